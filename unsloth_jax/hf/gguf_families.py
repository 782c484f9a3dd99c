"""GGUF tensors and hyperparameters of Qwen3.5 text (llama.cpp arch "qwen35") and GLM-4.5 MoE ("glm4moe").

Used by gguf_export.py (which picks the tensor types, writes the file and the tokenizer). Facts from llama.cpp's
converter (conversion/qwen.py Qwen3NextModel, _LinearAttentionVReorderBase, _Qwen35MRopeMixin; conversion/glm.py
Glm4MoeModel; conversion/base.py TextModel) and its loaders (src/models/qwen35.cpp, glm4-moe.cpp):

qwen35 (from the merged HF tensors, float32):
* every RMSNorm weight but the gated DeltaNet's own `linear_attn.norm` is stored as 1 + w;
* linear_attn.A_log -> ssm_a = -exp(A_log) (exp correctly rounded; the converter's torch float32 exp may differ
  by an ulp); dt_bias -> ssm_dt.bias; conv1d [C, 1, K] -> ssm_conv1d [C, K];
  in_proj_qkv -> attn_qkv, in_proj_z -> attn_gate, in_proj_b / in_proj_a -> ssm_beta / ssm_alpha, norm ->
  ssm_norm, out_proj -> ssm_out; the gated attention's q_proj (query and gate per head) stays one attn_q;
* with fewer key heads than value heads, the value heads are reordered from grouped by key head (k0: v0..v{r-1},
  k1: ...) to tiled (v0 of every key head, then v1, ...), in every tensor indexed by value head: the V rows of
  attn_qkv and the V channels of ssm_conv1d, attn_gate rows, ssm_beta / ssm_alpha rows, ssm_a, ssm_dt, and the
  columns of ssm_out;
* metadata: ssm.conv_kernel, ssm.state_size (key head dim), ssm.group_count (key heads), ssm.time_step_rank
  (value heads), ssm.inner_size, full_attention_interval, rope.dimension_count (the rotary dims) and
  rope.dimension_sections (the config's mrope_section padded to 4, default [11, 11, 10, 0]).
  llama.cpp cannot represent (refused, ConfigError): key and value head dims that differ (it uses one
  ssm.state_size for both) and a layer_types pattern other than "every k-th layer full attention" (it derives
  the layer kinds from full_attention_interval). The multi-token-prediction head (`mtp.*`) is not part of the
  model and is not written (the converter writes it as extra blocks; llama.cpp runs without it).

glm4moe:
* the routed experts of a layer stacked into ffn_{gate,up,down}_exps [E, out, in]; the shared experts as
  ffn_*_shexp; the router as ffn_gate_inp and its e_score_correction_bias as exp_probs_b.bias; no norm offset,
  no q/k permutation (GLM's RoPE is already the rotate-half layout llama.cpp uses for it);
* metadata: expert_count, expert_used_count, expert_feed_forward_length, expert_shared_count,
  leading_dense_block_count (the dense first layers), expert_gating_func sigmoid, expert_weights_scale
  (routed_scaling_factor), expert_weights_norm, expert_group_count / expert_group_used_count,
  rope.dimension_count (partial rotary). The counts llama.cpp reads with a default the config may not match
  are written always. The multi-token-prediction layers are not part of the model: block_count is
  num_hidden_layers and nextn_predict_layers 0. Llama 3 RoPE scaling is refused (llama.cpp's glm4moe applies no
  rope frequency factors).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from unsloth_jax.errors import ConfigError, UnsupportedArchitectureError
from unsloth_jax.hf.gguf_common import add_shape

log = logging.getLogger("unsloth_jax")

# the model_types (their families' gguf_arch: QWEN35, GLM4_MOE) whose tensors and keys this module writes
ARCHS = ("qwen3_5_text", "glm4_moe")
QWEN35_DEFAULT_SECTIONS = [11, 11, 10, 0]  # llama.cpp's qwen35 loader needs rope.dimension_sections


# ------------------------------------------------------------------------------------------------- checks
def full_attention_interval(cfg) -> int:
    """k such that layer i attends fully exactly when (i + 1) % k == 0, the only pattern llama.cpp's qwen35 can
    describe; ConfigError naming layer_types otherwise."""
    kinds = ["linear" if lin else "full" for lin in cfg.layer_linear]
    k = kinds.index("full") + 1
    if any((lin == "linear") != bool((i + 1) % k) for i, lin in enumerate(kinds)):
        raise ConfigError(f"GGUF export: layer_types {kinds} is not 'every {k}-th layer full attention'; llama.cpp's "
                          "qwen35 derives the layer kinds from full_attention_interval and cannot represent it")
    return k


def check(cfg, raw: dict) -> None:
    """Refuse, naming the setting, what llama.cpp's architecture cannot represent."""
    if cfg.model_type == "qwen3_5_text":
        if cfg.linear_key_head_dim != cfg.linear_value_head_dim:
            raise ConfigError(f"GGUF export: linear_key_head_dim={cfg.linear_key_head_dim} differs from "
                              f"linear_value_head_dim={cfg.linear_value_head_dim}; llama.cpp's qwen35 uses one "
                              "ssm.state_size for both")
        full_attention_interval(cfg)
    elif cfg.model_type == "glm4_moe":
        if cfg.rope_type not in ("default", "linear"):
            raise ConfigError(f"GGUF export: rope_type {cfg.rope_type!r} of glm4_moe is not supported (llama.cpp's "
                              "glm4moe applies no rope frequency factors; default and linear scaling are)")
        if cfg.num_mtp_layers:
            log.warning("unsloth_jax: the %d multi-token-prediction layer(s) of this GLM-4.5 checkpoint are not "
                        "part of the model and are not written to the GGUF (nextn_predict_layers = 0)",
                        cfg.num_mtp_layers)


# ------------------------------------------------------------------------------------------------ tensors
def _tiled_v_heads(x: np.ndarray, axis: int, k_heads: int, per_k: int, head_dim: int) -> np.ndarray:
    """Reorder value heads along `axis` (k_heads * per_k * head_dim long) from grouped by key head to tiled."""
    shape = x.shape
    axis %= x.ndim
    y = x.reshape(shape[:axis] + (k_heads, per_k, head_dim) + shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(y, axis, axis + 1)).reshape(shape)


def _qwen35_transform(cfg, suffix: str) -> Callable[[np.ndarray], np.ndarray]:
    """The qwen35 value transform of the HF tensor named `...{suffix}` (float32 in, float32 out)."""
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    reorder = nv != nk and suffix.startswith("linear_attn.")
    r = nv // nk if nk else 1

    def tiled(x, axis, head_dim):
        return _tiled_v_heads(x, axis, nk, r, head_dim) if reorder else x

    if suffix == "linear_attn.in_proj_qkv.weight":
        key = 2 * nk * dk
        return lambda x: np.concatenate([x[:key], tiled(x[key:], 0, dv)])
    if suffix == "linear_attn.conv1d.weight":
        key = 2 * nk * dk

        def conv(x):
            x = x.reshape(x.shape[0], x.shape[-1])
            return np.concatenate([x[:key], tiled(x[key:], 0, dv)])
        return conv
    if suffix == "linear_attn.in_proj_z.weight":
        return lambda x: tiled(x, 0, dv)
    if suffix in ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight", "linear_attn.dt_bias"):
        return lambda x: tiled(x, 0, 1)
    if suffix == "linear_attn.A_log":  # exp in float64, rounded once (torch's float32 exp may differ by an ulp)
        return lambda x: (-np.exp(tiled(x, 0, 1).astype(np.float64))).astype(x.dtype)
    if suffix == "linear_attn.out_proj.weight":
        return lambda x: tiled(x, 1, dv)
    if suffix.endswith("norm.weight") and suffix != "linear_attn.norm.weight":
        return lambda x: x + x.dtype.type(1)  # in the tensor's own precision (float16 stays float16)
    return lambda x: x


def _as_f32(make):
    def run():
        data = make()
        return data if data.dtype in (np.float16, np.float32) else data.astype(np.float32)
    return run


def plan(model, entries, name_map, out_dtype) -> list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]]:
    """(GGUF name, numpy shape, make) of every tensor, in write order, from export.merged_entries' `entries`
    (HF names and makers of the merged checkpoint in `out_dtype`, the merged export's dtype); make() gives
    float16 / float32 data (other dtypes widened to float32 after rounding to theirs, as the converter reads
    the merged checkpoint)."""
    cfg = model.config
    out = []

    def name_of(hf_name: str) -> str:
        new = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise UnsupportedArchitectureError(f"no llama.cpp tensor name for '{hf_name}' ({cfg.model_type})")
        return new

    if cfg.model_type == "qwen3_5_text":
        for e in entries:
            suffix = e.name.split(".", 3)[3] if e.name.startswith("model.layers.") else e.name
            hf_name = e.name.replace(".dt_bias", ".dt_proj.bias")
            shape = tuple(e.shape)
            if suffix == "linear_attn.conv1d.weight":
                shape = (shape[0], shape[-1])
            if suffix == "model.norm.weight":
                suffix = "norm.weight"
            fn = _qwen35_transform(cfg, suffix)
            out.append((name_of(hf_name), shape, lambda make=_as_f32(e.make), fn=fn: fn(np.asarray(make()))))
        return out
    return _glm4_moe_plan(model, entries, name_of, out_dtype)


def _glm4_moe_plan(model, entries, name_of, out_dtype):
    from unsloth_jax.hf.mapping import moe_specs
    from unsloth_jax.hf.moe_io import MergedExperts

    cfg = model.config
    out = []
    for e in entries:
        if ".mlp.experts." in e.name:  # per-expert tensors: written stacked below
            continue
        hf_name = e.name.replace("e_score_correction_bias", "e_score_correction.bias")
        out.append((name_of(hf_name), tuple(e.shape), _as_f32(e.make)))
    # the merged expert stacks in HF's fused layout: gate_up [E, 2F, D] (gate rows first), down [E, D, F]
    experts = MergedExperts(model)
    f = cfg.moe_intermediate_size
    for spec in moe_specs(cfg, "fused").values():
        if spec.kind != "experts":
            continue
        make = _as_f32(experts.maker(spec, out_dtype))
        prefix = f"model.layers.{spec.layer}.mlp.experts."
        e_, rows, cols = spec.hf_shape
        if spec.hf_name.endswith("gate_up_proj"):
            out.append((name_of(prefix + "gate_proj.weight"), (e_, f, cols), lambda make=make: make()[:, :f]))
            out.append((name_of(prefix + "up_proj.weight"), (e_, f, cols), lambda make=make: make()[:, f:]))
        else:
            out.append((name_of(prefix + "down_proj.weight"), (e_, rows, cols), make))
    return out


# ------------------------------------------------------------------------------------------------ metadata
def add_hparams(w, model, raw: dict, ftype) -> None:
    """The `<arch>.*` keys llama.cpp's converter writes for the family, with the model's values."""
    import gguf

    cfg = model.config
    add_shape(w, cfg)
    if cfg.rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_factor)
    w.add_rope_freq_base(cfg.rope_theta)
    if raw.get("head_dim") is not None or not raw:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_file_type(ftype)
    w.add_rope_dimension_count(cfg.rotary_dim or cfg.head_dim)
    if cfg.model_type == "qwen3_5_text":
        w.add_ssm_conv_kernel(cfg.linear_conv_kernel)
        w.add_ssm_state_size(cfg.linear_key_head_dim)
        w.add_ssm_group_count(cfg.linear_num_key_heads)
        w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
        w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
        w.add_full_attention_interval(full_attention_interval(cfg))
        params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        sections = list(params.get("mrope_section") or QWEN35_DEFAULT_SECTIONS)
        w.add_rope_dimension_sections((sections + [0, 0, 0, 0])[:4])
        return
    # glm4_moe
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.shared_expert_size // cfg.moe_intermediate_size)
    w.add_leading_dense_block_count(next(i for i, sparse in enumerate(cfg.layer_sparse) if sparse))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_weights_norm(cfg.norm_topk_prob)
    w.add_nextn_predict_layers(0)


# ------------------------------------------------------------------------------------------------ reading
# the llama.cpp archs (their families' gguf_read) whose config fields and tensor layouts this module reads
READ_ARCHS = ("qwen35", "glm4moe")
_PLUS_ONE = ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight")


def config_fields(f, raw: dict, names: set) -> dict:
    """The config.json fields of a qwen35 / glm4moe file beyond the common ones gguf_loading.hf_config reads
    (`f`: its GGUFFile). Multi-token-prediction blocks past the decoder (nextn_predict_layers) are left out."""
    a = f.arch + "."
    layers = raw["num_hidden_layers"] - int(f.get(a + "nextn_predict_layers", 0))
    rotary = int(f.get(a + "rope.dimension_count", raw["head_dim"]))
    rope = {"rope_type": "default", "rope_theta": raw["rope_theta"], "partial_rotary_factor": rotary / raw["head_dim"]}
    if "rope_scaling" in raw:  # linear
        rope.update(raw.pop("rope_scaling"))
    out = {"num_hidden_layers": layers, "rope_parameters": rope, "hidden_act": "silu"}
    if f.arch == "qwen35":
        k = int(f.get(a + "full_attention_interval", 4))
        state = int(f.need(a + "ssm.state_size"))
        out.update(layer_types=["linear_attention" if (i + 1) % k else "full_attention" for i in range(layers)],
                   linear_conv_kernel_dim=int(f.need(a + "ssm.conv_kernel")), linear_key_head_dim=state,
                   linear_value_head_dim=state, linear_num_key_heads=int(f.need(a + "ssm.group_count")),
                   linear_num_value_heads=int(f.need(a + "ssm.time_step_rank")), attention_bias=False)
        return out
    first_dense = int(f.get(a + "leading_dense_block_count", 0))
    out.update(n_routed_experts=int(f.need(a + "expert_count")),
               num_experts_per_tok=int(f.need(a + "expert_used_count")),
               moe_intermediate_size=int(f.need(a + "expert_feed_forward_length")),
               n_shared_experts=int(f.need(a + "expert_shared_count")), first_k_dense_replace=first_dense,
               n_group=int(f.get(a + "expert_group_count", 1) or 1),
               topk_group=int(f.get(a + "expert_group_used_count", 1) or 1),
               routed_scaling_factor=float(f.get(a + "expert_weights_scale", 1.0) or 1.0),
               norm_topk_prob=bool(f.get(a + "expert_weights_norm", False)), num_nextn_predict_layers=0,
               use_qk_norm="blk.0.attn_q_norm.weight" in names, attention_bias="blk.0.attn_q.bias" in names)
    return out


def gguf_names(cfg, name_map) -> dict:
    """GGUF tensor name -> the TensorSpec it fills (GLM-4.5's experts: the fused stacks; gate_exps and up_exps
    both name the gate_up stack)."""
    from unsloth_jax.hf.mapping import tensor_specs

    out = {}
    for hf_name, spec in tensor_specs(cfg, "fused" if cfg.is_moe else None).items():
        if hf_name.endswith("mlp.experts.gate_up_proj"):
            base = hf_name.removesuffix("gate_up_proj")
            out[name_map.get_name(base + "gate_proj.weight", try_suffixes=(".weight",))] = spec
            out[name_map.get_name(base + "up_proj.weight", try_suffixes=(".weight",))] = spec
            continue
        if hf_name.endswith("mlp.experts.down_proj"):
            hf_name += ".weight"
        hf_name = hf_name.replace(".dt_bias", ".dt_proj.bias").replace("e_score_correction_bias",
                                                                         "e_score_correction.bias")
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise UnsupportedArchitectureError(f"gguf has no {cfg.model_type} tensor name for '{hf_name}'")
        out[name] = spec
    return out


def is_mtp_tensor(cfg, name: str) -> bool:
    """Whether GGUF tensor `name` belongs to a multi-token-prediction block past the decoder's layers."""
    parts = name.split(".")
    return parts[0] == "blk" and int(parts[1]) >= cfg.num_hidden_layers


def restore(cfg, name: str, w: np.ndarray, held: dict) -> np.ndarray | None:
    """A qwen35 / glm4moe tensor (float32, HF order) back in the HF checkpoint's layout and values: the inverse
    of `plan`'s transforms. GLM-4.5's gate_exps / up_exps: None for the first of a layer's pair (kept in `held`),
    the fused [E, 2F, D] stack for the second."""
    leaf = name.split(".", 2)[-1] if name.startswith("blk.") else name
    if cfg.model_type == "glm4_moe":
        if leaf in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
            layer = name.split(".")[1]
            other = held.pop(layer, None)
            if other is None:
                held[layer] = (leaf, w)
                return None
            pair = dict([other, (leaf, w)])
            return np.concatenate([pair["ffn_gate_exps.weight"], pair["ffn_up_exps.weight"]], axis=1)
        return w
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    key, dv = 2 * nk * cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = nv // nk

    def grouped(x, axis, head_dim):  # tiled -> grouped by key head: the same swap with the roles exchanged
        return _tiled_v_heads(x, axis, r, nk, head_dim) if r > 1 else x

    if leaf in _PLUS_ONE or name == "output_norm.weight":
        return w - np.float32(1)
    if leaf in ("attn_qkv.weight", "ssm_conv1d.weight"):
        w = np.concatenate([w[:key], grouped(w[key:], 0, dv)])
        return w[:, None, :] if leaf == "ssm_conv1d.weight" else w
    if leaf == "attn_gate.weight":
        return grouped(w, 0, dv)
    if leaf in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_dt.bias"):
        return grouped(w, 0, 1)
    if leaf == "ssm_a":
        return np.log(-grouped(w, 0, 1).astype(np.float64)).astype(np.float32)
    if leaf == "ssm_out.weight":
        return grouped(w, 1, dv)
    return w
