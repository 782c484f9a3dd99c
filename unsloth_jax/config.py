"""ModelConfig: the fields of a Hugging Face config.json that the decoder needs, with per-family switches.

One frozen dataclass for every supported family (Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, Qwen3, Gemma, Gemma 2,
Gemma 3 text, Gemma 4 text, Phi-3, SmolLM3, Qwen3.5 text; the mixture-of-experts families Qwen3-MoE, Mixtral,
gpt-oss and GLM-4.5 MoE). `parse_text_config(raw, source, family)` reads the fields every family reads alike and
then asks the text family (a families.TextFamily, passed in: this module sits below families/ and never imports
it) for its own; the family-specific parsers live in the family modules. Reads both spellings of RoPE settings:
transformers 4's `rope_theta` + `rope_scaling`, and transformers 5's `rope_parameters`.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
from typing import ClassVar
from pathlib import Path

from unsloth_jax.errors import CheckpointNotFoundError, ConfigError, UnsupportedArchitectureError

log = logging.getLogger("unsloth_jax")



@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static description of a decoder. Hashable, so it can be a static argument of jitted functions."""

    # ---- shape ----
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    # ---- special tokens, dtype and the output head (as the HF config gives them) ----
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    tie_word_embeddings: bool = False
    final_softcap: float | None = None
    # ---- attention ----
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k before RoPE
    query_scale: float = 0.0  # softmax scale; 0 means head_dim ** -0.5
    attn_softcap: float | None = None
    layer_windows: tuple[int | None, ...] = ()  # per layer: sliding window size, or None for full attention
    attn_sinks: bool = False  # gpt-oss: a learned per-head logit in every softmax denominator
    # ---- RoPE: rope_type "default" | "linear" | "llama3" | "longrope" | "yarn" ----
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    rope_local_theta: float = 0.0  # Gemma 3: plain-RoPE base of the sliding-window layers; 0 = all layers alike
    rotary_dim: int = 0  # Phi-3 partial_rotary_factor: RoPE on the first rotary_dim dims of a head; 0 = head_dim
    rope_short_factor: tuple[float, ...] = ()  # LongRoPE (Phi-3): per-frequency divisors up to the original length
    rope_long_factor: tuple[float, ...] = ()  # ... and beyond it (chosen by the largest position of a call)
    rope_attention_factor: float = 1.0  # LongRoPE / YaRN: cos and sin (not the local ones) are multiplied by this
    rope_beta_fast: float = 32.0  # YaRN (gpt-oss)
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    # per layer: False where the layer applies no RoPE (SmolLM3's NoPE layers); () means every layer rotates
    layer_rope: tuple[bool, ...] = ()
    # ---- norms and embeddings ----
    rms_norm_eps: float = 1e-6
    norm_offset: float = 0.0  # Gemma's (1 + w) RMSNorm
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden)
    sandwich_norms: bool = False  # Gemma 2: post-attention and pre/post feed-forward norms
    # ---- dense MLP ----
    mlp_bias: bool = False
    activation: str = "silu"  # "silu" | "gelu" (erf) | "gelu_tanh"
    # ---- mixture of experts (Qwen3-MoE, Mixtral, gpt-oss); num_experts = 0 means a dense MLP everywhere ----
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's intermediate size
    layer_sparse: tuple[bool, ...] = ()  # per layer: True where the MLP is the routed experts block
    router: str = "softmax_topk"  # "softmax_topk" (softmax, then top-k) | "topk_softmax" (gpt-oss)
    #   | "sigmoid_group" (GLM-4.5: sigmoid, grouped top-k with a score-correction bias; see the GLM block)
    norm_topk_prob: bool = False  # softmax_topk: renormalise the top-k probabilities to sum to 1
    router_bias: bool = False  # gpt-oss: the router linear has a bias
    router_name: str = "gate"  # HF attribute of the router under `mlp` ("gate", or "router" for gpt-oss)
    expert_bias: bool = False  # gpt-oss: expert gate_up/down projections have biases
    expert_activation: str = "silu"  # "silu" (SwiGLU) | "swiglu_clamp" (gpt-oss: clamped, alpha, (up + 1))
    gate_up_interleaved: bool = False  # gpt-oss: gate and up columns alternate in gate_up_proj
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    output_router_logits: bool = False  # as in transformers: add router_aux_loss_coef * aux loss to the loss
    router_aux_loss_coef: float = 0.001
    # ---- GLM-4.5 MoE (glm4_moe): sigmoid grouped router, shared experts, MTP layers ----
    n_group: int = 1  # router "sigmoid_group": the experts in n_group equal groups ...
    topk_group: int = 1  # ... and each token picks its experts from its topk_group best groups
    routed_scaling_factor: float = 1.0  # sigmoid_group: the routing weights are multiplied by this
    router_score_bias: bool = False  # the router has e_score_correction_bias, added to the scores for the choice
    shared_expert_size: int = 0  # intermediate size of the shared experts' MLP beside the routed ones; 0 = none
    num_mtp_layers: int = 0  # checkpoint layers past num_hidden_layers (multi-token prediction): not loaded
    router_fp32: bool = False  # router weight and score bias held, loaded and written in float32 (transformers'
    #   _keep_in_fp32_modules_strict), whatever the model's dtype
    # ---- end GLM-4.5 MoE ----
    # ---- Qwen3.5 (qwen3_5_text): hybrid layers ----
    # per layer: True where the token mixer is gated DeltaNet linear attention (`linear_attn`) instead of
    # self-attention; () means every layer attends
    layer_linear: tuple[bool, ...] = ()
    attn_output_gate: bool = False  # q_proj gives each head's query and a gate: output * sigmoid(gate) per head
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0  # the depthwise causal conv1d's kernel size
    # ---- end Qwen3.5 ----
    # ---- Gemma 4 text (gemma4_text): see families/gemma4_text.py (_gemma4_fields) ----
    v_norm: bool = False  # values RMS-normed (no weight) before attention and the cache
    rope_proportion: float = 1.0  # rope_type "proportional": the first rope_proportion of the frequencies rotate
    # per layer: the layer whose keys/values it attends over (itself, or an earlier one: a KV-shared layer)
    layer_kv_source: tuple[int, ...] = ()
    per_layer_input_size: int = 0  # per-layer input embeddings (PLE): width per layer; 0 = none
    per_layer_vocab_size: int = 0  # rows of the PLE table (embed_tokens_per_layer)
    layer_scalar: bool = False  # each layer's output times its own scalar (the checkpoint's layer_scalar)
    # the full-attention layers' own attention shape (their submodule `global_attn`): head dim and key/value heads;
    # 0 = the model's head_dim / num_key_value_heads in every layer (and self_attn in every layer)
    global_head_dim: int = 0
    global_kv_heads: int = 0
    attention_k_eq_v: bool = False  # global_attn has no v_proj: its values are k_proj's output (v-normed, no RoPE)
    double_wide_mlp: bool = False  # the KV-shared layers' MLP (`wide_mlp`) at 2 x intermediate_size
    # ---- end Gemma 4 ----
    # the checkpoint is a multimodal one whose text decoder this is (families.MULTIMODAL_TEXT_LAYOUTS' key: its
    # tensor names, the towers the merged export copies through); "" for a text checkpoint
    source_layout: str = ""

    @property
    def scale(self) -> float:
        return self.query_scale or self.head_dim ** -0.5

    @property
    def rope_dim(self) -> int:
        """How many leading dims of each head RoPE rotates (head_dim unless partial)."""
        return self.rotary_dim or self.head_dim

    @property
    def global_rope_dim(self) -> int:
        """The width of the global (non-local) RoPE tables: the full-attention layers' head dim where they have
        their own (Gemma 4's global_head_dim), else rope_dim."""
        return self.global_head_dim or self.rope_dim

    @property
    def layer_kinds(self) -> tuple[tuple, ...]:
        """Per layer, what makes layers differ in the layer scan: (window, sparse MLP, applies RoPE, linear-attention
        token mixer). Layers of equal kinds run the same code, so runs of a repeating pattern of kinds are scanned
        (layer_segments)."""
        n = self.num_hidden_layers
        kinds = tuple(zip(self.layer_windows or (None,) * n, self.layer_sparse or (False,) * n,
                          self.layer_rope or (True,) * n, self.layer_linear or (False,) * n))
        if self.layer_kv_source:  # Gemma 4: KV-shared layers read a given layer; the layers they read are special
            read = self.kv_shared_sources
            kinds = tuple(k + (None if s == i else s, i in read)
                          for i, (k, s) in enumerate(zip(kinds, self.layer_kv_source)))
        return kinds

    @property
    def layer_period(self) -> int:
        """Smallest p such that layer_kinds repeat with period p over the whole stack (layer i has the kind of
        layer i % p); p need not divide num_hidden_layers (Gemma 3: 26 layers = 4 x 6 + 2). A pattern that never
        repeats gives p = L. The layer scan runs per segment (layer_segments), not by this period."""
        kinds = self.layer_kinds
        n = len(kinds)
        return next(p for p in range(1, n + 1) if all(kinds[i] == kinds[i % p] for i in range(n)))

    @property
    def layer_segments(self) -> tuple[tuple[int, int, int], ...]:
        """The layer stack as consecutive segments (first layer, period, groups): each segment is `groups`
        repeats of a group of `period` layers with equal kinds, scanned over its groups (models.layer_stack).
        Chosen to keep the unrolled code (the sum of the periods) and the number of scans small: GLM-4.5's
        [dense, dense, sparse x 58] is (0, 1, 2), (2, 1, 58); Gemma 3's 26 layers (0, 6, 4), (24, 1, 2)."""
        return periodic_segments(self.layer_kinds)

    def kv_source(self, layer: int) -> int:
        """The layer whose keys/values `layer` attends over: itself, or for a KV-shared layer (Gemma 4) an
        earlier layer of the same attention type."""
        return self.layer_kv_source[layer] if self.layer_kv_source else layer

    @property
    def kv_shared_sources(self) -> frozenset[int]:
        """The layers whose keys/values some later (KV-shared) layer reads."""
        return frozenset(s for i, s in enumerate(self.layer_kv_source) if s != i)

    @property
    def has_nope_layers(self) -> bool:
        """Whether some decoder layer applies no RoPE (SmolLM3's NoPE layers)."""
        return not all(self.layer_rope or (True,))

    @property
    def has_linear_layers(self) -> bool:
        """Whether some decoder layer mixes tokens by linear attention (Qwen3.5's gated DeltaNet)."""
        return any(self.layer_linear)

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the linear-attention conv1d: q and k (Hk * Dk each) and v (Hv * Dv)."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    @property
    def is_moe(self) -> bool:
        """Whether some decoder layer routes its tokens to experts."""
        return any(self.layer_sparse)

    @property
    def has_dense_mlp(self) -> bool:
        """Whether some decoder layer has a dense (gate/up/down) MLP."""
        return not all(self.layer_sparse or (False,))


SEGMENT_COST = 2  # periodic_segments: one more scan costs as much compile as this many more unrolled layers


@functools.lru_cache(maxsize=256)
def periodic_segments(kinds: tuple) -> tuple[tuple[int, int, int], ...]:
    """Split a per-layer pattern of hashable kinds into consecutive segments (first, period, groups), where
    kinds[first + g * period + j] == kinds[first + j] for every group g < groups, minimising the unrolled layers
    (sum of periods) plus SEGMENT_COST per segment, then the number of segments, then preferring longer early
    segments (dynamic programming, O(L^3))."""
    n = len(kinds)
    best: list = [(0, 0, 0, None)] + [None] * n  # best[j]: (cost, segments, -start, last segment) for kinds[:j]
    for i in range(n):
        for p in range(1, n - i + 1):
            end = i + p  # kinds[i:end] repeat with period p
            while end < n and kinds[end] == kinds[end - p]:
                end += 1
            for c in range(1, (end - i) // p + 1):
                j = i + c * p
                cand = (best[i][0] + p + SEGMENT_COST, best[i][1] + 1, -i, (i, p, c))  # ties: longer first runs
                if best[j] is None or cand[:3] < best[j][:3]:
                    best[j] = cand
    out, j = [], n
    while j:
        seg = best[j][3]
        out.append(seg)
        j = seg[0]
    return tuple(reversed(out))


def read_config_json(model_dir: str | os.PathLike) -> tuple[dict, Path]:
    """(the parsed config.json of a Hugging Face model directory, its path); CheckpointNotFoundError for a missing
    directory or file, ConfigError for invalid JSON, each naming the path."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise CheckpointNotFoundError(f"model directory not found: {model_dir}")
    if not path.is_file():
        raise CheckpointNotFoundError(f"{model_dir}: no config.json (is this a Hugging Face model directory?)")
    try:
        return json.loads(path.read_text()), path
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def need(raw: dict, key: str, source: str):
    if key not in raw or raw[key] is None:
        raise ConfigError(f"{source}: required field '{key}' is missing")
    return raw[key]


def rope_fields(raw: dict, source: str) -> dict:
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
    if rope_type == "yarn":
        return out | _yarn(raw, params, source)
    if rope_type not in ("linear", "llama3"):
        raise ConfigError(f"{source}: rope type '{rope_type}' is not supported (supported: default, linear, llama3, "
                          "yarn)")
    out["rope_factor"] = float(need(params, "factor", source + " rope_scaling"))
    if rope_type == "llama3":
        out["rope_low_freq_factor"] = float(params.get("low_freq_factor", 1.0))
        out["rope_high_freq_factor"] = float(params.get("high_freq_factor", 4.0))
        out["rope_original_max_position"] = int(params.get("original_max_position_embeddings", 8192))
    return out


def layer_windows(raw: dict, n_layers: int, source: str, untyped=None) -> tuple[int | None, ...]:
    """Per layer, the sliding window or None (full attention): from `layer_types` (with `sliding_window`), else
    from `sliding_window` alone: untyped(window, n_layers) where given (a family's rule), every layer otherwise."""
    window = raw.get("sliding_window")
    types = raw.get("layer_types")
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
    if untyped is not None:
        return untyped(int(window), n_layers)
    return (int(window),) * n_layers


def no_layer_windows(raw: dict, n_layers: int, source: str) -> tuple[None, ...]:
    """Every layer attends fully (a family whose config_fields read its windows, or that has none)."""
    return (None,) * n_layers


def activation(raw: dict, source: str, key: str = "hidden_act") -> str:
    """The MLP activation named by config.json's `key`: "hidden_act" (default silu), or Gemma's
    "hidden_activation" (default gelu_pytorch_tanh)."""
    if key == "hidden_activation":
        name = raw.get("hidden_activation") or "gelu_pytorch_tanh"
    else:
        name = raw.get("hidden_act", "silu")
    table = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
    if name not in table:
        raise ConfigError(f"{source}: activation '{name}' is not supported (supported: {', '.join(table)})")
    return table[name]


def parse_text_config(raw: dict, source: str, family) -> ModelConfig:
    """config.json's dict `raw` of a text decoder -> ModelConfig: the fields every family reads alike, then the
    family's (`family`: a families.TextFamily, which config.py does not import; it supplies raw_defaults,
    layer_windows, activation_key, config_fields and moe_fields). ConfigError naming `source` and the key."""
    model_type = raw.get("model_type")
    if family.raw_defaults:
        raw = dict(family.raw_defaults) | raw
    hidden = int(need(raw, "hidden_size", source))
    heads = int(need(raw, "num_attention_heads", source))
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    head_dim = int(raw.get("head_dim") or hidden // heads)
    n_layers = int(need(raw, "num_hidden_layers", source))
    if heads % kv_heads:
        raise ConfigError(f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    fields = dict(
        model_type=model_type,
        vocab_size=int(need(raw, "vocab_size", source)),
        hidden_size=hidden,
        intermediate_size=int(raw.get("intermediate_size") or 0) if family.moe_fields else
        int(need(raw, "intermediate_size", source)),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=bool(raw.get("attention_bias", False)),
        o_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        activation=activation(raw, source, family.activation_key),
        attn_softcap=(float(raw["attn_logit_softcapping"]) if raw.get("attn_logit_softcapping") else None),
        final_softcap=(float(raw["final_logit_softcapping"]) if raw.get("final_logit_softcapping") else None),
        layer_windows=family.layer_windows(raw, n_layers, source),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=tuple(raw["eos_token_id"]) if isinstance(raw.get("eos_token_id"), list) else raw.get("eos_token_id"),
        pad_token_id=raw.get("pad_token_id"),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
    )
    fields.update(family.config_fields(raw, source))
    if family.moe_fields:
        fields.update(family.moe_fields(raw, n_layers, source))
    if not math.isfinite(fields["rope_theta"]) or fields["rope_theta"] <= 0:
        raise ConfigError(f"{source}: rope_theta must be positive")
    return ModelConfig(**fields)

# ------------------------------------------------------------------------------------- YaRN RoPE (gpt-oss)
def _yarn(raw: dict, params: dict, source: str) -> dict:
    """YaRN settings as transformers' _compute_yarn_parameters reads them (factor, beta_fast/slow, truncate,
    original_max_position_embeddings, and the cos/sin attention factor: given, or from mscale/mscale_all_dim,
    or 0.1 * ln(factor) + 1)."""
    where = source + " rope_parameters"
    original = int(need(params, "original_max_position_embeddings", where))
    factor = params.get("factor")
    factor = float(factor) if factor is not None else int(need(raw, "max_position_embeddings", source)) / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        ms, ms_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, ms) / mscale(factor, ms_all) if ms and ms_all else mscale(factor)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{where}: partial_rotary_factor is not supported")
    return {"rope_factor": factor, "rope_original_max_position": original,
            "rope_beta_fast": float(params.get("beta_fast") or 32.0),
            "rope_beta_slow": float(params.get("beta_slow") or 1.0),
            "rope_truncate": bool(params.get("truncate", True)), "rope_attention_factor": float(attention)}


def positive_int(raw: dict, key: str, default: int, source: str) -> int:
    """raw[key] (default when absent), a positive int; ConfigError naming `source` and the key otherwise."""
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


# --------------------------------------------------------------------------- vision-language (Gemma 3 + SigLIP)
@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The SigLIP vision tower of a vision-language model (HF `vision_config`, model_type siglip_vision_model).
    Defaults are SigLIP's (transformers' SiglipVisionConfig)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    layer_norm_eps: float = 1e-6
    activation: str = "gelu_tanh"

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclasses.dataclass(frozen=True)
class VisionLanguageConfig:
    """A Gemma 3 vision-language checkpoint (config.json model_type "gemma3", Gemma3ForConditionalGeneration):
    the text decoder's `ModelConfig`, the SigLIP `VisionConfig`, and how images become tokens: each image gives
    `mm_tokens_per_image` soft tokens, written where input_ids hold `image_token_index`."""

    text: ModelConfig
    vision: VisionConfig
    mm_tokens_per_image: int = 256
    image_token_index: int = 262144
    boi_token_index: int = 255999
    eoi_token_index: int = 256000
    model_type: str = "gemma3"

    @property
    def tokens_per_side(self) -> int:
        return math.isqrt(self.mm_tokens_per_image)

    @property
    def pool_kernel(self) -> int:
        """Side of the average-pooling window over the patch grid (patches per side / tokens per side)."""
        return self.vision.patches_per_side // self.tokens_per_side

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json", *, text) -> "VisionLanguageConfig":
        """`text`: the text family (families.GEMMA3_TEXT) text_config is parsed by."""
        return _parse_vision_language(raw, source, text)


VISION_LANGUAGE_MODEL_TYPES = ("gemma3",)


def _parse_vision_language(raw: dict, source: str, text_family) -> VisionLanguageConfig:
    if raw.get("model_type") not in VISION_LANGUAGE_MODEL_TYPES:
        raise UnsupportedArchitectureError(f"{source}: model_type {raw.get('model_type')!r} is not a supported "
                                           f"vision-language model ({', '.join(VISION_LANGUAGE_MODEL_TYPES)})")
    text_raw = dict(need(raw, "text_config", source))
    text_raw.setdefault("model_type", "gemma3_text")
    if text_raw["model_type"] != "gemma3_text":
        raise ConfigError(f"{source}: text_config.model_type is {text_raw['model_type']!r}, expected 'gemma3_text'")
    if "tie_word_embeddings" in raw:  # the top-level flag is the one Gemma3ForConditionalGeneration ties by
        text_raw["tie_word_embeddings"] = raw["tie_word_embeddings"]
    text = parse_text_config(text_raw, source + " text_config", text_family)
    if text.final_softcap is not None:
        log.warning("unsloth_jax: %s sets text_config.final_logit_softcapping, which transformers' "
                    "Gemma3ForConditionalGeneration never applies; ignored here too", source)
        text = dataclasses.replace(text, final_softcap=None)
    v = dict(raw.get("vision_config") or {})
    if v.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise ConfigError(f"{source}: vision_config.model_type {v.get('model_type')!r} is not supported "
                          "(only siglip_vision_model)")
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_new"):
        raise ConfigError(f"{source}: vision_config.hidden_act {act!r} is not supported (only gelu_pytorch_tanh)")
    d = VisionConfig()
    vision = VisionConfig(**{f.name: type(getattr(d, f.name))(v.get(f.name, getattr(d, f.name)))
                             for f in dataclasses.fields(VisionConfig) if f.name != "activation"})
    if vision.hidden_size % vision.num_attention_heads:
        raise ConfigError(f"{source}: vision_config.hidden_size={vision.hidden_size} is not a multiple of "
                          f"num_attention_heads={vision.num_attention_heads}")
    if vision.image_size % vision.patch_size:
        raise ConfigError(f"{source}: vision_config.image_size={vision.image_size} is not a multiple of "
                          f"patch_size={vision.patch_size}")
    mm = int(raw.get("mm_tokens_per_image", 256))
    side = math.isqrt(mm)
    if side * side != mm or side == 0 or vision.patches_per_side % side:
        raise ConfigError(f"{source}: mm_tokens_per_image={mm} must be a square whose side divides the "
                          f"{vision.patches_per_side} patches per image side")
    return VisionLanguageConfig(
        text=text, vision=vision, mm_tokens_per_image=mm,
        image_token_index=int(raw.get("image_token_index", raw.get("image_token_id", 262144))),
        boi_token_index=int(raw.get("boi_token_index", 255999)), eoi_token_index=int(raw.get("eoi_token_index", 256000)))


# ---- Qwen2.5-VL (model_type "qwen2_5_vl"): models.vision_qwen2_5 ----

@dataclasses.dataclass(frozen=True)
class QwenVisionConfig:
    """Qwen2.5-VL's vision tower (HF `vision_config`, model_type qwen2_5_vl_vision). Defaults are transformers'
    Qwen2_5_VLVisionConfig's. `fullatt_block_indexes`: the blocks attending over the whole image (the others
    attend within windows of `window_size` pixels)."""

    depth: int = 32
    hidden_size: int = 3584
    intermediate_size: int = 3420
    num_heads: int = 16
    out_hidden_size: int = 3584
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    tokens_per_second: int = 4
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6  # transformers hard-codes it for the vision norms

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch of pixel_values: C * T * p * p."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def num_hidden_layers(self) -> int:
        """depth, under the name the LoRA code reads for every vision tower."""
        return self.depth

    @property
    def merge_unit(self) -> int:
        """Patches merged into one language token: spatial_merge_size ** 2."""
        return self.spatial_merge_size ** 2


@dataclasses.dataclass(frozen=True)
class QwenVLConfig:
    """A Qwen2.5-VL checkpoint (Qwen2_5_VLForConditionalGeneration): the Qwen2 text decoder's `ModelConfig`, the
    `QwenVisionConfig`, the multimodal RoPE split `mrope_section` (frequencies per (t, h, w) axis, summing to
    head_dim / 2) and the special token ids (image features go where input_ids hold `image_token_id`)."""

    text: ModelConfig
    vision: QwenVisionConfig
    mrope_section: tuple[int, int, int] = (16, 24, 24)
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    model_type: str = "qwen2_5_vl"
    mrope_interleaved: bool = False  # Qwen3-VL: True (rope.mrope_axes)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json", *, text) -> "QwenVLConfig":
        """`text`: the text family (families.QWEN2) text_config is parsed by."""
        return _parse_qwen_vl(raw, source, text)


QWEN_VL_MODEL_TYPES = ("qwen2_5_vl",)
QWEN3_VL_MODEL_TYPES = ("qwen3_vl",)  # Qwen3VLConfig (below)
QWEN3_5_MODEL_TYPES = ("qwen3_5",)  # Qwen3_5Config (below): Qwen3.5 as released, with its vision tower
_QWEN_VL_TOP_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                     "vision_config", "model_type", "architectures", "text_config", "tie_word_embeddings")


def _mrope_text(raw: dict, text_raw: dict, source: str, *, family: str, text_family,
                default_section: tuple, default_theta: float) -> tuple[ModelConfig, tuple, dict]:
    """The text decoder of a Qwen vision-language config: text_raw (its text fields) parsed by `text_family` (a
    families.TextFamily, as its first model type) with the dtype from the top level where transformers 5 writes
    it, and its M-RoPE checked -> (the text ModelConfig, mrope_section, the rope parameters as read)."""
    if not (text_raw.get("torch_dtype") or text_raw.get("dtype")):  # transformers 5 writes it at the top level
        text_raw["torch_dtype"] = raw.get("torch_dtype") or raw.get("dtype")
    params = dict(text_raw.get("rope_parameters") or text_raw.get("rope_scaling") or {})
    section = params.get("mrope_section", default_section)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"{source}: {family} rope type {rope_type!r} is not supported (only default / mrope)")
    theta = params.get("rope_theta", text_raw.get("rope_theta", default_theta))
    text_raw = {k: v for k, v in text_raw.items() if k not in ("rope_parameters", "rope_scaling")}
    text_raw.update(model_type=text_family.model_types[0], rope_theta=theta)
    if "partial_rotary_factor" in params:  # Qwen3.5: RoPE (and so M-RoPE) on part of each head
        text_raw.setdefault("partial_rotary_factor", params["partial_rotary_factor"])
    text = parse_text_config(text_raw, source + " text_config", text_family)
    if len(section) != 3 or 2 * sum(int(s) for s in section) != text.rope_dim:
        raise ConfigError(f"{source}: mrope_section {list(section)} must have 3 entries summing to the rotary dims "
                          f"/ 2 = {text.rope_dim // 2}")
    return text, section, params


def _parse_qwen_vl(raw: dict, source: str, text_family) -> QwenVLConfig:
    """transformers 5's layout (text_config + vision_config) or transformers 4's flat one (the text fields at the
    top level, rope_scaling {"type": "mrope", "mrope_section": ...})."""
    if raw.get("model_type") not in QWEN_VL_MODEL_TYPES:
        raise UnsupportedArchitectureError(f"{source}: model_type {raw.get('model_type')!r} is not Qwen2.5-VL "
                                           f"({', '.join(QWEN_VL_MODEL_TYPES)})")
    if raw.get("text_config"):
        text_raw = dict(raw["text_config"])
    else:  # transformers 4: the text fields sit beside vision_config
        text_raw = {k: v for k, v in raw.items() if k not in _QWEN_VL_TOP_KEYS}
    if text_raw.get("model_type", "qwen2_5_vl_text") not in ("qwen2_5_vl_text", "qwen2_5_vl"):
        raise ConfigError(f"{source}: text_config.model_type is {text_raw['model_type']!r}, expected "
                          "'qwen2_5_vl_text'")
    if "tie_word_embeddings" in raw:
        text_raw["tie_word_embeddings"] = raw["tie_word_embeddings"]
    text_raw.setdefault("tie_word_embeddings", False)
    text, section, _ = _mrope_text(raw, text_raw, source, family="Qwen2.5-VL", text_family=text_family,
                                   default_section=(16, 24, 24), default_theta=1000000.0)
    v = dict(raw.get("vision_config") or {})
    if v.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: vision_config.hidden_act {v.get('hidden_act')!r} is not supported (only silu)")
    vrope = v.get("rope_parameters") or {}
    d = QwenVisionConfig()
    kw = {f.name: v.get(f.name, getattr(d, f.name)) for f in dataclasses.fields(QwenVisionConfig)
          if f.name not in ("fullatt_block_indexes", "rope_theta", "rms_norm_eps")}
    if "in_chans" in v and "in_channels" not in v:
        kw["in_channels"] = v["in_chans"]
    vision = QwenVisionConfig(**{k: int(x) for k, x in kw.items()},
                              fullatt_block_indexes=tuple(int(i) for i in v.get("fullatt_block_indexes",
                                                                                 d.fullatt_block_indexes)),
                              rope_theta=float(vrope.get("rope_theta", d.rope_theta)))
    if vision.hidden_size % vision.num_heads or vision.head_dim % 4:
        raise ConfigError(f"{source}: vision_config.hidden_size={vision.hidden_size} must be num_heads="
                          f"{vision.num_heads} times a multiple of 4")
    bad = [i for i in vision.fullatt_block_indexes if not 0 <= i < vision.depth]
    if bad:
        raise ConfigError(f"{source}: vision_config.fullatt_block_indexes {bad} out of range (depth {vision.depth})")
    if vision.window_size % (vision.spatial_merge_size * vision.patch_size):
        raise ConfigError(f"{source}: vision_config.window_size={vision.window_size} must be a multiple of "
                          f"spatial_merge_size * patch_size = {vision.spatial_merge_size * vision.patch_size}")
    if vision.out_hidden_size != text.hidden_size:
        raise ConfigError(f"{source}: vision_config.out_hidden_size={vision.out_hidden_size} differs from the text "
                          f"hidden_size={text.hidden_size}")
    ids = {k: int(raw.get(k, text_raw.get(k, getattr(QwenVLConfig, k)))) for k in
           ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    return QwenVLConfig(text=text, vision=vision, mrope_section=tuple(int(s) for s in section), **ids)


# ---- Qwen3-VL (model_type "qwen3_vl"): models.vision_qwen3 ----

@dataclasses.dataclass(frozen=True)
class Qwen3VisionConfig:
    """Qwen3-VL's vision tower (HF `vision_config`, model_type qwen3_vl_vision). Defaults are transformers'
    Qwen3VLVisionConfig's. No windows: every block attends within one frame. `num_position_embeddings`: the
    learned square position table (resampled bilinearly to each image's grid); `deepstack_visual_indexes`: the
    blocks whose outputs, merged by their own mergers, are added to the first decoder layers' outputs."""

    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    out_hidden_size: int = 3584
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-6  # transformers hard-codes it for the vision LayerNorms

    head_dim = QwenVisionConfig.head_dim
    patch_dim = QwenVisionConfig.patch_dim
    num_hidden_layers = QwenVisionConfig.num_hidden_layers
    merge_unit = QwenVisionConfig.merge_unit

    @property
    def grid_side(self) -> int:
        """Side of the learned position grid: sqrt(num_position_embeddings)."""
        return math.isqrt(self.num_position_embeddings)


@dataclasses.dataclass(frozen=True)
class Qwen3VLConfig(QwenVLConfig):
    """A Qwen3-VL checkpoint (Qwen3VLForConditionalGeneration): as QwenVLConfig, with the Qwen3 text decoder
    (q/k norms), a `Qwen3VisionConfig` and M-RoPE whose (t, h, w) frequencies interleave (t h w t h w ...)."""

    vision: Qwen3VisionConfig = None
    mrope_section: tuple[int, int, int] = (24, 20, 20)
    model_type: str = "qwen3_vl"
    mrope_interleaved: bool = True
    # how _parse_qwen3_vl reads this class's checkpoints (Qwen3_5Config sets its own): the family's name for
    # messages, text_config's model_type and the text family it is parsed as, the default rope_theta, and whether
    # the tower has DeepStack
    FAMILY: ClassVar[str] = "Qwen3-VL"
    TEXT_TYPE: ClassVar[str] = "qwen3_vl_text"  # text_config's model_type (parsed by the text family given)
    DEFAULT_THETA: ClassVar[float] = 5000000.0
    DEEPSTACK: ClassVar[bool] = True

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json", *, text) -> "Qwen3VLConfig":
        """`text`: the text family (families.QWEN3; Qwen3.5: QWEN3_5_TEXT) text_config is parsed by."""
        return _parse_qwen3_vl(cls, raw, source, text)


def _parse_qwen3_vl(cls: type, raw: dict, source: str, text_family) -> Qwen3VLConfig:
    """transformers' layout of a Qwen3-VL-style checkpoint (`cls`: Qwen3VLConfig or Qwen3_5Config): text_config
    (rope_parameters with mrope_section; Qwen3.5: partial_rotary_factor) + vision_config + the token ids at the top
    level (defaults: cls's)."""
    if raw.get("model_type") != cls.model_type:
        raise UnsupportedArchitectureError(f"{source}: model_type {raw.get('model_type')!r} is not {cls.FAMILY} "
                                           f"({cls.model_type})")
    text_raw = raw.get("text_config") or {}
    if not isinstance(text_raw, dict):
        raise ConfigError(f"{source}: text_config must be an object, got {type(text_raw).__name__}")
    text_raw = dict(text_raw)
    text_type = cls.TEXT_TYPE
    if text_raw.get("model_type", text_type) != text_type:
        raise ConfigError(f"{source}: text_config.model_type is {text_raw['model_type']!r}, expected '{text_type}'")
    text_raw["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", text_raw.get("tie_word_embeddings", False)))
    text, section, params = _mrope_text(raw, text_raw, source, family=cls.FAMILY, text_family=text_family,
                                        default_section=cls.mrope_section, default_theta=cls.DEFAULT_THETA)
    if params.get("mrope_interleaved") is False:
        raise ConfigError(f"{source}: text_config.rope_parameters.mrope_interleaved=false is not {cls.FAMILY}'s "
                          "M-RoPE")
    vision = _qwen3_vision(raw, source, text, deepstack=cls.DEEPSTACK)
    ids = {k: int(raw.get(k, getattr(cls, k))) for k in
           ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    return cls(text=text, vision=vision, mrope_section=tuple(int(s) for s in section), **ids)


def _qwen3_vision(raw: dict, source: str, text: ModelConfig, *, deepstack: bool) -> Qwen3VisionConfig:
    """config.json's vision_config of a Qwen3-VL-style tower, checked against the text decoder `text`.
    deepstack=False (Qwen3.5, whose Qwen3_5VisionModel deletes DeepStack): deepstack_visual_indexes is ignored,
    as transformers ignores it, and the tower has no DeepStack mergers."""
    v = dict(raw.get("vision_config") or {})
    if v.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ConfigError(f"{source}: vision_config.hidden_act {v.get('hidden_act')!r} is not supported (only "
                          "gelu_pytorch_tanh)")
    vrope = v.get("rope_parameters") or {}
    d = Qwen3VisionConfig()
    kw = {f.name: int(v.get(f.name, getattr(d, f.name))) for f in dataclasses.fields(Qwen3VisionConfig)
          if f.name not in ("deepstack_visual_indexes", "rope_theta", "layer_norm_eps")}
    indexes = v.get("deepstack_visual_indexes", d.deepstack_visual_indexes) if deepstack else ()
    vision = Qwen3VisionConfig(**kw, deepstack_visual_indexes=tuple(int(i) for i in indexes),
                               rope_theta=float(vrope.get("rope_theta", d.rope_theta)))
    if vision.hidden_size % vision.num_heads or vision.head_dim % 4:
        raise ConfigError(f"{source}: vision_config.hidden_size={vision.hidden_size} must be num_heads="
                          f"{vision.num_heads} times a multiple of 4")
    if vision.grid_side ** 2 != vision.num_position_embeddings:
        raise ConfigError(f"{source}: vision_config.num_position_embeddings={vision.num_position_embeddings} is not "
                          "a square")
    bad = [i for i in vision.deepstack_visual_indexes if not 0 <= i < vision.depth]
    if bad:
        raise ConfigError(f"{source}: vision_config.deepstack_visual_indexes {bad} out of range (depth "
                          f"{vision.depth})")
    if len(vision.deepstack_visual_indexes) > text.num_hidden_layers:
        raise ConfigError(f"{source}: {len(vision.deepstack_visual_indexes)} deepstack_visual_indexes but only "
                          f"{text.num_hidden_layers} text layers")
    if vision.out_hidden_size != text.hidden_size:
        raise ConfigError(f"{source}: vision_config.out_hidden_size={vision.out_hidden_size} differs from the text "
                          f"hidden_size={text.hidden_size}")
    return vision


# ---- Qwen3.5 (model_type "qwen3_5"): Qwen3-VL's tower without DeepStack on the Qwen3.5 text decoder ----

@dataclasses.dataclass(frozen=True)
class Qwen3_5Config(Qwen3VLConfig):
    """A Qwen3.5 checkpoint as released (Qwen3_5ForConditionalGeneration): the qwen3_5_text decoder (gated
    DeltaNet and gated attention layers, families/qwen3_5_text.py) rotating its partial RoPE dims by interleaved
    M-RoPE, and Qwen3-VL's vision tower without DeepStack (vision.deepstack_visual_indexes is empty). Token ids
    default to transformers' Qwen3_5Config's. Checkpoints may also hold the multi-token-prediction head (mtp.*), which
    transformers never runs."""

    mrope_section: tuple[int, int, int] = (11, 11, 10)
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    model_type: str = "qwen3_5"
    FAMILY: ClassVar[str] = "Qwen3.5"
    TEXT_TYPE: ClassVar[str] = "qwen3_5_text"
    DEFAULT_THETA: ClassVar[float] = 10000.0
    DEEPSTACK: ClassVar[bool] = False  # Qwen3_5VisionModel deletes DeepStack


# ------------------------------------------------------------------------------ which layers hold what
# The stacked submodules that stand for one HF module of a layer, each held by the layers of one kind (Gemma 4):
# self_attn by the layers with their own keys/values at the model's attention shape (every attending layer
# elsewhere), global_attn by the full-attention layers with their own shape (cfg.global_head_dim), shared_attn /
# shared_global_attn by the KV-shared layers of either shape (no k_proj, v_proj, k_norm); wide_mlp by the
# KV-shared layers of a double-wide MLP (cfg.double_wide_mlp), mlp by the others.
KIND_MODULES = {"self_attn": ("self_attn", "global_attn", "shared_attn", "shared_global_attn"),
                "mlp": ("mlp", "wide_mlp")}
HF_MODULE = {sub: hf for hf, subs in KIND_MODULES.items() for sub in subs}  # our submodule -> its HF module
KV_SHARED_SKIPS = ("self_attn.k_proj.", "self_attn.v_proj.", "self_attn.k_norm.")  # HF suffix prefixes


def layer_module(cfg: ModelConfig, hf_module: str, layer: int) -> str:
    """Our stacked submodule holding HF module `hf_module` ("self_attn", "mlp", "linear_attn", ...) of decoder layer
    `layer` (KIND_MODULES): "global_attn" for Gemma 4's full-attention layers of their own shape, "shared_attn" /
    "shared_global_attn" for its KV-shared layers, "wide_mlp" for their double-wide MLP; else `hf_module`."""
    if hf_module == "self_attn":
        full = bool(cfg.global_head_dim) and (cfg.layer_windows or (None,) * cfg.num_hidden_layers)[layer] is None
        if cfg.kv_source(layer) != layer:
            return "shared_global_attn" if full else "shared_attn"
        return "global_attn" if full else "self_attn"
    if hf_module == "mlp" and cfg.double_wide_mlp and cfg.kv_source(layer) != layer:
        return "wide_mlp"
    return hf_module


def attention_dims(cfg: ModelConfig, sub: str) -> tuple[int, int]:
    """(head dim, key/value heads) of the attention submodule `sub` (KIND_MODULES["self_attn"])."""
    if sub in ("global_attn", "shared_global_attn"):
        return cfg.global_head_dim, cfg.global_kv_heads
    return cfg.head_dim, cfg.num_key_value_heads


def layer_has(cfg: ModelConfig, layer: int, suffix: str) -> bool:
    """Whether decoder layer `layer` holds the per-layer tensor (or PEFT module) `suffix`, in HF's names (e.g.
    "self_attn.k_proj.weight", "linear_attn.in_proj_qkv."; our module path under a layer is the same with the
    first name replaced by layer_module's): a Qwen3.5 layer has the tensors of its own token mixer only
    (self_attn on its full-attention layers, linear_attn on its linear-attention layers); a Gemma 4 KV-shared
    layer has no key/value projections or key norm, and with attention_k_eq_v a full-attention layer has no
    v_proj; every layer has every other tensor. (The stacked state: stack_holders.)"""
    parent = suffix.split(".", 1)[0]
    if parent in MIXERS and cfg.layer_linear:
        return cfg.layer_linear[layer] == (parent == "linear_attn")
    if parent == "linear_attn":
        return False
    if (cfg.attention_k_eq_v and suffix.startswith("self_attn.v_proj.")
            and layer_module(cfg, "self_attn", layer) == "global_attn"):
        return False
    return cfg.kv_source(layer) == layer or not suffix.startswith(KV_SHARED_SKIPS)


def stack_holders(cfg: ModelConfig, sub: str) -> tuple[int, ...]:
    """The decoder layers whose rows the stacked submodule `sub` (an attribute of the stacked DecoderLayer, e.g.
    "self_attn", "mlp", "global_attn"; or a dotted path under it, whose first name is used) holds, in order: row r
    of each of its variables is layer stack_holders(cfg, sub)[r]."""
    return _holders(cfg, sub.split(".", 1)[0])


# The stacked submodules that only some layers hold (by the layer's kind: Qwen3.5's token mixers, Gemma 4's
# KIND_MODULES); every other submodule (norms, Gemma 4's per-layer blocks) is held by every layer.
MIXERS = ("self_attn", "linear_attn")


@functools.lru_cache(maxsize=None)
def _holders(cfg: ModelConfig, sub: str) -> tuple[int, ...]:
    # read from the layer's kind (window, KV source, token mixer), so holding repeats with the kinds inside every
    # segment of cfg.layer_segments, which the layer scan slices by
    layers = range(cfg.num_hidden_layers)
    if sub in HF_MODULE:
        hf = HF_MODULE[sub]
        return tuple(i for i in layers if layer_module(cfg, hf, i) == sub
                     and not (cfg.layer_linear and cfg.layer_linear[i] and hf == "self_attn"))
    if sub == "linear_attn":
        return tuple(i for i in layers if cfg.layer_linear and cfg.layer_linear[i])
    return tuple(layers)


def layer_slot(cfg: ModelConfig, sub: str, layer: int) -> int:
    """The row of decoder layer `layer` in the stacked submodule `sub` (stack_holders); ValueError if that layer
    does not hold it."""
    try:
        return stack_holders(cfg, sub).index(layer)
    except ValueError:
        raise ValueError(f"{cfg.model_type}: decoder layer {layer} has no {sub}") from None
