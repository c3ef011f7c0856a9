"""A repository as a task's `files`: its text files, without version control, caches, environments, build
outputs, backups, links and binaries (docs/tasks.md, `openforge tasks mutate`): nothing that holds a copy of
the code a task's bug is put in."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

SKIP_DIRS = {".git", ".hg", ".svn", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".tox", ".nox",
             ".venv", "venv", "node_modules", ".eggs", "build", "dist", ".idea", ".vscode", ".ipynb_checkpoints"}
BACKUP_SUFFIXES = (".orig", ".rej", ".bak")  # what patch and editors leave: the code as it was
MAX_FILE_BYTES = 1_000_000
MAX_TOTAL_BYTES = 20_000_000


class RepoError(ValueError):
    """The repository cannot become a workspace (one line: why)."""


@dataclass
class RepoFiles:
    files: dict[str, str]  # relative POSIX path -> text, sorted by path
    skipped: Counter[str] = field(default_factory=Counter)  # reason -> how many files or folders

    @property
    def size(self) -> int:
        return sum(len(t.encode()) for t in self.files.values())


def _skip_dir(path: Path) -> str | None:
    if path.name in SKIP_DIRS or path.name.endswith(".egg-info"):
        return f"folder {path.name}"
    if (path / "pyvenv.cfg").is_file():
        return "virtual environment"
    return None


def read_repo(root: Path, *, max_total: int = MAX_TOTAL_BYTES) -> RepoFiles:
    """The text files under `root`; RepoError when they add up to more than `max_total` bytes."""
    found = RepoFiles({})
    total = 0
    for current, dirs, names in os.walk(root):
        here = Path(current)
        keep = []
        for d in sorted(dirs):
            if (here / d).is_symlink():
                found.skipped["link"] += 1
            elif why := _skip_dir(here / d):
                found.skipped[why] += 1
            else:
                keep.append(d)
        dirs[:] = keep
        for name in sorted(names):
            path = here / name
            rel = path.relative_to(root).as_posix()
            if path.is_symlink() or not path.is_file():
                found.skipped["link or special file"] += 1
                continue
            if name.endswith(BACKUP_SUFFIXES):
                found.skipped["backup file"] += 1
                continue
            if path.stat().st_size > MAX_FILE_BYTES:
                found.skipped[f"over {MAX_FILE_BYTES // 1000} kB"] += 1
                continue
            data = path.read_bytes()
            try:
                if b"\0" in data:
                    raise UnicodeDecodeError("utf-8", data, 0, 1, "NUL byte")
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                found.skipped["binary"] += 1
                continue
            total += len(data)
            if total > max_total:
                raise RepoError(f"{root}: its text files pass {max_total // 1_000_000} MB; a task's workspace "
                                f"holds them all (narrow the repository or move large files out)")
            found.files[rel] = text
    found.files = dict(sorted(found.files.items()))
    return found


def write_repo(files: dict[str, str], root: Path) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
