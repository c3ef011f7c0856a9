"""How each episode's calls went, for `GET /openforge/v1/episodes/<episode>/calls` (docs/control-api.md), and
the episode's budget of calls and tokens (`openforge_episode_max_calls`, `openforge_episode_max_tokens`).

The episode process asks this after its agent exited: an engine or proxy error answer (5xx) to one of its
calls makes the episode an infrastructure failure, not the policy's; calls refused past the budget or outside
its key's scope make it the agent's (docs/rollouts.md, Failure classes and Limits). Counted as calls are
admitted and records written, since the proxy started (not read back from the flow directory); the oldest
episodes are forgotten past `MAX_EPISODES`.
"""

from __future__ import annotations

import re
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from openforge.protocols.control import CallError, CallsAnswer

from .bodies import json_object
from .errors import error_message
from .exchange import Exchange, ResponseParts

MAX_EPISODES = 100_000
MAX_ERRORS = 8  # error answers kept per episode, the last ones
MAX_MESSAGE = 500
# Token counts of an answer's usage (Chat and Completions; Responses and Anthropic); an SSE stream repeats them.
_USAGE = re.compile(rb'"(prompt_tokens|completion_tokens|input_tokens|output_tokens)"\s*:\s*(\d{1,12})')


@dataclass
class _Episode:
    statuses: Counter[str] = field(default_factory=Counter)
    errors: list[CallError] = field(default_factory=list)
    admitted: int = 0
    tokens: int = 0  # counted while a token budget is set
    refused_budget: int = 0
    refused_scope: int = 0


def usage_tokens(response: ResponseParts) -> int:
    """Prompt + completion tokens an engine answer reports (the largest count of each kind it names): a stream
    says them in its first events (Anthropic's `message_start`) and its last (the usage chunk)."""
    chunks = response.chunks
    parts = [response.body or b""] if chunks is None else [b"".join(c[1] for c in chunks[:2]),
                                                           b"".join(c[1] for c in chunks[2:][-8:])]
    counts: dict[bytes, int] = {}
    for part in parts:
        for name, value in _USAGE.findall(part):
            counts[name] = max(counts.get(name, 0), int(value))
    return sum(counts.values())


class EpisodeCalls:
    """episode -> how its calls were answered, what they used, and what was refused."""

    def __init__(self) -> None:
        self._episodes: OrderedDict[str, _Episode] = OrderedDict()
        self.count_tokens = False  # read answers' usage: only while a token budget is set (it scans the answer)

    def _entry(self, episode: str) -> _Episode:
        entry = self._episodes.get(episode)
        if entry is None:
            entry = self._episodes[episode] = _Episode()
            if len(self._episodes) > MAX_EPISODES:
                self._episodes.popitem(last=False)
        return entry

    def admit(self, episode: str | None, max_calls: int, max_tokens: int) -> str | None:
        """Count a call of `episode` going on to the engine; why not instead, when it is past its budget (the
        refusal is counted). A call admitted under the budget may finish past it."""
        if not episode or not (max_calls or max_tokens):
            return None
        entry = self._entry(episode)
        why = None
        if max_calls and entry.admitted >= max_calls:
            why = f"OpenForge: episode {episode!r} has made its {max_calls} calls (openforge_episode_max_calls)"
        elif max_tokens and entry.tokens >= max_tokens:
            why = (f"OpenForge: episode {episode!r} has used {entry.tokens} of its {max_tokens} tokens "
                   "(openforge_episode_max_tokens)")
        if why is None:
            entry.admitted += 1
        else:
            entry.refused_budget += 1
        return why

    def refused_scope(self, episode: str) -> None:
        """Count a call made with `episode`'s key outside what the key opens."""
        self._entry(episode).refused_scope += 1

    def add(self, ex: Exchange, response: ResponseParts | None) -> None:
        """Count a written exchange record of an episode: its status ("none" when it got no answer) and the
        tokens its answer used."""
        if not ex.episode:
            return
        entry = self._entry(ex.episode)
        status = response.status if response is not None else None
        entry.statuses[str(status) if status is not None else "none"] += 1
        if self.count_tokens and response is not None and status == 200:
            entry.tokens += usage_tokens(response)
        if status is None or status >= 400 or ex.error:
            message = ex.error or error_message(json_object(response.body if response is not None else None)) or ""
            entry.errors.append({"status": status, "message": message[:MAX_MESSAGE]})
            del entry.errors[:-MAX_ERRORS]

    def answer(self, episode: str) -> CallsAnswer:
        entry = self._episodes.get(episode) or _Episode()
        return {"episode": episode, "calls": sum(entry.statuses.values()), "statuses": dict(entry.statuses),
                "errors": list(entry.errors), "tokens": entry.tokens, "refused_budget": entry.refused_budget,
                "refused_scope": entry.refused_scope}
