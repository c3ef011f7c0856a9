"""The train stage: one resident `Trainer` keeps the model and its optimizer in memory for the whole run; each
iteration's pass trains the samples of its window's episodes, at the policy versions that produced them
(sync: after the rollout; async: beside the next one), and writes a full checkpoint when one is due."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from openforge.rl.base import RunBase
from openforge.rl.errors import RLError

if TYPE_CHECKING:
    from openforge.trainer.config import TrainConfig
    from openforge.trainer.train import Trainer, TrainPlan


class Training(RunBase):
    """The run's part that trains: the resident trainer and each iteration's pass."""

    def resident_trainer(self) -> Trainer:
        """The run's trainer, loaded on first use from the newest checkpoint (or the starting weights)."""
        if self.trainer is None:
            from openforge.trainer.train import Trainer

            with self.console.status("loading the trainer"):
                self.trainer = Trainer(self.trainer_config(), resume=True, say=lambda m: self.console.print(f"  {m}"))
        return self.trainer

    def trainer_config(self) -> TrainConfig:
        """The resident trainer's settings: [train] over the loop's defaults (`TRAIN_DEFAULTS` sets `cpu_bf16`:
        bf16-autocast on a CPU with native bf16 matmuls, decided by the trainer); in async mode the steps print
        as lines (the rollout's progress bar is on screen)."""
        cfg = self.cfg.train_config(str(self.db), str(self.base_model), str(self.train_out), "")
        return dataclasses.replace(cfg, progress=False) if self.cfg.loop.mode == "async" else cfg

    def close_trainer(self) -> None:
        """At the end of the run, however it ends: steps only memory holds are written as a checkpoint, so
        `--resume` goes on from them (the trainer is always between two steps: `deferred_interrupt`)."""
        trainer, self.trainer = self.trainer, None
        if trainer is None:
            return
        if self.trainer_thread is not None and self.trainer_thread.is_alive():
            self.console.print("  [yellow]warning:[/] the trainer is still in a step; its state was not saved "
                               "(--resume trains from the newest checkpoint)")
            return
        try:
            if trainer.unsaved:
                with self.console.status(f"saving the trainer at step {trainer.step}"):
                    path = trainer.save()
                self.console.print(f"  saved the trainer's state to {path}: --resume goes on from it")
        except Exception as e:  # noqa: BLE001 - the run is ending; what it ended on is the error to show
            self.console.print(f"  [yellow]warning:[/] the trainer's state at step {trainer.step} was not saved "
                               f"({type(e).__name__}: {e}); --resume trains from the newest checkpoint")
        finally:
            trainer.close()

    def train(self, i: int) -> None:
        """The train stage: policy-gradient steps in the resident trainer (`train_pass`). In async mode the
        steps ran during the rollout stage (`training_beside`), so there is nothing left to do here."""
        if self.cfg.loop.mode == "sync":
            self.train_pass(i)

    def train_pass(self, i: int) -> None:
        """Iteration i's pass, start to end: `prepare_pass`, the steps, and a checkpoint when one is due."""
        plan = self.prepare_pass(i)
        if plan is not None:
            self.fit(plan)
        self.checkpoint_if_due(i)

    def prepare_pass(self, i: int) -> TrainPlan | None:
        """What iteration i's pass trains (its weights and optimizer state go on from the last iteration's),
        checked; None when there is nothing to train: no earlier rollouts (async, iteration 0), nothing to
        learn (`nothing_to_learn`: no step, the engine keeps serving the same weights, and rl.jsonl's
        `skipped_train` says why), or the steps already done (a stop saved them)."""
        from openforge.settings import ConfigError
        from openforge.trainer.data import DataError

        s, source = self.state, self.trains_on(i)
        if source is None:
            s.skipped_train = "async mode: the first iteration has no earlier rollouts to train on"
            return None
        from openforge.trainer.data import nothing_to_learn

        where = self.selection(source)
        try:
            s.skipped_train = nothing_to_learn(self.db, where, self.cfg.train_config("", "", ""))
        except DataError as e:
            raise RLError(f"training refused: {e}") from None
        if s.skipped_train:
            self.console.print(f"  [yellow]nothing to learn[/]: {s.skipped_train}; no optimizer step, the engine "
                               f"keeps serving the same weights")
            return None
        try:
            trainer = self.resident_trainer()
            trainer.stop.clear()
            if 0 <= trainer.step < s.train_start_step:
                self.console.print(f"  [yellow]warning:[/] the newest checkpoint is at step {trainer.step}, before "
                                   f"this iteration's start (step {s.train_start_step}): the steps between were in "
                                   "memory only when the run was killed; this iteration trains from the checkpoint")
            if s.train_start_step < 0 or trainer.step < s.train_start_step:
                s.train_start_step, s.train_end_step = trainer.step, -1
            plan = trainer.plan(where)
            if s.train_end_step < 0:
                s.train_end_step = trainer.step + plan.steps(trainer.cfg)
                s.save(self.state_path)
        except (ConfigError, DataError) as e:
            raise RLError(f"training refused: {e}") from None
        if trainer.step >= s.train_end_step:  # done before a stop, which saved them
            plan.source.close()
            return None
        return plan

    def fit(self, plan: TrainPlan) -> None:
        """The pass's steps; a stop between steps (Ctrl-C, `Trainer.stop`) leaves the trainer there, saved
        when the run ends."""
        from openforge.trainer.data import DataError

        s, trainer = self.state, self.resident_trainer()
        try:
            trainer.fit(plan, s.train_end_step, restart=trainer.step == s.train_start_step,
                        on_step=lambda record: self.track("train", record, int(record["step"])))
        except DataError as e:
            raise RLError(f"training refused: {e}") from None

    def checkpoint_if_due(self, i: int) -> None:
        """A full checkpoint every `loop.checkpoint_every` iterations and after the last one."""
        every, trainer = self.cfg.loop.checkpoint_every, self.trainer
        if trainer is not None and trainer.unsaved and ((i + 1) % every == 0 or i + 1 >= self.cfg.loop.iterations):
            with self.console.status(f"checkpoint at step {trainer.step}"):
                self.state.checkpoint = str(trainer.save())

    @contextlib.contextmanager
    def training_beside(self, i: int) -> Iterator[None]:
        """async: iteration i's pass in a thread while the body (its rollout, on the policy served now) runs;
        joined at the end, where its error is raised. A stop of the body (Ctrl-C) stops the trainer at its
        next step boundary and waits for it, so what the run saves on the way out is a state it was in."""
        plan = self.prepare_pass(i)
        if plan is None:
            yield
            return
        trainer, failed, elapsed = self.resident_trainer(), [], []
        if trainer.device.type == "cpu":
            self.console.print("  [yellow]note:[/] async mode with the trainer on the CPU: it and a CPU engine share "
                               "the same cores, which can make both slower than sync mode (docs/rl.md, async mode)")

        def work() -> None:
            started = time.monotonic()
            try:
                self.fit(plan)
            except BaseException as e:  # noqa: BLE001 - raised in the loop's thread after the join
                failed.append(e)
            finally:
                elapsed.append(round(time.monotonic() - started, 3))

        self.trainer_thread = threading.Thread(target=work, name="openforge-trainer", daemon=True)
        self.trainer_thread.start()
        try:
            yield
            self.trainer_thread.join()
        except BaseException:
            trainer.stop.set()
            self.console.print(f"  stopping the trainer after its current step (step {trainer.step + 1})")
            self.trainer_thread.join()
            raise
        self.state.seconds["train_beside"] = elapsed[0]  # after the join: only the loop's thread writes the state
        if failed:
            raise failed[0]
        self.checkpoint_if_due(i)
