"""Protocol translation: Anthropic Messages / OpenAI Responses <-> OpenAI Chat Completions.

Why: engines return exact token ids only on Chat Completions (docs/engines.md), while Claude Code speaks
Anthropic Messages and Codex speaks Responses. The addon sends those calls to the engine as Chat
Completions and translates the answer back, streamed as the engine produces it. Each protocol module in
`openforge.protocols` owns both directions (the same request conversion reconstruct trains on); this
module picks the module for a call and decides whether to translate at all.

Public interface (wired in by addons/proxy.py and addons/bodies.py): `request_to_chat`, `stream_translator`,
`response_from_chat`, `error_body`, `count_tokens_request`, `count_tokens_response`, `needs_translation`,
`TranslationError`.
"""

from __future__ import annotations

from types import ModuleType

from openforge.choices import Translate
from openforge.protocols import anthropic, errors, responses
from openforge.protocols.chat import ChatStream, Drops
from openforge.protocols.errors import ProtocolError as TranslationError

CLIENT_PROTOCOLS = ("anthropic", "responses")
_MODULES: dict[str, ModuleType] = {"anthropic": anthropic, "responses": responses}


def needs_translation(protocol: str, engine_profile: str, mode: str) -> bool:
    """Whether a call on `protocol` should go to the engine as Chat Completions.

    `auto` translates whenever the profile cannot return token ids and logprobs on that protocol, which
    today is every profile (docs/engines.md: vLLM's Responses gives ids but no logprobs for a streamed or
    tool-calling answer), so it translates every Messages and Responses call, as `always` does.
    """
    if mode not in tuple(Translate):
        raise ValueError(f"translate mode must be one of {', '.join(Translate)}, got {mode!r}")
    return protocol in CLIENT_PROTOCOLS and mode != "never"


def _module(protocol: str) -> ModuleType:
    if protocol not in _MODULES:
        raise ValueError(f"no translation for protocol {protocol!r}")
    return _MODULES[protocol]


def _object(body: object) -> dict:
    if not isinstance(body, dict):
        raise TranslationError(400, "request body must be a JSON object")
    return body


def request_to_chat(protocol: str, body: dict) -> tuple[dict, list[str]]:
    """Translate a client request body into a Chat Completions body; also return the dropped field names."""
    body = _object(body)
    drops = Drops()
    chat: dict = _module(protocol).request(body, drops)
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat, drops.names


def response_from_chat(protocol: str, chat_response: dict, request_body: dict) -> dict:
    """Translate a non-streaming Chat Completions answer into the client's protocol."""
    answer: dict = _module(protocol).answer(chat_response, request_body)
    return answer


def stream_translator(protocol: str, request_body: dict) -> ChatStream:
    """A translator whose `feed(bytes) -> bytes` / `finish() -> bytes` turn engine SSE into client SSE."""
    stream: ChatStream = _module(protocol).Stream(request_body)
    return stream


def error_body(protocol: str, status: int, message: str) -> dict:
    """An error object in the client protocol's own shape."""
    return errors.error_body(protocol, status, message)


def count_tokens_request(body: dict) -> dict:
    """The Chat Completions body whose `usage.prompt_tokens` answers Anthropic count_tokens."""
    return anthropic.count_tokens_request(_object(body))


def count_tokens_response(chat_response: dict) -> dict:
    """Anthropic's count_tokens answer from the engine's answer to `count_tokens_request`."""
    return anthropic.count_tokens_answer(chat_response)
