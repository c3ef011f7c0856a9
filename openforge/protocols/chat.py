"""Chat Completions, the engine's protocol: the pieces a request in another protocol is rebuilt from, and
the engine's answer read back (`read_answer`, `ChatStream`) for rendering in another protocol."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, NamedTuple

from .errors import ProtocolError, engine_message
from .sse import Event, SseReader


class Drops:
    """Ordered set of field names that were accepted but have no Chat Completions meaning."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def add(self, name: str) -> None:
        if name not in self.names:
            self.names.append(name)

    def extra(self, obj: dict, consumed: set[str]) -> None:
        """Add every key of `obj` not in `consumed`."""
        for key in obj:
            if key not in consumed:
                self.add(key)


def begin(body: dict, messages: list[dict], tools: list[dict]) -> dict[str, Any]:
    """A Chat Completions body begun from a client's: its model, messages and tools, in that order."""
    chat: dict[str, Any] = {}
    if "model" in body:
        chat["model"] = body["model"]
    chat["messages"] = messages
    if tools:
        chat["tools"] = tools
    return chat


def text_content(parts: list[dict]) -> str | list[dict]:
    """All-text part lists become one string (stable prompts whether a client sends a string or a
    one-element list); anything with an image stays a list of Chat Completions parts."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def tool_call(call_id: Any, name: Any, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def function_tool(name: Any, description: Any, parameters: Any, strict: Any) -> dict:
    """A Chat Completions function tool; a tool without a name is refused (the engine would reject it)."""
    if not isinstance(name, str) or not name:
        raise ProtocolError(400, "every tool needs a non-empty string name")
    fn: dict[str, Any] = {"name": name}
    if description is not None:
        fn["description"] = description
    fn["parameters"] = parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}
    if strict is not None:
        fn["strict"] = strict
    return {"type": "function", "function": fn}


def unsupported_tool(name: Any, ttype: Any) -> ProtocolError:
    """The refusal of a server-side tool (web search, code execution, ...): the engine runs functions only."""
    return ProtocolError(
        400,
        f"tool {name!r} has type {ttype!r}; the engine only takes function tools "
        "(remove or disable that tool in the client)",
    )


class Generated(NamedTuple):
    """What one answer or stream event says the model generated: its text in order (reasoning, tool names and
    arguments included), the engine's token ids, and the output token count; None where it says nothing."""

    text: str
    token_ids: list[int] | None
    output_tokens: int | None


def generated(obj: dict[str, Any]) -> Generated:
    """A Chat or Completions answer or chunk (its first choice)."""
    text, ids = "", None
    for ch in (obj.get("choices") or [])[:1]:
        part = ch.get("delta") or ch.get("message") or {}
        text += ch.get("text") or part.get("content") or ""
        text += part.get("reasoning_content") or ""
        for tc in part.get("tool_calls") or []:
            fn = tc.get("function") or {}
            text += (fn.get("name") or "") + (fn.get("arguments") or "")
        if ch.get("token_ids") is not None:
            ids = list(ch["token_ids"])
    return Generated(text, ids, (obj.get("usage") or {}).get("completion_tokens"))


def new_id(prefix: str) -> str:
    """A fresh id in a client protocol's style (`toolu_...`, `call_...`) for what the engine left unnamed."""
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def cached_tokens(usage: dict) -> int:
    """Prompt tokens the engine read from its prefix cache."""
    return int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)


class Answer(NamedTuple):
    """A non-streamed Chat answer's first choice, as a client protocol renders it."""

    id: str
    reasoning: str
    text: str
    tool_calls: list[dict]
    finish_reason: str | None
    stop_reason: Any  # vLLM: the stop string (or token id) that ended the answer
    usage: dict
    created: float


def read_answer(chat_response: dict) -> Answer:
    """The first choice of a non-streamed Chat answer; raises ProtocolError (502) when there is none."""
    choices = chat_response.get("choices") or []
    if not choices:
        detail = engine_message(chat_response) or "engine error"
        raise ProtocolError(502, f"engine answer has no choices: {detail}")
    choice = choices[0]
    message = choice.get("message") or {}
    return Answer(
        id=chat_response.get("id") or uuid.uuid4().hex,
        reasoning=message.get("reasoning_content") or message.get("reasoning") or "",
        text=message.get("content") or "",
        tool_calls=message.get("tool_calls") or [],
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason"),
        usage=chat_response.get("usage") or {},
        created=chat_response.get("created") or time.time(),
    )


def sse_event(event: str, payload: dict) -> bytes:
    """One named server-sent event with a compact JSON payload (Anthropic and Responses streams)."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event}\ndata: {data}\n\n".encode()


def _payload(event: Event) -> Any:
    """An engine stream event as its JSON object, "[DONE]", or an `{"error": ...}` object (an `error:`
    field, or data that is not a JSON object)."""
    _, data, error = event
    is_error = error is not None
    text = "\n".join(p for p in (data, error) if p is not None) if is_error or data is None else data
    if text.strip() == "[DONE]":
        return "[DONE]"
    try:
        payload = json.loads(text)
    except ValueError:
        return {"error": {"message": f"engine sent an unreadable stream event: {text[:200]!r}"}}
    if is_error and isinstance(payload, dict) and "error" not in payload:
        payload = {"error": payload}
    return payload if isinstance(payload, dict) else {"error": {"message": f"unexpected event {text[:200]!r}"}}


class Block:
    """One open or finished output block: text, thinking, or a tool call."""

    def __init__(self, kind: str, index: int, call_id: str = "", name: str = "") -> None:
        self.kind, self.index, self.call_id, self.name = kind, index, call_id, name
        self.text = ""
        self.item_id = ""
        self.closed = False
        self.cut = False  # closed because the engine stream broke off


class _ToolCall:
    def __init__(self) -> None:
        self.call_id = ""
        self.name = ""
        self.pending = ""
        self.block: Block | None = None


class ChatStream:
    """Folds Chat Completions chunks into ordered blocks; a client protocol's subclass renders them.

    `feed(bytes) -> bytes` / `finish() -> bytes` turn engine SSE into client SSE. Blocks are opened one
    at a time (a new kind of delta closes the open block), which is how both client protocols stream.
    The final event waits for the usage chunk / [DONE] after finish_reason.
    """

    tool_id_prefix = "call_"

    def __init__(self, request_body: dict) -> None:
        self.request = request_body
        self._reader = SseReader()
        self._out: list[bytes] = []
        self.started = False
        self.ended = False
        self.chat_id = ""
        self.model = request_body.get("model")
        self.created = time.time()
        self.blocks: list[Block] = []
        self._open: Block | None = None
        self._tools: dict[int, _ToolCall] = {}
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.usage: dict | None = None
        self.prompt_tokens: int | None = None
        self._token_count = 0

    # -- public ---------------------------------------------------------------------------------------
    def feed(self, data: bytes) -> bytes:
        for event in self._reader.feed(data):
            self._handle(_payload(event))
        return self._take()

    def finish(self) -> bytes:
        for event in self._reader.flush():
            self._handle(_payload(event))
        if not self.ended:
            if self.finish_reason is not None:
                self._end()
            else:
                self._fail("engine stream ended before the answer was complete", closing=True)
        return self._take()

    # -- chunk folding --------------------------------------------------------------------------------
    def _take(self) -> bytes:
        out, self._out = b"".join(self._out), []
        return out

    def _handle(self, payload: Any) -> None:
        if self.ended:
            return
        if payload == "[DONE]":
            if self.finish_reason is not None:
                self._end()
            else:
                self._fail("engine stream ended without a finish reason", closing=True)
            return
        if payload.get("error") is not None or payload.get("object") == "error":
            self._fail(engine_message(payload) or "engine error", closing=False)
            return
        if not self.started:
            self.chat_id = payload.get("id") or uuid.uuid4().hex
            if payload.get("created"):
                self.created = payload["created"]
            if payload.get("prompt_token_ids") is not None:
                self.prompt_tokens = len(payload["prompt_token_ids"])
            if payload.get("usage"):
                self.usage = payload["usage"]
            self.started = True
            self._on_start()
        if payload.get("usage"):
            self.usage = payload["usage"]
        for choice in payload.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            self._choice(choice)

    def _choice(self, choice: dict) -> None:
        delta = choice.get("delta") or {}
        self._token_count += len(choice.get("token_ids") or [])
        if not choice.get("token_ids"):
            self._token_count += len(((choice.get("logprobs") or {}).get("content")) or [])
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if reasoning:
            self._delta("thinking", reasoning)
        if delta.get("content"):
            self._delta("text", delta["content"])
        for call in delta.get("tool_calls") or []:
            self._tool_delta(call)
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
            self.stop_reason = choice.get("stop_reason")
            for tool in self._tools.values():
                if tool.block is None:
                    self._open_tool(tool)
            self._close_open()

    def _delta(self, kind: str, text: str) -> None:
        if self._open is None or self._open.kind != kind:
            self._close_open()
            self._open = self._new_block(kind)
        self._open.text += text
        self._on_delta(self._open, text)

    def _tool_delta(self, call: dict) -> None:
        tool = self._tools.setdefault(int(call.get("index", 0)), _ToolCall())
        fn = call.get("function") or {}
        if call.get("id") and not tool.call_id:
            tool.call_id = call["id"]
        if fn.get("name") and not tool.name:
            tool.name = fn["name"]
        args = fn.get("arguments") or ""
        if tool.block is None:
            tool.pending += args
            if tool.name:
                self._open_tool(tool)
        elif args:
            tool.block.text += args
            self._on_delta(tool.block, args)  # late deltas of an earlier call keep that call's index

    def _open_tool(self, tool: _ToolCall) -> None:
        self._close_open()
        block = self._new_block("tool", tool.call_id or new_id(self.tool_id_prefix), tool.name)
        tool.block, self._open = block, block
        if tool.pending:
            block.text, tool.pending = tool.pending, ""
            self._on_delta(block, block.text)

    def _new_block(self, kind: str, call_id: str = "", name: str = "") -> Block:
        block = Block(kind, len(self.blocks), call_id, name)
        self.blocks.append(block)
        self._on_open(block)
        return block

    def _close_open(self) -> None:
        if self._open is not None and not self._open.closed:
            self._open.closed = True
            self._on_close(self._open)
        self._open = None

    def _end(self) -> None:
        self._close_open()
        self.ended = True
        self._on_end()

    def _fail(self, message: str, closing: bool) -> None:
        if closing:
            if self._open is not None:
                self._open.cut = True
            self._close_open()
        self.ended = True
        self._on_fail(message)

    def final_usage(self) -> dict:
        """Engine usage, or counts from streamed token ids when the engine sent none."""
        if self.usage:
            return self.usage
        prompt = self.prompt_tokens or 0
        return {"prompt_tokens": prompt, "completion_tokens": self._token_count,
                "total_tokens": prompt + self._token_count}

    # -- rendering hooks ------------------------------------------------------------------------------
    def _on_start(self) -> None: ...
    def _on_open(self, block: Block) -> None: ...
    def _on_delta(self, block: Block, text: str) -> None: ...
    def _on_close(self, block: Block) -> None: ...
    def _on_end(self) -> None: ...
    def _on_fail(self, message: str) -> None: ...
