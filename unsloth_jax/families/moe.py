"""The mixture-of-experts families Qwen3-MoE (Qwen3MoeForCausalLM), Mixtral (MixtralForCausalLM) and gpt-oss
(GptOssForCausalLM), and what every MoE family reads alike (`moe_fields`; GLM-4.5 is families.glm4_moe).
Their per-layer tables hold attention and norms; the routers, experts and dense MLP layers are built by
hf/mapping.moe_specs from the family's expert layouts and names (docs/MOE.md)."""
from __future__ import annotations

from collections.abc import Callable

from unsloth_jax.config import activation, layer_windows, need, rope_fields
from unsloth_jax.errors import ConfigError
from unsloth_jax.families.base import TextFamily
from unsloth_jax.families.qwen import qk_norm_fields
from unsloth_jax.families.tensors import ATTN_NORMS, LAYERS, QK_NORM


def every_layer_sparse(raw: dict, n_layers: int, source: str) -> tuple[bool, ...]:
    return (True,) * n_layers


def moe_fields(raw: dict, n_layers: int, source: str, *, sparse: Callable = every_layer_sparse,
               expert_size_key: str = "intermediate_size", silu_only: bool = True) -> dict:
    """The MoE fields every family reads alike (Qwen3MoeConfig, MixtralConfig, GptOssConfig, Glm4MoeConfig):
    the expert count and top-k, layer_sparse from sparse(raw, n_layers, source), each expert's size from
    `expert_size_key`, the load-balancing loss settings; silu_only: refuse another hidden_act. The family's
    own fields (router kind, biases) go on top."""
    experts = raw.get("num_experts", raw.get("num_local_experts", raw.get("n_routed_experts")))
    if not experts or int(experts) <= 0:
        raise ConfigError(f"{source}: num_experts / num_local_experts / n_routed_experts is missing or not positive")
    experts = int(experts)
    top_k = int(need(raw, "num_experts_per_tok", source))
    if not 0 < top_k <= experts:
        raise ConfigError(f"{source}: num_experts_per_tok={top_k} must be between 1 and the {experts} experts")
    layer_sparse = sparse(raw, n_layers, source)
    expert_size = int(need(raw, expert_size_key, source))
    if expert_size_key != "intermediate_size" and not all(layer_sparse):
        need(raw, "intermediate_size", source)  # the dense MLP layers use it
    if silu_only and activation(raw, source) != "silu":
        raise ConfigError(f"{source}: hidden_act {raw.get('hidden_act')!r} is not supported for {raw['model_type']} "
                          "experts (only silu)")
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=expert_size,
        layer_sparse=layer_sparse,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        output_router_logits=bool(raw.get("output_router_logits", False)),
        router_aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.001)),
    )


# ---- Qwen3-MoE
def _qwen3_moe_sparse(raw: dict, n_layers: int, source: str) -> tuple[bool, ...]:
    """The layers not in mlp_only_layers whose (index + 1) is a multiple of decoder_sparse_step (transformers'
    rule)."""
    dense = set(raw.get("mlp_only_layers") or [])
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    bad = [i for i in dense if not isinstance(i, int) or not 0 <= i < n_layers]
    if bad:
        raise ConfigError(f"{source}: mlp_only_layers {bad} are not layer indices below num_hidden_layers={n_layers}")
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(n_layers))


def _qwen3_moe_fields(raw: dict, n_layers: int, source: str) -> dict:
    return moe_fields(raw, n_layers, source, sparse=_qwen3_moe_sparse, expert_size_key="moe_intermediate_size")


def _qwen3_moe_windows(raw: dict, n_layers: int, source: str) -> tuple[int | None, ...]:
    """None unless use_sliding_window; then layer_types, or every layer slides (no max_window_layers)."""
    if not raw.get("use_sliding_window", False):
        return (None,) * n_layers
    return layer_windows(raw, n_layers, source)


# ---- Mixtral
def _mixtral_fields(raw: dict, n_layers: int, source: str) -> dict:
    out = moe_fields(raw, n_layers, source)
    if float(raw.get("router_jitter_noise") or 0.0) > 0:
        raise ConfigError(f"{source}: router_jitter_noise > 0 (random router noise in training) is not supported")
    return out | dict(norm_topk_prob=True)


# ---- gpt-oss
def _gpt_oss_fields(raw: dict, n_layers: int, source: str) -> dict:
    """top-k then softmax, biased router and experts, the clamped SwiGLU with interleaved gate/up columns, and
    attention sinks."""
    return moe_fields(raw, n_layers, source, silu_only=False) | dict(
        router="topk_softmax", router_bias=True, router_name="router", expert_bias=True,
        expert_activation="swiglu_clamp", gate_up_interleaved=True, attn_sinks=True)


def _gpt_oss_sparse_specs(cfg, i: int, add) -> None:
    """A gpt-oss MoE layer's router (+ bias) and fused expert stacks [E, in, out] with their biases."""
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    mlp = LAYERS + ("mlp",)
    gate_up, down = mlp + ("experts", "gate_up_proj"), mlp + ("experts", "down_proj")
    p = f"model.layers.{i}.mlp"
    add(f"{p}.router.weight", mlp + ("router", "kernel"), i, "router", (e, d))
    add(f"{p}.router.bias", mlp + ("router", "bias"), i, "copy", (e,))
    add(f"{p}.experts.gate_up_proj", gate_up + ("kernel",), i, "experts_t", (e, d, 2 * f))
    add(f"{p}.experts.gate_up_proj_bias", gate_up + ("bias",), i, "copy", (e, 2 * f))
    add(f"{p}.experts.down_proj", down + ("kernel",), i, "experts_t", (e, f, d))
    add(f"{p}.experts.down_proj_bias", down + ("bias",), i, "copy", (e, d))


# transformers 5's save_pretrained writes the original (per-expert) format for Qwen3-MoE and Mixtral, fused 3-D
# expert tensors for gpt-oss; with save_original_format=False it writes Qwen3-MoE and Mixtral fused too.
QWEN3_MOE = TextFamily("Qwen3-MoE", ("qwen3_moe",), config_fields=qk_norm_fields, layer_windows=_qwen3_moe_windows,
                       moe_fields=_qwen3_moe_fields, layer_tensors=ATTN_NORMS + QK_NORM,
                       expert_layouts=("per_expert", "fused"),
                       per_expert_names=("mlp", "gate_proj", "up_proj", "down_proj"), peft_remaps_mlp_targets=True)
# Mixtral's Hub checkpoints name the experts block_sparse_moe.experts.{x}.w1 / w3 / w2 (gate, up, down)
MIXTRAL = TextFamily("Mixtral", ("mixtral",), moe_fields=_mixtral_fields, layer_tensors=ATTN_NORMS,
                     expert_layouts=("per_expert", "fused"), per_expert_names=("block_sparse_moe", "w1", "w3", "w2"),
                     peft_remaps_mlp_targets=True)
GPT_OSS = TextFamily("gpt-oss", ("gpt_oss",), config_fields=rope_fields, moe_fields=_gpt_oss_fields,
                     layer_tensors=ATTN_NORMS, expert_layouts=("fused",), sparse_specs=_gpt_oss_sparse_specs)

__all__ = ["GPT_OSS", "MIXTRAL", "QWEN3_MOE", "every_layer_sparse", "moe_fields"]
