"""Qwen3.5 text (config.json model_type "qwen3_5_text"; transformers' Qwen3_5ForCausalLM, and the text decoder of
Qwen3.5 as released, families.qwen3_5): gated DeltaNet linear attention on some layers, gated full attention with
q/k norms on the others (_qwen3_5_fields). llama.cpp's arch "qwen35": hf/gguf_families.py."""
from __future__ import annotations

from unsloth_jax.config import activation, need, no_layer_windows, positive_int, rope_fields
from unsloth_jax.errors import ConfigError
from unsloth_jax.families.base import TextFamily
from unsloth_jax.families.tensors import LLAMA_TENSORS, QK_NORM

# config.json fields Qwen3_5TextConfig defaults when they are absent (read before parsing)
_RAW_DEFAULTS = dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                     num_attention_heads=16, num_key_value_heads=4, head_dim=256, max_position_embeddings=32768,
                     tie_word_embeddings=False)
_QWEN3_5_LINEAR = dict(linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                       linear_num_key_heads=16, linear_num_value_heads=32)


def _qwen3_5_fields(raw: dict, source: str) -> dict:
    """Qwen3.5 text (Qwen3_5ForCausalLM, Qwen3_5TextConfig): `layer_types` (default: every
    `full_attention_interval`-th layer, 4, "full_attention", the others "linear_attention") picks each layer's
    token mixer: gated DeltaNet linear attention (linear_* sizes, a depthwise causal conv1d of
    linear_conv_kernel_dim) or self-attention with q/k norms and an output gate (q_proj is twice as wide: each
    head's query then its gate). Every RMSNorm but the linear attention's gated one is (1 + w); RoPE on the
    first partial_rotary_factor (default 0.25) of each head's dims (the M-RoPE sections of the vision-language
    model reduce to plain RoPE for text positions)."""
    n = int(need(raw, "num_hidden_layers", source))
    types = raw.get("layer_types")
    if types is None:
        interval = positive_int(raw, "full_attention_interval", 4, source)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n:
        raise ConfigError(f"{source}: layer_types must be a list of {n} entries (num_hidden_layers), got {types!r}")
    bad = sorted({str(t) for t in types if t not in ("full_attention", "linear_attention")})
    if bad:
        raise ConfigError(f"{source}: layer_types entries {bad} are not supported (full_attention, linear_attention)")
    if "full_attention" not in types:
        raise ConfigError(f"{source}: layer_types has no full_attention layer; a model of linear-attention layers "
                          "only is not supported")
    if raw.get("attention_bias"):
        raise ConfigError(f"{source}: attention_bias=true is not supported for qwen3_5_text")
    if activation(raw, source) != "silu":
        raise ConfigError(f"{source}: hidden_act {raw.get('hidden_act')!r} is not supported for qwen3_5_text (only "
                          "silu: the linear attention's conv1d and gate use it too)")
    sizes = {k: positive_int(raw, k, d, source) for k, d in _QWEN3_5_LINEAR.items()}
    if sizes["linear_num_value_heads"] % sizes["linear_num_key_heads"]:
        raise ConfigError(f"{source}: linear_num_value_heads={sizes['linear_num_value_heads']} is not a multiple of "
                          f"linear_num_key_heads={sizes['linear_num_key_heads']}")
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    partial = params.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25))
    for key in ("mrope_section", "mrope_interleaved"):  # text positions are equal on the M-RoPE axes
        params.pop(key, None)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type != "default":
        raise ConfigError(f"{source}: rope_parameters.rope_type {rope_type!r} is not supported for qwen3_5_text "
                          "(only default)")
    head_dim = int(raw["head_dim"])
    rotary = int(head_dim * float(partial))
    if rotary <= 0 or rotary > head_dim or rotary % 2:
        raise ConfigError(f"{source}: partial_rotary_factor={partial} gives {rotary} rotary dims of a {head_dim}-dim "
                          "head; it must be even and between 2 and head_dim")
    out = rope_fields({"rope_parameters": params}, source)
    out.update(layer_linear=tuple(t == "linear_attention" for t in types), attn_output_gate=True, qk_norm=True,
               norm_offset=1.0, rotary_dim=0 if rotary == head_dim else rotary,
               linear_num_key_heads=sizes["linear_num_key_heads"],
               linear_num_value_heads=sizes["linear_num_value_heads"],
               linear_key_head_dim=sizes["linear_key_head_dim"], linear_value_head_dim=sizes["linear_value_head_dim"],
               linear_conv_kernel=sizes["linear_conv_kernel_dim"])
    return out


# Llama's tensors and q/k norms on the full-attention layers, the gated DeltaNet's on the linear ones
# (config.layer_has picks a layer's); conv1d weight [C, 1, K], A_log / dt_bias [Hv], norm.weight [Dv] copied as
# they are
_LINEAR_ATTN = (
    *[(f"linear_attn.{p}.weight", ("linear_attn", p, "kernel"), "kernel")
      for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")],
    *[(f"linear_attn.{name}", ("linear_attn", *name.split(".")), "copy")
      for name in ("conv1d.weight", "A_log", "dt_bias", "norm.weight")],
)
# layer_types names token mixers here (_qwen3_5_fields), not windows: no sliding windows. Qwen3_5ForCausalLM skips
# the multi-token-prediction head (mtp.*) and a vision tower (model.visual.*) on load.
QWEN3_5_TEXT = TextFamily("Qwen3.5 text", ("qwen3_5_text",), raw_defaults=tuple(_RAW_DEFAULTS.items()),
                          config_fields=_qwen3_5_fields, layer_windows=no_layer_windows,
                          layer_tensors=LLAMA_TENSORS + QK_NORM + _LINEAR_ATTN,
                          ignored_prefixes=("mtp.", "model.visual."), gguf_arch="QWEN35",
                          gguf_read=("qwen35", "Qwen3_5ForCausalLM"))

__all__ = ["QWEN3_5_TEXT"]
