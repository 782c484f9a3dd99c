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

<parent> is self_attn for q/k/v/o_proj and mlp for gate/up/down_proj (Gemma 4: our path's submodule is the
layer's kind of it, config.layer_module: global_attn, shared_attn, shared_global_attn, wide_mlp). Norms, embeddings and the head keep HF's
layout (named `weight`); projections are [in, out] (named `kernel`, as Flax does). The mixture-of-experts
families (Qwen3-MoE, Mixtral, gpt-oss) add the router and the expert stacks: see the last section.

Fused checkpoint tensors (Phi-3) hold several of the decoder's projections stacked on the output axis, in order:

    model.layers.{i}.self_attn.qkv_proj.weight [q + 2 kv, D]  -> q_proj, k_proj, v_proj kernels (rows split)
    model.layers.{i}.mlp.gate_up_proj.weight   [2 F, D]       -> gate_proj, up_proj kernels

Their spec has kind "fused" and `parts`: one kernel spec per projection, in row order (`fused_parts`).
"""
from __future__ import annotations

import dataclasses

from unsloth_jax.config import (HF_MODULE, ModelConfig, attention_dims, layer_has, layer_module, layer_slot,
                                stack_holders)
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
FAMILY_LAYER_TENSORS["smollm3"] = _LLAMA  # SmolLM3: Llama's tensors (its NoPE layers have no tensors of their own)
# MoE families: attention and norms here; the MLP tensors (router, experts, dense layers) come from moe_specs.
_ATTN_NORMS = [e for e in _LLAMA if e[1][0] != "mlp"]
FAMILY_LAYER_TENSORS.update({"qwen3_moe": _ATTN_NORMS + _QK_NORM, "mixtral": _ATTN_NORMS, "gpt_oss": _ATTN_NORMS})
FAMILY_LAYER_TENSORS["glm4_moe"] = _ATTN_NORMS  # GLM-4.5 MoE: q/k norms (use_qk_norm) and biases by switch
# Qwen3.5: Llama's tensors and q/k norms on the full-attention layers, the gated DeltaNet's on the linear ones
# (`layer_has` picks a layer's); conv1d weight [C, 1, K], A_log / dt_bias [Hv], norm.weight [Dv] copied as they are
_LINEAR_ATTN = [
    *[(f"linear_attn.{p}.weight", ("linear_attn", p, "kernel"), "kernel")
      for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")],
    *[(f"linear_attn.{name}", ("linear_attn", *name.split(".")), "copy")
      for name in ("conv1d.weight", "A_log", "dt_bias", "norm.weight")],
]
FAMILY_LAYER_TENSORS["qwen3_5_text"] = _LLAMA + _QK_NORM + _LINEAR_ATTN
# Gemma 4 text: Gemma 3's tensors, the layer's scalar, and (with per-layer inputs) the per-layer input block;
# KV-shared layers have no k_proj / v_proj / k_norm (`layer_has`)
_GEMMA4_PLE = [
    ("per_layer_input_gate.weight", ("per_layer_input_gate", "kernel"), "kernel"),
    ("per_layer_projection.weight", ("per_layer_projection", "kernel"), "kernel"),
    ("post_per_layer_input_norm.weight", ("post_per_layer_input_norm", "weight"), "norm"),
]
FAMILY_LAYER_TENSORS["gemma4_text"] = _LLAMA + _SANDWICH + _QK_NORM + [("layer_scalar", ("layer_scalar",), "norm")]


def _gemma4_model_specs(cfg: ModelConfig) -> dict[str, "TensorSpec"]:
    """Gemma 4's per-layer input tensors outside the layers: the [Vp, L * P] table, the [L * P, D] projection
    (kind "matrix": an unstacked weight stored transposed) and the [P] norm."""
    if not cfg.per_layer_input_size:
        return {}
    width, d = cfg.num_hidden_layers * cfg.per_layer_input_size, cfg.hidden_size
    rows = [("model.embed_tokens_per_layer.weight", "embed", (cfg.per_layer_vocab_size, width)),
            ("model.per_layer_model_projection.weight", "matrix", (width, d)),
            ("model.per_layer_projection_norm.weight", "norm", (cfg.per_layer_input_size,))]
    return {name: TensorSpec(name, tuple(name.split(".")[:-1]) + ("kernel" if kind == "matrix" else "weight",),
                             None, kind, shape) for name, kind, shape in rows}


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


def _proj_shapes(cfg: ModelConfig, attn: str = "self_attn", mlp: str = "mlp") -> dict[str, tuple[int, int]]:
    """HF [out, in] shape of each projection, those of attention submodule `attn` and MLP submodule `mlp`
    (config.KIND_MODULES: Gemma 4's global_attn at its own head dim, wide_mlp at twice the width)."""
    d, f = cfg.hidden_size, cfg.intermediate_size * (2 if mlp == "wide_mlp" else 1)
    hd, hkv = attention_dims(cfg, attn)
    q, kv = cfg.num_attention_heads * hd, hkv * hd
    shapes = {
        "q_proj": (q * (2 if cfg.attn_output_gate else 1), d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, q),
        "gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f),
    }
    if cfg.has_linear_layers:  # Qwen3.5's gated DeltaNet
        hv, value = cfg.linear_num_value_heads, cfg.linear_num_value_heads * cfg.linear_value_head_dim
        shapes.update(in_proj_qkv=(cfg.linear_conv_dim, d), in_proj_z=(value, d), in_proj_b=(hv, d),
                      in_proj_a=(hv, d), out_proj=(d, value))
    return shapes


def ignored_tensor(cfg: ModelConfig, name: str) -> bool:
    """Whether checkpoint tensor `name` is one transformers skips on load for this family (Qwen3_5ForCausalLM:
    the multi-token-prediction head `mtp.*` and a vision tower `model.visual.*`), or one a Gemma 4 layer's
    forward never reads: the key/value projections and norms of a KV-shared layer, which attends over its
    source layer's keys/values (transformers 5.25 has no such weights; a checkpoint or adapter that holds them
    loads without them)."""
    if cfg.has_linear_layers and name.startswith(("mtp.", "model.visual.")):
        return True
    return kv_shared_tensor(cfg, name)


def kv_shared_tensor(cfg: ModelConfig, name: str) -> bool:
    """Whether `name` (a checkpoint tensor, or a PEFT adapter key under base_model.model.) is a key/value
    projection or norm (self_attn.{k,v}_proj / {k,v}_norm) of a Gemma 4 KV-shared layer."""
    if not cfg.layer_kv_source:
        return False
    parts = name.removeprefix("base_model.model.").split(".")
    return (len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
            and int(parts[2]) < cfg.num_hidden_layers and cfg.kv_source(int(parts[2])) != int(parts[2])
            and parts[3] == "self_attn" and parts[4] in ("k_proj", "v_proj", "k_norm", "v_norm"))


def _linear_attn_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    """HF shape of a copied linear-attention tensor (Qwen3.5)."""
    return {"conv1d": (cfg.linear_conv_dim, 1, cfg.linear_conv_kernel), "A_log": (cfg.linear_num_value_heads,),
            "dt_bias": (cfg.linear_num_value_heads,), "norm": (cfg.linear_value_head_dim,)}[name]


def layer_entries(cfg: ModelConfig) -> list[tuple[str, tuple[str, ...], str]]:
    """The family's per-layer table, with optional biases switched on by the config."""
    entries = list(FAMILY_LAYER_TENSORS[cfg.model_type])
    if cfg.qk_norm and not any(e[1][1] == "q_norm" for e in entries):  # optional q/k norms (GLM-4.5 use_qk_norm)
        entries += _QK_NORM
    if cfg.qkv_bias and cfg.model_type != "qwen2":
        entries += _QKV_BIAS
    if cfg.o_bias:
        entries += _O_BIAS
    if cfg.mlp_bias:
        entries += _MLP_BIAS
    if cfg.per_layer_input_size:
        entries += _GEMMA4_PLE
    return entries


def tensor_specs(cfg: ModelConfig, expert_layout: str | None = None) -> dict[str, TensorSpec]:
    """Every tensor the checkpoint of `cfg` must hold, keyed by HF name. expert_layout (MoE families):
    "per_expert" or "fused" (see moe_specs); None is what transformers' save_pretrained writes."""
    d = cfg.hidden_size
    specs = {
        "model.embed_tokens.weight": TensorSpec("model.embed_tokens.weight", ("model", "embed_tokens", "weight"), None,
                                                "embed", (cfg.vocab_size, d)),
        "model.norm.weight": TensorSpec("model.norm.weight", ("model", "norm", "weight"), None, "norm", (d,)),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head.weight"] = TensorSpec("lm_head.weight", ("lm_head", "weight"), None, "embed", (cfg.vocab_size, d))
    for i in range(cfg.num_hidden_layers):
        attn, mlp = layer_module(cfg, "self_attn", i), layer_module(cfg, "mlp", i)
        shapes = _proj_shapes(cfg, attn, mlp)
        hd = attention_dims(cfg, attn)[0]
        for suffix, sub, kind in layer_entries(cfg):
            if not layer_has(cfg, i, suffix):
                continue
            if sub[0] in HF_MODULE:  # the layer's own submodule for HF's self_attn / mlp (Gemma 4's kinds)
                sub = (layer_module(cfg, sub[0], i),) + sub[1:]
            name = f"model.layers.{i}.{suffix}"
            if kind == "fused":
                specs[name] = _fused_spec(cfg, name, suffix, i, shapes)
                continue
            if sub[0] == "layer_scalar":
                shape = (1,)
            elif sub[0] in ("per_layer_input_gate", "per_layer_projection"):
                p = cfg.per_layer_input_size
                shape = (p, d) if sub[0] == "per_layer_input_gate" else (d, p)
            elif kind == "kernel":
                shape = shapes[sub[1]]
            elif kind == "bias":
                shape = (shapes[sub[1]][0],)
            elif sub[0] == "linear_attn":
                shape = _linear_attn_shape(cfg, sub[1])
            elif len(sub) > 1 and sub[1] in ("q_norm", "k_norm"):
                shape = (hd,)
            else:
                shape = (d,)
            specs[name] = TensorSpec(name, LAYERS + sub, i, kind, shape, slot=layer_slot(cfg, sub[0], i))
    if cfg.is_moe:
        specs.update(moe_specs(cfg, expert_layout))
    specs.update(_gemma4_model_specs(cfg))
    return specs


def fused_groups(cfg: ModelConfig) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """(fused HF module name, parent, projections in row order) of the family, e.g. ("qkv_proj", "self_attn",
    ("q_proj", "k_proj", "v_proj")) for Phi-3; empty for families whose checkpoints keep projections apart."""
    return tuple((suffix.split(".")[1], parent, projs) for suffix, parent, projs in FUSED_PROJS.get(cfg.model_type, ()))


def _fused_spec(cfg: ModelConfig, name: str, suffix: str, layer: int, shapes: dict) -> TensorSpec:
    parent, projs = next((p, pr) for s, p, pr in FUSED_PROJS[cfg.model_type] if s == suffix)
    slot = layer_slot(cfg, parent, layer)
    parts = tuple(TensorSpec(name, LAYERS + (parent, p, "kernel"), layer, "kernel", shapes[p], slot=slot)
                  for p in projs)
    rows = sum(part.hf_shape[0] for part in parts)
    return TensorSpec(name, LAYERS + (parent, suffix.split(".")[1]), layer, "fused", (rows, shapes[projs[0]][1]),
                      parts, slot=slot)


def fused_parts(spec: TensorSpec):
    """(part spec, first row, end row) of each projection held by a fused spec, in row order."""
    start = 0
    for part in spec.parts:
        yield part, start, start + part.hf_shape[0]
        start += part.hf_shape[0]


# ------------------------------------------------------------------------------- mixture-of-experts families
# Kinds of the MoE tensors: "router" (HF [E, D] -> kernel [D, E]), "expert" (one expert's [out, in] projection,
# written transposed into columns [column, column + out) of expert `expert` of the fused stack), "experts"
# (a fused [E, out, in] stack -> [E, in, out]), "experts_t" (a fused stack already [E, in, out]: gpt-oss) and
# "copy" (biases, sinks: copied).
MOE_KINDS = ("router", "expert", "experts", "experts_t", "copy")
EXPERT_LAYOUTS = ("per_expert", "fused")
# transformers 5's save_pretrained writes the original (per-expert) format for Qwen3-MoE and Mixtral, fused
# 3-D expert tensors for gpt-oss; with save_original_format=False it writes Qwen3-MoE and Mixtral fused too.
DEFAULT_EXPERT_LAYOUT = {"qwen3_moe": "per_expert", "mixtral": "per_expert", "gpt_oss": "fused",
                         "glm4_moe": "per_expert"}
# Per-expert names: (checkpoint module of the MoE block, gate, up, down) (Mixtral's Hub checkpoints: w1/w3/w2).
_PER_EXPERT_NAMES = {"qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
                     "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
                     "glm4_moe": ("mlp", "gate_proj", "up_proj", "down_proj")}


def detect_expert_layout(cfg: ModelConfig, names) -> str:
    """The expert layout of a checkpoint holding tensor `names`: "fused" when it has fused expert stacks
    (`...mlp.experts.gate_up_proj`), else "per_expert" (gpt-oss checkpoints are always fused)."""
    if cfg.model_type == "gpt_oss" or any(n.endswith(".mlp.experts.gate_up_proj") for n in names):
        return "fused"
    return "per_expert"


def moe_specs(cfg: ModelConfig, expert_layout: str | None = None) -> dict[str, TensorSpec]:
    """The per-layer MLP tensors of a MoE family: the router and experts of the sparse layers, the dense
    gate/up/down projections of the others (Qwen3-MoE mlp_only_layers), and gpt-oss's attention sinks."""
    layout = expert_layout or DEFAULT_EXPERT_LAYOUT[cfg.model_type]
    if layout not in EXPERT_LAYOUTS or (cfg.model_type == "gpt_oss" and layout != "fused"):
        raise ValueError(f"expert layout {layout!r} is not one of {cfg.model_type}'s")
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    mlp = LAYERS + ("mlp",)
    gate_up, down = mlp + ("experts", "gate_up_proj"), mlp + ("experts", "down_proj")
    specs: dict[str, TensorSpec] = {}

    def add(name, path, layer, kind, shape, **kw):
        specs[name] = TensorSpec(name, path, layer, kind, tuple(shape), slot=layer_slot(cfg, path[len(LAYERS)], layer),
                                 **kw)

    for i in range(cfg.num_hidden_layers):
        if cfg.attn_sinks:
            add(f"model.layers.{i}.self_attn.sinks", LAYERS + ("self_attn", "sinks"), i, "copy",
                (cfg.num_attention_heads,))
        if not cfg.layer_sparse[i]:
            for proj, shape in (("gate_proj", (cfg.intermediate_size, d)), ("up_proj", (cfg.intermediate_size, d)),
                                ("down_proj", (d, cfg.intermediate_size))):
                add(f"model.layers.{i}.mlp.{proj}.weight", mlp + (proj, "kernel"), i, "kernel", shape)
            continue
        if cfg.model_type == "gpt_oss":
            p = f"model.layers.{i}.mlp"
            add(f"{p}.router.weight", mlp + ("router", "kernel"), i, "router", (e, d))
            add(f"{p}.router.bias", mlp + ("router", "bias"), i, "copy", (e,))
            add(f"{p}.experts.gate_up_proj", gate_up + ("kernel",), i, "experts_t", (e, d, 2 * f))
            add(f"{p}.experts.gate_up_proj_bias", gate_up + ("bias",), i, "copy", (e, 2 * f))
            add(f"{p}.experts.down_proj", down + ("kernel",), i, "experts_t", (e, f, d))
            add(f"{p}.experts.down_proj_bias", down + ("bias",), i, "copy", (e, d))
            continue
        _glm4_moe_extra_specs(cfg, i, add)
        block, w_gate, w_up, w_down = _PER_EXPERT_NAMES[cfg.model_type]
        if layout == "fused":
            p = f"model.layers.{i}.mlp"
            add(f"{p}.gate.weight", mlp + ("gate", "kernel"), i, "router", (e, d))
            add(f"{p}.experts.gate_up_proj", gate_up + ("kernel",), i, "experts", (e, 2 * f, d))
            add(f"{p}.experts.down_proj", down + ("kernel",), i, "experts", (e, d, f))
            continue
        p = f"model.layers.{i}.{block}"
        add(f"{p}.gate.weight", mlp + ("gate", "kernel"), i, "router", (e, d))
        for x in range(e):
            add(f"{p}.experts.{x}.{w_gate}.weight", gate_up + ("kernel",), i, "expert", (f, d), expert=x, column=0)
            add(f"{p}.experts.{x}.{w_up}.weight", gate_up + ("kernel",), i, "expert", (f, d), expert=x, column=f)
            add(f"{p}.experts.{x}.{w_down}.weight", down + ("kernel",), i, "expert", (d, f), expert=x, column=0)
    if cfg.router_fp32:  # GLM-4.5: mlp.gate.weight and e_score_correction_bias stay float32
        specs = {n: dataclasses.replace(s, keep_fp32=True) if s.path[-2] == cfg.router_name else s
                 for n, s in specs.items()}
    return specs


# ---- GLM-4.5 MoE ----
def _glm4_moe_extra_specs(cfg: ModelConfig, i: int, add) -> None:
    """MoE layer i's router score-correction bias `mlp.gate.e_score_correction_bias` [E] and shared experts
    `mlp.shared_experts.{gate,up,down}_proj.weight` (GLM-4.5), where the config has them."""
    mlp, p = LAYERS + ("mlp",), f"model.layers.{i}.mlp"
    if cfg.router_score_bias:
        add(f"{p}.gate.e_score_correction_bias", mlp + ("gate", "e_score_correction_bias"), i, "copy",
            (cfg.num_experts,))
    if cfg.shared_expert_size:
        d, f = cfg.hidden_size, cfg.shared_expert_size
        for proj, shape in (("gate_proj", (f, d)), ("up_proj", (f, d)), ("down_proj", (d, f))):
            add(f"{p}.shared_experts.{proj}.weight", mlp + ("shared_experts", proj, "kernel"), i, "kernel", shape)


def mtp_layer_tensor(cfg: ModelConfig, name: str) -> bool:
    """Whether checkpoint tensor `name` belongs to a multi-token-prediction layer past the decoder's layers
    (GLM-4.5's model.layers.{L..L+num_mtp_layers-1}.*), which transformers does not load either."""
    if not cfg.num_mtp_layers or not name.startswith("model.layers."):
        return False
    index = name.split(".")[2]
    return index.isdigit() and cfg.num_hidden_layers <= int(index) < cfg.num_hidden_layers + cfg.num_mtp_layers
# ---- end GLM-4.5 MoE ----


def stack_shape(cfg: ModelConfig, spec: TensorSpec) -> tuple[int, ...]:
    """The full layer-stacked shape of the variable a layer tensor goes into ([n, ...], n the layers holding it:
    config.stack_holders; for kind "expert" the whole [n, E, in, out] stack)."""
    n = len(stack_holders(cfg, spec.path[len(LAYERS)]))
    if spec.kind != "expert":
        return (n, *spec.param_shape)
    e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    return (n, e, d, 2 * f) if spec.path[-2] == "gate_up_proj" else (n, e, f, d)
