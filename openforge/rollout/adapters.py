"""Adapters: how to run one agent CLI for an episode, read from a TOML file (docs/rollouts.md).

The built-in ones (`openforge/rollout/adapters/*.toml`) are written in the same form as a user's
`--toolchain custom:FILE.toml`, so what a built-in does is readable, and copyable, as data.

Placeholders, in `command`, `env` values and `config_files` contents: `{prompt}`, `{workdir}`, `{episode}`,
`{base_url}`, `{api_key}` (the spec's five), plus `{home}` (the episode's HOME), `{tools}` (where the CLIs
are installed: $OPENFORGE_TOOLS_DIR, else `.tools` of this checkout), `{python}` (the episode's Python),
`{path}` (the inherited PATH) and `{model}` (the model name the CLI sends, MODEL). They are filled in by the
episode process, so `{tools}` and `{python}` are those of the machine (or pod) that runs it. Other braces
(JSON in a config file) are left as they are.

An `env` variable named like a credential (`SECRET_NAME`: `*_API_KEY`, `*_TOKEN`, `OPENFORGE_UPSTREAM_KEY`) may
only be `{api_key}`, the agent's own proxy key: the agent reads its whole environment, so a literal secret in
a toolchain file would be the agent's too.

`readonly` and `writable` (lists of absolute paths, placeholders allowed) are bound into a bwrap sandbox beside
what it binds anyway (the system, Python, the tools directory, and the installation a command named by
absolute path resolves into: `sandbox.install_roots`): the directories a CLI installed elsewhere needs.

These files are also how `toolchains/run.py` runs the CLIs outside a rollout (tests, trace capture): both
render them with `render_adapter`.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from openforge.rollout.spec import Adapter
from openforge.rollout.tasks import ID, relative_path

# Variable names that hold credentials: such a value belongs in a Secret (or, for an agent, is its own proxy key).
SECRET_NAME = re.compile(r"(?i)(.*_)?(API_KEY|TOKEN)|OPENFORGE_UPSTREAM_KEY")
PLACEHOLDERS = ("prompt", "workdir", "episode", "base_url", "api_key", "home", "tools", "python", "path", "model")
MODEL = "local-model"  # any engine of ours takes it; the proxy's route options map it to a served model
_PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")
CUSTOM = "custom:"
KEYS = {"command", "env", "config_files", "readonly", "writable"}


class AdapterError(ValueError):
    """An adapter file that cannot be used; the message names the file and key."""


def builtin_names() -> list[str]:
    return sorted(p.name.removesuffix(".toml") for p in resources.files(__package__).joinpath("adapters").iterdir()
                  if p.name.endswith(".toml"))


def tools_dir() -> str:
    """Where the agent CLIs are installed: $OPENFORGE_TOOLS_DIR, else this checkout's `.tools`."""
    return os.environ.get("OPENFORGE_TOOLS_DIR") or str(Path(__file__).resolve().parents[2] / ".tools")


def render(template: str, values: Mapping[str, str]) -> str:
    """`template` with each known `{name}` replaced; anything else (JSON braces) kept."""
    return _PLACEHOLDER.sub(lambda m: values[m[1]] if m[1] in PLACEHOLDERS else m[0], template)


def render_adapter(adapter: Adapter, values: Mapping[str, str], home: Path) -> tuple[list[str], dict[str, str]]:
    """Write the adapter's config files under `home` and return its argv and its own env, all rendered with
    `values`; AdapterError for a config file path that leaves `home`."""
    for rel, content in adapter.config_files.items():
        if why := relative_path(rel):
            raise AdapterError(f"config file {rel!r} {why.replace('workspace', 'home')}")
        path = home / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(content, values), encoding="utf-8")
    return [render(a, values) for a in adapter.command], {k: render(v, values) for k, v in adapter.env.items()}


def _check_placeholders(where: str, text: str) -> None:
    for name in _PLACEHOLDER.findall(text):
        if name not in PLACEHOLDERS:
            raise AdapterError(f"{where}: unknown placeholder {{{name}}} (known: "
                               f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)})")


def parse_adapter(name: str, data: dict[str, Any], source: str) -> Adapter:
    """A parsed TOML table -> Adapter; AdapterError naming `source` and the key."""
    unknown = sorted(set(data) - KEYS)
    if unknown:
        raise AdapterError(f"{source}: key '{unknown[0]}': unknown (known: {', '.join(sorted(KEYS))})")
    command = data.get("command")
    if not isinstance(command, list) or not command or not all(isinstance(a, str) and a for a in command):
        raise AdapterError(f"{source}: key 'command': must be a non-empty list of non-empty strings")
    for i, arg in enumerate(command):
        _check_placeholders(f"{source}: key 'command[{i}]'", arg)
    tables: dict[str, dict[str, str]] = {}
    for key in ("env", "config_files"):
        table = data.get(key, {})
        if not isinstance(table, dict):
            raise AdapterError(f"{source}: key '{key}': must be a table")
        for k, v in table.items():
            if not isinstance(v, str):
                raise AdapterError(f"{source}: key '{key}.{k}': must be a string")
            _check_placeholders(f"{source}: key '{key}.{k}'", v)
        tables[key] = dict(table)
    for var, value in tables["env"].items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", var):
            raise AdapterError(f"{source}: key 'env.{var}': not an environment variable name")
        if SECRET_NAME.fullmatch(var) and value != "{api_key}":
            raise AdapterError(f"{source}: key 'env.{var}': looks like a secret, and the agent reads its whole "
                               "env: its value may only be {api_key} (the agent's proxy key)")
    for path in tables["config_files"]:
        if why := relative_path(path):
            raise AdapterError(f"{source}: key 'config_files.{path}': {why.replace('workspace', 'home')}")
    paths: dict[str, tuple[str, ...]] = {}
    for key in ("readonly", "writable"):
        listed = data.get(key, [])
        if not isinstance(listed, list) or not all(isinstance(p, str) and (p.startswith(("/", "{"))) for p in listed):
            raise AdapterError(f"{source}: key '{key}': must be a list of absolute paths (placeholders allowed: "
                               '"/opt/x", "{home}/.cache")')
        for i, path in enumerate(listed):
            _check_placeholders(f"{source}: key '{key}[{i}]'", path)
        paths[key] = tuple(listed)
    return Adapter(name=name, command=tuple(command), env=tables["env"], config_files=tables["config_files"],
                   readonly=paths["readonly"], writable=paths["writable"])


def load_adapter_file(path: str | Path, name: str | None = None) -> Adapter:
    """Read an adapter TOML file; its name is the file's stem unless given."""
    path = Path(path)
    name = name or path.stem
    if not ID.fullmatch(name):
        raise AdapterError(f"{path}: adapter name {name!r} must be 1-128 of A-Z a-z 0-9 . _ - (it names episodes)")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise AdapterError(f"{path}: cannot read the adapter file: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{path}: not TOML: {e}") from None
    return parse_adapter(name, data, str(path))


def resolve(toolchain: str) -> Adapter:
    """A `--toolchain` value: a built-in name or `custom:FILE.toml`."""
    if toolchain.startswith(CUSTOM):
        return load_adapter_file(toolchain.removeprefix(CUSTOM))
    if toolchain not in builtin_names():
        raise AdapterError(f"unknown toolchain {toolchain!r}: built-in are {', '.join(builtin_names())}, "
                           f"or custom:FILE.toml")
    resource = resources.files(__package__).joinpath("adapters", f"{toolchain}.toml")
    with resources.as_file(resource) as path:
        return load_adapter_file(path, toolchain)
