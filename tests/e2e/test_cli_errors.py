"""What a user gets from `openforge train` and `openforge stats` on input they cannot run on: one `error:` line
(a `hint:` line where one helps) and a non-zero exit, never a traceback."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner, Result

from openforge.cli import app
from openforge.samples import SCHEMA_VERSION
from openforge.testing.trainer_samples import make_samples, qwen_tokenizer, write_samples


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("cli-errors")
    return write_samples(tmp / "runs.duckdb", make_samples(qwen_tokenizer(), 4, seed=0, episodes=2))


def one_error(args: list[str]) -> str:
    """Run the command; assert it failed with one `error:` line (and at most a hint) and no exception."""
    result = CliRunner().invoke(app, args)
    lines = result.stderr.splitlines()
    assert result.exit_code in (1, 2), (result.exit_code, result.stderr, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception
    assert lines and lines[0].startswith("error: ") and len(lines) <= 2, result.stderr
    assert len(lines) == 1 or lines[1].startswith("hint: "), result.stderr
    assert "Traceback" not in result.output
    return result.stderr


@pytest.mark.parametrize("where", ["nope >", "nope > 1", "reward >> 'x'", "reward > 0; DROP TABLE samples"])
def test_train_with_a_bad_where_is_one_error(db: Path, tiny_qwen_dir: Path, tmp_path: Path, where: str) -> None:
    err = one_error(["train", "--db", str(db), "--model", str(tiny_qwen_dir), "--out", str(tmp_path / "out"),
                     "--where", where])
    assert "--where" in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.parametrize("version", ["6", "99"])
def test_train_on_another_schema_version_is_one_error(db: Path, tiny_qwen_dir: Path, tmp_path: Path,
                                                      version: str) -> None:
    """The trainer reads one schema version: an older database (even one whose columns it could read) or a
    newer one is refused with what to run, before any step."""
    old = tmp_path / "old.duckdb"
    old.write_bytes(db.read_bytes())
    with duckdb.connect(str(old)) as con:
        con.execute(f"UPDATE meta SET value = '{version}' WHERE key = 'schema_version'")
    err = one_error(["train", "--db", str(old), "--model", str(tiny_qwen_dir), "--out", str(tmp_path / "out")])
    assert f"schema version {version}" in err and f"reads {SCHEMA_VERSION}" in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def stats(db: Path) -> Result:
    return CliRunner().invoke(app, ["stats", "--db", str(db)])


def test_stats_reads_a_current_database(db: Path) -> None:
    result = stats(db)
    assert result.exit_code == 0 and "samples" in result.stdout, result.output


@pytest.mark.parametrize("version", ["5", "2"])
def test_stats_on_a_migratable_old_schema_says_to_reconstruct(db: Path, tmp_path: Path, version: str) -> None:
    old = tmp_path / "old.duckdb"
    old.write_bytes(db.read_bytes())
    with duckdb.connect(str(old)) as con:
        con.execute(f"UPDATE meta SET value = '{version}' WHERE key = 'schema_version'")
    err = one_error(["stats", "--db", str(old)])
    assert f"schema version {version}" in err and f"reads {SCHEMA_VERSION}" in err
    assert "openforge reconstruct" in err and "migrates" in err


@pytest.mark.parametrize("version", ["1", "99"])
def test_stats_on_another_schema_says_to_rebuild(db: Path, tmp_path: Path, version: str) -> None:
    old = tmp_path / "old.duckdb"
    old.write_bytes(db.read_bytes())
    with duckdb.connect(str(old)) as con:
        con.execute(f"UPDATE meta SET value = '{version}' WHERE key = 'schema_version'")
    err = one_error(["stats", "--db", str(old)])
    assert f"schema version {version}" in err and "new database" in err


@pytest.mark.parametrize("content", [b"not a database\n", b"", b"\0" * 4096])
def test_stats_on_a_file_that_is_not_duckdb(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "notes.duckdb"
    path.write_bytes(content)
    assert "notes.duckdb" in one_error(["stats", "--db", str(path)])


def test_stats_on_a_duckdb_file_reconstruct_did_not_write(tmp_path: Path) -> None:
    path = tmp_path / "other.duckdb"
    with duckdb.connect(str(path)) as con:
        con.execute("CREATE TABLE t (x INTEGER)")
    assert "openforge reconstruct" in one_error(["stats", "--db", str(path)])
    assert path.stat().st_size > 0


def test_stats_without_a_database_is_one_error(tmp_path: Path) -> None:
    one_error(["stats", "--db", str(tmp_path / "none.duckdb")])
