"""Qwen2.5-VL equals transformers' Qwen2_5_VLForConditionalGeneration (float32, relative error < 1e-5): the vision
tower alone (window attention with 2 windows per image, one full-attention block), the M-RoPE positions of
get_rope_index, and the logits of a batch with two images of different grids in one row and a padded text-only
row; config layouts and loading errors."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.helpers import rel_err  # noqa: E402
from tests.vl_qwen_models import GRIDS, IMAGE, hf_qwen_vl, image_tokens, inputs  # noqa: E402
from tests import vl_qwen_models as qm  # noqa: E402
from unsloth_jax.families import QWEN2_5_VL  # noqa: E402
from unsloth_jax.errors import MissingTensorError  # noqa: E402
from unsloth_jax.hf.vision_io import load_vision_language_model  # noqa: E402
from unsloth_jax.models.vision_qwen2_5 import vision_layout  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    hf = hf_qwen_vl()
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module")
def ours(checkpoint):
    return load_vision_language_model(checkpoint[0], dtype="float32")


def test_window_layout_has_several_windows(ours):
    layout = vision_layout(ours.vl_config.vision, GRIDS)
    assert len(np.unique(layout["window_ids"])) == 4 and len(np.unique(layout["frame_ids"])) == 2
    assert not np.array_equal(layout["order"], np.arange(layout["order"].size))  # windows reorder the patches


def test_vision_tower_matches_transformers(checkpoint, ours, rng):
    _, hf = checkpoint
    pixels = rng.standard_normal((int(GRIDS.prod(-1).sum()), 96)).astype(np.float32)
    with torch.no_grad():
        ref = hf.model.visual(torch.tensor(pixels), grid_thw=torch.tensor(GRIDS)).pooler_output.numpy()
    out = np.asarray(ours.image_features(pixels, GRIDS))
    assert out.shape == (sum(image_tokens(g) for g in GRIDS), 64)
    err = rel_err(out, ref)
    print(f"vision tower relative error {err:.2e}")
    assert err < 1e-5, err


def test_vision_tower_at_the_hub_patch_and_window_sizes(tmp_path, rng):
    """The released models' patch geometry (patch 14, temporal patch 2, merge 2, window 112 px: 4 x 4 merged tokens;
    full attention in one block of four) at a tiny width, with grids whose merged sides are not multiples of the
    window (partial windows at the edges) and a two-frame one: the tower equals transformers' (float32)."""
    import transformers

    from unsloth_jax import FastVisionModel

    vision = dict(qm.VISION, depth=4, patch_size=14, window_size=112, fullatt_block_indexes=[2])
    cfg = transformers.Qwen2_5_VLConfig(text_config=dict(qm.TEXT), vision_config=vision, image_token_id=qm.IMAGE,
                                        video_token_id=qm.VIDEO, vision_start_token_id=qm.VSTART,
                                        vision_end_token_id=qm.VEND)
    for c in (cfg, cfg.text_config, cfg.vision_config):
        c._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, param in hf.model.visual.named_parameters():
            param.copy_((1.0 if "norm" in name or "ln_q" in name else 0.0) + 0.08 * torch.randn(param.shape))
    hf.save_pretrained(tmp_path)
    ours, _ = FastVisionModel.from_pretrained(tmp_path, dtype="float32", load_processor=False)
    grids = np.array([[1, 22, 18], [2, 12, 28], [1, 8, 8]])  # merged 11 x 9, 6 x 14 (2 frames), 4 x 4
    pixels = rng.standard_normal((int(grids.prod(-1).sum()), 3 * 2 * 14 * 14)).astype(np.float32)
    with torch.no_grad():
        ref = hf.model.visual(torch.tensor(pixels), grid_thw=torch.tensor(grids)).pooler_output.numpy()
    out = np.asarray(ours.image_features(pixels, grids))
    assert out.shape == ref.shape == (int(grids.prod(-1).sum()) // 4, qm.VISION["out_hidden_size"])
    err = rel_err(out, ref)
    print(f"vision tower at patch 14 / window 112: relative error {err:.2e}")
    assert err < 1e-5, err


def test_mrope_positions_match_get_rope_index(checkpoint, ours, rng):
    _, hf = checkpoint
    ids, mask, _, grids = inputs(rng)
    ref, _ = hf.model.get_rope_index(torch.tensor(ids), mm_token_type_ids=torch.tensor((ids == IMAGE).astype(int)),
                                     image_grid_thw=torch.tensor(grids), attention_mask=torch.tensor(mask))
    np.testing.assert_array_equal(ours.rope_positions(ids, mask, grids), ref.numpy())
    left = np.concatenate([np.zeros((2, 3), ids.dtype), ids[:, :-3]], axis=1)  # row 0's last 3 tokens are text
    left_mask = np.concatenate([np.zeros((2, 3), mask.dtype), mask[:, :-3]], axis=1)
    ref, _ = hf.model.get_rope_index(torch.tensor(left), mm_token_type_ids=torch.tensor((left == IMAGE).astype(int)),
                                     image_grid_thw=torch.tensor(grids), attention_mask=torch.tensor(left_mask))
    np.testing.assert_array_equal(ours.rope_positions(left, left_mask, grids), ref.numpy())
    with pytest.raises(ValueError, match="image_grid_thw entry"):
        ours.rope_positions(ids, mask, grids[::-1])


def test_logits_match_transformers_with_images(checkpoint, ours, rng):
    _, hf = checkpoint
    ids, mask, pixels, grids = inputs(rng)
    with torch.no_grad():
        ref = hf(torch.tensor(ids), attention_mask=torch.tensor(mask), pixel_values=torch.tensor(pixels),
                 image_grid_thw=torch.tensor(grids),
                 mm_token_type_ids=torch.tensor((ids == IMAGE).astype(int))).logits.numpy()
    out = np.asarray(ours(ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grids))
    real = mask.astype(bool)
    err = rel_err(out[real], ref[real])
    print(f"logits relative error {err:.2e}")
    assert err < 1e-5, err
    # plain 1D positions (no M-RoPE) change row 0's logits after the first image: the test above sees M-RoPE
    flat = np.asarray(ours(ids, attention_mask=mask, positions=np.cumsum(mask, 1) - 1, pixel_values=pixels,
                           image_grid_thw=grids))
    assert rel_err(flat[0], ref[0]) > 1e-3


def test_text_only_training_loss_matches_transformers(checkpoint, ours, rng):
    """The trainers' loss (train.step.loss_and_count) on a text-only batch, right padded: plain RoPE on all three
    axes, as transformers without images."""
    from unsloth_jax.train.step import loss_and_count

    _, hf = checkpoint
    ids = rng.integers(3, 240, size=(2, 16))
    mask = np.ones_like(ids)
    mask[1, 11:] = 0
    labels = np.where(mask == 1, ids, -100)
    with torch.no_grad():
        ref = float(hf(torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels)).loss)
    loss = float(loss_and_count(ours, dict(input_ids=ids, attention_mask=mask, labels=labels))[0])
    assert abs(loss - ref) / ref < 1e-5, (loss, ref)


def test_config_layouts(checkpoint):
    raw = json.loads((checkpoint[0] / "config.json").read_text())
    new = QWEN2_5_VL.parse_config(raw)
    assert new.mrope_section == (2, 3, 3) and new.vision.fullatt_block_indexes == (1,)
    assert new.text.qkv_bias and not new.text.o_bias and new.text.head_dim == 16
    flat = {k: v for k, v in raw.items() if k != "text_config"} | {
        k: v for k, v in raw["text_config"].items() if k not in ("rope_parameters", "model_type")}
    flat["rope_theta"] = 10000.0
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}
    assert QWEN2_5_VL.parse_config(flat) == new  # transformers 4's flat layout


# config.json of the Hub's Qwen2.5-VL-3B-Instruct (transformers 4's flat layout, tied embeddings)
HUB_3B = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
          "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
          "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
          "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 128000,
          "max_window_layers": 70, "model_type": "qwen2_5_vl", "num_attention_heads": 16, "num_hidden_layers": 36,
          "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
          "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
          "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                            "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
                            "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                            "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
                            "temporal_patch_size": 2},
          "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 151936}


def test_hub_config_and_refusals():
    from unsloth_jax.families import text_config
    from unsloth_jax.errors import ConfigError, UnsupportedArchitectureError

    with pytest.raises(UnsupportedArchitectureError, match="FastVisionModel"):  # not as a text model
        text_config(HUB_3B)

    cfg = QWEN2_5_VL.parse_config(HUB_3B)
    t, v = cfg.text, cfg.vision
    assert (t.hidden_size, t.num_hidden_layers, t.head_dim, t.num_key_value_heads) == (2048, 36, 128, 2)
    assert t.tie_word_embeddings and t.rope_theta == 1e6 and t.layer_windows == (None,) * 36 and t.qkv_bias
    assert cfg.mrope_section == (16, 24, 24) and cfg.image_token_id == 151655
    assert (v.depth, v.hidden_size, v.num_heads, v.patch_dim, v.window_size) == (32, 1280, 16, 1176, 112)
    assert v.fullatt_block_indexes == (7, 15, 23, 31) and v.tokens_per_second == 2
    with pytest.raises(ConfigError, match="mrope_section"):
        QWEN2_5_VL.parse_config(HUB_3B | {"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 20]}})
    with pytest.raises(ConfigError, match="window_size"):
        QWEN2_5_VL.parse_config(HUB_3B | {"vision_config": HUB_3B["vision_config"] | {"window_size": 100}})


def test_module_name_spelling_and_missing_tensor(checkpoint, ours, tmp_path):
    """transformers 5's module names (model.language_model.*, model.visual.*) load the same weights; a missing
    tensor is named."""
    from safetensors.numpy import load_file, save_file

    path, _ = checkpoint
    tensors = load_file(str(path / "model.safetensors"))
    assert "visual.merger.ln_q.weight" in tensors  # save_pretrained writes the Hub's names
    renamed = {("model.language_model." + k[6:] if k.startswith("model.") else
                "model." + k if k.startswith("visual.") else k): v for k, v in tensors.items()}
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    other = load_vision_language_model(tmp_path)
    np.testing.assert_array_equal(other.visual.blocks.attn.qkv.kernel[...], ours.visual.blocks.attn.qkv.kernel[...])
    np.testing.assert_array_equal(other.model.layers.self_attn.q_proj.bias[...],
                                  ours.model.layers.self_attn.q_proj.bias[...])
    del renamed["model.visual.merger.ln_q.weight"]
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(MissingTensorError, match="visual.merger.ln_q.weight"):
        load_vision_language_model(tmp_path)


# ---- LoRA through FastVisionModel (Unsloth's switches) against transformers + PEFT ----
@pytest.fixture(scope="module")
def fast(checkpoint):
    """FastVisionModel's QwenVisionModel (each test's get_peft_model replaces the pairs of the one before)."""
    from unsloth_jax import FastVisionModel
    from unsloth_jax import QwenVisionModel

    model, _ = FastVisionModel.from_pretrained(checkpoint[0], dtype="float32")
    assert isinstance(model, QwenVisionModel)
    return model


def _peft_regex(language, vision, attention=True, mlp=True) -> str:
    """PEFT's target_modules for Unsloth's switches, one alternative per tower (written independently of
    hf.vision_export)."""
    parts = []
    if language:
        mods = (["q_proj", "k_proj", "v_proj", "o_proj"] if attention else []) + (
            ["gate_proj", "up_proj", "down_proj"] if mlp else [])
        parts.append(rf".*language_model\.layers\.\d+\.(?:self_attn|mlp)\.(?:{'|'.join(mods)})")
    if vision:
        mods = (["qkv", "proj"] if attention else []) + (["gate_proj", "up_proj", "down_proj"] if mlp else [])
        parts.append(rf".*visual\.blocks\.\d+\.(?:attn|mlp)\.(?:{'|'.join(mods)})")
    return "|".join(parts)


@pytest.mark.parametrize("language,vision,attention,mlp", [(True, True, True, True), (False, True, True, False),
                                                          (True, False, False, True)],
                         ids=["both_all", "vision_attention", "language_mlp"])
def test_lora_counts_match_peft(checkpoint, fast, language, vision, attention, mlp):
    import copy

    import peft

    from unsloth_jax import FastVisionModel, lora

    path, hf = checkpoint
    model = FastVisionModel.get_peft_model(fast, r=4, lora_alpha=8, finetune_language_layers=language,
                                           finetune_vision_layers=vision, finetune_attention_modules=attention,
                                           finetune_mlp_modules=mlp, use_gradient_checkpointing=False)
    twin = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=_peft_regex(language, vision, attention, mlp)))
    n_peft = sum(p.numel() for n, p in twin.named_parameters() if "lora_" in n)
    assert lora.count(lora.split(model)[1]) == n_peft > 0


def test_lora_adapter_gradients_and_merged_export_match_transformers(checkpoint, fast, rng, tmp_path):
    """Random pairs on both towers: the saved adapter in transformers + PEFT gives our logits, the LoRA gradients
    of a next-token loss (through the vision tower's window attention) equal PEFT's, and the merged float32
    checkpoint gives the same logits in transformers without PEFT."""
    import copy

    import jax
    import jax.numpy as jnp
    import peft
    from flax import nnx

    from unsloth_jax import FastVisionModel, lora

    path, hf = checkpoint
    model = FastVisionModel.get_peft_model(fast, r=4, lora_alpha=8, finetune_vision_layers=True,
                                           use_gradient_checkpointing=False)
    state = nnx.state(model, nnx.LoRAParam)  # random B (and A): the adapter changes the logits
    nnx.update(model, nnx.from_flat_state({p: jnp.asarray(0.2 * rng.standard_normal(v.shape), jnp.float32)
                                           for p, v in nnx.to_flat_state(state)}))
    model.save_pretrained(tmp_path / "adapter")
    twin = peft.PeftModel.from_pretrained(copy.deepcopy(hf), str(tmp_path / "adapter"), is_trainable=True).eval()
    ids, mask, pixels, grids = inputs(rng)
    kw = dict(attention_mask=torch.tensor(mask), pixel_values=torch.tensor(pixels), image_grid_thw=torch.tensor(grids),
              mm_token_type_ids=torch.tensor((ids == IMAGE).astype(int)))
    ref = twin(input_ids=torch.tensor(ids), **kw).logits
    w = torch.tensor(mask[:, 1:], dtype=torch.float32)
    nll = torch.nn.functional.cross_entropy(ref[:, :-1].transpose(1, 2), torch.tensor(ids[:, 1:]), reduction="none")
    ((nll * w).sum() / w.sum()).backward()
    ref = ref.detach().numpy()
    with torch.no_grad():
        base = hf(torch.tensor(ids), **kw).logits.numpy()

    graphdef, trainable, frozen = lora.split(model)
    # a jitted step's batch: every array traced, the M-RoPE positions and the tower's layout built on the host
    batch = dict(input_ids=ids, attention_mask=mask, pixel_values=pixels,
                 positions=model.rope_positions(ids, mask, grids), vision_layout=model.vision_layout(grids))

    def loss(t, batch):
        logits = nnx.merge(graphdef, t, frozen)(**batch)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        nll = -jnp.take_along_axis(logp, batch["input_ids"][:, 1:, None], axis=-1)[..., 0]
        w = batch["attention_mask"][:, 1:]
        return (nll * w).sum() / w.sum(), logits

    (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(trainable, batch)
    real = mask.astype(bool)
    err = rel_err(np.asarray(out)[real], ref[real])
    assert rel_err(base[real], ref[real]) > 1e-2  # the adapter was applied
    print(f"LoRA logits relative error {err:.2e}")
    assert err < 1e-5, err
    theirs = {n: p.grad.numpy() for n, p in twin.named_parameters() if "lora_" in n}
    worst, seen = 0.0, 0
    for p, g in nnx.to_flat_state(grads):
        p = tuple(map(str, p))
        tower = "model.language_model.layers" if p[0] == "model" else "model.visual.blocks"
        ab = {"lora_a": "lora_A", "lora_b": "lora_B"}[p[-1]]
        g = np.asarray(g.get_value() if hasattr(g, "get_value") else g)
        for i in range(g.shape[0]):
            name = f"base_model.model.{tower}.{i}.{'.'.join(p[2:-1])}.{ab}.default.weight"
            worst = max(worst, rel_err(g[i].T, theirs.pop(name)))
            seen += 1
    assert not theirs and seen == 2 * (7 * 2 + 5 * 3), (sorted(theirs)[:4], seen)
    print(f"LoRA gradients worst relative error {worst:.2e}")
    assert worst < 1e-4, worst

    # the merged float32 checkpoint (both towers' pairs folded in) in transformers alone gives the same logits
    import transformers

    model.save_pretrained_merged(tmp_path / "merged", dtype="float32")
    merged, info = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        tmp_path / "merged", dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    merged.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        got = merged(torch.tensor(ids), **kw).logits.numpy()
    err = rel_err(got[real], ref[real])
    print(f"merged checkpoint logits relative error {err:.2e}")
    assert err < 1e-5, err
