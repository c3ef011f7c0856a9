"""Read a task file (JSON lines, docs/rollouts.md) into `spec.Task`s; every error names the line and field.

Task ids end up in episode ids (URL paths) and directory names, and `files` paths are written under the
episode's workspace, so both are checked here, before anything runs.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path, PurePosixPath
from typing import Any

from openforge.rollout.spec import Task

ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
FIELDS = {"id", "prompt", "verify", "files", "setup", "timeout_s", "toolchains", "metadata", "solution", "editable"}
REQUIRED = ("id", "prompt", "verify")


class TaskFileError(ValueError):
    """A task file that cannot be used; the message is `FILE:LINE: field 'x': why`."""


def relative_path(path: str) -> str | None:
    """Why `path` may not be written under a workspace (absolute, `..`, empty), or None when it may."""
    p = PurePosixPath(path)
    if not path or p.is_absolute() or ".." in p.parts or "\\" in path or "\x00" in path:
        return "must be a relative path inside the workspace (no '..', not absolute)"
    return None


def _field_error(field: str, why: str) -> ValueError:
    return ValueError(f"field '{field}': {why}")


def parse_task(obj: Any) -> Task:
    """One task object -> Task; ValueError("field 'x': why") for the first problem found."""
    if not isinstance(obj, dict):
        raise ValueError(f"a task is a JSON object, not {type(obj).__name__}")
    unknown = sorted(set(obj) - FIELDS)
    if unknown:
        raise _field_error(unknown[0], f"unknown field (known: {', '.join(sorted(FIELDS))})")
    for name in REQUIRED:
        if name not in obj:
            raise _field_error(name, "missing")
        if not isinstance(obj[name], str) or not obj[name].strip():
            raise _field_error(name, "must be a non-empty string")
    if not ID.fullmatch(obj["id"]):
        raise _field_error("id", f"{obj['id']!r} must be 1-128 of A-Z a-z 0-9 . _ - (it names files and URLs)")
    files = obj.get("files", {})
    if not isinstance(files, dict):
        raise _field_error("files", "must be an object {path: content}")
    for path, content in files.items():
        if why := relative_path(path):
            raise _field_error("files", f"{path!r} {why}")
        if not isinstance(content, str):
            raise _field_error("files", f"content of {path!r} must be a string")
    setup = obj.get("setup")
    if setup is not None and not isinstance(setup, str):
        raise _field_error("setup", "must be a string (a shell command)")
    timeout = obj.get("timeout_s", 600.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
        raise _field_error("timeout_s", f"must be a number of seconds > 0, not {timeout!r}")
    toolchains = obj.get("toolchains")
    if toolchains is not None:
        if not isinstance(toolchains, list) or not toolchains:
            raise _field_error("toolchains", "must be a non-empty list of toolchain names")
        for name in toolchains:
            if not isinstance(name, str) or not ID.fullmatch(name):
                raise _field_error("toolchains", f"{name!r} is not a toolchain name (an adapter's name: "
                                                    "claude-code, or a custom file's stem)")
    metadata = obj.get("metadata", {})
    if not isinstance(metadata, dict):
        raise _field_error("metadata", "must be an object")
    solution = obj.get("solution")
    if solution is not None and (not isinstance(solution, str) or not solution.strip()):
        raise _field_error("solution", "must be a non-empty string (a unified diff or a shell command)")
    editable = obj.get("editable", [])
    if not isinstance(editable, list) or not all(isinstance(p, str) for p in editable):
        raise _field_error("editable", "must be a list of paths of `files`")
    for path in editable:
        if path not in files:
            raise _field_error("editable", f"{path!r} is not one of the task's `files`")
    return Task(id=obj["id"], prompt=obj["prompt"], verify=obj["verify"], files=dict(files), setup=setup,
                timeout_s=float(timeout), toolchains=tuple(toolchains) if toolchains is not None else None,
                metadata=metadata, solution=solution, editable=tuple(editable))


def read_tasks(path: str | Path) -> list[Task]:
    """Every task of a JSON-lines file (blank lines allowed), in file order; TaskFileError on the first problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TaskFileError(f"{path}: cannot read the task file: {e}") from None
    tasks: list[Task] = []
    first_line: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskFileError(f"{path}:{n}: not JSON: {e.msg} (column {e.colno})") from None
        try:
            task = parse_task(obj)
        except ValueError as e:
            raise TaskFileError(f"{path}:{n}: {e}") from None
        if task.id in first_line:
            raise TaskFileError(f"{path}:{n}: field 'id': duplicate id {task.id!r} "
                                f"(first on line {first_line[task.id]})")
        first_line[task.id] = n
        tasks.append(task)
    if not tasks:
        raise TaskFileError(f"{path}: no tasks (one JSON object per line)")
    return tasks
