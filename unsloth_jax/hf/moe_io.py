"""Checkpoint and adapter I/O of the mixture-of-experts families (Qwen3-MoE, Mixtral, gpt-oss).

Merged export writes the layout transformers 5's save_pretrained writes (the family's first `expert_layouts`):
one tensor per expert for Qwen3-MoE (`mlp.experts.{e}.{gate,up,down}_proj.weight`) and Mixtral
(`block_sparse_moe.experts.{e}.w1/w3/w2.weight`), fused 3-D tensors for gpt-oss.

PEFT adapters: LoRA on the experts is PEFT 0.21's `target_parameters` form (a ParamWrapper on each fused 3-D
expert weight of transformers 5's model). When both expert weights are targeted the wrappers nest, gate_up_proj
inside down_proj, so per MoE layer N:

    base_model.model.model.layers.N.mlp.experts.base_layer.lora_A.weight  [E*r, in]    gate_up_proj
    base_model.model.model.layers.N.mlp.experts.base_layer.lora_B.weight  [out, r*E]
    base_model.model.model.layers.N.mlp.experts.lora_A.weight             [E*r, in]    down_proj
    base_model.model.model.layers.N.mlp.experts.lora_B.weight             [out, r*E]

(a single targeted weight has no `base_layer.`). lora_A rows are expert-major (row e*r + k is rank k of
expert e) and lora_B columns rank-major (column k*E + e), as PEFT's get_delta_weight reshapes them; in and out
are the projection's (gate_up: D -> 2F, down: F -> D) whichever way transformers stores the weight. So
lora_A.weight = a[N].transpose(0, 2, 1).reshape(E*r, in) and lora_B.weight = b[N].transpose(2, 1, 0).reshape(out, r*E)
for this package's a [L, E, in, r], b [L, E, r, out].

What PEFT cannot express: on transformers 5, PEFT rewrites the target_modules gate_proj/up_proj/down_proj of
Qwen3-MoE (and w1/w2/w3 of Mixtral) into the experts' fused weights when it loads an adapter (its v4 -> v5
conversion), so LoRA on the dense MLP layers of a Qwen3-MoE with mlp_only_layers / decoder_sparse_step has no
PEFT adapter form: `check_adapter_expressible` refuses to write one (merged export still works).
"""
from __future__ import annotations

import re

import numpy as np

from unsloth_jax.errors import ConfigError, MissingTensorError, ShapeMismatchError
from unsloth_jax.families import text_family
from unsloth_jax.hf.mapping import TensorSpec
from unsloth_jax.lora import merged_expert_kernel
from unsloth_jax.models.decoder import MLP_PROJS
from unsloth_jax.models.moe import EXPERT_PARAMETERS
from unsloth_jax.models.state import variable_at

_EXPERT_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.mlp\.experts\.(base_layer\.)?"
                         r"(lora_A|lora_B)(?:\.[\w-]+)?\.weight$")


# ---------------------------------------------------------------------------------------------- merged
class MergedExperts:
    """Makers of the merged HF tensors of the MoE kinds (router, expert, experts, experts_t) for one export.

    Expert weights get their LoRA pairs folded in (float32, then cast). Each expert stack (gate_up_proj,
    down_proj) keeps the merged [E, in, out] array of the layer last asked for, so the per-expert tensors of a
    layer, which alternate between the two stacks, cost one merge per stack and layer, and host memory holds
    one layer's stacks at a time."""

    def __init__(self, model):
        self.model = model
        self._merged_layer: dict[int, tuple[int, np.ndarray]] = {}  # id(GroupedLinear) -> (layer, merged)

    def _merged(self, grouped, layer: int) -> np.ndarray:
        held = self._merged_layer.get(id(grouped))
        if held is None or held[0] != layer:
            held = (layer, merged_expert_kernel(grouped, layer))
            self._merged_layer[id(grouped)] = held
        return held[1]

    def maker(self, spec: TensorSpec, out_dtype: np.dtype):
        """A function producing the HF tensor of `spec` in out_dtype."""
        if spec.kind == "router":
            kernel = variable_at(self.model, spec.path)[...]
            out_dtype = np.float32 if spec.keep_fp32 else out_dtype
            return lambda: np.ascontiguousarray(np.asarray(kernel[spec.slot], np.float32).T).astype(out_dtype)
        grouped = _parent(self.model, spec.path)
        if spec.kind == "experts_t":
            return lambda: np.ascontiguousarray(self._merged(grouped, spec.slot)).astype(out_dtype)
        if spec.kind == "experts":
            return lambda: np.ascontiguousarray(np.swapaxes(self._merged(grouped, spec.slot), 1, 2)).astype(out_dtype)
        if spec.kind == "expert":
            width = spec.hf_shape[0]

            def make():
                part = self._merged(grouped, spec.slot)[spec.expert][:, spec.column:spec.column + width]
                return np.ascontiguousarray(part.T).astype(out_dtype)

            return make
        raise ValueError(f"{spec.hf_name}: kind {spec.kind!r} is not a merged MoE kind")


def _parent(model, path: tuple[str, ...]):
    node = model
    for key in path[:-1]:
        node = getattr(node, key)
    return node


# ---------------------------------------------------------------------------------------------- adapter
def check_adapter_expressible(model) -> None:
    """Raise ConfigError when model.lora cannot be written as a PEFT adapter that PEFT 0.21 loads back onto
    transformers 5's model with the same function (see the module docstring)."""
    cfg, lo = model.config, model.lora
    dense = [t for t in lo.target_modules if t in MLP_PROJS]
    if cfg.is_moe and dense and text_family(cfg.model_type).peft_remaps_mlp_targets:
        raise ConfigError(
            f"cannot save a PEFT adapter with LoRA on the dense MLP projections {dense} of {cfg.model_type}: PEFT "
            f"on transformers 5 maps target_modules {dense} onto the experts' fused weights when loading, so the "
            "adapter would not load as trained. Save the merged model (save_pretrained_merged), or train with "
            "target_modules on attention only (experts: target_parameters)")


def expert_adapter_tensors(model) -> list[tuple[str, tuple[int, ...], object]]:
    """(PEFT key, shape, make) of every expert LoRA tensor of model.lora.target_parameters, float32."""
    lo = model.lora
    targets = tuple(lo.target_parameters or ())
    if not targets:
        return []
    experts = model.expert_projections()
    out = []
    for i, sparse in enumerate(model.config.layer_sparse):
        if not sparse:
            continue
        for name in targets:
            grouped = experts[name]
            if grouped.lora_a is None:
                raise ConfigError(f"model.lora targets {name} but model.model.layers.{name} has no lora_a/lora_b")
            a, b = grouped.lora_a[...], grouped.lora_b[...]
            e, d_in, r = a.shape[1:]
            d_out = b.shape[-1]
            prefix = f"base_model.model.model.layers.{i}.{_wrapper_path(name, targets)}"
            shape_a, shape_b = (e * r, d_in), (d_out, r * e)
            out.append((f"{prefix}.lora_A.weight", shape_a,
                        lambda a=a, i=i, s=shape_a: np.asarray(a[i], np.float32).transpose(0, 2, 1).reshape(s)))
            out.append((f"{prefix}.lora_B.weight", shape_b,
                        lambda b=b, i=i, s=shape_b: np.asarray(b[i], np.float32).transpose(2, 1, 0).reshape(s)))
    return out


def _wrapper_path(name: str, targets: tuple[str, ...]) -> str:
    """The module path of the PEFT ParamWrapper of expert weight `name` under a decoder layer: gate_up_proj's
    wrapper sits inside down_proj's when both are targeted."""
    if name == "mlp.experts.gate_up_proj" and "mlp.experts.down_proj" in targets:
        return "mlp.experts.base_layer"
    return "mlp.experts"


def resolve_target_parameters(raw, source: str) -> tuple[str, ...]:
    """adapter_config.json's target_parameters -> EXPERT_PARAMETERS names (full names or '.'-suffixes)."""
    if not raw:
        return ()
    raw = [raw] if isinstance(raw, str) else [str(t) for t in raw]
    names = tuple(EXPERT_PARAMETERS)
    unknown = [t for t in raw if not any(n == t or n.endswith("." + t) for n in names)]
    if unknown:
        raise ConfigError(f"{source}: target_parameters {unknown} name no expert weight unsloth_jax can adapt "
                          f"(supported: {', '.join(names)})")
    return tuple(n for n in names if any(n == t or n.endswith("." + t) for t in raw))


def is_expert_key(key: str) -> bool:
    return _EXPERT_KEY.match(key) is not None


def read_expert_adapter(model, f, targets: tuple[str, ...], r: int, where) -> dict:
    """The expert LoRA factors of a PEFT adapter (an open SafetensorsFile `f`) as {name: (a [L, E, in, r],
    b [L, E, r, out])} float32 numpy arrays; checks shapes and that every MoE layer has them."""
    cfg = model.config
    experts = model.expert_projections()
    n, e = cfg.num_hidden_layers, cfg.num_experts
    out = {t: (np.zeros((n, e, experts[t].in_features, r), np.float32),
               np.zeros((n, e, r, experts[t].out_features), np.float32)) for t in targets}
    by_path = {_wrapper_path(t, targets): t for t in targets}
    seen = set()
    for key in f.keys():
        m = _EXPERT_KEY.match(key)
        if m is None:
            continue
        i, nested, which = int(m.group(1)), bool(m.group(2)), m.group(3)
        path = "mlp.experts.base_layer" if nested else "mlp.experts"
        name = by_path.get(path)
        if name is None or i >= n or not cfg.layer_sparse[i]:
            raise ShapeMismatchError(f"{where}: tensor '{key}' does not fit target_parameters {list(targets)} or "
                                     f"this {cfg.model_type} model's MoE layers")
        d_in, d_out = experts[name].in_features, experts[name].out_features
        arr = np.asarray(f.get(key), np.float32)
        want = (e * r, d_in) if which == "lora_A" else (d_out, r * e)
        if arr.shape != want:
            raise ShapeMismatchError(f"{where}: tensor '{key}' has shape {list(arr.shape)}, expected {list(want)} "
                                     f"(r={r}, {e} experts, {name} is {d_in} -> {d_out})")
        if which == "lora_A":
            out[name][0][i] = arr.reshape(e, r, d_in).transpose(0, 2, 1)
        else:
            out[name][1][i] = arr.reshape(d_out, r, e).transpose(2, 1, 0)
        seen.add((name, i, which))
    missing = [f"layers.{i}.{t}.{w}" for t in targets for i in range(n) if cfg.layer_sparse[i]
               for w in ("lora_A", "lora_B") if (t, i, w) not in seen]
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise MissingTensorError(f"{where}: adapter is missing {len(missing)} expert LoRA tensor(s): {shown}")
    return out
