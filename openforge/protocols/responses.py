"""OpenAI Responses: a request as Chat Completions (`request`), its input items as Chat messages
(`messages`, the one conversion the proxy sends to the engine and reconstruct trains on)."""

from __future__ import annotations

from typing import Any

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
