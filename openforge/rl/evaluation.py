"""Evaluation apart from training (docs/evaluation.md): which tasks are held out, and how an evaluation
pass's episodes become scores with their standard errors.

A training curve scores the prompts the policy is trained on, with the rollout's sampling, and can rise
without the policy learning anything that carries over. An evaluation pass runs held-out tasks, `n` samples
per task at the policy's sampling (pass@k for every k <= n by the unbiased estimator of Chen et al. 2021)
and, optionally, one greedy attempt per task (temperature 0).
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from math import comb
from typing import Any

from openforge.rollout.failures import EpisodeStatus, classify
from openforge.rollout.spec import EpisodeResult, Task


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c passed: 1 - C(n-c, k) / C(n, k) (needs
    n >= k). Not the share of tasks passed in the first k samples, whose variance is higher."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c})")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def split_tasks(tasks: Sequence[Task], fraction: float) -> tuple[list[Task], list[Task]]:
    """(training tasks, held-out tasks): the share `fraction` of the tasks, at least one, chosen by the hash of
    their ids, so the same file always holds out the same tasks whatever its order; both in file order."""
    if not 0 < fraction < 1:
        raise ValueError(f"eval.split must be in (0, 1), not {fraction:g}")
    held = max(1, round(fraction * len(tasks)))
    if held >= len(tasks):
        raise ValueError(f"eval.split {fraction:g} of {len(tasks)} tasks leaves none to train on")
    ranked = sorted(tasks, key=lambda t: hashlib.sha256(t.id.encode()).hexdigest())
    out = {t.id for t in ranked[:held]}
    return [t for t in tasks if t.id not in out], [t for t in tasks if t.id in out]


def episode_score(result: EpisodeResult) -> float | None:
    """The verifier's reward; 0 for the agent's own failures (failures.py: it exited non-zero, a limit stopped
    it, it crashed a verifier that scores the pristine task); None (not scored) for what the agent did not
    cause: a timeout, a crash, a broken verifier."""
    if result.reward is not None:
        return result.reward
    return 0.0 if classify(result) == "agent" else None


def mean_se(values: Sequence[float]) -> tuple[float | None, float | None]:
    """(mean, standard error of the mean) of per-task values; no error from a single task."""
    if not values:
        return None, None
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    return round(mean, 6), None if se is None else round(se, 6)


def score(results: Sequence[EpisodeResult], ks: Sequence[int], pass_threshold: float) -> dict[str, Any]:
    """One evaluation mode's numbers. Each task is one observation (its attempts are not independent), so
    means are over tasks and standard errors are across tasks; pass@k over the tasks with >= k scored
    samples."""
    by_task: dict[str, list[float]] = {}
    for r in results:
        s = episode_score(r)
        by_task.setdefault(r.task_id, []).extend([] if s is None else [s])
    scored = {t: v for t, v in by_task.items() if v}
    reward, reward_se = mean_se([statistics.fmean(v) for v in scored.values()])
    passes: dict[str, dict[str, Any]] = {}
    for k in ks:
        values = [pass_at_k(len(v), sum(x >= pass_threshold for x in v), k) for v in scored.values() if len(v) >= k]
        value, se = mean_se(values)
        passes[str(k)] = {"value": value, "se": se, "tasks": len(values)}
    return {
        "episodes": len(results), "scored": sum(len(v) for v in scored.values()), "tasks": len(by_task),
        "reward_mean": reward, "reward_se": reward_se, "pass_at": passes,
        "failures": dict(sorted(Counter(r.status for r in results if r.status != EpisodeStatus.OK).items())),
    }
