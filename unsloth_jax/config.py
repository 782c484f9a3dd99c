"""ModelConfig: the fields of a Hugging Face config.json that the decoder needs, with per-family switches.

One frozen dataclass for every supported family (Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, Qwen3, Gemma, Gemma 2,
Gemma 3 text, Phi-3).
Reads both spellings of RoPE settings: transformers 4's `rope_theta` + `rope_scaling`, and transformers 5's
`rope_parameters`.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from pathlib import Path

from unsloth_jax.errors import CheckpointNotFoundError, ConfigError, UnsupportedArchitectureError

log = logging.getLogger("unsloth_jax")

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static description of a decoder. Hashable, so it can be a static argument of jitted functions."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"  # "default" | "linear" | "llama3" | "longrope"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k before RoPE
    activation: str = "silu"  # "silu" | "gelu" (erf) | "gelu_tanh"
    norm_offset: float = 0.0  # Gemma's (1 + w) RMSNorm
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden)
    sandwich_norms: bool = False  # Gemma 2: post-attention and pre/post feed-forward norms
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_scale: float = 0.0  # softmax scale; 0 means head_dim ** -0.5
    layer_windows: tuple[int | None, ...] = ()  # per layer: sliding window size, or None for full attention
    rope_local_theta: float = 0.0  # Gemma 3: plain-RoPE base of the sliding-window layers; 0 = all layers alike
    rotary_dim: int = 0  # Phi-3 partial_rotary_factor: RoPE on the first rotary_dim dims of a head; 0 = head_dim
    rope_short_factor: tuple[float, ...] = ()  # LongRoPE (Phi-3): per-frequency divisors up to the original length
    rope_long_factor: tuple[float, ...] = ()  # ... and beyond it (chosen by the largest position of a call)
    rope_attention_factor: float = 1.0  # LongRoPE: cos and sin are multiplied by this
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    torch_dtype: str | None = None

    @property
    def scale(self) -> float:
        return self.query_scale or self.head_dim ** -0.5

    @property
    def rope_dim(self) -> int:
        """How many leading dims of each head RoPE rotates (head_dim unless partial)."""
        return self.rotary_dim or self.head_dim

    @property
    def layer_period(self) -> int:
        """Smallest p such that layer_windows repeats with period p (layer i has the window of layer i % p).
        p need not divide num_hidden_layers: Gemma 3's 26 layers are 4 groups of 6 and a tail of 2."""
        n = self.num_hidden_layers
        windows = self.layer_windows or (None,) * n
        for p in range(1, n + 1):
            if all(windows[i] == windows[i % p] for i in range(n)):
                return p
        return n

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        return _parse(raw, source)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise CheckpointNotFoundError(f"model directory not found: {model_dir}")
        if not path.is_file():
            raise CheckpointNotFoundError(f"{model_dir}: no config.json (is this a Hugging Face model directory?)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return _parse(raw, str(path))


def _need(raw: dict, key: str, source: str):
    if key not in raw or raw[key] is None:
        raise ConfigError(f"{source}: required field '{key}' is missing")
    return raw[key]


def _rope(raw: dict, source: str) -> dict:
    """Normalise RoPE settings from either transformers 4 or transformers 5 spelling."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    if not params:
        params = dict(scaling)
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    out = {"rope_theta": float(theta), "rope_type": rope_type}
    if rope_type == "default":
        return out
    if rope_type not in ("linear", "llama3"):
        raise ConfigError(f"{source}: rope type '{rope_type}' is not supported (supported: default, linear, llama3)")
    out["rope_factor"] = float(_need(params, "factor", source + " rope_scaling"))
    if rope_type == "llama3":
        out["rope_low_freq_factor"] = float(params.get("low_freq_factor", 1.0))
        out["rope_high_freq_factor"] = float(params.get("high_freq_factor", 4.0))
        out["rope_original_max_position"] = int(params.get("original_max_position_embeddings", 8192))
    return out


def _layer_windows(raw: dict, model_type: str, n_layers: int, source: str) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    types = raw.get("layer_types")
    if model_type == "qwen2" or model_type == "qwen3":
        if not raw.get("use_sliding_window", False):
            return (None,) * n_layers
    if types:
        if len(types) != n_layers:
            raise ConfigError(f"{source}: layer_types has {len(types)} entries for {n_layers} layers")
        out = []
        for t in types:
            if t == "sliding_attention":
                if not window:
                    raise ConfigError(f"{source}: layer_types asks for sliding attention but sliding_window is unset")
                out.append(int(window))
            elif t == "full_attention":
                out.append(None)
            else:
                raise ConfigError(f"{source}: layer type '{t}' is not supported")
        return tuple(out)
    if not window:
        return (None,) * n_layers
    if model_type == "gemma2":  # even layers slide, odd layers are global
        return tuple(int(window) if i % 2 == 0 else None for i in range(n_layers))
    if model_type in ("qwen2", "qwen3"):
        first = int(raw.get("max_window_layers", 0))
        return tuple(int(window) if i >= first else None for i in range(n_layers))
    return (int(window),) * n_layers


def _activation(raw: dict, model_type: str, source: str) -> str:
    if model_type in ("gemma", "gemma2", "gemma3_text"):
        name = raw.get("hidden_activation") or "gelu_pytorch_tanh"
    else:
        name = raw.get("hidden_act", "silu")
    table = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
    if name not in table:
        raise ConfigError(f"{source}: activation '{name}' is not supported (supported: {', '.join(table)})")
    return table[name]


def _parse(raw: dict, source: str) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"{source}: model_type {model_type!r} is not supported; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    hidden = int(_need(raw, "hidden_size", source))
    heads = int(_need(raw, "num_attention_heads", source))
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    head_dim = int(raw.get("head_dim") or hidden // heads)
    n_layers = int(_need(raw, "num_hidden_layers", source))
    if heads % kv_heads:
        raise ConfigError(f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    gemma = model_type in ("gemma", "gemma2")
    default_tie = gemma
    fields = dict(
        model_type=model_type,
        vocab_size=int(_need(raw, "vocab_size", source)),
        hidden_size=hidden,
        intermediate_size=int(_need(raw, "intermediate_size", source)),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", default_tie)),
        qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        o_bias=model_type != "qwen2" and bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        activation=_activation(raw, model_type, source),
        norm_offset=1.0 if gemma else 0.0,
        embed_scale=gemma,
        sandwich_norms=model_type == "gemma2",
        attn_softcap=(float(raw["attn_logit_softcapping"]) if raw.get("attn_logit_softcapping") else None),
        final_softcap=(float(raw["final_logit_softcapping"]) if raw.get("final_logit_softcapping") else None),
        query_scale=(float(raw["query_pre_attn_scalar"]) ** -0.5 if model_type == "gemma2" and raw.get("query_pre_attn_scalar") else 0.0),
        layer_windows=_layer_windows(raw, model_type, n_layers, source),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=tuple(raw["eos_token_id"]) if isinstance(raw.get("eos_token_id"), list) else raw.get("eos_token_id"),
        pad_token_id=raw.get("pad_token_id"),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
    )
    fields.update(_rope(raw, source) if model_type not in _FAMILY_FIELDS else _FAMILY_FIELDS[model_type](raw, source))
    if not math.isfinite(fields["rope_theta"]) or fields["rope_theta"] <= 0:
        raise ConfigError(f"{source}: rope_theta must be positive")
    return ModelConfig(**fields)


# ------------------------------------------------------------------------------------ Gemma 3 text, Phi-3
def _gemma3_fields(raw: dict, source: str) -> dict:
    """Gemma 3 text (Gemma3ForCausalLM): Gemma 2's layer shape (sandwich norms, (1 + w) norms, scaled
    embeddings) plus q/k norms, every `sliding_window_pattern`-th layer global (or `layer_types`), and two RoPEs:
    plain RoPE with base `rope_local_base_freq` on sliding layers, `rope_theta` + `rope_scaling` on global ones.
    `final_logit_softcapping` applies; `attn_logit_softcapping` is ignored, as transformers' Gemma 3 does.
    Reads transformers 4 (`rope_theta`, `rope_local_base_freq`, `rope_scaling`) and 5 (`rope_parameters` keyed
    by layer type) spellings; defaults are Gemma3TextConfig's."""
    if raw.get("use_bidirectional_attention"):
        raise ConfigError(f"{source}: use_bidirectional_attention=true (an embedding model) is not supported")
    n = int(_need(raw, "num_hidden_layers", source))
    params = raw.get("rope_parameters") or {}
    nested = isinstance(params.get("full_attention"), dict) or isinstance(params.get("sliding_attention"), dict)
    if nested:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full = dict(params or raw.get("rope_scaling") or {})
        local = {}
    full.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", raw.get("rope_local_base_freq", 10_000.0))
    if (local.get("rope_type") or local.get("type") or "default") != "default":
        raise ConfigError(f"{source}: sliding_attention rope type {local.get('rope_type') or local.get('type')!r} "
                          "is not supported (only default RoPE on Gemma 3's sliding layers)")
    out = _rope({"rope_parameters": full}, source)
    out["rope_local_theta"] = float(local["rope_theta"])
    if not math.isfinite(out["rope_local_theta"]) or out["rope_local_theta"] <= 0:
        raise ConfigError(f"{source}: rope_local_base_freq must be positive")
    if not raw.get("layer_types"):
        pattern = int(raw.get("sliding_window_pattern") or 6)
        raw = dict(raw, sliding_window=raw.get("sliding_window", 4096),
                   layer_types=["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)])
    out["layer_windows"] = _layer_windows(raw, "gemma3_text", n, source)
    if not any(out["layer_windows"]):
        out["rope_local_theta"] = 0.0  # no sliding layer: one RoPE
    if raw.get("attn_logit_softcapping"):
        log.warning("unsloth_jax: %s sets attn_logit_softcapping, which transformers' Gemma 3 never applies; "
                    "ignored here too, so the logits match transformers'", source)
    out.update(qk_norm=True, norm_offset=1.0, embed_scale=True, sandwich_norms=True, attn_softcap=None,
               tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
               query_scale=float(raw.get("query_pre_attn_scalar") or 256) ** -0.5)
    return out


def _phi3_fields(raw: dict, source: str) -> dict:
    """Phi-3 (Phi3ForCausalLM): Llama's layer (the checkpoint fuses qkv_proj and gate_up_proj; hf/mapping.py
    splits them), partial RoPE (`partial_rotary_factor`) and LongRoPE (`rope_scaling` type "longrope", or the
    older "su" / "yarn" that transformers reads as longrope): inverse frequencies divided by `short_factor` while
    the largest position of a call is below `original_max_position_embeddings`, by `long_factor` beyond, and
    cos/sin times `attention_factor` (default sqrt(1 + ln(factor) / ln(original)), factor = max_position /
    original)."""
    params = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    head_dim = int(raw.get("head_dim") or int(_need(raw, "hidden_size", source)) // int(
        _need(raw, "num_attention_heads", source)))
    partial = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) or 1.0)
    rotary = int(head_dim * partial)
    if rotary <= 0 or rotary > head_dim or rotary % 2:
        raise ConfigError(f"{source}: partial_rotary_factor={partial} gives {rotary} rotary dims of a {head_dim}-dim "
                          "head; it must be even and between 2 and head_dim")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    out: dict = {"rotary_dim": 0 if rotary == head_dim else rotary}
    if rope_type not in ("longrope", "su", "yarn"):
        out.update(_rope({"rope_parameters": params}, source))
        return out
    short, long = params.get("short_factor"), params.get("long_factor")
    for key, value in (("short_factor", short), ("long_factor", long)):
        if not isinstance(value, list) or len(value) != rotary // 2 or not all(
                isinstance(x, (int, float)) and x > 0 for x in value):
            raise ConfigError(f"{source}: rope_scaling.{key} must be a list of {rotary // 2} positive numbers "
                              f"(one per rotary frequency) for rope type {rope_type!r}")
    original = raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    if not original:
        raise ConfigError(f"{source}: LongRoPE needs original_max_position_embeddings")
    original = int(original)
    factor = params.get("factor") or int(raw.get("max_position_embeddings", original)) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    out.update(rope_theta=float(params["rope_theta"]), rope_type="longrope", rope_factor=float(factor),
               rope_original_max_position=original, rope_short_factor=tuple(float(x) for x in short),
               rope_long_factor=tuple(float(x) for x in long), rope_attention_factor=float(attention))
    return out


# model_type -> parser of its RoPE and family switches (fields that override the generic ones in _parse)
_FAMILY_FIELDS = {"gemma3_text": _gemma3_fields, "phi3": _phi3_fields}
