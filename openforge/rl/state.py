"""state.json: where a run is (iteration, stage, policy version, what the engine serves), and the stage machine
it moves along: each stage ends by saving the state at the next one, so `--resume` continues where a killed
run stopped."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from openforge.rl.errors import RLError

STATE_VERSION = 1


class Stage(StrEnum):
    """An iteration's stages, in order; the name of the loop's method that runs each. `record` writes the
    iteration's rl.jsonl line, then the next iteration begins at `eval`."""

    EVAL = "eval"
    ROLLOUT = "rollout"
    RECONSTRUCT = "reconstruct"
    TRAIN = "train"
    PUBLISH = "publish"
    RECORD = "record"

    @property
    def next(self) -> Stage:
        """The stage that follows this one (after `record`: the next iteration's `eval`)."""
        order = list(Stage)
        return order[(order.index(self) + 1) % len(order)]

    def until_record(self) -> list[Stage]:
        """This stage and the ones after it that run a method, in order (`record` is the loop's own)."""
        order = list(Stage)
        return order[order.index(self):-1]


STAGES = tuple(Stage)


@dataclass
class State:
    """state.json: where the run is. `version`: the policy version the engine serves (= the iteration whose
    rollouts run on it); `served`: the GGUF or checkpoint directory it serves ("" = the starting weights)."""

    run_id: str
    iteration: int = 0
    stage: Stage = Stage.EVAL
    version: int = 0
    served: str = ""
    resumes: int = 0
    restarts: int = 0  # engine restarts after it died (each one also names reruns, as a resume does)
    train_start_step: int = -1  # the trainer's step when this iteration's training began (-1: not yet)
    train_end_step: int = -1  # the step it trains until (-1: not yet known)
    checkpoint: str = ""  # the checkpoint this iteration wrote ("" = none: not due, or nothing trained)
    skipped_train: str = ""  # why this iteration had nothing to learn (no optimizer step, nothing published)
    dropped: dict[str, str] = field(default_factory=dict)  # task id -> why re-calibration dropped it
    seconds: dict[str, float] = field(default_factory=dict)
    format: int = STATE_VERSION

    @classmethod
    def read(cls, path: Path) -> State:
        try:
            data = json.loads(path.read_text())
            if data.get("format") != STATE_VERSION:
                raise ValueError(f"state format {data.get('format')!r}, this OpenForge reads {STATE_VERSION}")
            if data.get("stage") not in STAGES:
                raise ValueError(f"unknown stage {data.get('stage')!r}")
            return cls(**data | {"stage": Stage(data["stage"])})
        except (OSError, ValueError, TypeError) as e:
            raise RLError(f"cannot resume from {path}: {e}") from None

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=1))
        os.replace(tmp, path)

    def advance(self, done: Stage) -> None:
        """`done` finished: the state moves to the stage after it (after `record`, the next iteration)."""
        if done is not self.stage:
            raise ValueError(f"stage {done} finished, but the run is at {self.stage}")
        if done is Stage.RECORD:
            self.iteration += 1
        self.stage = done.next
