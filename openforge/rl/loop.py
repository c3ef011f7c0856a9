"""`openforge rl`: rollouts on policy i -> reconstruct -> train -> publish policy i+1, `iterations` times.

One output directory holds the run (docs/rl.md):

    DIR/rl.toml            the resolved config (what --resume reads back)
    DIR/state.json         where the run is: iteration, stage, policy version, what the engine serves
    DIR/rl.jsonl           one line per finished iteration; DIR/rl.png its reward per iteration
    DIR/flows/             the proxy's flow files, DIR/rl.duckdb the samples of every iteration
    DIR/iterations/NNN/    that iteration's rollout (episodes/, results.jsonl, summary.json)
    DIR/train/             the trainer's metrics.jsonl (steps numbered across iterations) and checkpoints/
    DIR/gguf/              llama.cpp: the published weights;  DIR/logs/: engine.log, proxy.log
    DIR/secrets/           (0700) the tokens and keys of the proxy and engine, 0600 files

Each stage ends by saving state.json, so `--resume` continues at the stage a killed run was in: finished
episodes are kept and the unfinished ones rerun under new episode ids (a killed episode's calls have no
reward and never become samples); flow files already read are not read again; a finished training step
range is not trained again. Training selects the samples of the rollout episodes of the window's
iterations only (table `rl_episodes`), at the policy versions that produced them.

Faults the loop notices: an episode an interruption cut short (no result, `crashed: interrupted`, or a reward
that never reached the proxy) runs again on `--resume`; a dead engine is restarted once per iteration, and
a rollout it died under runs again; a checkpoint that does not load or holds non-finite weights is never
published (the newest valid one is); an episode whose DuckDB reward differs from its result.json is
flagged and left out of training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from openforge.engine import EngineError
from openforge.processes import non_dumpable, read_secret, write_secret
from openforge.rl.config import RLConfig, load_rl_config
from openforge.rl.services import (
    CheckpointInvalid,
    ControlAPI,
    LlamaCppPolicy,
    Policy,
    ProxyProcess,
    VllmPolicy,
    check_checkpoint,
    proxy_routes,
)
from openforge.rl.services import publish as publish_weights
from openforge.rollout.run_failure import every_episode_failed
from openforge.rollout.spec import EpisodeResult, EpisodeSpec, Task

STAGES = ("rollout", "reconstruct", "train", "publish", "record")  # record: the rl.jsonl line, then i + 1
STATE_VERSION = 1
METRIC_MEANS = ("loss", "policy_loss", "kl", "entropy", "clip_frac", "is_ratio_mean", "is_truncated_frac",
                "grad_norm", "engine_gap_mean", "engine_logprob_share", "tokens_per_s")
RL_EPISODES = """CREATE TABLE IF NOT EXISTS rl_episodes (
    iteration INTEGER NOT NULL, episode_id VARCHAR NOT NULL, task_id VARCHAR, toolchain VARCHAR,
    attempt INTEGER, status VARCHAR NOT NULL, reward DOUBLE)"""
RL_MISMATCHES = """CREATE TABLE IF NOT EXISTS rl_reward_mismatches (
    iteration INTEGER NOT NULL, episode_id VARCHAR NOT NULL, result_reward DOUBLE, db_reward DOUBLE)"""
REWARD_TOLERANCE = 1e-9


class RLError(RuntimeError):
    """The run cannot go on (bad input, a stage with nothing for the next); the message says what to do."""


@dataclass
class State:
    """state.json: where the run is. `version`: the policy version the engine serves (= the iteration whose
    rollouts run on it); `served`: the GGUF or checkpoint directory it serves ("" = the starting weights)."""

    run_id: str
    iteration: int = 0
    stage: str = "rollout"
    version: int = 0
    served: str = ""
    resumes: int = 0
    restarts: int = 0  # engine restarts after it died (each one also names reruns, as a resume does)
    train_start_step: int = -1  # the trainer's step when this iteration's training began (-1: not yet)
    checkpoint: str = ""  # what this iteration trained ("" = nothing: no samples, or not yet)
    seconds: dict[str, float] = field(default_factory=dict)
    format: int = STATE_VERSION

    @classmethod
    def read(cls, path: Path) -> State:
        try:
            data = json.loads(path.read_text())
            if data.get("format") != STATE_VERSION:
                raise ValueError(f"state format {data.get('format')!r}, this OpenForge reads {STATE_VERSION}")
            state = cls(**data)
            if state.stage not in STAGES:
                raise ValueError(f"unknown stage {state.stage!r}")
            return state
        except (OSError, ValueError, TypeError) as e:
            raise RLError(f"cannot resume from {path}: {e}") from None

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=1))
        os.replace(tmp, path)


def cpu_has_bf16() -> bool:
    """AVX512-BF16 or AMX: without them bf16 matmuls are emulated and several times slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


class RLRun:
    """One `openforge rl` run in `out`; `run()` does every remaining iteration and returns rl.jsonl's lines."""

    def __init__(self, cfg: RLConfig, out: Path, console: Console | None = None, resume: bool = False) -> None:
        self.cfg, self.out = cfg, Path(out)
        self.console = console or Console()
        self.state_path = self.out / "state.json"
        if resume:
            self.state = State.read(self.state_path)
            self.state.resumes += 1
        else:
            if self.state_path.exists():
                raise RLError(f"{self.out} holds a run already: continue it with --resume, or give another --out")
            self.state = State(run_id=time.strftime("rl%Y%m%dT%H%M%S") + "-" + secrets.token_hex(2))
        self.flow_dir, self.db = self.out / "flows", self.out / "rl.duckdb"
        self.train_out, self.gguf_dir, self.logs = self.out / "train", self.out / "gguf", self.out / "logs"
        self.secrets = self.out / "secrets"
        self.client_token, self.reward_token = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
        self._restarted_in = -1  # the iteration in which the engine was last restarted
        self.tasks = self._check_rollout()
        self.policy: Policy | None = None
        self.proxy: ProxyProcess | None = None
        self.control: ControlAPI | None = None
        self._resolve_models()

    # -- set-up ----------------------------------------------------------------------------------------------
    def _check_rollout(self) -> list[Task]:
        """The task list, with every task and toolchain checked before anything starts."""
        from openforge.examples.tasks import rollout_tasks
        from openforge.rollout.runner import RolloutError, prepare
        from openforge.rollout.tasks import TaskFileError, read_tasks

        r = self.cfg.rollout
        try:
            tasks = read_tasks(r.tasks) if r.tasks else rollout_tasks()
            tasks = tasks[: r.max_tasks] if r.max_tasks else tasks
            prepare(tasks, r.toolchains, proxy="http://127.0.0.1:1", out=self.out, attempts=r.attempts,
                    concurrency=r.concurrency, on_failure=r.on_failure, pass_threshold=r.pass_threshold,
                    sandbox=r.sandbox)
        except (TaskFileError, RolloutError) as e:
            raise RLError(str(e)) from None
        return tasks

    def _resolve_models(self) -> None:
        """The starting weights for the engine and the trainer, and the tokenizer reconstruct uses."""
        from openforge.models import ModelNotFound, default_gguf, hf_dir

        e = self.cfg.engine
        try:
            if e.backend == "llamacpp":
                self.template_gguf = Path(e.gguf) if e.gguf else default_gguf()
                if not self.template_gguf.is_file():
                    raise RLError(f"engine.gguf: no such file {self.template_gguf}")
                self.start_weights = self.template_gguf
                self._base_model: Path | None = None  # converted on first use (10-30 s, cached)
            else:
                model = Path(e.model) if e.model else hf_dir()
                if not (model / "config.json").is_file():
                    raise RLError(f"engine.model: not a Hugging Face model directory (no config.json): {model}")
                self.start_weights = self._base_model = model
        except ModelNotFound as err:
            raise RLError(str(err)) from None

    @property
    def base_model(self) -> Path:
        """The Hugging Face directory the trainer starts from (llama.cpp: the starting GGUF, converted)."""
        if self._base_model is None:
            from openforge.models import hf_dir

            self._base_model = hf_dir(self.template_gguf)
        return self._base_model

    def tokenizer(self) -> Any:
        r = self.cfg.reconstruct
        if r.tokenizer:
            return r.tokenizer
        if self.cfg.engine.backend == "llamacpp":
            from openforge.models import load_gguf_tokenizer

            return load_gguf_tokenizer(self.template_gguf)  # with the template the engine serves
        return str(self.base_model)

    def write_secrets(self) -> dict[str, Path]:
        """DIR/secrets/ (0700, never shown to an episode) with this start's client token, reward token and
        engine key, and the run's flow key (kept across resumes: it verifies the flow files already written),
        each a 0600 file; {proxy option: file}."""
        self.secrets.mkdir(mode=0o700, exist_ok=True)
        self.secrets.chmod(0o700)
        flow_key = self.secrets / "flow.key"
        if not flow_key.is_file():
            write_secret(flow_key, secrets.token_hex(32))
        flow_key.chmod(0o600)
        return {
            "openforge_client_tokens_file": write_secret(self.secrets / "client.token", self.client_token),
            "openforge_reward_tokens_file": write_secret(self.secrets / "reward.token", self.reward_token),
            "openforge_upstream_key_file": write_secret(self.secrets / "engine.key", secrets.token_urlsafe(32)),
            "openforge_flow_key_file": flow_key,
        }

    @contextlib.contextmanager
    def services(self) -> Iterator[None]:
        """Engine and proxy up for the whole run; both stopped on any exit (Ctrl-C included). This process
        holds the reward token: it is non-dumpable, as the engine and the proxy are."""
        non_dumpable()
        files = self.write_secrets()
        served = Path(self.state.served) if self.state.served else self.start_weights
        key_file = files["openforge_upstream_key_file"]
        policy: Policy
        if self.cfg.engine.backend == "llamacpp":
            policy = LlamaCppPolicy(self.cfg, self.template_gguf, served, self.logs / "engine.log", key_file)
        else:
            policy = VllmPolicy(self.cfg, served, self.logs / "engine.log", key_file)
        with contextlib.ExitStack() as stack:
            with self.console.status(f"starting the engine ({policy.profile}) on {served}"):
                policy.start()
            stack.callback(policy.stop)
            self.policy = policy
            proxy = ProxyProcess(policy.url, self.flow_dir, self.logs / "proxy.log", profile=policy.profile,
                                 routes=proxy_routes(self.cfg), secret_files=files,
                                 policy_version=self.state.version,
                                 pause_timeout=self.cfg.proxy.pause_timeout)
            self.proxy = stack.enter_context(proxy)
            self.control = ControlAPI(self.proxy.url, self.reward_token)
            stack.callback(self.control.close)
            self.console.print(f"engine {policy.url} ({policy.profile}, policy version {self.state.version}), "
                               f"proxy {self.proxy.url}, flows in {self.flow_dir}")
            yield

    # -- the run ---------------------------------------------------------------------------------------------
    def run(self) -> list[dict[str, Any]]:
        for d in (self.out, self.logs, self.flow_dir, self.gguf_dir):
            d.mkdir(parents=True, exist_ok=True)
        (self.out / "rl.toml").write_text(self.cfg.to_toml())
        self.state.save(self.state_path)
        with self.services():
            while self.state.iteration < self.cfg.loop.iterations:
                self.iteration()
        lines = read_lines(self.out / "rl.jsonl")
        plot(lines, self.out / "rl.png")
        return lines

    def iteration(self) -> None:
        i, s = self.state.iteration, self.state
        if s.stage == "rollout":
            s.seconds, s.train_start_step, s.checkpoint = {}, -1, ""
        self.console.rule(f"iteration {i + 1}/{self.cfg.loop.iterations} (policy version {s.version})")
        for stage in STAGES[STAGES.index(s.stage):-1]:
            started = time.monotonic()
            if stage in ("rollout", "publish"):
                self.ensure_engine(i, stage)
            getattr(self, stage)(i)
            s.seconds[stage] = round(s.seconds.get(stage, 0.0) + time.monotonic() - started, 3)
            s.stage = STAGES[STAGES.index(stage) + 1]
            s.save(self.state_path)
        line = self.summary_line(i)
        keep_lines_before(self.out / "rl.jsonl", i)  # a line an interruption left after it was written
        with (self.out / "rl.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")
        s.iteration, s.stage = i + 1, "rollout"
        s.save(self.state_path)
        reward = "-" if line["reward_mean"] is None else f"{line['reward_mean']:.3f}"
        self.console.print(f"iteration {i + 1}: reward {reward}, pass@{self.cfg.rollout.attempts} "
                           f"{_pct(line['pass_at_k'])}, {line['samples']} samples, now serving policy version "
                           f"{s.version}")

    def rollout_dir(self, i: int) -> Path:
        return self.out / "iterations" / f"{i:03d}" / "rollout"

    def ensure_engine(self, i: int, stage: str) -> bool:
        """Make sure the engine answers before `stage`: a dead one is restarted, once per iteration; a second
        death, or a restart that fails, stops the run (RLError). Whether it had to be restarted."""
        if self.policy is None or self.policy.alive():
            return False
        log = self.logs / "engine.log"
        if self._restarted_in == i:
            raise RLError(f"the engine died again in iteration {i + 1} after a restart (log: {log}); "
                          f"nothing was run against it")
        self.console.print(f"  [yellow]warning:[/] the engine is not answering before {stage}: restarting it "
                           f"(log: {log})")
        self._restarted_in = i
        self.state.restarts += 1
        self.state.save(self.state_path)
        try:
            self.policy.restart()
        except EngineError as e:
            raise RLError(f"the engine died and did not restart: {e}") from None
        return True

    # -- stages ----------------------------------------------------------------------------------------------
    def rollout(self, i: int) -> None:
        """Every task x toolchain x attempt on policy version i; the verifiers post rewards to the proxy. If
        the engine died meanwhile, it is restarted and the episodes of that round run again."""
        from openforge.rollout.runner import prepare

        r = self.cfg.rollout
        assert self.proxy is not None and self.control is not None
        out = self.rollout_dir(i)
        run_id, specs = prepare(self.tasks, r.toolchains, proxy=self.proxy.url, out=out, backend="local",
                                fresh_verify_copy=r.fresh_verify_copy, run_id=f"{self.state.run_id}-i{i:03d}",
                                sandbox=r.sandbox, **self.rollout_options())
        while True:
            ran = self.rollout_round(run_id, specs, out)
            if not self.ensure_engine(i, "the end of the rollout"):
                break
            void_results(ran)
            self.console.print(f"  the {len(ran)} episodes that ran against the dead engine run again")
        self.control.status()  # every answered call is in the flow file before reconstruct reads it
        results = [EpisodeResult(**json.loads(x)) for x in (out / "results.jsonl").read_text().splitlines() if x]
        failed = every_episode_failed(results, out / "episodes")
        if failed:  # nothing to learn from, and usually the engine or the setup, not the policy
            raise RLError(f"iteration {i + 1}: {failed} (episodes: {out / 'episodes'})")

    def rollout_options(self) -> dict[str, Any]:
        r = self.cfg.rollout
        return dict(attempts=r.attempts, concurrency=r.concurrency, on_failure=r.on_failure,
                    pass_threshold=r.pass_threshold)

    def rollout_round(self, run_id: str, specs: list[EpisodeSpec], out: Path) -> list[EpisodeSpec]:
        """Run the episodes of `specs` that no earlier try finished (under new ids: `rerun`); what it ran."""
        from openforge.rollout.runner import execute, read_result

        r = self.cfg.rollout
        rounds = self.state.resumes + self.state.restarts  # earlier tries of unfinished episodes
        earlier = {s.episode: [res for k in range(rounds) if (res := read_result(rerun(s, k))) is not None
                               and finished(res, r.on_failure)] for s in specs}
        done = [found[0] for found in earlier.values() if found]
        todo = [rerun(s, rounds) if Path(s.out_dir).exists() else s for s in specs if not earlier[s.episode]]
        if done:
            self.console.print(f"  {len(done)} episodes finished before the interruption; {len(todo)} to run")
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=self.console) as progress:
            bar = progress.add_task(f"rollout {len(specs)} episodes", total=len(specs), completed=len(done))

            def one_done(res: EpisodeResult) -> None:
                reward = "-" if res.reward is None else f"{res.reward:.2f}"
                progress.update(bar, advance=1, description=f"rollout: {res.task_id} {res.status} {reward}")

            execute(run_id, todo, out=out, on_done=one_done, done=done, sandbox=r.sandbox,
                    client_token=self.client_token, reward_token=self.reward_token, **self.rollout_options())
        return todo

    def reconstruct(self, i: int) -> None:
        """The new flow records into the run's DuckDB; the iteration's episodes into `rl_episodes`."""
        from openforge.reconstruct import reconstruct

        r = self.cfg.reconstruct
        with self.console.status("reconstruct: flow files -> samples"):
            summary = reconstruct([self.flow_dir], self.db, self.tokenizer(), run=self.state.run_id,
                                  advantage=r.advantage, group_by=r.group_by, train_roles=r.train_roles,
                                  chat_template=r.chat_template or None,
                                  flow_key=read_secret(self.secrets / "flow.key").encode())
        self.console.print(f"  reconstruct: {summary.calls} new calls, {summary.samples} samples rebuilt "
                           f"({summary.seconds:.1f} s)")
        self.record_episodes(i)

    def record_episodes(self, i: int) -> None:
        """The iteration's results into `rl_episodes`; each checked against the reward reconstruct stored
        for it: a mismatch goes to `rl_reward_mismatches` (left out of training) and gets a warning."""
        results = [EpisodeResult(**json.loads(x)) for x in
                   (self.rollout_dir(i) / "results.jsonl").read_text().splitlines() if x]
        con = duckdb.connect(str(self.db))
        try:
            ensure_tables(con)
            con.execute("DELETE FROM rl_episodes WHERE iteration = ?", [i])
            con.executemany("INSERT INTO rl_episodes VALUES (?, ?, ?, ?, ?, ?, ?)",
                            [(i, x.episode, x.task_id, x.toolchain, x.attempt, x.status, x.reward)
                             for x in results])
            found = reward_mismatches(con, results)
            con.execute("DELETE FROM rl_reward_mismatches WHERE iteration = ?", [i])
            if found:  # executemany refuses an empty list
                con.executemany("INSERT INTO rl_reward_mismatches VALUES (?, ?, ?, ?)", [(i, *m) for m in found])
        finally:
            con.close()
        if found:
            shown = ", ".join(f"{ep} (result.json {_num(a)}, DuckDB {_num(b)})" for ep, a, b in found[:3])
            more = f" and {len(found) - 3} more" if len(found) > 3 else ""
            self.console.print(f"  [yellow]warning:[/] {len(found)} episodes' rewards in {self.db.name} differ "
                               f"from their result.json: {shown}{more}; left out of training")

    def selection(self, i: int) -> str:
        """The samples iteration i trains on: its window's rollout episodes, at the versions that ran them."""
        lo = max(0, i - self.cfg.loop.window + 1)
        return (f"policy_version BETWEEN {lo} AND {i} AND episode_id IN "
                f"(SELECT episode_id FROM rl_episodes WHERE iteration BETWEEN {lo} AND {i}) AND episode_id NOT IN "
                f"(SELECT episode_id FROM rl_reward_mismatches)")

    def train(self, i: int) -> None:
        """Policy-gradient steps on the selection, continuing the weights and optimizer state of the last
        iteration; nothing when the selection is empty (the same weights are published again)."""
        import torch

        from openforge.trainer import checkpoint
        from openforge.trainer.config import ConfigError
        from openforge.trainer.data import DataError
        from openforge.trainer.train import train

        s = self.state
        latest = checkpoint.latest(self.train_out, self.console.print)
        latest_step = int(latest[1]["step"]) if latest else 0
        if latest and 0 <= s.train_start_step < latest_step:
            s.checkpoint = str(latest[0])  # this iteration's training finished before an interruption
            return
        if s.train_start_step < 0:
            s.train_start_step = latest_step
            s.save(self.state_path)
        con = duckdb.connect(str(self.db))
        try:
            ensure_tables(con)  # a run an older OpenForge started has no rl_reward_mismatches
        finally:
            con.close()
        where = self.selection(i)
        if not count_samples(self.db, where):
            self.console.print("  [yellow]no trainable samples this iteration[/]: the policy stays as it is")
            return
        try:
            cfg = self.cfg.train_config(str(self.db), str(self.base_model), str(self.train_out), where)
            cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
            bf16 = not cuda and cpu_has_bf16()  # CUDA: the trainer autocasts itself
            with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                final = train(cfg, resume=True, new_selection=True, say=lambda m: self.console.print(f"  {m}"))
        except (ConfigError, DataError) as e:
            raise RLError(f"training refused: {e}") from None
        s.checkpoint = str(final)

    def publishable(self) -> Path | None:
        """The checkpoint to serve: this iteration's if it loads with finite weights, else the newest one that
        does (each rejected one named in a warning); None when there is none."""
        s = self.state
        candidates = [Path(s.checkpoint)] if s.checkpoint else []
        candidates += sorted((p for p in (self.train_out / "checkpoints").glob("step_*")
                              if p.suffix != ".tmp" and p not in candidates), reverse=True)
        for path in candidates:
            try:
                check_checkpoint(path)
                return path
            except CheckpointInvalid as e:
                self.console.print(f"  [yellow]warning:[/] not publishing {path}: {e}")
        return None

    def publish(self, i: int) -> None:
        """Pause the proxy, give the engine the new weights, resume with policy version i + 1. Only a valid
        checkpoint is published; any failure is an RLError (one line), the proxy left paused."""
        assert self.control is not None and self.policy is not None
        s = self.state
        try:
            with self.console.status(f"publish policy version {i + 1}"):
                checkpoint = self.publishable() if s.checkpoint else None
                if checkpoint is not None:
                    served, paused = publish_weights(self.control, self.policy, checkpoint, i + 1,
                                                     self.gguf_dir, self.cfg.proxy.pause_timeout)
                    s.served, s.checkpoint = str(served), str(checkpoint)
                else:  # nothing trained, or nothing valid: the same weights under the next version
                    paused = 0.0
                    self.control.pause(self.cfg.proxy.pause_timeout)
                    self.control.resume(i + 1)
        except Exception as e:  # noqa: BLE001 - export, engine restart, proxy: each failure is one line
            raise RLError(f"publishing policy version {i + 1} failed: {type(e).__name__}: {e}") from None
        s.version = i + 1
        s.seconds["paused"] = round(paused, 3)
        prune_checkpoints(self.train_out, self.cfg.loop.keep_checkpoints, keep_also=s.checkpoint)
        for old in self.gguf_dir.glob("policy-*.gguf"):
            if str(old) != s.served:
                old.unlink()
        self.console.print(f"  published {s.served or self.start_weights} as policy version {i + 1} "
                           f"(proxy paused {paused:.1f} s)")

    # -- reporting -------------------------------------------------------------------------------------------
    def summary_line(self, i: int) -> dict[str, Any]:
        """rl.jsonl's line for iteration i (docs/rl.md)."""
        summary = json.loads((self.rollout_dir(i) / "summary.json").read_text())
        overall = summary["overall"]
        results = [json.loads(x) for x in (self.rollout_dir(i) / "results.jsonl").read_text().splitlines() if x]
        metrics = [m for m in read_lines(self.train_out / "metrics.jsonl") if m["step"] > self.state.train_start_step]
        con = duckdb.connect(str(self.db), read_only=True)
        try:
            samples, trainable = con.execute(
                f"SELECT count(*), coalesce(sum(n_trainable), 0) FROM samples WHERE n_trainable > 0 AND "
                f"{self.selection(i)} AND policy_version = {i}").fetchone()
            mismatches = con.execute("SELECT count(*) FROM rl_reward_mismatches WHERE iteration = ?",
                                     [i]).fetchone()[0]
        finally:
            con.close()
        return {
            "iteration": i, "policy_version": i, "run_id": self.state.run_id,
            "episodes": overall["episodes"], "attempts": self.cfg.rollout.attempts,
            "reward_mean": overall["mean_reward"], "pass_at_k": overall["pass_at_k"],
            "pass_all_k": overall["pass_all_k"], "failures": overall["failures"],
            "zero_variance_groups": zero_variance_share(results),
            "toolchains": {k: _brief(v) for k, v in summary["toolchains"].items()},
            "tasks": {k: _brief(v) for k, v in summary["tasks"].items()},
            "samples": samples, "trainable_tokens": trainable,
            "train_steps": len(metrics),
            "train_step_range": [metrics[0]["step"], metrics[-1]["step"]] if metrics else None,
            "train": {k: sum(m[k] for m in metrics) / len(metrics) for k in METRIC_MEANS} if metrics else None,
            "reward_mismatches": mismatches,
            "checkpoint": self.state.checkpoint or None, "served": self.state.served or str(self.start_weights),
            "seconds": dict(self.state.seconds),
        }


def rerun(spec: EpisodeSpec, resume: int) -> EpisodeSpec:
    """The episode as the `resume`-th resume runs it again after an interruption cut it short: a new id and
    directories (the calls it made so far carry the old id and no reward, so they never become samples);
    resume 0 is the episode itself."""
    if resume == 0:
        return spec
    episode = f"{spec.episode}-r{resume}"
    ep_dir = Path(spec.out_dir).with_name(episode)
    return dataclasses.replace(spec, episode=episode, out_dir=str(ep_dir), workdir=str(ep_dir / "work"),
                               home=str(ep_dir / "home"))


def finished(result: EpisodeResult, on_failure: str) -> bool:
    """Whether an earlier try's result counts on resume: the episode ran to its end, and the reward it had to
    post reached the proxy. A SIGTERM leaves `crashed: interrupted`; a kill -9 of the loop takes the proxy
    with it, so the agent fails and its reward post with it."""
    if result.status == "crashed" and result.reason == "interrupted":
        return False
    return result.reward_posted or not (result.reward is not None or on_failure == "zero")


def void_results(specs: list[EpisodeSpec]) -> None:
    """Set aside the result.json of episodes that ran against a dead engine (as result.void.json), so that
    they run again under new ids."""
    for spec in specs:
        result = Path(spec.out_dir) / "result.json"
        if result.is_file():
            result.replace(result.with_name("result.void.json"))


def ensure_tables(con: duckdb.DuckDBPyConnection) -> None:
    con.execute(RL_EPISODES)
    con.execute(RL_MISMATCHES)


def posted_reward(result: EpisodeResult) -> float | None:
    """The reward the episode posted to the proxy: the verifier's, 0.0 for a failure under on_failure=zero,
    None when nothing reached it."""
    if not result.reward_posted:
        return None
    return result.reward if result.reward is not None else 0.0


def reward_mismatches(con: duckdb.DuckDBPyConnection,
                      results: list[EpisodeResult]) -> list[tuple[str, float | None, float | None]]:
    """(episode, reward it posted, reward in DuckDB) for each episode of `results` whose DuckDB reward (table
    episodes, what reconstruct read from the flow files) is not the one its result.json says it posted."""
    stored = dict(con.execute("SELECT episode_id, reward FROM episodes WHERE episode_id IN "
                              "(SELECT unnest(?::VARCHAR[]))", [[r.episode for r in results]]).fetchall())
    found = []
    for r in results:
        if r.episode not in stored:
            continue  # no call of it reached the proxy: nothing to train
        mine, theirs = posted_reward(r), stored[r.episode]
        if (mine is None) != (theirs is None) or (mine is not None and abs(mine - theirs) > REWARD_TOLERANCE):
            found.append((r.episode, mine, theirs))
    return found


def count_samples(db: Path, where: str) -> int:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return int(con.execute(f"SELECT count(*) FROM samples WHERE n_trainable > 0 AND {where}").fetchone()[0])
    finally:
        con.close()


def zero_variance_share(results: list[dict[str, Any]]) -> float | None:
    """The share of (task, toolchain) groups whose rewards are all equal: GRPO learns nothing from them."""
    groups: dict[tuple[str, str], set[float]] = defaultdict(set)
    for r in results:
        if r["reward"] is not None:
            groups[(r["task_id"], r["toolchain"])].add(r["reward"])
    return round(sum(len(v) == 1 for v in groups.values()) / len(groups), 6) if groups else None


def prune_checkpoints(train_out: Path, keep: int, keep_also: str = "") -> None:
    """Keep the newest `keep` trainer checkpoints that load (weights and optimizer state: 1.6 GB each for
    135M), and `keep_also` (the one served); damaged ones go, so they never crowd out the last good one."""
    from openforge.trainer.checkpoint import CheckpointDamaged, check_weights

    good: list[Path] = []
    for path in sorted((p for p in (train_out / "checkpoints").glob("step_*") if p.suffix != ".tmp"), reverse=True):
        try:
            check_weights(path)
            good.append(path)
        except CheckpointDamaged:
            shutil.rmtree(path, ignore_errors=True)
    for old in good[keep:]:
        if str(old) != keep_also:
            shutil.rmtree(old, ignore_errors=True)


def read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def keep_lines_before(path: Path, iteration: int) -> None:
    """On resume, drop rl.jsonl lines of the iteration that is run again (and later ones)."""
    lines = [x for x in read_lines(path) if x["iteration"] < iteration]
    if path.is_file():
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def plot(lines: list[dict[str, Any]], path: Path) -> None:
    """rl.png: mean reward and pass@k per iteration, overall and per toolchain."""
    if not lines:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [line["iteration"] + 1 for line in lines]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(x, [line["reward_mean"] for line in lines], marker="o", label="mean reward")
    ax.plot(x, [line["pass_at_k"] for line in lines], marker="s", linestyle="--",
            label=f"pass@{lines[0]['attempts']}")
    names = sorted({n for line in lines for n in line["toolchains"]})
    if len(names) > 1:
        for name in names:
            ax.plot(x, [line["toolchains"].get(name, {}).get("reward_mean") for line in lines], marker=".",
                    linestyle=":", label=f"{name} reward")
    ax.set_xlabel("iteration")
    ax.set_xticks(x)
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("openforge rl: reward per iteration")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def results_table(lines: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    attempts = lines[0]["attempts"] if lines else 1
    table = Table(title="openforge rl")
    for col in ("iter", "policy", "episodes", "reward", f"pass@{attempts}", "samples", "loss", "gap", "s"):
        table.add_column(col, justify="right")
    table.caption = "reward: mean; loss: the trainer's mean; gap: mean |engine - trainer logprob|; s: seconds"
    for line in lines:
        t = line["train"] or {}
        table.add_row(str(line["iteration"] + 1), str(line["policy_version"]), str(line["episodes"]),
                      "-" if line["reward_mean"] is None else f"{line['reward_mean']:.3f}",
                      _pct(line["pass_at_k"]), str(line["samples"]),
                      f"{t['loss']:.4f}" if t else "-", f"{t['engine_gap_mean']:.4f}" if t else "-",
                      f"{sum(v for k, v in line['seconds'].items() if k != 'paused'):.0f}")
    return table


def load(config: Path | None, sets: dict[str, Any], out: Path, resume: bool) -> RLConfig:
    """The run's config: with --resume the run's own rl.toml (then `sets` on top), else `config` + `sets`."""
    if resume:
        saved = out / "rl.toml"
        if not saved.is_file():
            raise RLError(f"nothing to resume in {out} (no rl.toml)")
        return load_rl_config(saved, sets)
    return load_rl_config(config, sets)


def _brief(group: dict[str, Any]) -> dict[str, Any]:
    return {"episodes": group["episodes"], "reward_mean": group["mean_reward"], "pass_at_k": group["pass_at_k"],
            "pass_all_k": group["pass_all_k"]}


def _num(x: float | None) -> str:
    return "none" if x is None else f"{x:g}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"
