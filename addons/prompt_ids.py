"""The engine's own prompt ids for a call whose answer carries none (llama.cpp's Chat endpoint).

llama.cpp returns completion ids (in its logprobs entries) but never the prompt's. Its `/apply-template`
renders a Chat body with the same code as its Chat endpoint (template, tools, generation prompt), and its
`/tokenize` (`add_special`, `parse_special`: how the Chat endpoint tokenizes that text) gives the ids, so the
proxy asks for them beside the call and records them (`engine_prompt_ids`): reconstruct then uses the
engine's ids instead of rendering the prompt with another implementation of the template, which drifts
(docs/engines.md). Both requests run while the engine generates; the record waits for them.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

from openforge.choices import Profile

from . import options

TIMEOUT_S = 30.0  # both requests together; a template and a tokenization take milliseconds
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through HTTP(S)_PROXY


class PromptIdsError(Exception):
    """Why the engine gave no prompt ids (a sentence for the record's `engine_prompt_error`)."""


def wanted(s: options.Settings, profile: str, protocol: str) -> bool:
    """Whether to ask the engine for a call's prompt ids: a Chat call to llama.cpp, unless turned off."""
    return s.engine_prompt_ids and profile == Profile.llamacpp and protocol == "chat"


def start(s: options.Settings, body: bytes) -> asyncio.Future[list[int]]:
    """Ask the engine for the prompt ids of the Chat `body` it is sent, in a thread (the event loop never
    waits on the engine)."""
    future = asyncio.ensure_future(asyncio.to_thread(fetch, s, body))
    future.add_done_callback(_retrieved)
    return future


def _retrieved(future: asyncio.Future[list[int]]) -> None:
    """Mark a failure as seen: a call that ends before its ids are read (upstream error) logs nothing."""
    if not future.cancelled():
        future.exception()


def fetch(s: options.Settings, body: bytes) -> list[int]:
    """The engine's prompt ids for the Chat `body`: `/apply-template`, then `/tokenize`; PromptIdsError."""
    prompt = _post(s, "/apply-template", body).get("prompt")
    if not isinstance(prompt, str):
        raise PromptIdsError("the engine's /apply-template answered no prompt")
    request = {"content": prompt, "add_special": True, "parse_special": True}
    tokens = _post(s, "/tokenize", json.dumps(request).encode()).get("tokens")
    if not isinstance(tokens, list) or not tokens or not all(type(t) is int for t in tokens):
        raise PromptIdsError("the engine's /tokenize answered no token ids")
    return tokens


def _post(s: options.Settings, path: str, data: bytes) -> dict[str, Any]:
    url = f"{s.upstream_scheme}://{s.upstream_host}:{s.upstream_port}{s.upstream_prefix}{path}"
    headers = {"Content-Type": "application/json"}
    if s.upstream_key:
        headers["Authorization"] = f"Bearer {s.upstream_key}"
    try:
        with _OPENER.open(urllib.request.Request(url, data=data, headers=headers), timeout=TIMEOUT_S) as resp:
            answer = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raise PromptIdsError(f"the engine's {path} answered {e.code}") from None
    except (OSError, ValueError) as e:
        raise PromptIdsError(f"the engine's {path} failed: {type(e).__name__}: {e}") from None
    if not isinstance(answer, dict):
        raise PromptIdsError(f"the engine's {path} answered no JSON object")
    return answer


async def result(future: asyncio.Future[list[int]]) -> tuple[list[int] | None, str | None]:
    """(ids, None) or (None, why not), waiting at most `TIMEOUT_S` more."""
    try:
        return await asyncio.wait_for(asyncio.shield(future), TIMEOUT_S), None
    except PromptIdsError as e:
        return None, str(e)
    except TimeoutError:
        return None, f"the engine gave no prompt ids within {TIMEOUT_S:.0f} s"
