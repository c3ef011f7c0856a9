"""Async mode (issue 27): iteration i trains on iteration i-1's rollouts while its own rollouts run on the
policy served now, then publishes; every episode runs on one policy version. On the loop's stage machine
with stand-ins for the rollout and the trainer's steps (`tests/rl/test_rl_faults.py`'s `Run`)."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from openforge.rl.config import load_rl_config
from openforge.rl.errors import RLError
from openforge.settings import ConfigError
from tests.rl.test_rl_faults import Run

WAIT = 30.0  # seconds one side waits to see the other running: a sequential loop never does


class StoppableTrainer:
    device = SimpleNamespace(type="cpu")

    def __init__(self) -> None:
        self.step, self.unsaved, self.stop = 0, False, threading.Event()

    def close(self) -> None:
        pass


def async_run(tmp_path: Path, log: list[Any], iterations: int = 3) -> Run:
    run = Run(tmp_path / "run", log, fake=("reconstruct", "publish"), iterations=iterations,
              sets={"loop.mode": "async"})
    run.trainer = StoppableTrainer()  # type: ignore[assignment]
    run.checkpoint_if_due = lambda i: log.append((i, "checkpoint if due"))  # type: ignore[method-assign]
    return run


def test_each_iteration_trains_on_the_one_before_while_its_rollouts_run(tmp_path: Path) -> None:
    log: list[Any] = []
    run = async_run(tmp_path, log)
    rolling = {i: threading.Event() for i in range(3)}
    training = {i: threading.Event() for i in range(3)}

    def prepare_pass(i: int) -> Any:
        source = run.trains_on(i)
        log.append((i, "prepare", source))
        return None if source is None else f"samples of iteration {source}"

    def fit(selection: Any) -> None:
        i = run.state.iteration
        training[i].set()
        assert rolling[i].wait(WAIT), f"iteration {i}: the rollout never ran beside the training"
        log.append((i, "fit", selection))

    def rollout_episodes(i: int) -> None:
        rolling[i].set()
        if i > 0:
            assert training[i].wait(WAIT), f"iteration {i}: the training never ran beside the rollout"
        log.append((i, "rollout"))

    run.prepare_pass, run.fit, run.rollout_episodes = prepare_pass, fit, rollout_episodes  # type: ignore[method-assign]
    run.run()
    steps = [x for x in log if x[1] in ("prepare", "fit", "publish")]
    assert steps == [(0, "prepare", None), (0, "publish"),
                     (1, "prepare", 0), (1, "fit", "samples of iteration 0"), (1, "publish"),
                     (2, "prepare", 1), (2, "fit", "samples of iteration 1"), (2, "publish")]
    assert (1, "checkpoint if due") in log and run.trainer_thread is not None and not run.trainer_thread.is_alive()
    assert "train_beside" in run.state.seconds
    assert "async mode with the trainer on the CPU" in run.text.getvalue()


def test_ctrl_c_in_the_rollout_stops_the_trainer_at_a_step_boundary_first(tmp_path: Path) -> None:
    log: list[Any] = []
    run = async_run(tmp_path, log, iterations=2)
    run.state.iteration = 1
    started, steps = threading.Event(), []

    def fit(selection: Any) -> None:
        started.set()
        while not run.trainer.stop.is_set():  # type: ignore[union-attr]
            steps.append(1)
            threading.Event().wait(0.01)
        log.append("trainer stopped")

    def rollout_episodes(i: int) -> None:
        assert started.wait(WAIT)
        raise KeyboardInterrupt

    run.prepare_pass = lambda i: "selection"  # type: ignore[method-assign]
    run.fit, run.rollout_episodes = fit, rollout_episodes  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        run.run()
    assert log[-1] == "trainer stopped" and steps
    assert run.trainer_thread is not None and not run.trainer_thread.is_alive()
    assert "stopping the trainer after its current step" in run.text.getvalue()


def test_a_training_error_beside_the_rollout_stops_the_run_after_it(tmp_path: Path) -> None:
    log: list[Any] = []
    run = async_run(tmp_path, log, iterations=2)
    run.state.iteration = 1

    def fit(selection: Any) -> None:
        raise RLError("training refused: s0001: advantage is NaN")

    run.prepare_pass = lambda i: "selection"  # type: ignore[method-assign]
    run.fit = fit  # type: ignore[method-assign]
    run.rollout_episodes = lambda i: log.append((i, "rollout"))  # type: ignore[method-assign]
    with pytest.raises(RLError, match="training refused: s0001"):
        run.run()
    assert log == [(1, "rollout")]  # the rollout finished; nothing published


def test_the_first_async_iteration_has_nothing_to_train_on(tmp_path: Path) -> None:
    run = async_run(tmp_path, [])
    assert run.prepare_pass(0) is None
    assert run.state.skipped_train == "async mode: the first iteration has no earlier rollouts to train on"
    assert [run.trains_on(i) for i in range(3)] == [None, 0, 1]


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="loop.mode must be one of sync, async, not 'overlap'"):
        load_rl_config(sets={"loop.mode": "overlap"})
