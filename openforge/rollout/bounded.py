"""What bounds an episode's disk and output: its workspace and HOME on a size-bounded tmpfs of its own (or a
size watch where it cannot mount one), its stdout and stderr kept to the output limit (the first and last
quarter of each stream), and every read of an output file bounded. Standard library only.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import selectors
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from openforge.rollout.sizes import format_size

FULL_SLACK = 64 * 1024  # a bounded file system with less than this free after the agent was full


# -- bounded reads ----------------------------------------------------------------------------------------------
def read_tail(path: Path, limit: int) -> str:
    """The last `limit` bytes of a file as text ('' when it cannot be read): what any output is read by."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - limit))
            return f.read(limit).decode(errors="replace")
    except OSError:
        return ""


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
