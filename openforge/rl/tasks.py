"""The tasks a run trains and evaluates on: the task files of [rollout] and [eval], else the default task file
shipped with OpenForge (`default_tasks.jsonl`: the example agent's arithmetic tasks), and its hack canaries
(`eval.canaries`, canaries.py), every one checked before anything starts."""

from __future__ import annotations

from pathlib import Path

from openforge.rl.canaries import canary_tasks
from openforge.rl.config import RLConfig
from openforge.rl.errors import RLError
from openforge.rl.evaluation import split_tasks
from openforge.rollout.spec import Task

DEFAULT_TASKS = Path(__file__).with_name("default_tasks.jsonl")


def default_tasks() -> list[Task]:
    """The default task file's tasks (their verifiers run `$OPENFORGE_PYTHON`, the episode's interpreter)."""
    from openforge.rollout.tasks import read_tasks

    return read_tasks(DEFAULT_TASKS)


def check_tasks(cfg: RLConfig, out: Path) -> tuple[list[Task], list[Task]]:
    """(training tasks, evaluation tasks), every task and toolchain checked before anything starts; the
    evaluation tasks are held out: none of their ids is a training task's."""
    from openforge.rollout.runner import RolloutError, prepare
    from openforge.rollout.tasks import TaskFileError, read_tasks

    r, e = cfg.rollout, cfg.eval
    try:
        tasks = read_tasks(r.tasks) if r.tasks else default_tasks()
        held: list[Task] = read_tasks(e.tasks) if e.tasks else []
        if e.split:
            tasks, held = split_tasks(tasks, e.split)
        tasks = tasks[: r.max_tasks] if r.max_tasks else tasks
        held = held[: e.max_tasks] if e.max_tasks else held
        for group in (tasks, held) if held else (tasks,):
            prepare(group, r.toolchains, proxy="http://127.0.0.1:1", out=out, attempts=r.attempts,
                    concurrency=r.concurrency, on_failure=r.on_failure, pass_threshold=r.pass_threshold,
                    sandbox=r.sandbox)
    except (TaskFileError, RolloutError, ValueError) as err:
        raise RLError(str(err)) from None
    shared = sorted({t.id for t in tasks} & {t.id for t in held})
    if shared:
        raise RLError(f"eval.tasks: {len(shared)} of them are training tasks too ({', '.join(shared[:3])}): "
                      "evaluation must be on held-out tasks")
    return tasks, held


def check_canaries(cfg: RLConfig, out: Path, others: list[Task]) -> list[Task]:
    """The hack canaries of `eval.canaries`, checked like the other tasks before anything starts; none of their
    ids may be a training or evaluation task's (`others`), so no report mixes a canary with a task."""
    from openforge.rollout.runner import RolloutError, prepare
    from openforge.rollout.tasks import TaskFileError

    r = cfg.rollout
    try:
        canaries = canary_tasks(cfg.eval.canaries)
        if canaries:
            prepare(canaries, r.toolchains, proxy="http://127.0.0.1:1", out=out, attempts=r.attempts,
                    concurrency=r.concurrency, on_failure=r.on_failure, pass_threshold=r.pass_threshold,
                    sandbox=r.sandbox)
    except (TaskFileError, RolloutError) as err:
        raise RLError(f"eval.canaries: {err}") from None
    shared = sorted({t.id for t in canaries} & {t.id for t in others})
    if shared:
        raise RLError(f"eval.canaries: {len(shared)} of them are training or evaluation tasks too "
                      f"({', '.join(shared[:3])}): a canary is never trained")
    return canaries
