"""Whose crash a verifier's crash is: the verifier run on the pristine task (docs/rollouts.md, Failure classes).

A verifier that crashes, times out or hits a limit on the agent's workspace gives no reward. Were such an
episode always dropped, crashing would be free: a policy would learn to turn a sure 0.0 into no sample by
breaking the tests it fails (a verifier that imports the agent's code runs it). So the episode runs the
verifier once more on the task as it is before any agent (its files, its setup): when that scores (a finite
reward, 0.0 included) the verifier works and the agent's workspace broke it, the agent's failure; when it does
not, the task is broken, the verifier's.

The pristine task is the same for every episode of a task, so its verdict is made once per task and rollout:
the first episode that needs it makes it under an exclusive lock on `<pristine_dir>/<key>.lock` (key: the
task's content hash) and writes `<key>.json`; the others wait for the lock and read that. It runs in the
episode process, where the verdict is needed before the reward is posted, under the episode's sandbox and
limits: the pristine verifier must run exactly as the agent's did, or a crash of the machine's would pass
for the agent's. Standard library only: the episode entrypoint imports this.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from openforge.rollout.spec import Task

SCORES, FAILS = "scores", "fails"  # EpisodeResult.pristine


@dataclass(frozen=True)
class Verdict:
    """The verifier on the pristine task: its reward (None: it gave none, `why`), its seconds."""

    reward: float | None
    why: str = ""
    seconds: float = 0.0


def task_key(task: Task) -> str:
    """The task's content hash: the same task, the same key, whatever episode asks."""
    return hashlib.sha256(json.dumps(asdict(task), sort_keys=True).encode()).hexdigest()[:32]


def _read(path: Path) -> Verdict | None:
    try:
        data = json.loads(path.read_text())
        return Verdict(data["reward"], data.get("why", ""), data.get("seconds", 0.0))
    except (OSError, ValueError, TypeError, KeyError):
        return None  # none yet, or an interruption left it half-written: made again


def verdict(root: Path, task: Task, make: Callable[[Path], Verdict]) -> Verdict:
    """The pristine verdict of `task`: `root/<key>.json` when an episode of this rollout made it, else
    `make(root/<key>)` (a directory of its own for the pristine workspace), once, under the task's lock."""
    root.mkdir(parents=True, exist_ok=True)
    key = task_key(task)
    path = root / f"{key}.json"
    with open(root / f"{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, however this process ends
        found = _read(path)
        if found is None:
            found = make(root / key)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"task_id": task.id, **asdict(found)}))
            os.replace(tmp, path)
        return found
