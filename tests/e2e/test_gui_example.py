"""The GUI example: its screens and verifier, and the example GUI agent solving them through a real mitmdump
in front of the scripted engine that reads screenshots, over Chat Completions and Anthropic Messages; the
flow files hold every screenshot the agent sent, byte for byte; `openforge rollout` runs the tasks with both
GUI toolchains."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from openforge.addons.flowfile import open_flow_file
from openforge.examples import gui
from openforge.examples.gui import CELL, COLORS, SIZE, TASKS, GuiTask, after_click, score
from openforge.examples.gui_agent import run_episode
from openforge.rollout import run
from openforge.rollout.tasks import read_tasks
from openforge.testing import ROOT
from openforge.testing.gui_engine import FINAL, GuiEngine

CLIENT = "client-token-gui-0123456789"
REWARD = "reward-token-gui-0123456789"
_B64_PNG = re.compile(r"iVBORw0KGgo[A-Za-z0-9+/=]+")  # base64 of a PNG starts with its signature


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def centre(task: GuiTask, color: str | None = None) -> tuple[int, int]:
    x0, y0, x1, y1 = task.box(color)
    return (x0 + x1) // 2, (y0 + y1) // 2


def test_screens_are_small_deterministic_pngs_with_the_target_where_the_box_says() -> None:
    assert len({t.id for t in TASKS}) == len(TASKS) and len({t.screenshot() for t in TASKS}) == len(TASKS)
    for task in TASKS:
        png = task.screenshot()
        assert png == GuiTask(task.seed).screenshot()  # same seed, same bytes
        image = Image.open(io.BytesIO(png))
        assert (image.format, image.size, image.mode) == ("PNG", (SIZE, SIZE), "RGB")
        assert image.getpixel(centre(task)) == COLORS[task.target]
        assert task.instruction == f"Click the {task.target} cell." and task.box()[2] - task.box()[0] == CELL
    assert {t.target for t in TASKS} == set(COLORS)
    marked = after_click(TASKS[0].screenshot(), 5, 5)
    assert Image.open(io.BytesIO(marked)).getpixel((5, 5)) == (0, 0, 0)


def test_the_verifier_grades_the_last_click() -> None:
    task = GuiTask(1)
    x0, y0, x1, y1 = task.box()
    other = next(c for c in COLORS if c != task.target)
    assert score(task, [centre(task)]) == score(task, [(x0, y0)]) == score(task, [(x1 - 1, y1 - 1)]) == 1.0
    assert score(task, [centre(task, other)]) == score(task, [(x1, y0)]) == score(task, []) == 0.0
    assert score(task, [centre(task, other), centre(task)]) == 1.0
    assert score(task, [centre(task), centre(task, other)]) == 0.0


def test_the_verifier_cli_prints_the_reward(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    task = GuiTask(2)
    other = next(c for c in COLORS if c != task.target)
    path = tmp_path / "transcript.json"
    cases = [({"clicks": [list(centre(task))]}, "1.0"), ({"clicks": [list(centre(task, other))]}, "0.0"),
             ({"clicks": []}, "0.0"), ("not json", "0.0"), ({"clicks": [["a"]]}, "0.0"), ([1, 2], "0.0"),
             (None, "0.0")]  # None: the agent wrote no transcript
    for transcript, reward in cases:
        path.unlink(missing_ok=True)
        if transcript is not None:
            path.write_text(transcript if isinstance(transcript, str) else json.dumps(transcript))
        gui.main(["verify", "--seed", "2", "--transcript", str(path)])
        assert capsys.readouterr().out.strip() == reward, transcript


def test_the_task_file_and_screenshot_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gui.main(["tasks", "--n", "3"])
    (tmp_path / "gui.jsonl").write_text(capsys.readouterr().out)
    tasks = read_tasks(tmp_path / "gui.jsonl")
    assert [t.id for t in tasks] == ["gui-0", "gui-1", "gui-2"] and tasks[1].prompt == GuiTask(1).instruction
    assert tasks[1].toolchains == ("gui-agent", "gui-agent-anthropic")
    assert tasks[1].setup is not None and "screenshot --seed 1 screen.png" in tasks[1].setup
    gui.main(["screenshot", "--seed", "1", str(tmp_path / "s.png")])
    assert (tmp_path / "s.png").read_bytes() == GuiTask(1).screenshot()


def images_in(body: bytes) -> list[bytes]:
    """The PNGs a request body holds (base64, bare or in a data: URL), in order."""
    return [base64.b64decode(m) for m in _B64_PNG.findall(body.decode())]


@pytest.mark.parametrize("protocol", ["chat", "anthropic"])
def test_the_agent_solves_a_screen_through_the_proxy_and_the_flows_hold_the_screenshots(
        protocol: str, start_proxy: Any) -> None:
    task = GuiTask(3)
    first = task.screenshot()
    with GuiEngine() as engine:
        proxy = start_proxy(engine.url, "openforge_engine_profile=vllm")
        episode = f"gui-{protocol}"
        done = run_episode(f"{proxy.url}/e/{episode}", task.instruction, first, protocol=protocol)
        assert (done.error, done.final, done.n_calls) == (None, FINAL, 2)
        assert score(task, done.screen.clicks) == 1.0
        [[x, y]] = done.screen.clicks
        proxy.status()  # every answered exchange is on disk
        records = [r for p in proxy.flow_files() for r in open_flow_file(p).records() if r.get("type") == "exchange"]
    records = sorted((r for r in records if r["episode"] == episode), key=lambda r: r["seq"])
    assert [r["protocol"] for r in records] == [protocol] * 2
    assert all(r["response"]["status"] == 200 for r in records)
    marked = after_click(first, x, y)
    shown = [[sha(first)], [sha(first), sha(marked)]]  # each call holds the conversation so far
    for rec, want in zip(records, shown):
        client, upstream = rec["client_request"]["body"], rec["upstream_request"]["body"]
        assert [sha(i) for i in images_in(client)] == [sha(i) for i in images_in(upstream)] == want
        assert f"data:image/png;base64,{base64.b64encode(first).decode()}".encode() in upstream
        if protocol == "anthropic":
            assert rec["translated"]["from"] == "anthropic"
            sent = json.loads(client)
            assert sent["tools"][0]["type"] == "computer_20250124"
            assert sent["messages"][0]["content"][1]["source"] == {
                "type": "base64", "media_type": "image/png", "data": base64.b64encode(first).decode()}
        else:
            assert rec["translated"] is None


def test_rollout_runs_the_gui_tasks_with_both_toolchains(start_proxy: Any, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENFORGE_CLIENT_TOKEN", CLIENT)
    monkeypatch.setenv("OPENFORGE_REWARD_TOKEN", REWARD)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the agent and episode processes import this checkout
    with GuiEngine() as engine:
        proxy = start_proxy(engine.url, "openforge_engine_profile=vllm", f"openforge_client_tokens={CLIENT}",
                            f"openforge_reward_tokens={REWARD}")
        rollout = run(gui.rollout_tasks(1), ["gui-agent", "gui-agent-anthropic"], proxy=proxy.url,
                      out=tmp_path / "out", attempts=1, concurrency=2)
    assert sorted((r.task_id, r.toolchain, r.status, r.reward, r.reward_posted) for r in rollout.results) == [
        ("gui-0", c, "ok", 1.0, True) for c in ("gui-agent", "gui-agent-anthropic")]
    work = tmp_path / "out" / "episodes" / rollout.results[0].episode / "work"
    assert json.loads((work / "transcript.json").read_text())["final"] == FINAL
