"""The rollout runner: tasks x toolchains x attempts -> episode specs -> a backend runs them -> summary.

The seam between planning and running is the list of `EpisodeSpec`s: `plan` builds them, a backend runs
them (here `run_local`: one `python -m openforge.rollout.episode SPEC.json --secrets-stdin` process per
episode, `concurrency` at a time), and `summarize` reads only the `EpisodeResult`s. A Kubernetes backend
runs the same entrypoint in a Job per spec.

Secrets: the runner holds the client and reward tokens, given to `execute` as arguments (`run`, the library
entry point, defaults them to $OPENFORGE_CLIENT_TOKEN and $OPENFORGE_REWARD_TOKEN), and gives each episode
process, on a pipe on its stdin, that episode's client key (`episode_client_key`: its agent's API key, which
the proxy admits only for that episode's calls) and its reward key (`episode_reward_key`), never a token;
episode processes inherit neither variable.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from openforge.choices import RolloutBackend, Sandbox
from openforge.processes import signal_group, stop_group
from openforge.protocols.client_keys import episode_client_key
from openforge.protocols.control import STATUS_PATH, ControlClient, ControlError
from openforge.protocols.reward_keys import episode_reward_key
from openforge.rollout.adapters import AdapterError, render, resolve, tools_dir
from openforge.rollout.failures import POLICIES, EpisodeStatus, classify, policies
from openforge.rollout.limits import parse_limits
from openforge.rollout.pristine import FAILS
from openforge.rollout.sandbox import unavailable
from openforge.rollout.spec import (
    CLIENT_TOKEN_ENV,
    REWARD_TOKEN_ENV,
    TIMEOUTS_PER_EPISODE,
    Adapter,
    EpisodeResult,
    EpisodeSpec,
    Limits,
    Task,
)
from openforge.rollout.tasks import TaskFileError, read_tasks

if TYPE_CHECKING:
    from openforge.rollout.k8s import K8sOptions

OnFailure = str | Mapping[str, str]  # failures.policies: "default", "zero", "drop", "class=policy,..." or a mapping

ON_FAILURE = POLICIES
EPISODE_SLACK_S = 120.0  # past the timeouts of its steps (TIMEOUTS_PER_EPISODE), the runner kills an episode process


class RolloutError(ValueError):
    """Bad input to a rollout (task file, adapter, options): nothing was run."""


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S") + "-" + secrets.token_hex(2)


def plan(tasks: Sequence[Task], adapters: Sequence[Adapter], attempts: int, *, proxy_url: str, out: Path,
         run_id: str, fresh_verify_copy: bool = False, on_failure: OnFailure = "default",
         sandbox: str = "bwrap", role: str | None = None, limits: Limits | None = None) -> list[EpisodeSpec]:
    """One spec per (task, toolchain allowed by the task, attempt 1..k), each with its own directories under
    `out/episodes/<episode>/` (episode = run id, task, toolchain, attempt); `role`: the proxy's role for the
    agents' calls (None: the proxy's default, the policy); `limits`: each episode's (None: the defaults). The
    episodes share `out/pristine/`, where their verifier's verdict on each pristine task is kept (pristine.py)."""
    specs: list[EpisodeSpec] = []
    policy = policies(on_failure)
    verdicts = str((out / "pristine").resolve())
    for task in (replace(t, solution=None, metadata={}) for t in tasks):  # the fix, its origin: never in an episode
        for adapter in adapters:
            if task.toolchains is not None and adapter.name not in task.toolchains:
                continue
            for attempt in range(1, attempts + 1):
                episode = f"{run_id}-{task.id}-{adapter.name}-{attempt}"
                ep_dir = (out / "episodes" / episode).resolve()
                specs.append(EpisodeSpec(
                    run_id=run_id, episode=episode, task=task, adapter=adapter, attempt=attempt, proxy_url=proxy_url,
                    out_dir=str(ep_dir), workdir=str(ep_dir / "work"), home=str(ep_dir / "home"),
                    fresh_verify_copy=fresh_verify_copy, on_failure=policy, sandbox=sandbox, role=role,
                    limits=limits if limits is not None else Limits(), pristine_dir=verdicts))
    if len({s.episode for s in specs}) != len(specs):
        raise RolloutError("two episodes got the same id (task and toolchain names that run together): rename one")
    return specs


def check_installed(adapter: Adapter) -> None:
    """A built-in CLI that is not installed here fails now, not once per episode."""
    program = render(adapter.command[0], {"tools": tools_dir(), "python": sys.executable})
    if "/" in program and "{" not in program and not Path(program).exists():
        raise RolloutError(f"toolchain {adapter.name}: {program} not found (install the CLIs with "
                           f"toolchains/install.sh, or set OPENFORGE_TOOLS_DIR)")


def read_result(spec: EpisodeSpec) -> EpisodeResult | None:
    try:
        return EpisodeResult(**json.loads((Path(spec.out_dir) / "result.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def tokens(client_token: str | None, reward_token: str | None) -> tuple[str | None, str | None]:
    """The tokens given, else those in the environment."""
    return (client_token if client_token is not None else os.environ.get(CLIENT_TOKEN_ENV),
            reward_token if reward_token is not None else os.environ.get(REWARD_TOKEN_ENV))


def write_spec(spec: EpisodeSpec) -> Path:
    """`<out_dir>/spec.json`; under the `uid` sandbox root's alone (0400) in a directory the agent may only
    pass through (0711) to its workspace."""
    out = Path(spec.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "spec.json"
    path.unlink(missing_ok=True)
    private = spec.sandbox == "uid"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400 if private else 0o644)
    with open(fd, "w") as f:
        f.write(spec.to_json())
    if private:
        out.chmod(0o711)
    return path


def run_local(specs: list[EpisodeSpec], concurrency: int,
              on_done: Callable[[EpisodeResult], None] = lambda r: None, *, client_token: str | None = None,
              reward_token: str | None = None) -> list[EpisodeResult]:
    """Each spec in its own episode process (own process group), `concurrency` at a time; results in spec order.
    An episode process that dies without result.json gets a `crashed` result saying so (no reward posted)."""
    running: set[subprocess.Popen[bytes]] = set()
    lock = threading.Lock()
    env = {k: v for k, v in os.environ.items() if k not in (CLIENT_TOKEN_ENV, REWARD_TOKEN_ENV)}

    def one(spec: EpisodeSpec) -> EpisodeResult:
        out = Path(spec.out_dir)
        spec_path = write_spec(spec)
        key = episode_reward_key(reward_token, spec.episode) if reward_token else ""
        agent_key = episode_client_key(client_token, spec.episode, spec.role) if client_token else ""
        with open(out / "episode.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "openforge.rollout.episode", str(spec_path),
                                     "--secrets-stdin"], stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
        with lock:
            running.add(proc)
        assert proc.stdin is not None
        try:  # two lines, far below a pipe's buffer: the key waits there until the episode reads it
            proc.stdin.write(f"{agent_key}\n{key}\n".encode())
            proc.stdin.close()
        except OSError:  # the episode process died at once: its result says so below
            pass
        try:
            code = proc.wait(TIMEOUTS_PER_EPISODE * spec.task.timeout_s + EPISODE_SLACK_S)
        except subprocess.TimeoutExpired:  # SIGTERM first: the episode then kills its agent's group
            code = stop_group(proc, 10.0)
        finally:
            with lock:
                running.discard(proc)
        result = read_result(spec) or EpisodeResult.unrewarded(
            spec, EpisodeStatus.CRASHED, f"episode process exited {code} without result.json (see episode.log)")
        on_done(result)
        return result

    pool = ThreadPoolExecutor(max_workers=max(1, concurrency))
    try:
        results = list(pool.map(one, specs))
    except BaseException:  # Ctrl-C: stop every episode (each kills its agent's group on SIGTERM)
        pool.shutdown(wait=False, cancel_futures=True)
        with lock:
            for proc in running:
                signal_group(proc.pid, signal.SIGTERM)
        raise
    pool.shutdown()
    return results


def passed(result: EpisodeResult, threshold: float) -> bool:
    """An attempt passes when it ended ok with a verifier reward >= threshold."""
    return result.status == EpisodeStatus.OK and result.reward is not None and result.reward >= threshold


def counted_reward(result: EpisodeResult, on_failure: OnFailure) -> float | None:
    """The reward that counts for the mean: the verifier's, 0.0 for a failure whose class's policy is `zero`,
    none under `drop`."""
    if result.reward is not None:
        return result.reward
    return 0.0 if policies(on_failure)[classify(result) or "agent"] == "zero" else None


def group_stats(results: Sequence[EpisodeResult], threshold: float, on_failure: OnFailure) -> dict[str, Any]:
    """Episodes, mean reward, pass@k / pass^k over the (task, toolchain) units in `results`, failures, time."""
    units: dict[tuple[str, str], list[EpisodeResult]] = defaultdict(list)
    for r in results:
        units[(r.task_id, r.toolchain)].append(r)
    rewards = [x for r in results if (x := counted_reward(r, on_failure)) is not None]
    seconds = [r.agent_s + r.verify_s for r in results]
    return {
        "episodes": len(results),
        "units": len(units),
        "mean_reward": round(sum(rewards) / len(rewards), 6) if rewards else None,
        "pass_at_k": round(sum(any(passed(r, threshold) for r in u) for u in units.values()) / len(units), 6)
        if units else None,
        "pass_all_k": round(sum(all(passed(r, threshold) for r in u) for u in units.values()) / len(units), 6)
        if units else None,
        "failures": dict(sorted(Counter(r.status for r in results if r.status != EpisodeStatus.OK).items())),
        "failure_classes": dict(sorted(Counter(c for r in results if (c := classify(r))).items())),
        "resources": dict(sorted(Counter(r.resource for r in results if r.resource).items())),
        "drop_rates": drop_rates(results, on_failure),
        "broken": sum(r.pristine == FAILS for r in results),
        "seconds": round(sum(seconds), 3),
        "mean_seconds": round(sum(seconds) / len(seconds), 3) if seconds else None,
    }


def drop_rates(results: Sequence[EpisodeResult], on_failure: OnFailure) -> dict[str, float]:
    """Per failure class, the share of `results` dropped (no reward counted: the class's policy is `drop`)."""
    dropped = Counter(c for r in results if (c := classify(r)) and counted_reward(r, on_failure) is None)
    return {c: round(n / len(results), 6) for c, n in sorted(dropped.items())}


def summarize(results: Sequence[EpisodeResult], *, run_id: str, attempts: int, pass_threshold: float,
              on_failure: OnFailure, wall_s: float) -> dict[str, Any]:
    """summary.json: per task, per toolchain and overall (docs/rollouts.md, Summary); `broken_tasks`: the
    episodes of each task whose verifier failed on the pristine task too (the task's bug, not the policy's)."""
    by_task: dict[str, list[EpisodeResult]] = defaultdict(list)
    by_toolchain: dict[str, list[EpisodeResult]] = defaultdict(list)
    for r in results:
        by_task[r.task_id].append(r)
        by_toolchain[r.toolchain].append(r)
    tasks = {k: group_stats(v, pass_threshold, on_failure) for k, v in by_task.items()}
    return {
        "run_id": run_id, "attempts": attempts, "pass_threshold": pass_threshold, "on_failure": policies(on_failure),
        "wall_s": round(wall_s, 3),
        "tasks": tasks,
        "broken_tasks": {k: v["broken"] for k, v in tasks.items() if v["broken"]},
        "toolchains": {k: group_stats(v, pass_threshold, on_failure) for k, v in by_toolchain.items()},
        "overall": group_stats(results, pass_threshold, on_failure),
        "rewards_posted": sum(r.reward_posted for r in results),
        "limits": enforced_limits(results),
    }


def enforced_limits(results: Sequence[EpisodeResult]) -> dict[str, dict[str, int]]:
    """Per limit, how it was enforced and in how many episodes ({"memory": {"4GiB by cgroup v2": 8}})."""
    found: dict[str, Counter[str]] = defaultdict(Counter)
    for r in results:
        for limit, how in r.limits.items():
            found[limit][how] += 1
    return {k: dict(v.most_common()) for k, v in found.items()}


@dataclass
class Rollout:
    """What `run` did: the run id, every episode's result (spec order), the summary written to summary.json."""

    run_id: str
    out: Path
    results: list[EpisodeResult] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


def write_rollout(rollout: Rollout) -> Rollout:
    """`out/results.jsonl` (one result a line, spec order) and `out/summary.json`: what `read_rollout` reads."""
    (rollout.out / "results.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in rollout.results))
    (rollout.out / "summary.json").write_text(json.dumps(rollout.summary, indent=1))
    return rollout


def read_rollout(out: str | Path) -> Rollout:
    """The rollout `execute` wrote to `out`; RolloutError when its files are missing or not its format."""
    out = Path(out)
    try:
        summary = json.loads((out / "summary.json").read_text())
        results = [EpisodeResult(**json.loads(x)) for x in (out / "results.jsonl").read_text().splitlines() if x]
        return Rollout(summary["run_id"], out, results, summary)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise RolloutError(f"{out}: not a finished rollout (results.jsonl, summary.json): {e}") from None


def check_proxy(proxy: str, client_token: str | None = None, reward_token: str | None = None,
                timeout: float = 10.0) -> None:
    """RolloutError unless the proxy at `proxy` answers its readiness probe (`GET /openforge/v1/status`, with
    the client token, else the reward token): before any episode runs, not once per episode."""
    client, reward = tokens(client_token, reward_token)
    try:
        ready = ControlClient(proxy, client or reward, timeout=timeout, tries=1).status().get("ok") is True
    except ControlError as e:
        if e.status is None:
            raise RolloutError(f"the proxy at {proxy} does not answer (GET {STATUS_PATH}: {e.message}); start it "
                               "first (openforge proxy)") from None
        if e.status == 401:
            raise RolloutError(f"the proxy at {proxy} refuses the token given (HTTP 401): set "
                               f"{CLIENT_TOKEN_ENV} to one of its openforge_client_tokens") from None
        if e.status == 503:
            raise RolloutError(f"the proxy at {proxy} is not ready (HTTP 503): {e.message}") from None
        if e.status != 200:
            raise RolloutError(f"{proxy} is not an OpenForge proxy (GET {STATUS_PATH} answered HTTP {e.status})") \
                from None
        ready = False
    if not ready:
        raise RolloutError(f"{proxy} is not an OpenForge proxy (GET {STATUS_PATH} did not answer its JSON)")


def check_sandbox(sandbox: str, backend: str) -> str:
    """The sandbox mode episodes run under: `sandbox`, except that a Kubernetes pod confines its agent by
    uid (`bwrap` -> `uid`); RolloutError when the mode is unknown or cannot run here."""
    if sandbox not in tuple(Sandbox):
        raise RolloutError(f"sandbox must be one of {', '.join(Sandbox)}, not {sandbox!r}")
    if backend == "k8s":
        return "uid" if sandbox == "bwrap" else sandbox
    if why := unavailable(sandbox):
        raise RolloutError(why)
    return sandbox


def prepare(tasks: str | Path | Sequence[Task], toolchains: Iterable[str | Adapter], *, proxy: str, out: str | Path,
            attempts: int = 1, concurrency: int = 1, on_failure: OnFailure = "default", fresh_verify_copy: bool = False,
            pass_threshold: float = 1.0, backend: str = "local", run_id: str | None = None,
            sandbox: str = "bwrap", client_token: str | None = None,
            reward_token: str | None = None, role: str | None = None,
            limits: Limits | None = None) -> tuple[str, list[EpisodeSpec]]:
    """Check every input and plan the episodes: (run id, specs); RolloutError for bad input, or for a
    sandbox that cannot run here. The tokens are `execute`'s (accepted here so all three functions take the
    same keyword arguments); `limits`: each episode's (None: the defaults, docs/rollouts.md, Limits)."""
    if attempts < 1 or concurrency < 1:
        raise RolloutError("--attempts and --concurrency must be >= 1")
    try:
        policies(on_failure)
    except ValueError as e:
        raise RolloutError(f"--on-failure / on_failure: {e}") from None
    if backend not in tuple(RolloutBackend):
        raise RolloutError(f"--backend must be one of {', '.join(RolloutBackend)}, not {backend!r}")
    if not math.isfinite(pass_threshold):
        raise RolloutError("--pass-threshold must be a finite number")
    if not proxy.startswith(("http://", "https://")):
        raise RolloutError(f"--proxy must be the proxy's http(s) URL, not {proxy!r}")
    try:
        limits = parse_limits(dataclasses.asdict(limits), Limits.none()) if limits is not None else Limits()
    except ValueError as e:
        raise RolloutError(f"limits: {e}") from None
    try:
        task_list = read_tasks(tasks) if isinstance(tasks, (str, Path)) else list(tasks)
        adapters = [t if isinstance(t, Adapter) else resolve(t) for t in toolchains]
    except (TaskFileError, AdapterError) as e:
        raise RolloutError(str(e)) from None
    if not adapters:
        raise RolloutError("no toolchain: give at least one --toolchain")
    names = [a.name for a in adapters]
    if len(set(names)) != len(names):
        raise RolloutError(f"toolchain given twice: {', '.join(sorted(n for n in set(names) if names.count(n) > 1))}")
    if backend == "local":
        for adapter in adapters:
            check_installed(adapter)
    mode = check_sandbox(sandbox, backend)
    run_id = run_id or new_run_id()
    specs = plan(task_list, adapters, attempts, proxy_url=proxy.rstrip("/"), out=Path(out), run_id=run_id,
                 fresh_verify_copy=fresh_verify_copy, on_failure=on_failure, sandbox=mode, role=role, limits=limits)
    if not specs:
        raise RolloutError("no episode to run: every task's 'toolchains' excludes the toolchains given")
    return run_id, specs


def execute(run_id: str, specs: list[EpisodeSpec], *, out: str | Path, attempts: int, concurrency: int = 1,
            on_failure: OnFailure = "default", pass_threshold: float = 1.0, backend: str = "local",
            k8s_options: K8sOptions | None = None, on_done: Callable[[EpisodeResult], None] = lambda r: None,
            done: Sequence[EpisodeResult] = (), sandbox: str | None = None, client_token: str | None = None,
            reward_token: str | None = None) -> Rollout:
    """Run planned episodes on `backend` (`k8s`: as Jobs, with `k8s_options`); every result in
    `out/results.jsonl`, the summary in `out/summary.json`. `done`: results of episodes an interrupted
    earlier run of the same rollout finished, counted with the new ones (first). `sandbox`: run them under
    this mode instead of the planned one. `client_token`, `reward_token`: what the episodes are given (None:
    nothing; module docstring)."""
    if sandbox is not None:
        mode = check_sandbox(sandbox, backend)
        specs = [replace(s, sandbox=mode) for s in specs]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    if backend == "k8s":
        from openforge.rollout import k8s

        if k8s_options is None:
            raise RolloutError("--backend k8s needs the cluster settings (--k8s-config FILE.toml)")
        results = k8s.submit(specs, k8s_options, concurrency=concurrency, on_done=on_done)
    else:
        results = run_local(specs, concurrency, on_done, client_token=client_token, reward_token=reward_token)
    results = [*done, *results]
    summary = summarize(results, run_id=run_id, attempts=attempts, pass_threshold=pass_threshold,
                        on_failure=on_failure, wall_s=time.monotonic() - started)
    return write_rollout(Rollout(run_id, out, list(results), summary))


def run(tasks: str | Path | Sequence[Task], toolchains: Iterable[str | Adapter], *, proxy: str, out: str | Path,
        attempts: int = 1, concurrency: int = 1, on_failure: OnFailure = "default", fresh_verify_copy: bool = False,
        pass_threshold: float = 1.0, backend: str = "local", k8s_options: K8sOptions | None = None,
        run_id: str | None = None, on_done: Callable[[EpisodeResult], None] = lambda r: None,
        sandbox: str = "bwrap", client_token: str | None = None, reward_token: str | None = None,
        role: str | None = None, limits: Limits | None = None) -> Rollout:
    """`openforge rollout` as a function (docs/rollouts.md): `prepare`, `check_proxy` (local), then
    `execute`; `role`: the proxy's role for the agents' calls (a validator's, say); `limits`: each
    episode's (None: the defaults). Tokens: the arguments,
    else $OPENFORGE_CLIENT_TOKEN and $OPENFORGE_REWARD_TOKEN; RolloutError for bad input, a sandbox that
    cannot run here or a proxy that does not answer (nothing run)."""
    run_id, specs = prepare(tasks, toolchains, proxy=proxy, out=out, attempts=attempts, concurrency=concurrency,
                            on_failure=on_failure, fresh_verify_copy=fresh_verify_copy,
                            pass_threshold=pass_threshold, backend=backend, run_id=run_id, sandbox=sandbox,
                            role=role, limits=limits)
    client_token, reward_token = tokens(client_token, reward_token)
    if backend == "local":
        check_proxy(proxy, client_token, reward_token)
    return execute(run_id, specs, out=out, attempts=attempts, concurrency=concurrency, on_failure=on_failure,
                   pass_threshold=pass_threshold, backend=backend, k8s_options=k8s_options, on_done=on_done,
                   client_token=client_token, reward_token=reward_token)
