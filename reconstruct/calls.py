"""Parse one recorded exchange (any protocol, streamed or not) into a canonical `Call`.

The canonical form is OpenAI Chat shaped, because that is what Hugging Face chat templates consume:
messages `{role, content: str, reasoning_content?, tool_calls?: [{id, type, function: {name,
arguments: str}}], tool_call_id?}` and tools `{type: "function", function: {...}}`. Engine token ids
(vLLM, SGLang, llama.cpp) are read from the engine side of the exchange when present.
Anything that cannot become a call raises `Skip(reason, detail)`; the caller records it.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from openforge.addons.flowfile import ExchangeRecord, HttpResponse
from openforge.protocols import anthropic, engine_ids, responses, sse
from openforge.protocols.chat import Drops, tool_call
from openforge.protocols.endpoints import LLM_PROTOCOLS
from openforge.protocols.errors import ProtocolError
from openforge.reconstruct.answer_json import RawIds, loads, loads_answer


class Skip(Exception):
    """A record (or one choice of it) that cannot become a training call; `reason` is a short class for the
    skipped table, `call_id` the call it would have been (None: the whole record)."""

    def __init__(self, reason: str, detail: str = "", call_id: str | None = None) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail[:500]
        self.call_id = call_id


@dataclass
class Image:
    sha256: str
    mime: str | None
    data: bytes


@dataclass
class Call:
    """One LLM call in canonical form, with the engine's own token ids when it returned them."""

    call_id: str
    protocol: str
    streamed: bool
    status: int | None
    messages: list[dict[str, Any]] | None  # None for the Completions protocol
    tools: list[dict[str, Any]] | None
    completion: dict[str, Any]  # canonical assistant message
    prompt_text: str | None = None  # Completions protocol only
    completion_text: str | None = None  # Completions protocol only
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    engine_prompt_ids: list[int] | RawIds | None = None
    # the prompt ids came from the engine's own render and tokenization beside the call (the proxy's
    # `engine_prompt_ids`, llama.cpp), not from its answer: their count is checked against `prompt_tokens`
    engine_prompt_beside: bool = False
    engine_completion_ids: list[int] | None = None
    engine_logprobs: list[float] | None = None
    images: list[Image] = field(default_factory=list)


def _ids(ids: Any) -> list[int] | RawIds | None:
    if not ids:
        return None
    return ids if isinstance(ids, RawIds) else list(ids)


# ---------------------------------------------------------------- record -> Call


def parse_record(rec: ExchangeRecord) -> Call:
    """Canonicalise an exchange record's first choice (the one a client with n = 1 gets), or raise Skip."""
    first = parse_choices(rec)[0]
    if isinstance(first, Skip):
        raise first
    return first


def parse_choices(rec: ExchangeRecord) -> list[Call | Skip]:
    """One call per choice of the answer (a Chat or Completions request with `n > 1` gets several), in
    index order; a choice that cannot become a call is its Skip. Raises Skip for the whole record."""
    if not isinstance(rec.get("id"), str) or not rec["id"]:
        raise Skip("malformed_record", f"record id {rec.get('id')!r} is not a string")  # calls are keyed by it
    protocol = rec.get("protocol")
    if protocol not in LLM_PROTOCOLS:
        raise Skip("not_llm_call", f"protocol {protocol!r}")
    if rec.get("error"):
        raise Skip("proxy_error", str(rec["error"]))
    if rec.get("complete") is False:
        raise Skip("incomplete", "exchange did not finish (shutdown or disconnect)")
    upstream = rec.get("upstream_request")
    response = rec.get("response")
    if not upstream or not response:
        raise Skip("no_engine_exchange", "answered by the proxy or no response recorded")
    translated = rec.get("translated")
    engine_protocol = translated.get("to", "chat") if translated else protocol
    status = response.get("status")
    streamed = bool(response.get("streamed")) or response.get("chunks") is not None
    raw = _response_bytes(response)
    if status is None or status >= 400:
        raise Skip("engine_error", f"HTTP {status}: {raw[:300].decode('utf-8', 'replace')}")
    request = _json_body(upstream.get("body"), "request")
    images: list[Image] = []
    parser = _PARSERS.get(engine_protocol)
    if parser is None:
        raise Skip("unknown_protocol", f"engine protocol {engine_protocol!r}")
    calls = parser(rec, request, raw, streamed, images)
    for call in calls:
        if isinstance(call, Call):
            call.status = status
            call.protocol = protocol  # what the client spoke; the engine side may have been translated to chat
            call.images = images
    return calls


def choice_call_id(record_id: str, index: int) -> str:
    """The call id of a record's choice: the record id for choice 0 (so n = 1 reads as ever), else `id#k`."""
    return record_id if index == 0 else f"{record_id}#{index}"


def _response_bytes(response: HttpResponse) -> bytes:
    """The answer's bytes: the body, or the SSE chunks joined (`bytes(n)` of a number would allocate n bytes)."""
    chunks = response.get("chunks")
    if chunks is not None:
        if not isinstance(chunks, list) or not all(isinstance(c, list) and len(c) == 2 and isinstance(c[1], bytes)
                                                   for c in chunks):
            raise Skip("malformed_record", "response.chunks is not a list of [time, bytes] pairs")
        return b"".join(c[1] for c in chunks)
    body = response.get("body") or b""
    if not isinstance(body, bytes):
        raise Skip("malformed_record", f"response.body is {type(body).__name__}, not bytes")
    return body


def _json_body(body: Any, what: str, parse: Callable[[Any], Any] = loads) -> Any:
    try:
        return parse(body or b"")
    except (ValueError, TypeError) as e:
        raise Skip("non_json_body", f"{what} body is not JSON: {e}") from None


def sse_events(raw: bytes) -> Iterator[tuple[str | None, str]]:
    """Yield (event name, data) for each server-sent event with data; a torn last event is dropped."""
    for name, data, _ in sse.events(raw):
        if data is not None:
            yield name, data


def _sse_json(raw: bytes) -> Iterator[tuple[str | None, dict[str, Any]]]:
    for name, data in sse_events(raw):
        if data.strip() == "[DONE]":
            continue
        try:
            obj = loads_answer(data)
        except ValueError:
            raise Skip("non_json_body", f"SSE event is not JSON: {data[:200]}") from None
        if name == "error" or (
            isinstance(obj, dict) and (obj.get("type") == "error" or ("error" in obj and "type" not in obj))
        ):
            raise Skip("engine_error", f"error event in stream: {data[:300]}")
        yield name, obj


# ---------------------------------------------------------------- content helpers


def _text_and_images(content: Any, images: list[Image]) -> str | list[dict[str, Any]]:
    """Flatten str | list of parts (OpenAI, Anthropic, Responses) to text; images go to `images`.

    Content with an image stays a list of parts, so a VL chat template renders each image where it was:
    `{"type": "text", "text": ...}` and `{"type": "image", "sha256": ...}` (the hash tells two conversations
    with the same text and other images apart).
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    parts: list[dict[str, Any]] = []
    for part in content if isinstance(content, list) else [content]:
        if isinstance(part, str):
            texts.append(part)
            parts.append({"type": "text", "text": part})
            continue
        kind = part.get("type")
        if kind in ("text", "input_text", "output_text"):
            texts.append(part.get("text") or "")
            parts.append({"type": "text", "text": texts[-1]})
        elif kind in ("image_url", "input_image", "image") and _collect_image(part, images):
            parts.append({"type": "image", "sha256": images[-1].sha256})
    return parts if len(parts) > len(texts) else "\n".join(texts)


def _collect_image(part: dict[str, Any], images: list[Image]) -> bool:
    """Append the part's image to `images`; False for a part that holds none."""
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    source = part.get("source") or {}
    mime, data = None, None
    if source.get("type") == "base64":
        mime, data = source.get("media_type"), base64.b64decode(source.get("data") or "")
    elif isinstance(url, str) and url.startswith("data:") and "," in url:
        head, payload = url[5:].split(",", 1)
        mime = head.split(";")[0] or None
        data = base64.b64decode(payload) if ";base64" in head else payload.encode()
    elif isinstance(url, str) or source.get("url"):
        mime, data = "text/uri-list", str(url or source.get("url") or "").encode()
    if data is None:
        return False
    images.append(Image(hashlib.sha256(data).hexdigest(), mime, data))
    return True


def _tool_call(call_id: str | None, name: str, arguments: Any) -> dict[str, Any]:
    """A Chat tool call; arguments that are not yet JSON text are written as JSON."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return tool_call(call_id, name, arguments)


def assistant_message(text: str, reasoning: str | None, tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def _base(rec: ExchangeRecord, index: int, protocol: str, streamed: bool) -> dict[str, Any]:
    return {"call_id": choice_call_id(str(rec.get("id")), index), "protocol": protocol, "streamed": streamed,
            "status": None}


@dataclass
class _Choice:
    """One choice of a Chat or Completions answer, as its parts arrive (a stream interleaves choices by index)."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_slots: dict[int, dict[str, Any]] = field(default_factory=dict)  # streamed tool calls by their index
    message: dict[str, Any] | None = None  # a whole answer's assistant message
    prompt_ids: Any = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    lp_ids: list[int | None] = field(default_factory=list)  # llama.cpp's token id in each logprobs entry
    finish: str | None = None

    def add_delta(self, delta: dict[str, Any]) -> None:
        self.text.append(delta.get("content") or "")
        self.reasoning.append(delta.get("reasoning_content") or delta.get("reasoning") or "")
        for tc in delta.get("tool_calls") or []:
            slot = self.tool_slots.setdefault(tc.get("index", 0), {"id": None, "name": "", "args": []})
            slot["id"] = tc.get("id") or slot["id"]
            fn = tc.get("function") or {}
            slot["name"] += fn.get("name") or ""
            slot["args"].append(fn.get("arguments") or "")

    def assistant(self) -> dict[str, Any]:
        if self.message is not None:
            return self.message
        tool_calls = [_tool_call(s["id"], s["name"], "".join(s["args"])) for _, s in sorted(self.tool_slots.items())]
        return assistant_message("".join(self.text), "".join(self.reasoning) or None, tool_calls)

    def logprobs_if_aligned(self) -> list[float] | None:
        return self.logprobs if self.ids and len(self.logprobs) == len(self.ids) else None


def _completion_tokens(usage: dict[str, Any], choices: dict[int, _Choice], choice: _Choice) -> Any:
    """`usage` counts every choice's tokens: with several, a choice's own count is its engine ids (or unknown)."""
    if len(choices) == 1:
        return usage.get("completion_tokens")
    return len(choice.ids) or None


def _finished(rec: ExchangeRecord, protocol: str, streamed: bool, choices: dict[int, _Choice],
              out: list[Call | Skip]) -> Iterator[tuple[dict[str, Any], _Choice]]:
    """Each choice in index order with its call's base fields; one a stream never finished goes to `out` as
    a Skip instead."""
    for index, part in sorted(choices.items()):
        base = _base(rec, index, protocol, streamed)
        if streamed and part.finish is None:
            out.append(Skip("truncated_stream", "stream ended without a finish_reason", base["call_id"]))
        else:
            yield base, part


# ---------------------------------------------------------------- Chat Completions


def _chat_messages(request: dict[str, Any], images: list[Image]) -> list[dict[str, Any]]:
    out = []
    for m in request.get("messages") or []:
        role = m.get("role")
        msg: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            "content": _text_and_images(m.get("content"), images),
        }
        reasoning = m.get("reasoning_content") or m.get("reasoning")
        if reasoning:
            msg["reasoning_content"] = reasoning
        if m.get("tool_calls"):
            msg["tool_calls"] = [
                _tool_call(tc.get("id"), tc["function"]["name"], tc["function"].get("arguments", ""))
                for tc in m["tool_calls"]
            ]
        if m.get("tool_call_id") is not None:
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def _chat_tools(request: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = [t for t in request.get("tools") or [] if t.get("type", "function") == "function"]
    return tools or None


def _parse_chat(rec: ExchangeRecord, request: dict[str, Any], raw: bytes, streamed: bool,
                images: list[Image]) -> list[Call | Skip]:
    choices: dict[int, _Choice] = {}
    usage: dict[str, Any] = {}
    prompt_ids, sgl = None, {}
    if streamed:
        for _, chunk in _sse_json(raw):
            if chunk.get("prompt_token_ids") is not None and prompt_ids is None:
                prompt_ids = chunk["prompt_token_ids"]
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("sglext"):
                sgl.update(chunk["sglext"])
            for choice in chunk.get("choices") or []:
                part = choices.setdefault(choice.get("index", 0), _Choice())
                part.add_delta(choice.get("delta") or {})
                if choice.get("prompt_token_ids") is not None and part.prompt_ids is None:
                    part.prompt_ids = choice["prompt_token_ids"]
                part.ids.extend(engine_ids.vllm_completion_ids(choice))
                lps, ids = engine_ids.chat_logprobs(choice.get("logprobs"))
                part.logprobs.extend(lps)
                part.lp_ids.extend(ids)
                part.finish = choice.get("finish_reason") or part.finish
        if not choices:
            if raw.rstrip().endswith(b"[DONE]"):
                raise Skip("no_choices", "stream carried no choices")
            raise Skip("truncated_stream", "stream ended without a finish_reason")
    else:
        body = _json_body(raw, "response", loads_answer)
        if not isinstance(body, dict) or not body.get("choices"):
            raise Skip("no_choices", f"response has no choices: {raw[:200]!r}")
        usage, sgl = body.get("usage") or {}, body.get("sglext") or {}
        for k, choice in enumerate(body["choices"]):  # a whole answer lists its choices in index order
            m = choice.get("message") or {}
            tool_calls = [
                _tool_call(tc.get("id"), tc["function"]["name"], tc["function"].get("arguments", ""))
                for tc in m.get("tool_calls") or []
            ]
            lps, ids = engine_ids.chat_logprobs(choice.get("logprobs"))
            choices[k] = _Choice(
                message=assistant_message(m.get("content") or "", m.get("reasoning_content") or m.get("reasoning"),
                                          tool_calls),
                prompt_ids=engine_ids.vllm_prompt_ids(body, choice), ids=engine_ids.vllm_completion_ids(choice),
                logprobs=lps, lp_ids=ids, finish=choice.get("finish_reason"),
            )
    sgl_prompt, sgl_completion = engine_ids.sglang_ids(sgl)
    beside = rec.get("engine_prompt_ids")
    messages, tools = _chat_messages(request, images), _chat_tools(request)
    out: list[Call | Skip] = []
    for base, part in _finished(rec, "chat", streamed, choices, out):
        if not part.ids and len(choices) == 1:  # SGLang's and llama.cpp's ids cannot be told apart per choice
            part.ids = sgl_completion or engine_ids.llamacpp_completion_ids(part.lp_ids, usage)
        out.append(Call(
            **base,
            messages=messages,
            tools=tools,
            completion=part.assistant(),
            finish_reason=part.finish,
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=_completion_tokens(usage, choices, part),
            engine_prompt_ids=_ids(part.prompt_ids or prompt_ids or sgl_prompt or beside),
            engine_prompt_beside=not (part.prompt_ids or prompt_ids or sgl_prompt) and bool(beside),
            engine_completion_ids=list(part.ids) if part.ids else None,
            engine_logprobs=part.logprobs_if_aligned(),
        ))
    return out


# ---------------------------------------------------------------- Completions


def _parse_completions(rec: ExchangeRecord, request: dict[str, Any], raw: bytes, streamed: bool,
                       images: list[Image]) -> list[Call | Skip]:
    prompt = request.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    request_ids = prompt if isinstance(prompt, list) and all(isinstance(i, int) for i in prompt) else None
    if request_ids is None and not isinstance(prompt, str):
        raise Skip("unsupported_request", "completions prompt is neither text nor token ids")
    choices: dict[int, _Choice] = {}
    usage: dict[str, Any] = {}
    bodies = [c for _, c in _sse_json(raw)] if streamed else [_json_body(raw, "response", loads_answer)]
    for body in bodies:
        if not isinstance(body, dict):
            continue
        usage = body.get("usage") or usage
        for choice in body.get("choices") or []:
            part = choices.setdefault(choice.get("index", 0), _Choice())
            part.text.append(choice.get("text") or "")
            part.prompt_ids = part.prompt_ids or body.get("prompt_token_ids") or choice.get("prompt_token_ids")
            part.ids.extend(choice.get("token_ids") or [])
            lp = choice.get("logprobs") or {}
            part.logprobs.extend(float(x) for x in lp.get("token_logprobs") or [])
            part.finish = choice.get("finish_reason") or part.finish
    if not choices:
        raise Skip("no_choices", "completions response has no choices")
    out: list[Call | Skip] = []
    for base, part in _finished(rec, "completions", streamed, choices, out):
        text = "".join(part.text)
        out.append(Call(
            **base,
            messages=None,
            tools=None,
            completion=assistant_message(text, None, []),
            prompt_text=prompt if isinstance(prompt, str) else None,
            completion_text=text,
            finish_reason=part.finish,
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=_completion_tokens(usage, choices, part),
            engine_prompt_ids=_ids(request_ids or part.prompt_ids),
            engine_completion_ids=part.ids or None,
            engine_logprobs=part.logprobs_if_aligned(),
        ))
    return out


# ---------------------------------------------------------------- Responses


def _proxy_conversion(convert: Callable[[dict, Drops], list[dict]], body: dict[str, Any]) -> list[dict[str, Any]]:
    """What the proxy sends the engine for this part of a client request (`openforge.protocols`), so a call
    it translated and one it forwarded read alike; what the engine could not take is a Skip."""
    try:
        return convert(body, Drops())
    except ProtocolError as e:
        raise Skip("unsupported_request", e.message) from None


def _parse_responses(rec: ExchangeRecord, request: dict[str, Any], raw: bytes, streamed: bool,
                     images: list[Image]) -> list[Call | Skip]:
    if streamed:
        final, done_items = None, []
        for name, ev in _sse_json(raw):
            kind = ev.get("type") or name
            if kind in ("response.completed", "response.incomplete"):
                final = ev.get("response")
            elif kind == "response.failed":
                raise Skip("engine_error", json.dumps(ev.get("response", {}).get("error"))[:300])
            elif kind == "response.output_item.done":
                done_items.append(ev.get("item") or {})
        if final is None:
            raise Skip("truncated_stream", "stream ended without response.completed")
        if not final.get("output"):
            final["output"] = done_items
    else:
        final = _json_body(raw, "response")
        if not isinstance(final, dict) or "output" not in final:
            raise Skip("no_choices", "responses body has no output")
    messages = _chat_messages({"messages": _proxy_conversion(responses.messages, request)}, images)
    output = _proxy_conversion(responses.messages, {"input": final.get("output") or []})
    produced = _chat_messages({"messages": output}, images)
    completion = produced[-1] if produced else assistant_message("", None, [])
    tools = _proxy_conversion(responses.tools, request)
    usage = final.get("usage") or {}
    has_calls = bool(completion.get("tool_calls"))
    prompt_ids, completion_ids = engine_ids.vllm_responses_ids(final)
    return [Call(
        **_base(rec, 0, "responses", streamed),
        messages=messages,
        tools=tools or None,
        completion=completion,
        finish_reason="tool_calls" if has_calls else final.get("status"),
        prompt_tokens=usage.get("input_tokens"),
        completion_tokens=usage.get("output_tokens"),
        engine_prompt_ids=prompt_ids,
        engine_completion_ids=completion_ids,
    )]


# ---------------------------------------------------------------- Anthropic Messages


def _parse_anthropic(rec: ExchangeRecord, request: dict[str, Any], raw: bytes, streamed: bool,
                     images: list[Image]) -> list[Call | Skip]:
    if streamed:
        blocks: dict[int, dict[str, Any]] = {}
        partial: dict[int, list[str]] = {}
        stop, stopped = None, False
        usage: dict[str, Any] = {}
        for name, ev in _sse_json(raw):
            kind = ev.get("type") or name
            if kind == "message_start":
                usage.update((ev.get("message") or {}).get("usage") or {})
            elif kind == "content_block_start":
                blocks[ev["index"]] = dict(ev.get("content_block") or {})
                partial[ev["index"]] = []
            elif kind == "content_block_delta":
                b, d = blocks.setdefault(ev["index"], {}), ev.get("delta") or {}
                if d.get("type") == "text_delta":
                    b["text"] = b.get("text", "") + d.get("text", "")
                elif d.get("type") == "thinking_delta":
                    b["thinking"] = b.get("thinking", "") + d.get("thinking", "")
                elif d.get("type") == "input_json_delta":
                    partial.setdefault(ev["index"], []).append(d.get("partial_json", ""))
            elif kind == "message_delta":
                stop = (ev.get("delta") or {}).get("stop_reason") or stop
                usage.update(ev.get("usage") or {})
            elif kind == "message_stop":
                stopped = True
        if not stopped and stop is None:
            raise Skip("truncated_stream", "stream ended without message_stop")
        content = []
        for i in sorted(blocks):
            b = blocks[i]
            if b.get("type") == "tool_use" and partial.get(i):
                b["input"] = _json_body("".join(partial[i]).encode(), "tool_use input")
            content.append(b)
    else:
        body = _json_body(raw, "response")
        if not isinstance(body, dict) or body.get("type") == "error" or "content" not in body:
            raise Skip("no_choices", f"anthropic body has no content: {raw[:200]!r}")
        content, stop, usage = body["content"], body.get("stop_reason"), body.get("usage") or {}
    tools = _proxy_conversion(anthropic.tools, request)
    answer = [{"role": "assistant", "content": content}]
    return [Call(
        **_base(rec, 0, "anthropic", streamed),
        messages=_chat_messages({"messages": _proxy_conversion(anthropic.messages, request)}, images),
        tools=tools or None,
        completion=_chat_messages({"messages": _proxy_conversion(anthropic.messages, {"messages": answer})}, images)[0],
        finish_reason=stop,
        prompt_tokens=usage.get("input_tokens"),
        completion_tokens=usage.get("output_tokens"),
    )]


_PARSERS = {
    "chat": _parse_chat,
    "completions": _parse_completions,
    "responses": _parse_responses,
    "anthropic": _parse_anthropic,
}
