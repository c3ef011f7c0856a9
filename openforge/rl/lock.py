"""The run directory's lock: one `openforge rl` per `--out` at a time.

Two runs in one directory would start two engines and proxies, write the same checkpoints and count each
other's steps. The lock is `flock` on `DIR/.lock`, held for the run's life: the kernel releases it when the
process exits, however it exits (a crash or kill -9 included), so a stale lock file never blocks a resume.
The file names the holder (pid, host, start time, command) for the message the next run prints.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import IO


class RunLocked(RuntimeError):
    """Another process holds the run directory."""


class RunLock:
    """`acquire()` or RunLocked naming the holder; `release()` (also when the process ends)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / ".lock"
        self.file: IO[str] | None = None

    def acquire(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        f = self.path.open("a+")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = describe(f.read())
            f.close()
            raise RunLocked(f"{self.directory} is in use by another `openforge rl` ({holder}): wait for it to "
                            "finish or stop it, or give another --out") from None
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": sys.argv}) + "\n")
        f.flush()
        self.file = f

    def release(self) -> None:
        """Unlock (the file stays: it is only a lock while a process holds it)."""
        f, self.file = self.file, None
        if f is not None:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            f.close()


def describe(text: str) -> str:
    """The holder as a phrase: 'pid 123 on host, since ...' (or what the file says, if it is not ours)."""
    try:
        h = json.loads(text)
        return f"pid {h['pid']} on {h['host']}, since {h['started']}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"
