"""SmolLM3 (SmolLM3ForCausalLM): Llama's layer and tensors with NoPE layers (no RoPE at all) and SmolLM3Attention's
sliding-window rule (_smollm3_fields). llama.cpp writes it as its own arch "smollm3" with llama's layout."""
from __future__ import annotations

from unsloth_jax.config import need, no_layer_windows, rope_fields
from unsloth_jax.errors import ConfigError
from unsloth_jax.families.base import TextFamily


def _smollm3_fields(raw: dict, source: str) -> dict:
    """SmolLM3 (SmolLM3ForCausalLM): Llama's layer, but the layers whose `no_rope_layers` entry is 0 apply no
    RoPE at all (NoPE); without the list, every `no_rope_layer_interval`-th layer (default 4: layers 3, 7, ...)
    is NoPE, as SmolLM3Config does. Sliding windows as transformers' SmolLM3Attention: a layer attends within
    `sliding_window` only when `use_sliding_window` is true and its `layer_types` entry is "sliding_attention";
    without `layer_types`, the NoPE layers slide (when use_sliding_window and sliding_window are set). Embeddings
    are tied unless tie_word_embeddings is false (SmolLM3Config's default is true)."""
    n = int(need(raw, "num_hidden_layers", source))
    flags = raw.get("no_rope_layers")
    if flags is None:
        interval = raw.get("no_rope_layer_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ConfigError(f"{source}: no_rope_layer_interval must be a positive integer, got {interval!r}")
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if not isinstance(flags, list) or len(flags) != n or any(f not in (0, 1) or isinstance(f, float) for f in flags):
        raise ConfigError(f"{source}: no_rope_layers must be a list of {n} entries (num_hidden_layers), each 1 (RoPE) "
                          f"or 0 (NoPE), got {flags!r}")
    rope = tuple(bool(f) for f in flags)
    use_sliding, window = bool(raw.get("use_sliding_window", False)), raw.get("sliding_window")
    types = raw.get("layer_types")
    if types is None:
        types = ["sliding_attention" if use_sliding and window is not None and not r else "full_attention"
                 for r in rope]
    if not isinstance(types, list) or len(types) != n:
        raise ConfigError(f"{source}: layer_types must be a list of {n} entries (num_hidden_layers), got {types!r}")
    bad = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
    if bad:
        raise ConfigError(f"{source}: layer_types entries {bad} are not supported (full_attention, sliding_attention)")
    windows = (None,) * n
    if use_sliding and "sliding_attention" in types:
        if not window or int(window) <= 0:
            raise ConfigError(f"{source}: use_sliding_window is true and layer_types asks for sliding attention, but "
                              f"sliding_window is {window!r} (it must be a positive integer)")
        windows = tuple(int(window) if t == "sliding_attention" else None for t in types)
    out = rope_fields(raw, source)
    out.update(layer_rope=rope if not all(rope) else (), layer_windows=windows,
               tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)))
    return out


# its windows come from _smollm3_fields (SmolLM3Attention's rule); its NoPE layers have no tensors of their own
SMOLLM3 = TextFamily("SmolLM3", ("smollm3",), config_fields=_smollm3_fields, layer_windows=no_layer_windows,
                     gguf_arch="SMOLLM3", gguf_read=("smollm3", "SmolLM3ForCausalLM"))

__all__ = ["SMOLLM3"]
