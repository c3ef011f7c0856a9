"""How each episode's calls were answered, for `GET /openforge/v1/episodes/<episode>/calls` (docs/control-api.md).

The episode process asks this after its agent exited: an engine or proxy error answer (5xx) to one of its
calls makes the episode an infrastructure failure, not the policy's (docs/rollouts.md, Failure classes).
Counted as records are written, since the proxy started (not read back from the flow directory); the oldest
episodes are forgotten past `MAX_EPISODES`.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from openforge.protocols.control import CallError, CallsAnswer

from .bodies import json_object
from .errors import error_message
from .exchange import Exchange, ResponseParts

MAX_EPISODES = 100_000
MAX_ERRORS = 8  # error answers kept per episode, the last ones
MAX_MESSAGE = 500


class EpisodeCalls:
    """episode -> (answers by status, the last error answers)."""

    def __init__(self) -> None:
        self._episodes: OrderedDict[str, tuple[Counter[str], list[CallError]]] = OrderedDict()

    def add(self, ex: Exchange, response: ResponseParts | None) -> None:
        """Count a written exchange record of an episode: its status ("none" when it got no answer)."""
        if not ex.episode:
            return
        entry = self._episodes.get(ex.episode)
        if entry is None:
            entry = self._episodes[ex.episode] = (Counter(), [])
            if len(self._episodes) > MAX_EPISODES:
                self._episodes.popitem(last=False)
        status = response.status if response is not None else None
        entry[0][str(status) if status is not None else "none"] += 1
        if status is None or status >= 400 or ex.error:
            message = ex.error or error_message(json_object(response.body if response is not None else None)) or ""
            entry[1].append({"status": status, "message": message[:MAX_MESSAGE]})
            del entry[1][:-MAX_ERRORS]

    def answer(self, episode: str) -> CallsAnswer:
        statuses, errors = self._episodes.get(episode, (Counter(), []))
        return {"episode": episode, "calls": sum(statuses.values()), "statuses": dict(statuses), "errors": errors}
