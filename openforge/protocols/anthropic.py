"""Anthropic Messages, both directions: a request as Chat Completions (`request`), its conversation as Chat
messages (`messages`, the one conversion the proxy sends to the engine and reconstruct trains on), and the
engine's Chat answer rendered back as a Messages answer (`answer`, `Stream`, count_tokens)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from . import chat, computer_use
from .chat import Drops, Generated, begin, function_tool, text_content, tool_call, unsupported_tool
from .errors import ProtocolError

_HANDLED = {
    "model", "messages", "system", "tools", "tool_choice", "max_tokens", "temperature", "top_p", "top_k",
    "stop_sequences", "stream", "thinking", "output_config", "mcp_servers",
}


def request(body: dict, drops: Drops) -> dict:
    """The Chat Completions body for an Anthropic request (without `stream`); raises ProtocolError."""
    chat = begin(body, messages(body, drops), tools(body, drops))
    if "tools" in chat:
        choice = body.get("tool_choice")
        if isinstance(choice, dict):
            kind = choice.get("type")
            if kind == "auto":
                chat["tool_choice"] = "auto"
            elif kind == "any":
                chat["tool_choice"] = "required"
            elif kind == "none":
                chat["tool_choice"] = "none"
            elif kind == "tool":
                chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
            else:
                raise ProtocolError(400, f"tool_choice type {kind!r} is not supported")
            if choice.get("disable_parallel_tool_use"):
                chat["parallel_tool_calls"] = False
    elif body.get("tool_choice") is not None:
        drops.add("tool_choice")
    if body.get("mcp_servers"):
        raise ProtocolError(400, "mcp_servers needs Anthropic's servers; the engine cannot call MCP servers")
    for key in ("max_tokens", "temperature", "top_p", "top_k"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("stop_sequences"):
        chat["stop"] = list(body["stop_sequences"])
    thinking = body.get("thinking")
    if isinstance(thinking, dict):
        kind = thinking.get("type")
        if kind == "enabled":
            chat["chat_template_kwargs"] = {"enable_thinking": True}
            drops.extra(thinking, {"type"})  # budget_tokens, display: no engine-side meaning
        elif kind == "disabled":
            chat["chat_template_kwargs"] = {"enable_thinking": False}
        else:  # "adaptive": the engine's template default decides
            drops.add("thinking")
    output_config = body.get("output_config")
    if isinstance(output_config, dict):
        fmt = output_config.get("format")
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            chat["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": fmt.get("schema") or {}, "strict": True},
            }
        if any(k != "format" for k in output_config):
            drops.add("output_config")  # effort: Anthropic-only knob
    for key in body:
        if key not in _HANDLED:
            drops.add(key)  # metadata, context_management, service_tier, ...
    return chat


def tools(body: dict, drops: Drops) -> list[dict]:
    """The request's tools as Chat function tools (computer-use tools too: the client runs them); raises
    ProtocolError on a server-side tool or a typed tool of a version not known here."""
    return [_tool(t, drops) for t in body.get("tools") or []]


def _tool(tool: dict, drops: Drops) -> dict:
    ttype = tool.get("type")
    if ttype in computer_use.VERSIONS:
        return computer_use.function(tool, drops)
    if ttype not in (None, "custom"):
        raise unsupported_tool(tool.get("name"), ttype)
    drops.extra(tool, {"type", "name", "description", "input_schema", "strict"})  # cache_control, defer_loading
    return function_tool(tool.get("name"), tool.get("description"), tool.get("input_schema"), tool.get("strict"))


def _text(content: Any, drops: Drops, where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for block in content or []:
        if block.get("type") != "text":
            raise ProtocolError(400, f"{where}: only text blocks are allowed, got {block.get('type')!r}")
        drops.extra(block, {"type", "text"})
        texts.append(block.get("text", ""))
    return "\n".join(texts)


def messages(body: dict, drops: Drops) -> list[dict]:
    """`system` and `messages` as Chat messages: tool results become `tool` messages before the user's
    text, an assistant's text blocks are joined by "\\n" and its thinking blocks by "" (what the engine is
    sent); raises ProtocolError on a block the engine cannot take."""
    out: list[dict] = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": _text(system, drops, "system")})
    for i, msg in enumerate(body.get("messages") or []):
        if not isinstance(msg, dict):
            raise ProtocolError(400, f"messages.{i} must be an object")
        drops.extra(msg, {"role", "content"})
        role, content = msg.get("role"), msg.get("content")
        if role in ("system", "developer"):
            out.append({"role": "system", "content": _text(content, drops, f"messages.{i}")})
        elif role == "user":
            out.extend(_user(content, drops, i))
        elif role == "assistant":
            out.append(assistant(content, drops, i))
        else:
            raise ProtocolError(400, f"messages.{i}.role {role!r} is not supported")
    return out


def _part(block: dict, drops: Drops, where: str) -> dict:
    """A text / image / text-document block as a Chat Completions content part."""
    kind = block.get("type")
    if kind == "text":
        drops.extra(block, {"type", "text"})
        return {"type": "text", "text": block.get("text", "")}
    if kind == "image":
        drops.extra(block, {"type", "source"})
        source = block.get("source") or {}
        url: Any
        if source.get("type") == "base64":
            url = f"data:{source.get('media_type')};base64,{source.get('data')}"
        elif source.get("type") == "url":
            url = source.get("url")
        else:
            raise ProtocolError(400, f"{where}: image source {source.get('type')!r} is not supported")
        return {"type": "image_url", "image_url": {"url": url}}
    if kind == "document" and (block.get("source") or {}).get("type") == "text":
        drops.extra(block, {"type", "source"})
        return {"type": "text", "text": block["source"].get("data", "")}
    raise ProtocolError(400, f"{where}: content block type {kind!r} is not supported by the engine")


def _user(content: Any, drops: Drops, i: int) -> list[dict]:
    """A user turn as Chat messages: one `tool` message per tool result, holding its text (Chat `tool`
    messages take text only), then one user message with the results' images in order (a computer-use
    screenshot) followed by the turn's own blocks."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    tool_msgs: list[dict] = []
    images: list[dict] = []
    parts: list[dict] = []
    for j, block in enumerate(content or []):
        where = f"messages.{i}.content.{j}"
        if block.get("type") == "tool_result":
            drops.extra(block, {"type", "tool_use_id", "content"})  # is_error, cache_control
            inner = block.get("content")
            if inner is None or isinstance(inner, str):
                result = inner or ""
            else:
                converted = [_part(b, drops, where) for b in inner]
                result = "\n".join(p["text"] for p in converted if p["type"] == "text")
                images.extend(p for p in converted if p["type"] != "text")
            tool_msgs.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result})
        else:
            parts.append(_part(block, drops, where))
    # Chat Completions wants tool results right after the assistant's tool calls.
    parts = images + parts
    return tool_msgs + ([{"role": "user", "content": text_content(parts)}] if parts else [])


def assistant(content: Any, drops: Drops, i: int) -> dict:
    """An assistant turn's content (a string or blocks) as one Chat assistant message."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict] = []
    for j, block in enumerate(content or []):
        kind = block.get("type")
        if kind == "text":
            drops.extra(block, {"type", "text"})
            texts.append(block.get("text", ""))
        elif kind == "thinking":
            drops.extra(block, {"type", "thinking"})  # signature
            reasoning.append(block.get("thinking", ""))
        elif kind == "redacted_thinking":
            drops.add("redacted_thinking")
        elif kind == "tool_use":
            drops.extra(block, {"type", "id", "name", "input"})
            args = json.dumps(block.get("input") or {}, ensure_ascii=False)
            calls.append(tool_call(block.get("id"), block.get("name"), args))
        else:
            raise ProtocolError(400, f"messages.{i}.content.{j}: block type {kind!r} is not supported")
    msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


def generated(obj: dict[str, Any]) -> Generated:
    """A Messages answer or stream event: text, thinking, tool names and their input as generated."""
    text = ""
    kind = obj.get("type")
    if kind == "content_block_delta":
        d = obj.get("delta") or {}
        text = d.get("text") or d.get("partial_json") or d.get("thinking") or ""
    elif kind == "content_block_start":
        text = (obj.get("content_block") or {}).get("name") or ""
    elif kind == "message" or "content" in obj and "role" in obj:
        for b in obj.get("content") or []:
            text += b.get("text") or b.get("thinking") or ""
            if b.get("type") == "tool_use":
                text += b.get("name", "") + json.dumps(b.get("input"), sort_keys=True)
    usage = obj.get("usage") or (obj.get("message") or {}).get("usage") or {}
    return Generated(text, None, usage.get("output_tokens"))


# ----------------------------------------------------------------------------------------------------
# The engine's answer as a Messages answer
# ----------------------------------------------------------------------------------------------------


def _signature(thinking: str) -> str:
    """Stand-in for Anthropic's opaque thinking signature: stable, so an echoed block is recognisable."""
    return "openforge-" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


def _usage(usage: dict) -> dict:
    prompt, cached = int(usage.get("prompt_tokens") or 0), chat.cached_tokens(usage)
    return {
        "input_tokens": prompt - cached,  # Anthropic counts cache reads separately from input
        "output_tokens": int(usage.get("completion_tokens") or 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _stop(finish: str | None, stop_reason: Any, has_tools: bool, request: dict) -> tuple[str, str | None]:
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


def answer(chat_response: dict, request_body: dict) -> dict:
    """A non-streamed Chat answer as a Messages answer; raises ProtocolError (502) when it has no choice."""
    got = chat.read_answer(chat_response)
    content: list[dict] = []
    if got.reasoning:
        content.append({"type": "thinking", "thinking": got.reasoning, "signature": _signature(got.reasoning)})
    if got.text:
        content.append({"type": "text", "text": got.text})
    for call in got.tool_calls:
        fn = call.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            args = None
        content.append({"type": "tool_use", "id": call.get("id") or chat.new_id("toolu_"), "name": fn.get("name"),
                        "input": args if isinstance(args, dict) else {}})
    stop, sequence = _stop(got.finish_reason, got.stop_reason, bool(got.tool_calls), request_body)
    return {"id": f"msg_{got.id}", "type": "message", "role": "assistant",
            "model": request_body.get("model", chat_response.get("model")), "content": content,
            "stop_reason": stop, "stop_sequence": sequence, "usage": _usage(got.usage)}


class Stream(chat.ChatStream):
    """Chat Completions SSE -> Anthropic Messages SSE."""

    tool_id_prefix = "toolu_"

    def _emit(self, payload: dict) -> None:
        self._out.append(chat.sse_event(payload["type"], payload))

    def _on_start(self) -> None:
        usage = _usage(self.usage or {"prompt_tokens": self.prompt_tokens or 0})
        usage["output_tokens"] = 0
        self._emit({"type": "message_start", "message": {
            "id": f"msg_{self.chat_id}", "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}})

    def _on_open(self, block: chat.Block) -> None:
        if block.kind == "text":
            content: dict = {"type": "text", "text": ""}
        elif block.kind == "thinking":
            content = {"type": "thinking", "thinking": "", "signature": ""}
        else:
            content = {"type": "tool_use", "id": block.call_id, "name": block.name, "input": {}}
        self._emit({"type": "content_block_start", "index": block.index, "content_block": content})

    def _on_delta(self, block: chat.Block, text: str) -> None:
        if block.kind == "text":
            delta = {"type": "text_delta", "text": text}
        elif block.kind == "thinking":
            delta = {"type": "thinking_delta", "thinking": text}
        else:
            delta = {"type": "input_json_delta", "partial_json": text}
        self._emit({"type": "content_block_delta", "index": block.index, "delta": delta})

    def _on_close(self, block: chat.Block) -> None:
        if block.kind == "thinking":
            self._emit({"type": "content_block_delta", "index": block.index,
                        "delta": {"type": "signature_delta", "signature": _signature(block.text)}})
        self._emit({"type": "content_block_stop", "index": block.index})

    def _on_end(self) -> None:
        has_tools = any(b.kind == "tool" for b in self.blocks)
        stop, sequence = _stop(self.finish_reason, self.stop_reason, has_tools, self.request)
        self._emit({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": sequence},
                    "usage": _usage(self.final_usage())})
        self._emit({"type": "message_stop"})

    def _on_fail(self, message: str) -> None:
        self._emit({"type": "error", "error": {"type": "api_error", "message": message}})


def count_tokens_request(body: dict) -> dict:
    """The Chat Completions body whose `usage.prompt_tokens` answers a count_tokens request."""
    counting = request(body, Drops())
    counting["max_tokens"] = 1
    return counting


def count_tokens_answer(chat_response: dict) -> dict:
    """The count_tokens answer from that body's Chat answer; raises ProtocolError (502) without a count."""
    usage = chat_response.get("usage") or {}
    if usage.get("prompt_tokens") is not None:
        return {"input_tokens": int(usage["prompt_tokens"])}
    if chat_response.get("prompt_token_ids") is not None:
        return {"input_tokens": len(chat_response["prompt_token_ids"])}
    raise ProtocolError(502, "engine answer carries no prompt token count")
