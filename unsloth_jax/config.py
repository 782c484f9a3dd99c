"""ModelConfig: the fields of a Hugging Face config.json that the decoder needs, with per-family switches.

One frozen dataclass for every supported family (Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, Qwen3, Gemma, Gemma 2,
Gemma 3 text, Gemma 4 text, Phi-3, SmolLM3, Qwen3.5 text; the mixture-of-experts families Qwen3-MoE, Mixtral,
gpt-oss and GLM-4.5 MoE).
Reads both spellings of RoPE settings: transformers 4's `rope_theta` + `rope_scaling`, and transformers 5's
`rope_parameters`.
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

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3")
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "gpt_oss", "glm4_moe")  # mixture-of-experts families (see _moe_fields)
SUPPORTED_MODEL_TYPES += ("smollm3",)  # SmolLM3: Llama's layer with NoPE layers (_smollm3_fields, layer_rope)
SUPPORTED_MODEL_TYPES += ("qwen3_5_text",)  # Qwen3.5: gated DeltaNet + gated attention layers (_qwen3_5_fields)
SUPPORTED_MODEL_TYPES += ("gemma4_text",)  # Gemma 4 text: PLE, KV-shared layers (_gemma4_fields)


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
    # ---- Gemma 4 text (gemma4_text): see _gemma4_fields ----
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

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        return _parse(raw, source)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> "ModelConfig":
        raw, path = read_config_json(model_dir)
        return _parse(raw, str(path))


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
    if rope_type == "yarn":
        return out | _yarn(raw, params, source)
    if rope_type not in ("linear", "llama3"):
        raise ConfigError(f"{source}: rope type '{rope_type}' is not supported (supported: default, linear, llama3, "
                          "yarn)")
    out["rope_factor"] = float(_need(params, "factor", source + " rope_scaling"))
    if rope_type == "llama3":
        out["rope_low_freq_factor"] = float(params.get("low_freq_factor", 1.0))
        out["rope_high_freq_factor"] = float(params.get("high_freq_factor", 4.0))
        out["rope_original_max_position"] = int(params.get("original_max_position_embeddings", 8192))
    return out


def _layer_windows(raw: dict, model_type: str, n_layers: int, source: str) -> tuple[int | None, ...]:
    if model_type in ("smollm3", "gemma4_text"):  # their family fields read their windows
        return (None,) * n_layers
    if model_type == "qwen3_5_text":  # layer_types names token mixers (_qwen3_5_fields); no sliding windows
        return (None,) * n_layers
    window = raw.get("sliding_window")
    types = raw.get("layer_types")
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
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
    if model_type in _RAW_DEFAULTS:
        raw = _RAW_DEFAULTS[model_type] | raw
    if model_type in VISION_LANGUAGE_MODEL_TYPES + QWEN_VL_MODEL_TYPES + QWEN3_VL_MODEL_TYPES + QWEN3_5_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"{source}: model_type {model_type!r} is a vision-language model; load it with "
            "FastVisionModel.from_pretrained (unsloth_jax.config.VisionLanguageConfig / QwenVLConfig)")
    if model_type in GEMMA4_MULTIMODAL_TYPES:
        raise UnsupportedArchitectureError(
            f"{source}: model_type {model_type!r} (Gemma4ForConditionalGeneration, text with vision/audio towers) is "
            "not supported; the Gemma 4 text model is: a checkpoint of model_type 'gemma4_text' (Gemma4ForCausalLM)")
    if model_type not in SUPPORTED_MODEL_TYPES + MOE_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"{source}: model_type {model_type!r} is not supported; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES + MOE_MODEL_TYPES)}"
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
        intermediate_size=int(raw.get("intermediate_size") or 0) if model_type in MOE_MODEL_TYPES else
        int(_need(raw, "intermediate_size", source)),
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
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
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
    if model_type in MOE_MODEL_TYPES:
        fields.update(_moe_fields(raw, model_type, n_layers, source))
    if not math.isfinite(fields["rope_theta"]) or fields["rope_theta"] <= 0:
        raise ConfigError(f"{source}: rope_theta must be positive")
    return ModelConfig(**fields)


# ------------------------------------------------------------------------------------- YaRN RoPE (gpt-oss)
def _yarn(raw: dict, params: dict, source: str) -> dict:
    """YaRN settings as transformers' _compute_yarn_parameters reads them (factor, beta_fast/slow, truncate,
    original_max_position_embeddings, and the cos/sin attention factor: given, or from mscale/mscale_all_dim,
    or 0.1 * ln(factor) + 1)."""
    where = source + " rope_parameters"
    original = int(_need(params, "original_max_position_embeddings", where))
    factor = params.get("factor")
    factor = float(factor) if factor is not None else int(_need(raw, "max_position_embeddings", source)) / original

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


# ------------------------------------------------------------------------------- mixture-of-experts families
def _moe_layer_sparse(raw: dict, model_type: str, n_layers: int, source: str) -> tuple[bool, ...]:
    """Which layers route to experts: every layer for Mixtral and gpt-oss; for Qwen3-MoE the layers not in
    mlp_only_layers whose (index + 1) is a multiple of decoder_sparse_step (transformers' rule)."""
    if model_type == "glm4_moe":
        return _glm4_moe_sparse(raw, n_layers, source)
    if model_type != "qwen3_moe":
        return (True,) * n_layers
    dense = set(raw.get("mlp_only_layers") or [])
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    bad = [i for i in dense if not isinstance(i, int) or not 0 <= i < n_layers]
    if bad:
        raise ConfigError(f"{source}: mlp_only_layers {bad} are not layer indices below num_hidden_layers={n_layers}")
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(n_layers))


def _moe_fields(raw: dict, model_type: str, n_layers: int, source: str) -> dict:
    """The ModelConfig fields of a MoE family, from its config.json (Qwen3MoeConfig, MixtralConfig, GptOssConfig)."""
    experts = raw.get("num_experts", raw.get("num_local_experts", raw.get("n_routed_experts")))
    if not experts or int(experts) <= 0:
        raise ConfigError(f"{source}: num_experts / num_local_experts / n_routed_experts is missing or not positive")
    experts = int(experts)
    top_k = int(_need(raw, "num_experts_per_tok", source))
    if not 0 < top_k <= experts:
        raise ConfigError(f"{source}: num_experts_per_tok={top_k} must be between 1 and the {experts} experts")
    sparse = _moe_layer_sparse(raw, model_type, n_layers, source)
    if model_type in ("qwen3_moe", "glm4_moe"):
        expert_size = int(_need(raw, "moe_intermediate_size", source))
        if not all(sparse):
            _need(raw, "intermediate_size", source)  # the dense MLP layers use it
    else:
        expert_size = int(_need(raw, "intermediate_size", source))
    gpt_oss = model_type == "gpt_oss"
    if not gpt_oss and _activation(raw, model_type, source) != "silu":
        raise ConfigError(f"{source}: hidden_act {raw.get('hidden_act')!r} is not supported for {model_type} experts "
                          "(only silu)")
    if model_type == "mixtral" and float(raw.get("router_jitter_noise") or 0.0) > 0:
        raise ConfigError(f"{source}: router_jitter_noise > 0 (random router noise in training) is not supported")
    out = dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=expert_size,
        layer_sparse=sparse,
        router="topk_softmax" if gpt_oss else "softmax_topk",
        norm_topk_prob=True if model_type == "mixtral" else bool(raw.get("norm_topk_prob", False)),
        router_bias=gpt_oss,
        router_name="router" if gpt_oss else "gate",
        expert_bias=gpt_oss,
        expert_activation="swiglu_clamp" if gpt_oss else "silu",
        gate_up_interleaved=gpt_oss,
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        output_router_logits=bool(raw.get("output_router_logits", False)),
        router_aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.001)),
        attn_sinks=gpt_oss,
    )
    if model_type == "glm4_moe":
        out.update(_glm4_moe_router_fields(raw, experts, top_k, source))
    return out


# ---- GLM-4.5 MoE (glm4_moe, Glm4MoeForCausalLM) ----
def _glm4_moe_sparse(raw: dict, n_layers: int, source: str) -> tuple[bool, ...]:
    """GLM-4.5: the first `first_k_dense_replace` layers are dense (default 1), the others MoE."""
    first = raw.get("first_k_dense_replace", 1)
    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
        raise ConfigError(f"{source}: first_k_dense_replace={first!r} must be a non-negative integer")
    if first >= n_layers:
        raise ConfigError(f"{source}: first_k_dense_replace={first} leaves no MoE layer of the {n_layers} "
                          "(num_hidden_layers); a model without experts is not supported as glm4_moe")
    return tuple(i >= first for i in range(n_layers))


def _glm4_moe_router_fields(raw: dict, experts: int, top_k: int, source: str) -> dict:
    """GLM-4.5's router (transformers' Glm4MoeTopkRouter): sigmoid scores; for the choice the scores plus
    e_score_correction_bias, the experts in n_group groups, a group scored by the sum of its 2 best, the
    topk_group best groups kept, top-k among their experts; weights are the chosen experts' sigmoid scores,
    renormalised when norm_topk_prob (default true), times routed_scaling_factor. Shared experts: one MLP of
    moe_intermediate_size * n_shared_experts beside the routed ones."""
    n_group, topk_group = int(raw.get("n_group") or 1), int(raw.get("topk_group") or 1)
    if n_group <= 0 or experts % n_group:
        raise ConfigError(f"{source}: n_group={n_group} must be positive and divide the {experts} experts "
                          "(n_routed_experts)")
    if n_group > 1 and experts // n_group < 2:
        raise ConfigError(f"{source}: n_group={n_group} leaves {experts // n_group} expert per group; a group is "
                          "scored by its 2 best experts, so each needs at least 2")
    if not 0 < topk_group <= n_group:
        raise ConfigError(f"{source}: topk_group={topk_group} must be between 1 and n_group={n_group}")
    if top_k > topk_group * (experts // n_group):
        raise ConfigError(f"{source}: num_experts_per_tok={top_k} exceeds the {topk_group * (experts // n_group)} "
                          f"experts of the topk_group={topk_group} groups a token may use")
    shared = int(raw.get("n_shared_experts", 1) or 0)
    if shared < 0:
        raise ConfigError(f"{source}: n_shared_experts={shared} must be non-negative")
    mtp = raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers", 0))
    return dict(router="sigmoid_group", n_group=n_group, topk_group=topk_group,
                routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
                norm_topk_prob=bool(raw.get("norm_topk_prob", True)), router_score_bias=True,
                shared_expert_size=shared * int(_need(raw, "moe_intermediate_size", source)), router_fp32=True,
                num_mtp_layers=int(mtp or 0),
                output_router_logits=False)  # transformers computes no load-balancing loss for GLM


def _glm4_moe_fields(raw: dict, source: str) -> dict:
    """GLM-4.5's attention and RoPE: q/k/v biases by attention_bias (o_proj never has one), q/k RMSNorm by
    use_qk_norm, RoPE on the first partial_rotary_factor (default 0.5) of each head's dims (rope_parameters or
    the top level), default / linear / llama3 scaling."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    partial = params.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 0.5))
    head_dim = int(raw.get("head_dim") or int(_need(raw, "hidden_size", source)) // int(
        _need(raw, "num_attention_heads", source)))
    rotary = int(head_dim * float(0.5 if partial is None else partial))
    if rotary <= 0 or rotary > head_dim or rotary % 2:
        raise ConfigError(f"{source}: partial_rotary_factor={partial} gives {rotary} rotary dims of a {head_dim}-dim "
                          "head; it must be even and between 2 and head_dim")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise ConfigError(f"{source}: rope_parameters.rope_type {rope_type!r} is not supported for glm4_moe "
                          "(supported: default, linear, llama3)")
    out = _rope({"rope_parameters": params}, source)
    bias = bool(raw.get("attention_bias", False))
    out.update(rotary_dim=0 if rotary == head_dim else rotary, qkv_bias=bias, o_bias=False,
               qk_norm=bool(raw.get("use_qk_norm", False)))
    return out
# ---- end GLM-4.5 MoE ----


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
_FAMILY_FIELDS["glm4_moe"] = _glm4_moe_fields  # GLM-4.5 MoE


# ------------------------------------------------------------------------------------------------ SmolLM3
def _smollm3_fields(raw: dict, source: str) -> dict:
    """SmolLM3 (SmolLM3ForCausalLM): Llama's layer, but the layers whose `no_rope_layers` entry is 0 apply no
    RoPE at all (NoPE); without the list, every `no_rope_layer_interval`-th layer (default 4: layers 3, 7, ...)
    is NoPE, as SmolLM3Config does. Sliding windows as transformers' SmolLM3Attention: a layer attends within
    `sliding_window` only when `use_sliding_window` is true and its `layer_types` entry is "sliding_attention";
    without `layer_types`, the NoPE layers slide (when use_sliding_window and sliding_window are set). Embeddings
    are tied unless tie_word_embeddings is false (SmolLM3Config's default is true)."""
    n = int(_need(raw, "num_hidden_layers", source))
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
    out = _rope(raw, source)
    out.update(layer_rope=rope if not all(rope) else (), layer_windows=windows,
               tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)))
    return out


_FAMILY_FIELDS["smollm3"] = _smollm3_fields


# ------------------------------------------------------------------------------------------------ Qwen3.5
# config.json fields a model_type's transformers config class defaults when they are absent (read before parsing)
_RAW_DEFAULTS: dict[str, dict] = {
    "qwen3_5_text": dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                         num_attention_heads=16, num_key_value_heads=4, head_dim=256, max_position_embeddings=32768,
                         tie_word_embeddings=False),
}
_QWEN3_5_LINEAR = dict(linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                       linear_num_key_heads=16, linear_num_value_heads=32)


def _positive_int(raw: dict, key: str, default: int, source: str) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def _qwen3_5_fields(raw: dict, source: str) -> dict:
    """Qwen3.5 text (Qwen3_5ForCausalLM, Qwen3_5TextConfig): `layer_types` (default: every
    `full_attention_interval`-th layer, 4, "full_attention", the others "linear_attention") picks each layer's
    token mixer: gated DeltaNet linear attention (linear_* sizes, a depthwise causal conv1d of
    linear_conv_kernel_dim) or self-attention with q/k norms and an output gate (q_proj is twice as wide: each
    head's query then its gate). Every RMSNorm but the linear attention's gated one is (1 + w); RoPE on the
    first partial_rotary_factor (default 0.25) of each head's dims (the M-RoPE sections of the vision-language
    model reduce to plain RoPE for text positions)."""
    n = int(_need(raw, "num_hidden_layers", source))
    types = raw.get("layer_types")
    if types is None:
        interval = _positive_int(raw, "full_attention_interval", 4, source)
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
    if _activation(raw, "qwen3_5_text", source) != "silu":
        raise ConfigError(f"{source}: hidden_act {raw.get('hidden_act')!r} is not supported for qwen3_5_text (only "
                          "silu: the linear attention's conv1d and gate use it too)")
    sizes = {k: _positive_int(raw, k, d, source) for k, d in _QWEN3_5_LINEAR.items()}
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
    out = _rope({"rope_parameters": params}, source)
    out.update(layer_linear=tuple(t == "linear_attention" for t in types), attn_output_gate=True, qk_norm=True,
               norm_offset=1.0, rotary_dim=0 if rotary == head_dim else rotary,
               linear_num_key_heads=sizes["linear_num_key_heads"],
               linear_num_value_heads=sizes["linear_num_value_heads"],
               linear_key_head_dim=sizes["linear_key_head_dim"], linear_value_head_dim=sizes["linear_value_head_dim"],
               linear_conv_kernel=sizes["linear_conv_kernel_dim"])
    return out


_FAMILY_FIELDS["qwen3_5_text"] = _qwen3_5_fields


# --------------------------------------------------------------------------------------- Gemma 4 text
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
    if any(str(i) not in {str(k) for k in per_layer} for i in full):
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
    n = int(_need(raw, "num_hidden_layers", source))
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
        out["rope_local_theta"] = float(_need(local, "rope_theta", source + " rope_parameters.sliding_attention"))
    full = params.get("full_attention")
    full_type = full.get("rope_type", "default")
    if full_type == "proportional":
        prop = float(full.get("partial_rotary_factor", 1.0))
        if not 0.0 <= prop <= 1.0:
            raise ConfigError(f"{source}: rope_parameters.full_attention.partial_rotary_factor must be in [0, 1], "
                              f"got {prop}")
        out.update(rope_theta=float(_need(full, "rope_theta", source + " rope_parameters.full_attention")),
                   rope_type="proportional", rope_proportion=prop, rope_factor=float(full.get("factor", 1.0)))
    elif full_type == "default":
        out["rope_theta"] = float(_need(full, "rope_theta", source + " rope_parameters.full_attention"))
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
               activation=_activation(dict(raw, model_type="gemma"), "gemma", source),
               qk_norm=True, v_norm=True, norm_offset=0.0, embed_scale=True, sandwich_norms=True, attn_softcap=None,
               query_scale=1.0, layer_scalar=True, tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)))
    return out


_FAMILY_FIELDS["gemma4_text"] = _gemma4_fields
GEMMA4_MULTIMODAL_TYPES = ("gemma4",)  # Gemma4ForConditionalGeneration: refused (only its text model type loads)


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
    def from_dict(cls, raw: dict, source: str = "config.json") -> "VisionLanguageConfig":
        return _parse_vision_language(raw, source)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> "VisionLanguageConfig":
        raw, path = read_config_json(model_dir)
        return _parse_vision_language(raw, str(path))


VISION_LANGUAGE_MODEL_TYPES = ("gemma3",)


def _parse_vision_language(raw: dict, source: str) -> VisionLanguageConfig:
    if raw.get("model_type") not in VISION_LANGUAGE_MODEL_TYPES:
        raise UnsupportedArchitectureError(f"{source}: model_type {raw.get('model_type')!r} is not a supported "
                                           f"vision-language model ({', '.join(VISION_LANGUAGE_MODEL_TYPES)})")
    text_raw = dict(_need(raw, "text_config", source))
    text_raw.setdefault("model_type", "gemma3_text")
    if text_raw["model_type"] != "gemma3_text":
        raise ConfigError(f"{source}: text_config.model_type is {text_raw['model_type']!r}, expected 'gemma3_text'")
    if "tie_word_embeddings" in raw:  # the top-level flag is the one Gemma3ForConditionalGeneration ties by
        text_raw["tie_word_embeddings"] = raw["tie_word_embeddings"]
    text = _parse(text_raw, source + " text_config")
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
    def from_dict(cls, raw: dict, source: str = "config.json") -> "QwenVLConfig":
        return _parse_qwen_vl(raw, source)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> "QwenVLConfig":
        raw, path = read_config_json(model_dir)
        return _parse_qwen_vl(raw, str(path))


QWEN_VL_MODEL_TYPES = ("qwen2_5_vl",)
QWEN3_VL_MODEL_TYPES = ("qwen3_vl",)  # Qwen3VLConfig (below)
QWEN3_5_MODEL_TYPES = ("qwen3_5",)  # Qwen3_5Config (below): Qwen3.5 as released, with its vision tower
_QWEN_VL_TOP_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                     "vision_config", "model_type", "architectures", "text_config", "tie_word_embeddings")


def _mrope_text(raw: dict, text_raw: dict, source: str, *, family: str, text_type: str,
                default_section: tuple, default_theta: float) -> tuple[ModelConfig, tuple, dict]:
    """The text decoder of a Qwen vision-language config: text_raw (its text fields) parsed as `text_type` with the
    dtype from the top level where transformers 5 writes it, and its M-RoPE checked -> (the text ModelConfig,
    mrope_section, the rope parameters as read)."""
    if not (text_raw.get("torch_dtype") or text_raw.get("dtype")):  # transformers 5 writes it at the top level
        text_raw["torch_dtype"] = raw.get("torch_dtype") or raw.get("dtype")
    params = dict(text_raw.get("rope_parameters") or text_raw.get("rope_scaling") or {})
    section = params.get("mrope_section", default_section)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"{source}: {family} rope type {rope_type!r} is not supported (only default / mrope)")
    theta = params.get("rope_theta", text_raw.get("rope_theta", default_theta))
    text_raw = {k: v for k, v in text_raw.items() if k not in ("rope_parameters", "rope_scaling")}
    text_raw.update(model_type=text_type, rope_theta=theta)
    if "partial_rotary_factor" in params:  # Qwen3.5: RoPE (and so M-RoPE) on part of each head
        text_raw.setdefault("partial_rotary_factor", params["partial_rotary_factor"])
    text = _parse(text_raw, source + " text_config")
    if len(section) != 3 or 2 * sum(int(s) for s in section) != text.rope_dim:
        raise ConfigError(f"{source}: mrope_section {list(section)} must have 3 entries summing to the rotary dims "
                          f"/ 2 = {text.rope_dim // 2}")
    return text, section, params


def _parse_qwen_vl(raw: dict, source: str) -> QwenVLConfig:
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
    text, section, _ = _mrope_text(raw, text_raw, source, family="Qwen2.5-VL", text_type="qwen2",
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
    TEXT_TYPES: ClassVar[tuple[str, str]] = ("qwen3_vl_text", "qwen3")
    DEFAULT_THETA: ClassVar[float] = 5000000.0
    DEEPSTACK: ClassVar[bool] = True

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "Qwen3VLConfig":
        return _parse_qwen3_vl(cls, raw, source)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> "Qwen3VLConfig":
        raw, path = read_config_json(model_dir)
        return _parse_qwen3_vl(cls, raw, str(path))


def _parse_qwen3_vl(cls: type, raw: dict, source: str) -> Qwen3VLConfig:
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
    text_type, parse_as = cls.TEXT_TYPES
    if text_raw.get("model_type", text_type) != text_type:
        raise ConfigError(f"{source}: text_config.model_type is {text_raw['model_type']!r}, expected '{text_type}'")
    text_raw["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", text_raw.get("tie_word_embeddings", False)))
    text, section, params = _mrope_text(raw, text_raw, source, family=cls.FAMILY, text_type=parse_as,
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
    DeltaNet and gated attention layers, _qwen3_5_fields) rotating its partial RoPE dims by interleaved M-RoPE, and
    Qwen3-VL's vision tower without DeepStack (vision.deepstack_visual_indexes is empty). Token ids default to
    transformers' Qwen3_5Config's. Checkpoints may also hold the multi-token-prediction head (mtp.*), which
    transformers never runs."""

    mrope_section: tuple[int, int, int] = (11, 11, 10)
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    model_type: str = "qwen3_5"
    FAMILY: ClassVar[str] = "Qwen3.5"
    TEXT_TYPES: ClassVar[tuple[str, str]] = ("qwen3_5_text", "qwen3_5_text")
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
