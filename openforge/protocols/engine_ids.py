"""Where each engine puts token ids and logprobs in an answer.

vLLM (and recent SGLang) answer `return_token_ids` with `prompt_token_ids` and per-choice `token_ids`;
SGLang also reports them under `sglext`; llama.cpp's server puts each token's `id` inside its logprobs entry.
On Responses, vLLM answers `enable_response_messages` with `input_messages` / `output_messages`.
"""

from __future__ import annotations

import json
import re
from typing import Any


def vllm_prompt_ids(body: dict[str, Any], choice: dict[str, Any]) -> Any:
    """vLLM's prompt ids: on the answer, or (some versions) on the choice."""
    return body.get("prompt_token_ids") or choice.get("prompt_token_ids")


def vllm_completion_ids(choice: dict[str, Any]) -> list[int]:
    return choice.get("token_ids") or []


def vllm_responses_ids(response: dict[str, Any]) -> tuple[list[int] | None, list[int] | None]:
    """(prompt ids, completion ids) of a vLLM Responses answer from `input_messages` / `output_messages`
    (`enable_response_messages`), else (None, None).

    Each holds one `raw_message_tokens` entry `{message, tokens}` when one generation made the answer;
    more entries (a server-side tool loop: several generations) or harmony messages (no `tokens`) are
    not one prompt and its completion.
    """
    prompt, completion = _raw_tokens(response.get("input_messages")), _raw_tokens(response.get("output_messages"))
    if prompt is None or completion is None:
        return None, None
    return prompt, completion


def _raw_tokens(messages: Any) -> list[int] | None:
    if not isinstance(messages, list) or len(messages) != 1 or not isinstance(messages[0], dict):
        return None
    entry = messages[0]
    tokens = entry.get("tokens")
    if entry.get("type") != "raw_message_tokens" or not isinstance(tokens, list) or not tokens:
        return None
    return tokens if all(isinstance(t, int) and not isinstance(t, bool) for t in tokens) else None


def sglang_ids(sglext: dict[str, Any]) -> tuple[Any, list[int]]:
    """(prompt ids, completion ids) from SGLang's `sglext` extension."""
    return sglext.get("input_ids"), sglext.get("output_ids") or []


def chat_logprobs(logprobs: Any) -> tuple[list[float], list[int | None]]:
    """(logprob, llama.cpp token id or None) of each entry of a Chat choice's `logprobs.content`."""
    content = (logprobs or {}).get("content") or []
    return [float(e.get("logprob", float("nan"))) for e in content], [e.get("id") for e in content]


def llamacpp_completion_ids(entry_ids: list[int | None], usage: dict[str, Any]) -> list[int]:
    """llama.cpp's completion ids: its logprob entries' ids when every entry has one and they are as many
    as the completion's tokens. It merges the entries of tokens that end mid-character (an emoji split over
    two tokens gets one entry), and then they are not the completion's ids."""
    if entry_ids and all(i is not None for i in entry_ids) and usage.get("completion_tokens") in (None, len(entry_ids)):
        return entry_ids  # type: ignore[return-value]
    return []


def llamacpp_has_ids(choice: dict[str, Any]) -> bool:
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    return bool(content) and isinstance(content[0], dict) and "id" in content[0]  # type: ignore[index]


def has_token_ids(obj: Any) -> bool:
    """Whether an engine answer (a JSON object or SSE chunk) carries token ids."""
    if not isinstance(obj, dict):
        return False
    if obj.get("prompt_token_ids") or obj.get("token_ids"):
        return True
    response = obj.get("response")  # a Responses stream event carries the answer there
    if vllm_responses_ids(response if isinstance(response, dict) else obj)[1] is not None:
        return True
    for choice in obj.get("choices") or ():
        if isinstance(choice, dict):
            if choice.get("token_ids") or choice.get("prompt_token_ids") or llamacpp_has_ids(choice):
                return True
    return False


# After a `token_ids"` key: a non-empty list. Quotes inside JSON strings are escaped, so `token_ids"`
# preceded by a quote (or by `"prompt_`) can only be a key.
_NON_EMPTY_LIST = re.compile(rb'\s*:\s*\[\s*\d')
_LOGPROBS_OBJECT = re.compile(rb'"logprobs"\s*:\s*\{')
_RAW_MESSAGE_TOKENS = b'"raw_message_tokens"'  # the type of vLLM's Responses `input_messages` entries


def body_has_token_ids(body: bytes | None) -> bool:
    """`has_token_ids` of a JSON answer, parsing it only for llama.cpp-style ids in logprobs or vLLM's
    Responses `output_messages`."""
    if not body:
        return False
    i = body.find(b'token_ids"')  # a plain search: a regex starting at every quote of the body is ~10x slower
    while i != -1:
        if (body[i - 1:i] == b'"' or body[max(0, i - 8):i] == b'"prompt_') and _NON_EMPTY_LIST.match(body, i + 10):
            return True
        i = body.find(b'token_ids"', i + 10)
    if (b'"id"' not in body or not _LOGPROBS_OBJECT.search(body)) and _RAW_MESSAGE_TOKENS not in body:
        return False  # a llama.cpp answer (ids in logprobs) skips the scan for Responses' raw tokens
    try:
        return has_token_ids(json.loads(body))
    except ValueError:
        return False


def stream_has_token_ids(chunks: list[list[Any]]) -> bool:
    """Scan a finished SSE stream (off the per-chunk path) for an event that carries token ids."""
    for line in b"".join(c[1] for c in chunks).split(b"\n"):
        if line.startswith(b"data:") and (b"token_ids" in line or b'"logprobs"' in line
                                          or _RAW_MESSAGE_TOKENS in line):
            if body_has_token_ids(line[5:].strip()):
                return True
    return False


_PROMPT_IDS_KEY = b'"prompt_token_ids"'
_SPACE_COLON = frozenset(b" \t\r\n:")


def prompt_ids_span(data: bytes) -> tuple[int, int] | None:
    """[start, end) of the one `"prompt_token_ids": [...]` array in an engine answer's JSON, found
    without parsing it; None when absent, present twice, empty, or not a flat array.

    vLLM returns every prompt id, tens of thousands for an agent's prompt, and parsing them is most of
    the work on such an answer: the proxy only drops them, reconstruct compares them as text first.
    A key's quotes are never escaped and a string's inner quotes always are, so these bytes cannot sit
    inside a string; an array with no `[`, `{` or `"` inside ends at the first `]`.
    """
    i = data.find(_PROMPT_IDS_KEY)
    if i < 0 or data.find(_PROMPT_IDS_KEY, i + 1) >= 0:
        return None
    j, n = i + len(_PROMPT_IDS_KEY), len(data)
    while j < n and data[j] in _SPACE_COLON:
        j += 1
    if j >= n or data[j] != 0x5B:  # "["
        return None
    end = data.find(b"]", j)
    if end < 0 or not data[j + 1:end].strip() or any(c in data[j + 1:end] for c in (b"[", b"{", b'"')):
        return None
    return j, end + 1


def cut_prompt_ids(data: bytes) -> tuple[bytes, bytes | None]:
    """(the answer with its prompt id array read as `[]`, the array's text), or (data, None) when
    `prompt_ids_span` finds none."""
    span = prompt_ids_span(data)
    if span is None:
        return data, None
    return data[:span[0]] + b"[]" + data[span[1]:], data[span[0]:span[1]]
