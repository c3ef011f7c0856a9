"""Protocol translation: Anthropic Messages / OpenAI Responses <-> OpenAI Chat Completions.

Why: engines return exact token ids only on Chat Completions (docs/engines.md), while Claude Code speaks
Anthropic Messages and Codex speaks Responses. The addon sends those calls to the engine as Chat
Completions and translates the answer back, streamed as the engine produces it. A request is read by
`openforge.protocols` (the same conversion reconstruct trains on); this module renders the engine's
answer in the client's protocol. Everything here is pure and stdlib-only so it runs inside any
mitmproxy >= 11 (Python 3.11 / 3.12).

Public interface (wired in by addons/proxy.py): `request_to_chat`, `stream_translator`,
`response_from_chat`, `error_body`, `count_tokens_request`, `count_tokens_response`,
`needs_translation`, `TranslationError`.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from typing import Any

from openforge.protocols import anthropic, errors, responses
from openforge.protocols.chat import Drops
from openforge.protocols.errors import ProtocolError as TranslationError
from openforge.protocols.sse import Event, SseReader

CLIENT_PROTOCOLS = ("anthropic", "responses")
TRANSLATE_MODES = ("never", "auto", "always")

# Client protocols on which each engine profile returns exact token ids and logprobs natively. Empty
# everywhere today (docs/engines.md): vLLM's Responses gives ids (`enable_response_messages`, injected when
# not translated) but no logprobs for a streamed or tool-calling answer, so auto still translates it.
_TOKEN_IDS_NATIVE: dict[str, frozenset[str]] = {
    "vllm": frozenset(),
    "sglang": frozenset(),
    "llamacpp": frozenset(),
    "generic": frozenset(),
}


def needs_translation(protocol: str, engine_profile: str, mode: str) -> bool:
    """Whether a call on `protocol` should go to the engine as Chat Completions.

    auto translates whenever the profile cannot return token ids on that protocol (an unknown profile
    is assumed unable to).
    """
    if mode not in TRANSLATE_MODES:
        raise ValueError(f"translate mode must be one of {', '.join(TRANSLATE_MODES)}, got {mode!r}")
    if protocol not in CLIENT_PROTOCOLS or mode == "never":
        return False
    if mode == "always":
        return True
    return protocol not in _TOKEN_IDS_NATIVE.get(engine_profile, frozenset())


def request_to_chat(protocol: str, body: dict) -> tuple[dict, list[str]]:
    """Translate a client request body into a Chat Completions body; also return the dropped field names."""
    if not isinstance(body, dict):
        raise TranslationError(400, "request body must be a JSON object")
    drops = Drops()
    if protocol == "anthropic":
        chat = anthropic.request(body, drops)
    elif protocol == "responses":
        chat = responses.request(body, drops)
    else:
        raise ValueError(f"no request translation for protocol {protocol!r}")
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat, drops.names


# ----------------------------------------------------------------------------------------------------
# Shared answer helpers
# ----------------------------------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def _signature(thinking: str) -> str:
    """Stand-in for Anthropic's opaque thinking signature: stable, so an echoed block is recognisable."""
    return "openforge-" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


def _cached(usage: dict) -> int:
    return int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)


def _anthropic_usage(usage: dict) -> dict:
    prompt, cached = int(usage.get("prompt_tokens") or 0), _cached(usage)
    return {
        "input_tokens": prompt - cached,  # Anthropic counts cache reads separately from input
        "output_tokens": int(usage.get("completion_tokens") or 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _responses_usage(usage: dict) -> dict:
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    reasoning = int(((usage.get("completion_tokens_details") or {}).get("reasoning_tokens")) or 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": _cached(usage)},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": int(usage.get("total_tokens") or prompt + completion),
    }


def _anthropic_stop(finish: str | None, stop_reason: Any, has_tools: bool, request: dict) -> tuple[str, str | None]:
    """Chat finish_reason (+ vLLM's matched `stop_reason`) -> Anthropic (stop_reason, stop_sequence)."""
    if finish in ("tool_calls", "function_call") or (has_tools and finish == "stop"):
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if finish == "content_filter":
        return "refusal", None
    if isinstance(stop_reason, str) and stop_reason in (request.get("stop_sequences") or []):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _responses_status(finish: str | None) -> tuple[str, dict | None]:
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def _response_object(request: dict, rid: str, created: float, model: Any, status: str, output: list,
                     usage: dict | None, error: dict | None = None, incomplete: dict | None = None) -> dict:
    """A Responses `response` object echoing the request's settings, as the real API does."""
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": incomplete,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "metadata": request.get("metadata") or {},
        "model": model,
        "output": output,
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": request.get("reasoning"),
        "temperature": request.get("temperature"),
        "text": request.get("text") or {"format": {"type": "text"}},
        "tool_choice": request.get("tool_choice", "auto"),
        "tools": request.get("tools") or [],
        "top_p": request.get("top_p"),
        "truncation": "disabled",
        "usage": usage,
    }


def _message_item(item_id: str, text: str, status: str) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _function_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


# ----------------------------------------------------------------------------------------------------
# Non-streaming answers
# ----------------------------------------------------------------------------------------------------


def response_from_chat(protocol: str, chat_response: dict, request_body: dict) -> dict:
    """Translate a non-streaming Chat Completions answer into the client's protocol."""
    choices = chat_response.get("choices") or []
    if not choices:
        detail = errors.engine_message(chat_response) or "engine error"
        raise TranslationError(502, f"engine answer has no choices: {detail}")
    choice = choices[0]
    message = choice.get("message") or {}
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    text = message.get("content") or ""
    calls = message.get("tool_calls") or []
    usage = chat_response.get("usage") or {}
    model = request_body.get("model", chat_response.get("model"))
    base_id = chat_response.get("id") or uuid.uuid4().hex
    if protocol == "anthropic":
        content: list[dict] = []
        if reasoning:
            content.append({"type": "thinking", "thinking": reasoning, "signature": _signature(reasoning)})
        if text:
            content.append({"type": "text", "text": text})
        for call in calls:
            fn = call.get("function") or {}
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except ValueError:
                args = None
            content.append({"type": "tool_use", "id": call.get("id") or _new_id("toolu_"), "name": fn.get("name"),
                            "input": args if isinstance(args, dict) else {}})
        stop, sequence = _anthropic_stop(choice.get("finish_reason"), choice.get("stop_reason"), bool(calls),
                                         request_body)
        return {"id": f"msg_{base_id}", "type": "message", "role": "assistant", "model": model,
                "content": content, "stop_reason": stop, "stop_sequence": sequence,
                "usage": _anthropic_usage(usage)}
    if protocol == "responses":
        status, incomplete = _responses_status(choice.get("finish_reason"))
        output: list[dict] = []
        if reasoning:
            output.append(_reasoning_item(f"rs_{base_id}", reasoning, "completed"))
        if text:
            output.append(_message_item(f"msg_{base_id}", text, "completed"))
        for k, call in enumerate(calls):
            fn = call.get("function") or {}
            output.append(_function_item(f"fc_{base_id}_{k}", call.get("id") or _new_id("call_"),
                                         fn.get("name") or "", fn.get("arguments") or "", "completed"))
        created = chat_response.get("created") or time.time()
        return _response_object(request_body, f"resp_{base_id}", created, model, status, output,
                                _responses_usage(usage), incomplete=incomplete)
    raise ValueError(f"no answer translation for protocol {protocol!r}")


# ----------------------------------------------------------------------------------------------------
# Streaming answers
# ----------------------------------------------------------------------------------------------------



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


class _Block:
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
        self.block: _Block | None = None


class _ChatStreamTranslator:
    """Folds Chat Completions chunks into ordered blocks; subclasses render them in a client protocol.

    Blocks are opened one at a time (a new kind of delta closes the open block), which is how both
    client protocols stream. The final event waits for the usage chunk / [DONE] after finish_reason.
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
        self.blocks: list[_Block] = []
        self._open: _Block | None = None
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
            self._fail(errors.engine_message(payload) or "engine error", closing=False)
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
        block = self._new_block("tool", tool.call_id or _new_id(self.tool_id_prefix), tool.name)
        tool.block, self._open = block, block
        if tool.pending:
            block.text, tool.pending = tool.pending, ""
            self._on_delta(block, block.text)

    def _new_block(self, kind: str, call_id: str = "", name: str = "") -> _Block:
        block = _Block(kind, len(self.blocks), call_id, name)
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

    def _final_usage(self) -> dict:
        """Engine usage, or counts from streamed token ids when the engine sent none."""
        if self.usage:
            return self.usage
        prompt = self.prompt_tokens or 0
        return {"prompt_tokens": prompt, "completion_tokens": self._token_count,
                "total_tokens": prompt + self._token_count}

    # -- rendering hooks ------------------------------------------------------------------------------
    def _on_start(self) -> None: ...
    def _on_open(self, block: _Block) -> None: ...
    def _on_delta(self, block: _Block, text: str) -> None: ...
    def _on_close(self, block: _Block) -> None: ...
    def _on_end(self) -> None: ...
    def _on_fail(self, message: str) -> None: ...


def _sse(event: str, payload: dict) -> bytes:
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event}\ndata: {data}\n\n".encode()


class AnthropicStream(_ChatStreamTranslator):
    """Chat Completions SSE -> Anthropic Messages SSE."""

    tool_id_prefix = "toolu_"

    def _emit(self, payload: dict) -> None:
        self._out.append(_sse(payload["type"], payload))

    def _on_start(self) -> None:
        usage = _anthropic_usage(self.usage or {"prompt_tokens": self.prompt_tokens or 0})
        usage["output_tokens"] = 0
        self._emit({"type": "message_start", "message": {
            "id": f"msg_{self.chat_id}", "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}})

    def _on_open(self, block: _Block) -> None:
        if block.kind == "text":
            content: dict = {"type": "text", "text": ""}
        elif block.kind == "thinking":
            content = {"type": "thinking", "thinking": "", "signature": ""}
        else:
            content = {"type": "tool_use", "id": block.call_id, "name": block.name, "input": {}}
        self._emit({"type": "content_block_start", "index": block.index, "content_block": content})

    def _on_delta(self, block: _Block, text: str) -> None:
        if block.kind == "text":
            delta = {"type": "text_delta", "text": text}
        elif block.kind == "thinking":
            delta = {"type": "thinking_delta", "thinking": text}
        else:
            delta = {"type": "input_json_delta", "partial_json": text}
        self._emit({"type": "content_block_delta", "index": block.index, "delta": delta})

    def _on_close(self, block: _Block) -> None:
        if block.kind == "thinking":
            self._emit({"type": "content_block_delta", "index": block.index,
                        "delta": {"type": "signature_delta", "signature": _signature(block.text)}})
        self._emit({"type": "content_block_stop", "index": block.index})

    def _on_end(self) -> None:
        has_tools = any(b.kind == "tool" for b in self.blocks)
        stop, sequence = _anthropic_stop(self.finish_reason, self.stop_reason, has_tools, self.request)
        self._emit({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": sequence},
                    "usage": _anthropic_usage(self._final_usage())})
        self._emit({"type": "message_stop"})

    def _on_fail(self, message: str) -> None:
        self._emit({"type": "error", "error": {"type": "api_error", "message": message}})


class ResponsesStream(_ChatStreamTranslator):
    """Chat Completions SSE -> OpenAI Responses SSE (with monotonically increasing sequence numbers)."""

    def __init__(self, request_body: dict) -> None:
        super().__init__(request_body)
        self._seq = 0

    def _emit(self, payload: dict) -> None:
        payload["sequence_number"] = self._seq
        self._seq += 1
        self._out.append(_sse(payload["type"], payload))

    def _response(self, status: str, output: list, usage: dict | None = None, error: dict | None = None,
                  incomplete: dict | None = None) -> dict:
        return _response_object(self.request, f"resp_{self.chat_id}", self.created, self.model, status, output,
                                usage, error, incomplete)

    def _item(self, block: _Block, status: str) -> dict:
        if block.kind == "text":
            return _message_item(block.item_id, block.text, status)
        if block.kind == "thinking":
            return _reasoning_item(block.item_id, block.text, status)
        return _function_item(block.item_id, block.call_id, block.name, block.text, status)

    def _on_start(self) -> None:
        self._emit({"type": "response.created", "response": self._response("in_progress", [])})
        self._emit({"type": "response.in_progress", "response": self._response("in_progress", [])})

    def _on_open(self, block: _Block) -> None:
        prefix = {"text": "msg", "thinking": "rs", "tool": "fc"}[block.kind]
        block.item_id = f"{prefix}_{self.chat_id}_{block.index}"
        item = self._item(block, "in_progress")
        if block.kind != "tool":
            item["content"] = []
        self._emit({"type": "response.output_item.added", "output_index": block.index, "item": item})
        if block.kind == "text":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        elif block.kind == "thinking":
            part = {"type": "reasoning_text", "text": ""}
        else:
            return
        self._emit({"type": "response.content_part.added", "item_id": block.item_id,
                    "output_index": block.index, "content_index": 0, "part": part})

    def _on_delta(self, block: _Block, text: str) -> None:
        ids = {"item_id": block.item_id, "output_index": block.index}
        if block.kind == "text":
            self._emit({"type": "response.output_text.delta", **ids, "content_index": 0, "delta": text,
                        "logprobs": []})
        elif block.kind == "thinking":
            self._emit({"type": "response.reasoning_text.delta", **ids, "content_index": 0, "delta": text})
        else:
            self._emit({"type": "response.function_call_arguments.delta", **ids, "delta": text})

    def _on_close(self, block: _Block) -> None:
        ids = {"item_id": block.item_id, "output_index": block.index}
        item = self._item(block, "incomplete" if block.cut else "completed")
        if block.kind == "tool":
            self._emit({"type": "response.function_call_arguments.done", **ids, "name": block.name,
                        "arguments": block.text})
        else:
            if block.kind == "text":
                self._emit({"type": "response.output_text.done", **ids, "content_index": 0, "text": block.text,
                            "logprobs": []})
            else:
                self._emit({"type": "response.reasoning_text.done", **ids, "content_index": 0,
                            "text": block.text})
            self._emit({"type": "response.content_part.done", **ids, "content_index": 0,
                        "part": item["content"][0]})
        self._emit({"type": "response.output_item.done", "output_index": block.index, "item": item})

    def _on_end(self) -> None:
        status, incomplete = _responses_status(self.finish_reason)
        output = [self._item(b, "completed") for b in self.blocks]
        response = self._response(status, output, _responses_usage(self._final_usage()), incomplete=incomplete)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        self._emit({"type": kind, "response": response})

    def _on_fail(self, message: str) -> None:
        if not self.started:
            self.chat_id = self.chat_id or uuid.uuid4().hex
            self.started = True
            self._on_start()
        output = [self._item(b, "incomplete" if b.cut or not b.closed else "completed") for b in self.blocks]
        self._emit({"type": "response.failed", "response": self._response(
            "failed", output, None, error={"code": "server_error", "message": message})})


def stream_translator(protocol: str, request_body: dict) -> _ChatStreamTranslator:
    """A translator whose `feed(bytes) -> bytes` / `finish() -> bytes` turn engine SSE into client SSE."""
    if protocol == "anthropic":
        return AnthropicStream(request_body)
    if protocol == "responses":
        return ResponsesStream(request_body)
    raise ValueError(f"no stream translation for protocol {protocol!r}")


# ----------------------------------------------------------------------------------------------------
# Errors and count_tokens
# ----------------------------------------------------------------------------------------------------


def error_body(protocol: str, status: int, message: str) -> dict:
    """An error object in the client protocol's own shape."""
    return errors.error_body(protocol, status, message)


def count_tokens_request(body: dict) -> dict:
    """The Chat Completions body whose `usage.prompt_tokens` answers Anthropic count_tokens."""
    chat, _ = request_to_chat("anthropic", {**body, "stream": False})
    chat["max_tokens"] = 1
    return chat


def count_tokens_response(chat_response: dict) -> dict:
    usage = chat_response.get("usage") or {}
    if usage.get("prompt_tokens") is not None:
        return {"input_tokens": int(usage["prompt_tokens"])}
    if chat_response.get("prompt_token_ids") is not None:
        return {"input_tokens": len(chat_response["prompt_token_ids"])}
    raise TranslationError(502, "engine answer carries no prompt token count")
