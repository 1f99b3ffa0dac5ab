"""The notebook is executed here, so it never rots; in git it carries no outputs."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "diagnose_a_divergence.ipynb"


def test_notebook_is_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)


@pytest.mark.slow
def test_notebook_runs_shows_the_default_surviving_and_names_the_lr_spike(tmp_path):
    from nbclient import NotebookClient

    # ipykernel's "python3" spec starts `python`, which jupyter_client maps to this interpreter (the venv's).
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "\n".join(
        o.get("text", "") + str(o.get("data", {}).get("text/markdown", ""))
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
    )
    assert "survived: onset step 49: oversized update (LR spike)" in text
    assert "log_only: onset step 49: oversized update (LR spike)" in text
    assert "lr spike, action=log" in text and "status: diverged" in text
    survived = next(line for line in text.splitlines() if line.startswith("lr spike, defaults"))
    assert "status: ok" in survived
    assert "rollback rollback" in text and '"source": "snapshot_file"' in text
    natural = next(line for line in text.splitlines() if line.startswith("lr 0.1, defaults"))
    assert "status: unstable" in natural and "QK-clip acted on" in text  # a natural failure, mitigated and flagged
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 6
