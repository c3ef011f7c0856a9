"""`trainer/config.py`'s TOML: what `dump_toml` writes next to a checkpoint reads back as the same config, and
a file that cannot be read is one ConfigError naming it (`openforge rl` reads its rl.toml the same way)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from openforge.settings import ConfigError, read_toml, toml_value
from openforge.trainer.config import TrainConfig, dump_toml, load_config


def test_a_dumped_config_reads_back_the_same(tmp_path: Path) -> None:
    cfg = TrainConfig(where='run_id = "r1" AND path LIKE \'C:\\\\%\'', tree="auto", betas=(0.8, 0.95), lr=3e-6)
    (tmp_path / "train.toml").write_text(dump_toml(cfg))
    assert load_config(tmp_path / "train.toml") == cfg


def test_toml_values_parse_as_what_they_were() -> None:
    value = {"a": [1, 2.5, "x\"y"], "b": True, "c": (0.9, 0.999)}
    assert tomllib.loads(f"v = {toml_value(value)}")["v"] == {"a": [1, 2.5, 'x"y'], "b": True, "c": [0.9, 0.999]}


@pytest.mark.parametrize("text", [None, "[train\n"])
def test_an_unreadable_file_is_one_error_naming_it(tmp_path: Path, text: str | None) -> None:
    path = tmp_path / "train.toml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=f"cannot read config {path}"):
        read_toml(path)
