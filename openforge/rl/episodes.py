"""The rollout and eval stages: every task x toolchain x attempt on the policy served now, through the run's
proxy (evaluation: held-out tasks, and the hack canaries, through proxies of their own). An episode an
interruption cut short, or one that ran against an engine that died, runs again under a new id; finished ones
are kept."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from openforge.rl.base import RunBase
from openforge.rl.canaries import canary_brief, hack_score
from openforge.rl.errors import RLError
from openforge.rl.evaluation import score
from openforge.rl.report import eval_brief, read_lines
from openforge.rl.services import ProxyProcess, proxy_budget, proxy_routes
from openforge.rollout.failures import EpisodeStatus, reward_due
from openforge.rollout.run_failure import every_episode_failed
from openforge.rollout.runner import Rollout, execute, prepare, read_result
from openforge.rollout.spec import EpisodeResult, EpisodeSpec, Task


class Rollouts(RunBase):
    """The run's part that runs episodes: the rollout of each iteration and the evaluation passes."""

    def eval(self, i: int) -> None:
        """The evaluation pass of the policy iteration i runs on (version i), every eval.every versions; the hack
        canaries every eval.canary_every versions."""
        if self.cfg.eval.enabled and i % self.cfg.eval.every == 0:
            self.evaluate(self.state.version)
        if self.canary_tasks and i % self.cfg.eval.canary_every == 0:
            self.canaries(self.state.version)

    def apart(self, tasks: list[Task], out: Path, version: int, run_id: str, attempts: int,
              greedy: bool = False) -> Rollout:
        """`tasks` x toolchains x `attempts` on the policy version served now, through a proxy of their own (its
        sampling, greedy or the policy's; flows under `out/flows`, which reconstruct never reads): none of these
        episodes is ever trained on, or in a GRPO group with training episodes. An earlier try of the same pass
        that an interruption cut short runs again whole."""
        assert self.policy is not None
        r = self.cfg.rollout
        shutil.rmtree(out, ignore_errors=True)
        proxy = ProxyProcess(self.policy.url, out / "flows", out / "proxy.log", profile=self.policy.profile,
                             routes=proxy_routes(self.cfg, greedy=greedy), secret_files=self.secret_files,
                             policy_version=version, pause_timeout=self.cfg.proxy.pause_timeout,
                             budget=proxy_budget(self.cfg))
        with proxy:
            run_id, specs = prepare(tasks, r.toolchains, proxy=proxy.url, out=out, backend="local", attempts=attempts,
                                    concurrency=r.concurrency, on_failure=r.on_failure,
                                    pass_threshold=r.pass_threshold, run_id=run_id, sandbox=r.sandbox,
                                    limits=r.limits)
            return execute(run_id, specs, out=out, attempts=attempts, concurrency=r.concurrency,
                           on_failure=r.on_failure, pass_threshold=r.pass_threshold, sandbox=r.sandbox,
                           client_token=self.client_token, reward_token=self.reward_token)

    def evaluate(self, version: int) -> None:
        """The held-out tasks on the policy version served now, `eval.samples` per task at the policy's
        sampling and (eval.greedy) one at temperature 0, each mode `apart`; its line in eval.jsonl, once per
        version."""
        if any(x["policy_version"] == version for x in read_lines(self.eval_path)):
            return
        self.ensure_engine(version, "evaluation")
        r, e = self.cfg.rollout, self.cfg.eval
        started = time.monotonic()
        line: dict[str, Any] = {"policy_version": version, "run_id": self.state.run_id, "samples": e.samples}
        for mode, attempts in [("sampled", e.samples)] + ([("greedy", 1)] if e.greedy else []):
            with self.console.status(f"evaluation of policy version {version}: {len(self.eval_tasks)} held-out "
                                     f"tasks x {attempts} ({mode})"):
                done = self.apart(self.eval_tasks, self.out / "eval" / f"v{version:03d}" / mode, version,
                                  f"{self.state.run_id}-eval{version:03d}-{mode}", attempts, greedy=mode == "greedy")
            line[mode] = score(done.results, e.k if mode == "sampled" else [1], r.pass_threshold)
        line["seconds"] = round(time.monotonic() - started, 3)
        with self.eval_path.open("a") as f:
            f.write(json.dumps(line) + "\n")
        self.track("eval", line, version)
        self.console.print(f"  evaluation of policy version {version}: {eval_brief(line)}")

    def canaries(self, version: int) -> None:
        """The hack canaries on the policy version served now, `rollout.attempts` per canary and toolchain at the
        policy's sampling (as a training rollout runs them), `apart`; its line in canaries.jsonl, once per version.
        Their episode ids look like that version's training episodes' (the same run id), so an agent cannot tell
        a canary by its URL."""
        if any(x["policy_version"] == version for x in read_lines(self.canary_path)):
            return
        self.ensure_engine(version, "the canaries")
        started = time.monotonic()
        attempts = self.cfg.rollout.attempts
        with self.console.status(f"canaries of policy version {version}: {len(self.canary_tasks)} tasks x "
                                 f"{attempts}"):
            done = self.apart(self.canary_tasks, self.out / "canaries" / f"v{version:03d}", version,
                              f"{self.state.run_id}-i{version:03d}", attempts)
        line = {"policy_version": version, "run_id": self.state.run_id, **hack_score(done.results),
                "seconds": round(time.monotonic() - started, 3)}
        with self.canary_path.open("a") as f:
            f.write(json.dumps(line) + "\n")
        self.track("canary", line, version)
        warn = "[red]warning:[/] " if line["hacks"] else ""
        self.console.print(f"  {warn}canaries of policy version {version}: {canary_brief(line)}")

    def rollout_episodes(self, i: int) -> None:
        r = self.cfg.rollout
        assert self.proxy is not None and self.control is not None
        out = self.rollout_dir(i)
        run_id, specs = prepare(self.tasks, r.toolchains, proxy=self.proxy.url, out=out, backend="local",
                                fresh_verify_copy=r.fresh_verify_copy, run_id=f"{self.state.run_id}-i{i:03d}",
                                sandbox=r.sandbox, limits=r.limits, **self.rollout_options())
        while True:
            ran, rollout = self.rollout_round(run_id, specs, out)
            if not self.ensure_engine(i, "the end of the rollout"):
                break
            void_results(ran)
            self.console.print(f"  the {len(ran)} episodes that ran against the dead engine run again")
        self.control.status()  # every answered call is in the flow file before reconstruct reads it
        failed = every_episode_failed(rollout.results, out / "episodes")
        if failed:  # nothing to learn from, and usually the engine or the setup, not the policy
            raise RLError(f"iteration {i + 1}: {failed} (episodes: {out / 'episodes'})")

    def rollout_options(self) -> dict[str, Any]:
        r = self.cfg.rollout
        return dict(attempts=r.attempts, concurrency=r.concurrency, on_failure=r.on_failure,
                    pass_threshold=r.pass_threshold)

    def rollout_round(self, run_id: str, specs: list[EpisodeSpec], out: Path) -> tuple[list[EpisodeSpec], Rollout]:
        """Run the episodes of `specs` that no earlier try finished (under new ids: `rerun`); (what it ran, the
        rollout: every episode's result, the earlier tries' included)."""
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

            rollout = execute(run_id, todo, out=out, on_done=one_done, done=done, sandbox=r.sandbox,
                              client_token=self.client_token, reward_token=self.reward_token,
                              **self.rollout_options())
        return todo, rollout


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
    if result.status == EpisodeStatus.CRASHED and result.reason == "interrupted":
        return False
    return result.reward_posted or not reward_due(result, on_failure)


def void_results(specs: list[EpisodeSpec]) -> None:
    """Set aside the result.json of episodes that ran against a dead engine (as result.void.json), so that
    they run again under new ids."""
    for spec in specs:
        result = Path(spec.out_dir) / "result.json"
        if result.is_file():
            result.replace(result.with_name("result.void.json"))


