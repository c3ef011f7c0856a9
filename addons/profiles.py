"""Engine profiles: how to ask each engine for token ids and logprobs, and how to hide them from the client.

vLLM takes `return_token_ids` and `logprobs`; llama.cpp's server puts the token `id` inside each logprobs
entry; SGLang takes both fields (recent versions); a generic OpenAI-compatible server gives logprobs only
(where each puts them in the answer: `openforge.protocols.engine_ids`). On a Responses call forwarded
untranslated, vLLM takes `enable_response_messages` (ids, no logprobs: docs/engines.md).
What we add to a request, we remove from the answer, so the toolchain sees the response it asked for.

llama.cpp refuses `logprobs` on a streamed Chat call with tools (400), and its streamed tool-call answer
leaves out the ids of the tokens its tool-call parser holds back; the whole answer has them all. So such a
call goes to llama.cpp unstreamed (`unstream`) and the proxy streams the answer to the client (`restream`).
llama.cpp also renders a Chat request in its own normal form (function tools as name, description and
parameters only; a message's text parts joined by newlines): `normalize` sends it in that form, so the
recorded request is what the engine rendered and reconstruct renders the same prompt.
"""

from __future__ import annotations

import json
import math
import urllib.request
from typing import Any

from openforge.choices import Profile
from openforge.protocols.engine_ids import cut_prompt_ids, has_token_ids
from openforge.protocols.sse import split_complete


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
    for name in (Profile.vllm, Profile.sglang, Profile.llamacpp):
        if name in owners:
            return name
    if "llama.cpp" in server or "llamacpp" in owners or "llama.cpp" in owners:
        return "llamacpp"
    return "generic"


def inject(profile: str, protocol: str, body: dict[str, Any]) -> list[str]:
    """Ask for token ids / logprobs on a Chat, Completions or (vLLM) Responses body in place; return the
    fields injected."""
    injected: list[str] = []
    if protocol == "responses":
        if profile == Profile.vllm and not body.get("enable_response_messages"):
            body["enable_response_messages"] = True
            injected.append("enable_response_messages")
        return injected
    if protocol not in ("chat", "completions"):
        return injected
    if profile in (Profile.vllm, Profile.sglang) and not body.get("return_token_ids"):
        body["return_token_ids"] = True
        injected.append("return_token_ids")
    if protocol == "chat":
        if not body.get("logprobs"):
            body["logprobs"] = True
            injected.append("logprobs")
            if profile == Profile.llamacpp and body.get("top_logprobs") is None:
                body["top_logprobs"] = 1  # llama.cpp's default is 20 alternatives per token; 0 gives no logprobs
                injected.append("top_logprobs")
    elif body.get("logprobs") is None:
        body["logprobs"] = 1
        injected.append("logprobs")
    return injected


def normalize(profile: str, protocol: str, body: dict[str, Any]) -> list[str]:
    """For llama.cpp, rewrite a Chat body in place as the engine renders it; return the fields rewritten."""
    if profile != Profile.llamacpp or protocol != "chat":
        return []
    changed: list[str] = []
    tools = body.get("tools")
    if isinstance(tools, list):
        normal = [_llamacpp_tool(t) for t in tools]
        if normal != tools:
            body["tools"] = normal
            changed.append("tools")
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict):
                continue
            parts = message.get("content")
            if isinstance(parts, list) and parts and all(
                    isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
                message["content"] = "\n".join(p["text"] for p in parts)
                if "messages" not in changed:
                    changed.append("messages")
            if _llamacpp_tool_calls(message.get("tool_calls")) and "messages" not in changed:
                changed.append("messages")
    return changed


def _llamacpp_tool_calls(tool_calls: Any) -> bool:
    """Each tool call's `arguments` written, in place, as llama.cpp renders them; whether any changed.

    llama.cpp parses a tool call's arguments and its template renders the parsed value again (its own JSON
    writer: `", "` and `": "` between items, characters as they are, no `\\u` escapes, floats as C's `%g`),
    while a Hugging Face template renders the client's string as sent: `{"expression": "12 \\u00d7 7"}` or
    `{"x":1.0}` reach the model as `{"expression": "12 × 7"}` and `{"x": 1}`. Written so, the string is
    what both render. Arguments that are not a JSON object or array, or whose form would not survive
    llama.cpp's parse and render again, stay as they are (the prompt check then shows any drift).
    """
    changed = False
    for call in tool_calls if isinstance(tool_calls, list) else ():
        fn = call.get("function") if isinstance(call, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        if not isinstance(args, str):
            continue
        rendered = _rendered_arguments(args)
        if rendered is not None and rendered != args:
            fn["arguments"] = rendered  # type: ignore[index]
            changed = True
    return changed


def _rendered_arguments(args: str) -> str | None:
    """`args` as llama.cpp renders them, when that is a fixed point of its parse and render; else None."""
    try:
        value = json.loads(args)
        if not isinstance(value, dict | list):
            return None
        rendered = _minja_json(value)
        return rendered if _minja_json(json.loads(rendered)) == rendered else None
    except (ValueError, RecursionError):
        return None


_INT64_MIN, _UINT64_MAX = -(1 << 63), (1 << 64) - 1  # beyond these llama.cpp's JSON parser reads a double


def _minja_json(value: Any) -> str:
    """JSON text as llama.cpp's template engine (minja) writes a parsed value with `tojson`."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_minja_json(k)}: {_minja_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_minja_json(v) for v in value) + "]"
    if value is True or value is False or value is None:
        return json.dumps(value)
    if isinstance(value, int) and _INT64_MIN <= value <= _UINT64_MAX:
        return str(value)
    if isinstance(value, int | float):
        if not math.isfinite(value := float(value)):
            raise ValueError("not a finite number")
        return format(value, "g")
    return json.dumps(value, ensure_ascii=False)


def _llamacpp_tool(tool: Any) -> Any:
    """A function tool as llama.cpp renders it: `{type, function: {name, description, parameters}}`, the
    description "" and the parameters {} when absent, other fields (`strict`, ...) left out; any other tool
    unchanged."""
    fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        return tool
    return {"type": "function", "function": {"name": fn["name"], "description": fn.get("description") or "",
                                             "parameters": fn.get("parameters", {})}}


def unstream(profile: str, protocol: str, body: dict[str, Any]) -> bool:
    """Make a streamed llama.cpp Chat body with tools unstreamed, in place (the module's docstring says why);
    whether it did. The client still gets a stream (`addons/restream.py`)."""
    if profile != Profile.llamacpp or protocol != "chat" or body.get("stream") is not True or not body.get("tools"):
        return False
    body["stream"] = False
    body.pop("stream_options", None)
    return True


def strip(obj: Any, injected: list[str]) -> bool:
    """Remove, in place, what the injected fields added to one answer object or stream chunk (put back
    what the engine answers when not asked, where it answers something).

    Returns whether anything changed, so callers can pass unchanged bytes through without re-encoding.
    """
    if not isinstance(obj, dict):
        return False
    ids = "return_token_ids" in injected
    lps = "logprobs" in injected
    changed = "enable_response_messages" in injected and _strip_response_messages(obj)
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


def _strip_response_messages(obj: dict[str, Any]) -> bool:
    """Null vLLM's `input_messages` / `output_messages` on a Responses answer or on a stream event's
    `response`: unasked, vLLM answers them null."""
    response = obj.get("response")
    holder = response if isinstance(response, dict) else obj
    changed = False
    for key in ("input_messages", "output_messages"):
        if holder.get(key) is not None:
            holder[key] = None
            changed = True
    return changed


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
        (b'"logprobs"',) if "logprobs" in injected else ()) + (
        (b'_messages"',) if "enable_response_messages" in injected else ())


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
        complete, self.buf = split_complete(self.buf + data if self.buf else data)
        return self._rewrite(complete) if complete else b""

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
