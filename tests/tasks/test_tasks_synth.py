"""`openforge tasks synth` end to end: a real proxy (mitmdump, flow files signed) in front of a scripted
engine that plays the synthesis model and the validator's agent (openforge/testing/forge_engine.py). A
candidate repaired after a failed check and one repaired after the validator are accepted and pass
`check_task`; one that only ever answers in prose is rejected with its reason; every synthesis and validator
call is in the flow files under its role and candidate, and the cost written equals what the records say."""

from __future__ import annotations

import json
import secrets
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from openforge.addons.flowfile import expand_paths, open_flow_file
from openforge.cli import app
from openforge.rollout.tasks import read_tasks
from openforge.taskforge.synth import stage_of
from openforge.testing import ROOT
from openforge.testing.forge_engine import ForgeEngine


def records(flow_dir: Path, key: bytes) -> list[dict[str, Any]]:
    out = []
    for path in expand_paths([flow_dir]):
        ff = open_flow_file(path, key)
        out.extend(r for r in ff.records() if r.get("type") == "exchange")
        assert ff.error is None and ff.unauthenticated is None, ff.error or ff.unauthenticated
    return out


@pytest.fixture
def synth_run(start_proxy: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the validator's episode processes import this tree
    monkeypatch.delenv("OPENFORGE_CLIENT_TOKEN", raising=False)
    key = secrets.token_hex(20)
    (tmp_path / "flow.key").write_text(key)
    with ForgeEngine(profile="vllm") as engine:
        proxy = start_proxy(engine.url, "openforge_engine_profile=vllm",
                            f"openforge_flow_key_file={tmp_path / 'flow.key'}")
        (tmp_path / "about.txt").write_text("Small Python bug fixes in a calculator module.")
        prices = tmp_path / "prices.json"
        prices.write_text(json.dumps({"synthesis": {"prompt": 1.0, "completion": 2.0},
                                      "*": {"prompt": 0.5, "completion": 0.5}}))
        out = tmp_path / "tasks.jsonl"
        result = CliRunner().invoke(app, [
            "tasks", "synth", "--proxy", proxy.url, "--about", f"@{tmp_path / 'about.txt'}", "--out", str(out),
            "--n", "3", "--repairs", "2", "--flow-key-file", str(tmp_path / "flow.key"), "--prices", str(prices)])
        proxy.stop()
    return result, out, records(proxy.flow_dir, key.encode()), engine, prices


def test_synth_repairs_validates_and_costs_from_the_records(synth_run: Any, tmp_path: Path) -> None:
    result, out, recs, engine, prices = synth_run
    assert result.exit_code == 0, (result.output, result.stderr, result.exception)
    tasks = read_tasks(out)
    assert [t.metadata["candidate"].split(".")[1] for t in tasks] == ["c001", "c003"]
    summary = json.loads(out.with_name(out.name + ".synth.json").read_text())
    assert summary["reasons"] == {"not_json": 1} and summary["proposed"] == 3
    (rejected,) = summary["rejected_candidates"]
    assert rejected["title"] == "Always prose" and "not a JSON object" in rejected["detail"]
    assert "rejected " in result.stderr and "not_json" in result.stderr

    from openforge.taskforge.check import check_task

    for task in tasks:
        assert task.metadata["source"] == "synth" and task.solution
        report = check_task(task, work_root=tmp_path / "recheck")
        assert report.passed, report

    # every call the engine answered is recorded, under its role, and each under its run's episodes
    run = summary["run_id"]
    roles = Counter(r["role"] for r in recs)
    assert roles == {"synthesis": engine.calls["synthesis"], "validator": engine.calls["validator"]}, roles
    assert all(r["complete"] and r["episode"].startswith(run + ".") for r in recs)
    stages = Counter(stage_of(r["episode"]) for r in recs)
    assert stages["propose"] == 2 and stages["repair"] == 4 and stages["validate"] == roles["validator"] == 3
    assert set(stages) == {"propose", "implement", "repair", "validate"}

    # the cost written is what the records say, per task (its own episodes) and for the run
    def own(prefix: str) -> dict[str, Any]:
        mine = [r for r in recs if r["episode"].startswith(prefix + ".")]
        by_role: dict[str, dict[str, Any]] = {}
        for r in mine:
            usage = json.loads(r["response"]["body"])["usage"]
            part = by_role.setdefault(r["role"], {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0,
                                                  "wall_s": 0.0})
            part["calls"] += 1
            part["wall_s"] += r["t_end"] - r["t_start"]
            part["prompt_tokens"] += usage["prompt_tokens"]
            part["completion_tokens"] += usage["completion_tokens"]
        return by_role

    for task in tasks:
        spent = task.metadata["synth_cost"]
        expected = own(task.metadata["candidate"])
        assert spent["by_role"] == {role: {**part, "wall_s": pytest.approx(part["wall_s"], abs=1e-3)}
                                    for role, part in expected.items()}
        assert spent["calls"] == sum(p["calls"] for p in expected.values()) and set(expected) == {
            "synthesis", "validator"}
    run_cost = own(run)
    assert summary["cost"]["calls"] == len(recs)
    assert summary["cost"]["prompt_tokens"] == sum(p["prompt_tokens"] for p in run_cost.values())
    assert summary["cost_per_accepted"]["calls"] == round(len(recs) / 2, 3)
    priced = sum(p["prompt_tokens"] * (1.0 if role == "synthesis" else 0.5)
                 + p["completion_tokens"] * (2.0 if role == "synthesis" else 0.5) for role, p in run_cost.items()) / 1e6
    assert summary["dollars"] == pytest.approx(priced)


def test_synth_without_a_proxy_is_one_error_line(tmp_path: Path) -> None:
    from openforge.processes import free_port

    result = CliRunner().invoke(app, ["tasks", "synth", "--proxy", f"http://127.0.0.1:{free_port()}",
                                      "--about", "anything", "--out", str(tmp_path / "t.jsonl")])
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "does not answer" in lines[0], result.stderr
    assert not (tmp_path / "t.jsonl").exists()


def test_synth_gives_up_on_prose_proposals(start_proxy: Any, tmp_path: Path) -> None:
    """A model that never answers the proposal in JSON: one error line, exit 1, no task file."""
    with ForgeEngine(profile="vllm", script={}) as engine:
        engine.proposals = "I would rather chat."
        proxy = start_proxy(engine.url)
        result = CliRunner().invoke(app, ["tasks", "synth", "--proxy", proxy.url, "--about", "x", "--n", "2",
                                          "--repairs", "1", "--out", str(tmp_path / "t.jsonl"),
                                          "--flow-dir", str(proxy.flow_dir)])
    assert result.exit_code == 1, (result.output, result.exception)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "no usable proposals after 1 repair(s)" in errors[0], result.stderr
    assert not (tmp_path / "t.jsonl").exists()
