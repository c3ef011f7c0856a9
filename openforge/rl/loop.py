"""`openforge rl`: rollouts on policy i -> reconstruct -> train -> publish policy i+1, `iterations` times.

One output directory holds the run (docs/rl.md):

    DIR/rl.toml            the resolved config (what --resume reads back)
    DIR/state.json         where the run is: iteration, stage, policy version, what the engine serves
    DIR/rl.jsonl           one line per finished iteration; DIR/rl.png its reward per iteration
    DIR/flows/             the proxy's flow files, DIR/rl.duckdb the samples of every iteration
    DIR/iterations/NNN/    that iteration's rollout (episodes/, results.jsonl, summary.json)
    DIR/train/             the trainer's metrics.jsonl (steps numbered across iterations) and checkpoints/
    DIR/policies/          the weights the engine serves (llama.cpp: a GGUF; vLLM: a model directory)
    DIR/logs/              engine.log, proxy.log
    DIR/secrets/           (0700) the tokens and keys of the proxy and engine, 0600 files

Each stage ends by saving state.json, so `--resume` continues at the stage a killed run was in: finished
episodes are kept and the unfinished ones rerun under new episode ids (a killed episode's calls have no
reward and never become samples); flow files already read are not read again; a finished training step
range is not trained again. Training selects the samples of the rollout episodes of the window's
iterations only (table `rl_episodes`), at the policy versions that produced them.

Faults the loop notices: an episode an interruption cut short (no result, `crashed: interrupted`, or a reward
that never reached the proxy) runs again on `--resume`; a dead engine is restarted once per iteration, and
a rollout it died under runs again; non-finite weights are never published; an episode whose DuckDB reward
differs from its result.json is flagged and left out of training.

The trainer is resident: one `Trainer` keeps the model and its optimizer in memory for the whole run, and
publishing reads the weights from there. A full checkpoint is written every `loop.checkpoint_every`
iterations, at the end, and whenever the run stops (Ctrl-C, an error): only a kill the process cannot
catch loses steps, and `--resume` then trains the iterations after the newest checkpoint again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import threading
import time
import tomllib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from openforge.engine import EngineError
from openforge.processes import non_dumpable, read_secret, write_secret
from openforge.rl.config import RLConfig, load_rl_config
from openforge.rl.evaluation import score, split_tasks
from openforge.rl.lock import RunLock, RunLocked
from openforge.rl.services import (
    ControlAPI,
    LlamaCppPolicy,
    Policy,
    ProxyProcess,
    VllmPolicy,
    proxy_routes,
)
from openforge.rl.services import publish as publish_weights
from openforge.rollout.failures import reward_due
from openforge.rollout.run_failure import every_episode_failed
from openforge.rollout.spec import EpisodeResult, EpisodeSpec, Task
from openforge.taskforge.calibrate import out_of_band, parse_band, pass_rates
from openforge.tracking import TrackerError, Trackers

if TYPE_CHECKING:
    from openforge.trainer.config import TrainConfig
    from openforge.trainer.train import Selection, Trainer

STAGES = ("eval", "rollout", "reconstruct", "train", "publish", "record")  # record: the rl.jsonl line, then i + 1
STATE_VERSION = 1
METRIC_MEANS = ("loss", "policy_loss", "kl", "entropy", "clip_frac", "ratio_dev", "is_ratio_mean", "is_truncated_frac",
                "grad_norm", "engine_gap_mean", "engine_logprob_share", "tokens_per_s")
RL_EPISODES = """CREATE TABLE IF NOT EXISTS rl_episodes (
    iteration INTEGER NOT NULL, episode_id VARCHAR NOT NULL, task_id VARCHAR, toolchain VARCHAR,
    attempt INTEGER, status VARCHAR NOT NULL, reward DOUBLE)"""
RL_MISMATCHES = """CREATE TABLE IF NOT EXISTS rl_reward_mismatches (
    iteration INTEGER NOT NULL, episode_id VARCHAR NOT NULL, result_reward DOUBLE, db_reward DOUBLE)"""
REWARD_TOLERANCE = 1e-9
# rl.jsonl fields that are not a series (eval: logged when it ran, as eval/*)
UNTRACKED = ("iteration", "policy_version", "run_id", "tasks", "train_step_range", "checkpoint", "served", "eval",
             "attempts", "recalibrated", "skipped_train")


class RLError(RuntimeError):
    """The run cannot go on (bad input, a stage with nothing for the next); the message says what to do."""


@dataclass
class State:
    """state.json: where the run is. `version`: the policy version the engine serves (= the iteration whose
    rollouts run on it); `served`: the GGUF or checkpoint directory it serves ("" = the starting weights)."""

    run_id: str
    iteration: int = 0
    stage: str = STAGES[0]
    version: int = 0
    served: str = ""
    resumes: int = 0
    restarts: int = 0  # engine restarts after it died (each one also names reruns, as a resume does)
    train_start_step: int = -1  # the trainer's step when this iteration's training began (-1: not yet)
    train_end_step: int = -1  # the step it trains until (-1: not yet known)
    checkpoint: str = ""  # the checkpoint this iteration wrote ("" = none: not due, or nothing trained)
    skipped_train: str = ""  # why this iteration had nothing to learn (no optimizer step, nothing published)
    dropped: dict[str, str] = field(default_factory=dict)  # task id -> why re-calibration dropped it
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
        self.lock = RunLock(self.out)  # held until run() ends: one run per directory
        if self.out.is_dir():
            self.take_lock()  # before anything else: the message names the run that holds it
        try:
            self._set_up(resume)
        except BaseException:
            self.lock.release()
            raise

    def take_lock(self) -> None:
        if self.lock.file is None:
            try:
                self.lock.acquire()
            except RunLocked as e:
                raise RLError(str(e)) from None

    def _set_up(self, resume: bool) -> None:
        self.state_path = self.out / "state.json"
        if resume:
            self.state = State.read(self.state_path)
            self.state.resumes += 1
        else:
            if self.state_path.exists():
                raise RLError(f"{self.out} holds a run already: continue it with --resume, or give another --out")
            self.state = State(run_id=time.strftime("rl%Y%m%dT%H%M%S") + "-" + secrets.token_hex(2))
        self.flow_dir, self.db = self.out / "flows", self.out / "rl.duckdb"
        self.train_out, self.policies, self.logs = self.out / "train", self.out / "policies", self.out / "logs"
        self.secrets = self.out / "secrets"
        self.client_token, self.reward_token = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
        self._restarted_in = -1  # the iteration in which the engine was last restarted
        self.tasks, self.eval_tasks = self._check_rollout()
        self.tasks = [t for t in self.tasks if t.id not in self.state.dropped]
        self.secret_files: dict[str, Path] = {}
        self.trackers: Trackers | None = None
        self.policy: Policy | None = None
        self.proxy: ProxyProcess | None = None
        self.control: ControlAPI | None = None
        self.trainer: Trainer | None = None  # loaded by the first stage that needs it, kept for the run
        self.trainer_thread: threading.Thread | None = None  # async mode: the pass beside the rollout
        self._resolve_models()

    # -- set-up ----------------------------------------------------------------------------------------------
    def _check_rollout(self) -> tuple[list[Task], list[Task]]:
        """(training tasks, evaluation tasks), every task and toolchain checked before anything starts; the
        evaluation tasks are held out: none of their ids is a training task's."""
        from openforge.examples.tasks import rollout_tasks
        from openforge.rollout.runner import RolloutError, prepare
        from openforge.rollout.tasks import TaskFileError, read_tasks

        r, e = self.cfg.rollout, self.cfg.eval
        try:
            tasks = read_tasks(r.tasks) if r.tasks else rollout_tasks()
            held: list[Task] = read_tasks(e.tasks) if e.tasks else []
            if e.split:
                tasks, held = split_tasks(tasks, e.split)
            tasks = tasks[: r.max_tasks] if r.max_tasks else tasks
            held = held[: e.max_tasks] if e.max_tasks else held
            for group in (tasks, held) if held else (tasks,):
                prepare(group, r.toolchains, proxy="http://127.0.0.1:1", out=self.out, attempts=r.attempts,
                        concurrency=r.concurrency, on_failure=r.on_failure, pass_threshold=r.pass_threshold,
                        sandbox=r.sandbox)
        except (TaskFileError, RolloutError, ValueError) as err:
            raise RLError(str(err)) from None
        shared = sorted({t.id for t in tasks} & {t.id for t in held})
        if shared:
            raise RLError(f"eval.tasks: {len(shared)} of them are training tasks too ({', '.join(shared[:3])}): "
                          "evaluation must be on held-out tasks")
        return tasks, held

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
        files = self.secret_files = self.write_secrets()
        served = Path(self.state.served) if self.state.served else self.start_weights
        key_file = files["openforge_upstream_key_file"]
        policy: Policy
        if self.cfg.engine.backend == "llamacpp":
            policy = LlamaCppPolicy(self.cfg, self.template_gguf, served, self.logs / "engine.log", key_file)
        else:
            policy = VllmPolicy(self.cfg, served, self.logs / "engine.log", key_file)
        with contextlib.ExitStack() as stack:
            with self.console.status(f"starting the engine ({policy.profile}) on {policy.served}"):
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
        """Every remaining iteration; the run directory's lock is released at the end, however it ends."""
        from openforge.trainer.train import silence_loading_bars

        try:
            for d in (self.out, self.logs, self.flow_dir, self.policies):
                d.mkdir(parents=True, exist_ok=True)
            self.take_lock()  # a directory that did not exist yet at set-up
            (self.out / "rl.toml").write_text(self.cfg.to_toml())
            self.state.save(self.state_path)
            self.open_trackers()
            silence_loading_bars()  # transformers' per-load bars between the loop's lines
            with self.services():
                while self.state.iteration < self.cfg.loop.iterations:
                    self.iteration()
                if self.cfg.eval.enabled:
                    self.evaluate(self.state.version)  # the policy the run ends with, whatever eval.every says
        finally:
            self.close_trainer()
            if self.trackers is not None:
                self.trackers.close()
            self.lock.release()
        lines = read_lines(self.out / "rl.jsonl")
        plot(lines, self.out / "rl.png", read_lines(self.eval_path))
        return lines

    def open_trackers(self) -> None:
        """The experiment trackers of [tracking] under DIR/tracking (docs/tracking.md); none: nothing."""
        t = self.cfg.tracking
        if not t.trackers:
            return
        try:
            self.trackers = Trackers(t.trackers, self.out / "tracking", t.project, self.state.run_id,
                                     tomllib.loads(self.cfg.to_toml()),
                                     warn=lambda m: self.console.print(f"  [yellow]{m}[/]"))
        except TrackerError as e:
            raise RLError(f"tracking: {e}") from None

    def track(self, series: str, values: dict[str, Any], step: int) -> None:
        if self.trackers is not None:
            self.trackers.log(series, values, step)

    def iteration(self) -> None:
        i, s = self.state.iteration, self.state
        if s.stage == STAGES[0]:
            s.seconds, s.train_start_step, s.train_end_step, s.checkpoint, s.skipped_train = {}, -1, -1, "", ""
        self.console.rule(f"iteration {i + 1}/{self.cfg.loop.iterations} (policy version {s.version})")
        for stage in STAGES[STAGES.index(s.stage):-1]:
            started = time.monotonic()
            if stage in ("rollout", "publish"):
                self.ensure_engine(i, stage)
            getattr(self, stage)(i)
            s.seconds[stage] = round(s.seconds.get(stage, 0.0) + time.monotonic() - started, 3)
            s.stage = STAGES[STAGES.index(stage) + 1]
            s.save(self.state_path)
        line = self.summary_line(i) | {"skipped_train": s.skipped_train or None}
        dropped = self.recalibrate(i)
        if dropped is not None:
            line["recalibrated"] = {"band": list(self.cfg.tasks.band), "dropped": dropped,
                                    "tasks_left": len(self.tasks) - len(dropped)}
        keep_lines_before(self.out / "rl.jsonl", i)  # a line an interruption left after it was written
        with (self.out / "rl.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")
        self.track("rl", {k: v for k, v in line.items() if k not in UNTRACKED}, i)
        s.dropped.update(dropped or {})
        self.tasks = [t for t in self.tasks if t.id not in s.dropped]
        s.iteration, s.stage = i + 1, STAGES[0]
        s.save(self.state_path)
        reward = "-" if line["reward_mean"] is None else f"{line['reward_mean']:.3f}"
        self.console.print(f"iteration {i + 1}: reward {reward}, pass@{self.cfg.rollout.attempts} "
                           f"{_pct(line['pass_at_k'])}, {line['samples']} samples, now serving policy version "
                           f"{s.version}")

    def recalibrate(self, i: int) -> dict[str, str] | None:
        """Every tasks.recalibrate_every iterations, before the next one: the tasks whose pass rate in this
        iteration's rollouts left tasks.band ({task id: why}), from the results already there (no extra
        rollout); a task with no attempt counted stays. None when it is not the time; RLError when no task
        would be left."""
        every, r = self.cfg.tasks.recalibrate_every, self.cfg.rollout
        if not every or (i + 1) % every or i + 1 >= self.cfg.loop.iterations:
            return None
        band = parse_band(self.cfg.tasks.band)
        results = [EpisodeResult(**json.loads(x)) for x in
                   (self.rollout_dir(i) / "results.jsonl").read_text().splitlines() if x]
        dropped = out_of_band(pass_rates(results, r.pass_threshold, r.on_failure), band)
        if dropped and not {t.id for t in self.tasks} - dropped.keys():
            shown = "; ".join(f"{k}: {v}" for k, v in list(dropped.items())[:3])
            raise RLError(f"re-calibration after iteration {i + 1}: every task left the band {band[0]:g}..{band[1]:g} "
                          f"({shown}): nothing left to train on; widen it (--set tasks.band=LO,HI) or turn it off "
                          f"(--set tasks.recalibrate_every=0)")
        if dropped:
            self.console.print(f"  re-calibration: {len(dropped)} tasks left the band {band[0]:g}..{band[1]:g} and "
                               f"are dropped: {', '.join(dropped)}; {len(self.tasks) - len(dropped)} tasks left")
        return dropped

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
    def eval(self, i: int) -> None:
        """The evaluation pass of the policy iteration i runs on (version i), every eval.every versions."""
        if self.cfg.eval.enabled and i % self.cfg.eval.every == 0:
            self.evaluate(self.state.version)

    def evaluate(self, version: int) -> None:
        """The held-out tasks on the policy version served now, `eval.samples` per task at the policy's
        sampling and (eval.greedy) one at temperature 0; its line in eval.jsonl, once per version. Each mode's
        calls go through a proxy of its own (its sampling; flows under DIR/eval/, which reconstruct never
        reads): no evaluation episode is ever trained on, or in a GRPO group with training episodes."""
        from openforge.rollout.runner import execute, prepare

        if any(x["policy_version"] == version for x in read_lines(self.eval_path)):
            return
        assert self.policy is not None
        self.ensure_engine(version, "evaluation")
        r, e = self.cfg.rollout, self.cfg.eval
        started = time.monotonic()
        line: dict[str, Any] = {"policy_version": version, "run_id": self.state.run_id, "samples": e.samples}
        for mode, attempts in [("sampled", e.samples)] + ([("greedy", 1)] if e.greedy else []):
            out = self.out / "eval" / f"v{version:03d}" / mode
            shutil.rmtree(out, ignore_errors=True)  # an evaluation an interruption cut short runs again whole
            proxy = ProxyProcess(self.policy.url, out / "flows", out / "proxy.log", profile=self.policy.profile,
                                 routes=proxy_routes(self.cfg, greedy=mode == "greedy"),
                                 secret_files=self.secret_files, policy_version=version,
                                 pause_timeout=self.cfg.proxy.pause_timeout)
            with self.console.status(f"evaluation of policy version {version}: {len(self.eval_tasks)} held-out "
                                     f"tasks x {attempts} ({mode})"), proxy:
                run_id, specs = prepare(self.eval_tasks, r.toolchains, proxy=proxy.url, out=out, backend="local",
                                        attempts=attempts, concurrency=r.concurrency, on_failure=r.on_failure,
                                        pass_threshold=r.pass_threshold,
                                        run_id=f"{self.state.run_id}-eval{version:03d}-{mode}", sandbox=r.sandbox)
                done = execute(run_id, specs, out=out, attempts=attempts, concurrency=r.concurrency,
                               on_failure=r.on_failure, pass_threshold=r.pass_threshold, sandbox=r.sandbox,
                               client_token=self.client_token, reward_token=self.reward_token)
            line[mode] = score(done.results, e.k if mode == "sampled" else [1], r.pass_threshold)
        line["seconds"] = round(time.monotonic() - started, 3)
        with self.eval_path.open("a") as f:
            f.write(json.dumps(line) + "\n")
        self.track("eval", line, version)
        self.console.print(f"  evaluation of policy version {version}: {eval_brief(line)}")

    @property
    def eval_path(self) -> Path:
        return self.out / "eval.jsonl"

    def rollout(self, i: int) -> None:
        """Every task x toolchain x attempt on policy version i; the verifiers post rewards to the proxy. If
        the engine died meanwhile, it is restarted and the episodes of that round run again. In async mode
        iteration i's training runs beside it (`training_beside`)."""
        with self.training_beside(i) if self.cfg.loop.mode == "async" else contextlib.nullcontext():
            self.rollout_episodes(i)

    def rollout_episodes(self, i: int) -> None:
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
        started = time.monotonic()  # the whole stage: the tokenizer's loading and the reward checks too
        with self.console.status("reconstruct: flow files -> samples"):
            summary = reconstruct([self.flow_dir], self.db, self.tokenizer(), run=self.state.run_id,
                                  advantage=r.advantage, group_by=r.group_by, train_roles=r.train_roles,
                                  chat_template=r.chat_template or None,
                                  flow_key=read_secret(self.secrets / "flow.key").encode())
            self.record_episodes(i)
        self.console.print(f"  reconstruct: {summary.calls} new calls, {summary.samples} samples rebuilt "
                           f"({time.monotonic() - started:.1f} s)")

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

    def resident_trainer(self) -> Trainer:
        """The run's trainer, loaded on first use from the newest checkpoint (or the starting weights)."""
        if self.trainer is None:
            from openforge.trainer.train import Trainer

            with self.console.status("loading the trainer"):
                self.trainer = Trainer(self.trainer_config(), resume=True, say=lambda m: self.console.print(f"  {m}"))
        return self.trainer

    def trainer_config(self) -> TrainConfig:
        """The resident trainer's settings: [train] over the loop's defaults. On a CPU with native bf16 matmuls
        (AVX512-BF16, AMX) `precision = "auto"` is bf16-autocast, several times faster there than fp32; in async
        mode the steps print as lines (the rollout's progress bar is on screen)."""
        import torch

        cfg = self.cfg.train_config(str(self.db), str(self.base_model), str(self.train_out), "")
        cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
        if cfg.precision == "auto" and cpu and cpu_has_bf16():
            cfg = dataclasses.replace(cfg, precision="bf16-autocast")
        return dataclasses.replace(cfg, progress=False) if self.cfg.loop.mode == "async" else cfg

    def close_trainer(self) -> None:
        """At the end of the run, however it ends: steps only memory holds are written as a checkpoint, so
        `--resume` goes on from them (the trainer is always between two steps: `deferred_interrupt`)."""
        trainer, self.trainer = self.trainer, None
        if trainer is None:
            return
        if self.trainer_thread is not None and self.trainer_thread.is_alive():
            self.console.print("  [yellow]warning:[/] the trainer is still in a step; its state was not saved "
                               "(--resume trains from the newest checkpoint)")
            return
        try:
            if trainer.unsaved:
                with self.console.status(f"saving the trainer at step {trainer.step}"):
                    path = trainer.save()
                self.console.print(f"  saved the trainer's state to {path}: --resume goes on from it")
        except Exception as e:  # noqa: BLE001 - the run is ending; what it ended on is the error to show
            self.console.print(f"  [yellow]warning:[/] the trainer's state at step {trainer.step} was not saved "
                               f"({type(e).__name__}: {e}); --resume trains from the newest checkpoint")
        finally:
            trainer.close()

    def trains_on(self, i: int) -> int | None:
        """The iteration whose rollouts iteration i trains on: its own (sync), or the one before (async: they
        train while its own run; none in iteration 0)."""
        if self.cfg.loop.mode == "sync":
            return i
        return i - 1 if i > 0 else None

    def train(self, i: int) -> None:
        """The train stage: policy-gradient steps in the resident trainer (`train_pass`). In async mode the
        steps ran during the rollout stage (`training_beside`), so there is nothing left to do here."""
        if self.cfg.loop.mode == "sync":
            self.train_pass(i)

    def train_pass(self, i: int) -> None:
        """Iteration i's pass, start to end: `prepare_pass`, the steps, and a checkpoint when one is due."""
        selection = self.prepare_pass(i)
        if selection is not None:
            self.fit(selection)
        self.checkpoint_if_due(i)

    def prepare_pass(self, i: int) -> Selection | None:
        """What iteration i's pass trains (its weights and optimizer state go on from the last iteration's),
        checked; None when there is nothing to train: no earlier rollouts (async, iteration 0), nothing to
        learn (`nothing_to_learn`: no step, the engine keeps serving the same weights, and rl.jsonl's
        `skipped_train` says why), or the steps already done (a stop saved them)."""
        from openforge.trainer.config import ConfigError
        from openforge.trainer.data import DataError

        s, source = self.state, self.trains_on(i)
        if source is None:
            s.skipped_train = "async mode: the first iteration has no earlier rollouts to train on"
            return None
        con = duckdb.connect(str(self.db))
        try:
            ensure_tables(con)  # a run an older OpenForge started has no rl_reward_mismatches
        finally:
            con.close()
        where = self.selection(source)
        s.skipped_train = nothing_to_learn(self.db, where, self.cfg.train_config("", "", "", where))
        if s.skipped_train:
            self.console.print(f"  [yellow]nothing to learn[/]: {s.skipped_train}; no optimizer step, the engine "
                               f"keeps serving the same weights")
            return None
        try:
            trainer = self.resident_trainer()
            trainer.stop.clear()
            if 0 <= trainer.step < s.train_start_step:
                self.console.print(f"  [yellow]warning:[/] the newest checkpoint is at step {trainer.step}, before "
                                   f"this iteration's start (step {s.train_start_step}): the steps between were in "
                                   "memory only when the run was killed; this iteration trains from the checkpoint")
            if s.train_start_step < 0 or trainer.step < s.train_start_step:
                s.train_start_step, s.train_end_step = trainer.step, -1
            selection = trainer.select(where)
            if s.train_end_step < 0:
                s.train_end_step = trainer.step + selection.steps(trainer.cfg)
                s.save(self.state_path)
        except (ConfigError, DataError) as e:
            raise RLError(f"training refused: {e}") from None
        if trainer.step >= s.train_end_step:  # done before a stop, which saved them
            selection.source.close()
            return None
        return selection

    def fit(self, selection: Selection) -> None:
        """The pass's steps; a stop between steps (Ctrl-C, `Trainer.stop`) leaves the trainer there, saved
        when the run ends."""
        from openforge.trainer.data import DataError

        s, trainer = self.state, self.resident_trainer()
        try:
            trainer.fit(selection, s.train_end_step, restart=trainer.step == s.train_start_step,
                        on_step=lambda record: self.track("train", record, int(record["step"])))
        except DataError as e:
            raise RLError(f"training refused: {e}") from None

    def checkpoint_if_due(self, i: int) -> None:
        """A full checkpoint every `loop.checkpoint_every` iterations and after the last one."""
        every, trainer = self.cfg.loop.checkpoint_every, self.trainer
        if trainer is not None and trainer.unsaved and ((i + 1) % every == 0 or i + 1 >= self.cfg.loop.iterations):
            with self.console.status(f"checkpoint at step {trainer.step}"):
                self.state.checkpoint = str(trainer.save())

    @contextlib.contextmanager
    def training_beside(self, i: int) -> Iterator[None]:
        """async: iteration i's pass in a thread while the body (its rollout, on the policy served now) runs;
        joined at the end, where its error is raised. A stop of the body (Ctrl-C) stops the trainer at its
        next step boundary and waits for it, so what the run saves on the way out is a state it was in."""
        selection = self.prepare_pass(i)
        if selection is None:
            yield
            return
        trainer, failed, elapsed = self.resident_trainer(), [], []
        if trainer.device.type == "cpu":
            self.console.print("  [yellow]note:[/] async mode with the trainer on the CPU: it and a CPU engine share "
                               "the same cores, which can make both slower than sync mode (docs/rl.md, async mode)")

        def work() -> None:
            started = time.monotonic()
            try:
                self.fit(selection)
            except BaseException as e:  # noqa: BLE001 - raised in the loop's thread after the join
                failed.append(e)
            finally:
                elapsed.append(round(time.monotonic() - started, 3))

        self.trainer_thread = threading.Thread(target=work, name="openforge-trainer", daemon=True)
        self.trainer_thread.start()
        try:
            yield
            self.trainer_thread.join()
        except BaseException:
            trainer.stop.set()
            self.console.print(f"  stopping the trainer after its current step (step {trainer.step + 1})")
            self.trainer_thread.join()
            raise
        self.state.seconds["train_beside"] = elapsed[0]  # after the join: only the loop's thread writes the state
        if failed:
            raise failed[0]
        self.checkpoint_if_due(i)

    def trained(self) -> bool:
        """This iteration runs optimizer steps."""
        s = self.state
        return not s.skipped_train and s.train_end_step > s.train_start_step >= 0

    def publish(self, i: int) -> None:
        """Pause the proxy, give the engine the trainer's new weights, resume with policy version i + 1; an
        iteration that trained nothing resumes on the same weights. Non-finite weights are never published;
        any failure is an RLError (one line), the proxy left paused."""
        assert self.control is not None and self.policy is not None
        s = self.state
        if self.trained() and self.resident_trainer().step < s.train_end_step:
            self.console.print("  [yellow]warning:[/] the steps this iteration trained were in memory only when "
                               "the run was killed: training them again")
            self.train_pass(i)
        try:
            with self.console.status(f"publish policy version {i + 1}"):
                if self.trained():
                    served, paused = publish_weights(self.control, self.policy, self.resident_trainer().weights(),
                                                     i + 1, self.policies, self.cfg.proxy.pause_timeout)
                    s.served = str(served)
                else:  # nothing trained: the same weights under the next version
                    paused = 0.0
                    self.control.pause(self.cfg.proxy.pause_timeout)
                    self.control.resume(i + 1)
        except Exception as e:  # noqa: BLE001 - export, engine restart, proxy: each failure is one line
            raise RLError(f"publishing policy version {i + 1} failed: {type(e).__name__}: {e}") from None
        s.version = i + 1
        s.seconds["paused"] = round(paused, 3)
        prune_checkpoints(self.train_out, self.cfg.loop.keep_checkpoints, keep_also=s.checkpoint)
        for old in self.policies.glob("policy-*"):
            if str(old) == s.served:
                continue
            if old.is_dir():
                shutil.rmtree(old)
            else:
                old.unlink()
        if self.trained():
            self.console.print(f"  published {s.served} as policy version {i + 1} (proxy paused {paused:.1f} s)")
        else:
            self.console.print(f"  policy version {i + 1} is the same weights: {self.serving()}")

    def serving(self) -> str:
        """What the engine serves now, as the engine was given it (policy 0 of llama.cpp: the starting
        GGUF's f16 export, not the quantised file `engine.gguf` names)."""
        return str(self.policy.served) if self.policy is not None else self.state.served or str(self.start_weights)

    # -- reporting -------------------------------------------------------------------------------------------
    def summary_line(self, i: int) -> dict[str, Any]:
        """rl.jsonl's line for iteration i (docs/rl.md)."""
        summary = json.loads((self.rollout_dir(i) / "summary.json").read_text())
        overall = summary["overall"]
        results = [json.loads(x) for x in (self.rollout_dir(i) / "results.jsonl").read_text().splitlines() if x]
        s = self.state
        metrics = [m for m in read_lines(self.train_out / "metrics.jsonl")
                   if s.train_start_step < m["step"] <= s.train_end_step] if self.trained() else []
        con = duckdb.connect(str(self.db), read_only=True)
        try:
            samples, trainable = con.execute(
                f"SELECT count(*), coalesce(sum(n_trainable), 0) FROM samples WHERE n_trainable > 0 AND "
                f"{self.selection(i)} AND policy_version = {i}").fetchone()
            mismatches = con.execute("SELECT count(*) FROM rl_reward_mismatches WHERE iteration = ?",
                                     [i]).fetchone()[0]
            source = self.trains_on(i)
            stale_max, stale_mean = con.execute(
                f"SELECT max({i} - policy_version), avg({i} - policy_version) FROM samples WHERE n_trainable > 0 "
                f"AND {self.selection(source)}").fetchone() if source is not None else (None, None)
        finally:
            con.close()
        return {
            "iteration": i, "policy_version": i, "run_id": self.state.run_id,
            "episodes": overall["episodes"], "attempts": self.cfg.rollout.attempts,
            "reward_mean": overall["mean_reward"], "pass_at_k": overall["pass_at_k"],
            "pass_all_k": overall["pass_all_k"], "failures": overall["failures"],
            "failure_classes": overall.get("failure_classes", {}),
            "zero_variance_groups": zero_variance_share(results),
            "toolchains": {k: _brief(v) for k, v in summary["toolchains"].items()},
            "tasks": {k: _brief(v) for k, v in summary["tasks"].items()},
            "samples": samples, "trainable_tokens": trainable,
            "train_steps": len(metrics),
            "train_step_range": [metrics[0]["step"], metrics[-1]["step"]] if metrics else None,
            "train": {k: sum(m[k] for m in metrics) / len(metrics) for k in METRIC_MEANS} if metrics else None,
            "reward_mismatches": mismatches,
            "trained_on": source if self.trained() else None,
            "staleness": {"max": stale_max, "mean": None if stale_mean is None else round(stale_mean, 6)},
            "checkpoint": self.state.checkpoint or None, "served": self.serving(),
            "seconds": dict(self.state.seconds),
            "eval": next((x for x in read_lines(self.eval_path) if x["policy_version"] == i), None),
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


def finished(result: EpisodeResult, on_failure: str | dict[str, str]) -> bool:
    """Whether an earlier try's result counts on resume: the episode ran to its end, and the reward it had to
    post reached the proxy. A SIGTERM leaves `crashed: interrupted`; a kill -9 of the loop takes the proxy
    with it, so the agent fails and its reward post with it."""
    if result.status == "crashed" and result.reason == "interrupted":
        return False
    return result.reward_posted or not reward_due(result, on_failure)


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
    """The reward the episode posted to the proxy: the verifier's, 0.0 for a failure whose class's policy is zero,
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


def nothing_to_learn(db: Path, where: str, cfg: Any) -> str:
    """Why the trainer would select nothing from the samples `where` selects (`cfg`: its TrainConfig): no
    trainable sample, every group with equal rewards (advantage 0 everywhere), or the dynamic group filter
    keeping none; "" when there is something to learn."""
    from openforge.trainer.data import GROUP_KEY, selection_filter

    ppo = cfg.objective == "ppo"
    chosen = selection_filter(where, ppo and not cfg.keep_zero_advantage, cfg.group_filter if ppo else "none",
                              cfg.seed)
    con = duckdb.connect(str(db), read_only=True)
    try:
        (selected,) = con.execute(f"SELECT count(*) FROM samples WHERE {chosen}").fetchone()
        groups, equal = con.execute(
            f"SELECT count(*), count(*) FILTER (NOT learns) FROM (SELECT {GROUP_KEY}, coalesce(bool_or(advantage "
            f"<> 0), false) AS learns FROM samples WHERE n_trainable > 0 AND ({where}) GROUP BY ALL)").fetchone()
    finally:
        con.close()
    if selected:
        return ""
    if not groups:
        return "no trainable samples in this iteration's episodes"
    if equal == groups and ppo and not cfg.keep_zero_advantage:
        return f"every group had equal rewards ({groups} group{'s' * (groups != 1)})"
    return f"group_filter = {cfg.group_filter} kept none of {groups} groups ({equal} with equal rewards)"


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


def plot(lines: list[dict[str, Any]], path: Path, evals: list[dict[str, Any]] | None = None) -> None:
    """rl.png: by policy version, the rollouts' mean reward and pass@k (overall and per toolchain) and the
    evaluation's mean reward (error bars: one standard error), pass@k and greedy pass@1."""
    if not lines and not evals:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    x = [line["policy_version"] for line in lines]
    if lines:
        ax.plot(x, [line["reward_mean"] for line in lines], marker="o", label="rollout reward (trained on)")
        ax.plot(x, [line["pass_at_k"] for line in lines], marker="s", linestyle="--",
                label=f"rollout pass@{lines[0]['attempts']} (any)")
        names = sorted({n for line in lines for n in line["toolchains"]})
        if len(names) > 1:
            for name in names:
                ax.plot(x, [line["toolchains"].get(name, {}).get("reward_mean") for line in lines], marker=".",
                        linestyle=":", label=f"{name} reward")
    evals = sorted(evals or [], key=lambda e: e["policy_version"])
    if evals:
        ev = [e["policy_version"] for e in evals]
        sampled = [e["sampled"] for e in evals]
        ax.errorbar(ev, [s["reward_mean"] for s in sampled], yerr=[s["reward_se"] or 0 for s in sampled],
                    marker="D", capsize=3, label=f"eval reward (held out, n={evals[-1]['samples']})")
        k = max(sampled[-1]["pass_at"], key=int)
        ax.plot(ev, [s["pass_at"][k]["value"] for s in sampled], marker="^", linestyle="-.", label=f"eval pass@{k}")
        if all("greedy" in e for e in evals):
            ax.plot(ev, [e["greedy"]["pass_at"]["1"]["value"] for e in evals], marker="v", linestyle="-.",
                    label="eval greedy pass@1")
    ticks = sorted(set(x) | {e["policy_version"] for e in evals})
    ax.set_xlabel("policy version (rollouts of iteration i + 1 run on version i)")
    ax.set_xticks(ticks)
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("openforge rl: reward by policy version")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def eval_brief(line: dict[str, Any]) -> str:
    """An evaluation line in a few words: 'reward 0.50 +- 0.10, pass@1 40%, pass@2 60%, greedy 50% (8 tasks,
    32/32 scored)'."""
    s = line["sampled"]
    parts = [f"reward {_num3(s['reward_mean'])} +- {_num3(s['reward_se'])}"]
    parts += [f"pass@{k} {_pct(v['value'])}" for k, v in s["pass_at"].items()]
    if "greedy" in line:
        parts.append(f"greedy {_pct(line['greedy']['pass_at']['1']['value'])}")
    failures = f", failures {s['failures']}" if s["failures"] else ""
    return ", ".join(parts) + f" ({s['tasks']} tasks, {s['scored']}/{s['episodes']} scored{failures})"


def results_table(lines: list[dict[str, Any]], evals: list[dict[str, Any]] | None = None) -> Any:
    """The table printed at the end: a row per iteration (its policy version's rollouts, training, and
    evaluation when there was one), and a last row for the evaluation of the policy the run ends with."""
    from rich.table import Table

    attempts = lines[0]["attempts"] if lines else 1
    by_version = {e["policy_version"]: e for e in evals or []}
    table = Table(title="openforge rl")
    for col in ("iter", "policy", "episodes", "reward", f"pass@{attempts}", "samples", "loss", "gap", "s"):
        table.add_column(col, justify="right")
    if by_version:
        for col in ("eval reward", "eval pass@k", "greedy", "scored"):
            table.add_column(col, justify="right")
    table.caption = ("reward: mean over the rollout (trained on); loss: the trainer's mean; gap: mean |engine - "
                     "trainer logprob|; s: seconds" + ("; eval: held-out tasks, +- one standard error across "
                                                        "tasks, pass@k unbiased; scored/episodes" if by_version
                                                        else ""))
    for line in lines:
        t = line["train"] or {}
        row = [str(line["iteration"] + 1), str(line["policy_version"]), str(line["episodes"]),
               "-" if line["reward_mean"] is None else f"{line['reward_mean']:.3f}",
               _pct(line["pass_at_k"]), str(line["samples"]),
               f"{t['loss']:.4f}" if t else "-", f"{t['engine_gap_mean']:.4f}" if t else "-",
               f"{sum(v for k, v in line['seconds'].items() if k != 'paused'):.0f}"]
        table.add_row(*row, *(_eval_cells(by_version.get(line["policy_version"])) if by_version else []))
    last = max(by_version, default=-1)
    if last >= 0 and last not in {line["policy_version"] for line in lines}:
        table.add_row("end", str(last), *["-"] * 7, *_eval_cells(by_version[last]))
    return table


def _eval_cells(line: dict[str, Any] | None) -> list[str]:
    if line is None:
        return ["-"] * 4
    s = line["sampled"]
    passes = " ".join(f"@{k} {_pct(v['value'])}" for k, v in s["pass_at"].items())
    greedy = _pct(line["greedy"]["pass_at"]["1"]["value"]) if "greedy" in line else "-"
    return [f"{_num3(s['reward_mean'])}+-{_num3(s['reward_se'])}", passes, greedy, f"{s['scored']}/{s['episodes']}"]


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


def _num3(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"
