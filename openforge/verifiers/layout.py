"""The shipped files of a task with tests: copied into a fresh directory, with the pytest configuration and the
test-file names they hold.

Only the files named are copied, and never a compiled one (`__pycache__`, `*.pyc`): nothing the agent added
to the workspace (a `conftest.py`, a `pytest.ini`, a `sitecustomize.py`, a `.pyc` of old code) is there.
"""

from __future__ import annotations

import configparser
import shutil
import tomllib
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from openforge.verifiers.expect import TEST_FILES

# pytest's configuration files in its order of precedence, each with what makes it pytest's
CONFIG_FILES = {"pytest.toml": "", ".pytest.toml": "", "pytest.ini": "", ".pytest.ini": "",
                "pyproject.toml": "[tool.pytest", "tox.ini": "[pytest]", "setup.cfg": "[tool:pytest]"}


def bad_path(rel: str) -> str | None:
    """Why `rel` is no path of a shipped file (absolute, `..`, empty), or None."""
    path = PurePosixPath(rel)
    if not rel or path.is_absolute() or ".." in path.parts:
        return f"{rel!r} is not a relative path inside the workspace"
    return None


def compiled(rel: str) -> bool:
    return rel.endswith(".pyc") or "__pycache__" in PurePosixPath(rel).parts


def shipped_copy(workspace: Path, files: Iterable[str], into: Path) -> None:
    """The shipped files as they are in `workspace`, but compiled ones; a link is no shipped file (not followed)."""
    for rel in files:
        source = workspace / rel
        if not compiled(rel) and source.is_file() and not source.is_symlink():
            (into / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, into / rel)


def config_file(root: Path) -> Path | None:
    """The configuration pytest would read at `root`, the top of the copy (None: it has none)."""
    for name, marker in CONFIG_FILES.items():
        path = root / name
        if path.is_file() and not path.is_symlink():
            if not marker or marker in path.read_text(encoding="utf-8", errors="replace"):
                return path
    return None


def test_patterns(config: Path | None) -> tuple[str, ...]:
    """The file names pytest collects as tests: the configuration's `python_files`, or its default."""
    if config is None:
        return TEST_FILES
    value: object = None
    try:
        if config.suffix == ".toml":
            data = tomllib.loads(config.read_text(encoding="utf-8"))
            table = data.get("pytest", {}) if config.name.endswith("pytest.toml") else data.get("tool", {}).get(
                "pytest", {})
            value = table.get("ini_options", table).get("python_files")
        else:
            parser = configparser.ConfigParser(interpolation=None)
            parser.read_string(config.read_text(encoding="utf-8"))
            section = "tool:pytest" if config.name == "setup.cfg" else "pytest"
            value = parser.get(section, "python_files", fallback=None)
    except (ValueError, configparser.Error, AttributeError):  # pytest itself says what is wrong with it
        return TEST_FILES
    if isinstance(value, str):
        return tuple(value.split()) or TEST_FILES
    if isinstance(value, list):
        return tuple(str(v) for v in value) or TEST_FILES
    return TEST_FILES
