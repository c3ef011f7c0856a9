"""The chat the scripted engines answer from, whatever protocol a request came in: the byte tokenizer and
its ChatML template, a request read into one `Conversation`, the tool call the script makes, the `Reply`.

Standard library only, like `scripted_engine`: it runs in the light Python 3.12 proxy environment too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

SHELL_TOOL_NAMES = ("Bash", "bash", "exec_command", "shell", "run_shell_command")
DEFAULT_MODEL = "scripted-model"


class ByteTokenizer:
    """Byte-level tokenizer over ChatML: id = UTF-8 byte + 3; ids 0-2 are the special tokens."""

    name_or_path = "openforge/byte-chatml"
    special_tokens = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    eos_token = "<|im_end|>"
    eos_token_id = 2
    vocab_size = 256 + 3
    _SPECIAL = re.compile(r"(<\|endoftext\|>|<\|im_start\|>|<\|im_end\|>)")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        for i, part in enumerate(self._SPECIAL.split(text)):
            if i % 2:
                ids.append(self.special_tokens.index(part))
            else:
                ids.extend(b + 3 for b in part.encode())
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            if i >= 3:
                buf.append(i - 3)
                continue
            if buf:
                out.append(buf.decode(errors="replace"))
                buf = bytearray()
            if not skip_special_tokens:
                out.append(self.special_tokens[i])
        if buf:
            out.append(buf.decode(errors="replace"))
        return "".join(out)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        **_: Any,
    ) -> list[int] | str:
        text = render_chatml(messages, tools, add_generation_prompt)
        return self.encode(text) if tokenize else text


def end_of_turn_id(tokenizer: Any) -> int:
    """The id that ends an assistant turn: ChatML's `<|im_end|>` when the tokenizer knows it, else its EOS."""
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    if convert is not None:
        im_end = convert("<|im_end|>")
        if isinstance(im_end, int) and im_end != getattr(tokenizer, "unk_token_id", None):
            return im_end
    return int(tokenizer.eos_token_id)


def content_text(content: Any) -> str:
    """Flatten OpenAI/Anthropic content (string or list of parts) to plain text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict):
                if "text" in part:
                    parts.append(str(part["text"]))
                elif part.get("type") in ("image", "image_url", "input_image"):
                    parts.append("<image>")
                elif part.get("type") == "tool_result":
                    parts.append(content_text(part.get("content")))
        return "".join(parts)
    return str(content)


def render_tool_call(name: str, arguments: Any) -> str:
    """A tool call the way Qwen/Hermes chat templates render it."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def render_chatml(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool = True
) -> str:
    """The default tokenizer's chat template: ChatML, tools listed in the system message."""
    msgs = [dict(m) for m in messages]
    if tools:
        tool_block = "# Tools\n\n<tools>\n" + "\n".join(json.dumps(t, sort_keys=True) for t in tools) + "\n</tools>"
        if msgs and msgs[0].get("role") == "system":
            msgs[0]["content"] = content_text(msgs[0].get("content")) + "\n\n" + tool_block
        else:
            msgs.insert(0, {"role": "system", "content": tool_block})
    out = []
    for m in msgs:
        text = content_text(m.get("content"))
        for call in m.get("tool_calls") or []:
            fn = call.get("function") or {}
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    pass
            text += ("\n" if text else "") + render_tool_call(fn.get("name", ""), args)
        out.append(f"<|im_start|>{m.get('role', 'user')}\n{text}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


class Conversation(NamedTuple):
    """A request in neutral chat form, whatever protocol it arrived in."""

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]  # chat-style {"type": "function", "function": {name, parameters}}
    max_tokens: int | None


class Reply(NamedTuple):
    """What the engine answers: text, or one tool call; plus the completion's token ids."""

    text: str  # visible text ("" for a tool call)
    tool_name: str | None
    arguments: dict[str, Any] | None
    call_id: str
    ids: list[int]  # completion ids, end-of-turn token included unless truncated
    finish: str  # "stop", "tool_calls" or "length"


def _sample_value(schema: dict[str, Any]) -> Any:
    if schema.get("enum"):
        return schema["enum"][0]
    kind = schema.get("type", "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    return {"string": "list files", "integer": 1, "number": 1, "boolean": False, "array": [], "object": {}}.get(
        kind, "list files"
    )


def tool_arguments(schema: dict[str, Any]) -> dict[str, Any]:
    """Arguments for a shell-like tool: command/cmd -> "ls" (["ls"] if an array), other required props simple."""
    props = schema.get("properties") or {}
    args: dict[str, Any] = {}
    for name, prop in props.items():
        if name in ("command", "cmd"):
            args[name] = ["ls"] if prop.get("type") == "array" else "ls"
    for name in schema.get("required") or []:
        if name not in args:
            args[name] = _sample_value(props.get(name) or {})
    return args


def pick_tool(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The shell-like tool among those offered, else the first."""
    fns = [t["function"] for t in tools]
    return next((f for f in fns if f.get("name") in SHELL_TOOL_NAMES), fns[0])


def anthropic_conversation(body: dict[str, Any]) -> Conversation:
    """An Anthropic Messages request as a Conversation."""
    msgs: list[dict[str, Any]] = []
    if body.get("system"):
        msgs.append({"role": "system", "content": content_text(body["system"])})
    for m in body.get("messages") or []:
        content = m.get("content")
        if isinstance(content, str):
            msgs.append({"role": m.get("role", "user"), "content": content})
            continue
        text_parts, calls = [], []
        for block in content or []:
            kind = block.get("type")
            if kind == "tool_result":
                msgs.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                             "content": content_text(block.get("content"))})
            elif kind == "tool_use":
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block.get("name"),
                                           "arguments": json.dumps(block.get("input") or {})}})
            else:
                text_parts.append(block)
        if text_parts or calls:
            msg: dict[str, Any] = {"role": m.get("role", "user"), "content": content_text(text_parts)}
            if calls:
                msg["tool_calls"] = calls
            msgs.append(msg)
    tools = [{"type": "function", "function": {"name": t["name"], "parameters": t.get("input_schema") or {}}}
             for t in body.get("tools") or [] if t.get("name")]
    return Conversation(body.get("model") or DEFAULT_MODEL, msgs, tools, body.get("max_tokens"))


def responses_conversation(body: dict[str, Any]) -> Conversation:
    """An OpenAI Responses request as a Conversation."""
    msgs: list[dict[str, Any]] = []
    if body.get("instructions"):
        msgs.append({"role": "system", "content": content_text(body["instructions"])})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    for item in items or []:
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role", "user")
            msgs.append({"role": role, "content": content_text(item.get("content"))})
        elif kind == "function_call":
            msgs.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": item.get("call_id"), "type": "function",
                 "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}]})
        elif kind == "function_call_output":
            output = item.get("output")
            msgs.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": output if isinstance(output, str) else content_text(output)})
    tools = [{"type": "function", "function": {"name": t["name"], "parameters": t.get("parameters") or {}}}
             for t in body.get("tools") or [] if t.get("type") == "function" and t.get("name")]
    return Conversation(body.get("model") or DEFAULT_MODEL, msgs, tools, body.get("max_output_tokens"))


class Received(NamedTuple):
    """One request the engine received: path with query, lower-cased headers, parsed JSON body (or None)."""

    path: str
    headers: dict[str, str]
    body: Any


def split_even(ids: list[int], n: int) -> list[list[int]]:
    """`ids` in `n` consecutive runs of (nearly) equal length, the last ones shorter or empty."""
    size = -(-len(ids) // n) if ids else 0
    return [ids[i * size : (i + 1) * size] for i in range(n)]
