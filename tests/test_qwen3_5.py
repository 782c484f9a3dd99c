"""Qwen3.5 text (model_type qwen3_5_text): gated DeltaNet linear-attention layers (three of four) and gated
full-attention layers, against transformers' Qwen3_5ForCausalLM in float32: config parsing and refusals, the 3:1
pattern as one layer segment under the remat / offload policies, logits of right-padded and packed rows, one LoRA
step (linear-attention projections included), the PEFT adapter and the merged checkpoint in PEFT / transformers,
greedy generation on the engine with rows admitted while others decode, and checkpoint extras transformers skips
(GGUF export: tests/test_gguf_families.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from tests.conftest import fresh_seed  # noqa: E402
from tests.family_checks import (assert_policies_equal_plain_stack, hf_f32, load_f32,  # noqa: E402
                                 lora_steps_lower_the_loss, torch_logits)
from tests.helpers import rel_err  # noqa: E402
from tests.hf_models import save_hf_model  # noqa: E402
from unsloth_jax import FastLanguageModel  # noqa: E402
from unsloth_jax.families import text_config  # noqa: E402
from unsloth_jax.errors import ConfigError, UnsupportedArchitectureError  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
       "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
BASE = dict(model_type="qwen3_5_text", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(source dir, transformers model, our model) of the tiny "qwen35" family (5 layers: linear x3, full,
    linear: layer_segments makes them one group of 5), built once per module."""
    path = tmp_path_factory.mktemp("qwen35")
    hf = save_hf_model("qwen35", path, seed=fresh_seed("qwen35 model") % (1 << 31))
    return path, hf, load_f32(path)








# ------------------------------------------------------------------------------------------------ config
def test_config_layer_pattern_and_refusals():
    """layer_types (default: every 4th layer full attention) gives the per-layer mixer switch, a layer kind the
    layer scan groups on (8 layers: one segment of 2 groups of 4); the (1 + w) norms, q/k norms, output gate and partial rotary are on; bad
    values raise ConfigError naming the config.json key, and the vision-language qwen3_5 is not a text config."""
    cfg = text_config(BASE)
    assert cfg.layer_linear == (True, True, True, False, True, True) and cfg.layer_period == 4
    assert text_config(BASE | {"num_hidden_layers": 8}).layer_segments == ((0, 4, 2),)
    assert cfg.attn_output_gate and cfg.qk_norm and cfg.norm_offset == 1.0 and cfg.rope_dim == 4
    assert cfg.linear_conv_dim == 2 * 2 * 8 + 4 * 8 and cfg.linear_conv_kernel == 4 and not cfg.tie_word_embeddings
    alt = text_config(BASE | {"layer_types": ["linear_attention", "full_attention"] * 3})
    assert alt.layer_period == 2 and alt.layer_segments == ((0, 2, 3),) and alt.layer_windows == (None,) * 6
    assert text_config(BASE | {"full_attention_interval": 3}).layer_linear == (True, True, False) * 2
    assert text_config(BASE | {"rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                                             "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 2],
                                                             "mrope_interleaved": True}}).rope_dim == 8
    for bad, key in [({"layer_types": ["linear_attention"] * 6}, "layer_types"),
                     ({"layer_types": ["sliding_attention"] * 6}, "layer_types"),
                     ({"layer_types": ["full_attention"] * 5}, "layer_types"),
                     ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
                     ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim"),
                     ({"attention_bias": True}, "attention_bias"),
                     ({"hidden_act": "gelu"}, "hidden_act"),
                     ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_type")]:
        with pytest.raises(ConfigError, match=key):
            text_config(BASE | bad)
    with pytest.raises(UnsupportedArchitectureError, match="FastVisionModel"):  # tests/test_vision_qwen3_5.py
        text_config({"model_type": "qwen3_5", "text_config": BASE})


# ------------------------------------------------------------------------------------------------ layer stack
def test_segment_scan_policies_equal_the_plain_stack(seed):
    """8 layers of the 3:1 pattern are one segment of 2 groups of 4 (the mixer is a layer kind of the scan); the
    loss and its gradients under host offload (the prefetched offload scan, checkpointed) and two-level
    checkpointing equal those of the plain scan. Gradient bound: per leaf, float32 rounding of another summation
    order on small gradients (max 1.6e-5 over 21 seeds)."""
    cfg = text_config(BASE | {"num_hidden_layers": 8})
    assert cfg.layer_segments == ((0, 4, 2),)
    assert_policies_equal_plain_stack(cfg, seed)


# ------------------------------------------------------------------------------------------------ logits
def test_logits_right_padded_and_packed(tiny, rng):
    """One call over three rows: a full row, a right-padded row (13 of 20 tokens) and a packed row of two
    sequences (7 + 9 tokens, positions restarting, then padding). Logits of every real token equal transformers'
    on each sequence alone: padding leaves the real tokens alone, and a segment start restarts the recurrent
    state and the causal conv. Bound 5e-5, as the merged export's below: transformers' chunked delta rule rounds
    differently in float32 (a CI run's random model gave 1.1e-5 on a 9-token segment; typically 2-4e-6)."""
    _, hf, model = tiny
    assert model.config.layer_period == 4 and model.config.num_hidden_layers == 5
    seqs = [rng.integers(3, 256, size=n) for n in (20, 13, 7, 9)]
    ids = np.zeros((3, 20), np.int64)
    mask = np.zeros_like(ids)
    seg = np.zeros_like(ids)
    pos = np.zeros_like(ids)
    ids[0], ids[1, :13], ids[2, :7], ids[2, 7:16] = seqs
    mask[0], mask[1, :13], mask[2, :16] = 1, 1, 1
    seg[0], seg[1, :13], seg[2, :7], seg[2, 7:16] = 1, 1, 1, 2
    pos[0], pos[1, :13], pos[2, :7], pos[2, 7:16] = np.arange(20), np.arange(13), np.arange(7), np.arange(9)
    ours = np.asarray(model(ids, mask, positions=pos, segment_ids=seg))
    spans = [(0, slice(0, 20)), (1, slice(0, 13)), (2, slice(0, 7)), (2, slice(7, 16))]
    for (row, span), seq in zip(spans, seqs):
        assert rel_err(ours[row, span], torch_logits(hf, seq[None])[0]) < 5e-5, (row, span)
    # right padding alone, as transformers takes it (attention_mask, no segments)
    padded = np.asarray(model(ids[:2], mask[:2]))
    assert rel_err(padded[1, :13], torch_logits(hf, ids[:2], mask[:2])[1, :13]) < 5e-5


# ------------------------------------------------------------------------------------------------ LoRA
def test_lora_step_peft_adapter_and_merged_export(tiny, tmp_path, rng):
    """One SFT step lowers the loss and trains only the LoRA factors (on the attention, MLP and linear-attention
    projections); with every lora_b random, the PEFT adapter (no keys for the mixer a layer lacks) loads in PEFT
    on transformers' model with our logits and in FastLanguageModel with our factors, and the merged checkpoint
    loads in transformers (Qwen3_5ForCausalLM, no missing or unexpected keys) with our logits."""
    from safetensors import safe_open

    from unsloth_jax.config import layer_has
    from unsloth_jax.models.decoder import PROJ_PARENT
    path, _, _ = tiny
    model = FastLanguageModel.get_peft_model(load_f32(path), r=4, lora_alpha=8, target_modules=ALL,
                                             use_gradient_checkpointing=True, random_state=int(rng.integers(1 << 30)))
    assert set(model.lora.target_modules) == set(ALL)
    g, t1, f = lora_steps_lower_the_loss(model, rng)
    model = nnx.merge(g, t1, f)
    for lin in model.projections().values():
        lin.lora_b[...] = np.asarray(0.05 * rng.standard_normal(lin.lora_b[...].shape), np.float32)
    ids = np.zeros((2, 18), np.int64)
    mask = np.zeros_like(ids)
    ids[0], ids[1, :11] = rng.integers(3, 256, size=18), rng.integers(3, 256, size=11)
    mask[0], mask[1, :11] = 1, 1
    real = mask.astype(bool)
    ours = np.asarray(model(ids, mask))
    model.save_pretrained(tmp_path / "adapter")
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "np") as fh:
        keys = set(fh.keys())
    assert any(".layers.0.linear_attn.in_proj_qkv.lora_A" in k for k in keys)
    assert not any(".layers.0.self_attn." in k or ".layers.3.linear_attn." in k for k in keys)
    pm = peft.PeftModel.from_pretrained(hf_f32(path), str(tmp_path / "adapter"), is_trainable=True)
    assert model.get_nb_trainable_parameters() == pm.get_nb_trainable_parameters()  # one mixer per layer counted
    assert rel_err(ours[real], torch_logits(pm, ids, mask)[real]) < 5e-5  # as the logits test's bound
    back = load_f32(tmp_path / "adapter")  # our loader reads the adapter back onto the base
    assert set(back.lora.target_modules) == set(ALL)
    for name, lin in back.projections().items():  # a mixer's stack holds the layers that have it, nothing else
        have = [i for i in range(5) if layer_has(model.config, i, f"{PROJ_PARENT[name]}.{name}.")]
        for leaf in ("lora_a", "lora_b"):
            assert getattr(lin, leaf)[...].shape[0] == len(have)
            np.testing.assert_array_equal(np.asarray(getattr(lin, leaf)[...]),
                                          np.asarray(getattr(model.projections()[name], leaf)[...]))
    model.save_pretrained_merged(tmp_path / "merged", None, dtype="float32")
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["model_type"] == "qwen3_5_text"
    merged, info = hf_f32(tmp_path / "merged", output_loading_info=True)
    assert type(merged).__name__ == "Qwen3_5ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    # 5e-5, not the 1e-5 of the other families: transformers' float32 chunked delta rule (a triangular solve per
    # chunk) and the merged kernels round differently; measured over 15 seeds: median 3e-6, max 1.5e-5
    assert rel_err(ours[real], torch_logits(merged, ids, mask)[real]) < 5e-5


# ------------------------------------------------------------------------------------------------ generation
def test_greedy_generation_with_admissions_matches_transformers(tiny, rng):
    """Greedy completions on the engine equal transformers' generate for each prompt: five prompts of different
    lengths, two completions each, on 8 rows with 2-token decode chunks, so the last prompt's rows are admitted
    (their recurrent states set from its prefill) while other rows decode, into rows a finished sequence left.
    The rows' recurrent states count against the KV cache cap."""
    from unsloth_jax.inference.engine import Engine
    from unsloth_jax.inference.sampling import SamplingParams

    _, hf, model = tiny
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (9, 4, 12, 6, 5)]
    budgets = [2, 7, 5, 7, 6]
    from unsloth_jax.inference import pages

    # the rows' recurrent states count against the KV cap: 40 pages of 16 tokens hold 8 rows of 2 pages + 2
    # pages of state each (16 rows without the states), and leave 16 pages for the KV pool
    per_page = pages.page_bytes(model.config, 16, model.dtype)
    assert -(-pages.state_bytes(model.config, model.dtype) // per_page) == 2
    assert Engine(model, kv_cache_gib=40 * per_page / 2**30)._sizes(300, 2) == (8, 16)
    engine = Engine(model, max_rows=8, chunk=2)
    outs = engine.generate(prompts, [SamplingParams(n=2, temperature=0.0, max_tokens=m) for m in budgets])
    assert engine.last_stats["rows"] == 8 and engine.last_stats["chunks"] >= 3
    for prompt, budget, out in zip(prompts, budgets, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=budget, do_sample=False, eos_token_id=[2],
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert [c.token_ids for c in out.outputs] == [ref, ref], (prompt, budget)


def test_checkpoint_extras_skipped_and_missing_tensor_named(tiny, tmp_path):
    """As transformers' Qwen3_5ForCausalLM, a checkpoint's multi-token-prediction head (mtp.*) is skipped; a
    missing linear-attention tensor is named."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from unsloth_jax.errors import MissingTensorError

    path, _, model = tiny
    tensors = load_file(str(path / "model.safetensors"))
    for name, extra in (("with_mtp", {"mtp.fc.weight": np.ones((4, 4), np.float32)}), ("missing", None)):
        out = tmp_path / name
        out.mkdir()
        shutil.copy(path / "config.json", out / "config.json")
        kept = dict(tensors, **extra) if extra else {k: v for k, v in tensors.items()
                                                       if k != "model.layers.4.linear_attn.A_log"}
        save_file(kept, str(out / "model.safetensors"))
    back = load_f32(tmp_path / "with_mtp")
    np.testing.assert_array_equal(np.asarray(back.model.layers.linear_attn.A_log[...]),
                                  np.asarray(model.model.layers.linear_attn.A_log[...]))
    with pytest.raises(MissingTensorError, match="model.layers.4.linear_attn.A_log"):
        load_f32(tmp_path / "missing")
