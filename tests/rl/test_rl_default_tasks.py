"""`openforge rl`'s default tasks: a task file shipped as package data, read like any other."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from openforge.examples.tasks import rollout_tasks
from openforge.rl.tasks import DEFAULT_TASKS, default_tasks
from openforge.rollout.episode import verifier_env

ROOT = Path(__file__).resolve().parents[2]


def test_the_default_task_file_holds_the_example_tasks() -> None:
    ours, examples = default_tasks(), rollout_tasks()
    assert [(t.id, t.prompt, t.verify.split()[1:]) for t in ours] == \
        [(t.id, t.prompt, t.verify.split()[1:]) for t in examples]
    assert all(t.verify.startswith('"$OPENFORGE_PYTHON" -m openforge.examples.verifier ') for t in ours)


def test_a_default_verifier_runs_with_the_interpreter_the_verifier_environment_names(tmp_path: Path) -> None:
    env = verifier_env(tmp_path, {**os.environ, "PYTHONPATH": str(ROOT)})
    assert env["OPENFORGE_PYTHON"] == sys.executable
    (tmp_path / "transcript.json").write_text('{"final": "17 + 25 = 42", "tool_results": []}')
    verify = default_tasks()[0].verify  # add-1: 17 + 25
    done = subprocess.run(["bash", "-c", verify], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and float(done.stdout.split()[-1]) == 1.0, done.stderr


def test_the_default_task_file_ships_with_the_package() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert DEFAULT_TASKS.name in data["openforge.rl"] and DEFAULT_TASKS.is_file()
