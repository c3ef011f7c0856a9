"""`openforge demo --out DIR` replaces only what a demo made: a directory with the demo's marker, or an empty
one; any other existing path is refused (one line, nothing deleted) unless --force."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from openforge import demo
from openforge.cli import app


def test_a_folder_of_user_files_is_refused_and_kept(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("years of work")
    done = CliRunner().invoke(app, ["demo", "--out", str(tmp_path / "mine")], env={**os.environ, "COLUMNS": "200"})
    assert done.exit_code == 2 and done.output.startswith("error: --out "), done.output
    assert "--force" in done.output and "Traceback" not in done.output
    assert (tmp_path / "mine" / "thesis.tex").read_text() == "years of work"


@pytest.mark.parametrize("kind", ["marked", "empty", "forced", "forced-file"])
def test_an_earlier_demo_an_empty_folder_or_force_is_replaced(tmp_path: Path, kind: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo, "RLRun", lambda cfg, out, console: out)  # the loop itself is test_demo_e2e's
    out = tmp_path / "out"
    if kind == "forced-file":
        out.write_text("a file")
    else:
        out.mkdir()
    if kind in ("marked", "forced"):
        (out / "old.txt").write_text("old")
    if kind == "marked":
        (out / demo.MARKER).write_text("")
    assert demo.prepare(demo.DemoConfig(out=out), Console(), force=kind.startswith("forced")) == out
    assert sorted(p.name for p in out.iterdir()) == [demo.MARKER]
