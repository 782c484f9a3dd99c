"""Gemma 4 text (config.json model_type "gemma4_text"; transformers' Gemma4ForCausalLM): Gemma 3's tensors, the
layer's scalar, per-layer input embeddings (PLE) and KV-shared layers (_gemma4_fields, _gemma4_model_specs)."""
from __future__ import annotations

import logging

from unsloth_jax.config import ModelConfig, activation, need, no_layer_windows
from unsloth_jax.errors import ConfigError
from unsloth_jax.families.base import MultimodalTextLayout, TextFamily
from unsloth_jax.families.tensors import LLAMA_TENSORS, QK_NORM, SANDWICH, TensorSpec

log = logging.getLogger("unsloth_jax")

# Gemma4ForConditionalGeneration (every released google/gemma-4-* checkpoint): its text decoder loads for text
# fine-tuning; the vision and audio towers and their embedders stay on disk and are copied through on export
GEMMA4_MULTIMODAL = MultimodalTextLayout(
    "gemma4", "Gemma4ForConditionalGeneration", "model.language_model.",
    ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio."))


def _gemma4_layer_shapes(raw: dict, types: list, source: str) -> dict:
    """The full-attention layers' own attention shape: transformers gives them `global_head_dim` (default 512) and,
    with attention_k_eq_v, `num_global_key_value_heads` keys/values heads, or per-layer overrides in
    `per_layer_config` (what its save_pretrained writes). -> the ModelConfig fields global_head_dim / global_kv_heads
    (0 where the full layers have the model's shape and no k_eq_v: one attention shape). Refused, naming the key:
    overrides of other fields, of sliding layers, or that differ between full layers."""
    hd, kv = raw.get("head_dim", 256), raw.get("num_key_value_heads", 4)
    k_eq_v = bool(raw.get("attention_k_eq_v"))
    per_layer = raw.get("per_layer_config")
    if per_layer is None:  # transformers' __post_init__ spelling: global_head_dim for the full-attention layers
        over = {"head_dim": raw.get("global_head_dim", 512)}
        if k_eq_v and raw.get("num_global_key_value_heads") is not None:
            over["num_key_value_heads"] = raw["num_global_key_value_heads"]
        per_layer = {str(i): over for i, t in enumerate(types) if t == "full_attention"}
    if not isinstance(per_layer, dict):
        raise ConfigError(f"{source}: per_layer_config must be a mapping of layer index to overrides")
    shapes = set()
    for idx, over in per_layer.items():
        over = over or {}
        bad = sorted(set(over) - {"head_dim", "num_key_value_heads"})
        if bad:
            raise ConfigError(f"{source}: per_layer_config[{idx}] overrides {bad}: not supported (only head_dim and "
                              "num_key_value_heads)")
        if not str(idx).isdigit() or not int(idx) < len(types):
            raise ConfigError(f"{source}: per_layer_config key {idx!r} is not a layer index below {len(types)}")
        shape = (int(over.get("head_dim", hd)), int(over.get("num_key_value_heads", kv)))
        if types[int(idx)] == "sliding_attention":
            if shape != (hd, kv):
                raise ConfigError(f"{source}: per_layer_config[{idx}] gives sliding-attention layer {idx} head_dim "
                                  f"{shape[0]} / num_key_value_heads {shape[1]}: only full-attention layers may "
                                  f"differ from the model's head_dim {hd} / num_key_value_heads {kv}")
            continue
        shapes.add(shape)
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    if any(i not in {int(k) for k in per_layer} for i in full):  # keys: "4", or "04" as transformers writes 10+ layers
        shapes.add((hd, kv))
    if len(shapes) > 1:
        raise ConfigError(f"{source}: per_layer_config gives the full-attention layers different attention shapes "
                          f"{sorted(shapes)} (head_dim, num_key_value_heads): only one shape for all of them is "
                          "supported")
    ghd, gkv = shapes.pop() if shapes else (hd, kv)
    if (ghd, gkv) == (hd, kv) and not k_eq_v:
        return {}
    if raw.get("num_attention_heads", 8) % gkv:
        raise ConfigError(f"{source}: num_attention_heads {raw.get('num_attention_heads', 8)} is not a multiple of "
                          f"the full-attention layers' {gkv} key/value heads (num_global_key_value_heads)")
    return {"global_head_dim": ghd, "global_kv_heads": gkv, "attention_k_eq_v": k_eq_v}


def _gemma4_fields(raw: dict, source: str) -> dict:
    """Gemma 4 text (Gemma4ForCausalLM, Gemma4TextConfig): Gemma 3's sandwich-normed layer with plain-weight
    RMSNorms (not 1 + w), q/k norms and a weightless value norm, attention scale 1, `layer_types` (default 5
    sliding : 1 full, the last layer always full), RoPE per layer type (`rope_parameters.sliding_attention`:
    default; `full_attention`: default or "proportional", which rotates the first partial_rotary_factor of the
    frequencies), per-layer input embeddings (`hidden_size_per_layer_input`, `vocab_size_per_layer_input`), the
    last `num_kv_shared_layers` layers attending over the keys/values of the last earlier layer of their type, and
    each layer's `layer_scalar`; the full-attention layers' own attention shape (`global_head_dim`,
    `num_global_key_value_heads` with `attention_k_eq_v`, whose full layers take their values from k_proj, or
    `per_layer_config`: _gemma4_layer_shapes) and the KV-shared layers' MLP at twice intermediate_size
    (`use_double_wide_mlp`). Refused, naming the key: MoE blocks, bidirectional attention, full layers of
    different shapes."""
    n = int(need(raw, "num_hidden_layers", source))
    if raw.get("enable_moe_block"):
        raise ConfigError(f"{source}: enable_moe_block=true (Gemma 4's MoE block) is not supported")
    if raw.get("use_bidirectional_attention") == "all":
        raise ConfigError(f"{source}: use_bidirectional_attention='all' (bidirectional text attention) is not "
                          "supported; only causal attention")
    types = raw.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n:
        raise ConfigError(f"{source}: layer_types must be a list of {n} entries (num_hidden_layers), got {types!r}")
    bad = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
    if bad:
        raise ConfigError(f"{source}: layer_types entries {bad} are not supported (full_attention, sliding_attention)")
    if types[-1] != "full_attention":  # transformers forces it, with a warning
        log.warning("unsloth_jax: %s: the last layer of a Gemma 4 model is always full_attention (as transformers "
                    "forces it); layer_types[-1] %r ignored", source, types[-1])
        types = types[:-1] + ["full_attention"]
    out = _gemma4_layer_shapes(raw, types, source)
    window = raw.get("sliding_window", 512)
    if "sliding_attention" in types and (not isinstance(window, int) or window <= 0):
        raise ConfigError(f"{source}: sliding_window must be a positive integer, got {window!r}")
    windows = tuple(int(window) if t == "sliding_attention" else None for t in types)

    params = raw.get("rope_parameters") or {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                            "full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                                               "partial_rotary_factor": 0.25}}
    if not isinstance(params, dict) or not all(isinstance(params.get(t), dict) for t in set(types)):
        raise ConfigError(f"{source}: rope_parameters must hold a dict for each layer type in layer_types "
                          f"({sorted(set(types))}), got {params!r}")
    local = params.get("sliding_attention")
    if local is not None:
        if local.get("rope_type", "default") != "default":
            raise ConfigError(f"{source}: rope_parameters.sliding_attention.rope_type {local.get('rope_type')!r} is "
                              "not supported (only default)")
        out["rope_local_theta"] = float(need(local, "rope_theta", source + " rope_parameters.sliding_attention"))
    full = params.get("full_attention")
    full_type = full.get("rope_type", "default")
    if full_type == "proportional":
        prop = float(full.get("partial_rotary_factor", 1.0))
        if not 0.0 <= prop <= 1.0:
            raise ConfigError(f"{source}: rope_parameters.full_attention.partial_rotary_factor must be in [0, 1], "
                              f"got {prop}")
        out.update(rope_theta=float(need(full, "rope_theta", source + " rope_parameters.full_attention")),
                   rope_type="proportional", rope_proportion=prop, rope_factor=float(full.get("factor", 1.0)))
    elif full_type == "default":
        out["rope_theta"] = float(need(full, "rope_theta", source + " rope_parameters.full_attention"))
    else:
        raise ConfigError(f"{source}: rope_parameters.full_attention.rope_type {full_type!r} is not supported "
                          "(default, proportional)")
    if "sliding_attention" not in types:
        out.pop("rope_local_theta", None)

    shared = int(raw.get("num_kv_shared_layers") or 0)
    if not 0 <= shared < n:
        raise ConfigError(f"{source}: num_kv_shared_layers={shared} must be below num_hidden_layers={n}")
    first = n - shared
    sources = list(range(n))
    for i in range(first, n):
        own = [j for j in range(first) if types[j] == types[i]]
        if not own:
            raise ConfigError(f"{source}: KV-shared layer {i} ({types[i]}, num_kv_shared_layers={shared}) has no "
                              f"earlier {types[i]} layer to share keys/values with")
        sources[i] = own[-1]
    ple = int(raw.get("hidden_size_per_layer_input", 256) or 0)
    out.update(layer_windows=windows, layer_kv_source=tuple(sources) if shared else (),
               per_layer_input_size=ple, double_wide_mlp=bool(raw.get("use_double_wide_mlp")) and shared > 0,
               per_layer_vocab_size=int(raw.get("vocab_size_per_layer_input", 262_144)) if ple else 0,
               activation=activation(raw, source, "hidden_activation"),
               qk_norm=True, v_norm=True, norm_offset=0.0, embed_scale=True, sandwich_norms=True, attn_softcap=None,
               query_scale=1.0, layer_scalar=True, tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)))
    return out


# with per-layer inputs (per_layer_input_size), each layer's per-layer input block; KV-shared layers have no
# k_proj / v_proj / k_norm (config.layer_has)
_GEMMA4_PLE = (
    ("per_layer_input_gate.weight", ("per_layer_input_gate", "kernel"), "kernel"),
    ("per_layer_projection.weight", ("per_layer_projection", "kernel"), "kernel"),
    ("post_per_layer_input_norm.weight", ("post_per_layer_input_norm", "weight"), "norm"),
)


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


_LAYER_SCALAR = (("layer_scalar", ("layer_scalar",), "norm"),)
# its windows come from _gemma4_fields
GEMMA4_TEXT = TextFamily("Gemma 4 text", ("gemma4_text",), config_fields=_gemma4_fields,
                         layer_windows=no_layer_windows,
                         layer_tensors=LLAMA_TENSORS + SANDWICH + QK_NORM + _LAYER_SCALAR,
                         switched_tensors=(("per_layer_input_size", _GEMMA4_PLE),),
                         model_tensors=_gemma4_model_specs)

__all__ = ["GEMMA4_MULTIMODAL", "GEMMA4_TEXT"]
