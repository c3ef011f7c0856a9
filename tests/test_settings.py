"""`openforge.settings`: the one coercer (driven by the annotation), bounds, choices, booleans, the TOML round
trip and `--set`; and the documented settings tables equal to the dataclasses they document (names and
defaults): docs/rl.md's rl.toml, docs/trainer.md's table, docs/addon.md's options."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

import pytest

from openforge.choices import Attention, EngineBackend
from openforge.rl.config import LOOP_SET, RLConfig, load_rl_config
from openforge.settings import (
    ConfigError,
    coerce,
    describe,
    load,
    parse_bool,
    parse_sets,
    read_toml,
    setting,
    table_toml,
    to_dict,
    toml_value,
    validate,
)
from openforge.testing import ROOT
from openforge.trainer.config import TrainConfig


@dataclass
class Inner:
    rate: float = setting(0.5, ge=0, le=1, help="A share.")


@dataclass
class Example:
    count: int = setting(2, ge=1, note="1 = once", help="How many.")
    rate: float = setting(1.0, gt=0, unit="seconds", finite=True, help="How long.")
    on: bool = setting(True, help="Whether.")
    name: str = setting("x", help="A word.")
    where: Path = setting(Path("."), help="A directory.")
    engine: EngineBackend = setting(EngineBackend.llamacpp, help="Which engine.")
    maybe: int | None = setting(None, help="Perhaps a number.")
    pair: tuple[float, float] = setting((0.1, 0.2), ge=0, help="Two numbers.")
    ks: list[int] = setting(factory=lambda: [1], help="Numbers.")
    tree: bool | str = setting(False, words=("auto",), help="A flag or auto.")
    inner: Inner = setting(factory=Inner, help="A nested table.")


@pytest.mark.parametrize(("kind", "value", "expected"), [
    (int, "3", 3), (int, 3, 3), (float, "1e-5", 1e-5), (float, 2, 2.0), (str, "a b", "a b"),
    (Path, "d/e", Path("d/e")), (EngineBackend, "vllm", EngineBackend.vllm), (int | None, None, None),
    (int | None, "4", 4), (tuple[float, float], "0.9, 0.99", (0.9, 0.99)), (tuple[float, float], [1, 0], (1.0, 0.0)),
    (list[int], "1,2", [1, 2]), (list[str], ["a"], ["a"]), (dict[str, str], {"a": "b"}, {"a": "b"}),
])
def test_the_annotation_decides_the_type(kind: object, value: object, expected: object) -> None:
    got = coerce("x", value, kind)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize(("kind", "value", "message"), [
    (int, "two", "x: cannot read 'two' as int"), (int, True, "x: expected int, got True"),
    (float, "fast", "x: cannot read 'fast' as float"), (str, 3, "x: expected str, got 3"),
    (EngineBackend, "sglang", "x must be llamacpp or vllm, not 'sglang'"),
    (tuple[float, float], "1", "x: expected a list of numbers, got '1'"),
    (list[int], "a,b", "x: expected a list of integers"), (bool, "maybe", "x: cannot read 'maybe' as bool"),
])
def test_a_value_of_the_wrong_type_is_one_error_naming_the_setting(kind: object, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        coerce("x", value, kind)


@pytest.mark.parametrize(("word", "value"), [*((w, True) for w in ("true", "TRUE", "on", "yes", "1", " On ")),
                                              *((w, False) for w in ("false", "off", "No", "0"))])
def test_one_boolean_parser_takes_both_old_spellings(word: str, value: bool) -> None:
    assert parse_bool(word) is value


def test_booleans_refuse_other_words() -> None:
    with pytest.raises(ValueError):
        parse_bool("maybe")


def test_load_coerces_nested_tables_and_words_and_refuses_unknown_keys() -> None:
    got = load(Example, {"count": "3", "tree": "auto", "on": "off", "inner": {"rate": "0.25"}})
    assert (got.count, got.tree, got.on, got.inner.rate) == (3, "auto", False, 0.25)
    with pytest.raises(ConfigError, match="unknown setting inner.speed; known: rate"):
        load(Example, {"inner": {"speed": 1}})
    with pytest.raises(ConfigError, match="tree: cannot read 'maybe' as bool or 'auto'"):
        load(Example, {"tree": "maybe"})


@pytest.mark.parametrize(("values", "message"), [
    ({"count": 0}, "count must be >= 1 (1 = once), not 0"),
    ({"rate": "-1"}, "rate must be finite and > 0 seconds, not -1"),
    ({"rate": "inf"}, "rate must be finite and > 0 seconds, not inf"),
    ({"pair": "0.1,-1"}, "pair must be >= 0, not (0.1, -1.0)"),
    ({"inner": {"rate": 2}}, "inner.rate must be in [0, 1], not 2"),
])
def test_bounds_are_one_error_line_naming_the_setting(values: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        validate(load(Example, values))
    assert str(e.value) == message


def test_choices_are_checked_on_values_set_in_code_too() -> None:
    with pytest.raises(ConfigError, match="attention must be auto, sdpa, flex or flash, not 'flash2'"):
        TrainConfig(attention="flash2").validate()  # type: ignore[arg-type]
    assert TrainConfig(attention=Attention.flex).validate().attention == "flex"


def test_toml_round_trip(tmp_path: Path) -> None:
    original = load(Example, {"count": 5, "engine": "vllm", "maybe": 3, "ks": [1, 2], "inner": {"rate": 0.75}})
    values = {k: v for k, v in to_dict(original).items() if v is not None}  # TOML has no null
    (tmp_path / "x.toml").write_text("\n".join(table_toml("x", values)) + "\n")
    assert load(Example, read_toml(tmp_path / "x.toml")["x"]) == original
    assert tomllib.loads(f"v = {toml_value(EngineBackend.vllm)}")["v"] == "vllm"


def test_set_parses_key_value_pairs() -> None:
    assert parse_sets(["lr=1e-5", "where=reward > 0", "kl-coef = 0.1"]) == \
        {"lr": "1e-5", "where": "reward > 0", "kl_coef": "0.1"}
    with pytest.raises(ConfigError, match="--set expects key=value, got 'lr'"):
        parse_sets(["lr"])


def test_train_in_rl_toml_is_typed_and_validated() -> None:
    cfg = load_rl_config(sets={"train.kl_coef": "0.01", "train.tree": "false", "train.objective": "sft"})
    assert isinstance(cfg.train, TrainConfig) and (cfg.train.kl_coef, cfg.train.tree, cfg.train.objective) == \
        (0.01, False, "sft")
    with pytest.raises(ConfigError, match="train.kl_coef: cannot read 'lots' as float"):
        load_rl_config(sets={"train.kl_coef": "lots"})


def test_a_cli_option_help_comes_from_its_field() -> None:
    assert describe(TrainConfig, "lr") == "lr: Peak learning rate (AdamW, warmup then cosine). (default 1e-06)"


# -- the documented settings equal the dataclasses ------------------------------------------------------------

def rl_toml_in_the_docs() -> dict[str, dict[str, object]]:
    text = (ROOT / "docs" / "rl.md").read_text()
    block = re.search(r"## Config \(`--config rl.toml`\).*?```toml\n(.*?)```", text, re.S)
    assert block, "docs/rl.md has no rl.toml block under 'Config'"
    return tomllib.loads(block.group(1))


def test_docs_rl_toml_lists_every_setting_with_its_default() -> None:
    documented, defaults = rl_toml_in_the_docs(), RLConfig()
    assert list(documented) == [f.name for f in fields(RLConfig)]
    for section, table in documented.items():
        values = to_dict(getattr(defaults, section), LOOP_SET if section == "train" else ())
        if section == "train":  # the loop's own defaults, every one; the trainer's others in docs/trainer.md
            assert set(table) <= set(values) and all(table[k] == values[k] for k in table), table
            assert set(table) >= set(k for k in values if values[k] != to_dict(TrainConfig())[k])
            continue
        assert table == values, f"docs/rl.md [{section}] differs from openforge/rl/config.py"


def test_docs_trainer_table_lists_every_field_with_its_default() -> None:
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", (ROOT / "docs" / "trainer.md").read_text(), re.M)
    assert rows == [(k, toml_value(v)) for k, v in to_dict(TrainConfig()).items()]


def test_docs_addon_table_lists_every_option_with_its_default() -> None:
    from openforge.addons.options import SPECS

    rows = re.findall(r"^\| `(openforge_\w+)` \| `(\w+)` \| (.*?) \|", (ROOT / "docs" / "addon.md").read_text(), re.M)
    documented = {name: ("" if default in ("none", "(required)") else default.strip("`")) for name, _, default in rows}
    assert documented == {s.name: s.builtin for s in SPECS}
    assert all(env == "OPENFORGE_" + name.removeprefix("openforge_").upper() for name, env, _ in rows)
