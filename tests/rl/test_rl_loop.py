"""`openforge rl`: its config, GRPO groups within one policy version, and a real run on the embedded engine
that is interrupted (Ctrl-C) mid-way and resumed: nothing left running, no episode or sample counted twice.

The uninterrupted short run, with its files and the notebook over them, is tests/e2e/test_demo_e2e.py (the
demo is the loop).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pytest
from rich.console import Console

from openforge.reconstruct import store
from openforge.reconstruct.rewards import advantage_sql
from openforge.rl.config import load_rl_config
from openforge.rl.episodes import rerun
from openforge.rl.errors import RLError
from openforge.rl.loop import RLRun
from openforge.rl.state import STAGES
from openforge.rollout.spec import Adapter, EpisodeSpec, Task
from openforge.settings import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["--iterations", "2", "--attempts", "2", "--steps", "1", "--set", "rollout.max_tasks=2",
         "--set", "train.step_tokens=1024", "--set", "train.row_tokens=1024", "--set", "engine.threads=1"]


# --- config ------------------------------------------------------------------------------------------------

def test_config_defaults_file_sets_and_flags_in_that_order(tmp_path: Path) -> None:
    cfg = load_rl_config()
    assert (cfg.engine.backend, cfg.loop.iterations, cfg.rollout.toolchains, cfg.train.steps) == \
        ("llamacpp", 3, ["tool-agent"], 2)
    assert cfg.train.min_lr_ratio == 1.0  # constant lr: a cosine schedule would restart every iteration
    path = tmp_path / "rl.toml"
    path.write_text('[loop]\niterations = 5\nwindow = 2\n[rollout]\ntoolchains = ["codex", "tool-agent"]\n'
                    '[train]\nlr = 3e-6\nkl_coef = 0.01\n')
    cfg = load_rl_config(path, {"loop.iterations": "7", "rollout.toolchains": "claude-code,codex"})
    assert (cfg.loop.iterations, cfg.loop.window, cfg.rollout.toolchains) == (7, 2, ["claude-code", "codex"])
    assert cfg.train.lr == 3e-6 and cfg.train_config("db", "m", "o").kl_coef == 0.01
    saved = tmp_path / "saved.toml"
    saved.write_text(cfg.to_toml())
    assert load_rl_config(saved) == cfg  # what --resume reads back


@pytest.mark.parametrize(("text", "sets", "message"), [
    ("[engines]\nbackend = 'vllm'\n", {}, "unknown section(s) engines"),
    ("[loop]\niteration = 2\n", {}, "unknown setting loop.iteration"),
    ("", {"loop.iterations": "0"}, "loop.iterations must be >= 1"),
    ("", {"loop.iterations": "two"}, "loop.iterations: cannot read 'two' as int"),
    ("", {"engine.backend": "sglang"}, "engine.backend must be llamacpp or vllm"),
    ("", {"train.db": "other.duckdb"}, "[train] may not set db, model, out, where"),
    ("", {"train.lr": "-1"}, "lr must be finite and > 0"),
    ("", {"train.warp": "9"}, "unknown config key(s): warp"),
    ("", {"iterations": "2"}, "--set expects section.key=value"),
    ("", {"proxy.temperature": "-1"}, "proxy.temperature must be >= 0 (0 = greedy), not -1"),
    ("", {"proxy.temperature": "nan"}, "proxy.temperature must be >= 0"),
    ("", {"proxy.top_p": "7"}, "proxy.top_p must be in (0, 1], not 7"),
    ("", {"proxy.top_p": "0"}, "proxy.top_p must be in (0, 1]"),
    ("", {"proxy.min_p": "1.5"}, "proxy.min_p must be in [0, 1]"),
    ("", {"proxy.pause_timeout": "inf"}, "proxy.pause_timeout must be > 0 seconds"),
    ("", {"engine.max_model_len": "5"}, "engine.max_model_len must be >= 512 tokens, not 5"),
    ("", {"rollout.pass_threshold": "nan"}, "rollout.pass_threshold must be a finite number"),
    ("[loop\n", {}, "cannot read config"),
])
def test_config_errors_name_the_setting(tmp_path: Path, text: str, sets: dict[str, str], message: str) -> None:
    path = tmp_path / "rl.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_rl_config(path, sets)
    assert message in str(e.value)


# --- advantages within a policy version --------------------------------------------------------------------

def test_grpo_groups_never_mix_policy_versions(tmp_path: Path) -> None:
    """Attempts at one task by policy 0 (rewards 0, 1) and policy 1 (rewards 1, 1): each group is normalised
    on its own, so policy 1's equal rewards get advantage 0, not the positive one a mixed group gives."""
    con = store.connect(tmp_path / "db.duckdb")
    episodes = [("a0", 0, 0.0), ("b0", 0, 1.0), ("a1", 1, 1.0), ("b1", 1, 1.0)]
    for ep, version, reward in episodes:
        con.execute("INSERT INTO episodes (episode_id, task_id, n_calls, n_samples, reward, weight) "
                    "VALUES (?, 't', 1, 1, ?, 1.0)", [ep, reward])
        con.execute("INSERT INTO calls (call_id, file_id, episode_id, protocol, streamed, token_source, "
                    "policy_version) VALUES (?, 'f', ?, 'chat', false, 'engine', ?)", [f"c-{ep}", ep, version])
    con.execute(advantage_sql("grpo"))
    adv = dict(con.execute("SELECT episode_id, advantage FROM episodes").fetchall())
    con.close()
    assert adv["a1"] == adv["b1"] == 0.0
    assert adv["a0"] < 0 < adv["b0"]


# --- resume ------------------------------------------------------------------------------------------------

def test_a_rerun_episode_gets_a_new_id_and_directories(tmp_path: Path) -> None:
    spec = EpisodeSpec(run_id="r", episode="r-t-tool-agent-1", task=Task("t", "p", "true"),
                       adapter=Adapter("tool-agent", ("true",)), attempt=1, proxy_url="http://127.0.0.1:1",
                       out_dir=str(tmp_path / "episodes/r-t-tool-agent-1"), workdir="w", home="h")
    assert rerun(spec, 0) is spec
    again = rerun(spec, 2)
    assert again.episode == "r-t-tool-agent-1-r2" and again.base_url.endswith("/e/r-t-tool-agent-1-r2")
    assert Path(again.out_dir) == tmp_path / "episodes/r-t-tool-agent-1-r2"
    assert Path(again.workdir).parent == Path(again.out_dir) == Path(again.home).parent


class Scripted(RLRun):
    """The loop's stage machine with stages that only log themselves (no engine, proxy or model); `stop_at`
    raises KeyboardInterrupt in that (iteration, stage), as a Ctrl-C there would."""

    def __init__(self, out: Path, log: list[tuple[int, str]], stop_at: tuple[int, str] | None = None,
                 resume: bool = False) -> None:
        super().__init__(load_rl_config(sets={"loop.iterations": "3"}), out, Console(file=io.StringIO()), resume)
        self.log, self.stop_at = log, stop_at
        for stage in STAGES[:-1]:
            setattr(self, stage, lambda i, stage=stage: self.step(i, stage))

    def step(self, i: int, stage: str) -> None:
        if (i, stage) == self.stop_at:
            raise KeyboardInterrupt
        self.log.append((i, stage))
        if stage == "publish":
            self.state.version = i + 1

    @contextlib.contextmanager
    def services(self) -> Iterator[None]:
        yield

    def summary_line(self, i: int) -> dict[str, Any]:
        return {"iteration": i, "policy_version": i, "reward_mean": None, "pass_at_k": None, "samples": 0,
                "attempts": 4, "toolchains": {}}


@pytest.mark.parametrize("stop_at", [(0, "rollout"), (1, "train"), (1, "publish"), (2, "reconstruct")])
def test_resume_runs_each_stage_of_each_iteration_once(tmp_path: Path, stop_at: tuple[int, str]) -> None:
    log: list[tuple[int, str]] = []
    with pytest.raises(KeyboardInterrupt):
        Scripted(tmp_path / "run", log, stop_at).run()
    Scripted(tmp_path / "run", log, resume=True).run()
    assert log == [(i, stage) for i in range(3) for stage in STAGES[:-1]]
    lines = [json.loads(x) for x in (tmp_path / "run" / "rl.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in lines] == [0, 1, 2]
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    assert (state["iteration"], state["stage"], state["version"], state["resumes"]) == (3, "eval", 3, 1)


def test_an_interruption_after_the_line_was_written_does_not_write_it_twice(tmp_path: Path) -> None:
    log: list[tuple[int, str]] = []
    Scripted(tmp_path / "run", log).run()
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    (tmp_path / "run" / "state.json").write_text(json.dumps(state | {"iteration": 2, "stage": "record"}))
    Scripted(tmp_path / "run", log, resume=True).run()  # killed between the line and the state's save
    lines = [json.loads(x) for x in (tmp_path / "run" / "rl.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in lines] == [0, 1, 2] and len(log) == 15


def test_a_finished_run_resumes_for_more_iterations_and_a_used_directory_is_refused(tmp_path: Path) -> None:
    log: list[tuple[int, str]] = []
    Scripted(tmp_path / "run", log).run()
    with pytest.raises(RLError, match="holds a run already"):
        Scripted(tmp_path / "run", log)
    more = Scripted(tmp_path / "run", log, resume=True)
    more.cfg.loop.iterations = 4
    more.run()
    assert log[-5:] == [(3, stage) for stage in STAGES[:-1]]


# --- one run per directory ---------------------------------------------------------------------------------

def test_a_second_run_in_a_directory_in_use_fails_at_once_naming_the_holder(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    first = Scripted(tmp_path / "run", [])
    with pytest.raises(RLError, match=rf"in use by another `openforge rl` \(pid {os.getpid()} on "):
        Scripted(tmp_path / "run", [], resume=True)
    first.run()  # releases it at the end
    Scripted(tmp_path / "run", [], resume=True).run()


def test_two_runs_started_in_a_new_directory_at_once_do_not_both_run(tmp_path: Path) -> None:
    from openforge.rl.lock import RunLock

    second = Scripted(tmp_path / "run", [])  # the directory does not exist yet: nothing to lock at set-up
    first = RunLock(tmp_path / "run")
    first.acquire()
    with pytest.raises(RLError, match="in use by another"):
        second.run()
    assert not (tmp_path / "run" / "rl.jsonl").exists()
    first.release()


def test_the_lock_goes_with_its_holder_even_killed(tmp_path: Path) -> None:
    code = ("import pathlib, time; from openforge.rl.lock import RunLock; "
            f"lock = RunLock(pathlib.Path({str(tmp_path / 'run')!r})); lock.acquire(); "
            "print('held', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code],
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        cli = subprocess.run([sys.executable, "-m", "openforge.cli", "rl", "--out", str(tmp_path / "run")],
                             cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"},
                             capture_output=True, text=True, timeout=120)
        assert cli.returncode == 2 and f"pid {holder.pid} on" in cli.stderr + cli.stdout, cli
        assert "Traceback" not in cli.stderr and "engine" not in cli.stdout, cli
    finally:
        holder.kill()
        holder.wait()
    Scripted(tmp_path / "run", []).run()  # kill -9 released it: no stale lock


def children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found |= {int(x) for x in (task / "children").read_text().split()}
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_ctrl_c_mid_rollout_stops_everything_and_resume_counts_each_episode_once(tmp_path: Path) -> None:
    """Ctrl-C in iteration 2's rollout: iteration 1's step is in the resident trainer's memory only (no
    checkpoint is due), so stopping writes it; --resume goes on from it."""
    out = tmp_path / "run"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OPENFORGE_")},
           "PYTHONPATH": str(ROOT), "COLUMNS": "160"}
    command = [sys.executable, "-m", "openforge.cli", "rl", "--out", str(out), *SHORT,
               "--set", "train.keep_zero_advantage=true"]  # a step every iteration
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    # Ctrl-C once the first episode of iteration 2 has finished and others have started
    episodes = out / "iterations" / "001" / "rollout" / "episodes"
    deadline = time.monotonic() + 800
    while not list(episodes.glob("*/result.json")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    kids = children(proc.pid)
    assert len(kids) >= 3, kids  # engine, proxy, episodes
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, output
    assert "interrupted" in output and "--resume" in output and "Traceback" not in output, output
    time.sleep(1)
    assert not [k for k in kids if alive(k)], output  # engine, proxy and every episode stopped
    assert json.loads((out / "state.json").read_text())["iteration"] == 1
    assert "saved the trainer's state" in output, output
    assert [p.name for p in (out / "train" / "checkpoints").iterdir()] == ["step_000001"]

    done = subprocess.run([sys.executable, "-m", "openforge.cli", "rl", "--out", str(out), "--resume"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [json.loads(x) for x in (out / "rl.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in lines] == [0, 1] and [x["policy_version"] for x in lines] == [0, 1]
    assert all(x["episodes"] == 4 for x in lines)  # 2 tasks x 2 attempts, each counted once
    state = json.loads((out / "state.json").read_text())
    assert (state["iteration"], state["version"], state["resumes"]) == (2, 2, 1)

    con = duckdb.connect(str(out / "rl.duckdb"), read_only=True)
    per_iteration = con.execute("SELECT iteration, count(*), count(DISTINCT episode_id), count(DISTINCT "
                                "task_id || '/' || attempt) FROM rl_episodes GROUP BY 1 ORDER BY 1").fetchall()
    assert per_iteration == [(0, 4, 4, 4), (1, 4, 4, 4)]
    trained = con.execute("SELECT r.iteration, s.policy_version, count(*) FROM samples s JOIN rl_episodes r "
                          "USING (episode_id) WHERE s.n_trainable > 0 GROUP BY 1, 2 ORDER BY 1").fetchall()
    con.close()
    assert [(i, v) for i, v, _ in trained] == [(0, 0), (1, 1)]  # each iteration's samples, its policy's
    assert [n for _, _, n in trained] == [x["samples"] for x in lines]
    # one step per iteration, the optimizer state carried on through the stop; the last iteration checkpoints
    steps = [json.loads(x)["step"] for x in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2] and [x["train_step_range"] for x in lines] == [[1, 1], [2, 2]]
    assert [x["checkpoint"] for x in lines] == [None, str(out / "train" / "checkpoints" / "step_000002")]
    assert [p.name for p in (out / "train" / "checkpoints").iterdir()] == ["step_000002"]
    assert [p.name for p in (out / "policies").iterdir()] == ["policy-0002.gguf"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_async_mode_trains_on_the_last_rollouts_while_the_next_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OPENFORGE_")},
           "PYTHONPATH": str(ROOT), "COLUMNS": "160"}
    done = subprocess.run([sys.executable, "-m", "openforge.cli", "rl", "--out", str(out), *SHORT,
                           "--set", "loop.mode=async", "--set", "train.keep_zero_advantage=true"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1100)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    lines = [json.loads(x) for x in (out / "rl.jsonl").read_text().splitlines()]
    assert [x["trained_on"] for x in lines] == [None, 0] and [x["policy_version"] for x in lines] == [0, 1]
    assert lines[0]["skipped_train"].startswith("async mode") and lines[0]["train_steps"] == 0
    assert lines[1]["train_steps"] == 1 and lines[1]["staleness"] == {"max": 1, "mean": 1.0}  # one version behind
    assert lines[1]["served"] == str(out / "policies" / "policy-0002.gguf")
    con = duckdb.connect(str(out / "rl.duckdb"), read_only=True)
    versions = con.execute("SELECT r.iteration, c.policy_version FROM calls c JOIN rl_episodes r USING (episode_id) "
                           "GROUP BY ALL ORDER BY 1").fetchall()
    split = con.execute("SELECT episode_id FROM calls GROUP BY 1 HAVING count(DISTINCT policy_version) > 1").fetchall()
    con.close()
    assert versions == [(0, 0), (1, 1)] and split == []  # every episode on one policy version


# --- the trainer's output in the loop ------------------------------------------------------------------------

def test_the_step_message_says_which_steps_run() -> None:
    from openforge.trainer.train import steps_phrase

    assert steps_phrase(0, 4) == "steps 1-4 of this run"
    assert steps_phrase(1, 5) == "steps 2-5 of this run (after step 1)"
    assert steps_phrase(4, 5) == "step 5 of this run (after step 4)"
    assert steps_phrase(5, 5) == "no step to run (the checkpoint is at step 5 of 5)"


def test_the_progress_bar_shows_wall_time_throughput_and_time_left() -> None:
    from openforge.trainer.train import ProgressBar

    now = [0.0]
    out = io.StringIO()
    bar = ProgressBar(True, 5, 1, clock=lambda: now[0], console=Console(file=out, width=200))
    with bar:
        for t in (600.0, 1200.0):  # two steps of 10 minutes, 6000 tokens each
            now[0] = t
            bar.advance({"tokens": 6000, "loss": 0.5})
    text = out.getvalue()
    assert "3/5" in text and "0:20:00" in text, text  # the real elapsed time
    assert "10 tok/s" in text and "~0:20:00 left" in text, text  # 12000 tokens / 1200 s; 2 steps at 600 s
