"""A run in which no episode succeeded, said in one line with its likely cause.

Why: when the engine refuses every call (a request shape it does not take, a prompt over its context), each
CLI exits non-zero and each episode is scored 0; a summary of zeros reads like a weak policy. The cause is in
what the CLI printed: the engine's error answer as the CLI showed it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from openforge.rollout.bounded import read_tail
from openforge.rollout.failures import EpisodeStatus
from openforge.rollout.spec import EpisodeResult

MAX_CAUSE = 300  # characters of the CLI's own line kept in the message
READ_TAIL = 256 * 1024  # bytes read from the end of each output file


def every_episode_failed(results: Sequence[EpisodeResult], episodes_dir: Path) -> str | None:
    """None if any episode finished `ok` (or there were none); else 'every episode failed (STATUS N, ...):
    REASON; the agent printed: LINE' for the first failed episode."""
    if not results or any(r.status == EpisodeStatus.OK for r in results):
        return None
    counts = ", ".join(f"{status} {n}" for status, n in sorted(Counter(r.status for r in results).items()))
    first = results[0]
    message = f"every episode failed ({counts}); {first.episode}: {first.reason or first.status}"
    cause = agent_error(episodes_dir / first.episode)
    return f"{message}; the agent printed: {cause}" if cause else message


def agent_error(episode_dir: Path) -> str:
    """The last line of the agent's output that mentions an error (stdout first: CLIs print their JSON
    events there), else the last line of its stderr; '' when it printed nothing."""
    lines: dict[str, list[str]] = {}
    for name in ("agent.stdout", "agent.stderr"):
        text = read_tail(episode_dir / name, READ_TAIL)
        lines[name] = [line.strip() for line in text.splitlines() if line.strip()]
    for name in ("agent.stdout", "agent.stderr"):
        errors = [line for line in lines[name] if "error" in line.lower()]
        if errors:
            return _short(errors[-1])
    return _short(lines["agent.stderr"][-1]) if lines["agent.stderr"] else ""


def _short(line: str) -> str:
    return line if len(line) <= MAX_CAUSE else line[:MAX_CAUSE] + "..."
