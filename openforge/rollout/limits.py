"""Per-episode limits (docs/rollouts.md, Limits): reading them, enforcing each with what this machine has, and
saying which one stopped the agent. Standard library only: the episode entrypoint imports it.

- memory, pids, cpus: one cgroup per episode (cgroup v2, or the v1 memory, pids and cpu hierarchies), in
  which the agent's and the verifier's processes are born (the episode process enters it only while it
  starts them) and which is emptied and removed after the episode. An OOM kill is read from the cgroup's own
  counter (v2 `memory.events`, v1 `memory.oom_control`), a refused fork from `pids.events`: never guessed
  from an exit status. Without a cgroup (not root, none writable): RLIMIT_AS and RLIMIT_NPROC, poor
  substitutes (RLIMIT_AS bounds each process's address space, not the memory all of them use, and breaks
  runtimes that reserve large ranges; RLIMIT_NPROC counts every process of the agent's uid on the machine,
  and root ignores it); cpus then go unenforced.
- disk: the workspace and HOME on one size-bounded tmpfs that the episode process mounts (as root, in a
  mount namespace of its own, so it outlives the agent's sandbox and goes with the episode process), copied
  back into the episode directory at the end; the verifier's copy on another. Without: RLIMIT_FSIZE (no
  file past the limit) and a size check of the directories while the step runs and after it.
- output: stdout and stderr read through pipes, each stream's first and last quarter of the limit kept with
  a line saying what was cut; an agent past the limit is stopped.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import math
import os
import re
import resource
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import IO, Any

from openforge.rollout.spec import Limits

UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
         "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30,
         "ti": 2**40, "tib": 2**40}
SIZE = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)", re.IGNORECASE)
SIZES = ("memory", "disk", "output")
EXAMPLES = {"memory": "1GiB", "pids": "256", "disk": "1GiB", "output": "8MiB", "cpus": "1", "calls": "200",
            "tokens": "200000"}
# The smallest limit that still runs an episode (a sandbox, a Python, its threads), other than 0 (none).
MINIMUM: dict[str, float] = {"memory": 32 * 2**20, "pids": 16, "disk": 2**20, "output": 4096, "cpus": 0.01,
                             "calls": 1, "tokens": 1}
MAXIMUM: dict[str, float] = {"memory": 2**62, "pids": 2**22, "disk": 2**62, "output": 2**40, "cpus": 1024,
                             "calls": 2**31, "tokens": 2**62}
CPU_PERIOD_US = 100_000
FULL_SLACK = 64 * 1024  # a bounded file system with less than this free after the agent was full
PROCS_GONE_S = 5.0


# -- reading limits ---------------------------------------------------------------------------------------------
def parse_size(text: str | int | float) -> int:
    """Bytes from `1GiB`, `512MiB`, `64M` (1000-based: k, M, G, T; 1024-based: Ki, Mi, Gi, Ti, with or without
    a B) or a number of bytes; ValueError otherwise."""
    if isinstance(text, bool):
        raise ValueError(text)
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        match = SIZE.fullmatch(text.strip())
        if not match or match.group(2).lower() not in UNITS:
            raise ValueError(text)
        value, unit = float(match.group(1)), match.group(2).lower()
    if not math.isfinite(value) or value < 0:
        raise ValueError(text)
    return int(value * UNITS[unit])


def format_size(n: int) -> str:
    """`n` bytes in the largest binary unit that keeps at most one decimal: 1GiB, 1.5GiB, 256MiB, 100B."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size and (n * 10) % size == 0:
            return f"{n / size:g}{unit}"
    return f"{n}B"


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


# -- bounded reads ----------------------------------------------------------------------------------------------
def read_tail(path: Path, limit: int) -> str:
    """The last `limit` bytes of a file as text ('' when it cannot be read): what any output is read by."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - limit))
            return f.read(limit).decode(errors="replace")
    except OSError:
        return ""


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


# -- a size-bounded workspace -----------------------------------------------------------------------------------
CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18
MNT_DETACH = 2


def _libc_call(name: str, *args: Any) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{name}: {os.strerror(e)}")


def private_mounts() -> str | None:
    """Give this process a mount namespace of its own (root only; before any thread starts), so the bounded
    file systems it mounts are its own and go with it; None once done, else why not."""
    if os.geteuid() != 0:
        return "not root"
    try:
        _libc_call("unshare", CLONE_NEWNS)
        _libc_call("mount", None, b"/", None, ctypes.c_ulong(MS_REC | MS_PRIVATE), None)
    except (OSError, AttributeError) as e:
        return str(e)
    return None


def _mount(source: str, target: Path, fstype: str | None, flags: int, data: str | None = None) -> None:
    _libc_call("mount", source.encode(), str(target).encode(), fstype.encode() if fstype else None,
               ctypes.c_ulong(flags), data.encode() if data else None)


def _umount(target: Path) -> None:
    with contextlib.suppress(OSError):
        _libc_call("umount2", str(target).encode(), MNT_DETACH)


class BoundedDirs:
    """Directories sharing one tmpfs of `size` bytes, mounted over them by this process (in its own mount
    namespace: see `private_mounts`); `persist` copies what they hold back into the directories beneath."""

    def __init__(self, dirs: Sequence[Path], size: int) -> None:
        self.dirs, self.size = list(dirs), size
        self.below: list[int] = []  # the directories under the mounts, for `persist`
        staging = Path(tempfile.mkdtemp(prefix="openforge-disk-"))
        bound: list[Path] = []
        try:
            _mount("tmpfs", staging, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=0755")
            try:
                for k, d in enumerate(self.dirs):
                    d.mkdir(parents=True, exist_ok=True)
                    self.below.append(os.open(d, os.O_RDONLY | os.O_DIRECTORY))
                    (staging / str(k)).mkdir(mode=0o755)
                    _mount(str(staging / str(k)), d, None, MS_BIND)
                    bound.append(d)
            finally:
                _umount(staging)  # the binds keep the tmpfs
        except OSError:
            for d in bound:
                _umount(d)
            self.close()
            raise
        finally:
            staging.rmdir()

    def full(self) -> bool:
        st = os.statvfs(self.dirs[0])
        return st.f_bavail * st.f_frsize < FULL_SLACK

    def persist(self) -> str | None:
        """Copy each directory's files into the one beneath its mount (at most `size` bytes in all: a sparse
        file is not blown up on disk); None, else what was left out."""
        budget = [self.size]

        def copy(src: str, dst: str) -> None:
            n = os.lstat(src).st_size
            if n > budget[0]:
                raise OSError(errno.EFBIG, f"past the workspace's {format_size(self.size)}", src)
            budget[0] -= n
            shutil.copy2(src, dst)

        why = None
        for d, fd in zip(self.dirs, self.below):
            try:
                shutil.copytree(d, f"/proc/self/fd/{fd}", symlinks=True, dirs_exist_ok=True, copy_function=copy,
                                ignore=special_files)
            except (OSError, shutil.Error) as e:
                why = f"{d.name} copied back in part: {str(e)[:200]}"
        self.close()
        return why

    def close(self) -> None:
        for fd in self.below:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.below = []


def special_files(directory: str, names: list[str]) -> set[str]:
    """What a copy of a workspace leaves out: pipes, sockets, devices (reading a pipe the agent left would
    block)."""
    return {n for n in names if not (os.path.islink(p := os.path.join(directory, n)) or os.path.isfile(p)
                                     or os.path.isdir(p))}


def tree_size(dirs: Sequence[Path]) -> int:
    """Bytes the files under `dirs` claim (their sizes: a sparse file counts whole, as a copy writes it)."""
    total, stack = 0, [str(d) for d in dirs]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    with contextlib.suppress(OSError):
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                        else:
                            total += entry.stat(follow_symlinks=False).st_size
        except OSError:
            continue
    return total


class SizeWatch:
    """Where no bounded file system could be mounted: `dirs` measured while a step runs (more often the
    faster a walk is), `on_over` called once they hold `limit` bytes."""

    def __init__(self, dirs: Sequence[Path], limit: int, on_over: Callable[[], None]) -> None:
        self.dirs, self.limit, self.on_over = list(dirs), limit, on_over
        self.over: int | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            if (size := tree_size(self.dirs)) >= self.limit:
                self.over = size
                self.on_over()
                return
            self.stop.wait(max(0.25, 10 * (time.monotonic() - started)))

    def finish(self) -> int | None:
        """Bytes the directories held when past the limit (during the step or now), else None."""
        self.stop.set()
        self.thread.join()
        if self.over is None and (size := tree_size(self.dirs)) >= self.limit:
            self.over = size
        return self.over


# -- bounded output ---------------------------------------------------------------------------------------------
class Output:
    """A step's stdout and stderr read through pipes into `<name>.stdout` / `.stderr`, each kept to its first and
    last quarter of `limit` with a line saying what was cut between them; `on_over` is called once both
    together pass `limit`."""

    def __init__(self, out: Path, name: str, limit: int, on_over: Callable[[], None] | None) -> None:
        self.limit, self.on_over, self.keep = limit, on_over, max(1, limit // 4)
        self.total, self.over = 0, False
        self.files: dict[int, IO[bytes]] = {}
        self.tails: dict[int, bytearray] = {}
        self.seen: dict[int, int] = {}
        self.child_ends: list[int] = []
        self.sel = selectors.DefaultSelector()
        for stream in ("stdout", "stderr"):
            r, w = os.pipe()
            self.child_ends.append(w)
            self.files[r] = open(out / f"{name}.{stream}", "wb")
            self.tails[r], self.seen[r] = bytearray(), 0
            self.sel.register(r, selectors.EVENT_READ)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def popen(self) -> dict[str, int]:
        return {"stdout": self.child_ends[0], "stderr": self.child_ends[1]}

    def start(self) -> None:
        """Once the child holds the write ends: this process lets go of them and reads."""
        for w in self.child_ends:
            os.close(w)
        self.child_ends = []
        self.thread.start()

    def _run(self) -> None:
        while self.sel.get_map() and not self.stop.is_set():
            for key, _ in self.sel.select(0.1):
                fd = int(key.fd)
                data = os.read(fd, 65536)
                if not data:
                    self.sel.unregister(fd)
                    continue
                self._take(fd, data)

    def _take(self, fd: int, data: bytes) -> None:
        head = max(0, self.keep - self.seen[fd])
        if head:
            self.files[fd].write(data[:head])
        tail = self.tails[fd]
        tail += data[head:]
        del tail[:max(0, len(tail) - self.keep)]
        self.seen[fd] += len(data)
        self.total += len(data)
        if self.total > self.limit and not self.over:
            self.over = True
            if self.on_over is not None:
                self.on_over()

    def close(self, grace: float = 2.0) -> None:
        """Read what is left for up to `grace` seconds (a process that escaped the step may hold a pipe),
        then write each stream's tail."""
        for w in self.child_ends:  # the child never started
            os.close(w)
        if self.thread.is_alive():
            self.thread.join(grace)
            self.stop.set()
            self.thread.join()
        for fd, f in self.files.items():
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(fd)
            tail, seen = self.tails[fd], self.seen[fd]
            if seen > self.keep:
                cut = seen - self.keep - len(tail)
                if cut > 0:
                    f.write(f"\n[openforge: {cut} bytes cut here, {seen} in all: the output limit "
                            f"({format_size(self.limit)}) keeps the first and the last {format_size(self.keep)} "
                            f"of each stream]\n".encode())
                f.write(bytes(tail))
            f.close()
            os.close(fd)
        self.sel.close()


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
    """The limits of one episode as this machine enforces them: the cgroup (made at once, removed by `close`),
    the rlimits that stand in for what it lacks, the bounded file systems; `enforced` says what holds each."""

    def __init__(self, limits: Limits, name: str, *, mounts: bool = False, uid: int | None = None) -> None:
        self.limits, self.mounts = limits, mounts
        self.uid = os.geteuid() if uid is None else uid
        self.bounded: list[BoundedDirs] = []
        self.enforced: dict[str, str] = {}
        self.cgroup: Cgroup | None = None
        if any(getattr(limits, k) for k in CONTROLLER) and os.geteuid() == 0:
            self.cgroup = Cgroup.create(limits, name, find_hierarchies())
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
