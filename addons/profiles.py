"""Engine profiles: how to ask each engine for token ids and logprobs, and how to hide them from the client.

vLLM takes `return_token_ids` and `logprobs`; llama.cpp's server puts the token `id` inside each logprobs
entry; SGLang takes both fields (recent versions); a generic OpenAI-compatible server gives logprobs only.
What we add to a request, we remove from the answer, so the toolchain sees the response it asked for.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any


def detect(models_url: str, key: str, timeout: float = 3.0) -> str | None:
    """Profile from the engine's GET /v1/models (`owned_by`) or `Server` header; None if unreachable."""
    req = urllib.request.Request(models_url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            server = (resp.headers.get("server") or "").lower()
            data = json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        server, data = (e.headers.get("server") or "").lower(), {}
    except (OSError, ValueError):
        return None
    owners = {str(m.get("owned_by", "")).lower() for m in data.get("data") or [] if isinstance(m, dict)}
    for name in ("vllm", "sglang", "llamacpp"):
        if name in owners:
            return name
    if "llama.cpp" in server or "llamacpp" in owners or "llama.cpp" in owners:
        return "llamacpp"
    return "generic"


def inject(profile: str, protocol: str, body: dict[str, Any]) -> list[str]:
    """Ask for token ids / logprobs on a Chat or Completions body in place; return the fields injected."""
    injected: list[str] = []
    if protocol not in ("chat", "completions"):
        return injected
    if profile in ("vllm", "sglang") and not body.get("return_token_ids"):
        body["return_token_ids"] = True
        injected.append("return_token_ids")
    if protocol == "chat":
        if not body.get("logprobs"):
            body["logprobs"] = True
            injected.append("logprobs")
    elif body.get("logprobs") is None:
        body["logprobs"] = 1
        injected.append("logprobs")
    return injected


def has_token_ids(obj: Any) -> bool:
    """Whether an engine answer (a JSON object or SSE chunk) carries token ids."""
    if not isinstance(obj, dict):
        return False
    if obj.get("prompt_token_ids") or obj.get("token_ids"):
        return True
    for choice in obj.get("choices") or ():
        if isinstance(choice, dict):
            if choice.get("token_ids") or choice.get("prompt_token_ids"):
                return True
            content = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
            if content and isinstance(content[0], dict) and "id" in content[0]:
                return True
    return False


def strip(obj: Any, injected: list[str]) -> bool:
    """Remove, in place, what the injected fields added to one answer object or stream chunk.

    Returns whether anything changed, so callers can pass unchanged bytes through without re-encoding.
    """
    if not isinstance(obj, dict):
        return False
    ids = "return_token_ids" in injected
    lps = "logprobs" in injected
    changed = False
    if ids and "prompt_token_ids" in obj:
        del obj["prompt_token_ids"]
        changed = True
    for choice in obj.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if ids and ("token_ids" in choice or "prompt_token_ids" in choice):
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
            changed = True
        if lps and choice.get("logprobs") is not None:
            choice["logprobs"] = None
            changed = True
    return changed


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


def loads_without_prompt_ids(data: bytes) -> tuple[Any, bool]:
    """`json.loads` of an answer with its prompt id array read as `[]`, and whether one was there:
    parses what is left, for an answer whose prompt ids will be dropped."""
    rest, ids = cut_prompt_ids(data)
    return loads(rest), ids is not None


def loads(data: bytes) -> Any:
    """`json.loads` of an engine's answer; bytes that are not UTF-8 read as U+FFFD, so the fields we asked
    for are still found and removed (the record keeps the bytes as received)."""
    try:
        return json.loads(data)
    except UnicodeDecodeError:
        return json.loads(data.decode("utf-8", "replace"))


def markers(injected: list[str]) -> tuple[bytes, ...]:
    """Byte strings one of which must occur in an answer for `strip` to have anything to remove."""
    return ((b"token_ids",) if "return_token_ids" in injected else ()) + (
        (b'"logprobs"',) if "logprobs" in injected else ())


# One encoder for every re-encoded body or event: json.dumps with non-default arguments builds a new one per call.
# ASCII output (non-ASCII as \u escapes, the same JSON): the C encoder's fast path, which ensure_ascii=False
# leaves on any non-ASCII character; and a client's lone surrogate still encodes.
encode_json = json.JSONEncoder(separators=(",", ":")).encode


class SseStripper:
    """Rewrites an SSE byte stream event by event, removing injected fields; holds back partial events.

    Fed each network read; `feed(b"")` flushes whatever is left. Only `data:` lines that contain an
    injected field's name are parsed (a bytes check first), and only those that `strip` changes are
    re-encoded; every other byte passes through unchanged.
    """

    __slots__ = ("injected", "markers", "drop_ids", "buf", "saw_ids")

    def __init__(self, injected: list[str]) -> None:
        self.injected = injected
        self.markers = markers(injected)
        self.drop_ids = "return_token_ids" in injected
        self.buf = b""
        self.saw_ids = False

    def feed(self, data: bytes) -> bytes:
        if not data:
            out, self.buf = self.buf, b""
            return self._rewrite(out) if out else b""
        buf = self.buf + data if self.buf else data
        lf, crlf = buf.rfind(b"\n\n"), buf.rfind(b"\r\n\r\n")
        if lf < 0 and crlf < 0:  # no complete event yet
            self.buf = buf
            return b""
        end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        self.buf = buf[end:]
        return self._rewrite(buf[:end])

    def drain(self) -> bytes:
        """The held-back bytes, unchanged (used when giving up on rewriting)."""
        out, self.buf = self.buf, b""
        return out

    def _rewrite(self, block: bytes) -> bytes:
        marks = self.markers
        if not any(m in block for m in marks):
            return block
        lines = block.split(b"\n")
        for i, line in enumerate(lines):
            if not line.startswith(b"data:") or not any(m in line for m in marks):
                continue
            cr = line.endswith(b"\r")
            data = line[5:-1] if cr else line[5:]
            obj, cut = loads_without_prompt_ids(data) if self.drop_ids else (loads(data), False)
            if not self.saw_ids and (cut or has_token_ids(obj)):
                self.saw_ids = True
            if strip(obj, self.injected):
                new = b"data: " + encode_json(obj).encode()
                lines[i] = new + b"\r" if cr else new
        return b"\n".join(lines)
