"""Runs notebooks/rl_run.ipynb on an `openforge rl --out` directory, for its unit test and the rl end-to-end test."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

RL_NOTEBOOK = Path(__file__).resolve().parent.parent.parent / "notebooks" / "rl_run.ipynb"


def execute_rl_notebook(rl_dir: Path) -> str:
    """Execute the notebook top to bottom with OPENFORGE_RL_DIR=rl_dir; return its text output.

    Executed, not parsed: a cell that breaks on a real run's layout raises here (nbclient's CellExecutionError).
    Each section draws at most one figure and a run without training still draws three (rewards, lengths,
    zero-variance groups), so fewer means a section silently drew nothing.
    """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(RL_NOTEBOOK, as_version=4)
    with mock.patch.dict(os.environ, {"OPENFORGE_RL_DIR": str(rl_dir)}):  # the kernel inherits it
        NotebookClient(nb, timeout=240, kernel_name="python3",
                       resources={"metadata": {"path": str(RL_NOTEBOOK.parent)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    images = sum("image/png" in o.get("data", {}) for o in outputs)
    assert images >= 3, f"rl_run.ipynb drew {images} plots on {rl_dir}, expected at least 3"
    return "".join(o.get("text", "") for o in outputs)
