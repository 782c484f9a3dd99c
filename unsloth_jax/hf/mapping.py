"""Name tables: Hugging Face tensor name <-> unsloth_jax module path, with the transform between them.

The path of a variable in the NNX module tree (`unsloth_jax.models.decoder`) reads like the HF name, with the
layer index dropped because decoder layers are stacked on a leading axis L (for lax.scan):

    model.embed_tokens.weight [V, D]                 <- model.embed_tokens.weight
    model.norm.weight [D]                            <- model.norm.weight
    lm_head.weight [V, D]                            <- lm_head.weight   (only when embeddings are untied)
    model.layers.<norm>.weight [L, D]                <- model.layers.{i}.<norm>.weight
    model.layers.self_attn.{q,k}_norm.weight [L, hd] <- model.layers.{i}.self_attn.{q,k}_norm.weight  (Qwen3)
    model.layers.<parent>.<proj>.kernel [L, in, out] <- model.layers.{i}.<parent>.<proj>.weight  (transposed)
    model.layers.<parent>.<proj>.bias [L, out]       <- model.layers.{i}.<parent>.<proj>.bias

<parent> is self_attn for q/k/v/o_proj and mlp for gate/up/down_proj. Norms, embeddings and the head keep HF's
layout (named `weight`); projections are [in, out] (named `kernel`, as Flax does).

Fused checkpoint tensors (Phi-3) hold several of the decoder's projections stacked on the output axis, in order:

    model.layers.{i}.self_attn.qkv_proj.weight [q + 2 kv, D]  -> q_proj, k_proj, v_proj kernels (rows split)
    model.layers.{i}.mlp.gate_up_proj.weight   [2 F, D]       -> gate_proj, up_proj kernels

Their spec has kind "fused" and `parts`: one kernel spec per projection, in row order (`fused_parts`).
"""
from __future__ import annotations

import dataclasses

from unsloth_jax.config import ModelConfig
from unsloth_jax.models.decoder import ATTN_PROJS, MLP_PROJS, PROJ_PARENT as PROJ_MODULE
LAYERS = ("model", "layers")  # module path of the stacked decoder layers

# Per-layer tensors of each family: (HF suffix after "model.layers.{i}.", module path under LAYERS, kind).
# kind: "norm" (copied), "kernel" (transposed [out, in] -> [in, out]), "bias" (copied).
_LLAMA = [
    ("input_layernorm.weight", ("input_layernorm", "weight"), "norm"),
    ("post_attention_layernorm.weight", ("post_attention_layernorm", "weight"), "norm"),
    *[(f"{PROJ_MODULE[p]}.{p}.weight", (PROJ_MODULE[p], p, "kernel"), "kernel") for p in ATTN_PROJS + MLP_PROJS],
]
_QKV_BIAS = [(f"self_attn.{p}.bias", ("self_attn", p, "bias"), "bias") for p in ("q_proj", "k_proj", "v_proj")]
_O_BIAS = [("self_attn.o_proj.bias", ("self_attn", "o_proj", "bias"), "bias")]
_MLP_BIAS = [(f"mlp.{p}.bias", ("mlp", p, "bias"), "bias") for p in MLP_PROJS]
_QK_NORM = [("self_attn.q_norm.weight", ("self_attn", "q_norm", "weight"), "norm"),
            ("self_attn.k_norm.weight", ("self_attn", "k_norm", "weight"), "norm")]
_SANDWICH = [
    ("pre_feedforward_layernorm.weight", ("pre_feedforward_layernorm", "weight"), "norm"),
    ("post_feedforward_layernorm.weight", ("post_feedforward_layernorm", "weight"), "norm"),
]

# Phi-3: (fused HF suffix, parent module, the projections it holds in row order)
FUSED_PROJS = {
    "phi3": (("self_attn.qkv_proj.weight", "self_attn", ("q_proj", "k_proj", "v_proj")),
             ("mlp.gate_up_proj.weight", "mlp", ("gate_proj", "up_proj"))),
}
_PHI3 = [
    ("input_layernorm.weight", ("input_layernorm", "weight"), "norm"),
    ("post_attention_layernorm.weight", ("post_attention_layernorm", "weight"), "norm"),
    ("self_attn.o_proj.weight", ("self_attn", "o_proj", "kernel"), "kernel"),
    ("mlp.down_proj.weight", ("mlp", "down_proj", "kernel"), "kernel"),
    *[(suffix, (parent, suffix.split(".")[1], "kernel"), "fused") for suffix, parent, _ in FUSED_PROJS["phi3"]],
]

FAMILY_LAYER_TENSORS = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA + _QKV_BIAS,
    "qwen3": _LLAMA + _QK_NORM,
    "gemma": _LLAMA,
    "gemma2": _LLAMA + _SANDWICH,
    "gemma3_text": _LLAMA + _SANDWICH + _QK_NORM,
    "phi3": _PHI3,
}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Where one HF tensor goes: `path` in the module tree, `layer` (None for unstacked variables), `kind`, and
    the expected HF shape."""

    hf_name: str
    path: tuple[str, ...]
    layer: int | None
    kind: str  # "embed" | "norm" | "kernel" | "bias" | "fused"
    hf_shape: tuple[int, ...]
    parts: tuple["TensorSpec", ...] = ()  # kind "fused": the kernel spec of each projection, in row order

    @property
    def param_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.hf_shape)) if self.kind == "kernel" else self.hf_shape


def _proj_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """HF [out, in] shape of each projection."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    return {
        "q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, q),
        "gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f),
    }


def layer_entries(cfg: ModelConfig) -> list[tuple[str, tuple[str, ...], str]]:
    """The family's per-layer table, with optional biases switched on by the config."""
    entries = list(FAMILY_LAYER_TENSORS[cfg.model_type])
    if cfg.qkv_bias and cfg.model_type != "qwen2":
        entries += _QKV_BIAS
    if cfg.o_bias:
        entries += _O_BIAS
    if cfg.mlp_bias:
        entries += _MLP_BIAS
    return entries


def tensor_specs(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor the checkpoint of `cfg` must hold, keyed by HF name."""
    shapes = _proj_shapes(cfg)
    d, hd = cfg.hidden_size, cfg.head_dim
    specs = {
        "model.embed_tokens.weight": TensorSpec("model.embed_tokens.weight", ("model", "embed_tokens", "weight"), None,
                                                "embed", (cfg.vocab_size, d)),
        "model.norm.weight": TensorSpec("model.norm.weight", ("model", "norm", "weight"), None, "norm", (d,)),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head.weight"] = TensorSpec("lm_head.weight", ("lm_head", "weight"), None, "embed", (cfg.vocab_size, d))
    for i in range(cfg.num_hidden_layers):
        for suffix, sub, kind in layer_entries(cfg):
            name = f"model.layers.{i}.{suffix}"
            if kind == "fused":
                specs[name] = _fused_spec(cfg, name, suffix, i, shapes)
                continue
            if kind == "kernel":
                shape = shapes[sub[1]]
            elif kind == "bias":
                shape = (shapes[sub[1]][0],)
            elif sub[1] in ("q_norm", "k_norm"):
                shape = (hd,)
            else:
                shape = (d,)
            specs[name] = TensorSpec(name, LAYERS + sub, i, kind, shape)
    return specs


def fused_groups(cfg: ModelConfig) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """(fused HF module name, parent, projections in row order) of the family, e.g. ("qkv_proj", "self_attn",
    ("q_proj", "k_proj", "v_proj")) for Phi-3; empty for families whose checkpoints keep projections apart."""
    return tuple((suffix.split(".")[1], parent, projs) for suffix, parent, projs in FUSED_PROJS.get(cfg.model_type, ()))


def _fused_spec(cfg: ModelConfig, name: str, suffix: str, layer: int, shapes: dict) -> TensorSpec:
    parent, projs = next((p, pr) for s, p, pr in FUSED_PROJS[cfg.model_type] if s == suffix)
    parts = tuple(TensorSpec(name, LAYERS + (parent, p, "kernel"), layer, "kernel", shapes[p]) for p in projs)
    rows = sum(part.hf_shape[0] for part in parts)
    return TensorSpec(name, LAYERS + (parent, suffix.split(".")[1]), layer, "fused", (rows, shapes[projs[0]][1]),
                      parts)


def fused_parts(spec: TensorSpec):
    """(part spec, first row, end row) of each projection held by a fused spec, in row order."""
    start = 0
    for part in spec.parts:
        yield part, start, start + part.hf_shape[0]
        start += part.hf_shape[0]
