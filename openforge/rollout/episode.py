"""Run ONE episode from its spec: workspace, agent, verifier, reward post, result.json.

    python -m openforge.rollout.episode SPEC.json [--secrets-stdin]

This is the entrypoint a local rollout starts per episode and a Kubernetes Job runs. Secrets: with
`--secrets-stdin` (the local runner) this episode's client key (`episode_client_key`, never the client token)
and its reward key (`episode_reward_key`, never the reward token) are two lines on stdin, and the reward key
is read from the pipe only once the agent is gone; without it (a Job), both are derived from
$OPENFORGE_CLIENT_TOKEN and $OPENFORGE_REWARD_TOKEN. This process is non-dumpable from its first line on.

The agent gets an environment built from scratch (a few harmless variables, its HOME, the adapter's `env`)
and runs in the spec's sandbox (`openforge/rollout/sandbox.py`). The verifier runs after the agent's
sandbox is gone, in a fresh copy of the workspace with the task's files restored over it, with no token, no
network (bwrap) and no current directory on Python's path; this process posts the reward. Both run under the
spec's limits (`limits.py`): a limit that stops the agent ends the episode as `resource`. A verifier that
gives no reward runs once more on the pristine task (`pristine.py`), which says whose failure it is: the
agent's, or the task's. `result.json` is written whatever happens. Exit code 0 once result.json is written
(the outcome is in it), 2 for a spec that cannot be read.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from openforge.choices import Sandbox
from openforge.processes import stop_group
from openforge.protocols.client_keys import episode_client_key
from openforge.protocols.control import CallsAnswer, ControlClient, ControlError
from openforge.protocols.reward_keys import episode_reward_key
from openforge.rollout import pristine, sandbox, seccomp
from openforge.rollout.adapters import MODEL, render, render_adapter, tools_dir
from openforge.rollout.bounded import BoundedDirs, private_mounts, read_tail, special_files
from openforge.rollout.failures import (
    EpisodeStatus,
    answered,
    classify,
    engine_failure,
    model_output_errors,
    over_budget,
    policies,
)
from openforge.rollout.limits import EpisodeLimits, Fired, Step
from openforge.rollout.spec import CLIENT_TOKEN_ENV, RESULT_MARKER, REWARD_TOKEN_ENV, EpisodeResult, EpisodeSpec, Limits
from openforge.rollout.tasks import relative_path

DUMMY_KEY = "sk-openforge-dummy-0000"  # a proxy without client tokens takes any key
KEEP_ENV = ("PATH", "LANG", "LC_ALL", "TERM", "TMPDIR", "USER", "LOGNAME", "SHELL", "PYTHONPATH")
MAX_ABS_REWARD = 1e6  # the proxy refuses larger rewards
KILL_GRACE_S = 2.0
POST_TRIES = 3
STDERR_TAIL = 2000  # characters of the verifier's stderr kept in result.json
STDERR_READ = 64 * 1024  # bytes of the verifier's stderr read (the end of a traceback)
STDOUT_READ = 1024 * 1024  # bytes of the verifier's stdout read (its last line is the reward)
TRACEBACK = "Traceback (most recent call last):"


class EpisodeError(Exception):
    """Ends the episode early with `status` and `reason` (and the limit that fired, for `resource`)."""

    def __init__(self, status: str, reason: str, resource: str | None = None) -> None:
        super().__init__(reason)
        self.status, self.reason, self.resource = status, reason, resource


def hide_environment() -> None:
    """Make this process non-dumpable (Linux): its /proc/<pid>/environ and memory, which hold secrets, are
    then unreadable to other processes of the same user, agents included (not to root). exec resets it, so
    the agent and verifier are ordinary processes."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_DUMPABLE = 4
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


def _read_line(fd: int) -> str:
    """One line from `fd`, byte by byte: nothing past it leaves the pipe."""
    data = b""
    while (byte := os.read(fd, 1)) and byte != b"\n":
        data += byte
    return data.decode()


class Secrets:
    """The agent's key, this episode's own (`episode_client_key`: it opens only this episode's calls as
    `role`, the spec's), and this episode's reward key (module docstring: where each comes from)."""

    def __init__(self, episode: str, stdin_fd: int | None, env: Mapping[str, str], role: str | None = None) -> None:
        self._fd = stdin_fd
        if stdin_fd is not None:
            self.client_token = _read_line(stdin_fd) or None
            self._key: str | None = None
        else:
            client = env.get(CLIENT_TOKEN_ENV)
            self.client_token = episode_client_key(client, episode, role) if client else None
            token = env.get(REWARD_TOKEN_ENV)
            self._key = episode_reward_key(token, episode) if token else None

    def reward_key(self) -> str | None:
        """The key the reward is posted with; from stdin, read at the first call (after the agent exited)."""
        if self._fd is not None:
            self._key, self._fd = _read_line(self._fd) or None, None
        return self._key


def base_env(home: Path, parent: Mapping[str, str]) -> dict[str, str]:
    """What every child (setup, agent, verifier) starts from: no secrets, its own HOME, no proxy for 127.0.0.1."""
    env = {k: parent[k] for k in KEEP_ENV if k in parent}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_CACHE_HOME=str(home / ".cache"),
               NO_COLOR="1", CI="1", NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    return env


def verifier_env(home: Path, parent: Mapping[str, str]) -> dict[str, str]:
    """`base_env` where nothing the agent wrote in the workspace can stand in for a module or program: no
    current directory on Python's path (PYTHONSAFEPATH), only absolute PATH and PYTHONPATH entries; and
    `OPENFORGE_PYTHON`, the interpreter that has OpenForge (a task's `verify` may run a Python verifier with
    it wherever the episode runs)."""
    env = base_env(home, parent)
    for var in ("PATH", "PYTHONPATH"):
        if var in env:
            env[var] = os.pathsep.join(p for p in env[var].split(os.pathsep) if os.path.isabs(p))
    env["PYTHONSAFEPATH"] = "1"
    env["OPENFORGE_PYTHON"] = sys.executable
    return env


def placeholders(spec: EpisodeSpec, api_key: str, parent: Mapping[str, str]) -> dict[str, str]:
    base_url = spec.base_url
    if spec.sandbox == Sandbox.bwrap:
        base_url = sandbox.sandbox_url(spec.proxy_url) + spec.call_prefix
    return {"prompt": spec.task.prompt, "workdir": spec.workdir, "episode": spec.episode, "base_url": base_url,
            "api_key": api_key, "home": spec.home, "tools": tools_dir(), "python": sys.executable,
            "path": parent.get("PATH", os.defpath), "model": MODEL}


def write_under(root: Path, rel: str, content: str) -> None:
    """Write a task file at `root/rel`, replacing whatever is there: a link or a directory the agent put on
    the way is removed, never followed."""
    if why := relative_path(rel):
        raise EpisodeError(EpisodeStatus.CRASHED, f"file {rel!r} {why}")
    path = root
    for part in Path(rel).parts[:-1]:
        path = path / part
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            path.unlink()
        path.mkdir(exist_ok=True)
    path = path / Path(rel).name
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with open(fd, "w", encoding="utf-8") as f:
        f.write(content)


def run_group(argv: list[str], *, cwd: Path, env: dict[str, str], out: Path, name: str, timeout: float,
              popen: Mapping[str, Any] | None = None, step: Step | None = None) -> tuple[int | None, float]:
    """Run `argv` in its own process group, stdout/stderr to `out/name.stdout|.stderr`; (exit code or None
    on timeout, seconds). What the command left running in its group is killed when it exits. `popen`:
    more Popen arguments (the user to run as); `step`: the limits it runs under (none by default), which
    say afterwards whether one stopped it (`step.fired`)."""
    step = step or Step(Limits.none())
    started = time.monotonic()
    with step.stdio(out, name) as stdio:
        try:
            with step.spawning():
                proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                                        **stdio, **step.popen(popen))
        except OSError as e:
            step.done()
            raise EpisodeError(EpisodeStatus.CRASHED, f"cannot start {name} ({argv[0]}): {e.strerror or e}") from None
        step.started(proc)
        try:
            code: int | None = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:  # on timeout or interruption: the command; else: what it left behind in the background
            stop_group(proc, KILL_GRACE_S)
            step.done()
    return code, time.monotonic() - started


def parse_reward(stdout: str, exit_code: int, stderr: str = "") -> float:
    """The verifier's reward (docs/rollouts.md, The reward): its last non-empty stdout line as a finite
    number when it exited 0; when it printed nothing, 1.0 for exit 0 and 0.0 for exit 1 (a test runner's
    "checked: no"), unless stderr shows a crash. ValueError saying why for anything else: a crash is never
    a reward."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    if exit_code < 0:
        raise ValueError(f"killed by signal {-exit_code}")
    if lines and exit_code != 0:
        raise ValueError(f"exited {exit_code} after printing {lines[-1][:80]!r}: a crash is no reward")
    if not lines:
        if exit_code not in (0, 1):
            raise ValueError(f"exited {exit_code} (only 0 and 1 are verdicts; see verify.stderr)")
        if exit_code == 1 and (why := python_crash(stderr)):
            raise ValueError(f"crashed: {why}")
        return 1.0 if exit_code == 0 else 0.0
    last = lines[-1]
    try:
        reward = float(last)
    except ValueError:
        raise ValueError(f"last stdout line {last[:80]!r} is not a number") from None
    if not math.isfinite(reward) or abs(reward) > MAX_ABS_REWARD:
        raise ValueError(f"last stdout line {last[:80]!r} is not a finite number within +-{MAX_ABS_REWARD:g}")
    return reward


def python_crash(stderr: str) -> str | None:
    """The uncaught exception (not an AssertionError: that is a check saying no) or missing module that
    ended a Python verifier, from its stderr; None when stderr shows neither."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    if lines and "No module named " in lines[-1] and "Error" not in lines[-1]:
        return lines[-1].split(": ", 1)[-1][:200]
    if TRACEBACK not in stderr or not lines:
        return None
    last = lines[-1]
    return None if last.startswith("AssertionError") else last[:200]


def post_reward(spec: EpisodeSpec, reward: float, status: str, key: str | None) -> str | None:
    """POST the reward to the proxy with this episode's reward key; None once accepted, else why not."""
    metadata = {"toolchain": spec.adapter.name, "attempt": spec.attempt, "run_id": spec.run_id, "status": status}
    try:
        ControlClient(spec.proxy_url, key, tries=POST_TRIES).reward(spec.episode, reward, spec.task.id, metadata)
    except ControlError as e:
        if e.status is None:
            return f"reward post failed: {e.message}"
        return f"reward post refused: HTTP {e.status} {e.message}"
    return None


class Confinement:
    """How this episode's agent and verifier are started, per the spec's sandbox mode (sandbox.py)."""

    def __init__(self, spec: EpisodeSpec) -> None:
        self.spec, self.mode = spec, spec.sandbox
        if why := sandbox.unavailable(self.mode):
            raise EpisodeError(EpisodeStatus.CRASHED, why)

    def prepare(self, *dirs: Path) -> None:
        """Before a step: in `uid` mode the step's directories become the unprivileged user's, and the
        episode's directory (root's, its files 0600) one it may pass through to them."""
        if self.mode == Sandbox.uid:
            Path(self.spec.out_dir).chmod(0o711)
            for d in dirs:
                sandbox.give_to(d, sandbox.NOBODY)

    @contextlib.contextmanager
    def step(self, argv: list[str], *, cwd: Path, writable: list[Path], network: bool,
             readonly: Sequence[Path] = ()) -> Iterator[tuple[list[str], dict[str, Any]]]:
        """(argv, extra Popen arguments) of one sandboxed step; what it left running is gone afterwards."""
        if self.mode == Sandbox.none:
            yield argv, {}
            return
        if self.mode == Sandbox.uid:
            try:
                yield argv, sandbox.as_user(sandbox.NOBODY)
            finally:
                sandbox.kill_user(sandbox.NOBODY)
            return
        out = Path(self.spec.out_dir)
        hidden = [out.parent.parent, out, Path.home()]  # the run directory (<run>/episodes/<episode>), the episode's
        hidden += [Path(self.spec.pristine_dir)] if self.spec.pristine_dir else []  # the rollout's pristine verdicts
        named = [p for p in sandbox.named_files(argv) if not self._writable(p, writable)]
        readonly = [*sandbox.readonly_paths(), *named, *sandbox.install_roots(named), *readonly]
        with contextlib.ExitStack() as stack:
            relay = stack.enter_context(sandbox.ProxyRelay(self.spec.proxy_url)) if network else None
            fd = seccomp.program_fd(sandbox.seccomp_program())
            stack.callback(os.close, fd)
            yield sandbox.bwrap_command(argv, cwd=cwd, writable=writable, readonly=readonly, hidden=hidden,
                                        relay=relay, seccomp_fd=fd), {"pass_fds": (fd,)}

    @staticmethod
    def _writable(path: Path, writable: list[Path]) -> bool:
        return any(path.resolve().is_relative_to(w.resolve()) for w in writable)


def _setup_workspace(spec: EpisodeSpec, env: dict[str, str], out: Path, guard: EpisodeLimits) -> BoundedDirs | None:
    """The workspace and HOME (on one bounded file system where `guard` can mount it: returned), the task's
    files, its setup."""
    work, home = Path(spec.workdir), Path(spec.home)
    work.mkdir(parents=True, exist_ok=True)
    home.mkdir(parents=True, exist_ok=True)
    bounded = guard.bound([work, home])
    for rel, content in spec.task.files.items():
        write_under(work, rel, content)
    if spec.task.setup:
        code, _ = run_group(["bash", "-c", spec.task.setup], cwd=work, env=env, out=out, name="setup",
                            timeout=spec.task.timeout_s, step=guard.step(contained=False))
        if code != 0:
            why = "timed out" if code is None else f"exited {code}"
            raise EpisodeError(EpisodeStatus.CRASHED, f"setup {why} (see setup.stderr)")
    return bounded


def verify_in_copy(spec: EpisodeSpec, box: Confinement, parent: Mapping[str, str],
                   out: Path) -> tuple[int | None, float]:
    """(exit code or None on timeout, seconds) of the task's verifier, run in `work.verify/`: a fresh copy of
    the workspace with the task's own files (but the `editable` ones) written over it, and a fresh HOME."""
    code, seconds, _ = _verify(spec, box, parent, out, EpisodeLimits(Limits.none(), ""))
    return code, seconds


def _verify(spec: EpisodeSpec, box: Confinement, parent: Mapping[str, str], out: Path,
            guard: EpisodeLimits) -> tuple[int | None, float, Fired | None]:
    """`verify_in_copy` under the episode's limits (the copy and its HOME on a bounded file system of their
    own, or measured); also the limit that stopped the verifier."""
    work = Path(spec.workdir)
    copy, home = work.with_name(work.name + ".verify"), out / "verify-home"
    for d in (copy, home):
        shutil.rmtree(d, ignore_errors=True)
    bounded = guard.bound([copy, home])
    try:
        shutil.copytree(work, copy, symlinks=True, ignore=special_files, dirs_exist_ok=True)
    except (OSError, shutil.Error):
        if bounded is not None and bounded.full():  # sparse files the agent left, say, written out whole
            raise EpisodeError(EpisodeStatus.RESOURCE, f"resource: disk: the workspace does not fit in its "
                               f"verifier's copy (the disk limit {guard.enforced['disk']})", "disk") from None
        raise
    for rel, content in spec.task.files.items():
        if rel not in spec.task.editable:
            write_under(copy, rel, content)
    home.mkdir(exist_ok=True)
    box.prepare(copy, home)
    step = guard.step(bounded=bounded, watch=[copy, home])
    with box.step(["bash", "-c", spec.task.verify], cwd=copy, writable=[copy, home], network=False) as (argv, popen):
        code, seconds = run_group(argv, cwd=copy, env=verifier_env(home, parent), out=out, name="verify",
                                  timeout=spec.task.timeout_s, popen=popen, step=step)
    return code, seconds, step.fired


def verifier_stdout(path: Path) -> str:
    """The end of the verifier's stdout, where its reward is; ValueError when that end is blank but there was
    more before it (the reward cannot be told from "printed nothing" then)."""
    text = read_tail(path, STDOUT_READ)
    if not text.strip() and path.is_file() and path.stat().st_size > STDOUT_READ:
        raise ValueError(f"its last {STDOUT_READ} bytes of stdout are blank")
    return text


class VerifyFailed(EpisodeError):
    """The verifier gave no reward; `result` holds its exit code and stderr."""

    def __init__(self, result: EpisodeResult, reason: str) -> None:
        super().__init__(EpisodeStatus.VERIFY_FAILED, reason)
        self.result = result


def _verdict(spec: EpisodeSpec, box: Confinement, parent: Mapping[str, str], out: Path,
             result: EpisodeResult, guard: EpisodeLimits) -> EpisodeResult:
    """`result` with the verifier's reward, exit code and stderr tail; VerifyFailed when it gave none (a limit
    that stopped the verifier too), classed by the verifier's verdict on the pristine task (`_whose_crash`)."""
    code, seconds, fired = _verify(spec, box, parent, out, guard)
    stderr = read_tail(out / "verify.stderr", STDERR_READ)
    result = replace(result, verify_exit_code=code, verify_s=round(seconds, 3), verify_stderr=stderr[-STDERR_TAIL:])
    try:
        return replace(result, reward=_reward(spec, out, code, fired, stderr))
    except ValueError as e:
        raise VerifyFailed(*_whose_crash(spec, parent, guard, result, f"verifier: {e}")) from None


def _reward(spec: EpisodeSpec, out: Path, code: int | None, fired: Fired | None, stderr: str) -> float:
    """The reward of the verifier run that wrote `out/verify.*`; ValueError saying why it gave none."""
    if fired is not None:
        raise ValueError(f"resource: {fired.resource}: {fired.why}")
    if code is None:
        raise ValueError(f"timed out after {spec.task.timeout_s:g} s")
    return parse_reward(verifier_stdout(out / "verify.stdout"), code, stderr)


def _whose_crash(spec: EpisodeSpec, parent: Mapping[str, str], guard: EpisodeLimits, result: EpisodeResult,
                 reason: str) -> tuple[EpisodeResult, str]:
    """(result, reason) of a verifier that gave no reward on the agent's workspace, by its verdict on the
    pristine task (pristine.py, once per task and rollout): the agent's failure when that scores, else the
    verifier's (the task is broken)."""
    root = Path(spec.pristine_dir) if spec.pristine_dir else Path(spec.out_dir) / "pristine"
    found = pristine.verdict(root, spec.task, lambda where: _pristine_run(spec, parent, guard, where))
    if found.reward is not None:
        return (replace(result, failure_class="agent", pristine=pristine.SCORES),
                f"{reason}; the verifier crashed on the agent's workspace but scores the pristine task "
                f"({found.reward:g}): the agent's failure")
    return (replace(result, failure_class="verifier", pristine=pristine.FAILS),
            f"{reason}; the verifier fails on the pristine task too ({found.why}): the task is broken")


def _pristine_run(spec: EpisodeSpec, parent: Mapping[str, str], guard: EpisodeLimits, where: Path) -> pristine.Verdict:
    """The task's verifier on the task's own workspace (files and setup, no agent) in `where`, as the episode's
    verifier ran: the same sandbox and limits."""
    shutil.rmtree(where, ignore_errors=True)  # what an interrupted run left
    where.mkdir(parents=True)
    if spec.sandbox == Sandbox.uid:
        where.parent.chmod(0o711)  # the unprivileged user passes through to the copy it verifies
    alone = replace(spec, out_dir=str(where), workdir=str(where / "work"), home=str(where / "home"))
    try:
        box = Confinement(alone)
        _setup_workspace(alone, base_env(Path(alone.home), parent), where, guard)
        code, seconds, fired = _verify(alone, box, parent, where, guard)
        stderr = read_tail(where / "verify.stderr", STDERR_READ)
        return pristine.Verdict(_reward(alone, where, code, fired, stderr), seconds=round(seconds, 3))
    except ValueError as e:
        return pristine.Verdict(None, str(e))
    except EpisodeError as e:
        return pristine.Verdict(None, e.reason)


def proxy_calls(spec: EpisodeSpec, key: str | None) -> CallsAnswer | None:
    """The proxy's count of this episode's calls by answer status, with its last error answers
    (`GET /openforge/v1/episodes/<episode>/calls`, with the episode's reward key); None when it cannot say
    (a proxy without that endpoint, or none)."""
    try:
        calls = ControlClient(spec.proxy_url, key, tries=1).calls(spec.episode)
    except ControlError:
        return None
    return calls if isinstance(calls.get("statuses"), dict) else None


def _classified(result: EpisodeResult, calls: Mapping[str, Any] | None) -> EpisodeResult:
    """`result` with its failure class (failures.py), the reason saying what decided it."""
    cls = classify(result)
    notes = []
    if result.status == EpisodeStatus.TIMEOUT and calls is not None and not answered(calls):
        cls = "infra"
        notes.append("no call of it was answered (a slow or stuck engine, or an agent that never called it)")
    if calls is not None and (n := model_output_errors(calls)):
        notes.append(f"the engine could not parse the model's output ({n} calls): the model's mistake")
    return replace(result, failure_class=cls, reason="; ".join(r for r in (result.reason, *notes) if r))


def run_episode(spec: EpisodeSpec, secrets: Secrets, parent_env: Mapping[str, str] | None = None, *,
                mounts: bool = False) -> EpisodeResult:
    """Run the episode, post its reward (the verifier's, or 0.0 for a failure whose class's policy is zero),
    write result.json. `mounts`: this process has a mount namespace of its own (`bounded.private_mounts`), so
    the disk limit can be a bounded file system."""
    parent = os.environ if parent_env is None else parent_env
    out = Path(spec.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = EpisodeResult(episode=spec.episode, task_id=spec.task.id, toolchain=spec.adapter.name,
                           attempt=spec.attempt, status=EpisodeStatus.OK, reward=None)
    work, home = Path(spec.workdir), Path(spec.home)
    env = base_env(home, parent)
    calls: CallsAnswer | None = None
    guard = EpisodeLimits(spec.limits, f"openforge-episode-{os.getpid()}", mounts=mounts,
                          uid=sandbox.NOBODY if spec.sandbox == Sandbox.uid else None)
    try:
        box = Confinement(spec)
        bounded = _setup_workspace(spec, env, out, guard)
        result = replace(result, limits=dict(guard.enforced))
        values = placeholders(spec, secrets.client_token or DUMMY_KEY, parent)
        argv, adapter_env = render_adapter(spec.adapter, values, home)
        box.prepare(work, home)
        step = guard.step(bounded=bounded, watch=[work, home], stop_on_output=True)
        extra = {key: [Path(render(p, values)) for p in getattr(spec.adapter, key)] for key in ("readonly", "writable")}
        with box.step(argv, cwd=work, writable=[work, home, *extra["writable"]], network=True,
                      readonly=extra["readonly"]) as (argv, popen):
            code, agent_s = run_group(argv, cwd=work, env={**env, **adapter_env}, out=out, name="agent",
                                      timeout=spec.task.timeout_s, popen=popen, step=step)
        result = replace(result, exit_code=code, agent_s=round(agent_s, 3))
        calls = proxy_calls(spec, secrets.reward_key())
        if calls is not None:
            guard.budget_kept("refused_budget" in calls)
            result = replace(result, calls={str(k): int(v) for k, v in calls["statuses"].items()},
                             limits=dict(guard.enforced))
        if (fired := step.fired) is not None:
            raise EpisodeError(EpisodeStatus.RESOURCE, f"resource: {fired.resource}: the agent {fired.why}",
                               fired.resource)
        if calls is not None:
            if why := over_budget(calls, spec.limits.calls, spec.limits.tokens):
                raise EpisodeError(EpisodeStatus.RESOURCE, f"resource: calls: {why}", "calls")
            if why := engine_failure(calls):
                raise EpisodeError(EpisodeStatus.ENGINE_ERROR, why)
        if code is None:
            raise EpisodeError(EpisodeStatus.TIMEOUT, f"agent killed after {spec.task.timeout_s:g} s")
        if code != 0:
            confined = spec.sandbox == Sandbox.bwrap
            hint = sandbox.missing_path_hint(read_tail(out / "agent.stderr", 8192)) if confined else None
            raise EpisodeError(EpisodeStatus.AGENT_FAILED, f"agent exited {code} (see agent.stderr)"
                               + (f": {hint}" if hint else ""))
        result = _verdict(spec, box, parent, out, result, guard)
    except VerifyFailed as e:
        result = replace(e.result, status=e.status, reason=e.reason)
    except EpisodeError as e:
        result = replace(result, status=e.status, reason=e.reason, resource=e.resource)
    except KeyboardInterrupt:  # SIGINT, or SIGTERM (main): the runner was stopped; no reward for this one
        result = replace(result, status=EpisodeStatus.CRASHED, reason="interrupted", failure_class="infra")
        _closed(guard)
        write_result(out, result)
        return result
    except Exception as e:  # noqa: BLE001 - an episode always ends with a result saying why
        result = replace(result, status=EpisodeStatus.CRASHED, reason=f"{type(e).__name__}: {e}")
    if why := _closed(guard):
        result = replace(result, reason="; ".join(r for r in (result.reason, why) if r))
    result = _classified(result, calls)
    if result.failure_class is None or policies(spec.on_failure)[result.failure_class] == "zero":
        why = post_reward(spec, result.reward if result.reward is not None else 0.0, result.status,
                          secrets.reward_key())
        result = replace(result, reward_posted=why is None,
                         reason="; ".join(r for r in (result.reason, why) if r))
    write_result(out, result)
    return result


def _closed(guard: EpisodeLimits) -> str | None:
    """The cgroup removed and the bounded directories copied back; what went wrong, if anything."""
    try:
        return guard.close()
    except Exception as e:  # noqa: BLE001 - the episode's outcome stands; the result says what was not cleaned up
        return f"limits not cleaned up: {type(e).__name__}: {e}"


def write_result(out: Path, result: EpisodeResult) -> None:
    tmp = out / "result.json.tmp"
    tmp.write_text(json.dumps(asdict(result), indent=1))
    tmp.replace(out / "result.json")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    hide_environment()
    args = sys.argv[1:] if argv is None else argv
    from_stdin = "--secrets-stdin" in args
    args = [a for a in args if a != "--secrets-stdin"]
    if len(args) != 1:
        print("usage: python -m openforge.rollout.episode SPEC.json [--secrets-stdin]", file=sys.stderr)
        return 2
    try:
        spec = EpisodeSpec.read(Path(args[0]))
    except (OSError, ValueError, TypeError, KeyError) as e:
        print(f"error: cannot read the episode spec {args[0]}: {e}", file=sys.stderr)
        return 2
    # before any thread starts: a mount namespace of its own, for the bounded workspace
    mounts = bool(spec.limits.disk) and private_mounts() is None
    signal.signal(signal.SIGTERM, _interrupt)
    secrets = Secrets(spec.episode, sys.stdin.fileno() if from_stdin else None, os.environ, spec.role)
    for name in (CLIENT_TOKEN_ENV, REWARD_TOKEN_ENV):  # no child inherits them
        os.environ.pop(name, None)
    if spec.sandbox == Sandbox.uid:
        os.umask(0o077)  # what this process writes is root's alone; the agent gets only its own directories
    result = run_episode(spec, secrets, mounts=mounts)
    print(f"{result.episode}: {result.status} reward={result.reward} {result.reason}".rstrip())
    print(RESULT_MARKER + json.dumps(asdict(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
