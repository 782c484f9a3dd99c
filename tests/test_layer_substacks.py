"""Per-kind layer sub-stacks (config.stack_holders): a Qwen3.5 token mixer is stacked over the layers that hold it
only. On a pattern whose tail segment has no linear-attention layer ([lin x3, full] x 2 + [full, full]): every
leaf's rows, the parameter and LoRA counts of transformers / PEFT, logits against transformers' Qwen3_5ForCausalLM
in float32, the loss and gradients under host offload and two-level checkpointing against the plain stack, and
the engine's weight layouts against the plain forward pass."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

from tests.family_checks import assert_policies_equal_plain_stack, load_f32, torch_logits  # noqa: E402
from tests.helpers import rel_err  # noqa: E402
from tests.hf_models import make_hf_model  # noqa: E402
from unsloth_jax import FastLanguageModel  # noqa: E402
from unsloth_jax.backend import key_names  # noqa: E402
from unsloth_jax.config import layer_slot, stack_holders  # noqa: E402
from unsloth_jax.families import text_config  # noqa: E402
from unsloth_jax.lora import count  # noqa: E402

TYPES = (["linear_attention"] * 3 + ["full_attention"]) * 2 + ["full_attention"] * 2
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
       "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
FIELDS = dict(num_hidden_layers=len(TYPES), layer_types=TYPES)
BASE = dict(model_type="qwen3_5_text", vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8) | FIELDS


def test_holders_and_slots():
    """The mixers' holders follow layer_types; the other submodules are held by every layer."""
    cfg = text_config(BASE)
    assert cfg.layer_segments == ((0, 4, 2), (8, 1, 2))  # the tail segment has no linear-attention layer
    assert stack_holders(cfg, "self_attn") == (3, 7, 8, 9)
    assert stack_holders(cfg, "linear_attn.in_proj_qkv") == (0, 1, 2, 4, 5, 6)
    assert stack_holders(cfg, "mlp") == tuple(range(10))
    assert layer_slot(cfg, "self_attn", 8) == 2 and layer_slot(cfg, "linear_attn", 4) == 3
    with pytest.raises(ValueError, match="layer 3 has no linear_attn"):
        layer_slot(cfg, "linear_attn", 3)


def test_rows_counts_logits_and_lora_against_transformers(tmp_path, seed):
    """Every leaf under model.layers has one row per holder; the parameter count is transformers' (no unused
    mixer weights), the LoRA count PEFT's; logits of right-padded rows match transformers (the bound of
    tests/test_qwen3_5.py)."""
    hf = make_hf_model("qwen35", seed % (1 << 31), **FIELDS)
    hf.save_pretrained(str(tmp_path))
    model = load_f32(tmp_path)
    cfg = model.config
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model.model.layers)):
        sub = key_names(path)[0]
        assert leaf.shape[0] == len(stack_holders(cfg, sub)), key_names(path)
    assert count(model) == sum(p.numel() for p in hf.parameters())

    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 256, size=(2, 14))
    mask = np.ones_like(ids)
    mask[1, 9:] = 0
    real = mask.astype(bool)
    assert rel_err(np.asarray(model(ids, mask))[real], torch_logits(hf, ids, mask)[real]) < 5e-5

    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, target_modules=ALL)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=ALL))
    want = sum(p.numel() for n, p in pm.named_parameters() if "lora_" in n)
    assert count(nnx.state(model, nnx.LoRAParam)) == want


def test_tail_without_linear_layers_under_offload_and_two_level(seed):
    """Loss and gradients under host offload (the prefetched offload scan) and two-level checkpointing equal
    the plain stack's on the pattern whose tail segment has no linear_attn rows (the bound of
    tests/test_qwen3_5.py's policy test)."""
    assert_policies_equal_plain_stack(text_config(BASE), seed)


def test_engine_layouts_follow_the_plain_forward(seed):
    """Greedy tokens on the engine with a live LoRA, in the "copy" and "merged_buffer" layouts (per-layer parts
    and a merged stacked clone, each layer merged into its kind's graphdef; "shared": tests/test_qwen3_5.py),
    equal those of the model's plain forward pass, re-run on the whole sequence for every token."""
    from unsloth_jax.inference.engine import Engine
    from unsloth_jax.inference.sampling import SamplingParams
    from unsloth_jax.models.decoder import CausalLM

    rng = np.random.default_rng(seed)
    model = CausalLM(text_config(BASE), rngs=nnx.Rngs(seed % (1 << 30)))
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8,
                                             target_modules=["q_proj", "v_proj", "in_proj_qkv", "out_proj"])
    for lin in model.projections().values():
        if lin.lora_b is not None:
            lin.lora_b[...] = jnp.asarray(0.3 * rng.standard_normal(lin.lora_b[...].shape), jnp.float32)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (7, 4)]
    want = []
    for p in prompts:
        ids = list(p)
        for _ in range(4):
            ids.append(int(np.argmax(np.asarray(model(np.asarray([ids])))[0, -1])))
        want.append(ids[len(p):])
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for layout in ("copy", "merged_buffer"):
        assert [o.outputs[0].token_ids for o in Engine(model, weights=layout).generate(prompts, greedy)] == want
