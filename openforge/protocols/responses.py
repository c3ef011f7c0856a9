"""OpenAI Responses, both directions: a request as Chat Completions (`request`), its input items as Chat
messages (`messages`, the one conversion the proxy sends to the engine and reconstruct trains on), and the
engine's Chat answer rendered back as a `response` object or stream (`answer`, `Stream`)."""

from __future__ import annotations

import uuid
from typing import Any

from . import chat
from .chat import Drops, Generated, begin, function_tool, text_content, tool_call, unsupported_tool
from .errors import ProtocolError

# Chat Completions' reasoning_effort takes low/medium/high on the engines we target.
_EFFORT = {"minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
_HANDLED = {
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
    "temperature", "top_p", "top_logprobs", "stream", "reasoning", "text", "previous_response_id",
    "conversation", "prompt", "background",
}


def request(body: dict, drops: Drops) -> dict:
    """The Chat Completions body for a Responses request (without `stream`); raises ProtocolError."""
    for key in ("previous_response_id", "conversation", "prompt"):
        if body.get(key):
            raise ProtocolError(400, f"{key} needs server-side state; send the full input instead (store: false)")
    if body.get("background"):
        raise ProtocolError(400, "background responses are not supported; send a foreground request")
    chat = begin(body, messages(body, drops), tools(body, drops))
    if "tools" in chat:
        choice = body.get("tool_choice")
        if isinstance(choice, str):
            chat["tool_choice"] = choice
        elif isinstance(choice, dict):
            if choice.get("type") != "function":
                raise ProtocolError(400, f"tool_choice type {choice.get('type')!r} is not supported")
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        if body.get("parallel_tool_calls") is not None:
            chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("top_logprobs"):
        chat["logprobs"] = True
        chat["top_logprobs"] = body["top_logprobs"]
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict):
        effort = reasoning.get("effort")
        if effort == "none":
            chat["chat_template_kwargs"] = {"enable_thinking": False}
        elif effort in _EFFORT:
            chat["reasoning_effort"] = _EFFORT[effort]
            chat["chat_template_kwargs"] = {"enable_thinking": True}
        drops.extra(reasoning, {"effort"})  # summary, generate_summary
    text = body.get("text")
    if isinstance(text, dict):
        fmt = text.get("format") or {}
        if fmt.get("type") == "json_schema":
            schema = {"name": fmt.get("name", "output"), "schema": fmt.get("schema") or {}}
            if fmt.get("strict") is not None:
                schema["strict"] = fmt["strict"]
            chat["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif fmt.get("type") == "json_object":
            chat["response_format"] = {"type": "json_object"}
        drops.extra(text, {"format"})  # verbosity
    for key in body:
        if key not in _HANDLED:
            drops.add(key)  # include, store, prompt_cache_key, client_metadata, metadata, ...
    return chat


def tools(body: dict, drops: Drops) -> list[dict]:
    """The request's tools as Chat function tools; raises ProtocolError on a server-side tool."""
    return [_tool(t, drops) for t in body.get("tools") or []]


def _tool(tool: dict, drops: Drops) -> dict:
    if tool.get("type") != "function":
        raise unsupported_tool(tool.get("name"), tool.get("type"))
    drops.extra(tool, {"type", "name", "description", "parameters", "strict"})
    return function_tool(tool.get("name"), tool.get("description"), tool.get("parameters"), tool.get("strict"))


def _parts(content: Any, drops: Drops, where: str) -> str | list[dict]:
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content or []):
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text", "refusal"):
            drops.extra(part, {"type", "text", "refusal", "annotations", "logprobs"})
            parts.append({"type": "text", "text": part.get("text", part.get("refusal", ""))})
        elif kind == "input_image" and part.get("image_url"):
            drops.extra(part, {"type", "image_url", "detail"})
            image = {"url": part["image_url"]}
            if part.get("detail"):
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            raise ProtocolError(400, f"{where}.content.{j}: part type {kind!r} is not supported by the engine")
    return text_content(parts)


def messages(body: dict, drops: Drops) -> list[dict]:
    """`instructions` and `input` items as Chat messages: a function call joins the assistant turn before
    it, reasoning items (their `content` texts joined by "") go to the assistant output they precede;
    raises ProtocolError on an item the engine cannot take."""
    out: list[dict] = []
    if body.get("instructions"):
        out.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    reasoning: list[str] = []  # reasoning items wait for the assistant output they belong to

    def take_reasoning(msg: dict) -> dict:
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
            reasoning.clear()
        return msg

    for i, item in enumerate(items or []):
        where = f"input.{i}"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            drops.extra(item, {"type", "role", "content", "id", "status"})
            role = item.get("role")
            content = _parts(item.get("content"), drops, where)
            if role in ("system", "developer"):
                if not isinstance(content, str):
                    raise ProtocolError(400, f"{where}: {role} messages take text only")
                out.append({"role": "system", "content": content})
            elif role == "user":
                out.append({"role": "user", "content": content})
            elif role == "assistant":
                out.append(take_reasoning({"role": "assistant", "content": content}))
            else:
                raise ProtocolError(400, f"{where}.role {role!r} is not supported")
        elif kind == "function_call":
            drops.extra(item, {"type", "call_id", "name", "arguments", "id", "status"})
            call = tool_call(item.get("call_id"), item.get("name"), item.get("arguments") or "{}")
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)  # same assistant turn as the text before it
            else:
                out.append(take_reasoning({"role": "assistant", "content": None, "tool_calls": [call]}))
        elif kind == "function_call_output":
            drops.extra(item, {"type", "call_id", "output", "id", "status"})
            output = item.get("output")
            content = output if isinstance(output, str) else _parts(output, drops, where)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
        elif kind == "reasoning":
            text, consumed = _reasoning(item)
            drops.extra(item, consumed)  # encrypted_content
            if text is not None:
                reasoning.append(text)
        else:
            raise ProtocolError(400, f"{where}: input item type {kind!r} is not supported by the engine")
    if reasoning:
        drops.add("reasoning")
    return out


def _reasoning(item: dict) -> tuple[str | None, set[str]]:
    """A reasoning item's text and the fields it was read from: its `content` texts as generated (joined
    by ""), else, where the server kept them back, its `summary` paragraphs (joined by "\\n"); None when
    it has neither (encrypted only)."""
    if item.get("content"):
        return "".join(p.get("text", "") for p in item["content"]), {"type", "content", "id", "status"}
    if item.get("summary"):
        summary = "\n".join(p.get("text", "") for p in item["summary"] if isinstance(p, dict))
        return summary, {"type", "content", "summary", "id", "status"}
    return None, {"type", "content", "id", "status"}


_DELTAS = ("response.output_text.delta", "response.function_call_arguments.delta", "response.reasoning_text.delta")


def generated(obj: dict[str, Any]) -> Generated:
    """A Responses stream event, or a whole `response` object: text, reasoning, function names and arguments."""
    text = ""
    kind = obj.get("type", "")
    if kind in _DELTAS:
        text = obj.get("delta") or ""
    elif kind == "response.output_item.added":
        text = (obj.get("item") or {}).get("name") or ""
    resp = obj.get("response") if kind else obj
    if not isinstance(resp, dict):
        return Generated(text, None, None)
    if not kind:
        for item in resp.get("output") or []:
            text += (item.get("name") or "") + (item.get("arguments") or "")
            for part in item.get("content") or []:
                text += part.get("text") or ""
    return Generated(text, None, (resp.get("usage") or {}).get("output_tokens"))


# ----------------------------------------------------------------------------------------------------
# The engine's answer as a Responses answer
# ----------------------------------------------------------------------------------------------------


def _usage(usage: dict) -> dict:
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    reasoning = int(((usage.get("completion_tokens_details") or {}).get("reasoning_tokens")) or 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": chat.cached_tokens(usage)},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": int(usage.get("total_tokens") or prompt + completion),
    }


def _status(finish: str | None) -> tuple[str, dict | None]:
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


def answer(chat_response: dict, request_body: dict) -> dict:
    """A non-streamed Chat answer as a `response` object; raises ProtocolError (502) when it has no choice."""
    got = chat.read_answer(chat_response)
    status, incomplete = _status(got.finish_reason)
    output: list[dict] = []
    if got.reasoning:
        output.append(_reasoning_item(f"rs_{got.id}", got.reasoning, "completed"))
    if got.text:
        output.append(_message_item(f"msg_{got.id}", got.text, "completed"))
    for k, call in enumerate(got.tool_calls):
        fn = call.get("function") or {}
        output.append(_function_item(f"fc_{got.id}_{k}", call.get("id") or chat.new_id("call_"),
                                     fn.get("name") or "", fn.get("arguments") or "", "completed"))
    model = request_body.get("model", chat_response.get("model"))
    return _response_object(request_body, f"resp_{got.id}", got.created, model, status, output,
                            _usage(got.usage), incomplete=incomplete)


class Stream(chat.ChatStream):
    """Chat Completions SSE -> OpenAI Responses SSE (with monotonically increasing sequence numbers)."""

    def __init__(self, request_body: dict) -> None:
        super().__init__(request_body)
        self._seq = 0

    def _emit(self, payload: dict) -> None:
        payload["sequence_number"] = self._seq
        self._seq += 1
        self._out.append(chat.sse_event(payload["type"], payload))

    def _response(self, status: str, output: list, usage: dict | None = None, error: dict | None = None,
                  incomplete: dict | None = None) -> dict:
        return _response_object(self.request, f"resp_{self.chat_id}", self.created, self.model, status, output,
                                usage, error, incomplete)

    def _item(self, block: chat.Block, status: str) -> dict:
        if block.kind == "text":
            return _message_item(block.item_id, block.text, status)
        if block.kind == "thinking":
            return _reasoning_item(block.item_id, block.text, status)
        return _function_item(block.item_id, block.call_id, block.name, block.text, status)

    def _on_start(self) -> None:
        self._emit({"type": "response.created", "response": self._response("in_progress", [])})
        self._emit({"type": "response.in_progress", "response": self._response("in_progress", [])})

    def _on_open(self, block: chat.Block) -> None:
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

    def _on_delta(self, block: chat.Block, text: str) -> None:
        ids = {"item_id": block.item_id, "output_index": block.index}
        if block.kind == "text":
            self._emit({"type": "response.output_text.delta", **ids, "content_index": 0, "delta": text,
                        "logprobs": []})
        elif block.kind == "thinking":
            self._emit({"type": "response.reasoning_text.delta", **ids, "content_index": 0, "delta": text})
        else:
            self._emit({"type": "response.function_call_arguments.delta", **ids, "delta": text})

    def _on_close(self, block: chat.Block) -> None:
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
        status, incomplete = _status(self.finish_reason)
        output = [self._item(b, "completed") for b in self.blocks]
        response = self._response(status, output, _usage(self.final_usage()), incomplete=incomplete)
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
