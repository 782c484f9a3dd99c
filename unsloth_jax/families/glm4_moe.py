"""GLM-4.5 MoE (config.json model_type "glm4_moe"; transformers' Glm4MoeForCausalLM): dense first layers, then
MoE layers with a sigmoid grouped router (score-correction bias, float32) and shared experts; partial RoPE;
optional q/k norms and q/k/v biases; multi-token-prediction layers past num_hidden_layers, not loaded.
llama.cpp's arch "glm4moe": hf/gguf_families.py."""
from __future__ import annotations

from unsloth_jax.config import ModelConfig, need, rope_fields
from unsloth_jax.errors import ConfigError
from unsloth_jax.families.base import TextFamily
from unsloth_jax.families.moe import moe_fields
from unsloth_jax.families.tensors import ATTN_NORMS, LAYERS


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
                shared_expert_size=shared * int(need(raw, "moe_intermediate_size", source)), router_fp32=True,
                num_mtp_layers=int(mtp or 0),
                output_router_logits=False)  # transformers computes no load-balancing loss for GLM


def _glm4_moe_fields(raw: dict, source: str) -> dict:
    """GLM-4.5's attention and RoPE: q/k/v biases by attention_bias (o_proj never has one), q/k RMSNorm by
    use_qk_norm, RoPE on the first partial_rotary_factor (default 0.5) of each head's dims (rope_parameters or
    the top level), default / linear / llama3 scaling."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    partial = params.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 0.5))
    head_dim = int(raw.get("head_dim") or int(need(raw, "hidden_size", source)) // int(
        need(raw, "num_attention_heads", source)))
    rotary = int(head_dim * float(0.5 if partial is None else partial))
    if rotary <= 0 or rotary > head_dim or rotary % 2:
        raise ConfigError(f"{source}: partial_rotary_factor={partial} gives {rotary} rotary dims of a {head_dim}-dim "
                          "head; it must be even and between 2 and head_dim")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise ConfigError(f"{source}: rope_parameters.rope_type {rope_type!r} is not supported for glm4_moe "
                          "(supported: default, linear, llama3)")
    out = rope_fields({"rope_parameters": params}, source)
    bias = bool(raw.get("attention_bias", False))
    out.update(rotary_dim=0 if rotary == head_dim else rotary, qkv_bias=bias, o_bias=False,
               qk_norm=bool(raw.get("use_qk_norm", False)))
    return out


def _glm4_moe_moe_fields(raw: dict, n_layers: int, source: str) -> dict:
    experts_fields = moe_fields(raw, n_layers, source, sparse=_glm4_moe_sparse, expert_size_key="moe_intermediate_size")
    return experts_fields | _glm4_moe_router_fields(raw, experts_fields["num_experts"],
                                                    experts_fields["num_experts_per_tok"], source)


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


# q/k norms (use_qk_norm) and biases by switch; the MLP tensors from hf/mapping.moe_specs
GLM4_MOE = TextFamily("GLM-4.5 MoE", ("glm4_moe",), config_fields=_glm4_moe_fields, moe_fields=_glm4_moe_moe_fields,
                      layer_tensors=ATTN_NORMS, expert_layouts=("per_expert", "fused"),
                      per_expert_names=("mlp", "gate_proj", "up_proj", "down_proj"),
                      sparse_extra_specs=_glm4_moe_extra_specs, peft_remaps_mlp_targets=True, gguf_arch="GLM4_MOE",
                      gguf_read=("glm4moe", "Glm4MoeForCausalLM"))

__all__ = ["GLM4_MOE"]
