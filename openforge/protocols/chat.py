"""Chat Completions, the engine's protocol: the pieces a request in another protocol is rebuilt from."""

from __future__ import annotations

from typing import Any, NamedTuple

from .errors import ProtocolError


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
