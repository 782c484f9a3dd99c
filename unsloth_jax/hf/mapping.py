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
from unsloth_jax.families import text_family
from unsloth_jax.families.tensors import LAYERS, MLP_BIAS, O_BIAS, QK_NORM, QKV_BIAS, TensorSpec
# the per-layer tables are the families' (TextFamily.layer_tensors, families/tensors.py); this module builds the
# specs of a checkpoint from its family's table and config


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
    """Whether checkpoint tensor `name` is one transformers skips on load for this family (its
    `ignored_prefixes`; Qwen3_5ForCausalLM: the multi-token-prediction head `mtp.*` and a vision tower
    `model.visual.*`), or one a Gemma 4 layer's forward never reads: the key/value projections and norms of a
    KV-shared layer, which attends over its source layer's keys/values (transformers 5.25 has no such weights; a
    checkpoint or adapter that holds them loads without them)."""
    return name.startswith(text_family(cfg.model_type).ignored_prefixes) or kv_shared_tensor(cfg, name)


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
    """The family's per-layer table, with optional norms and biases switched on by the config."""
    family = text_family(cfg.model_type)
    entries = list(family.layer_tensors)
    if cfg.qk_norm and not any(e[1][1] == "q_norm" for e in entries):  # optional q/k norms (GLM-4.5 use_qk_norm)
        entries += QK_NORM
    if cfg.qkv_bias and not any(e[1][1:] == ("q_proj", "bias") for e in entries):  # Qwen2's table has them
        entries += QKV_BIAS
    if cfg.o_bias:
        entries += O_BIAS
    if cfg.mlp_bias:
        entries += MLP_BIAS
    for field, switched in family.switched_tensors:
        if getattr(cfg, field):
            entries += switched
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
    entries = layer_entries(cfg)
    for i in range(cfg.num_hidden_layers):
        attn, mlp = layer_module(cfg, "self_attn", i), layer_module(cfg, "mlp", i)
        shapes = _proj_shapes(cfg, attn, mlp)
        hd = attention_dims(cfg, attn)[0]
        for suffix, sub, kind in entries:
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
    family = text_family(cfg.model_type)
    if family.model_tensors is not None:
        specs.update(family.model_tensors(cfg))
    return specs


def fused_groups(cfg: ModelConfig) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """(fused HF module name, parent, projections in row order) of the family, e.g. ("qkv_proj", "self_attn",
    ("q_proj", "k_proj", "v_proj")) for Phi-3; empty for families whose checkpoints keep projections apart."""
    return tuple((suffix.split(".")[1], parent, projs)
                 for suffix, parent, projs in text_family(cfg.model_type).fused_projs)


def _fused_spec(cfg: ModelConfig, name: str, suffix: str, layer: int, shapes: dict) -> TensorSpec:
    parent, projs = next((p, pr) for s, p, pr in text_family(cfg.model_type).fused_projs if s == suffix)
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
EXPERT_LAYOUTS = ("per_expert", "fused")  # a family's expert_layouts: the first is what save_pretrained writes


def detect_expert_layout(cfg: ModelConfig, names) -> str:
    """The expert layout of a checkpoint holding tensor `names`: "fused" when it has fused expert stacks
    (`...mlp.experts.gate_up_proj`), else "per_expert" (a family with fused checkpoints only: "fused")."""
    if text_family(cfg.model_type).expert_layouts == ("fused",):
        return "fused"
    if any(n.endswith(".mlp.experts.gate_up_proj") for n in names):
        return "fused"
    return "per_expert"


def moe_specs(cfg: ModelConfig, expert_layout: str | None = None) -> dict[str, TensorSpec]:
    """The per-layer MLP tensors of a MoE family: the router and experts of the sparse layers, the dense
    gate/up/down projections of the others (Qwen3-MoE mlp_only_layers), and gpt-oss's attention sinks. The
    family gives its layouts and per-expert names, or builds its sparse layers' specs itself (gpt-oss)."""
    family = text_family(cfg.model_type)
    layout = expert_layout or family.expert_layouts[0]
    if layout not in EXPERT_LAYOUTS or layout not in family.expert_layouts:
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
        if family.sparse_specs is not None:
            family.sparse_specs(cfg, i, add)
            continue
        if family.sparse_extra_specs is not None:
            family.sparse_extra_specs(cfg, i, add)
        block, w_gate, w_up, w_down = family.per_expert_names
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
