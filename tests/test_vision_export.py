"""Export of a Gemma 3 vision-language LoRA model to transformers: the PEFT adapter (language and vision pairs)
loads with PEFT onto transformers' Gemma3ForConditionalGeneration and gives our logits; the merged 16-bit
checkpoint loads in transformers (and back here) with no tensor missing and gives our logits (float32 export: the same bound; bfloat16:
the rounding of 16-bit weights)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from tests import vl_models  # noqa: E402
from tests.helpers import rel_err  # noqa: E402
from tests.test_vision_sft import _load, _randomise_lora, checkpoint  # noqa: E402,F401

pytestmark = pytest.mark.torch


def _batch(model, processor):
    from unsloth_jax import UnslothVisionDataCollator

    records = vl_models.shapes_dataset(2)
    records[1]["messages"][1]["content"][0]["text"] += " Nothing else is there."
    return UnslothVisionDataCollator(model, processor)(records)


def _ours(model, batch):
    return np.asarray(model(batch["input_ids"], attention_mask=batch["attention_mask"],
                            pixel_values=batch["pixel_values"], token_type_ids=batch["token_type_ids"]))


def _theirs(hf, batch):
    kw = {k: torch.tensor(v).long() if k != "pixel_values" else torch.tensor(v) for k, v in batch.items()
          if k != "labels"}
    with torch.no_grad():
        return hf(**kw).logits.float().numpy()


@pytest.fixture(scope="module")
def trained(checkpoint):  # noqa: F811
    """Our model with random LoRA pairs on both towers (every projection), its processor and a batch."""
    model, processor = _load(checkpoint[0], finetune_vision_layers=True)
    _randomise_lora(model, seed=2)
    return model, processor, _batch(model, processor)


def test_adapter_loads_in_peft_with_equal_logits(checkpoint, trained, tmp_path):  # noqa: F811
    import json

    path, hf = checkpoint
    model, processor, batch = trained
    model.save_pretrained(tmp_path / "adapter", processor)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert isinstance(config["target_modules"], str) and config["base_model_name_or_path"] == str(path)
    import copy

    twin = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "adapter").eval()
    n_lora = sum(1 for n, _ in twin.named_parameters() if "lora_A" in n)
    assert n_lora == 7 * 2 + 6 * 2  # 7 language + 6 vision projections, 2 layers each
    real = batch["attention_mask"].astype(bool)
    ours, theirs = _ours(model, batch), _theirs(twin, batch)
    err = rel_err(ours[real], theirs[real])
    base = rel_err(_theirs(hf, batch)[real], theirs[real])
    print(f"adapter: logits relative error {err:.1e} (the adapter moves them by {base:.1e})")
    assert err < 1e-5 and base > 1e-2, (err, base)


@pytest.mark.parametrize("dtype,bound", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_merged_checkpoint_loads_in_transformers_with_equal_logits(trained, tmp_path, dtype, bound):
    import transformers

    from unsloth_jax import FastVisionModel

    model, processor, batch = trained
    out = tmp_path / "merged"
    model.save_pretrained_merged(out, processor, save_method="merged_16bit", dtype=dtype)
    hf, info = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    hf.eval()
    # nothing missing: SigLIP's pooling head (unused by Gemma 3) is written through from the source checkpoint
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    source = transformers.Gemma3ForConditionalGeneration.from_pretrained(model.model_dir, dtype=torch.float32)
    head = {n: p for n, p in source.named_parameters() if ".head." in n}
    assert len(head) == 11, sorted(head)  # probe, attention in/out weight and bias, layernorm, mlp fc1/fc2
    for name, p in hf.named_parameters():
        if name in head:
            assert torch.equal(p, head[name].to(getattr(torch, dtype)).float()), name
    assert transformers.AutoProcessor.from_pretrained(out).tokenizer.image_token_id == vl_models.IMAGE
    real = batch["attention_mask"].astype(bool)
    ours = _ours(model, batch)
    err = rel_err(ours[real], _theirs(hf, batch)[real])
    back, _ = FastVisionModel.from_pretrained(out, dtype="float32")
    reloaded = _ours(back, batch)
    again = rel_err(ours[real], reloaded[real])
    same_file = rel_err(reloaded[real], _theirs(hf, batch)[real])  # both read the written 16-bit weights
    print(f"merged {dtype}: transformers' logits relative error {err:.1e}, reloaded here {again:.1e}, "
          f"transformers vs reloaded {same_file:.1e}")
    assert err < bound and again < bound and same_file < 1e-5, (err, again, same_file)


def test_language_only_adapter_adapts_no_vision_module(checkpoint, tmp_path):  # noqa: F811
    """The default (language layers only): PEFT, reading the adapter's target_modules regex, adapts the 7 language
    projections and none of the vision tower's q/k/v_proj, which share their names."""
    import copy

    path, hf = checkpoint
    model, processor = _load(path)
    _randomise_lora(model, seed=3)
    batch = _batch(model, processor)
    model.save_pretrained(tmp_path / "adapter")
    twin = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "adapter").eval()
    adapted = [n for n, _ in twin.named_parameters() if "lora_A" in n]
    assert len(adapted) == 14 and not any("vision_tower" in n for n in adapted)
    real = batch["attention_mask"].astype(bool)
    assert rel_err(_ours(model, batch)[real], _theirs(twin, batch)[real]) < 1e-5
