"""Every notebook in notebooks/ is stored without outputs and runs top to bottom (nbclient, python3 kernel of
this environment) in a fresh temporary working directory."""
from __future__ import annotations

import json

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from tests.helpers import ROOT, subprocess_env  # noqa: E402

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
NEEDS = {"03_export": ("torch", "peft", "gguf"), "01_quickstart_lora": ("transformers",)}


def test_notebooks_exist_and_have_no_outputs():
    names = {p.stem for p in NOTEBOOKS}
    assert {"01_quickstart_lora", "02_qlora", "03_export", "04_functional_core"} <= names
    for path in NOTEBOOKS:
        raw = json.loads(path.read_text())
        for cell in raw["cells"]:
            if cell["cell_type"] == "code":
                assert cell["outputs"] == [] and cell["execution_count"] is None, f"{path.name} has stored outputs"
        assert raw["metadata"]["kernelspec"]["name"] == "python3"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    for mod in NEEDS.get(path.stem, ()):
        pytest.importorskip(mod)
    monkeypatch.setenv("PYTHONPATH", subprocess_env()["PYTHONPATH"])
    monkeypatch.setenv("TQDM_DISABLE", "1")
    book = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(book, timeout=240, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{path.name} failed:\n{str(e)[-4000:]}")
    assert any(c.get("outputs") for c in book.cells if c.cell_type == "code")
