"""Qwen2.5-VL through FastVisionModel.from_pretrained beyond 16/32 bits (tiny random checkpoint, float32):

- load_in_4bit=True: the language model's projections in NF4 (bitsandbytes' values), the vision blocks and merger
  dense; logits equal transformers' with the dequantized weights in its language Linears, near the dense model's;
  greedy generation with images equals transformers' with those weights; a LoRA step on top has finite gradients
  for the LoRA pairs only and lowers the loss.
- a saved adapter (ours, with and without vision-block LoRA; PEFT's own on transformers' model, in transformers 5's
  and 4's key spellings) loads back onto the base with the saving model's / transformers + PEFT's logits; bad
  adapter directories are named.
"""
from __future__ import annotations

import copy
import json
import re
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from tests.helpers import rel_err  # noqa: E402
from tests.test_vision_qwen2_5_vl import checkpoint  # noqa: E402,F401
from tests.vl_qwen_models import IMAGE, inputs  # noqa: E402
from unsloth_jax.errors import (ConfigError, MissingTensorError, ShapeMismatchError,  # noqa: E402
                                UnexpectedTensorError)

pytestmark = pytest.mark.torch


def _ours(model, batch) -> np.ndarray:
    """Our logits [B, S, V] float32 on `batch` (inputs()'s ids, mask, pixels, grids)."""
    ids, mask, pixels, grids = batch
    return np.asarray(model(ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grids))


def _theirs(hf, batch) -> np.ndarray:
    """transformers' (or PEFT's) logits [B, S, V] on the same batch."""
    ids, mask, pixels, grids = batch
    with torch.no_grad():
        return hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), pixel_values=torch.tensor(pixels),
                  image_grid_thw=torch.tensor(grids),
                  mm_token_type_ids=torch.tensor((ids == IMAGE).astype(int))).logits.numpy()


def _randomise_lora(model, seed: int) -> None:
    """Every LoRA pair of `model` (A and B) set to random values of scale 0.2, so the adapter moves the logits."""
    import jax.numpy as jnp
    from flax import nnx

    rng = np.random.default_rng(seed)
    state = nnx.state(model, nnx.LoRAParam)
    nnx.update(model, nnx.from_flat_state({p: jnp.asarray(0.2 * rng.standard_normal(v.shape), jnp.float32)
                                           for p, v in nnx.to_flat_state(state)}))


@pytest.fixture(scope="module")
def batch():
    """Two rows: both images of vl_qwen_models.GRIDS in row 0, a padded text-only row 1."""
    return inputs(np.random.default_rng(0))


# ---------------------------------------------------------------------------------------- 4-bit (QLoRA)
@pytest.fixture(scope="module")
def quantized(checkpoint):  # noqa: F811
    """Our 4-bit model, and transformers' model with our dequantized NF4 language weights (an independent forward
    of the weights we hold)."""
    import jax.numpy as jnp

    from pallas_kernels.nf4 import dequantize_nf4
    from unsloth_jax import FastVisionModel, QwenVisionModel
    from unsloth_jax.models import NF4Param

    path, hf = checkpoint
    model, _ = FastVisionModel.from_pretrained(path, dtype="float32", load_in_4bit=True)
    assert isinstance(model, QwenVisionModel)
    twin = copy.deepcopy(hf)
    for name, lin in model.projections().items():
        assert isinstance(lin.kernel, NF4Param), name
        deq = np.asarray(dequantize_nf4(lin.kernel.get_value(), jnp.float32))  # [L, out, in], HF layout
        for i, layer in enumerate(twin.model.language_model.layers):
            linear = getattr(layer.self_attn, name, None) or getattr(layer.mlp, name)
            assert 0.05 < rel_err(deq[i], linear.weight.detach().numpy()) < 0.12, (name, i)  # NF4's usual error
            with torch.no_grad():
                linear.weight.copy_(torch.from_numpy(np.array(deq[i])))
    for name, lin in model.vision_projections().items():  # the vision blocks and the merger stay dense
        assert not isinstance(lin.kernel, NF4Param) and lin.kernel[...].dtype == jnp.float32, name
    assert model.visual.merger.mlp_0.kernel[...].dtype == jnp.float32
    assert model.model.layers.self_attn.q_proj.bias[...].dtype == jnp.float32  # Qwen2's q/k/v biases: dense
    return model, twin


def test_4bit_weights_are_bitsandbytes_nf4(checkpoint, quantized):  # noqa: F811
    """Each language projection dequantizes to what bitsandbytes' own NF4 (blocks of 64, double quantization)
    gives for the checkpoint's weight."""
    import jax.numpy as jnp

    F = pytest.importorskip("bitsandbytes.functional")
    from pallas_kernels.nf4 import dequantize_nf4

    model, _ = quantized
    layer = checkpoint[1].model.language_model.layers[1]
    for name, lin in model.projections().items():
        weight = (getattr(layer.self_attn, name, None) or getattr(layer.mlp, name)).weight.detach()
        packed, state = F.quantize_4bit(weight, quant_type="nf4", blocksize=64, compress_statistics=True)
        ref = F.dequantize_4bit(packed, state).numpy()
        deq = np.asarray(dequantize_nf4(lin.kernel.get_value(), jnp.float32))[1]
        assert rel_err(deq, ref) < 1e-6, (name, rel_err(deq, ref))  # last-bit differences of the statistics


def test_4bit_logits_equal_transformers_with_dequantized_weights(checkpoint, quantized, batch):  # noqa: F811
    model, twin = quantized
    real = batch[1].astype(bool)
    ours = _ours(model, batch)[real]
    err = rel_err(ours, _theirs(twin, batch)[real])
    dense = rel_err(ours, _theirs(checkpoint[1], batch)[real])
    print(f"4-bit: logits relative error {err:.1e} vs transformers with the dequantized weights, {dense:.1e} vs "
          "the unquantized model")
    assert err < 1e-4, err
    assert 10 * err < dense < 0.3, dense  # NF4's error (0.19 here), well below a wrongly placed weight's ~1


def test_4bit_generation_equals_transformers_with_dequantized_weights(checkpoint, quantized):  # noqa: F811
    """Greedy generation with images on a fresh 4-bit load (NF4 decode path) equals transformers' generate with
    the dequantized weights, on test_vision_qwen_generate's left-padded batch of two rows and three images."""
    from tests.test_vision_qwen_generate import NEW, _batch, _hf_generate
    from unsloth_jax import FastVisionModel

    model, _ = FastVisionModel.from_pretrained(checkpoint[0], dtype="float32", load_in_4bit=True,
                                               load_processor=False)
    inputs = _batch(seed=1)
    ours = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    np.testing.assert_array_equal(ours, _hf_generate(quantized[1], inputs))


def test_qlora_step_trains_lora_pairs_only(quantized, batch, tmp_path):
    """get_peft_model on the 4-bit model (both towers): the trainable state is the LoRA pairs, their gradients
    are finite (B's non-zero), a plain gradient step lowers the loss, and the adapter saved from it loads back
    onto the 4-bit base (load_in_4bit=True) with the same logits."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from unsloth_jax import FastVisionModel, lora
    from unsloth_jax.models import NF4Param
    from unsloth_jax.train.step import loss_and_count

    model = FastVisionModel.get_peft_model(quantized[0], r=4, lora_alpha=8, finetune_vision_layers=True,
                                           use_gradient_checkpointing=False)
    graphdef, trainable, frozen = lora.split(model)
    paths = [tuple(map(str, p)) for p, _ in nnx.to_flat_state(trainable)]
    assert paths and all(p[-1] in ("lora_a", "lora_b") for p in paths), paths
    assert len(paths) == 2 * (7 + 5)  # every language and vision-block projection, stacked over layers
    assert any(isinstance(v, NF4Param) for _, v in nnx.to_flat_state(frozen))

    ids, mask, pixels, grids = batch
    train_batch = dict(input_ids=ids, attention_mask=mask, labels=np.where(mask == 1, ids, -100),
                       pixel_values=pixels, mrope_positions=model.rope_positions(ids, mask, grids),
                       **{f"vision_{k}": v for k, v in model.vision_layout(grids).items()})

    @jax.jit  # the batch traced, as in the jitted train step
    def loss_and_grads(t, b):
        return jax.value_and_grad(lambda t: loss_and_count(nnx.merge(graphdef, t, frozen), b)[0])(t)

    loss, grads = loss_and_grads(trainable, train_batch)
    assert jnp.isfinite(loss)
    flat = {tuple(map(str, p)): np.asarray(g.get_value() if hasattr(g, "get_value") else g)
            for p, g in nnx.to_flat_state(grads)}
    assert all(np.isfinite(g).all() for g in flat.values())
    assert all(np.abs(g).max() > 0 for p, g in flat.items() if p[-1] == "lora_b"), "B = 0 gets a gradient"
    stepped = jax.tree.map(lambda w, g: w - 0.5 * g, trainable, grads)
    loss_after, _ = loss_and_grads(stepped, train_batch)
    print(f"QLoRA loss {float(loss):.4f} -> {float(loss_after):.4f} after one gradient step")
    assert float(loss_after) < float(loss), (float(loss), float(loss_after))

    nnx.update(model, stepped)
    model.save_pretrained(tmp_path / "adapter")
    back, _ = FastVisionModel.from_pretrained(tmp_path / "adapter", dtype="float32", load_in_4bit=True)
    assert back.lora == model.lora and isinstance(back.model.layers.mlp.up_proj.kernel, NF4Param)
    np.testing.assert_array_equal(_ours(back, batch), _ours(model, batch))


# ---------------------------------------------------------------------------------------- adapter reload
@pytest.fixture(scope="module")
def saved(checkpoint, tmp_path_factory):  # noqa: F811
    """{vision LoRA on: (adapter directory, the model that saved it)}: adapters (r=4, alpha=8, every language
    projection, and with True every vision-block projection too) saved by our model with random pairs."""
    from unsloth_jax import FastVisionModel

    out = {}
    for vision in (True, False):
        model, _ = FastVisionModel.from_pretrained(checkpoint[0], dtype="float32")
        model = FastVisionModel.get_peft_model(model, r=4, lora_alpha=8, finetune_vision_layers=vision,
                                               use_gradient_checkpointing=False)
        _randomise_lora(model, seed=3)
        out[vision] = (tmp_path_factory.mktemp("qwen_adapter") / "adapter", model)
        model.save_pretrained(out[vision][0])
    return out


@pytest.mark.parametrize("vision", [True, False], ids=["vision_lora", "language_only"])
def test_saved_adapter_loads_back_with_equal_logits(checkpoint, saved, batch, vision):  # noqa: F811
    from unsloth_jax import FastVisionModel, QwenVisionModel

    out, model = saved[vision]
    back, _ = FastVisionModel.from_pretrained(out, dtype="float32")
    assert isinstance(back, QwenVisionModel) and back.lora == model.lora, (back.lora, model.lora)
    assert back.lora.vision_target_modules == (("qkv", "proj", "gate_proj", "up_proj", "down_proj") if vision
                                               else None)
    again = _ours(back, batch)
    np.testing.assert_array_equal(again, _ours(model, batch))
    real = batch[1].astype(bool)
    moved = rel_err(_theirs(checkpoint[1], batch)[real], again[real])
    print(f"reloaded Qwen2.5-VL adapter (vision LoRA {vision}): logits equal the saving model's (the adapter "
          f"moves them by {moved:.1e})")
    assert moved > 1e-2


@pytest.fixture(scope="module")
def peft_adapter(checkpoint, tmp_path_factory):  # noqa: F811
    """An adapter PEFT wrote for transformers' Qwen2_5_VLForConditionalGeneration (target_modules a list that
    catches both towers: q_proj, v_proj, qkv and every down_proj; rsLoRA), random non-zero pairs, and that model."""
    path, hf = checkpoint
    cfg = peft.LoraConfig(r=4, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj", "qkv", "down_proj"])
    twin = peft.get_peft_model(copy.deepcopy(hf), cfg)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    twin.peft_config["default"].base_model_name_or_path = str(path)
    out = tmp_path_factory.mktemp("qwen_peft") / "adapter"
    twin.save_pretrained(out)
    return out, twin.eval()


def _checkpoint_spelling(adapter_dir, out_dir) -> None:
    """A copy of `adapter_dir` with its keys in the checkpoint spelling (model.layers, visual.blocks) that PEFT on
    transformers 4 writes."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(adapter_dir, out_dir)
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    renamed = {k.replace("model.model.language_model.layers", "model.model.layers")
               .replace("model.model.visual.blocks", "model.visual.blocks"): v for k, v in tensors.items()}
    assert len(renamed) == len(tensors) and renamed != tensors
    assert any(k.startswith("base_model.model.visual.blocks.") for k in renamed)
    save_file(renamed, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})


def test_peft_adapter_loads_with_peft_logits(checkpoint, peft_adapter, batch, tmp_path):  # noqa: F811
    from unsloth_jax import FastVisionModel

    out, twin = peft_adapter
    keys = json.loads((out / "adapter_config.json").read_text())
    assert keys["use_rslora"] and sorted(keys["target_modules"]) == ["down_proj", "q_proj", "qkv", "v_proj"]
    real = batch[1].astype(bool)
    theirs = _theirs(twin, batch)[real]
    assert rel_err(_theirs(checkpoint[1], batch)[real], theirs) > 1e-2  # the adapter moves the logits
    _checkpoint_spelling(out, tmp_path / "tf4")
    for adapter_dir in (out, tmp_path / "tf4"):
        model, _ = FastVisionModel.from_pretrained(adapter_dir, dtype="float32")
        lo = model.lora
        assert (lo.r, lo.lora_alpha, lo.use_rslora) == (4, 16, True)
        assert lo.target_modules == ("q_proj", "v_proj", "down_proj") and lo.vision_target_modules == (
            "qkv", "down_proj")
        err = rel_err(_ours(model, batch)[real], theirs)
        print(f"PEFT's adapter ({adapter_dir.name}): logits relative error {err:.1e} vs transformers + PEFT")
        assert err < 1e-5, err


def _variant(src, dst, *, config=None, tensors=None):
    """A copy of adapter directory `src` at `dst`, adapter_config.json updated by `config` (a dict) and its
    tensors replaced by `tensors(dict) -> dict`."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    if config:
        raw = json.loads((dst / "adapter_config.json").read_text())
        (dst / "adapter_config.json").write_text(json.dumps(raw | config))
    if tensors:
        weights = dst / "adapter_model.safetensors"
        save_file(tensors(load_file(str(weights))), str(weights), metadata={"format": "pt"})
    return dst


def test_bad_adapter_directories_are_named(saved, tmp_path):
    from unsloth_jax import FastVisionModel

    out = saved[True][0]
    key = "base_model.model.model.visual.blocks.2.attn.qkv.lora_B.weight"

    def drop(t):
        return {k: v for k, v in t.items() if k != key}

    def wrong_rank(t):
        return t | {key: np.zeros((t[key].shape[0], 3), np.float32)}

    missing = _variant(out, tmp_path / "missing", tensors=drop)
    with pytest.raises(MissingTensorError,
                       match=rf"{re.escape(str(missing))}.*missing 1 LoRA tensor.*{re.escape(key)}"):
        FastVisionModel.from_pretrained(missing, dtype="float32")
    rank = _variant(out, tmp_path / "rank", tensors=wrong_rank)
    with pytest.raises(ShapeMismatchError, match=rf"{re.escape(str(rank))}.*'{re.escape(key)}' has shape "
                                                 r"\[96, 3\], expected \[96, 4\]"):
        FastVisionModel.from_pretrained(rank, dtype="float32")
    subset = _variant(out, tmp_path / "subset", config={"target_modules": r".*visual\.blocks\.[01]\.attn\.qkv"})
    with pytest.raises(ConfigError, match=r"qkv of the vision layers \[0, 1\] only; a subset of layers"):
        FastVisionModel.from_pretrained(subset, dtype="float32")
    fewer = _variant(out, tmp_path / "fewer", config={"target_modules": r".*language_model\.layers\.\d+\.self_attn"
                                                                        r"\.q_proj"})
    with pytest.raises(UnexpectedTensorError, match="do not fit adapter_config.json.s targets"):
        FastVisionModel.from_pretrained(fewer, dtype="float32")
    nothing = _variant(out, tmp_path / "nothing", config={"target_modules": ["not_a_proj"]})
    with pytest.raises(ConfigError, match="matches no projection of this Qwen2.5-VL model.*vision qkv, proj"):
        FastVisionModel.from_pretrained(nothing, dtype="float32")
