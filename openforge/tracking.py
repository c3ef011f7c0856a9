"""Experiment trackers (docs/tracking.md): TensorBoard event files, Weights & Biases offline runs and an
MLflow file store, all under one directory of the run, fed the same numbers as rl.jsonl and metrics.jsonl.

Nothing leaves the machine: W&B runs offline (`wandb sync DIR/tracking/wandb/offline-run-*` uploads one
later), MLflow writes files (`mlflow ui --backend-store-uri DIR/tracking/mlruns`), TensorBoard reads its
folder (`tensorboard --logdir DIR/tracking/tensorboard`). Each series has its own x axis: `train/*` the
trainer's step, `rl/*` the iteration, `eval/*` and `canary/*` the policy version evaluated.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from openforge.choices import TrackerName

AXES = {"train": "step", "rl": "iteration", "eval": "policy_version", "canary": "policy_version"}  # x axes
INSTALL = "pip install 'openforge[tracking]' (make setup installs it)"


class TrackerError(RuntimeError):
    """A tracker cannot start (its package is missing, its directory cannot be written)."""


class Tracker(Protocol):
    def log(self, series: str, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Nested numbers as {"a/b": x}; what is not a finite number (None, text, lists, bools) is left out."""
    found: dict[str, float] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            found |= flatten(value, f"{name}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            found[name] = float(value)
    return found


class TensorBoard:
    def __init__(self, directory: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise TrackerError(f"tensorboard is not installed: {INSTALL}") from None
        self.writer = SummaryWriter(str(directory))

    def log(self, series: str, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(f"{series}/{name}", value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandB:
    """An offline run; `define_metric` gives each series its own x axis (W&B's own step only increases)."""

    def __init__(self, directory: Path, project: str, name: str, config: Mapping[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise TrackerError(f"wandb is not installed: {INSTALL}") from None
        os.environ["WANDB_MODE"] = "offline"  # never online, whatever the user's settings say
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=name, group=name, dir=str(directory), config=dict(config),
                              mode="offline", settings=wandb.Settings(silent=True, console="off"))
        for series, axis in AXES.items():
            self.run.define_metric(f"{series}/{axis}")
            self.run.define_metric(f"{series}/*", step_metric=f"{series}/{axis}")

    def log(self, series: str, metrics: Mapping[str, float], step: int) -> None:
        self.run.log({f"{series}/{AXES.get(series, 'step')}": step} | {f"{series}/{k}": v for k, v in metrics.items()})

    def close(self) -> None:
        self.run.finish()


class MLflow:
    """A run in a local file store, continued on resume (found by its `openforge.run_id` tag)."""

    def __init__(self, directory: Path, project: str, name: str, config: Mapping[str, Any]) -> None:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store on request
        try:
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise TrackerError(f"mlflow is not installed: {INSTALL}") from None
        self.metric = Metric
        self.client = MlflowClient(tracking_uri=directory.resolve().as_uri())
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        found = self.client.search_runs([experiment_id], f"tags.`openforge.run_id` = '{name}'", max_results=1)
        if found:
            self.run_id = found[0].info.run_id
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=name,
                                                 tags={"openforge.run_id": name}).info.run_id
            params = [Param(k, str(v)[:500]) for k, v in flatten_params(config).items()]
            for i in range(0, len(params), 100):
                self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, series: str, metrics: Mapping[str, float], step: int) -> None:
        import time

        now = int(time.time() * 1000)
        batch = [self.metric(f"{series}/{k}", v, now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def flatten_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            found |= flatten_params(value, f"{prefix}{key}.")
        else:
            found[f"{prefix}{key}"] = value
    return found


class Trackers:
    """The trackers a run asked for, fed together; none is a no-op. A tracker that fails while logging is
    named once and dropped: a tracker never stops a run."""

    def __init__(self, names: Sequence[str], directory: Path, project: str, name: str,
                 config: Mapping[str, Any], warn: Any = print) -> None:
        self.warn = warn
        self.trackers: dict[str, Tracker] = {}
        try:
            for tracker in names:
                if tracker == TrackerName.tensorboard:
                    self.trackers[tracker] = TensorBoard(directory / "tensorboard")
                elif tracker == TrackerName.wandb:
                    self.trackers[tracker] = WandB(directory / "wandb", project, name, config)
                elif tracker == TrackerName.mlflow:
                    self.trackers[tracker] = MLflow(directory / "mlruns", project, name, config)
                else:
                    raise TrackerError(f"unknown tracker {tracker!r}: one of {', '.join(TrackerName)}")
        except BaseException:
            self.close()
            raise

    def log(self, series: str, values: Mapping[str, Any], step: int) -> None:
        metrics = flatten(values)
        for name, tracker in list(self.trackers.items()):
            try:
                tracker.log(series, metrics, step)
            except Exception as e:  # noqa: BLE001 - a tracker's failure is its own, not the run's
                self.warn(f"warning: tracker {name} failed ({type(e).__name__}: {e}); it logs nothing more")
                del self.trackers[name]

    def close(self) -> None:
        for tracker in self.trackers.values():
            tracker.close()
        self.trackers = {}
