"""Experiment trackers (issue 30, docs/tracking.md): what TensorBoard, W&B (offline) and MLflow (file store)
were fed by the trainer's steps and the loop's iterations and evaluations, read back with each one's own
reader: TensorBoard's EventAccumulator, W&B's protobuf records from the run's .wandb file, MlflowClient."""

from __future__ import annotations

import io
import json
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from openforge.rl.config import load_rl_config
from openforge.rl.errors import RLError
from openforge.testing.trainer_samples import make_samples, qwen_tokenizer, write_samples
from openforge.tracking import Trackers, flatten
from openforge.trainer.config import load_config
from openforge.trainer.train import train
from tests.rl.test_rl_eval import Run, fake_episodes  # noqa: F401 - the fixture, used by name

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")


# --- each tracker's own reader -----------------------------------------------------------------------------

def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[str, list[tuple[int, float]]] = {}
    for events in sorted(directory.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            found.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return found


def wandb_records(path: Path) -> Iterator[bytes]:
    """The records of a .wandb file: W&B's header (':W&B', 0xBEE1, version 0), then LevelDB's log format
    (32 KiB blocks of records: crc32, length, type full/first/middle/last)."""
    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (kind == 0 and length == 0):
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk


def wandb_history(directory: Path) -> list[dict[str, Any]]:
    from wandb.proto import wandb_internal_pb2

    rows = []
    for run_file in sorted(directory.glob("wandb/offline-run-*/run-*.wandb")):
        for data in wandb_records(run_file):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def mlflow_metrics(directory: Path, name: str) -> tuple[dict[str, list[tuple[int, float]]], dict[str, str], int]:
    """{metric: [(step, value)]}, the params, and how many runs the experiment has."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=directory.resolve().as_uri())
    experiment = client.get_experiment_by_name("openforge")
    runs = client.search_runs([experiment.experiment_id])
    run = next(r for r in runs if r.data.tags.get("openforge.run_id") == name)
    history = {key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
               for key in run.data.metrics}
    return history, run.data.params, len(runs)


# --- the trackers ------------------------------------------------------------------------------------------

def test_flatten_keeps_finite_numbers_only() -> None:
    assert flatten({"a": 1, "b": {"c": 2.5, "d": None, "e": "x", "f": [1]}, "g": True, "h": float("nan")}) == \
        {"a": 1.0, "b/c": 2.5}


def test_every_tracker_reads_back_what_it_was_fed_each_series_on_its_axis(tmp_path: Path) -> None:
    def feed(trackers: Trackers, steps: range) -> None:
        for step in steps:
            trackers.log("train", {"step": step, "loss": 1.0 / step, "lr": 1e-5}, step)
        trackers.log("rl", {"reward_mean": 0.25 * steps[-1], "failures": {"timeout": 1},
                            "seconds": {"rollout": 12.5}}, steps[-1] // 2)

    trackers = Trackers(["tensorboard", "wandb", "mlflow"], tmp_path, "openforge", "run-1", {"loop": {"window": 1}})
    feed(trackers, range(1, 3))
    trackers.log("eval", {"sampled": {"pass_at": {"1": {"value": 0.5, "se": 0.1}}}}, 0)
    trackers.close()
    resumed = Trackers(["tensorboard", "mlflow"], tmp_path, "openforge", "run-1", {})  # --resume
    feed(resumed, range(3, 5))
    resumed.close()

    tb = tensorboard_scalars(tmp_path / "tensorboard")
    assert [s for s, _ in tb["train/loss"]] == [1, 2, 3, 4]
    assert tb["train/loss"][1][1] == pytest.approx(0.5)
    assert tb["rl/reward_mean"] == [(1, 0.5), (2, 1.0)] and tb["rl/seconds/rollout"][0] == (1, 12.5)
    assert tb["eval/sampled/pass_at/1/value"] == [(0, 0.5)]

    history, params, runs = mlflow_metrics(tmp_path / "mlruns", "run-1")
    assert runs == 1  # the resumed run continues the same MLflow run
    assert [s for s, _ in history["train/loss"]] == [1, 2, 3, 4] and history["rl/failures/timeout"] == [(1, 1.0),
                                                                                                       (2, 1.0)]
    assert history["eval/sampled/pass_at/1/se"] == [(0, 0.1)] and params["loop.window"] == "1"

    rows = wandb_history(tmp_path / "wandb")
    train_rows = [r for r in rows if "train/loss" in r]
    assert [r["train/step"] for r in train_rows] == [1, 2] and train_rows[0]["train/loss"] == 1.0
    assert [(r["rl/iteration"], r["rl/reward_mean"]) for r in rows if "rl/reward_mean" in r] == [(1, 0.5)]
    assert [r["eval/policy_version"] for r in rows if "eval/sampled/pass_at/1/value" in r] == [0]


def test_a_missing_tracker_package_is_one_error_before_the_run_starts(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    from openforge.rl.loop import RLRun

    run = RLRun(load_rl_config(sets={"tracking.trackers": "wandb", "loop.iterations": "1"}), tmp_path / "run",
                Console(file=io.StringIO()))
    with pytest.raises(RLError, match=r"tracking: wandb is not installed: pip install 'openforge\[tracking\]'"):
        run.run()
    assert not (tmp_path / "run" / "rl.jsonl").exists()


# --- fed by the loop and the trainer -------------------------------------------------------------------------

def test_the_loop_feeds_its_iterations_and_evaluations(tmp_path: Path, fake_episodes: Any) -> None:  # noqa: F811
    run = Run(tmp_path / "run", {"tracking.trackers": "tensorboard,mlflow,wandb", "eval.every": "2"}, [])
    run.run()
    tracking = tmp_path / "run" / "tracking"
    tb = tensorboard_scalars(tracking / "tensorboard")
    assert [s for s, _ in tb["rl/reward_mean"]] == [0, 1, 2] and "rl/attempts" not in tb
    assert [s for s, _ in tb["eval/sampled/reward_mean"]] == [0, 2, 3]
    assert [s for s, _ in tb["eval/greedy/pass_at/1/value"]] == [0, 2, 3]
    history, _, _ = mlflow_metrics(tracking / "mlruns", run.state.run_id)
    assert [s for s, _ in history["eval/sampled/pass_at/2/value"]] == [0, 2, 3]
    rows = wandb_history(tracking / "wandb")
    assert [r["rl/iteration"] for r in rows if "rl/reward_mean" in r] == [0, 1, 2]


@pytest.mark.usefixtures("one_torch_thread")
def test_the_trainer_feeds_each_step_and_prints_no_loading_bars(tmp_path: Path, tiny_qwen_dir: Path,
                                                                 capfd: pytest.CaptureFixture[str]) -> None:
    db = write_samples(tmp_path / "runs.duckdb", make_samples(qwen_tokenizer(), 4, seed=0, episodes=2))
    cfg = load_config(None, dict(db=str(db), model=str(tiny_qwen_dir), out=str(tmp_path / "out"), step_tokens=160,
                                 row_tokens=160, steps=2, progress=False))
    trackers = Trackers(["tensorboard"], tmp_path / "tracking", "openforge", "t", {})
    train(cfg, say=lambda _: None, on_step=lambda record: trackers.log("train", record, int(record["step"])))
    trackers.close()
    assert "Loading weights" not in capfd.readouterr().err  # transformers' bar, once per model load
    tb = tensorboard_scalars(tmp_path / "tracking" / "tensorboard")
    logged = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [(s, pytest.approx(v)) for s, v in tb["train/loss"]] == [(m["step"], m["loss"]) for m in logged]
    assert {"train/grad_norm", "train/tokens_per_s", "train/engine_gap_mean"} <= set(tb)
