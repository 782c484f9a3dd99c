"""bench/vision_bench.py at the tiny Qwen2.5-VL and Qwen3-VL shapes, both sides in this process (CPU, bfloat16):
each run's JSON line has the fields the GPU session files, and both sides train the same thing: the same trainable
parameter count and, with LoRA B = 0, the same first loss (the base model's) within bfloat16 rounding. The images
move that loss by about 0.9% / 1.3% (shuffled pixels), so a side that misplaced them would fail the bound."""
from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from bench import vision_bench  # noqa: E402

pytestmark = pytest.mark.torch
FIELDS = {"family", "shape", "side", "precision", "batch", "seq", "images", "real_tokens_per_step", "step_ms",
          "tokens_per_s", "peak_gib", "first_step_s", "trainable_params", "loss_first", "loss_last", "load_s"}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_both_sides_train_the_same_thing(tmp_path, family):
    checkpoint = str(tmp_path / f"{family}-tiny")
    assert vision_bench.main(["make", "--family", family, "--shape", "tiny", "--checkpoint", checkpoint]) == 0
    assert not vision_bench.make_checkpoint(family, "tiny", checkpoint)  # made once, then kept
    lines = {}
    for side in ("hf", "ours"):
        a = vision_bench.parse_args(["run", "--side", side, "--family", family, "--shape", "tiny",
                                     "--checkpoint", checkpoint, "--batch", "2", "--seq", "64",
                                     "--images-per-row", "2", "--steps", "2", "--warmup", "1"])
        lines[side] = line = json.loads(json.dumps(vision_bench.run(a)))
        assert FIELDS <= set(line), FIELDS - set(line)
        assert (line["side"], line["precision"], line["images"]) == (side, "bf16 LoRA", 4)
        assert line["real_tokens_per_step"] == 128 and line["image_tokens_per_step"] == 4 * 16
        assert line["losses_finite"] and line["tokens_per_s"] > 0 and line["steps_timed"] == 1
    hf, ours = lines["hf"], lines["ours"]
    assert hf["trainable_params"] == ours["trainable_params"] > 0
    # measured: qwen2_5_vl 6.86058 (hf) vs 6.86105 (ours), 7e-5 relative, shuffling the pixels moves it by 9e-3;
    # qwen3_vl 6.37375 vs 6.37388, 2e-5 relative, shuffling the pixels moves it by 1.3e-2
    assert math.isclose(hf["loss_first"], ours["loss_first"], rel_tol=2e-3), (hf["loss_first"], ours["loss_first"])


def test_hf_side_refuses_4bit():
    with pytest.raises(SystemExit):
        vision_bench.parse_args(["run", "--side", "hf", "--family", "gemma3", "--shape", "tiny", "--load-in-4bit"])
