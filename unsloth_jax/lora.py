"""LoRA on the NNX decoder, and the functional partition into trainable and frozen state.

    settings = LoraSettings(r=16, lora_alpha=16, target_modules=ALL_TARGETS)
    add_lora(model, settings, jax.random.PRNGKey(3407))       # in place: nnx.LoRAParam lora_a / lora_b
    graphdef, trainable, frozen = split(model)                 # nnx.split(model, trainable_filter(...), ...)
    model = nnx.merge(graphdef, trainable, frozen)

`add_lora` gives every targeted projection (a `Linear`) `lora_a` [R, in, r] and `lora_b` [R, r, out] (R: the rows of
its stack, the layers holding it) as `nnx.LoRAParam`s, and, for MoE families, every expert weight named in
`target_parameters` (PEFT's names "mlp.experts.gate_up_proj", "mlp.experts.down_proj"; a `GroupedLinear`) `lora_a`
[L, E, in, r] and `lora_b` [L, E, r, out]: one rank-r pair per expert, as PEFT's ParamWrapper trains on a fused 3-D
weight. Differentiating a loss with respect to the trainable state alone (`nnx.LoRAParam`, plus any
`modules_to_save` weights and biases the settings train) means frozen weights never get a gradient buffer or
optimizer state. `nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)` selects the same leaves the NNX way.

Full fine-tuning is the other partition: `enable_full_finetuning(model)` marks every projection's kernel as
trained (`Linear.train_kernel`, so ops.linear no longer stops its gradient) and `split` then puts every
`nnx.Param` in the trainable state (tied embeddings stay one variable, so they stay tied).
"""
from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from unsloth_jax.config import stack_holders
from unsloth_jax.models.decoder import ATTN_PROJS, MLP_PROJS, CausalLM
from unsloth_jax.models.layers import Buffer, Linear, value_of
from unsloth_jax.models.linear_attention import LINEAR_PROJS
from unsloth_jax.models.moe import EXPERT_PARAMETERS
from unsloth_jax.quant import dense_kernel, is_quantized

log = logging.getLogger("unsloth_jax")

ALL_TARGETS = ATTN_PROJS + MLP_PROJS
# every projection name LoRA may target: the seven above and Qwen3.5's linear-attention projections (PEFT's names)
KNOWN_TARGETS = ALL_TARGETS + LINEAR_PROJS
BIAS_MODES = ("none", "all", "lora_only")


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """The LoRA configuration of a model, as PEFT's LoraConfig names it. Frozen, so a model holds it as a
    static attribute."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    lora_dropout: float = 0.0
    bias: str = "none"
    use_rslora: bool = False
    modules_to_save: tuple[str, ...] | None = None
    target_parameters: tuple[str, ...] | None = None  # MoE expert weights, PEFT's names (EXPERT_PARAMETERS)
    # a vision-language model's vision-tower Linears (models.vision.VISION_PROJS names: q_proj ... fc2)
    vision_target_modules: tuple[str, ...] | None = None

    @property
    def scale(self) -> float:
        return self.lora_alpha / (self.r ** 0.5 if self.use_rslora else self.r)


def expand_targets(target_modules) -> tuple[str, ...]:
    """target_modules as a tuple of projection names: a name, a list of names, or PEFT's "all-linear" (every
    projection of the decoder layers, not the output head; add_lora keeps those the model has). Raises
    ValueError naming unknown entries."""
    if isinstance(target_modules, str):
        targets = KNOWN_TARGETS if target_modules == "all-linear" else (target_modules,)
    else:
        try:
            targets = tuple(target_modules)
        except TypeError:
            raise TypeError(f"target_modules must be a list of module names or 'all-linear', got "
                            f"{target_modules!r}") from None
    if not targets:
        raise ValueError("target_modules is empty; name at least one projection or use 'all-linear'")
    unknown = [t for t in targets if t not in KNOWN_TARGETS]
    if unknown:
        raise ValueError(f"unknown target module(s) {unknown}; choose from {list(KNOWN_TARGETS)} or 'all-linear'")
    return tuple(dict.fromkeys(targets))


def expand_target_parameters(target_parameters, model: CausalLM) -> tuple[str, ...]:
    """PEFT's target_parameters for a MoE model -> the expert weights' full names in EXPERT_PARAMETERS order.
    An entry names one by its full name or a '.'-separated suffix ("experts.down_proj", "gate_up_proj").
    Raises ValueError for a dense model or an entry naming no expert weight."""
    if not target_parameters:
        return ()
    if isinstance(target_parameters, str):
        target_parameters = [target_parameters]
    if not model.config.is_moe:
        raise ValueError(f"target_parameters={list(target_parameters)}: this {model.config.model_type} model has no "
                         "expert weights (target_parameters adapts the experts of MoE models)")
    names = tuple(EXPERT_PARAMETERS)
    unknown = [t for t in target_parameters if not any(n == t or n.endswith("." + t) for n in names)]
    if unknown:
        raise ValueError(f"target_parameters {unknown} name no expert weight; choose from {list(names)}")
    return tuple(n for n in names if any(n == t or n.endswith("." + t) for t in target_parameters))


def _lora_pair(key, stack: tuple[int, ...], in_features: int, out_features: int, r: int):
    """PEFT's initialisation: A ~ kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)), B = 0 (float32)."""
    bound = 1.0 / np.sqrt(in_features)
    a = jax.random.uniform(key, (*stack, in_features, r), jnp.float32, -bound, bound)
    return nnx.LoRAParam(a), nnx.LoRAParam(jnp.zeros((*stack, r, out_features), jnp.float32))


def add_lora(model: CausalLM, settings: LoraSettings, key: jax.Array) -> CausalLM:
    """Give every targeted projection a LoRA pair, in place, initialised as PEFT does: A ~ kaiming_uniform(a=sqrt(5))
    = U(-1/sqrt(in), 1/sqrt(in)), B = 0, both float32 [R, in, r] / [R, r, out] (R: the stack's rows; [L, E, ...]
    for the expert weights of settings.target_parameters). Existing pairs are replaced, and the pairs of projections not
    targeted any more are removed. A MoE model without dense MLP layers skips gate/up/down_proj (with a
    warning). Returns the model."""
    if settings.bias not in BIAS_MODES:
        raise ValueError(f"bias must be one of {', '.join(BIAS_MODES)}, got {settings.bias!r}")
    if getattr(model, "full_finetuning", False):
        raise ValueError("this model is set up for full fine-tuning (every weight trains); LoRA adapters cannot "
                         "be added to it: load it again without full_finetuning=True to train LoRA")
    targets = (expand_targets(settings.target_modules) if settings.target_modules
               or not (settings.target_parameters or settings.vision_target_modules) else ())
    expert_targets = expand_target_parameters(settings.target_parameters, model)
    vision_targets = _vision_targets(settings.vision_target_modules, model, settings.bias)
    if settings.bias != "none" and model.config.expert_bias:
        raise ValueError(f"bias={settings.bias!r} is not supported for {model.config.model_type}: its router and "
                         "expert biases have no PEFT adapter form; use bias='none'")
    stacks = model.projection_stacks()  # (submodule, name) -> Linear
    projs = {name for _, name in stacks}
    no_linear = [t for t in targets if t in LINEAR_PROJS and t not in projs]
    if no_linear:  # Qwen3.5's linear-attention projections ("all-linear" names them for every model)
        log.debug("unsloth_jax: target_modules %s: this model has no linear-attention layers", no_linear)
        targets = tuple(t for t in targets if t not in no_linear)
    absent = [t for t in targets if t not in projs]
    if absent:
        log.warning("unsloth_jax: target_modules %s match no module of this %s model (it has no dense MLP layers); "
                    "its experts take LoRA through target_parameters=%s (PEFT's form)", absent,
                    model.config.model_type, list(EXPERT_PARAMETERS))
        targets = tuple(t for t in targets if t in projs)
    if not targets and not expert_targets and not vision_targets:
        raise ValueError(f"nothing to adapt: target_modules {list(settings.target_modules)} and target_parameters "
                         f"{list(settings.target_parameters or [])} match nothing in this model")
    keys = jax.random.split(key, len(targets)) if targets else []
    for (_, name), lin in stacks.items():
        if name not in targets:
            lin.lora_a = lin.lora_b = None
            lin.lora_scale = None
    for name, k in zip(targets, keys):
        # every submodule holding the projection (Gemma 4's global_attn, ...: config.KIND_MODULES), its own key
        for j, lin in enumerate(lin for (_, n), lin in stacks.items() if n == name):
            lin.lora_a, lin.lora_b = _lora_pair(k if j == 0 else jax.random.fold_in(k, j), stack_of(lin),
                                                lin.in_features, lin.out_features, settings.r)
            lin.lora_scale = float(settings.scale)
    experts = model.expert_projections()
    expert_keys = jax.random.split(jax.random.fold_in(key, 1), max(len(experts), 1))
    for (name, grouped), k in zip(experts.items(), expert_keys):
        if name in expert_targets:
            stack = (len(stack_holders(model.config, "mlp")), grouped.num_experts)
            grouped.lora_a, grouped.lora_b = _lora_pair(k, stack, grouped.in_features, grouped.out_features,
                                                        settings.r)
            grouped.lora_scale = float(settings.scale)
        else:
            grouped.lora_a = grouped.lora_b = None
            grouped.lora_scale = None
    if hasattr(model, "vision_projections"):
        _add_vision_lora(model, vision_targets, settings, jax.random.fold_in(key, 2))
    model.lora = dataclasses.replace(settings, target_modules=targets, target_parameters=expert_targets or None,
                                     vision_target_modules=vision_targets or None)
    return model


def _vision_targets(names, model, bias: str) -> tuple[str, ...]:
    """vision_target_modules checked against the model's vision Linears (ValueError naming unknown ones)."""
    if not names:
        return ()
    if not hasattr(model, "vision_projections"):
        raise ValueError(f"vision_target_modules={list(names)}: this model has no vision tower")
    known = tuple(model.vision_projections())
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown vision target module(s) {unknown}; choose from {list(known)}")
    if bias != "none":
        raise ValueError(f"bias={bias!r} is not supported with LoRA on the vision layers; use bias='none'")
    return tuple(n for n in known if n in names)


def _add_vision_lora(model, targets: tuple[str, ...], settings: LoraSettings, key: jax.Array) -> None:
    """LoRA pairs [Lv, in, r] / [Lv, r, out] on the targeted vision-tower Linears (PEFT's init), none elsewhere."""
    layers = model.vl_config.vision.num_hidden_layers
    keys = dict(zip(targets, jax.random.split(key, max(len(targets), 1))))
    for name, lin in model.vision_projections().items():
        if name in targets:
            lin.lora_a, lin.lora_b = _lora_pair(keys[name], (layers,), lin.in_features, lin.out_features, settings.r)
            lin.lora_scale = float(settings.scale)
        else:
            lin.lora_a = lin.lora_b = None
            lin.lora_scale = None


_FULL_FT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def enable_full_finetuning(model: CausalLM) -> CausalLM:
    """Make every weight of `model` trainable, in place: each projection's `train_kernel` is set (its gradient
    flows through ops.linear) and `model.full_finetuning` becomes True, so `split` puts every nnx.Param in the
    trainable state. Only dense float32/bfloat16/float16 weights can train: a 4-bit (NF4Param) or FP8 base,
    a mixture-of-experts model, or a model that already has LoRA adapters, raises ValueError (naming the
    variable where one is at fault)."""
    if model.lora is not None:
        raise ValueError("the model already has LoRA adapters; full fine-tuning trains the base weights "
                         "themselves: load the model again with full_finetuning=True instead")
    if model.config.is_moe:  # router, experts and sinks stop their gradients (models/moe.py): they would not train
        raise ValueError(f"full fine-tuning of {model.config.model_type} (mixture-of-experts) is not supported: its "
                         "router and expert weights have no gradient path; train LoRA (target_parameters for the "
                         "experts) instead")
    for path, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Variable):
            continue
        name = ".".join(map(str, path))
        value = value_of(var)
        if not isinstance(var, nnx.Param) or is_quantized(value):
            raise ValueError(f"{name} is a {type(var).__name__} (a quantized base weight): full fine-tuning needs "
                             "dense weights; load the model without load_in_4bit / load_in_fp8 (a pre-quantized "
                             "checkpoint cannot be fully fine-tuned)")
        if jnp.dtype(value.dtype) not in _FULL_FT_DTYPES:
            raise ValueError(f"{name} has dtype {value.dtype}: full fine-tuning trains float32, bfloat16 or "
                             "float16 weights only")
    for lin in model.projection_stacks().values():
        lin.train_kernel = True
    model.full_finetuning = True
    return model


def trainable_filter(settings: LoraSettings | None, full_finetuning: bool = False):
    """The nnx filter of the variables that train: with full_finetuning, every nnx.Param; otherwise, under
    `settings`, every nnx.LoRAParam, the weights of the `modules_to_save` modules (e.g. "lm_head",
    "embed_tokens"), and biases when bias="all" (every bias) or "lora_only" (biases of the targeted
    projections). Without extras it is just nnx.LoRAParam."""
    if full_finetuning:
        return nnx.Param
    if settings is None:
        return nnx.LoRAParam
    rules = [nnx.LoRAParam]
    saved = tuple(settings.modules_to_save or ())
    if saved:
        rules.append(lambda path, _: any(str(p) in saved for p in path))
    if settings.bias == "all":
        rules.append(lambda path, _: bool(path) and path[-1] == "bias")
    elif settings.bias == "lora_only":
        targets = set(settings.target_modules)
        rules.append(lambda path, _: len(path) >= 2 and path[-1] == "bias" and path[-2] in targets)
    return rules[0] if len(rules) == 1 else nnx.Any(*rules)


def split(model: CausalLM, trainable=None):
    """(graphdef, trainable state, frozen state) of `model`: nnx.split by `trainable` (default: the model's own
    trainable_filter(model.lora, model.full_finetuning)). The two states are pure pytrees with disjoint
    leaves."""
    if not isinstance(model, nnx.Module):
        raise TypeError(f"lora.split takes the model (an nnx.Module from FastLanguageModel), got "
                        f"{type(model).__name__}: the split of a params dict into (trainable, frozen) moved to the NNX "
                        "module, so call `graphdef, trainable, frozen = lora.split(model)` (nnx.split(model, "
                        "nnx.LoRAParam, ...)) and `nnx.merge(graphdef, trainable, frozen)` to join them")
    wrt = trainable_filter(model.lora, model.full_finetuning) if trainable is None else trainable
    return nnx.split(model, wrt, ...)


def count(tree) -> int:
    """Number of scalar parameters in a module or state (4-bit and FP8 weights count their original elements;
    a Buffer, which transformers holds as a buffer, is no parameter). A layer-stack leaf has one row per layer
    holding its submodule (config.stack_holders), so the counts are transformers' and PEFT's."""
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree)
    total = 0
    for var in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        if isinstance(var, Buffer):
            continue
        value = value_of(var) if isinstance(var, nnx.Variable) else var
        if is_quantized(value):  # original elements, times the stacked layers
            total += value.numel * int(np.prod(value.stack_shape))
        else:
            total += int(np.prod(np.shape(value)))
    return total


def stack_of(lin: Linear) -> tuple[int, ...]:
    """The stack axes of a (possibly 4-bit or FP8) Linear's kernel: () unstacked, (rows,) in a layer stack."""
    kernel = value_of(lin.kernel)
    return tuple(kernel.stack_shape) if is_quantized(kernel) else tuple(kernel.shape[:-2])


def merged_kernel(lin: Linear, layer: int) -> np.ndarray:
    """Layer `layer` of a projection as a dense float32 [in, out] numpy array with its LoRA pair folded in
    (kernel + scale * A @ B); a 4-bit or FP8 base is dequantized first."""
    kernel = value_of(lin.kernel)
    w = np.asarray(dense_kernel(jax.tree.map(lambda a: a[layer], kernel)), np.float32)
    if lin.lora_a is not None:
        a = np.asarray(lin.lora_a[...][layer], np.float32)
        b = np.asarray(lin.lora_b[...][layer], np.float32)
        w = w + np.float32(lin.lora_scale) * (a @ b)
    return w


def merged_expert_kernel(grouped, layer: int) -> np.ndarray:
    """Layer `layer` of an expert stack (`GroupedLinear`) as a dense float32 [E, in, out] numpy array with its
    LoRA pairs folded in (kernel[e] + scale * A[e] @ B[e])."""
    w = np.asarray(grouped.kernel[...][layer], np.float32)
    if grouped.lora_a is not None:
        a = np.asarray(grouped.lora_a[...][layer], np.float32)
        b = np.asarray(grouped.lora_b[...][layer], np.float32)
        w = w + np.float32(grouped.lora_scale) * np.einsum("eir,ero->eio", a, b)
    return w


__all__ = ["ALL_TARGETS", "KNOWN_TARGETS", "LoraSettings", "expand_targets", "expand_target_parameters", "add_lora",
           "enable_full_finetuning", "trainable_filter", "split", "count", "merged_kernel", "merged_expert_kernel"]
