"""What a request is: episode / role / toolchain, secrets masked, errors in the client's shape (the protocol
by path and the path prefixes: `openforge.protocols.endpoints`).

Pure functions over strings and header lists, so they are cheap on the hot path and easy to test.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterable
from urllib.parse import unquote, unquote_plus

# Credentials: masked in records and logs, never forwarded to the engine. Names ending like an API key or a
# token count too (`x-goog-api-key`, Azure's `api-key`, `x-auth-token`).
SECRET_HEADERS = frozenset({"authorization", "x-api-key", "api-key", "x-goog-api-key", "proxy-authorization",
                            "cookie", "set-cookie"})
_SECRET_SUFFIXES = ("api-key", "apikey", "api_key", "-token", "-secret", "authorization")
SECRET_PARAMS = frozenset({"key", "api_key", "api-key", "apikey", "x-api-key", "access_token", "token"})
# Our own control headers never go to the engine either.
DROP_UPSTREAM = frozenset({"x-openforge-episode", "x-openforge-role"})
DROP_UPSTREAM_BYTES = frozenset(name.encode() for name in DROP_UPSTREAM)
DROP_UPSTREAM_LLM_BYTES = DROP_UPSTREAM_BYTES | {b"accept-encoding"}  # replaced by identity: we read the answer

# User-Agent fragments (lower case) -> toolchain name; first match wins.
_TOOLCHAINS = (
    ("claude-cli", "claude-code"),
    ("claude-code", "claude-code"),
    ("codex", "codex"),
    ("qwencode", "qwen-code"),
    ("qwen-code", "qwen-code"),
    ("mini-swe-agent", "mini-swe-agent"),
    ("litellm", "litellm"),
    ("openai/python", "openai-python"),
    ("openai/js", "openai-js"),
    ("anthropic/python", "anthropic-python"),
    ("anthropic/js", "anthropic-js"),
    ("curl/", "curl"),
    ("python-httpx", "httpx"),
)


_SECRET_NAMES: dict[bytes, bool] = {}  # header name -> is_secret_header, cached: checked per header per call


def is_secret_header(name: bytes) -> bool:
    """Whether a (raw) header name carries a credential."""
    secret = _SECRET_NAMES.get(name)
    if secret is None:
        n = name.decode("latin-1").lower()
        secret = n in SECRET_HEADERS or n.endswith(_SECRET_SUFFIXES)
        if len(_SECRET_NAMES) < 4096:  # clients choose header names: bound what is kept
            _SECRET_NAMES[name] = secret
    return secret


_PATH_TOKEN = re.compile(r"(?<=/k/)[^/?#]+")
_MAYBE_SECRET_PARAM = re.compile(r"(?i)key|token|%")  # every name in SECRET_PARAMS has one, or is %-encoded


def _is_secret_param(part: str) -> bool:
    return unquote_plus(part.partition("=")[0]).lower() in SECRET_PARAMS


def public_query(query: str) -> str:
    """A query string without its credential parameters (`?key=`, `?api_key=`, ...), the rest unchanged."""
    if not _MAYBE_SECRET_PARAM.search(query):
        return query
    return "&".join(part for part in query.split("&") if not _is_secret_param(part))


def masked_url(url: str) -> str:
    """A URL with its `/k/<token>/` prefix and credential query parameters masked, for records and logs."""
    base, sep, query = url.partition("?")
    if "/k/" not in base and not _MAYBE_SECRET_PARAM.search(query):  # the usual case, checked cheaply
        return url
    base = _PATH_TOKEN.sub(lambda m: mask(unquote(m.group())), base)
    if sep:
        query = "&".join(f"{part.partition('=')[0]}={mask(unquote_plus(part.partition('=')[2]))}"
                         if _is_secret_param(part) else part for part in query.split("&"))
    return base + sep + query


# C0 and C1 controls, line and paragraph separators, and the invisible format characters that reorder or hide
# text on a terminal: bidi marks, embeddings, overrides and isolates (U+202E shows `exe.txt` as `txt.exe`),
# zero-width characters and the byte-order mark.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def printable(text: str) -> str:
    """`text` with control, bidi and zero-width characters as `\\xNN` / `\\uNNNN`: a logged field cannot
    forge a line, reorder what the operator reads, or reach the terminal as an escape sequence."""
    if not _CONTROL.search(text):
        return text
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                        else f"\\u{ord(m.group()):04x}", text)


def proxy_auth_user(value: str | None) -> str | None:
    """The user name of a `Proxy-Authorization: Basic ...` header, else None."""
    if not value or not value[:6].lower() == "basic ":
        return None
    try:
        user = base64.b64decode(value[6:].strip(), validate=True).decode("utf-8").split(":", 1)[0]
    except (binascii.Error, UnicodeDecodeError):
        return None
    return user or None


def toolchain(user_agent: str | None) -> str | None:
    if not user_agent:
        return None
    ua = user_agent.lower()
    for fragment, name in _TOOLCHAINS:
        if fragment in ua:
            return name
    return ua.split("/", 1)[0][:40] or None


def mask(value: str) -> str:
    """`sk-a…wxyz`: first and last 4 characters of a secret (of the token after a `Bearer `-like scheme)."""
    scheme, sep, token = value.partition(" ")
    if not sep:
        scheme, token = "", value
    else:
        scheme += " "
    shown = f"{token[:4]}…{token[-4:]}" if len(token) > 12 else "…"
    return scheme + shown


def header_map(fields: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """Lower-case name -> value of mitmproxy's raw `Headers.fields`, repeated headers folded with ", " as
    `Headers.get` does."""
    out: dict[str, str] = {}
    for k, v in fields:
        name, value = k.decode("utf-8", "surrogateescape").lower(), v.decode("utf-8", "surrogateescape")
        out[name] = f"{out[name]}, {value}" if name in out else value
    return out


def is_event_stream(fields: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether raw header fields say `content-type: text/event-stream` (one pass, no per-field decoding)."""
    for k, v in fields:
        if k.lower() == b"content-type":
            return v.lstrip().lower().startswith(b"text/event-stream")
    return False


def masked_fields(fields: Iterable[tuple[bytes, bytes]]) -> list[list[str]]:
    """Headers as recorded: mitmproxy's raw `Headers.fields` decoded as mitmproxy does, secrets masked."""
    return [[k.decode("utf-8", "surrogateescape"),
             mask(v.decode("utf-8", "surrogateescape")) if is_secret_header(k)
             else v.decode("utf-8", "surrogateescape")] for k, v in fields]

