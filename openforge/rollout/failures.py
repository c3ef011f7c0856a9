"""Why an episode failed, and what its reward is then (docs/rollouts.md, Failure classes).

Every episode that did not end `ok` has a *class*: the agent's own failure, a timeout, the verifier's, the
engine's or proxy's, or the infrastructure's. A policy per class says whether it posts 0.0 (`zero`, trained
as the policy's mistake) or nothing (`drop`, left out of its GRPO group). Only the agent's failures score
0.0 by default: a slow machine, a dead engine or a broken verifier is not something the policy did (a verifier
the agent's workspace crashed, but that scores the pristine task, is the agent's failure: pristine.py).
Standard library only: the episode entrypoint imports this.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any


class EpisodeStatus(StrEnum):
    """How an episode ended (`EpisodeResult.status`): ok, or the failure it ended in."""

    OK = "ok"
    AGENT_FAILED = "agent_failed"
    TIMEOUT = "timeout"
    CRASHED = "crashed"
    VERIFY_FAILED = "verify_failed"
    ENGINE_ERROR = "engine_error"
    # a limit stopped the agent (docs/rollouts.md, Limits): the agent's failure, named in
    # `EpisodeResult.resource`: memory, pids, disk, output or calls
    RESOURCE = "resource"


POLICIES = ("zero", "drop")
CLASSES = ("agent", "timeout", "verifier", "engine", "infra")
DEFAULT_POLICY = {"agent": "zero", "timeout": "drop", "verifier": "drop", "engine": "drop", "infra": "drop"}
# status -> class, where nothing more is known (a timeout whose agent got no answer is `infra`: episode.py)
STATUS_CLASS: dict[str, str] = {EpisodeStatus.AGENT_FAILED: "agent", EpisodeStatus.TIMEOUT: "timeout",
                                EpisodeStatus.VERIFY_FAILED: "verifier", EpisodeStatus.ENGINE_ERROR: "engine",
                                EpisodeStatus.CRASHED: "infra", EpisodeStatus.RESOURCE: "agent"}
# An engine's 5xx that says it could not parse what the model generated (llama.cpp: a tool call that is not
# JSON): the model's mistake, so the agent's, not the engine's.
MODEL_OUTPUT_ERRORS = ("failed to parse tool call", "failed to parse input", "failed to parse arguments")


def policies(value: str | Mapping[str, str] | None) -> dict[str, str]:
    """The policy of every class from `value`: "default" or None (DEFAULT_POLICY), one policy for all
    ("zero"), a mapping of some classes (the rest default), or "zero,timeout=drop" (in order: a bare policy
    sets every class, class=policy one); ValueError saying why."""
    out = dict(DEFAULT_POLICY)
    if value is None or value == "default":
        return out
    if isinstance(value, str):
        items = [(k.strip(), v.strip()) if sep else ("", k.strip())
                 for k, sep, v in (part.partition("=") for part in value.split(",") if part.strip())]
    elif isinstance(value, Mapping):
        items = list(value.items())
    else:
        raise ValueError(f"expected a policy or a table of class = policy, not {value!r}")
    for cls, policy in items:
        if cls and cls not in CLASSES:
            raise ValueError(f"unknown failure class {cls!r} (known: {', '.join(CLASSES)})")
        if policy not in POLICIES:
            raise ValueError(f"{cls + ': ' if cls else ''}{policy!r} is not one of {', '.join(POLICIES)}")
        out.update({cls: policy} if cls else dict.fromkeys(CLASSES, policy))
    return out


def classify(result: Any) -> str | None:
    """The failure class of an `EpisodeResult` (None when it ended ok): its own, else its status's."""
    if result.status == EpisodeStatus.OK:
        return None
    return result.failure_class or STATUS_CLASS.get(result.status, "infra")


def reward_due(result: Any, on_failure: str | Mapping[str, str] | None) -> bool:
    """Whether the episode had to post a reward: the verifier's, or 0.0 for a class whose policy is zero."""
    cls = classify(result)
    return cls is None or result.reward is not None or policies(on_failure)[cls] == "zero"


def model_output_error(message: str) -> bool:
    return any(m in message.lower() for m in MODEL_OUTPUT_ERRORS)


def engine_failure(calls: Mapping[str, Any]) -> str | None:
    """What went wrong, when the proxy answered one of the episode's calls with an engine or proxy error
    (5xx) that is not about the model's own output; `calls` is the proxy's answer for the episode."""
    errors = [e for e in calls.get("errors") or [] if isinstance(e, dict)]
    infra = [e for e in errors if int(e.get("status") or 0) >= 500 and not model_output_error(str(e.get("message")))]
    statuses = {str(k): v for k, v in (calls.get("statuses") or {}).items()}
    failed = sum(n for k, n in statuses.items() if k.isdigit() and int(k) >= 500)
    if not failed or (errors and not infra and len(errors) >= failed):
        return None
    last = infra[-1] if infra else {}
    detail = f" (last: {last.get('status')} {str(last.get('message'))[:200]})" if last else ""
    return f"the engine or proxy failed {failed} of the episode's {calls.get('calls', failed)} calls{detail}"


def answered(calls: Mapping[str, Any]) -> int:
    """How many of the episode's calls got a 2xx answer."""
    return sum(n for k, n in (calls.get("statuses") or {}).items() if str(k).startswith("2"))


def model_output_errors(calls: Mapping[str, Any]) -> int:
    """How many of the episode's calls the engine refused because it could not parse the model's output."""
    return sum(1 for e in calls.get("errors") or [] if isinstance(e, dict) and int(e.get("status") or 0) >= 500
               and model_output_error(str(e.get("message"))))


def budget_refusals(calls: Mapping[str, Any]) -> int:
    """How many of the episode's calls the proxy refused past the episode's call or token budget
    (`refused_budget` in its calls answer; 0 from a proxy that keeps no budget)."""
    n = calls.get("refused_budget")
    return n if isinstance(n, int) and not isinstance(n, bool) else 0


def over_budget(calls: Mapping[str, Any], max_calls: int, max_tokens: int) -> str | None:
    """Why the episode went past its call or token budget (0: none), from the proxy's calls answer: the
    proxy refused calls past it, or (a proxy that keeps no budget) the episode made more calls, or used more
    tokens, than it allows; None when it did not."""
    if n := budget_refusals(calls):
        return f"the proxy refused {n} of its calls past the episode's budget"
    made, used = calls.get("calls"), calls.get("tokens")
    if max_calls and isinstance(made, int) and made > max_calls:
        return f"{made} calls, over the limit of {max_calls}"
    if max_tokens and isinstance(used, int) and used > max_tokens:
        return f"{used} tokens, over the limit of {max_tokens}"
    return None
