"""`openforge replay drive`: re-send recorded engine calls, measure, and compare with the recorded outputs."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from typer.testing import CliRunner

from openforge.replay.drive import drive, prefix_ratio
from openforge.replay.serve import ReplayIndex, ReplayServer
from openforge.replay.trace import load_exchanges
from openforge.testing.toolchain_flows import chat_stream_events, exchange, sse, write_trace


def trace(tmp_path: Path, name: str, texts: list[str]) -> Path:
    records = []
    for i, text in enumerate(texts):
        body = {"model": "m", "messages": [{"role": "user", "content": f"task {i}"}], "stream": True}
        ids = [100 + sum(map(ord, w)) for w in text.split(" ")]  # one token per word
        records.append(exchange(body, episode=f"ep{i % 2}", chunks=sse(chat_stream_events(text, ids)),
                                injected=["return_token_ids"], t_start=1000.0 + i))
    return write_trace(tmp_path / name, records)


def test_replay_drive_against_itself_is_identical(tmp_path: Path) -> None:
    texts = [f"answer number {i} is here" for i in range(6)]
    exchanges = load_exchanges([trace(tmp_path, "a", texts)])
    with ReplayServer(ReplayIndex.build(exchanges, side="engine"), speed=None) as srv:
        report = asyncio.run(drive(exchanges, srv.url, concurrency=3))
    s = report.summary()
    assert (s["calls"], s["ok"], s["failed"]) == (6, 6, 0)
    assert s["identical_fraction"] == 1.0 and s["mean_prefix_ratio"] == 1.0
    assert s["ttft_p50_s"] is not None and s["latency_p99_s"] >= s["latency_p50_s"] > 0
    assert s["output_tokens_per_s"] > 0


def test_replay_drive_measures_divergence_from_another_policy(tmp_path: Path) -> None:
    recorded = load_exchanges([trace(tmp_path, "a", ["same words here", "first differs", "x y z"])])
    # the "new policy" answers the same prompts: one identical, one diverging after a common prefix, one not at all
    other = load_exchanges([trace(tmp_path, "b", ["same words here", "first changed", "q r s"])])
    with ReplayServer(ReplayIndex.build(other, side="engine"), speed=None) as srv:
        report = asyncio.run(drive(recorded, srv.url, concurrency=2))
    by_id = {r.id: r for r in report.results}
    results = [by_id[ex["id"]] for ex in recorded]
    assert [r.identical for r in results] == [True, False, False]
    assert results[1].prefix_ratio == 0.5 and results[2].prefix_ratio == 0.0
    assert report.summary()["identical_fraction"] == 1 / 3


def test_replay_drive_reports_engine_errors(tmp_path: Path) -> None:
    recorded = load_exchanges([trace(tmp_path, "a", ["one two"])])
    unrelated = load_exchanges([trace(tmp_path, "b", ["x"])])
    unrelated[0]["upstream_request"]["body"] = json.dumps({"messages": [{"role": "user", "content": "zzz"}]}).encode()
    with ReplayServer(ReplayIndex.build(unrelated, side="engine"), speed=None) as srv:
        report = asyncio.run(drive(recorded, srv.url, concurrency=1))
    assert report.results[0].error == "HTTP 400" and report.summary()["ok"] == 0


def test_replay_prefix_ratio() -> None:
    assert prefix_ratio([], []) == 1.0
    assert prefix_ratio([1, 2, 3, 4], [1, 2]) == 0.5


def test_replay_drive_cli_prints_and_writes_json(tmp_path: Path) -> None:
    import typer

    from openforge.commands import replay as cmd

    app = typer.Typer()
    cmd.register(app)
    path = trace(tmp_path, "a", ["alpha beta", "gamma"])
    out = tmp_path / "report.json"
    with ReplayServer(ReplayIndex.build(load_exchanges([path]), side="engine"), speed=None) as srv:
        res = CliRunner().invoke(app, ["replay", "drive", str(path), "--upstream", srv.url, "--concurrency", "2",
                                       "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "identical_fraction" in res.output
    data = json.loads(out.read_text())
    assert data["summary"]["ok"] == 2 and len(data["calls"]) == 2
