"""Request and answer bodies: JSON read once, and the answer the client gets made from the engine's.

The engine's answer is recorded as received; the client gets it without the fields the proxy injected
(`strip_body`), or translated back into the protocol it spoke (`translate_body`); a call the proxy sent
unstreamed (`profiles.unstream`) is answered as the stream the client asked for (`restream_body`).
"""

from __future__ import annotations

import json
from typing import Any

from mitmproxy import http

from openforge.protocols import errors as protocol_errors
from openforge.protocols.engine_ids import body_has_token_ids, has_token_ids
from openforge.protocols.errors import ProtocolError

from . import profiles, restream, translate
from .errors import Refused, error_message
from .exchange import Exchange


def set_body(message: http.Message, data: bytes) -> None:
    """`message.content = data`, minus mitmproxy's per-call header scans when the body is not encoded."""
    fields = message.headers.fields
    names = [k.lower() for k, _ in fields]
    if b"content-encoding" in names:
        message.content = data  # mitmproxy re-encodes it
        return
    message.raw_content = data
    if b"transfer-encoding" not in names:
        length = str(len(data)).encode()
        message.headers.fields = tuple((k, length) if n == b"content-length" else (k, v)
                                       for (k, v), n in zip(fields, names))
        if b"content-length" not in names:
            message.headers.fields += ((b"content-length", length),)


def _parse_object(data: bytes | None) -> dict[str, Any] | None:
    """A JSON object, else None; RecursionError when nested too deeply for Python's parser."""
    if not data:
        return None
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def json_object(data: bytes | None) -> dict[str, Any] | None:
    """A JSON object, else None (also for a body nested too deeply to parse)."""
    try:
        return _parse_object(data)
    except RecursionError:
        return None


def request_json(data: bytes | None) -> dict[str, Any] | None:
    """A client's request as a JSON object, else None; refused when nested too deeply to parse: forwarded
    as it is, it would hand the engine what the proxy itself cannot read, and go unrecorded as a call."""
    try:
        return _parse_object(data)
    except RecursionError:
        raise Refused(400, "OpenForge: the request body is nested too deeply to parse",
                      "invalid_request_error") from None


def strip_body(resp: http.Response, ex: Exchange) -> bool:
    """Remove injected fields from a JSON answer (parsed once, for both jobs); whether it has token ids.

    Prompt ids we asked for are dropped unparsed: an agent's prompt has tens of thousands.
    """
    body = resp.content
    marks = profiles.markers(ex.injected) if resp.status_code == 200 else ()
    if not body or not any(m in body for m in marks):  # nothing of ours in it: leave the bytes alone
        return body_has_token_ids(body)
    try:
        obj, cut = (profiles.loads_without_prompt_ids(body) if "return_token_ids" in ex.injected
                    else (profiles.loads(body), False))
    except ValueError:
        return False
    if not isinstance(obj, dict):
        return False
    has_ids = cut or has_token_ids(obj)
    if profiles.strip(obj, ex.injected):
        set_body(resp, profiles.encode_json(obj).encode())
    return has_ids


def translate_body(resp: http.Response, ex: Exchange) -> None:
    """Turn the engine's Chat Completions answer (or error) into the protocol the client spoke."""
    assert ex.translated is not None
    source = ex.translated["from"]
    client = "anthropic" if source == "anthropic_count_tokens" else source
    engine = json_object(resp.content)
    try:
        if resp.status_code >= 400 or engine is None:
            message = error_message(engine) or resp.get_text(strict=False) or f"engine answered {resp.status_code}"
            out = protocol_errors.error_body(client, resp.status_code if resp.status_code >= 400 else 502, message)
            if resp.status_code < 400:
                resp.status_code = 502
        elif source == "anthropic_count_tokens":
            out = translate.count_tokens_response(engine)
        else:
            out = translate.response_from_chat(source, engine, ex.client_body or {})
    except ProtocolError as e:
        out, resp.status_code = protocol_errors.error_body(client, e.status, e.message), e.status
        ex.error = e.message
    resp.content = json.dumps(out, ensure_ascii=False).encode()
    resp.headers["content-type"] = "application/json"


def restream_body(resp: http.Response, ex: Exchange) -> bool:
    """Answer an unstreamed call (`ex.restream`) as the stream the client asked for: the engine's Chat answer
    without injected fields as Chat events, or translated into the client's protocol's events. An error
    answer stays a JSON error, as the engine gives it to a streamed call. Returns whether it has token ids."""
    if ex.translated is None:
        has_ids = strip_body(resp, ex)
        answer = json_object(resp.content) if resp.status_code == 200 else None
        if answer is not None:
            _set_stream(resp, restream.chat_events(answer, ex.restream_usage))
        return has_ids
    has_ids = body_has_token_ids(resp.content)
    answer = json_object(resp.content) if resp.status_code == 200 else None
    if answer is None or not answer.get("choices"):
        translate_body(resp, ex)
        return has_ids
    translator = translate.stream_translator(ex.translated["from"], ex.client_body or {})
    _set_stream(resp, translator.feed(restream.chat_events(answer, True)) + translator.finish())
    return has_ids


def _set_stream(resp: http.Response, events: bytes) -> None:
    resp.headers["content-type"] = "text/event-stream"
    set_body(resp, events)
