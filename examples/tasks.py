"""A tiny arithmetic task set: each task has one right answer the verifier can check exactly."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from openforge.rollout.spec import Task as RolloutTask


@dataclass(frozen=True)
class Task:
    id: str
    question: str
    answer: int


TASKS = (
    Task("add-1", "What is 17 + 25?", 42),
    Task("mul-1", "What is 12 * 7?", 84),
    Task("sub-1", "What is 100 - 37?", 63),
    Task("mix-1", "What is 6 * (4 + 5)?", 54),
    Task("add-2", "What is 250 + 131?", 381),
    Task("mul-2", "What is 15 * 15?", 225),
    Task("sub-2", "What is 90 - 48?", 42),
    Task("mix-2", "What is (20 - 8) * 3?", 36),
)


def rollout_tasks(n: int = len(TASKS), python: str = sys.executable) -> list[RolloutTask]:
    """The first `n` tasks as rollout tasks for the `tool-agent` toolchain, graded by the example verifier
    (`openforge rl`'s default task set; `python` runs the verifier)."""
    from openforge.rollout.spec import Task as RolloutTask

    verify = f"{shlex.quote(python)} -m openforge.examples.verifier --answer"
    return [RolloutTask(id=t.id, prompt=t.question, verify=f"{verify} {t.answer}", timeout_s=120.0,
                        toolchains=("tool-agent",)) for t in TASKS[:n]]
