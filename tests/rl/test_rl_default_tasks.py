"""`openforge rl`'s default tasks: a task file shipped as package data, read like any other."""

from __future__ import annotations

import shlex
import tomllib
from pathlib import Path

from openforge.examples.tasks import rollout_tasks
from openforge.rl.tasks import DEFAULT_TASKS, default_tasks

ROOT = Path(__file__).resolve().parents[2]


def test_the_default_task_file_holds_the_example_tasks_run_by_this_python() -> None:
    assert default_tasks() == rollout_tasks()
    assert all(t.verify.startswith(shlex.quote("/x y/python") + " -m ") for t in default_tasks("/x y/python"))


def test_the_default_task_file_ships_with_the_package() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert DEFAULT_TASKS.name in data["openforge.rl"] and DEFAULT_TASKS.is_file()
