"""Gemma 4 text at the released checkpoints' shapes (tests/hf_models.py's tiny "gemma4" with OVERRIDES):
"gemma4_shapes", the full-attention layers at global_head_dim 64 (head_dim 32) with the KV-shared layers'
double-wide MLP (E2B / E4B), and
"gemma4_keqv", the full layers at 64 with one key/value head whose values are the key projection
(attention_k_eq_v, num_global_key_value_heads; the dense 31B). Against transformers in float32: the per-kind
sub-stacks (self_attn, global_attn, shared_attn, shared_global_attn, mlp, wide_mlp) and their counts, logits
on right-padded rows past the window, one LoRA step, the PEFT adapter and the merged checkpoint loaded by PEFT /
transformers with our logits, PEFT's own adapter loaded here, and greedy generation on the engine."""
from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from tests.conftest import fresh_seed  # noqa: E402
from tests.family_checks import (assert_greedy_matches_transformers, assert_lora_gradients_match_peft,  # noqa: E402
                                 assert_policies_equal_plain_stack, hf_f32, load_f32, trained_with_random_b,
                                 right_padded, torch_logits)
from tests.helpers import rel_err  # noqa: E402
from tests.hf_models import FAMILIES, save_hf_model  # noqa: E402
from unsloth_jax import FastLanguageModel  # noqa: E402
from unsloth_jax.config import layer_has, layer_module, stack_holders  # noqa: E402
from unsloth_jax.families import text_config  # noqa: E402
from unsloth_jax.lora import count  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BASE = FAMILIES["gemma4"] | dict(model_type="gemma4_text", vocab_size=256, hidden_size=64, intermediate_size=128,
                                 num_attention_heads=4, num_key_value_heads=2)
# The released checkpoints' shapes on the tiny "gemma4" config: the full layers at global_head_dim 64 (twice head_dim)
# with the KV-shared layers' double-wide MLP (E2B / E4B); keys as values with one global key/value head and no KV
# sharing (the dense 31B)
OVERRIDES = {"gemma4_shapes": dict(global_head_dim=64, use_double_wide_mlp=True),
             "gemma4_keqv": dict(global_head_dim=64, attention_k_eq_v=True, num_global_key_value_heads=1,
                                 num_kv_shared_layers=0)}
# layers s s s s s g | s g (the last forced full); the KV-shared 6, 7 read 4, 5
HOLDERS = {
    "gemma4_shapes": {"self_attn": (0, 1, 2, 3, 4), "global_attn": (5,), "shared_attn": (6,),
                      "shared_global_attn": (7,), "mlp": tuple(range(6)), "wide_mlp": (6, 7)},
    "gemma4_keqv": {"self_attn": (0, 1, 2, 3, 4, 6), "global_attn": (5, 7), "mlp": tuple(range(8))},
}


@pytest.fixture(scope="module", params=sorted(HOLDERS))
def tiny(request, tmp_path_factory):
    """(family, source dir, transformers model, our model), built once per family."""
    path = tmp_path_factory.mktemp(request.param)
    hf = save_hf_model("gemma4", path, seed=fresh_seed(f"{request.param} model") % (1 << 31),
                       **OVERRIDES[request.param])
    return request.param, path, hf, load_f32(path)


def test_config_fields_holders_and_refusals():
    """global_head_dim / num_global_key_value_heads / attention_k_eq_v / use_double_wide_mlp (and
    per_layer_config, what transformers writes) become the config's fields; each layer's submodules follow
    its kind; full layers of two shapes and MoE blocks are refused naming the key."""
    shapes = text_config(BASE | OVERRIDES["gemma4_shapes"])
    assert (shapes.global_head_dim, shapes.global_kv_heads, shapes.attention_k_eq_v, shapes.double_wide_mlp) == (
        64, 2, False, True)
    assert shapes.global_rope_dim == 64 and shapes.rope_dim == 32
    keqv = text_config(BASE | OVERRIDES["gemma4_keqv"])
    assert (keqv.global_head_dim, keqv.global_kv_heads, keqv.attention_k_eq_v, keqv.double_wide_mlp) == (
        64, 1, True, False)
    written = text_config(BASE | {"attention_k_eq_v": True, "per_layer_config": {
        "5": {"head_dim": 64, "num_key_value_heads": 1}, "7": {"head_dim": 64, "num_key_value_heads": 1}}})
    assert (written.global_head_dim, written.global_kv_heads) == (64, 1)
    # without attention_k_eq_v transformers ignores num_global_key_value_heads
    assert text_config(BASE | OVERRIDES["gemma4_shapes"] | {"num_global_key_value_heads": 1}
                                 ).global_kv_heads == 2
    for family, cfg in (("gemma4_shapes", shapes), ("gemma4_keqv", keqv)):
        for sub, holders in HOLDERS[family].items():
            assert stack_holders(cfg, sub) == holders, (family, sub)
            assert all(layer_module(cfg, "mlp" if "mlp" in sub else "self_attn", i) == sub for i in holders)
    assert not layer_has(keqv, 5, "self_attn.v_proj.weight") and layer_has(keqv, 4, "self_attn.v_proj.weight")
    assert not layer_has(shapes, 7, "self_attn.k_norm.weight") and layer_has(shapes, 7, "self_attn.q_norm.weight")
    from unsloth_jax.errors import ConfigError

    for bad, key in [({"per_layer_config": {"5": {"head_dim": 64}, "7": {"head_dim": 128}}}, "per_layer_config"),
                     ({"enable_moe_block": True}, "enable_moe_block")]:
        with pytest.raises(ConfigError, match=key):
            text_config(BASE | OVERRIDES["gemma4_shapes"] | bad)


def test_logits_and_counts_match_transformers(tiny, rng):
    """Every layer-stack leaf has one row per holder of its submodule; the parameter count is transformers'
    (no k/v weights in the KV-shared layers, no v_proj beside k_eq_v); logits of two right-padded rows (20 and
    13 tokens, past the window of 8) equal transformers' in float32."""
    family, _, hf, model = tiny
    for path, leaf in nnx.to_flat_state(nnx.state(model.model.layers)):
        if path[0] in HOLDERS[family]:
            assert leaf[...].shape[0] == len(HOLDERS[family][path[0]]), path
    assert count(model) == sum(p.numel() for p in hf.parameters())
    ids, mask = right_padded(rng, [20, 13])
    real = mask.astype(bool)
    # 2e-4 as in test_gemma4.py (float32 rounding over 8 layers; a wrong mapping gives errors of order 1)
    assert rel_err(np.asarray(model(ids, mask))[real], torch_logits(hf, ids, mask)[real]) < 2e-4


def test_lora_step_peft_adapter_and_merged_export(tiny, tmp_path, rng):
    """LoRA on the seven projections of every kind of submodule: the trainable count is PEFT's, one SFT step
    lowers the loss; with every lora_b random, the PEFT adapter (HF module names; no k/v pairs in the KV-shared
    layers, no v_proj pair beside k_eq_v) loads in PEFT on transformers' model with our logits, and the merged
    checkpoint loads in transformers with no missing / unexpected keys and our logits."""
    family, path, _, _ = tiny
    model = FastLanguageModel.get_peft_model(load_f32(path), r=4, lora_alpha=8, target_modules=ALL,
                                             use_gradient_checkpointing=True, random_state=int(rng.integers(1 << 30)))
    pm = peft.get_peft_model(hf_f32(path), peft.LoraConfig(r=4, lora_alpha=8, target_modules=ALL))
    assert model.get_nb_trainable_parameters() == pm.get_nb_trainable_parameters()
    # lr 1e-4 as in test_gemma4.py (a random model's first Adam step can overshoot at 1e-3)
    model, ids, mask, real, ours = trained_with_random_b(model, rng, lr=1e-4)
    model.save_pretrained(tmp_path / "adapter")
    pm = peft.PeftModel.from_pretrained(hf_f32(path), str(tmp_path / "adapter"))
    # 5e-4 as in test_gemma4.py (float32 rounding through 8 layers with random LoRA pairs has a heavy tail)
    assert rel_err(ours[real], torch_logits(pm, ids, mask)[real]) < 5e-4
    model.save_pretrained_merged(tmp_path / "merged", None, dtype="float32")
    merged, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "merged"), dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert rel_err(ours[real], torch_logits(merged, ids, mask)[real]) < 5e-4


def test_peft_made_adapter_loads(tiny, tmp_path, rng):
    """An adapter PEFT makes on transformers' model (random A and B, HF module names) loads here with PEFT's
    logits: each layer's pairs go to its own submodule's rows; k/v pairs of a KV-shared layer, which another
    writer may add, are skipped."""
    from unsloth_jax.hf.peft_io import load_adapter

    family, path, _, _ = tiny
    torch.manual_seed(int(rng.integers(1 << 30)))
    pm = peft.get_peft_model(hf_f32(path), peft.LoraConfig(r=4, lora_alpha=8, target_modules=ALL,
                                                         init_lora_weights=False))
    pm.save_pretrained(str(tmp_path / "adapter"))
    if family == "gemma4_shapes":  # pairs for a KV-shared layer's k/v projections (never read) are skipped
        from safetensors.numpy import load_file, save_file

        file = str(tmp_path / "adapter" / "adapter_model.safetensors")
        tensors = load_file(file)
        for proj in ("k_proj", "v_proj"):
            for w in "AB":
                src = f"base_model.model.model.layers.4.self_attn.{proj}.lora_{w}.weight"
                tensors[src.replace("layers.4.", "layers.6.")] = tensors[src]
        save_file(tensors, file, metadata={"format": "pt"})
    model = load_adapter(load_f32(path), tmp_path / "adapter")
    ids, mask = right_padded(rng, [12, 7])
    real = mask.astype(bool)
    assert rel_err(np.asarray(model(ids, mask))[real], torch_logits(pm, ids, mask)[real]) < 2e-4


@pytest.mark.slow
def test_lora_gradients_match_peft(tiny, tmp_path, rng):
    """The loss and every LoRA gradient equal PEFT's (float32), through the global layers' values taken from
    k_proj and the double-wide MLP; test_lora_step_peft_adapter_and_merged_export is the fast guard."""
    _, path, _, _ = tiny
    model = FastLanguageModel.get_peft_model(load_f32(path), r=4, lora_alpha=8, target_modules=ALL,
                                             random_state=int(rng.integers(1 << 30)))
    # 5e-3 as in test_gemma4.py (float32 against float32 over 8 layers)
    assert_lora_gradients_match_peft(model, path, tmp_path, rng)


def test_greedy_generation_matches_transformers(tiny, rng):
    """Greedy tokens of a left-padded batch (prompts of 11 and 4 tokens, 7 new tokens: past the window of 8) on
    the engine, whose page pools have each layer's own head dim and key/value heads, equal transformers'."""
    _, _, hf, model = tiny
    assert_greedy_matches_transformers(hf, model, rng, [11, 4], new=7, eos=1)


def test_contiguous_cache_refused_for_two_attention_shapes():
    """run_layers' one [L, B, T, Hkv, hd] cache cannot hold layers of two head dims: a ValueError naming
    global_head_dim (the engine's per-layer page pools decode these models)."""
    import jax.numpy as jnp

    from unsloth_jax.models.attention import KVCache
    from unsloth_jax.models.decoder import CausalLM, make_batch

    model = CausalLM(text_config(BASE | OVERRIDES["gemma4_shapes"]), rngs=nnx.Rngs(0))
    ids = jnp.ones((1, 3), jnp.int32)
    x = model.model.embed(ids, jnp.float32)
    (cos, sin), local = model.model.rope(make_batch(ids).positions)
    cache = KVCache(jnp.zeros((8, 1, 4, 2, 32)), jnp.zeros((8, 1, 4, 2, 32)), jnp.ones((1, 4), jnp.int32), 0)
    with pytest.raises(ValueError, match="global_head_dim"):
        model.model.run_layers(x, cos, sin, make_batch(ids), cache=cache, local_rope=local)


@pytest.mark.slow
def test_layer_stack_policies_equal_the_plain_stack(seed):
    """Loss and gradients under host offload and two-level checkpointing equal the plain stack's on the
    double-wide, global-shape config: each segment's groups take their rows of every kind's sub-stack. (The fast
    guards: the LoRA step above under gradient checkpointing; tests/test_layer_substacks.py's two-level test.)"""
    assert_policies_equal_plain_stack(text_config(BASE | OVERRIDES["gemma4_shapes"]), seed)


def test_kv_shared_tensors_in_a_checkpoint_are_skipped(tiny, tmp_path, rng):
    """A checkpoint that also holds k/v projections and norms for the KV-shared layers (which transformers 5.25's
    Gemma 4 has not, and its forward never reads) loads, with the same logits."""
    import shutil

    from safetensors.numpy import load_file, save_file

    family, path, _, model = tiny
    if not model.config.layer_kv_source:
        pytest.skip(f"{family} has no KV-shared layers")
    shutil.copytree(path, tmp_path / "ckpt")
    file = next((tmp_path / "ckpt").glob("*.safetensors"))
    tensors = load_file(str(file))
    for i in (6, 7):
        src = model.config.kv_source(i)
        for name in ("k_proj.weight", "v_proj.weight", "k_norm.weight"):
            tensors[f"model.layers.{i}.self_attn.{name}"] = tensors[f"model.layers.{src}.self_attn.{name}"]
    save_file(tensors, str(file), metadata={"format": "pt"})
    ids, mask = right_padded(rng, [9, 5])
    real = mask.astype(bool)
    np.testing.assert_array_equal(np.asarray(load_f32(tmp_path / "ckpt")(ids, mask))[real],
                                  np.asarray(model(ids, mask))[real])
