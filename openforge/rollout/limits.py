"""Per-episode limits (docs/rollouts.md, Limits): reading them, enforcing each with what this machine has, and
saying which one stopped the agent. Standard library only: the episode entrypoint imports it.

- memory, pids, cpus: the episode's cgroup (`cgroups.py`); without one (not root, none writable): RLIMIT_AS
  and RLIMIT_NPROC, poor substitutes (RLIMIT_AS bounds each process's address space, not the memory all of
  them use, and breaks runtimes that reserve large ranges; RLIMIT_NPROC counts every process of the agent's
  uid on the machine, and root ignores it); cpus then go unenforced.
- disk: the workspace and HOME on one size-bounded tmpfs that the episode process mounts (`bounded.py`: as
  root, in a mount namespace of its own, so it outlives the agent's sandbox), copied back into the episode
  directory at the end; the verifier's copy on another. Without: RLIMIT_FSIZE (no file past the limit) and a
  size check of the directories while the step runs and after it.
- output: stdout and stderr read through pipes that keep each stream's head and tail (`bounded.py`); an
  agent past the limit is stopped.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import signal
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from openforge.rollout.bounded import BoundedDirs, Output, SizeWatch
from openforge.rollout.cgroups import CONTROLLER, Cgroup, find_hierarchies, remove_stale
from openforge.rollout.sizes import format_size, parse_size
from openforge.rollout.spec import Limits

SIZES = ("memory", "disk", "output")
EXAMPLES = {"memory": "1GiB", "pids": "256", "disk": "1GiB", "output": "8MiB", "cpus": "1", "calls": "200",
            "tokens": "200000"}
# The smallest limit that still runs an episode (a sandbox, a Python, its threads), other than 0 (none).
MINIMUM: dict[str, float] = {"memory": 32 * 2**20, "pids": 16, "disk": 2**20, "output": 4096, "cpus": 0.01,
                             "calls": 1, "tokens": 1}
MAXIMUM: dict[str, float] = {"memory": 2**62, "pids": 2**22, "disk": 2**62, "output": 2**40, "cpus": 1024,
                             "calls": 2**31, "tokens": 2**62}


# -- reading limits ---------------------------------------------------------------------------------------------
def _value(name: str, value: Any) -> float:
    if name in SIZES:
        return parse_size(value)
    if isinstance(value, bool):
        raise ValueError(value)
    number = float(value) if name == "cpus" else int(str(value).strip()) if isinstance(value, str) else value
    if not isinstance(number, (int, float)) or not math.isfinite(number) or (name != "cpus" and number != int(number)):
        raise ValueError(value)
    return number


def parse_limits(values: Mapping[str, Any], base: Limits | None = None,
                 label: Callable[[str], str] = lambda name: name) -> Limits:
    """`base` (default: `Limits()`) with `values` on top, strings or numbers as a flag or rl.toml gives them;
    ValueError in one line naming the setting (`label(name)`) with a valid example."""
    known = [f.name for f in fields(Limits)]
    out: dict[str, Any] = {}
    for name, value in values.items():
        if name not in known:
            raise ValueError(f"unknown setting {label(name)}; known: {', '.join(known)}")
        kind = "a size" if name in SIZES else "a number" if name == "cpus" else "a whole number"
        try:
            number = _value(name, value)
        except (ValueError, TypeError):
            raise ValueError(f"{label(name)}: {value!r} is not {kind} (e.g. {EXAMPLES[name]}; 0 = no limit)") from None
        if number and not MINIMUM[name] <= number <= MAXIMUM[name]:
            low, high, given = (_text(name, x) for x in (MINIMUM[name], MAXIMUM[name], number))
            raise ValueError(f"{label(name)}: {given} is outside {low}..{high} (e.g. {EXAMPLES[name]}; 0 = no limit)")
        out[name] = float(number) if name == "cpus" else int(number)
    return replace(base if base is not None else Limits(), **out)


def _text(name: str, value: float) -> str:
    return format_size(int(value)) if name in SIZES else str(int(value)) if value == int(value) else f"{value:g}"


def shown(limits: Limits) -> dict[str, str]:
    """Each limit set, as people write it: {"memory": "4GiB", "pids": "512", ...}."""
    return {f.name: _text(f.name, v) for f in fields(Limits) if (v := getattr(limits, f.name))}


def settings(limits: Limits) -> dict[str, str | int | float]:
    """Every limit as rl.toml writes it: sizes as text ("4GiB"), the rest as numbers, 0 for none."""
    values: dict[str, str | int | float] = {f.name: getattr(limits, f.name) for f in fields(Limits)}
    return {k: format_size(int(v)) if k in SIZES and v else v for k, v in values.items()}


# -- one episode ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fired:
    """A limit that stopped a step: which (memory, pids, disk, output) and what happened."""

    resource: str
    why: str


def _rlimit(kind: int, value: int) -> tuple[int, int]:
    _, hard = resource.getrlimit(kind)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    return kind, value


def _apply(rlimits: Sequence[tuple[int, int]], then: Callable[[], None] | None) -> Callable[[], None]:
    def preexec() -> None:
        if then is not None:
            then()
        for kind, value in rlimits:
            resource.setrlimit(kind, (value, value))

    return preexec


class Step:
    """How one command of the episode (setup, the agent, the verifier) runs under the limits: its output kept
    to the output limit and, when contained, born in the episode's cgroup under its rlimits, its directories
    measured where no bounded file system holds them; `fired` says which limit stopped it, once `done`."""

    def __init__(self, limits: Limits, *, cgroup: Cgroup | None = None, rlimits: Sequence[tuple[int, int]] = (),
                 bounded: BoundedDirs | None = None, watch: Sequence[Path] = (), stop_on_output: bool = False) -> None:
        self.limits, self.cgroup, self.rlimits = limits, cgroup, list(rlimits)
        self.bounded, self.watch, self.stop_on_output = bounded, list(watch), stop_on_output
        self.fired: Fired | None = None
        self._output: Output | None = None
        self._watch: SizeWatch | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._before: dict[str, int] = {}

    @contextlib.contextmanager
    def stdio(self, out: Path, name: str) -> Iterator[dict[str, Any]]:
        """Popen's stdout and stderr: the output limit's pipes, or plain files without one."""
        if self.limits.output:
            self._output = Output(out, name, self.limits.output, self._stop if self.stop_on_output else None)
            yield self._output.popen()
            return
        with open(out / f"{name}.stdout", "wb") as stdout, open(out / f"{name}.stderr", "wb") as stderr:
            yield {"stdout": stdout, "stderr": stderr}

    def popen(self, extra: Mapping[str, Any] | None) -> dict[str, Any]:
        """Popen's other arguments: `extra` (the user to run as), with the rlimits set in the child last."""
        args = dict(extra or {})
        if self.rlimits:
            args["preexec_fn"] = _apply(self.rlimits, args.get("preexec_fn"))
        return args

    @contextlib.contextmanager
    def spawning(self) -> Iterator[None]:
        if self.cgroup is None:
            yield
            return
        self._before = self.cgroup.counters()
        with self.cgroup.entered():
            yield

    def started(self, proc: subprocess.Popen[bytes]) -> None:
        self._proc = proc
        if self._output is not None:
            self._output.start()
        if self.watch and self.limits.disk:
            self._watch = SizeWatch(self.watch, self.limits.disk, self._stop)

    def _stop(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)
        if self.cgroup is not None:
            self.cgroup.kill()

    def done(self) -> Fired | None:
        """After the command and its group were stopped: what is left in the cgroup killed, the output
        written, and the limit that stopped it, if one did."""
        if self.cgroup is not None:
            self.cgroup.kill()
        if self._output is not None:
            self._output.close()
        over = self._watch.finish() if self._watch is not None else None
        self.fired = self._judge(over)
        return self.fired

    def _judge(self, over: int | None) -> Fired | None:
        lim = self.limits
        if self.cgroup is not None:
            after = self.cgroup.counters()
            if n := after.get("memory", 0) - self._before.get("memory", 0):
                return Fired("memory", f"went past the memory limit of {format_size(lim.memory)}: the kernel's OOM "
                                       f"killer killed {n} of its processes ({self.cgroup.holds('memory')})")
            if n := after.get("pids", 0) - self._before.get("pids", 0):
                return Fired("pids", f"reached the limit of {lim.pids} processes and threads: {n} more were "
                                     f"refused ({self.cgroup.holds('pids')})")
        if self._output is not None and self._output.over and self.stop_on_output:
            return Fired("output", f"printed more than the output limit of {format_size(lim.output)} and was "
                                   "stopped (head and tail kept)")
        if over is not None:
            return Fired("disk", f"put {format_size(over)} in its directories, the disk limit is "
                                 f"{format_size(lim.disk)}")
        if self.bounded is not None and self.bounded.full():
            return Fired("disk", f"filled its {format_size(lim.disk)} file system (tmpfs)")
        return None


class EpisodeLimits:
    """The limits of one episode as this machine enforces them: the cgroup `name` (`<stem>-<pid>`, made at once
    after the cgroups of the stem's dead pids are removed, removed by `close`), the rlimits that stand in for
    what it lacks, the bounded file systems; `enforced` says what holds each."""

    def __init__(self, limits: Limits, name: str, *, mounts: bool = False, uid: int | None = None) -> None:
        self.limits, self.mounts = limits, mounts
        self.uid = os.geteuid() if uid is None else uid
        self.bounded: list[BoundedDirs] = []
        self.enforced: dict[str, str] = {}
        self.cgroup: Cgroup | None = None
        if any(getattr(limits, k) for k in CONTROLLER) and os.geteuid() == 0:
            found = find_hierarchies()
            remove_stale(found, name.rpartition("-")[0] + "-")  # name: <stem>-<pid>
            self.cgroup = Cgroup.create(limits, name, found)
        self.rlimits: list[tuple[int, int]] = []
        value = shown(limits)
        for limit in ("memory", "pids", "cpus"):
            if not getattr(limits, limit):
                continue
            if how := (self.cgroup.holds(limit) if self.cgroup else None):
                self.enforced[limit] = f"{value[limit]} by {how}"
            elif limit == "memory":
                self.rlimits.append(_rlimit(resource.RLIMIT_AS, limits.memory))
                self.enforced[limit] = f"{value[limit]} by RLIMIT_AS (each process's address space; no cgroup)"
            elif limit == "pids" and self.uid != 0:
                self.rlimits.append(_rlimit(resource.RLIMIT_NPROC, limits.pids))
                self.enforced[limit] = f"{value[limit]} by RLIMIT_NPROC (every process of uid {self.uid}; no cgroup)"
            else:  # cpus, or pids of root (whom RLIMIT_NPROC does not hold)
                self.enforced[limit] = f"{value[limit]} not enforced (no cgroup)"
        if limits.disk:
            self.enforced["disk"] = f"{value['disk']} by " + ("tmpfs" if mounts else "RLIMIT_FSIZE and size checks")
        if limits.output:
            self.enforced["output"] = f"{value['output']} by pipes (head and tail kept)"
        self.budget_kept(None)

    def budget_kept(self, by_proxy: bool | None) -> None:
        """Say how the call and token budget held: the proxy refused calls past it (its calls answer counts
        refusals), or this process counted them after the agent; None: not known yet."""
        how = {None: "by the proxy", True: "by the proxy's budget",
               False: "counted after the agent (no budget at the proxy)"}[by_proxy]
        for limit in ("calls", "tokens"):
            if getattr(self.limits, limit):
                self.enforced[limit] = f"{shown(self.limits)[limit]} {how}"

    def bound(self, dirs: Sequence[Path]) -> BoundedDirs | None:
        """`dirs` on one tmpfs of the disk limit, where this process could take its own mount namespace; else
        None (their size is then checked instead)."""
        if not (self.limits.disk and self.mounts):
            return None
        try:
            bounded = BoundedDirs(dirs, self.limits.disk)
        except OSError as e:
            self.enforced["disk"] = f"{shown(self.limits)['disk']} by RLIMIT_FSIZE and size checks (tmpfs: {e})"
            return None
        self.bounded.append(bounded)
        return bounded

    def step(self, *, contained: bool = True, bounded: BoundedDirs | None = None, watch: Sequence[Path] = (),
             stop_on_output: bool = False) -> Step:
        """A step: `contained` ones (the agent, the verifier) in the cgroup and under the rlimits, with `watch`
        measured unless `bounded` holds them; `stop_on_output`: stopped past the output limit (the agent)."""
        if not contained:
            return Step(self.limits)
        rlimits = list(self.rlimits)
        if self.limits.disk and bounded is None:
            rlimits.append(_rlimit(resource.RLIMIT_FSIZE, self.limits.disk))
        return Step(self.limits, cgroup=self.cgroup, rlimits=rlimits, bounded=bounded,
                    watch=[] if bounded is not None else list(watch), stop_on_output=stop_on_output)

    def close(self) -> str | None:
        """Kill what is left in the cgroup and remove it; copy the bounded directories back; None, or what could
        not be copied back."""
        if self.cgroup is not None:
            self.cgroup.remove()
        whys = [why for b in self.bounded if (why := b.persist())]
        self.bounded = []
        return "; ".join(whys) or None
