"""The resident trainer (issue 27): one `Trainer` keeps the model and its optimizer between passes, and
gives the same weights as a trainer that saves and reloads between them; a pass a Ctrl-C interrupted goes
on from the checkpoint written then, as if it never stopped."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import duckdb
import pytest
import torch
from safetensors.torch import load_file

from openforge.testing.trainer_samples import make_samples, qwen_tokenizer, write_samples
from openforge.trainer.config import load_config
from openforge.trainer.train import Trainer, deferred_interrupt, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> Path:
    samples = make_samples(qwen_tokenizer(), 8, seed=2, episodes=4)
    return write_samples(tmp_path_factory.mktemp("resident") / "runs.duckdb", samples)


def halves(db: Path) -> tuple[str, str]:
    """Two selections, as two RL iterations have: the first two episodes, then the other two."""
    con = duckdb.connect(str(db), read_only=True)
    episodes = [e for (e,) in con.execute("SELECT DISTINCT episode_id FROM samples ORDER BY 1").fetchall()]
    con.close()
    quoted = [", ".join(f"'{e}'" for e in part) for part in (episodes[:2], episodes[2:])]
    return tuple(f"episode_id IN ({q})" for q in quoted)  # type: ignore[return-value]


def config(db: Path, model: Path, out: Path, where: str = ""):
    return load_config(None, dict(db=str(db), model=str(model), out=str(out), where=where, step_tokens=160,
                                  row_tokens=160, steps=0, epochs=2, lr=5e-2, warmup_steps=2, grad_clip=100.0,
                                  progress=False))


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "model.safetensors"))


def metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_one_resident_trainer_equals_saving_and_reloading_between_passes(db, tiny_qwen_dir, tmp_path):
    first, second = halves(db)
    reloaded = tmp_path / "reloaded"
    train(config(db, tiny_qwen_dir, reloaded, first), say=lambda _: None)
    final = train(config(db, tiny_qwen_dir, reloaded, second), resume=True, new_selection=True, say=lambda _: None)

    resident = Trainer(config(db, tiny_qwen_dir, tmp_path / "resident"), say=lambda _: None)
    for where in (first, second):
        plan = resident.plan(where)
        resident.fit(plan, resident.step + plan.steps(resident.cfg))
    assert resident.step == int(final.name.split("_")[1]) >= 4 and resident.unsaved
    expected, got = weights(final), resident.weights()
    assert set(got) == set(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    saved = resident.save()
    assert not resident.unsaved and all(torch.equal(weights(saved)[k], expected[k]) for k in expected)
    assert [m["loss"] for m in metrics(tmp_path / "resident")] == [m["loss"] for m in metrics(reloaded)]


def test_a_pass_interrupted_between_steps_goes_on_from_the_checkpoint_saved_then(db, tiny_qwen_dir, tmp_path):
    whole = Trainer(config(db, tiny_qwen_dir, tmp_path / "whole"), say=lambda _: None)
    plan = whole.plan("")
    end = plan.steps(whole.cfg)
    whole.fit(plan, end)
    assert end >= 3

    def stop_after_step_2(record: dict) -> None:
        if record["step"] == 2:
            raise KeyboardInterrupt

    out = tmp_path / "stopped"
    stopped = Trainer(config(db, tiny_qwen_dir, out), say=lambda _: None)
    with pytest.raises(KeyboardInterrupt):
        stopped.fit(stopped.plan(""), end, on_step=stop_after_step_2)
    assert stopped.step == 2
    saved = stopped.save()  # what the RL loop does when the run stops
    assert (saved / "proximal_rank0.pt").is_file()  # the pass is not over: its proximal policy is kept

    again = Trainer(config(db, tiny_qwen_dir, out), resume=True, say=lambda _: None)
    assert again.step == 2
    again.fit(again.plan(""), end, restart=False)
    expected, got = whole.weights(), again.weights()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert [m["loss"] for m in metrics(out)] == [m["loss"] for m in metrics(tmp_path / "whole")]


def test_ctrl_c_inside_an_update_takes_effect_after_it():
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupt():
            os.kill(os.getpid(), signal.SIGINT)
            reached.append("after the signal")
    assert reached == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
