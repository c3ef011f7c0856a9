"""One cgroup per episode (cgroup v2, or the v1 memory, pids and cpu hierarchies): made with the episode's
memory, pids and cpus limits, the agent's and the verifier's processes born in it, its own counters read for
what fired (v2 `memory.events`, v1 `memory.oom_control`, `pids.events`), emptied and removed after the
episode. Standard library only: the episode entrypoint imports it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from openforge.rollout.spec import Limits

CPU_PERIOD_US = 100_000
PROCS_GONE_S = 5.0


# -- cgroups ----------------------------------------------------------------------------------------------------
CONTROLLER = {"memory": "memory", "pids": "pids", "cpus": "cpu"}  # limit -> cgroup controller


@dataclass(frozen=True)
class Hierarchy:
    """A mounted cgroup hierarchy: its version, where it is mounted, and this process's cgroup in it."""

    version: int
    mount: Path
    own: Path


def _unescape(path: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def hierarchies(mountinfo: str, cgroup: str, controllers_of: Callable[[Path], set[str]]) -> dict[str, Hierarchy]:
    """Controller -> the hierarchy holding it, from /proc/self/mountinfo and /proc/self/cgroup (a controller
    bound to a v1 hierarchy is missing from v2's); `controllers_of(mount)` lists a v2 mount's controllers."""
    own_v1: dict[str, str] = {}
    own_v2 = None
    for line in cgroup.splitlines():
        hid, _, rest = line.partition(":")
        names, _, path = rest.partition(":")
        if hid == "0" and not names:
            own_v2 = path
        for name in names.split(","):
            own_v1[name] = path
    found: dict[str, Hierarchy] = {}
    for line in mountinfo.splitlines():
        parts = line.split()
        if "-" not in parts:
            continue
        sep = parts.index("-")
        root, mount, fstype = _unescape(parts[3]), Path(_unescape(parts[4])), parts[sep + 1]
        options = set(parts[sep + 3].split(",")) if len(parts) > sep + 3 else set()
        if fstype == "cgroup":  # a hierarchy mounted twice: its first mount (/sys/fs/cgroup/...)
            for name in (set(CONTROLLER.values()) & options & own_v1.keys()) - found.keys():
                found[name] = Hierarchy(1, mount, _own(mount, root, own_v1[name]))
        elif fstype == "cgroup2" and own_v2 is not None:
            for name in (set(CONTROLLER.values()) & controllers_of(mount)) - found.keys():
                found[name] = Hierarchy(2, mount, _own(mount, root, own_v2))
    return found


def _own(mount: Path, root: str, path: str) -> Path:
    """This process's cgroup directory under `mount` (whose root is `root` in the hierarchy)."""
    rel = os.path.relpath(path, root) if path == root or path.startswith(root.rstrip("/") + "/") else path
    return mount / rel.lstrip("/") if rel != "." else mount


def _controllers(mount: Path) -> set[str]:
    try:
        return set((mount / "cgroup.controllers").read_text().split())
    except OSError:
        return set()


def find_hierarchies() -> dict[str, Hierarchy]:
    try:
        return hierarchies(Path("/proc/self/mountinfo").read_text(), Path("/proc/self/cgroup").read_text(),
                           _controllers)
    except OSError:
        return {}


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _counter(path: Path, key: str) -> int | None:
    """`key N` in a flat-keyed cgroup file (memory.events, pids.events, memory.oom_control)."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return None


class Cgroup:
    """One episode's cgroup: a directory in each hierarchy that holds one of its controllers (v2: one)."""

    def __init__(self, dirs: dict[str, tuple[Hierarchy, Path]]) -> None:
        self.dirs = dirs  # controller -> (hierarchy, directory)

    @classmethod
    def create(cls, limits: Limits, name: str, found: Mapping[str, Hierarchy]) -> Cgroup:
        """A cgroup named `name` with the limits set of memory, pids and cpus, in every hierarchy that has
        their controllers and lets this process write there (the others are left to rlimits)."""
        wanted = {CONTROLLER[k]: v for k in CONTROLLER if (v := getattr(limits, k)) and CONTROLLER[k] in found}
        dirs: dict[str, tuple[Hierarchy, Path]] = {}
        by_mount: dict[Path, list[str]] = {}
        for controller in wanted:
            by_mount.setdefault(found[controller].mount, []).append(controller)
        for controllers in by_mount.values():
            h = found[controllers[0]]
            try:
                d = _make_v2(h, name, controllers) if h.version == 2 else _make_v1(h, name)
            except OSError:
                continue
            try:
                for controller in controllers:
                    _set_limit(h.version, d, controller, wanted[controller])
            except OSError:
                with contextlib.suppress(OSError):
                    d.rmdir()
                continue
            dirs.update({c: (h, d) for c in controllers})
        return cls(dirs)

    def holds(self, limit: str) -> str | None:
        """`cgroup v1` / `cgroup v2` when the limit is enforced by this cgroup, else None."""
        found = self.dirs.get(CONTROLLER[limit])
        return f"cgroup v{found[0].version}" if found else None

    def _unique(self) -> list[tuple[Hierarchy, Path]]:
        return list({d: (h, d) for h, d in self.dirs.values()}.values())

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """This process in the cgroup meanwhile: what it starts now is born in it, and stays."""
        pid = str(os.getpid())
        for _, d in self._unique():
            _write(d / "cgroup.procs", pid)
        try:
            yield
        finally:
            for h, _ in self._unique():
                with contextlib.suppress(OSError):
                    _write(h.own / "cgroup.procs", pid)

    def counters(self) -> dict[str, int]:
        """OOM kills (`memory`; v1 kernels before 4.13: times the limit was hit) and refused forks (`pids`)."""
        out: dict[str, int] = {}
        if "memory" in self.dirs:
            h, d = self.dirs["memory"]
            n = _counter(d / "memory.events", "oom_kill") if h.version == 2 else \
                _counter(d / "memory.oom_control", "oom_kill")
            if n is None and h.version == 1:
                with contextlib.suppress(OSError, ValueError):
                    n = int((d / "memory.failcnt").read_text())
            out["memory"] = n or 0
        if "pids" in self.dirs:
            out["pids"] = _counter(self.dirs["pids"][1] / "pids.events", "max") or 0
        return out

    def pids(self) -> set[int]:
        found: set[int] = set()
        for _, d in self._unique():
            with contextlib.suppress(OSError, ValueError):
                found |= {int(x) for x in (d / "cgroup.procs").read_text().split()}
        return found

    def kill(self) -> None:
        """SIGKILL everything in the cgroup (v2 `cgroup.kill`, else each process until none is left)."""
        for h, d in self._unique():
            if h.version == 2 and (d / "cgroup.kill").exists():
                with contextlib.suppress(OSError):
                    _write(d / "cgroup.kill", "1")
        deadline = time.monotonic() + PROCS_GONE_S
        while (left := self.pids() - {os.getpid()}) and time.monotonic() < deadline:
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)

    def remove(self) -> None:
        """Kill what is left, then remove the cgroup's directories."""
        self.kill()
        for _, d in self._unique():
            for _ in range(50):  # a killed process leaves its cgroup a moment after it died
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)
        self.dirs = {}


def remove_stale(found: Mapping[str, Hierarchy], prefix: str) -> None:
    """Remove the cgroups `<prefix><pid>` of episode processes that are gone: one killed by SIGKILL could not
    remove its own. A cgroup of a process still running (or a pid reused) is left, and so is one that still
    holds processes (rmdir refuses it)."""
    parents = {p for h in found.values() for p in (h.own, h.mount / "openforge")}
    for parent in parents:
        for d in parent.glob(prefix + "*"):
            try:
                os.kill(int(d.name.removeprefix(prefix)), 0)
            except ProcessLookupError:
                with contextlib.suppress(OSError):
                    d.rmdir()
            except (ValueError, PermissionError, OverflowError):
                pass


def _make_v1(h: Hierarchy, name: str) -> Path:
    d = h.own / name
    d.mkdir()
    return d


def _enable(d: Path, controllers: Sequence[str]) -> None:
    present = set((d / "cgroup.subtree_control").read_text().split())
    if missing := [c for c in controllers if c not in present]:
        _write(d / "cgroup.subtree_control", " ".join(f"+{c}" for c in missing))


def _make_v2(h: Hierarchy, name: str, controllers: Sequence[str]) -> Path:
    """Under this process's own cgroup when its controllers can be enabled there (v2 refuses that while it
    holds processes, but for the root), else under `openforge/` at the hierarchy's root."""
    for parent in dict.fromkeys((h.own, h.mount / "openforge")):
        try:
            if parent != h.own:
                parent.mkdir(exist_ok=True)
                _enable(h.mount, controllers)
            _enable(parent, controllers)
            d = parent / name
            d.mkdir()
            return d
        except OSError:
            continue
    raise OSError(errno.EACCES, "no cgroup v2 parent with the controllers enabled", str(h.mount))


def _set_limit(version: int, d: Path, controller: str, value: float) -> None:
    if controller == "memory":
        _write(d / ("memory.max" if version == 2 else "memory.limit_in_bytes"), str(int(value)))
        for extra, text in (("memory.swap.max", "0"), ("memory.oom.group", "1")) if version == 2 else \
                (("memory.memsw.limit_in_bytes", str(int(value))),):
            with contextlib.suppress(OSError):  # no swap accounting, or an older kernel
                _write(d / extra, text)
    elif controller == "pids":
        _write(d / "pids.max", str(int(value)))
    else:
        quota = max(1000, int(value * CPU_PERIOD_US))
        if version == 2:
            _write(d / "cpu.max", f"{quota} {CPU_PERIOD_US}")
        else:
            _write(d / "cpu.cfs_period_us", str(CPU_PERIOD_US))
            _write(d / "cpu.cfs_quota_us", str(quota))
