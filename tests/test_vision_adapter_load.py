"""Loading a saved Gemma 3 vision-language LoRA adapter back (FastVisionModel.from_pretrained(adapter_dir)): the
reloaded model's settings and logits equal the saving model's (float32, LoRA on both towers, random non-zero
pairs), which transformers + PEFT also give; bad adapter directories are named."""
from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from tests.helpers import rel_err  # noqa: E402
from tests.test_vision_export import _batch, _ours, _theirs  # noqa: E402
from tests.test_vision_sft import _load, _randomise_lora, checkpoint  # noqa: E402,F401
from unsloth_jax.errors import CheckpointNotFoundError, ConfigError, UnexpectedTensorError  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def saved(checkpoint, tmp_path_factory):  # noqa: F811
    """An adapter (vision attention + every language projection, r=4, alpha=8) saved with the processor, and the
    model that saved it."""
    model, processor = _load(checkpoint[0], finetune_vision_layers=True, finetune_mlp_modules=False,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"])
    _randomise_lora(model, seed=7)
    out = tmp_path_factory.mktemp("vl_adapter") / "adapter"
    model.save_pretrained(out, processor)
    return out, model, processor


def test_adapter_loads_back_with_equal_logits(checkpoint, saved):  # noqa: F811
    import copy

    from unsloth_jax import FastVisionModel, VisionModel

    out, model, processor = saved
    back, back_processor = FastVisionModel.from_pretrained(out, dtype="float32")
    assert isinstance(back, VisionModel) and back_processor is not None
    assert back.lora == model.lora, (back.lora, model.lora)
    assert back.lora.vision_target_modules == ("q_proj", "k_proj", "v_proj", "out_proj")
    batch = _batch(model, processor)
    real = batch["attention_mask"].astype(bool)
    ours, again = _ours(model, batch)[real], _ours(back, batch)[real]
    twin = peft.PeftModel.from_pretrained(copy.deepcopy(checkpoint[1]), out).eval()
    theirs = _theirs(twin, batch)[real]
    base = _theirs(checkpoint[1], batch)[real]
    err, peft_err, moved = rel_err(again, ours), rel_err(again, theirs), rel_err(base, theirs)
    print(f"reloaded adapter: logits relative error {err:.1e} vs the saving model, {peft_err:.1e} vs PEFT "
          f"(the adapter moves them by {moved:.1e})")
    assert err < 1e-6 and peft_err < 1e-5 and moved > 1e-2, (err, peft_err, moved)


def test_bad_adapter_directories_are_named(saved, tmp_path):
    from unsloth_jax import FastVisionModel

    out = saved[0]

    def variant(name, edit):
        d = tmp_path / name
        shutil.copytree(out, d)
        cfg = json.loads((d / "adapter_config.json").read_text())
        edit(cfg)
        (d / "adapter_config.json").write_text(json.dumps(cfg))
        return d

    missing_base = variant("missing_base", lambda c: c.update(base_model_name_or_path=str(tmp_path / "nowhere")))
    with pytest.raises(CheckpointNotFoundError, match="nowhere"):
        FastVisionModel.from_pretrained(missing_base)
    nothing = variant("nothing", lambda c: c.update(target_modules=["not_a_proj"]))
    with pytest.raises(ConfigError, match="matches no projection"):
        FastVisionModel.from_pretrained(nothing, dtype="float32")
    fewer = variant("fewer", lambda c: c.update(target_modules=r".*language_model\.layers\.\d+\.self_attn\.q_proj"))
    with pytest.raises(UnexpectedTensorError, match="do not fit adapter_config.json.s targets"):
        FastVisionModel.from_pretrained(fewer, dtype="float32")
    subset = variant("subset", lambda c: c.update(target_modules=r".*language_model\.layers\.0\.self_attn\.q_proj"))
    with pytest.raises(ConfigError, match="subset of layers"):
        FastVisionModel.from_pretrained(subset, dtype="float32")
