"""The jit-compiled train steps over the NNX model's split state: `make_step`, the one factory every trainer's
step comes from (SFT here, DPO/ORPO in preference.py, GRPO in grpo.py: each brings only its `StepLoss`), and SFT's
`make_train_step`.

    graphdef, trainable, frozen = unsloth_jax.lora.split(model)       # nnx.split(model, nnx.LoRAParam, ...)
    step = make_train_step(graphdef, optimizer, remat="full")
    trainable, opt_state, metrics = step(trainable, frozen, opt_state, batch)
    nnx.update(model, trainable)                                       # the trained LoRA weights, in place

`batch` holds int32 arrays [A, B, S] (A micro-batches for gradient accumulation; A may be 1): input_ids,
labels (HF convention: aligned with input_ids, -100 ignored; the loss predicts labels[t+1] from position t),
attention_mask (padding on the right), and optionally positions, and segment_ids for packed rows. A
vision-language model's batch adds its family's image fields (families.<family>.prepare_inputs: Gemma 3's
pixel_values float32 [A, N, C, H, W] and token_type_ids [A, B, S]; Qwen2.5-VL's pixel_values [A, P, C*T*p*p],
mrope_positions [A, 3, B, S] and the tower's window layout vision_* [A, P, ...]), read into ModelInputs.
Gradients are taken with respect to
`trainable` only; `frozen` enters the loss as a constant. The loss over the accumulated micro-batches equals
the loss of one big batch (each micro-batch's mean is weighted by its count of target tokens).

A step whose loss or gradient is not finite leaves params and optimizer state untouched and reports
`skipped=1`.

MoE families with `config.output_router_logits` (transformers' switch; from_pretrained(...,
output_router_logits=True) sets it) add `router_aux_loss_coef` times the load-balancing loss of each
micro-batch to its loss, as transformers' *ForCausalLM does, and report `aux_loss` (token-weighted over the
micro-batches) in the metrics.
"""
from __future__ import annotations

import functools
import logging
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from pallas_kernels._common import on_gpu
from unsloth_jax import ops
from unsloth_jax.families import TEXT, Family, family_of
from unsloth_jax.models.decoder import CausalLM
from unsloth_jax.models.layer_stack import NO_REMAT, LayerStackPolicy, Offload, require_policy
from unsloth_jax.models.moe import load_balancing_loss
from unsloth_jax.models.offload import OFFLOAD_COMPILER_OPTIONS
from unsloth_jax.train.optim import FusedAdamW, global_norm, scale_gradient

log = logging.getLogger("unsloth_jax")


def host_offload_supported() -> bool:
    """Pinned-host offload of remat residuals works on GPU backends (checked on the H200, jax 0.11.2)."""
    return on_gpu()


def step_compiler_options(remat: LayerStackPolicy, policy: ops.Policy | None = None) -> dict | None:
    """XLA options for a train step under the layer-stack policy `remat`: on the GPU, a per-layer host offload
    that runs as the prefetched layer scan (unsloth_jax.models.offload: "offload", and "offload_attention" unless
    its setting offload_attention=policy) gets OFFLOAD_COMPILER_OPTIONS, which put its host copies on their own
    streams beside the compute; else None (the policy-based offload modes measured no gain from them). The
    steps pass it to ops.policy_jit, which calls it with the ops `policy` of each call; the ops policy holds
    kernel choices only, so it is not read."""
    if not on_gpu():
        return None
    stack = require_policy(remat, "remat")
    return OFFLOAD_COMPILER_OPTIONS if stack.offload_scan and stack.layers_per_checkpoint == 1 else None


def resolve_remat(use_gradient_checkpointing, layers_per_checkpoint: int = 1) -> LayerStackPolicy:
    """The LayerStackPolicy of get_peft_model's (and from_pretrained's) use_gradient_checkpointing: Unsloth's
    False / True / "unsloth", a remat mode name (unsloth_jax.models.layer_stack) or a LayerStackPolicy, parsed
    by LayerStackPolicy.parse, with the offload fallback (plain remat, one notice) where the backend has no
    pinned host memory.

    layers_per_checkpoint > 1 (long sequences, with True or "unsloth"): two-level checkpointing, only every
    layers_per_checkpoint-th layer input is kept across the stack (on the device for True, in pinned host
    memory for "unsloth") and the layers between are recomputed group by group in the backward pass
    ("full_every_K" / "offload_every_K", see unsloth_jax.models.layer_stack)."""
    argument = "use_gradient_checkpointing"
    policy = LayerStackPolicy.parse(use_gradient_checkpointing, argument=argument)
    if policy.offload is not Offload.NONE and not host_offload_supported():
        log.warning("unsloth_jax: host offload of checkpointed activations needs a GPU; using plain "
                    "per-layer rematerialisation on %s", jax.default_backend())
        policy = policy.without_host_offload()  # before K: "offload_attention" has no two-level form, "full" has
    return policy.with_layers_per_checkpoint(layers_per_checkpoint, f"{argument}={use_gradient_checkpointing!r}")


def aux_loss_enabled(model: CausalLM) -> bool:
    """Whether the training loss includes the MoE load-balancing loss (config.output_router_logits)."""
    return model.config.is_moe and model.config.output_router_logits


def loss_terms(model: CausalLM, batch: dict, *, remat: LayerStackPolicy = NO_REMAT,
               loss_chunk: int = 1024) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """(mean next-token loss over target tokens, number of target tokens, load-balancing loss or None) of
    `model` on one micro-batch [B, S]; the aux loss only when aux_loss_enabled(model). remat: the layer-stack
    policy (parsed where the user gave it)."""
    family = family_of(model)
    inputs = family.prepare_inputs(batch)
    ids, side = inputs.input_ids, inputs.side()
    aux = None
    if aux_loss_enabled(model):
        h, stats = model.hidden_states(ids, side, remat_mode=remat, router_stats=True)
        aux = load_balancing_loss(stats, model.config.num_experts)
    else:  # a vision-language batch's images go in at its image tokens (the family's ModelInputs fields)
        h = family.hidden_states(model, inputs, remat=remat)
    targets = batch["labels"][:, 1:].reshape(-1)
    h = h[:, :-1].reshape(-1, h.shape[-1])
    loss = ops.cross_entropy(h, model.head_weight(), targets, softcap=model.config.final_softcap, chunk=loss_chunk)
    return loss, jnp.sum(targets != -100), aux


def loss_and_count(model: CausalLM, batch: dict, *, remat: LayerStackPolicy | str = NO_REMAT,
                   loss_chunk: int = 1024) -> tuple[jax.Array, jax.Array]:
    """(mean next-token loss over target tokens, number of target tokens) of `model` on one micro-batch [B, S];
    plus router_aux_loss_coef * the load-balancing loss where aux_loss_enabled(model), as transformers adds it.
    A functional-core entry point: remat is what users type there (LayerStackPolicy.parse reads it)."""
    remat = LayerStackPolicy.parse(remat, argument="remat")
    loss, n, aux = loss_terms(model, batch, remat=remat, loss_chunk=loss_chunk)
    if aux is not None:
        loss = loss + model.config.router_aux_loss_coef * aux
    return loss, n


class StepLoss(NamedTuple):
    """What a trainer brings to `make_step`: its loss, in two parts around the accumulation scan.

    micro(trainable, frozen, ref_state, micro_batch, policy) -> (value, stats): one micro-batch's contribution
        to the summed loss (a float32 scalar) and a dict of scalars to sum over the micro-batches; `policy` is
        the step's LayerStackPolicy, ref_state the step's reference argument (None without one).
    finish(value_sum, stats_sums, batch) -> (metrics, grad_divisor): metrics with "loss" (the loss the update
        is guarded on) and the rest of the step's metrics; grad_divisor: a float32 scalar the summed gradient
        is divided by (the target tokens for a token-weighted mean, A for a mean over micro-batches) or None.
    prepare(batch) -> batch (optional): run first, e.g. to give every leaf the leading micro-batch axis A."""

    micro: Callable
    finish: Callable
    prepare: Callable | None = None


def accumulate(fn, trainable, batch, *, with_grad: bool):
    """Inside a jitted step: sum `fn(trainable, micro) -> (value, stats dict)` over the micro-batches of `batch`
    (every leaf [A, ...]) -> (value sum, stats sums, gradient sum w.r.t. trainable or None without with_grad).
    A > 1: a lax.scan, the gradients summed in float32 (the stats in their own dtypes); A = 1: the one
    micro-batch as it is, its gradients in each parameter's dtype (summing them into float32 zeros would be
    exact and only cost a float32 copy of every gradient)."""
    grad_fn = jax.value_and_grad(fn, has_aux=True)

    def one(micro):
        if with_grad:
            (value, stats), g = grad_fn(trainable, micro)
            return value, stats, g
        value, stats = fn(trainable, micro)
        return value, stats, None

    if jax.tree.leaves(batch)[0].shape[0] == 1:
        return one(jax.tree.map(lambda x: x[0], batch))

    def body(carry, micro):
        g_sum, v_sum, s_sum = carry
        value, stats, g = one(micro)
        if with_grad:
            g_sum = jax.tree.map(lambda t, x: t + x.astype(jnp.float32), g_sum, g)
        return (g_sum, v_sum + value, jax.tree.map(jnp.add, s_sum, stats)), None

    first = jax.tree.map(lambda a: a[0], batch)
    stats_shape = jax.eval_shape(lambda: fn(trainable, first)[1])
    init = (jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), trainable) if with_grad else None,
            jnp.zeros((), jnp.float32), jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), stats_shape))
    (g_sum, v_sum, s_sum), _ = jax.lax.scan(body, init, batch)
    return v_sum, s_sum, g_sum


def make_step(graphdef: nnx.GraphDef, optimizer, loss: StepLoss, *, remat, mesh=None, donate: bool = True,
              reference: bool = False, train: bool = True, family: Family = TEXT):
    """The one factory of the jitted steps (SFT, DPO, ORPO, GRPO): `loss` is what each trainer brings.

    train=True: step(trainable, frozen, opt_state, [ref_state,] batch) -> (trainable, opt_state, metrics): the
    micro-batches of `batch` (every leaf [A, ...]) accumulated by `accumulate`, `loss.finish`'s metrics, then
    one guarded optimizer update (`apply_gradients`: plus grad_norm and skipped). train=False (optimizer
    unused): evaluate(trainable, frozen, [ref_state,] batch) -> metrics, without gradients. ref_state is an
    argument only with reference=True.
    remat: the layer-stack policy, a LayerStackPolicy or what LayerStackPolicy.parse reads (parsed here, once;
    a ValueError naming `remat` for anything else); loss.micro gets it typed. donate: the step donates
    trainable and opt_state. The op policy in force at each call is a static argument (ops.policy_jit).
    mesh: a ("data", "fsdp") `jax.sharding.Mesh` (unsloth_jax.distributed.make_mesh): the step then has
    in/out shardings from `unsloth_jax.distributed`'s rules (batch rows, axis 1, split over both axes; large
    frozen weights, and a reference state, over fsdp; the rest replicated) and places its arguments there (a
    no-op for arguments already placed). `batch` is the global batch; `family` (the model's Family) says which
    axis of each batch field runs over the rows (Family.batch_row_axis: a vision-language batch's images are
    given whole to every device).
    """
    policy = LayerStackPolicy.parse(remat, argument="remat")
    unsharded = mesh is None or mesh.shape["fsdp"] == 1  # the fused update splits only leaves not sharded

    def forward(trainable, frozen, ref_state, batch, with_grad):
        if loss.prepare is not None:
            batch = loss.prepare(batch)
        fn = lambda params, micro: loss.micro(params, frozen, ref_state, micro, policy)  # noqa: E731
        value, stats, grads = accumulate(fn, trainable, batch, with_grad=with_grad)
        metrics, divisor = loss.finish(value, stats, batch)
        return metrics, divisor, grads

    def train_step(trainable, frozen, opt_state, ref_state, batch):
        metrics, divisor, grads = forward(trainable, frozen, ref_state, batch, True)
        new_params, new_opt, update_metrics = apply_gradients(optimizer, trainable, opt_state, grads,
                                                              metrics["loss"], grad_divisor=divisor,
                                                              in_chunks=unsharded)
        return new_params, new_opt, {**metrics, **update_metrics}

    def eval_step(trainable, frozen, ref_state, batch):
        return forward(trainable, frozen, ref_state, batch, False)[0]

    if train:
        fn = train_step if reference else (lambda t, f, o, batch: train_step(t, f, o, None, batch))
        kinds = ("trainable", "frozen", "trainable") + (("frozen",) if reference else ())
        donate_argnums = (0, 2) if donate else ()
        options = functools.partial(step_compiler_options, policy)
    else:
        fn = eval_step if reference else (lambda t, f, batch: eval_step(t, f, None, batch))
        kinds = ("trainable", "frozen") + (("frozen",) if reference else ())
        donate_argnums, options = (), None
    if mesh is None:
        return ops.policy_jit(fn, donate_argnums=donate_argnums, compiler_options=options)
    return jit_on_mesh(fn, mesh, kinds, train=train, donate_argnums=donate_argnums, compiler_options=options,
                       family=family)


def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, *, remat="full",
                    loss_chunk: int = 1024, donate: bool = True, mesh=None, family: Family = TEXT):
    """SFT's jitted `step(trainable, frozen, opt_state, batch) -> (trainable, opt_state, metrics)` (make_step
    with `sft_loss`).

    graphdef, trainable, frozen: the three parts of `nnx.split(model, <trainable filter>, ...)`; trainable and
    frozen are nnx.State pytrees, and gradients exist for `trainable` only. opt_state: optimizer.init(trainable).
    metrics: loss (f32, mean over target tokens of all micro-batches), grad_norm, tokens (target tokens),
    skipped (1 when the update was dropped for a non-finite loss or gradient), aux_loss (MoE with
    output_router_logits). The op policy in force at each call is a static argument (see unsloth_jax.ops.policy_jit).
    remat: how the layer stack saves, recomputes and offloads: a LayerStackPolicy (model.gradient_checkpointing,
    which get_peft_model sets), a name LayerStackPolicy.parse reads ("none", "full", "offload",
    "offload_attention", "save_attention", "full_every_K" / "offload_every_K", with settings after commas:
    "offload,layer_loop=unrolled"), or Unsloth's False / True / "unsloth"; parsed once by make_step, a
    ValueError naming `remat` for anything else. Unlike get_peft_model, an offload mode is kept on a backend
    without pinned host memory (its copies are no-ops on the CPU).
    Pass the state through `backend.commit_to_devices` before the first call: with remat="offload" the step returns
    committed arrays, and uncommitted first inputs would make the second call compile the step again.

    mesh: a ("data", "fsdp") `jax.sharding.Mesh` (unsloth_jax.distributed.make_mesh) to run on several
    devices (make_step): a no-op placement for arguments already placed, e.g. by `distributed.shard_state`;
    family: the model's Family (families.family_of(model)), for a vision-language batch on a mesh.
    """
    return make_step(graphdef, optimizer, sft_loss(graphdef, loss_chunk), remat=remat, mesh=mesh, donate=donate,
                     family=family)


def sft_loss(graphdef: nnx.GraphDef, loss_chunk: int = 1024) -> StepLoss:
    """The next-token loss, token-weighted over the micro-batches: each micro-batch adds its mean loss times its
    target tokens (plus router_aux_loss_coef x the load-balancing loss where aux_loss_enabled), and the sum is
    divided by all target tokens, so the accumulated loss equals one big batch's."""

    def micro(trainable, frozen, _ref_state, batch, policy):
        model = nnx.merge(graphdef, trainable, frozen)
        loss, n, aux = loss_terms(model, batch, remat=policy, loss_chunk=loss_chunk)
        stats = {"tokens": n}
        if aux is not None:
            loss = loss + model.config.router_aux_loss_coef * aux
            stats["aux_loss"] = aux * n
        return loss * n, stats

    def finish(value, stats, _batch):
        denom = jnp.maximum(stats["tokens"], 1).astype(jnp.float32)
        metrics = {"loss": value / denom, "tokens": stats["tokens"]}
        if "aux_loss" in stats:
            metrics["aux_loss"] = stats["aux_loss"] / denom
        return metrics, denom

    return StepLoss(micro, finish)


def jit_on_mesh(step, mesh, kinds: tuple[str, ...], *, train: bool, donate_argnums=(), compiler_options=None,
                family: Family = TEXT):
    """`step` jitted with in/out shardings by unsloth_jax.distributed's rules (built once per structure of
    the arguments), traced and run under the mesh (jax.set_mesh): the decoder's per-layer weight gather and
    the kernels' per-shard calls read it there. kinds: per state argument (all but the last, the batch),
    "trainable" (trainable params and their optimizer state) or "frozen"; train: the step returns
    (trainable, opt_state, metrics), else metrics; family: the batch fields' row axes (Family.batch_row_axis)."""
    from unsloth_jax import distributed

    built: dict = {}

    def shardings(*args):
        states = tuple(distributed.state_shardings(mesh, a, trainable=kind == "trainable")
                       for kind, a in zip(kinds, args[:-1]))
        def field(path, x):
            axis = family.batch_row_axis(path[0].key, np.ndim(x))
            return distributed.replicated(mesh) if axis is None else distributed.batch_sharding(mesh, np.ndim(x), axis)

        batch = jax.tree_util.tree_map_with_path(field, args[-1])
        outs = (states[0], states[2], distributed.replicated(mesh)) if train else distributed.replicated(mesh)
        return states + (batch,), outs

    def jitted_for(args):
        key = (jax.tree.structure(args), tuple(np.shape(x) for x in jax.tree.leaves(args[:-1])),
               tuple(np.ndim(x) for x in jax.tree.leaves(args[-1])))
        if key not in built:
            ins, outs = shardings(*args)
            built[key] = (ops.policy_jit(step, donate_argnums=donate_argnums, in_shardings=ins,
                                         out_shardings=outs, compiler_options=compiler_options), ins)
        return built[key]

    def placed(args):
        fn, ins = jitted_for(args)
        return fn, distributed.put(args, ins)

    def call(*args):
        fn, args = placed(args)
        with jax.set_mesh(mesh):
            return fn(*args)

    def lower(*args):
        fn, args = placed(args)
        with jax.set_mesh(mesh):
            return fn.lower(*args)

    call.lower = lower
    call.mesh = mesh
    return call


def apply_gradients(optimizer: optax.GradientTransformation | FusedAdamW, trainable, opt_state, grads, loss, *,
                    grad_divisor=None, in_chunks: bool = True):
    """One guarded optimizer update inside a jitted step -> (new trainable, new opt_state, metrics).

    grads: gradients shaped like `trainable`, float32 or in the params' dtypes; with `grad_divisor` (a float32
    scalar, e.g. the token count) the gradient is grads / grad_divisor computed in float32. Either way it is
    cast to each parameter's dtype before the update. When `loss` or the gradients' global norm is not finite,
    params and optimizer state stay as they were. metrics: grad_norm (of the unclipped gradients) and skipped
    (1 when the update was dropped). A FusedAdamW (make_optimizer's AdamW) is applied by its `apply`, piece
    by piece and in place when `in_chunks` (off where leaves are sharded over devices); any other optax
    transformation by update + optax.apply_updates. Every trainer's step ends here.
    """
    cast = lambda g, p: scale_gradient(g, grad_divisor).astype(p.dtype)  # noqa: E731
    grad_norm = global_norm(jax.tree.map(cast, grads, trainable))
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    metrics = {"grad_norm": grad_norm, "skipped": (~finite).astype(jnp.int32)}
    if isinstance(optimizer, FusedAdamW):
        new_params, new_opt = optimizer.apply(grads, opt_state, trainable, grad_norm=grad_norm, finite=finite,
                                              grad_divisor=grad_divisor, in_chunks=in_chunks)
        return new_params, new_opt, metrics
    grads = jax.tree.map(lambda g, p: jnp.where(finite, cast(g, p), 0.0), grads, trainable)
    updates, new_opt = optimizer.update(grads, opt_state, trainable)
    new_params = optax.apply_updates(trainable, updates)
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    new_params = jax.tree.map(keep, new_params, trainable)
    new_opt = jax.tree.map(keep, new_opt, opt_state)
    return new_params, new_opt, metrics


def _eval_loss(trainable, frozen, batch, *, graphdef, loss_chunk):
    def one(carry, micro):
        model = nnx.merge(graphdef, trainable, frozen)
        loss, n = loss_and_count(model, micro, remat=NO_REMAT, loss_chunk=loss_chunk)
        return (carry[0] + loss * n, carry[1] + n), None

    (total, n), _ = jax.lax.scan(one, (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)), batch)
    return total, n


_eval_loss_jit = ops.policy_jit(_eval_loss, static_argnames=("graphdef", "loss_chunk"))


def eval_loss(trainable, frozen, batch, *, graphdef: nnx.GraphDef, loss_chunk: int = 1024):
    """(sum of token losses, token count) over a batch [A, B, S] without gradients."""
    return _eval_loss_jit(trainable, frozen, batch, graphdef=graphdef, loss_chunk=loss_chunk)
