"""Every notebook in notebooks/ is stored with the outputs of a full CPU run (scripts/execute_notebooks.py), what a
user opening it sees, and runs top to bottom (nbclient, python3 kernel of this environment), from a copy with its
outputs cleared, in a fresh temporary working directory. Each one trains, so both its stored and its executed
outputs must show a loss plot (an image/png output), a training loss that falls, a held-out loss
(held_out_facts.jsonl) that falls, and answers to held-out questions."""
from __future__ import annotations

import json
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from tests.helpers import ASSETS, ROOT, subprocess_env  # noqa: E402

# 05_grpo_smollm2 (GRPO on SmolLM2; tests/test_grpo_notebook.py) and vision_finetune (tests/test_vision_sample.py)
# are run shortened by their own tests, so the checks here (a training run's outputs; run at full length) leave
# them out.
NOTEBOOKS = sorted(p for p in (ROOT / "notebooks").glob("*.ipynb") if p.stem not in ("05_grpo_smollm2",
                                                                                      "vision_finetune"))
NEEDS = {"03_export": ("torch", "peft", "gguf"), "01_quickstart_lora": ("transformers",)}
TRAINING = {"01_quickstart_lora", "02_qlora", "03_export", "04_functional_core"}
# What a training notebook prints once it has trained: the first and last logged training loss, and (on the
# same line, for the main run) the held-out loss before and after training.
TRAIN_LINE = re.compile(r"training loss (\d+\.\d+) -> (\d+\.\d+)")
HELD_OUT_LINE = re.compile(r"training loss (\d+\.\d+) -> (\d+\.\d+).*held-out loss (\d+\.\d+) -> (\d+\.\d+)")


def check_stored_run(path) -> None:
    """The notebook at `path` is stored as one run left it: every code cell executed, in order, with no error
    output, and the file stays small (no progress bars or huge outputs)."""
    raw = json.loads(path.read_text())
    assert raw["metadata"]["kernelspec"]["name"] == "python3"
    cells = [c for c in raw["cells"] if c["cell_type"] == "code"]
    counts = [c["execution_count"] for c in cells]
    assert counts == list(range(1, len(cells) + 1)), f"{path.name}: not stored as one run (execution counts {counts})"
    errors = [o for c in cells for o in c["outputs"] if o["output_type"] == "error"]
    assert not errors, f"{path.name}: stored with an error: {errors[0].get('ename')}"
    assert path.stat().st_size < 400_000, f"{path.name}: {path.stat().st_size} bytes stored"


def test_notebooks_exist_and_carry_a_runs_outputs():
    names = {p.stem for p in NOTEBOOKS}
    assert {"01_quickstart_lora", "02_qlora", "03_export", "04_functional_core"} <= names
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        check_stored_run(path)
    for path in NOTEBOOKS:  # the stored outputs are a run that learned, as the executed ones must be
        if path.stem in TRAINING:
            check_training_outputs(path.stem, nbformat.read(path, as_version=4))


def _outputs(book) -> list[dict]:
    return [o for c in book.cells if c.cell_type == "code" for o in c.get("outputs", [])]


def _logged_losses(text: str) -> list[float]:
    """The training losses the notebook logged: SFTTrainer's printed log records ({"step": ..., "loss": ...}),
    or the notebook's own "loss per epoch:" line."""
    records = [json.loads(line) for line in text.splitlines() if line.startswith('{"step"')]
    if records:
        return [r["loss"] for r in records]
    line = next((x for x in text.splitlines() if x.startswith("loss per epoch:")), "")
    return [float(v) for v in line.split(":", 1)[1].split()] if line else []


def check_training_outputs(name: str, book) -> None:
    """The executed notebook `book` plotted its loss, its logged training loss fell and did not end going up,
    its held-out loss fell, and it asked the model held-out questions."""
    outputs = _outputs(book)
    # stdout only: a progress bar (stderr) may share a line with the trainer's log records
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream" and o.get("name") == "stdout")
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{name}: no loss plot (image/png output)"

    summaries = [tuple(map(float, m.groups())) for m in HELD_OUT_LINE.finditer(text)]
    assert summaries, f"{name}: no 'training loss A -> B | held-out loss C -> D' line in:\n{text[-3000:]}"
    first, last, held_before, held_after = summaries[0]
    assert held_after < held_before, f"{name}: held-out loss rises, {held_before} -> {held_after}"
    for m in TRAIN_LINE.finditer(text):  # every run of the notebook, the main one included
        assert float(m.group(2)) < float(m.group(1)), f"{name}: {m.group(0)}"

    logged = _logged_losses(text)
    assert len(logged) >= 3, f"{name}: fewer than 3 logged training losses"
    assert abs(logged[0] - first) < 6e-4 and abs(logged[-1] - last) < 6e-4, \
        f"{name}: printed training loss {first} -> {last}, logged {logged}"
    assert logged[-1] < logged[0] and logged[-1] <= 1.05 * min(logged), f"{name}: the loss ends going up: {logged}"

    held_out = [json.loads(line) for line in (ASSETS / "held_out_facts.jsonl").read_text().splitlines()]
    asked = [r["instruction"] for r in held_out if f"{r['instruction']} -> " in text]
    assert asked, f"{name}: asks the model no held-out question"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    for mod in ("matplotlib", *NEEDS.get(path.stem, ())):
        pytest.importorskip(mod)
    monkeypatch.setenv("PYTHONPATH", subprocess_env()["PYTHONPATH"])
    monkeypatch.setenv("TQDM_DISABLE", "1")
    book = nbformat.read(path, as_version=4)
    for cell in book.cells:  # the stored notebook holds a full run's outputs: check this run's only
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    client = nbclient.NotebookClient(book, timeout=240, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{path.name} failed:\n{str(e)[-4000:]}")
    assert any(c.get("outputs") for c in book.cells if c.cell_type == "code")
    if path.stem in TRAINING:
        check_training_outputs(path.stem, book)


def _executed(stream_text: str, png: bool = True):
    """A notebook as nbclient leaves it: one code cell with `stream_text` on stdout (and a PNG display)."""
    cell = nbformat.v4.new_code_cell("...")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=stream_text)]
    if png:
        cell.outputs.append(nbformat.v4.new_output("display_data", data={"image/png": "iVBORw0KGgo=",
                                                                         "text/plain": "<Figure>"}))
    book = nbformat.v4.new_notebook()
    book.cells.append(cell)
    return book


def test_training_checks_reject_bad_outputs():
    """check_training_outputs passes a good run and fails each way a notebook can go wrong."""
    question = json.loads((ASSETS / "held_out_facts.jsonl").read_text().splitlines()[0])["instruction"]

    def text(losses, held=(9.9, 0.2), asked=True):
        log = "".join(json.dumps({"step": 15 * i + 1, "loss": x}) + "\n" for i, x in enumerate(losses))
        line = f"training loss {losses[0]:.3f} -> {losses[-1]:.3f}"
        line += f" | held-out loss {held[0]:.3f} -> {held[1]:.3f}\n" if held else "\n"
        return log + line + (f"{question} -> an answer\n" if asked else "")

    good = [3.5, 1.2, 0.4, 0.2]
    check_training_outputs("good", _executed(text(good)))  # passes
    bad = {"no loss plot": _executed(text(good), png=False),
           "ends going up": _executed(text([3.5, 1.2, 0.2, 0.4])),
           "no 'training loss A -> B | held-out loss": _executed(text(good, held=None)),
           "held-out loss rises": _executed(text(good, held=(0.2, 0.3))),
           "no held-out question": _executed(text(good, asked=False)),
           "printed training loss 3.5 -> 0.1, logged": _executed(text(good).replace("-> 0.200 |", "-> 0.100 |"))}
    for message, book in bad.items():
        with pytest.raises(AssertionError, match=re.escape(message)):
            check_training_outputs("nb", book)
