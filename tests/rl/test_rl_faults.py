"""Faults `openforge rl` must notice (issue 25), each on the loop's stage machine with the engine, the proxy
and the episode processes replaced by stand-ins: interrupted episodes rerun on --resume, a dead engine
restarted (or the run stopped), only finite weights published, rewards that disagree flagged. Also the
run's secrets: files in DIR/secrets, never in an environment or a command line."""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import duckdb
import pytest
import torch
from rich.console import Console

from openforge.engines.process import EngineError
from openforge.reconstruct import store
from openforge.rl import episodes
from openforge.rl.config import load_rl_config
from openforge.rl.errors import RLError
from openforge.rl.loop import RLRun
from openforge.rollout.runner import Rollout, write_rollout
from openforge.rollout.spec import EpisodeResult, EpisodeSpec

OTHER_STAGES = ("reconstruct", "train", "publish")


class FakePolicy:
    """The engine: `alive()` answers from `health` (popped; True once empty); restarts are logged."""

    profile, url = "llamacpp", "http://127.0.0.1:1"

    def __init__(self, log: list[Any], health: list[bool] | None = None, restart_fails: bool = False) -> None:
        self.log, self.health, self.restart_fails = log, health or [], restart_fails
        self.published: list[Any] = []
        self.served = Path("/cache/start.f16.gguf")  # policy 0: the starting GGUF's f16 export

    def alive(self) -> bool:
        return self.health.pop(0) if self.health else True

    def restart(self) -> None:
        self.log.append("restart")
        if self.restart_fails:
            raise EngineError("engine for x.gguf exited with code 1 before http://127.0.0.1:1/health answered")

    def publish(self, weights: Any, version: int, out: Path) -> Path:
        self.published.append(weights)
        self.served = out / f"policy-{version:04d}.gguf"
        return self.served


class FakeControl:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def status(self) -> dict[str, Any]:
        return {}

    def pause(self, timeout_s: float) -> None:
        self.calls.append(("pause", timeout_s))

    def resume(self, version: int) -> None:
        self.calls.append(("resume", version))


class FakeProxy:
    url = "http://127.0.0.1:1"


class Run(RLRun):
    """The loop with stand-in services; the stages in `fake` only log themselves, the others are real."""

    def __init__(self, out: Path, log: list[Any], *, resume: bool = False, fake: tuple[str, ...] = OTHER_STAGES,
                 policy: FakePolicy | None = None, iterations: int = 1, sets: dict[str, str] | None = None) -> None:
        cfg = load_rl_config(sets={"loop.iterations": str(iterations), "rollout.max_tasks": "2",
                                   "rollout.attempts": "2", **(sets or {})})
        self.text = io.StringIO()
        super().__init__(cfg, out, Console(file=self.text, width=200), resume)
        self.log = log
        self.fake_policy = policy or FakePolicy(log)
        for stage in fake:
            setattr(self, stage, lambda i, stage=stage: self.log.append((i, stage)))

    @contextlib.contextmanager
    def services(self) -> Iterator[None]:
        self.policy, self.proxy, self.control = self.fake_policy, FakeProxy(), FakeControl()  # type: ignore[assignment]
        yield

    def summary_line(self, i: int) -> dict[str, Any]:
        return {"iteration": i, "policy_version": i, "reward_mean": None, "pass_at_k": None, "samples": 0,
                "attempts": 2, "toolchains": {}}


def fake_execute(outcomes: dict[int, Any], ran: list[str], interrupt: bool = False) -> Any:
    """`runner.execute`: in its first call, episode k's result.json as `outcomes[k]` says (fields over an ok
    result; None: no result.json, as after a kill -9), then Ctrl-C if `interrupt`; later calls: all ok."""
    calls: list[int] = []

    def execute(run_id: str, specs: list[EpisodeSpec], *, out: Path, done: Any = (), **options: Any) -> Rollout:
        first = not calls
        calls.append(len(specs))
        for k, spec in enumerate(specs):
            ran.append(spec.episode)
            outcome = outcomes.get(k, {}) if first else {}
            Path(spec.out_dir).mkdir(parents=True, exist_ok=True)
            if outcome is not None:
                result = EpisodeResult(spec.episode, spec.task.id, spec.adapter.name, spec.attempt, "ok", 1.0,
                                       reward_posted=True)
                (Path(spec.out_dir) / "result.json").write_text(json.dumps(asdict(result) | outcome))
        if first and interrupt:
            raise KeyboardInterrupt
        results = [*done, *(res for s in specs if (res := read(s)) is not None)]
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "results.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in results))
        return Rollout(run_id, Path(out), results)

    return execute


def read(spec: EpisodeSpec) -> EpisodeResult | None:
    path = Path(spec.out_dir) / "result.json"
    return EpisodeResult(**json.loads(path.read_text())) if path.is_file() else None


# --- interrupted episodes --------------------------------------------------------------------------------

def test_episodes_an_interruption_cut_short_run_again_on_resume(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Of 4 episodes: one finished, one was stopped by SIGTERM (`crashed: interrupted`), one failed because
    a kill -9 of the loop took the proxy (agent_failed, its reward post failed), one left no result. On
    --resume only the finished one counts; the other three run again under new ids."""
    ran: list[str] = []
    outcomes = {1: {"status": "crashed", "reason": "interrupted", "reward": None, "reward_posted": False},
                2: {"status": "agent_failed", "reward": None, "reward_posted": False,
                    "reason": "agent exited 1; reward post failed: [Errno 111] Connection refused"},
                3: None}
    monkeypatch.setattr(episodes, "execute", fake_execute(outcomes, ran, interrupt=True))
    log: list[Any] = []
    with pytest.raises(KeyboardInterrupt):
        Run(tmp_path / "run", log).run()
    first = list(ran)
    assert len(first) == 4
    Run(tmp_path / "run", log, resume=True).run()
    assert ran[4:] == [f"{first[k]}-r1" for k in (1, 2, 3)]
    results = [json.loads(x) for x in (tmp_path / "run/iterations/000/rollout/results.jsonl").read_text().splitlines()]
    assert sorted(r["episode"] for r in results) == sorted([first[0], *ran[4:]])
    assert all(r["status"] == "ok" for r in results)


def test_a_failure_that_posted_no_reward_by_choice_is_kept(tmp_path: Path) -> None:
    """on_failure=drop posts nothing for a failure: that result is final, not an interruption."""
    failed = EpisodeResult("e", "t", "tool-agent", 1, "agent_failed", None, reason="agent exited 1")
    assert episodes.finished(failed, "drop") and not episodes.finished(failed, "zero")
    interrupted = EpisodeResult("e", "t", "tool-agent", 1, "crashed", None, reason="interrupted")
    assert not episodes.finished(interrupted, "drop")
    assert episodes.finished(EpisodeResult("e", "t", "a", 1, "ok", 0.5, reward_posted=True), "zero")


# --- a dead engine ---------------------------------------------------------------------------------------

def test_a_dead_engine_is_restarted_before_the_next_stage(tmp_path: Path) -> None:
    log: list[Any] = []
    policy = FakePolicy(log, health=[True, False])  # alive before the rollout, dead before publish
    Run(tmp_path / "run", log, fake=("rollout", *OTHER_STAGES), policy=policy).run()
    assert log == [(0, "rollout"), (0, "reconstruct"), (0, "train"), "restart", (0, "publish")]
    state = json.loads((tmp_path / "run/state.json").read_text())
    assert state["restarts"] == 1 and state["iteration"] == 1


def test_an_engine_that_does_not_come_back_stops_the_run_before_any_rollout(tmp_path: Path) -> None:
    log: list[Any] = []
    policy = FakePolicy(log, health=[False], restart_fails=True)
    run = Run(tmp_path / "run", log, fake=("rollout", *OTHER_STAGES), policy=policy)
    with pytest.raises(RLError, match="the engine died and did not restart: engine for x.gguf exited"):
        run.run()
    assert log == ["restart"]  # no rollout, no publish against it
    assert json.loads((tmp_path / "run/state.json").read_text())["stage"] == "rollout"


def test_an_engine_that_dies_twice_in_an_iteration_stops_the_run(tmp_path: Path) -> None:
    log: list[Any] = []
    policy = FakePolicy(log, health=[False, False])
    with pytest.raises(RLError, match="died again in iteration 1 after a restart"):
        Run(tmp_path / "run", log, fake=("rollout", *OTHER_STAGES), policy=policy).run()
    assert log == ["restart", (0, "rollout"), (0, "reconstruct"), (0, "train")]


def test_a_rollout_the_engine_died_under_runs_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every episode of a round the engine died in failed for it: all of them run again (new ids) once it
    is back, so no failure caused by the engine is counted or trained on."""
    ran: list[str] = []
    failed = {"status": "agent_failed", "reward": None, "reward_posted": True, "reason": "agent exited 1"}
    monkeypatch.setattr(episodes, "execute", fake_execute({k: failed for k in range(4)}, ran))
    log: list[Any] = []
    policy = FakePolicy(log, health=[True, False])  # alive before the rollout, dead after it
    Run(tmp_path / "run", log, policy=policy).run()
    assert len(ran) == 8 and ran[4:] == [f"{e}-r1" for e in ran[:4]]
    results = [json.loads(x) for x in (tmp_path / "run/iterations/000/rollout/results.jsonl").read_text().splitlines()]
    assert [r["episode"] for r in results] == ran[4:] and all(r["status"] == "ok" for r in results)
    assert log[0] == "restart"


# --- publish ----------------------------------------------------------------------------------------------

class FakeTrainer:
    """The resident trainer: at `step`, with `weights` (an exception instead: what `weights()` raises)."""

    def __init__(self, step: int, weights: dict[str, torch.Tensor] | Exception) -> None:
        self.step, self._weights, self.unsaved = step, weights, False

    def weights(self) -> dict[str, torch.Tensor]:
        if isinstance(self._weights, Exception):
            raise self._weights
        return self._weights

    def close(self) -> None:
        pass


def publish_run(tmp_path: Path, trainer: FakeTrainer, start: int = 0, end: int = 1) -> Run:
    """The loop at the publish stage of iteration 0, which trained steps start+1..end."""
    run = Run(tmp_path / "run", [], fake=("rollout", "reconstruct", "train"))
    run.trainer = trainer  # type: ignore[assignment]
    run.state.train_start_step, run.state.train_end_step = start, end
    return run


def test_publish_serves_the_trainers_weights_from_memory(tmp_path: Path) -> None:
    w = {"w": torch.ones(4, 4)}
    run = publish_run(tmp_path, FakeTrainer(1, w))
    with run.services():
        run.publish(0)
    assert run.fake_policy.published == [w] and run.state.version == 1
    assert run.control.calls == [("pause", 300.0), ("resume", 1)]  # type: ignore[union-attr]
    assert not (tmp_path / "run/train/checkpoints").exists()  # no checkpoint was due, none was read


def test_non_finite_weights_never_reach_the_engine(tmp_path: Path) -> None:
    from openforge.trainer.data import DataError

    run = publish_run(tmp_path, FakeTrainer(1, DataError("not saving step 1: 1 weight tensor(s) hold non-finite "
                                                         "values (w)")))
    with run.services(), pytest.raises(RLError) as e:
        run.publish(0)
    assert str(e.value).startswith("publishing policy version 1 failed: DataError: not saving step 1")
    assert run.fake_policy.published == [] and run.control.calls == []  # type: ignore[union-attr]


def test_an_iteration_that_trained_nothing_publishes_the_same_weights_again(tmp_path: Path) -> None:
    run = publish_run(tmp_path, FakeTrainer(3, {}), start=-1, end=-1)
    run.state.skipped_train = "every group had equal rewards (2 groups)"
    with run.services():
        run.publish(0)
    assert run.fake_policy.published == [] and run.state.served == "" and run.state.version == 1
    assert run.control.calls == [("pause", 300.0), ("resume", 1)]  # type: ignore[union-attr]
    # what the engine serves is named, not the quantised GGUF the run started from
    assert run.serving() == "/cache/start.f16.gguf" and "/cache/start.f16.gguf" in run.text.getvalue()
    assert str(run.start_weights) not in run.text.getvalue()


def test_steps_a_kill_lost_are_trained_again_before_publishing(tmp_path: Path) -> None:
    """state.json says: publish what steps 3-4 trained; the process that trained them was killed before it
    saved, so the trainer loaded on resume is at step 2."""
    trainer = FakeTrainer(2, {"w": torch.zeros(1)})
    run = publish_run(tmp_path, trainer, start=2, end=4)
    run.train_pass = lambda i: setattr(trainer, "step", 4)  # type: ignore[method-assign]
    with run.services():
        run.publish(0)
    assert trainer.step == 4 and len(run.fake_policy.published) == 1
    assert "were in memory only when the run was killed: training them again" in run.text.getvalue()


def test_every_publish_failure_is_one_rl_error(tmp_path: Path) -> None:
    run = publish_run(tmp_path, FakeTrainer(1, {"w": torch.ones(1)}))

    def broken(weights: Any, version: int, out: Path) -> Path:
        raise OSError(28, "No space left on device")

    run.fake_policy.publish = broken  # type: ignore[method-assign]
    with run.services(), pytest.raises(RLError) as e:
        run.publish(0)
    assert str(e.value) == "publishing policy version 1 failed: OSError: [Errno 28] No space left on device"


# --- rewards that disagree -------------------------------------------------------------------------------

def test_a_reward_that_differs_from_result_json_is_flagged_and_not_trained(tmp_path: Path) -> None:
    """A late post turned e2's 0.0 into 0.99 in the flow files; e3's failure posted 0.0 (on_failure=zero)
    and DuckDB agrees; e4 posted nothing but DuckDB has a reward for it."""
    run = Run(tmp_path / "run", [])
    out = run.rollout_dir(0)
    out.mkdir(parents=True)
    results = [EpisodeResult("e1", "t", "tool-agent", 1, "ok", 1.0, reward_posted=True),
               EpisodeResult("e2", "t", "tool-agent", 2, "ok", 0.0, reward_posted=True),
               EpisodeResult("e3", "t", "tool-agent", 3, "agent_failed", None, reward_posted=True),
               EpisodeResult("e4", "t", "tool-agent", 4, "crashed", None, reward_posted=False)]
    write_rollout(Rollout("r", out, results, {"run_id": "r"}))
    con = store.connect(run.db)
    for ep, reward in [("e1", 1.0), ("e2", 0.99), ("e3", 0.0), ("e4", 0.7)]:
        con.execute("INSERT INTO episodes (episode_id, task_id, n_calls, n_samples, reward, weight) "
                    "VALUES (?, 't', 1, 1, ?, 1.0)", [ep, reward])
    con.close()
    run.record_episodes(0)
    text = run.text.getvalue()
    assert "warning:" in text and "2 episodes' rewards" in text and "e2 (result.json 0, DuckDB 0.99)" in text
    con = duckdb.connect(str(run.db))
    assert con.execute("SELECT episode_id, result_reward, db_reward FROM rl_reward_mismatches ORDER BY 1").fetchall() \
        == [("e2", 0.0, 0.99), ("e4", None, 0.7)]
    con.execute("CREATE TEMP TABLE s AS SELECT episode_id, 0 AS policy_version, 1 AS n_trainable FROM episodes")
    kept = con.execute(f"SELECT episode_id FROM s WHERE {run.selection(0).sql()} ORDER BY 1").fetchall()
    con.close()
    assert kept == [("e1",), ("e3",)]


def test_rl_jsonl_counts_the_reward_mismatches(tmp_path: Path) -> None:
    run = Run(tmp_path / "run", [])
    out = run.rollout_dir(0)
    out.mkdir(parents=True)
    group = {"episodes": 1, "mean_reward": 1.0, "pass_at_k": 1.0, "pass_all_k": 1.0}
    write_rollout(Rollout("r", out, [EpisodeResult("e1", "t", "a", 1, "ok", 1.0, reward_posted=True)],
                          {"run_id": "r", "overall": group | {"failures": {}}, "toolchains": {"a": group},
                           "tasks": {"t": group}}))
    con = store.connect(run.db)
    con.execute("INSERT INTO episodes (episode_id, task_id, n_calls, n_samples, reward, weight) "
                "VALUES ('e1', 't', 1, 1, 0.5, 1.0)")
    con.close()
    run.record_episodes(0)
    assert RLRun.summary_line(run, 0)["reward_mismatches"] == 1


# --- secrets ---------------------------------------------------------------------------------------------

def test_secrets_are_0600_files_in_a_0700_directory_and_nowhere_else(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from openforge.rl.services import ProxyProcess

    monkeypatch.setenv("OPENFORGE_REWARD_TOKENS", "from-the-users-shell")
    run = Run(tmp_path / "run", [])
    run.out.mkdir()
    files = run.write_secrets()
    assert set(files) == {"openforge_client_tokens_file", "openforge_reward_tokens_file",
                          "openforge_upstream_key_file", "openforge_flow_key_file"}
    assert (run.out / "secrets").stat().st_mode & 0o777 == 0o700
    assert all(p.parent == run.out / "secrets" and p.stat().st_mode & 0o777 == 0o600 for p in files.values())
    assert files["openforge_reward_tokens_file"].read_text() == run.reward_token
    flow_key = files["openforge_flow_key_file"].read_text()
    assert len(flow_key) >= 32
    assert run.write_secrets()["openforge_flow_key_file"].read_text() == flow_key  # kept across starts
    proxy = ProxyProcess("http://127.0.0.1:1", run.flow_dir, run.logs / "proxy.log", profile="llamacpp",
                         routes={}, secret_files=files)
    line = " ".join(proxy.command)
    for name, path in files.items():
        assert f"{name}={path}" in line
    for secret in (run.client_token, run.reward_token, flow_key, files["openforge_upstream_key_file"].read_text()):
        assert secret not in line and secret not in proxy.env.values()
    assert "OPENFORGE_REWARD_TOKENS" not in proxy.env
    assert os.environ.get("OPENFORGE_CLIENT_TOKEN") is None


def test_the_loop_leaves_no_token_in_its_environment(tmp_path: Path) -> None:
    log: list[Any] = []
    before = dict(os.environ)
    seen: list[dict[str, str]] = []
    run = Run(tmp_path / "run", log, fake=("rollout", *OTHER_STAGES))
    run.reconstruct = lambda i: seen.append(dict(os.environ))  # type: ignore[method-assign]
    run.run()
    assert seen == [before]
