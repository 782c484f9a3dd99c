"""README.md's Python blocks run as written, in order, on the bundled tiny model (issue 38, item 12): the inputs
the README names as the user's own (records, pairs, prompts, texts, input_ids/mask, path) come from the bundled
samples, and step counts are shrunk by a few textual substitutions listed here (nothing else is changed)."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from tests.helpers import ASSETS, ROOT, TINY_MODEL

# (README text, what the test runs instead): fewer steps and tokens on the CPU.
SHRINK = [("max_steps=60", "max_steps=3"), ('"path/to/hf-model"', "path"),
          ("max_completion_length=256", "max_completion_length=8, max_steps=1"),
          ("max_tokens=64", "max_tokens=8"), ("num_generations=8", "num_generations=2"),
          ("per_device_train_batch_size=8,", "per_device_train_batch_size=2,"), ("r=128", "r=8")]


def readme_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, re.S)


@pytest.mark.slow
@pytest.mark.torch
def test_readme_python_blocks_run_in_order(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    monkeypatch.chdir(tmp_path)
    rows = [json.loads(line) for line in (ASSETS / "alpaca_sample.jsonl").read_text().splitlines()[:16]]
    texts = [json.loads(line) for line in (ASSETS / "text_sample.jsonl").read_text().splitlines()[:16]]
    ids = np.random.default_rng(0).integers(3, 500, size=(2, 9))
    namespace = {"path": str(TINY_MODEL), "records": rows, "texts": texts, "input_ids": ids,
                 "mask": np.ones_like(ids),
                 "pairs": [{"prompt": r["instruction"], "chosen": " " + r["output"], "rejected": " I do not know."}
                           for r in rows[:4]],
                 "prompts": [{"prompt": r["instruction"]} for r in rows[:2]]}
    blocks = readme_blocks()
    assert len(blocks) >= 5
    used = set()
    for i, block in enumerate(blocks):
        for old, new in SHRINK:
            if old in block:
                used.add(old)
                block = block.replace(old, new)
        try:
            exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
        except Exception as e:  # noqa: BLE001 - name the block that failed
            raise AssertionError(f"README.md python block {i + 1} failed: {type(e).__name__}: {e}") from e
    assert used == {old for old, _ in SHRINK}, f"substitutions that no longer match README.md: {set(dict(SHRINK)) - used}"
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert namespace["trainer_stats"].global_step == 3
