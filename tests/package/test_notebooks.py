"""Every notebook in notebooks/ executes top to bottom (nbclient) and renders its figures."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from utils import shared_dir

# the kernels inherit the cache switch: off, so each notebook extracts for itself (a model class
# defined in a notebook cell has no source file and is never cached anyway: see
# test_disk_cache.test_class_without_source_is_never_cached; with the cache on they pass and take as long)
pytestmark = pytest.mark.no_extraction_cache

NOTEBOOKS = sorted((Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))
# every notebook is an integration test, as the marker says: a kernel of its own (a second process),
# some with a package-shipped real model (SmolLM2, MiniLM)
CASES = [pytest.param(p, id=p.stem, marks=[pytest.mark.integration]) for p in NOTEBOOKS]


@pytest.mark.parametrize("path", CASES)
def test_notebook_runs(path, monkeypatch):
    notebook = nbformat.read(path, as_version=4)
    monkeypatch.setenv("NNBRIDGE_SHARED", str(shared_dir()))  # the kernel inherits it
    # iopub_timeout: a cell's printed output can arrive seconds after its reply on a loaded
    # machine; nbclient's default (4 s) then drops it (a missing "True" failed CI once)
    NotebookClient(notebook, timeout=600, iopub_timeout=60, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    if path.stem == "reach_any_op":
        assert sum("image/png" in o.get("data", {}) for o in outputs) >= 2, "figures render"
    if path.stem == "graphpatch_demos_on_smollm2":
        assert any("patch == weight-edited model: True" in o.get("text", "") for o in outputs), "ROME edit equals eager"
    if path.stem == "graph_surgery_on_smollm2":
        assert any("clean logits back: True" in o.get("text", "") for o in outputs), "surgery.clear restores the model"
    if path.stem == "migrating_an_nnsight_script":
        assert any("True" in o.get("text", "") for o in outputs), "both imports give the same numbers"


def test_at_least_three_notebooks():
    assert {p.stem for p in NOTEBOOKS} >= {"reach_any_op", "migrating_an_nnsight_script", "graphpatch_on_torch_2_13",
                                          "graphpatch_demos_on_smollm2", "graph_surgery_on_smollm2"}
