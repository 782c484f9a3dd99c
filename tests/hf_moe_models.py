"""Tiny random-init transformers checkpoints of the mixture-of-experts families, for parity tests (needs torch).

Each family's config exercises its switches: Qwen3-MoE with a dense layer (mlp_only_layers) and a dense
layer from decoder_sparse_step, normalised top-k; Mixtral with 8 experts top-2 and a sliding window; gpt-oss
with alternating sliding/full layers, attention sinks, YaRN RoPE, biases and a low swiglu_limit so that the
clamps of its activation are hit.
"""
from __future__ import annotations

import torch

from tests.hf_models import tiny_config

TINY_MOE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, rms_norm_eps=1e-6)

MOE_FAMILIES = {
    # layers 0 and 2 are dense (mlp_only_layers=[0], and layer 2 as (2 + 1) % 2 != 0), layers 1 and 3 MoE
    "qwen3_moe": dict(intermediate_size=96, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=3,
                      head_dim=16, norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=2,
                      tie_word_embeddings=False),
    "mixtral": dict(intermediate_size=40, num_local_experts=8, num_experts_per_tok=2, sliding_window=8),
    "gpt_oss": dict(intermediate_size=24, num_local_experts=6, num_experts_per_tok=2, head_dim=16, sliding_window=8,
                    swiglu_limit=0.6,
                    rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 64,
                                     "rope_theta": 150000.0}),
}
# A Qwen3-MoE whose layers are all MoE (the Qwen3-30B-A3B pattern), for the tests that need no dense layer.
MOE_FAMILIES["qwen3_moe_all"] = dict(MOE_FAMILIES["qwen3_moe"], mlp_only_layers=[], decoder_sparse_step=1,
                                     norm_topk_prob=False, num_hidden_layers=2)


def model_type_of(family: str) -> str:
    return "qwen3_moe" if family.startswith("qwen3_moe") else family


def make_hf_moe_model(family: str, seed: int = 0, dtype=torch.float32, **overrides):
    """A transformers MoE causal LM of `family` (eager attention) with every parameter randomised: norms
    around 1, biases and sinks nonzero, weights N(0, 0.08^2), the router N(0, 0.3^2) so top-k choices are far
    from ties."""
    import transformers

    config = tiny_config(model_type_of(family), TINY_MOE | MOE_FAMILIES[family] | overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("bias", "sinks")):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif ".gate." in name or ".router." in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
    model.eval()
    return model


def save_hf_moe_model(family: str, path, seed: int = 0, dtype=torch.float32, save_original_format: bool = True,
                      **overrides):
    """Write a tiny checkpoint as transformers' save_pretrained does (save_original_format=False: Qwen3-MoE and
    Mixtral experts as fused 3-D tensors instead of one tensor per expert). Returns the torch model."""
    model = make_hf_moe_model(family, seed, dtype, **overrides)
    model.save_pretrained(str(path), save_original_format=save_original_format)
    return model


# ---- GLM-4.5 MoE (glm4_moe) ----
# 3 layers: the first dense (first_k_dense_replace=1), two MoE with 8 experts in 4 groups of 2, tokens using their
# 2 best groups (n_group > 1 exercises the group masking), top-3, routed_scaling_factor 2.5, one shared expert,
# RoPE on half of each head (partial_rotary_factor 0.5, GLM's default), q/k norms and q/k/v biases.
GLM4_MOE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, intermediate_size=96,
                moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5, tie_word_embeddings=False)


def make_hf_glm4_moe(seed: int = 0, dtype=torch.float32, **overrides):
    """A transformers Glm4MoeForCausalLM (eager attention) randomised as make_hf_moe_model does, plus a nonzero
    e_score_correction_bias (a buffer) of the size of the score gaps, so it changes some expert choices."""
    import transformers

    config = tiny_config("glm4_moe", GLM4_MOE | overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif ".gate." in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=gen))
    model.eval()
    return model
# ---- end GLM-4.5 MoE ----
