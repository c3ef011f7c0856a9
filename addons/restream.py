"""A whole Chat Completions answer as the Chat Completions stream a client asked for.

Why: a streamed llama.cpp call with tools goes to the engine unstreamed (`profiles.unstream`: only the
whole answer carries every token id). The client asked for a stream and gets one: these events, sent at
once when the answer is complete, or for a translated call fed through the Anthropic / Responses stream
translator (`translate.stream_translator`). Stdlib only, like the rest of the addon's protocol code.
"""

from __future__ import annotations

from typing import Any

from .profiles import encode_json


def chat_events(answer: dict[str, Any], include_usage: bool) -> bytes:
    """SSE `data:` events of a Chat answer: per choice its role, reasoning, text (with the choice's logprobs,
    if the answer has them) and tool calls, then its finish reason; the usage event if asked; `[DONE]`."""
    head = {"id": answer.get("id") or "", "object": "chat.completion.chunk", "created": answer.get("created") or 0,
            "model": answer.get("model")}
    if answer.get("system_fingerprint") is not None:
        head["system_fingerprint"] = answer["system_fingerprint"]
    events: list[dict[str, Any]] = []

    def chunk(index: int, delta: dict[str, Any], finish: Any = None, **extra: Any) -> None:
        events.append({**head, "choices": [{"index": index, "delta": delta, "finish_reason": finish, **extra}]})

    for choice in answer.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        index = choice.get("index", 0)
        message = choice.get("message") or {}
        chunk(index, {"role": message.get("role") or "assistant", "content": ""})
        for key in ("reasoning_content", "reasoning"):
            if message.get(key):
                chunk(index, {key: message[key]})
        logprobs = choice.get("logprobs")
        if message.get("content") or logprobs is not None:
            chunk(index, {"content": message.get("content") or ""}, logprobs=logprobs)
        calls = [c for c in message.get("tool_calls") or () if isinstance(c, dict)]
        if calls:
            chunk(index, {"tool_calls": [{**call, "index": k} for k, call in enumerate(calls)]})
        chunk(index, {}, choice.get("finish_reason"))
    if include_usage and answer.get("usage") is not None:
        events.append({**head, "choices": [], "usage": answer["usage"]})
    return b"".join(b"data: " + encode_json(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
