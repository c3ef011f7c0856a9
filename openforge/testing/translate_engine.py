"""Engine-side Chat Completions streams for the translation tests, shaped like vLLM's and llama.cpp's.

vLLM (return_token_ids + logprobs): `prompt_token_ids` on the first chunk, per-chunk `token_ids`,
`logprobs`, `stop_reason` on the choice, a usage-only chunk before `[DONE]`. llama.cpp: no token_ids,
token `id`s inside `logprobs.content`, `timings` on the last chunk. Those engine-only fields must never
reach the client.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SUPPORT = Path(__file__).parent
ENGINE_ONLY_FIELDS = ("token_ids", "prompt_token_ids", "timings", "system_fingerprint", "token_id:")


def load_request(name: str) -> dict:
    return json.loads((SUPPORT / f"translate_{name}_request.json").read_text())


def _ids(text: str) -> list[int]:
    return [b + 3 for b in text.encode()]


def vllm_chunks(deltas: list[dict], finish: str, *, prompt_tokens: int = 40, cached: int = 16,
                usage: bool = True, stop_reason: Any = None, chat_id: str = "chatcmpl-7f3a",
                logprobs: bool = True) -> list[dict]:
    """One chunk per delta (content / reasoning_content / tool_calls), then finish, then usage."""
    base = {"id": chat_id, "object": "chat.completion.chunk", "created": 1760000000, "model": "local-model"}
    chunks: list[dict] = [{**base, "prompt_token_ids": list(range(prompt_tokens)),
                           "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None, "token_ids": []}]}]
    completion = 0
    for delta in deltas:
        text = delta.get("content") or delta.get("reasoning_content") or json.dumps(delta.get("tool_calls"))
        ids = _ids(text)[:3] or [7]
        completion += len(ids)
        entries: list[dict[str, Any]] = [
            {"token": f"token_id:{i}", "logprob": -0.25, "bytes": None, "top_logprobs": []} for i in ids]
        lp: dict[str, Any] | None = {"content": entries} if logprobs else None
        chunks.append({**base, "choices": [{"index": 0, "delta": delta, "logprobs": lp,
                                            "finish_reason": None, "token_ids": ids}]})
    chunks.append({**base, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish,
                                        "stop_reason": stop_reason, "token_ids": [2]}]})
    completion += 1
    if usage:
        chunks.append({**base, "choices": [], "usage": {
            "prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"reasoning_tokens": 0}}})
    return chunks


def tool_call_deltas(index: int, call_id: str, name: str, arguments: str, pieces: int = 3) -> list[dict]:
    """A tool call streamed the way vLLM's tool parsers do: id + name first, then argument fragments."""
    first = {"tool_calls": [{"index": index, "id": call_id, "type": "function",
                             "function": {"name": name, "arguments": ""}}]}
    step = max(1, len(arguments) // pieces)
    rest = [{"tool_calls": [{"index": index, "function": {"arguments": arguments[i:i + step]}}]}
            for i in range(0, len(arguments), step)]
    return [first, *rest]


def llamacpp_chunks(text: str, finish: str = "stop") -> list[dict]:
    """llama.cpp server style: token ids inside logprobs.content, timings and usage on the last chunk."""
    base = {"id": "chatcmpl-llama", "object": "chat.completion.chunk", "created": 1760000000,
            "model": "smollm2", "system_fingerprint": "b6000-abc"}
    chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": None},
                                    "finish_reason": None}]}]
    for i, word in enumerate(text.split(" ")):
        piece = word if i == 0 else " " + word
        chunks.append({**base, "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None,
                                            "logprobs": {"content": [{"id": 100 + i, "token": piece,
                                                                      "bytes": list(piece.encode()),
                                                                      "logprob": -0.5, "top_logprobs": []}]}}]})
    n = len(text.split(" "))
    chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}],
                   "usage": {"prompt_tokens": 12, "completion_tokens": n, "total_tokens": 12 + n},
                   "timings": {"prompt_n": 12, "predicted_n": n}})
    return chunks


def sse(chunks: list[dict], done: bool = True) -> bytes:
    body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    return body + (b"data: [DONE]\n\n" if done else b"")


def parse_sse(data: bytes) -> list[tuple[str, dict]]:
    """Client-side view of a translated stream: (event name, JSON payload) pairs."""
    events = []
    for block in data.decode().split("\n\n"):
        if not block.strip():
            continue
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((fields["event"], json.loads(fields["data"])))
    return events


def translate_all(translator: Any, data: bytes, sizes: list[int] | None = None) -> bytes:
    """Feed `data` in pieces (sizes cycle; default all at once) and return everything the translator sent."""
    out, pos, k = [], 0, 0
    sizes = sizes or [len(data) or 1]
    while pos < len(data):
        step = sizes[k % len(sizes)]
        out.append(translator.feed(data[pos:pos + step]))
        pos, k = pos + step, k + 1
    out.append(translator.finish())
    return b"".join(out)
