"""Typed settings: every config is a dataclass whose fields carry their bounds and one help line
(`setting`), read from TOML or `--set key=value` by one coercer driven by the field's annotation, and
checked by one validator whose error names the setting. Standard library only: the proxy imports it
beside mitmproxy, without the training stack."""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, fields
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeGuard, Union


class ConfigError(ValueError):
    """A configuration value a user must fix (unknown key, wrong type, out of range); the message names it."""


TRUE = ("true", "on", "yes", "1")
FALSE = ("false", "off", "no", "0")
KINDS = {int: "integers", float: "numbers", str: "strings"}  # a list's element type, in its errors


def parse_bool(text: str) -> bool:
    """The one boolean reading of every config and option: true/on/yes/1 or false/off/no/0, any case."""
    word = text.strip().lower()
    if word in TRUE:
        return True
    if word in FALSE:
        return False
    raise ValueError(f"{text!r} is not true or false")


@dataclass(frozen=True)
class Spec:
    """What a field's metadata holds: its help line, bounds (each number, or each element of a list or
    tuple of numbers) and the exceptions a few settings need."""

    help: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    finite: bool = False  # say "finite and" in the bounds' error (a float is always checked finite)
    unit: str = ""  # after the bound in its error: ">= 512 tokens"
    note: str = ""  # after the bound in its error, in parentheses: "(0 = never)"
    wanted: str = ""  # what the error says is accepted, where the derived words would not do
    words: tuple[str, ...] = ()  # words a field of another type also takes (`tree = "auto"`)
    parse: Callable[[str, Any, Any], Any] | None = None  # (name, value, default) -> value, for custom formats
    dump: Callable[[Any], Any] | None = None  # the value as TOML writes it, for custom formats

    @property
    def bounded(self) -> bool:
        return any(b is not None for b in (self.ge, self.gt, self.le, self.lt))

    def bounds_text(self) -> str:
        low = f"[{self.ge:g}" if self.ge is not None else f"({self.gt:g}" if self.gt is not None else None
        high = f"{self.le:g}]" if self.le is not None else f"{self.lt:g})" if self.lt is not None else None
        if low and high:
            text = f"in {low}, {high}"
        elif low:
            text = (">= " if self.ge is not None else "> ") + low[1:]
        else:
            text = ("<= " if self.le is not None else "< ") + (high or "")[:-1]
        text = ("finite and " if self.finite else "") + text + (f" {self.unit}" if self.unit else "")
        return text + (f" ({self.note})" if self.note else "")


def setting(default: Any = MISSING, *, help: str, factory: Callable[[], Any] | None = None, **spec: Any) -> Any:
    """A dataclass field with its default (or `factory`), its help line and its `Spec` (bounds, ...)."""
    metadata = {"setting": Spec(help, **spec)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def spec(cls: type, name: str) -> Spec:
    """The `Spec` of field `name` of the dataclass `cls` (a bare field gets an empty help line)."""
    found = next((f for f in fields(cls) if f.name == name), None)
    if found is None:
        raise KeyError(f"{cls.__name__} has no field {name}")
    return found.metadata.get("setting", Spec(""))


def default(cls: type, name: str) -> Any:
    """The default of field `name` of the dataclass `cls`."""
    found = next(f for f in fields(cls) if f.name == name)
    return found.default_factory() if found.default_factory is not MISSING else found.default


def choices(kind: type[StrEnum]) -> str:
    """`a, b or c`: the members of a choice set as an error lists them."""
    values = [str(v) for v in kind]
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " or " + values[-1]


def _is_enum(kind: Any) -> TypeGuard[type[StrEnum]]:
    return isinstance(kind, type) and issubclass(kind, StrEnum)


def _type_name(kind: Any) -> str:
    return getattr(kind, "__name__", str(kind))


def coerce(name: str, value: Any, kind: Any, spec: Spec | None = None, default_value: Any = None) -> Any:
    """A TOML value or a `--set` string as the annotation `kind` (int, float, bool, str, Path, a StrEnum,
    Optional, unions with `spec.words`, tuples, lists, dicts and nested dataclasses); ConfigError naming
    `name` when it cannot be one."""
    spec = spec or Spec("")
    if spec.parse is not None:
        try:
            return spec.parse(name, value, default_value)
        except ValueError as e:
            raise ConfigError(str(e) if str(e).startswith(name) else f"{name}: {e}") from None
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if isinstance(value, str) and value.lower() in spec.words:
            return value.lower()
        inner = [a for a in args if a is not type(None) and not (a is str and spec.words)]
        if len(inner) == 1:
            try:
                return coerce(name, value, inner[0], dataclasses.replace(spec, words=()))
            except ConfigError:
                if not spec.words:
                    raise
            also = "".join(f" or {word!r}" for word in spec.words)
            raise ConfigError(f"{name}: cannot read {value!r} as {_type_name(inner[0])}{also}") from None
        raise TypeError(f"{name}: unsupported annotation {kind}")
    if origin in (list, tuple):
        items = [v.strip() for v in value.strip("()[] ").split(",") if v.strip()] if isinstance(value, str) \
            else value
        element = args[0] if args else str
        fixed = origin is tuple and not (len(args) == 2 and args[1] is Ellipsis)
        wrong = not isinstance(items, (list, tuple)) or (fixed and len(items) != len(args))
        if not wrong:
            try:
                out = [coerce(name, v, args[i] if fixed else element) for i, v in enumerate(items)]
                return tuple(out) if origin is tuple else out
            except ConfigError:
                pass
        of = choices(element) if _is_enum(element) else KINDS.get(element, _type_name(element) + "s")
        what = spec.wanted or f"a list of {of}"
        raise ConfigError(f"{name}: expected {what}, got {value!r}")
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{name}: expected a table, got {value!r}")
        return {str(k): coerce(f"{name}.{k}", v, args[1] if args else Any) for k, v in value.items()}
    if dataclasses.is_dataclass(kind) and isinstance(kind, type):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{name} must be a [{name}] table of settings, not {value!r}")
        return load(kind, value, prefix=f"{name}.", base=default_value)
    if kind is Any:
        return value
    if _is_enum(kind):
        if isinstance(value, str) and value in kind._value2member_map_:
            return kind(value)
        raise ConfigError(f"{name} must be {spec.wanted or choices(kind)}, not {value!r}")
    if isinstance(value, str) and kind is not str:
        try:
            if kind is bool:
                return parse_bool(value)
            return kind(value)
        except ValueError:
            raise ConfigError(f"{name}: cannot read {value!r} as {_type_name(kind)}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{name}: expected {_type_name(kind)}, got {value!r}")
    return value


def load(cls: type, values: Mapping[str, Any], *, prefix: str = "", base: Any = None) -> Any:
    """`base` (else `cls()`) with `values` coerced on top; ConfigError for an unknown key."""
    base = cls() if base is None else base
    known = {f.name: f for f in fields(cls)}
    kinds = typing.get_type_hints(cls)
    changed = {}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"unknown setting {prefix}{key}; known: {', '.join(sorted(known))}")
        changed[key] = coerce(prefix + key, value, kinds[key], spec(cls, key), getattr(base, key))
    return dataclasses.replace(base, **changed)


def _show(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else repr(value)


def validate(obj: Any, prefix: str = "") -> None:
    """Every field of `obj` (and of its nested dataclasses) within its bounds and choices: ConfigError
    naming the first that is not."""
    kinds = typing.get_type_hints(type(obj))
    for f in fields(obj):
        name, value, kind = prefix + f.name, getattr(obj, f.name), kinds[f.name]
        s: Spec = f.metadata.get("setting", Spec(""))
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            validate(value, f"{name}.")
            continue
        if _is_enum(kind) and value not in kind._value2member_map_:
            raise ConfigError(f"{name} must be {s.wanted or choices(kind)}, not {value!r}")
        numbers = [v for v in (value if isinstance(value, (list, tuple)) else [value])
                   if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if not numbers:
            continue
        finite = all(math.isfinite(v) for v in numbers)
        inside = all((s.ge is None or v >= s.ge) and (s.gt is None or v > s.gt) and (s.le is None or v <= s.le)
                     and (s.lt is None or v < s.lt) for v in numbers)
        if not (finite and inside):
            if not s.bounded and not s.wanted:
                raise ConfigError(f"{name} must be a finite number, not {_show(value)}")
            raise ConfigError(f"{name} must be {s.wanted or s.bounds_text()}, not {_show(value)}")


def read_toml(path: str | Path) -> dict[str, Any]:
    """A config file's tables; ConfigError naming the file when it cannot be read or parsed."""
    try:
        return tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read config {path}: {e}") from None


def toml_value(v: Any) -> str:
    """A value as TOML writes it: booleans, numbers, strings (StrEnums, paths), arrays (lists, tuples) and
    inline tables."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return toml_value(to_dict(v))
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_dict(obj: Any, leave_out: tuple[str, ...] = ()) -> dict[str, Any]:
    """A dataclass's fields as TOML would hold them (StrEnums as strings, custom formats by `Spec.dump`)."""
    out: dict[str, Any] = {}
    for f in fields(obj):
        if f.name in leave_out:
            continue
        value, s = getattr(obj, f.name), f.metadata.get("setting", Spec(""))
        if s.dump is not None:
            value = s.dump(value)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = to_dict(value)
        out[f.name] = str(value) if isinstance(value, (StrEnum, Path)) else value
    return out


def table_toml(title: str, values: Mapping[str, Any]) -> list[str]:
    """`[title]` and one `key = value` line per setting."""
    return [f"[{title}]", *(f"{k} = {toml_value(v)}" for k, v in values.items())]


def parse_sets(items: list[str]) -> dict[str, str]:
    """`["lr=1e-5", "where=reward > 0"]` -> {"lr": "1e-5", "where": "reward > 0"} (`-` in a key read as `_`)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        out[key.strip().replace("-", "_")] = value.strip()
    return out


def describe(cls: type, name: str, key: str | None = None, value: Any = MISSING, more: str = "") -> str:
    """`key: help more (default D)`: a CLI option's help from the field it sets, so that its words and default
    are written once; `value` where the command's default is not the field's (rl's [train])."""
    value = default(cls, name) if value is MISSING else value
    text = f"{key or name}: {spec(cls, name).help}" + (f" {more}" if more else "")
    if value in ("", [], None):
        return text
    return f"{text} (default {value if isinstance(value, str) else toml_value(value)})"
