"""Copies of a task's original code that the agent could reach instead of fixing the bug (docs/tasks.md,
`no_side_copies`): version control history, build outputs, backups, stale compiled files, a file holding the
code as the solution leaves it, and an installed copy of the same package on the interpreter's path.

Each finder returns phrases naming what it found; `openforge tasks check` fails a task with any, and
`openforge tasks mutate` refuses a repository whose package is installed where the sandbox's Python finds it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path, PurePosixPath

from openforge.choices import Sandbox
from openforge.rollout.episode import Confinement, EpisodeError, run_group, verifier_env
from openforge.taskforge.repo_files import BACKUP_SUFFIXES
from openforge.taskforge.solution import confined_spec

HISTORY_DIRS = {".git", ".hg", ".svn"}
PYTHON = re.compile(r"python[0-9.]*$")
MIN_COPY_CHARS = 16  # non-blank characters: a shorter file (say, an empty one) matches others by chance
MAX_COMPARED_BYTES = 1_000_000
PROBE_TIMEOUT_S = 30.0
# run by each interpreter in the sandbox, from an empty directory: where each top-level name is found (stdlib
# left out) that holds one of the workspace's files at the same path (a module: the same file name)
PROBE = """
import importlib.util, json, os, sys
found = {}
for name, (module, inside) in json.loads(sys.argv[1]).items():
    if name in getattr(sys, "stdlib_module_names", ()):
        continue
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        continue
    for where in list(spec.submodule_search_locations or []) or [spec.origin or ""] if spec else ():
        if any(os.path.isfile(os.path.join(where, rel)) for rel in inside) or (
                not inside and os.path.basename(where) == module and os.path.isfile(where)):
            found[name] = where
            break
print(json.dumps(found))
"""


def _walk(work: Path, prune: bool = False) -> Iterator[tuple[str, Path, bool]]:
    """(relative path, path, is a directory) of everything under `work`, links not followed; with `prune`,
    not inside history folders and virtual environments (what is in them is not the project's)."""
    for current, dirs, names in os.walk(work):
        here = Path(current)
        for name in sorted(dirs) + sorted(names):
            path = here / name
            yield path.relative_to(work).as_posix(), path, name in dirs
        if prune:
            dirs[:] = [d for d in dirs if d not in HISTORY_DIRS and not (here / d / "pyvenv.cfg").exists()]


def in_workspace(work: Path, shipped: Iterable[str]) -> list[str]:
    """History folders, `build/` folders (not a package of that name), backups (`*.orig`, `*.rej`, `*.bak`),
    compiled files the task ships, and `.pyc` files that do not match their source (left by a setup that
    compiled the original, then wrote the bug)."""
    found = [f"a compiled file shipped in `files`: {rel}" for rel in sorted(shipped)
             if rel.endswith(".pyc") or "__pycache__" in PurePosixPath(rel).parts]
    for rel, path, is_dir in _walk(work, prune=True):
        name = path.name
        if is_dir and name in HISTORY_DIRS:
            found.append(f"version control history: {rel}/")
        elif is_dir and name == "build" and not (path / "__init__.py").exists() and any(path.iterdir()):
            found.append(f"a build output: {rel}/")
        elif not is_dir and name.endswith(BACKUP_SUFFIXES):
            found.append(f"a backup: {rel}")
        elif not is_dir and name.endswith(".pyc") and not path.is_symlink() and _stale(path):
            found.append(f"a stale compiled file {rel} (it does not match its source)")
    return found


def _source_of(pyc: Path) -> Path:
    if pyc.parent.name == "__pycache__":
        return pyc.parent.parent / (pyc.name.split(".", 1)[0] + ".py")
    return pyc.with_suffix(".py")


def _stale(pyc: Path) -> bool:
    """Whether `pyc` holds other code than its source beside it (or has none): by the header's source hash,
    or its source mtime and size, as the import system checks it."""
    source = _source_of(pyc)
    try:
        header = pyc.read_bytes()[:16]
        if not source.is_file() or len(header) < 16:
            return True
        flags = int.from_bytes(header[4:8], "little")
        if flags & 1:
            return header[8:16] != importlib.util.source_hash(source.read_bytes())
        stat = source.stat()
        return (int.from_bytes(header[8:12], "little") != int(stat.st_mtime) & 0xFFFFFFFF
                or int.from_bytes(header[12:16], "little") != stat.st_size & 0xFFFFFFFF)
    except OSError:
        return True


def copies_of_solved(untouched: Path, solved: Path) -> list[str]:
    """Files of the untouched workspace holding a file as the solution leaves it: the original, readable
    beside the bug."""
    solved_texts: dict[bytes, str] = {}
    for rel, path, is_dir in _walk(solved):
        before = untouched / rel
        if is_dir or path.is_symlink() or not before.is_file() or path.stat().st_size > MAX_COMPARED_BYTES:
            continue
        data = path.read_bytes()
        if len(b"".join(data.split())) >= MIN_COPY_CHARS and data != before.read_bytes():
            solved_texts[data] = rel
    found = []
    for rel, path, is_dir in _walk(untouched) if solved_texts else ():
        if not is_dir and not path.is_symlink() and path.stat().st_size <= MAX_COMPARED_BYTES:
            original = solved_texts.get(path.read_bytes())
            if original is not None and original != rel:
                found.append(f"{rel} holds {original} as the solution leaves it")
    return found


def top_level(rel: str, paths: set[str]) -> tuple[str, str]:
    """(import name, its path in the workspace) of the top-level package or module a Python file belongs to:
    its folders up to the last one holding an `__init__.py`."""
    parts = PurePosixPath(rel).parts
    depth = len(parts) - 1
    while depth > 0 and "/".join([*parts[:depth], "__init__.py"]) in paths:
        depth -= 1
    if depth == len(parts) - 1:
        return PurePosixPath(rel).stem, rel
    return parts[depth], "/".join(parts[:depth + 1])


def interpreters(command: str, env: Mapping[str, str]) -> list[str]:
    """The Pythons a command's sandbox offers: the one the command starts with (when it names one), the
    interpreter that has OpenForge, and `python3` on PATH."""
    found = [sys.executable]
    try:
        first = shlex.split(command)[:1]
    except ValueError:
        first = []
    for word in [os.path.expandvars(w) for w in first] + ["python3"]:
        path = shutil.which(word, path=env.get("PATH")) if PYTHON.search(word) else None
        if path and path not in found:
            found.append(path)
    return found


def installed(code: Iterable[str], paths: set[str], command: str, parent: Mapping[str, str],
              sandbox: str) -> list[str]:
    """Installed copies of the workspace's own packages and modules (those of the files `code`, among all
    its files `paths`) that an interpreter of the command finds from outside the workspace, in the sandbox
    (`sandbox`) and environment a verifier has: a location holding one of those files at the same path."""
    code = list(code)
    wanted: dict[str, tuple[str, list[str]]] = {}
    for rel in code:
        name, top = top_level(rel, paths)
        if name.isidentifier() and name not in wanted:
            inside = [c[len(top) + 1:] for c in code if c.startswith(top + "/")]
            wanted[name] = (PurePosixPath(top).name, inside)
    if not wanted:
        return []
    found: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="openforge-side-copies-") as tmp:
        root = Path(tmp)
        if sandbox == Sandbox.uid:
            root.chmod(0o711)  # the unprivileged uid passes through to the directories it is given
        work, home = root / "work", root / "home"
        for d in (work, home):
            d.mkdir()
        env = verifier_env(home, parent)
        for python in interpreters(command, env):
            for name, where in _probe(python, wanted, root, sandbox, env).items():
                found.setdefault(name, f"an installed copy of {name} on {python}'s path: {where}")
    return list(found.values())


def _probe(python: str, wanted: dict[str, tuple[str, list[str]]], root: Path, sandbox: str,
           env: Mapping[str, str]) -> dict[str, str]:
    """PROBE's answer from `python`, confined as a verifier is; {} when it gives none."""
    work, home = root / "work", root / "home"
    try:
        box = Confinement(confined_spec(work, home, root, sandbox))
        box.prepare(work, home)
        argv = [python, "-c", PROBE, json.dumps(wanted)]
        with box.step(argv, cwd=work, writable=[work, home], network=False) as (cmd, popen):
            code, _ = run_group(cmd, cwd=work, env=dict(env), out=root, name="probe", timeout=PROBE_TIMEOUT_S,
                                popen=popen)
        found = json.loads((root / "probe.stdout").read_text().strip().splitlines()[-1]) if code == 0 else {}
    except (EpisodeError, OSError, ValueError, IndexError):
        return {}
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}
