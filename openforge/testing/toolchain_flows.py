"""Hand-made flow records (format v1) for replay tests: the shapes the proxy writes, built in code."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any, cast

from openforge.addons.flowfile import FlowRecord, FlowWriter

JSON = [["content-type", "application/json"]]
SSE = [["content-type", "text/event-stream"]]


def sse(events: list[Any], done: bool = True) -> list[bytes]:
    out = [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events]
    return out + ([b"data: [DONE]\n\n"] if done else [])


def chat_stream_events(text: str, token_ids: list[int] | None = None, tool: dict | None = None) -> list[Any]:
    """OpenAI chat chunks for `text` (one per word), vLLM-style token ids when given, usage last."""
    events: list[Any] = []
    words = text.split(" ") if text else []
    for i, w in enumerate(words):
        choice: dict[str, Any] = {"index": 0, "delta": {"content": w + (" " if i < len(words) - 1 else "")}}
        if token_ids is not None:
            choice["token_ids"] = token_ids[i : i + 1] if i < len(words) - 1 else token_ids[i:]
        events.append({"id": "c1", "object": "chat.completion.chunk", "choices": [choice]})
    if tool:
        choice = {"index": 0, "delta": {"tool_calls": [{"index": 0, "id": tool["id"], "type": "function",
                  "function": {"name": tool["name"], "arguments": tool["arguments"]}}]}}
        if token_ids is not None and not words:
            choice["token_ids"] = token_ids
        events.append({"id": "c1", "object": "chat.completion.chunk", "choices": [choice]})
    events.append({"id": "c1", "object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls" if tool else "stop"}]})
    events.append({"id": "c1", "object": "chat.completion.chunk", "choices": [],
                   "usage": {"prompt_tokens": 10, "completion_tokens": len(token_ids or words), "total_tokens": 10}})
    return events


def exchange(
    body: dict[str, Any],
    *,
    path: str = "/v1/chat/completions",
    episode: str | None = "ep1",
    chunks: list[bytes] | None = None,
    response_body: Any = None,
    injected: list[str] | None = None,
    t_start: float = 1000.0,
    gap: float = 0.01,
    client_response: dict[str, Any] | None = None,
    protocol: str = "chat",
) -> dict[str, Any]:
    """One complete exchange record; the upstream request carries the injected fields."""
    up_body = dict(body)
    for name in injected or []:
        up_body[name] = True
    if chunks is not None:
        response = {"status": 200, "headers": SSE, "body": None, "streamed": True,
                    "chunks": [[t_start + gap * (i + 1), c] for i, c in enumerate(chunks)]}
        t_end = t_start + gap * (len(chunks) + 1)
    else:
        response = {"status": 200, "headers": JSON, "body": json.dumps(response_body).encode(),
                    "streamed": False, "chunks": None}
        t_end = t_start + gap
    client_path = f"/e/{episode}{path}" if episode else path
    return {
        "type": "exchange", "id": uuid.uuid4().hex, "proxy": "testprox", "seq": 0,
        "t_start": t_start, "t_first_byte": t_start + gap, "t_end": t_end, "complete": True,
        "episode": episode, "episode_source": "path" if episode else None, "role": "agent",
        "toolchain": "openai-python", "protocol": protocol, "model": body.get("model"),
        "upstream_model": body.get("model"), "engine_profile": "vllm",
        "client_request": {"method": "POST", "url": f"http://127.0.0.1:1{client_path}",
                           "headers": [["content-type", "application/json"], ["authorization", "Bear…mmy1"]],
                           "body": json.dumps(body).encode()},
        "upstream_request": {"method": "POST", "url": f"http://127.0.0.1:2{path}",
                             "headers": [["content-type", "application/json"]],
                             "body": json.dumps(up_body).encode()},
        "response": response, "client_response": client_response, "injected": injected or [],
        "translated": None, "has_token_ids": bool(injected), "error": None,
    }


def write_trace(directory: Path, records: list[dict[str, Any]]) -> Path:
    for seq, r in enumerate(records, 1):
        r["seq"] = seq
    w = FlowWriter(directory, "testprox")
    for r in records:
        w.write(cast(FlowRecord, r))  # built as plain dicts in the flow format
    w.close()
    return directory
