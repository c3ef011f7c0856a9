"""`openforge rl`: rollouts on policy i -> reconstruct -> train -> publish policy i+1, `iterations` times.

One output directory holds the run (docs/rl.md):

    DIR/rl.toml            the resolved config (what --resume reads back)
    DIR/state.json         where the run is: iteration, stage, policy version, what the engine serves
    DIR/rl.jsonl           one line per finished iteration; DIR/rl.png its reward per iteration
    DIR/canaries.jsonl     the hack rate per policy version on the canaries (eval.canaries), run apart
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
import json
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console

from openforge.processes import non_dumpable, read_secret
from openforge.protocols.control import ControlClient
from openforge.rl.config import RLConfig
from openforge.rl.episodes import Rollouts
from openforge.rl.errors import RLError
from openforge.rl.lock import RunLock, RunLocked
from openforge.rl.pruning import prune_checkpoints, prune_policies
from openforge.rl.records import reward_mismatches
from openforge.rl.report import UNTRACKED, Report, keep_lines_before, percent, plot, read_lines
from openforge.rl.services import LlamaCppPolicy, Policy, ProxyProcess, VllmPolicy, proxy_budget, proxy_routes
from openforge.rl.services import publish as publish_weights
from openforge.rl.state import Stage
from openforge.rl.training import Training
from openforge.taskforge.calibrate import out_of_band, parse_band, pass_rates
from openforge.tracking import TrackerError, Trackers


class RLRun(Rollouts, Training, Report):
    """One `openforge rl` run in `out`; `run()` does every remaining iteration and returns rl.jsonl's lines. Its
    stages are the methods named by `Stage` (episodes.py: eval, rollout; training.py: train; here: reconstruct,
    publish)."""

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
                                 pause_timeout=self.cfg.proxy.pause_timeout, budget=proxy_budget(self.cfg))
            self.proxy = stack.enter_context(proxy)
            self.control = ControlClient(self.proxy.url, self.reward_token, timeout=60)
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
            self.migrate_db()
            self.open_trackers()
            silence_loading_bars()  # transformers' per-load bars between the loop's lines
            with self.services():
                while self.state.iteration < self.cfg.loop.iterations:
                    self.iteration()
                if self.cfg.eval.enabled:
                    self.evaluate(self.state.version)  # the policy the run ends with, whatever eval.every says
                if self.canary_tasks:
                    self.canaries(self.state.version)  # and its hack rate, whatever eval.canary_every says
        finally:
            self.close_trainer()
            if self.trackers is not None:
                self.trackers.close()
            self.lock.release()
        lines = read_lines(self.out / "rl.jsonl")
        plot(lines, self.out / "rl.png", read_lines(self.eval_path), read_lines(self.canary_path))
        return lines

    def migrate_db(self) -> None:
        """A resumed run's DuckDB at this OpenForge's schema version before any stage reads it (a run resumed
        at its train stage reaches the trainer, which reads only this version, before reconstruct would)."""
        if not self.db.exists():
            return
        import duckdb

        from openforge.reconstruct import store

        try:
            store.connect(self.db).close()
        except ValueError as e:  # its message names the database and what to do
            raise RLError(str(e)) from None
        except duckdb.Error as e:
            raise RLError(f"{self.db}: {e}") from None

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

    def iteration(self) -> None:
        i, s = self.state.iteration, self.state
        if s.stage is Stage.EVAL:
            s.seconds, s.train_start_step, s.train_end_step, s.checkpoint, s.skipped_train = {}, -1, -1, "", ""
        self.console.rule(f"iteration {i + 1}/{self.cfg.loop.iterations} (policy version {s.version})")
        for stage in s.stage.until_record():
            started = time.monotonic()
            if stage in (Stage.ROLLOUT, Stage.PUBLISH):
                self.ensure_engine(i, stage.value)
            getattr(self, stage.value)(i)
            s.seconds[stage.value] = round(s.seconds.get(stage.value, 0.0) + time.monotonic() - started, 3)
            s.advance(stage)
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
        s.advance(Stage.RECORD)
        s.save(self.state_path)
        for task, n in (line.get("broken_tasks") or {}).items():
            self.console.print(f"  [yellow]warning:[/] task {task}: its verifier gives no reward on the pristine task "
                               f"either ({n} episodes dropped): the task is broken, fix it or leave it out")
        reward = "-" if line["reward_mean"] is None else f"{line['reward_mean']:.3f}"
        self.console.print(f"iteration {i + 1}: reward {reward}, pass@{self.cfg.rollout.attempts} "
                           f"{percent(line['pass_at_k'])}, {line['samples']} samples, now serving policy version "
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
        results = self.rollout_of(i).results
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

    def rollout(self, i: int) -> None:
        """Every task x toolchain x attempt on policy version i; the verifiers post rewards to the proxy. If
        the engine died meanwhile, it is restarted and the episodes of that round run again. In async mode
        iteration i's training runs beside it (`training_beside`)."""
        with self.training_beside(i) if self.cfg.loop.mode == "async" else contextlib.nullcontext():
            self.rollout_episodes(i)

    def reconstruct(self, i: int) -> None:
        """The new flow records into the run's DuckDB; the iteration's episodes into `rl_episodes`."""
        from openforge.reconstruct import reconstruct
        from openforge.reconstruct.renderer import load_renderer

        r = self.cfg.reconstruct
        started = time.monotonic()  # the whole stage: the tokenizer's loading and the reward checks too
        with self.console.status("reconstruct: flow files -> samples"):
            if self.renderer is None:  # loaded once a run: the same tokenizer and template every iteration
                self.renderer = load_renderer(self.tokenizer(), r.chat_template or None)
            summary = reconstruct([self.flow_dir], self.db, self.renderer, run=self.state.run_id,
                                  advantage=r.advantage, group_by=r.group_by, train_roles=r.train_roles,
                                  flow_key=read_secret(self.secrets / "flow.key").encode())
            self.record_episodes(i)
        self.console.print(f"  reconstruct: {summary.calls} new calls, {summary.samples} samples rebuilt "
                           f"({time.monotonic() - started:.1f} s)")

    def record_episodes(self, i: int) -> None:
        """The iteration's results into `rl_episodes`; each checked against the reward reconstruct stored
        for it: a mismatch goes to `rl_reward_mismatches` (left out of training) and gets a warning."""
        from openforge.reconstruct import store
        from openforge.samples import connect

        results = self.rollout_of(i).results
        con = connect(self.db, read_only=False)  # reconstruct has just applied the schema
        try:
            found = reward_mismatches(con, results)
            store.record_rl_iteration(con, i, [(x.episode, x.task_id, x.toolchain, x.attempt, x.status, x.reward)
                                               for x in results], found)
        finally:
            con.close()
        if found:
            shown = ", ".join(f"{ep} (result.json {_num(a)}, DuckDB {_num(b)})" for ep, a, b in found[:3])
            more = f" and {len(found) - 3} more" if len(found) > 3 else ""
            self.console.print(f"  [yellow]warning:[/] {len(found)} episodes' rewards in {self.db.name} differ "
                               f"from their result.json: {shown}{more}; left out of training")

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
        prune_policies(self.policies, s.served)
        if self.trained():
            self.console.print(f"  published {s.served} as policy version {i + 1} (proxy paused {paused:.1f} s)")
        else:
            self.console.print(f"  policy version {i + 1} is the same weights: {self.serving()}")


def _num(x: float | None) -> str:
    return "none" if x is None else f"{x:g}"


