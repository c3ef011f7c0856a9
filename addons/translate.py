"""Protocol translation: Anthropic Messages / OpenAI Responses <-> OpenAI Chat Completions.

Why: engines return exact token ids only on Chat Completions (docs/engines.md), while Claude Code speaks
Anthropic Messages and Codex speaks Responses. The addon sends those calls to the engine as Chat
Completions and translates the answer back, streamed as the engine produces it. Everything here is
pure and stdlib-only so it runs inside any mitmproxy >= 11 (Python 3.11 / 3.12).

Public interface (wired in by addons/openforge.py): `request_to_chat`, `stream_translator`,
`response_from_chat`, `error_body`, `count_tokens_request`, `count_tokens_response`,
`needs_translation`, `TranslationError`.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from typing import Any

CLIENT_PROTOCOLS = ("anthropic", "responses")
TRANSLATE_MODES = ("never", "auto", "always")

# Client protocols on which each engine profile returns exact token ids natively. Empty everywhere today
# (docs/engines.md): vLLM, SGLang and llama.cpp give token ids on Chat Completions / Completions only.
_TOKEN_IDS_NATIVE: dict[str, frozenset[str]] = {
    "vllm": frozenset(),
    "sglang": frozenset(),
    "llamacpp": frozenset(),
    "generic": frozenset(),
}

# Chat Completions' reasoning_effort takes low/medium/high on the engines we target.
_EFFORT = {"minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


class TranslationError(Exception):
    """A request the engine cannot take (e.g. a non-function tool); `status` is the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


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


# ----------------------------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------------------------


class _Drops:
    """Ordered set of field names that were accepted but have no Chat Completions meaning."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def add(self, name: str) -> None:
        if name not in self.names:
            self.names.append(name)

    def extra(self, obj: dict, consumed: set[str]) -> None:
        for key in obj:
            if key not in consumed:
                self.add(key)


def request_to_chat(protocol: str, body: dict) -> tuple[dict, list[str]]:
    """Translate a client request body into a Chat Completions body; also return the dropped field names."""
    if not isinstance(body, dict):
        raise TranslationError(400, "request body must be a JSON object")
    drops = _Drops()
    if protocol == "anthropic":
        chat = _anthropic_request(body, drops)
    elif protocol == "responses":
        chat = _responses_request(body, drops)
    else:
        raise ValueError(f"no request translation for protocol {protocol!r}")
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat, drops.names


def _text_content(parts: list[dict]) -> str | list[dict]:
    """All-text part lists become one string (stable prompts whether a client sends a string or a
    one-element list); anything with an image stays a list of Chat Completions parts."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _tool_call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _function_tool(name: Any, description: Any, parameters: Any, strict: Any) -> dict:
    if not isinstance(name, str) or not name:
        raise TranslationError(400, "every tool needs a non-empty string name")
    fn: dict[str, Any] = {"name": name}
    if description is not None:
        fn["description"] = description
    fn["parameters"] = parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}
    if strict is not None:
        fn["strict"] = strict
    return {"type": "function", "function": fn}


def _unsupported_tool(name: Any, ttype: Any) -> TranslationError:
    return TranslationError(
        400,
        f"tool {name!r} has type {ttype!r}; the engine only takes function tools "
        "(remove or disable that tool in the client)",
    )


# --- Anthropic Messages ---------------------------------------------------------------------------

_ANTHROPIC_HANDLED = {
    "model", "messages", "system", "tools", "tool_choice", "max_tokens", "temperature", "top_p", "top_k",
    "stop_sequences", "stream", "thinking", "output_config", "mcp_servers",
}


def _anthropic_request(body: dict, drops: _Drops) -> dict:
    chat: dict[str, Any] = {}
    if "model" in body:
        chat["model"] = body["model"]
    chat["messages"] = _anthropic_messages(body, drops)
    tools = body.get("tools") or []
    if tools:
        chat["tools"] = [_anthropic_tool(t, drops) for t in tools]
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
                raise TranslationError(400, f"tool_choice type {kind!r} is not supported")
            if choice.get("disable_parallel_tool_use"):
                chat["parallel_tool_calls"] = False
    elif body.get("tool_choice") is not None:
        drops.add("tool_choice")
    if body.get("mcp_servers"):
        raise TranslationError(400, "mcp_servers needs Anthropic's servers; the engine cannot call MCP servers")
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
        if key not in _ANTHROPIC_HANDLED:
            drops.add(key)  # metadata, context_management, service_tier, ...
    return chat


def _anthropic_tool(tool: dict, drops: _Drops) -> dict:
    ttype = tool.get("type")
    if ttype not in (None, "custom"):
        raise _unsupported_tool(tool.get("name"), ttype)
    drops.extra(tool, {"type", "name", "description", "input_schema", "strict"})  # cache_control, defer_loading
    return _function_tool(tool.get("name"), tool.get("description"), tool.get("input_schema"), tool.get("strict"))


def _anthropic_text(content: Any, drops: _Drops, where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for block in content or []:
        if block.get("type") != "text":
            raise TranslationError(400, f"{where}: only text blocks are allowed, got {block.get('type')!r}")
        drops.extra(block, {"type", "text"})
        texts.append(block.get("text", ""))
    return "\n".join(texts)


def _anthropic_messages(body: dict, drops: _Drops) -> list[dict]:
    out: list[dict] = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": _anthropic_text(system, drops, "system")})
    for i, msg in enumerate(body.get("messages") or []):
        if not isinstance(msg, dict):
            raise TranslationError(400, f"messages.{i} must be an object")
        drops.extra(msg, {"role", "content"})
        role, content = msg.get("role"), msg.get("content")
        if role in ("system", "developer"):
            out.append({"role": "system", "content": _anthropic_text(content, drops, f"messages.{i}")})
        elif role == "user":
            out.extend(_anthropic_user(content, drops, i))
        elif role == "assistant":
            out.append(_anthropic_assistant(content, drops, i))
        else:
            raise TranslationError(400, f"messages.{i}.role {role!r} is not supported")
    return out


def _anthropic_part(block: dict, drops: _Drops, where: str) -> dict:
    """A text / image / text-document block as a Chat Completions content part."""
    kind = block.get("type")
    if kind == "text":
        drops.extra(block, {"type", "text"})
        return {"type": "text", "text": block.get("text", "")}
    if kind == "image":
        drops.extra(block, {"type", "source"})
        source = block.get("source") or {}
        if source.get("type") == "base64":
            url = f"data:{source.get('media_type')};base64,{source.get('data')}"
        elif source.get("type") == "url":
            url = source.get("url")
        else:
            raise TranslationError(400, f"{where}: image source {source.get('type')!r} is not supported")
        return {"type": "image_url", "image_url": {"url": url}}
    if kind == "document" and (block.get("source") or {}).get("type") == "text":
        drops.extra(block, {"type", "source"})
        return {"type": "text", "text": block["source"].get("data", "")}
    raise TranslationError(400, f"{where}: content block type {kind!r} is not supported by the engine")


def _anthropic_user(content: Any, drops: _Drops, i: int) -> list[dict]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    tool_msgs: list[dict] = []
    parts: list[dict] = []
    for j, block in enumerate(content or []):
        where = f"messages.{i}.content.{j}"
        if block.get("type") == "tool_result":
            drops.extra(block, {"type", "tool_use_id", "content"})  # is_error, cache_control
            inner = block.get("content")
            if inner is None or isinstance(inner, str):
                result: Any = inner or ""
            else:
                result = _text_content([_anthropic_part(b, drops, where) for b in inner])
            tool_msgs.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result})
        else:
            parts.append(_anthropic_part(block, drops, where))
    # Chat Completions wants tool results right after the assistant's tool calls.
    return tool_msgs + ([{"role": "user", "content": _text_content(parts)}] if parts else [])


def _anthropic_assistant(content: Any, drops: _Drops, i: int) -> dict:
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
            calls.append(_tool_call(block.get("id"), block.get("name"), args))
        else:
            raise TranslationError(400, f"messages.{i}.content.{j}: block type {kind!r} is not supported")
    msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


# --- OpenAI Responses -----------------------------------------------------------------------------

_RESPONSES_HANDLED = {
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
    "temperature", "top_p", "top_logprobs", "stream", "reasoning", "text", "previous_response_id",
    "conversation", "prompt", "background",
}


def _responses_request(body: dict, drops: _Drops) -> dict:
    for key in ("previous_response_id", "conversation", "prompt"):
        if body.get(key):
            raise TranslationError(400, f"{key} needs server-side state; send the full input instead (store: false)")
    if body.get("background"):
        raise TranslationError(400, "background responses are not supported; send a foreground request")
    chat: dict[str, Any] = {}
    if "model" in body:
        chat["model"] = body["model"]
    chat["messages"] = _responses_messages(body, drops)
    tools = body.get("tools") or []
    if tools:
        chat["tools"] = [_responses_tool(t, drops) for t in tools]
        choice = body.get("tool_choice")
        if isinstance(choice, str):
            chat["tool_choice"] = choice
        elif isinstance(choice, dict):
            if choice.get("type") != "function":
                raise TranslationError(400, f"tool_choice type {choice.get('type')!r} is not supported")
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
        if key not in _RESPONSES_HANDLED:
            drops.add(key)  # include, store, prompt_cache_key, client_metadata, metadata, ...
    return chat


def _responses_tool(tool: dict, drops: _Drops) -> dict:
    if tool.get("type") != "function":
        raise _unsupported_tool(tool.get("name"), tool.get("type"))
    drops.extra(tool, {"type", "name", "description", "parameters", "strict"})
    return _function_tool(tool.get("name"), tool.get("description"), tool.get("parameters"), tool.get("strict"))


def _responses_parts(content: Any, drops: _Drops, where: str) -> str | list[dict]:
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
            raise TranslationError(400, f"{where}.content.{j}: part type {kind!r} is not supported by the engine")
    return _text_content(parts)


def _responses_messages(body: dict, drops: _Drops) -> list[dict]:
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
            content = _responses_parts(item.get("content"), drops, where)
            if role in ("system", "developer"):
                if not isinstance(content, str):
                    raise TranslationError(400, f"{where}: {role} messages take text only")
                out.append({"role": "system", "content": content})
            elif role == "user":
                out.append({"role": "user", "content": content})
            elif role == "assistant":
                out.append(take_reasoning({"role": "assistant", "content": content}))
            else:
                raise TranslationError(400, f"{where}.role {role!r} is not supported")
        elif kind == "function_call":
            drops.extra(item, {"type", "call_id", "name", "arguments", "id", "status"})
            call = _tool_call(item.get("call_id"), item.get("name"), item.get("arguments") or "{}")
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)  # same assistant turn as the text before it
            else:
                out.append(take_reasoning({"role": "assistant", "content": None, "tool_calls": [call]}))
        elif kind == "function_call_output":
            drops.extra(item, {"type", "call_id", "output", "id", "status"})
            output = item.get("output")
            content = output if isinstance(output, str) else _responses_parts(output, drops, where)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
        elif kind == "reasoning":
            drops.extra(item, {"type", "content", "id", "status"})  # summary, encrypted_content
            reasoning.extend(p.get("text", "") for p in item.get("content") or [])
        else:
            raise TranslationError(400, f"{where}: input item type {kind!r} is not supported by the engine")
    if reasoning:
        drops.add("reasoning")
    return out


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


def _engine_error_message(chunk: dict) -> str:
    err = chunk.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err)
    if err is not None:
        return str(err)
    return str(chunk.get("message") or "engine error")


# ----------------------------------------------------------------------------------------------------
# Non-streaming answers
# ----------------------------------------------------------------------------------------------------


def response_from_chat(protocol: str, chat_response: dict, request_body: dict) -> dict:
    """Translate a non-streaming Chat Completions answer into the client's protocol."""
    choices = chat_response.get("choices") or []
    if not choices:
        raise TranslationError(502, f"engine answer has no choices: {_engine_error_message(chat_response)}")
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


class _SSEReader:
    """Incremental SSE parser for the engine stream: bytes in any split -> JSON payloads or "[DONE]"."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[Any]:
        buf = self._buf + data
        hold = b""
        if buf.endswith(b"\r"):  # may be the first half of a CRLF
            buf, hold = buf[:-1], b"\r"
        events = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n\n")
        self._buf = events.pop() + hold
        return [p for p in (self._parse(e) for e in events) if p is not None]

    def flush(self) -> list[Any]:
        """An unterminated last event (engine closed without the blank line)."""
        rest, self._buf = self._buf, b""
        parsed = self._parse(rest.replace(b"\r\n", b"\n").strip(b"\r\n"))
        return [] if parsed is None else [parsed]

    @staticmethod
    def _parse(event: bytes) -> Any:
        data: list[str] = []
        is_error = False
        for line in event.decode("utf-8", errors="replace").split("\n"):
            if not line or line.startswith(":"):
                continue
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field in ("data", "error"):
                data.append(value)
                is_error = is_error or field == "error"
        if not data:
            return None
        text = "\n".join(data)
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
        self._reader = _SSEReader()
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
        for payload in self._reader.feed(data):
            self._handle(payload)
        return self._take()

    def finish(self) -> bytes:
        for payload in self._reader.flush():
            self._handle(payload)
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
            self._fail(_engine_error_message(payload), closing=False)
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

_ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                          529: "overloaded_error", 503: "overloaded_error"}
_OPENAI_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                       404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def error_body(protocol: str, status: int, message: str) -> dict:
    """An error object in the client protocol's own shape."""
    if protocol == "anthropic":
        kind = _ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    if protocol in ("chat", "completions", "responses"):
        kind = _OPENAI_ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        return {"error": {"message": message, "type": kind, "param": None, "code": None}}
    raise ValueError(f"no error shape for protocol {protocol!r}")


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
