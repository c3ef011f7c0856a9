"""Calibration: how often the policy solves each task, and which tasks are worth training on (docs/tasks.md).

A GRPO group whose attempts all pass, or all fail, has equal rewards and teaches nothing; so a task is kept
when its pass rate lies in a band (bounds inclusive). The pass rate counts only the attempts that say
something about the policy: an episode whose failure class's policy is `drop` (by default a timeout, a
verifier, engine or infrastructure failure: openforge/rollout/failures.py) is not an attempt, one whose
class's policy is `zero` (by default the agent's own failure) is a failed attempt. The same rule decides
which episodes count for the mean reward (`runner.counted_reward`), so the two figures always agree.

`openforge tasks calibrate` runs the policy through `openforge.rollout.run`; `openforge rl` uses `pass_rates`
and `in_band` on the rollouts each iteration already ran.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from openforge.protocols.control import ControlClient, ControlError
from openforge.rollout.run_failure import every_episode_failed
from openforge.rollout.runner import OnFailure, RolloutError, counted_reward, passed, prepare, tokens
from openforge.rollout.spec import EpisodeResult
from openforge.rollout.tasks import TaskFileError, read_tasks

DEFAULT_BAND = (0.1, 0.9)
KEPT, TOO_EASY, TOO_HARD, UNMEASURED = "kept", "too easy", "too hard", "no attempt counted"


class CalibrationFailed(RuntimeError):
    """Every episode failed (usually the engine or the set-up, not the policy): no pass rate means anything."""


def parse_band(value: str | Sequence[Any]) -> tuple[float, float]:
    """`"0.1,0.9"` or `[0.1, 0.9]` -> (lo, hi) with 0 <= lo <= hi <= 1; ValueError saying why."""
    parts = value.split(",") if isinstance(value, str) else list(value)
    try:
        if len(parts) != 2 or any(isinstance(p, bool) for p in parts):
            raise ValueError
        lo, hi = (float(p) for p in parts)
    except (TypeError, ValueError):
        raise ValueError(f"the band is two pass rates LO,HI (e.g. 0.1,0.9), not {value!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and 0 <= lo <= hi <= 1):
        raise ValueError(f"the band needs 0 <= LO <= HI <= 1, not {lo:g},{hi:g}")
    return lo, hi


@dataclass(frozen=True)
class TaskRate:
    """One task's calibration: `attempts` counted (the policy's), `passed` among them, `episodes` run."""

    task_id: str
    episodes: int
    attempts: int
    passed: int
    mean_reward: float | None

    @property
    def pass_rate(self) -> float | None:
        return round(self.passed / self.attempts, 6) if self.attempts else None


def pass_rates(results: Iterable[EpisodeResult], threshold: float, on_failure: OnFailure) -> dict[str, TaskRate]:
    """Per task (first-seen order): the counted attempts (those with a `counted_reward`), how many passed
    (`runner.passed`: ok with a reward >= threshold), and their mean reward."""
    by_task: dict[str, list[EpisodeResult]] = defaultdict(list)
    for r in results:
        by_task[r.task_id].append(r)
    rates = {}
    for task_id, group in by_task.items():
        counted = [(r, x) for r in group if (x := counted_reward(r, on_failure)) is not None]
        mean = round(sum(x for _, x in counted) / len(counted), 6) if counted else None
        rates[task_id] = TaskRate(task_id, len(group), len(counted), sum(passed(r, threshold) for r, _ in counted),
                                  mean)
    return rates


def verdict(pass_rate: float | None, band: tuple[float, float]) -> str:
    """KEPT inside the band (bounds inclusive), TOO_EASY above it, TOO_HARD below, UNMEASURED with no
    counted attempt."""
    if pass_rate is None:
        return UNMEASURED
    lo, hi = band
    return TOO_EASY if pass_rate > hi else TOO_HARD if pass_rate < lo else KEPT


def out_of_band(rates: dict[str, TaskRate], band: tuple[float, float]) -> dict[str, str]:
    """{task id: why} for the tasks whose pass rate lies outside `band`: 'too easy: pass rate 1.00 of 4
    attempts' (a task with no attempt counted is not among them: nothing says it left)."""
    out = {}
    for task_id, rate in rates.items():
        why = verdict(rate.pass_rate, band)
        if why in (TOO_EASY, TOO_HARD):
            out[task_id] = f"{why}: pass rate {rate.pass_rate:.2f} of {rate.attempts} attempts"
    return out


def policy_version(proxy: str, client_token: str | None = None, timeout: float = 10.0) -> int | None:
    """The policy version the proxy stamps on new calls (`GET /openforge/v1/policy`), None when it does not
    say (an older proxy, or no answer)."""
    try:
        version = ControlClient(proxy, tokens(client_token, None)[0], timeout=timeout, tries=1).policy().get("version")
    except ControlError:
        return None
    return version if isinstance(version, int) and not isinstance(version, bool) else None


@dataclass
class Calibration:
    """What `calibrate` did: every task's rate and verdict (task file order), where the kept ones went."""

    out: Path
    rollout_dir: Path
    band: tuple[float, float]
    policy: int | None
    rates: list[TaskRate] = field(default_factory=list)
    verdicts: dict[str, str] = field(default_factory=dict)

    @property
    def kept(self) -> list[str]:
        return [r.task_id for r in self.rates if self.verdicts[r.task_id] == KEPT]

    def to_json(self) -> str:
        return json.dumps({"out": str(self.out), "band": list(self.band), "calibrated_at_policy": self.policy,
                           "tasks": [asdict(r) | {"pass_rate": r.pass_rate, "verdict": self.verdicts[r.task_id]}
                                     for r in self.rates]}, indent=1)


def calibrated_lines(path: Path, rates: dict[str, TaskRate], keep: set[str], policy: int | None) -> str:
    """The kept tasks' lines of the task file at `path`, as written there (fields and order unchanged), each
    with `pass_rate`, `mean_reward`, `attempts` and `calibrated_at_policy` set in its metadata."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        obj = json.loads(line)
        rate = rates.get(obj["id"])
        if obj["id"] not in keep or rate is None:
            continue
        obj["metadata"] = {**obj.get("metadata", {}), "pass_rate": rate.pass_rate, "mean_reward": rate.mean_reward,
                           "attempts": rate.attempts, "calibrated_at_policy": policy}
        lines.append(json.dumps(obj) + "\n")
    return "".join(lines)


def write_atomically(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file beside it and a rename: never half-written."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def calibrate(tasks: str | Path, toolchains: Sequence[str], *, proxy: str, out: str | Path, attempts: int,
              band: tuple[float, float] = DEFAULT_BAND, rollout_dir: str | Path | None = None,
              on_start: Callable[[int], None] = lambda n: None,
              on_done: Callable[[EpisodeResult], None] = lambda r: None, **rollout: Any) -> Calibration:
    """Run every task `attempts` times per toolchain (`openforge.rollout.run`, with `rollout`'s other
    arguments: concurrency, on_failure, pass_threshold, sandbox, tokens), then write the tasks whose pass rate
    lies in `band` to `out` with their calibration in `metadata`, and every task's figures to
    `rollout_dir/calibration.json` (default: OUT.rollout/ beside `out`). RolloutError for bad input, as
    `run` raises it (nothing run, nothing written); CalibrationFailed when every episode failed (nothing
    written). `on_start` gets the number of episodes planned, `on_done` each result. The policy version is
    the proxy's as the run starts."""
    from openforge.rollout import run

    tasks, out = Path(tasks), Path(out)
    rollout_dir = Path(rollout_dir) if rollout_dir else out.with_name(out.name + ".rollout")
    try:
        task_list = read_tasks(tasks)
    except TaskFileError as e:
        raise RolloutError(str(e)) from None
    _, specs = prepare(task_list, toolchains, proxy=proxy, out=rollout_dir, attempts=attempts, **rollout)
    on_start(len(specs))
    policy = policy_version(proxy, rollout.get("client_token"))  # the version the episodes start on
    done = run(task_list, toolchains, proxy=proxy, out=rollout_dir, attempts=attempts, on_done=on_done, **rollout)
    if failed := every_episode_failed(done.results, rollout_dir / "episodes"):  # no figure to trust, nothing written
        raise CalibrationFailed(failed)
    rates = pass_rates(done.results, done.summary["pass_threshold"], done.summary["on_failure"])
    result = Calibration(out, rollout_dir, band, policy,
                         [rates.get(t.id) or TaskRate(t.id, 0, 0, 0, None) for t in task_list])
    result.verdicts = {r.task_id: verdict(r.pass_rate, band) for r in result.rates}
    write_atomically(out, calibrated_lines(tasks, rates, set(result.kept), policy))
    write_atomically(rollout_dir / "calibration.json", result.to_json())
    return result
