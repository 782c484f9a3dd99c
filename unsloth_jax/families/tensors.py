"""What a text family's HF tensor table is made of: `TensorSpec` (where one checkpoint tensor goes) and the
per-layer tensor entries the families share. hf/mapping.py builds every checkpoint's specs from a family's table
(`TextFamily.layer_tensors` and friends); the families own the tables.

A per-layer entry is (HF suffix after "model.layers.{i}.", module path under LAYERS, kind), kind "norm" (copied),
"kernel" (transposed [out, in] -> [in, out]), "bias" (copied), "copy" (copied as stored) or "fused" (several
projections stacked on the output axis: the family's `fused_projs`).
"""
from __future__ import annotations

import dataclasses

from unsloth_jax.models.decoder import ATTN_PROJS, MLP_PROJS, PROJ_PARENT as PROJ_MODULE

LAYERS = ("model", "layers")  # module path of the stacked decoder layers
LayerTensor = tuple[str, tuple[str, ...], str]

LLAMA_TENSORS: tuple[LayerTensor, ...] = (
    ("input_layernorm.weight", ("input_layernorm", "weight"), "norm"),
    ("post_attention_layernorm.weight", ("post_attention_layernorm", "weight"), "norm"),
    *[(f"{PROJ_MODULE[p]}.{p}.weight", (PROJ_MODULE[p], p, "kernel"), "kernel") for p in ATTN_PROJS + MLP_PROJS],
)
QKV_BIAS = tuple((f"self_attn.{p}.bias", ("self_attn", p, "bias"), "bias") for p in ("q_proj", "k_proj", "v_proj"))
O_BIAS = (("self_attn.o_proj.bias", ("self_attn", "o_proj", "bias"), "bias"),)
MLP_BIAS = tuple((f"mlp.{p}.bias", ("mlp", p, "bias"), "bias") for p in MLP_PROJS)
QK_NORM = (("self_attn.q_norm.weight", ("self_attn", "q_norm", "weight"), "norm"),
           ("self_attn.k_norm.weight", ("self_attn", "k_norm", "weight"), "norm"))
SANDWICH = (
    ("pre_feedforward_layernorm.weight", ("pre_feedforward_layernorm", "weight"), "norm"),
    ("post_feedforward_layernorm.weight", ("post_feedforward_layernorm", "weight"), "norm"),
)
# MoE families: attention and norms; the MLP tensors (router, experts, dense layers) come from mapping.moe_specs
ATTN_NORMS = tuple(e for e in LLAMA_TENSORS if e[1][0] != "mlp")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Where one HF tensor goes: `path` in the module tree, `layer` (None for unstacked variables), `kind`, and
    the expected HF shape. `slot`: the layer's row in its stacked variable (config.layer_slot; the layer itself
    unless given)."""

    hf_name: str
    path: tuple[str, ...]
    layer: int | None
    kind: str  # "embed" | "norm" | "kernel" | "bias" | "fused" | "matrix" (an unstacked, never quantized weight
    #   stored transposed: Gemma 4's per_layer_model_projection), and for MoE families MOE_KINDS
    hf_shape: tuple[int, ...]
    parts: tuple["TensorSpec", ...] = ()  # kind "fused": the kernel spec of each projection, in row order
    expert: int | None = None  # kind "expert": the expert this tensor is
    column: int = 0  # kind "expert": first column of the fused output axis it fills (gate 0, up F)
    keep_fp32: bool = False  # loaded and written in float32 whatever the dtype (GLM-4.5's router: cfg.router_fp32)
    slot: int | None = None

    def __post_init__(self):
        if self.slot is None:
            object.__setattr__(self, "slot", self.layer)

    @property
    def param_shape(self) -> tuple[int, ...]:
        """The shape of this tensor's slot in param layout (one layer; for kind "expert" one expert's part)."""
        if self.kind in ("kernel", "router", "expert", "matrix"):
            return tuple(reversed(self.hf_shape))
        if self.kind == "experts":
            return (self.hf_shape[0], self.hf_shape[2], self.hf_shape[1])
        return self.hf_shape


__all__ = ["ATTN_NORMS", "LAYERS", "LLAMA_TENSORS", "LayerTensor", "MLP_BIAS", "O_BIAS", "QKV_BIAS", "QK_NORM",
           "SANDWICH", "TensorSpec"]
