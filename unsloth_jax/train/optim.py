"""Optimizers and learning-rate schedules with the names HF/TRL users pass (`optim`, `lr_scheduler_type`).

Schedules follow transformers' definitions exactly (the rate used for update number t, counting from 0), so a
run here and an HF Trainer run see the same learning rates. AdamW (`adamw`, a FusedAdamW) keeps its moments in
float32 whatever the weights' dtype (bf16 weights in full fine-tuning get float32 moments); `adamw_8bit` keeps
both in 8 bits, block-wise (`_quantize`). The train step applies AdamW with `FusedAdamW.apply`: leaf by leaf and,
for big leaves, piece by piece along the layer axis, in place, so its float32 temporaries are those of one piece
(the plain optax `update` is there too). `embedding_schedule` gives the embedding table and the output head
their own learning rate (Unsloth's embedding_learning_rate).
"""
from __future__ import annotations

import math
import re
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from unsloth_jax.backend import key_names

# optax >= 0.2.5 spells the global norm optax.tree.norm and deprecates global_norm
global_norm = optax.tree.norm if hasattr(getattr(optax, "tree", None), "norm") else optax.global_norm

OPTIMIZERS = ("adamw_torch", "adamw", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit", "sgd")
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")


def warmup_steps_for(total_steps: int, warmup_steps: int = 0, warmup_ratio: float = 0.0) -> int:
    """HF's rule: warmup_steps wins when positive, else ceil(warmup_ratio * total_steps)."""
    return warmup_steps if warmup_steps > 0 else int(math.ceil(warmup_ratio * total_steps))


def make_schedule(name: str, learning_rate: float, total_steps: int, warmup: int) -> optax.Schedule:
    """lr(t) for update t = 0, 1, ... as transformers' get_scheduler computes it."""
    if name not in SCHEDULERS:
        raise ValueError(f"lr_scheduler_type {name!r} is not supported; use one of {', '.join(SCHEDULERS)}")
    total = max(int(total_steps), 1)

    def schedule(count):
        t = jnp.asarray(count, jnp.float32)
        warm = t / max(1.0, float(warmup))
        if name == "constant":
            factor = jnp.ones_like(t)
        elif name == "constant_with_warmup":
            factor = jnp.where(t < warmup, warm, 1.0)
        elif name == "linear":
            factor = jnp.where(t < warmup, warm, jnp.maximum(0.0, (total - t) / max(1.0, float(total - warmup))))
        else:  # cosine, half a period
            progress = (t - warmup) / max(1.0, float(total - warmup))
            factor = jnp.where(t < warmup, warm, jnp.maximum(0.0, 0.5 * (1.0 + jnp.cos(jnp.pi * progress))))
        return learning_rate * factor

    return schedule


# ------------------------------------------------------------------------------------------ 8-bit Adam
_BLOCK = 256


class _Q8(NamedTuple):
    codes: jax.Array  # int8 [n_blocks, 256] (m) or uint8 (v)
    scale: jax.Array  # float32 [n_blocks]


def _quantize(x: jax.Array, signed: bool) -> _Q8:
    """Block-wise 8-bit with companding: x ~ scale * sign(c) * (|c| / 127)^2 (m, square root) or
    scale * (c / 255)^4 (v, fourth root, so sqrt(v) is kept like m: a v entry rounds to 0 only where |m| does
    too, never leaving a step m / eps). Companding keeps relative precision for small entries, which Adam's
    second moment needs; the scale is each block's absmax."""
    flat = x.reshape(-1).astype(jnp.float32)
    pad = -flat.size % _BLOCK
    blocks = jnp.pad(flat, (0, pad)).reshape(-1, _BLOCK)
    scale = jnp.max(jnp.abs(blocks), axis=1)
    unit = jnp.sqrt(jnp.abs(blocks) / jnp.where(scale > 0, scale, 1.0)[:, None])
    if signed:
        codes = jnp.round(jnp.sign(blocks) * unit * 127).astype(jnp.int8)
    else:
        codes = jnp.round(jnp.sqrt(unit) * 255).astype(jnp.uint8)
    return _Q8(codes, scale)


def _dequantize(q: _Q8, like: jax.Array, signed: bool) -> jax.Array:
    c = q.codes.astype(jnp.float32) / (127.0 if signed else 255.0)
    vals = (jnp.sign(c) * c * c if signed else jnp.square(c * c)) * q.scale[:, None]
    return vals.reshape(-1)[: like.size].reshape(like.shape)


class Adam8bitState(NamedTuple):
    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates


def _zero_codes(p, signed: bool) -> _Q8:
    """_quantize(zeros like p), built directly (no float32 array of p's size is made)."""
    n_blocks = -(-math.prod(p.shape) // _BLOCK)
    return _Q8(jnp.zeros((n_blocks, _BLOCK), jnp.int8 if signed else jnp.uint8), jnp.zeros((n_blocks,), jnp.float32))


def _zero_moments(params, eight_bit: bool):
    """(mu, nu) of a fresh Adam state: float32 zeros like each leaf, or 8-bit zero codes (`_zero_codes`)."""
    if eight_bit:
        return (jax.tree.map(lambda p: _zero_codes(p, True), params),
                jax.tree.map(lambda p: _zero_codes(p, False), params))
    zeros = lambda p: jnp.zeros(p.shape, jnp.float32)  # noqa: E731
    return jax.tree.map(zeros, params), jax.tree.map(zeros, params)


def _unzip3(params, outs):
    """A tree like `params` whose leaves are 3-tuples -> three trees like `params`."""
    treedef = jax.tree.structure(params)
    leaves = treedef.flatten_up_to(outs)
    return tuple(treedef.unflatten([o[i] for o in leaves]) for i in range(3))


def scale_by_adam_8bit(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> optax.GradientTransformation:
    """Adam's update direction with both moments stored block-wise in 8 bits (a quarter of fp32 Adam's state),
    as an optax transformation for custom chains (make_optimizer's "adamw_8bit" is `adamw` with eight_bit)."""

    def init(params):
        return Adam8bitState(jnp.zeros((), jnp.int32), *_zero_moments(params, True))

    def update(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        is_q = lambda x: isinstance(x, _Q8)  # noqa: E731
        mu = jax.tree.map(lambda g, q: _moment(g.astype(jnp.float32), _dequantize(q, g, True), b1, 1),
                          updates, state.mu, is_leaf=is_q)
        nu = jax.tree.map(lambda g, q: _moment(g.astype(jnp.float32), _dequantize(q, g, False), b2, 2),
                          updates, state.nu, is_leaf=is_q)
        c1, c2 = _bias_corrections(b1, b2, count)
        direction = jax.tree.map(lambda m, v, g: _direction(m, v, c1, c2, eps).astype(g.dtype), mu, nu, updates)
        new_state = Adam8bitState(count, jax.tree.map(lambda m: _quantize(m, True), mu),
                                  jax.tree.map(lambda v: _quantize(v, False), nu))
        return direction, new_state

    return optax.GradientTransformation(init, update)


# ------------------------------------------------------------------------------ AdamW, fused per chunk
def _moment(g: jax.Array, prev: jax.Array, decay: float, order: int) -> jax.Array:
    """Adam's moment update in float32: (1 - decay) * g**order + decay * prev (optax's formula)."""
    return (1 - decay) * (g ** order) + decay * prev


def _bias_corrections(b1: float, b2: float, count: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(1 - b1**t, 1 - b2**t) in float32 for update number t = count (counting from 1)."""
    return (1 - b1 ** count).astype(jnp.float32), (1 - b2 ** count).astype(jnp.float32)


def _direction(m, v, c1, c2, eps: float) -> jax.Array:
    """Adam's step direction m_hat / (sqrt(v_hat) + eps) from the bias-corrected moments."""
    return (m / c1) / (jnp.sqrt(v / c2) + eps)


def scale_gradient(g: jax.Array, divisor: jax.Array | None) -> jax.Array:
    """g / divisor in float32 (g unchanged without a divisor): a summed gradient made a mean."""
    return g if divisor is None else g.astype(jnp.float32) / divisor


CHUNK_ELEMENTS = 1 << 26  # elements of a leaf the fused update holds at once (256 MiB per float32 temporary)
_SELECT_ELEMENTS = 1 << 22  # leaves up to this size are guarded by a select, not a cond (see _in_pieces)
_MAX_CHUNKS = 4096        # more pieces than this: the leaf is updated whole (a leading axis with no fitting divisor)


def chunk_count(shape: tuple[int, ...], limit: int = CHUNK_ELEMENTS) -> int:
    """How many equal pieces along its leading axis (the layer axis of a stacked leaf, the rows of an
    embedding) the fused update splits a leaf of `shape` into: the fewest whose pieces hold at most `limit`
    elements, else one row each, each piece a whole number of 8-bit blocks (256 elements); 1 (the whole leaf)
    when the leaf holds at most `limit` elements or no split qualifies."""
    n = math.prod(shape)
    if n <= limit or len(shape) == 0:
        return 1
    rows, row = shape[0], n // shape[0]
    fits = [k for k in range(2, rows + 1) if rows % k == 0 and (rows // k) * row % _BLOCK == 0]
    small = [k for k in fits if (rows // k) * row <= limit]
    k = min(small) if small else max(fits, default=1)
    return k if k <= _MAX_CHUNKS else 1


class AdamWState(NamedTuple):
    count: jax.Array    # int32 []: updates applied so far
    mu: optax.Updates   # per parameter leaf: float32 array of its shape, or _Q8 (8-bit)
    nu: optax.Updates


class FusedAdamW(NamedTuple):
    """AdamW (clip by global norm, Adam, decoupled weight decay, -lr(t)) as one transformation.

    init(params) -> AdamWState (zeros, built without float32 copies of the params).
    update(grads, state, params) -> (float32 updates, state): the optax interface (add with
        optax.apply_updates).
    apply(grads, state, params, grad_norm=, finite=, grad_divisor=None, in_chunks=True) -> (new params, new
        state): the same update added to the params and cast to their dtype, leaf by leaf and, for leaves of
        more than chunk_elements, piece by piece along the leading (layer) axis (`chunk_count`; a
        lax.fori_loop writing each piece back in place), so the float32 temporaries (dequantized moments,
        direction) of one piece are live at a time.
        grads: any float dtype; the gradient is scale_gradient(grads, grad_divisor) cast to each param's dtype
        (as apply_gradients computes it); grad_norm: its global norm (the clipping norm); where `finite` is
        false params and state stay as they were.
    """
    init: Callable
    update: Callable
    apply: Callable


def adamw(schedule: optax.Schedule, *, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 0.0, max_grad_norm: float = 0.0, eight_bit: bool = False,
          embedding_schedule: optax.Schedule | None = None, chunk_elements: int = CHUNK_ELEMENTS,
          weight_decay_mask: Callable | None = None) -> FusedAdamW:
    """torch.optim.AdamW's update (optax.chain(clip_by_global_norm, scale_by_adam with float32 moments,
    add_decayed_weights, scale_by_learning_rate) computed element by element the same way), with moments in
    float32 or, with eight_bit, block-wise 8-bit (`_quantize`). embedding_schedule: the rate of the leaves
    under embed_tokens / lm_head (embedding_labels) instead of `schedule`. weight_decay_mask: params -> a pytree
    of bools, the leaves weight decay applies to (decay_mask); None: every leaf."""
    if chunk_elements < _BLOCK:
        raise ValueError(f"chunk_elements must be at least {_BLOCK}, got {chunk_elements}")

    def init(params):
        return AdamWState(jnp.zeros((), jnp.int32), *_zero_moments(params, eight_bit))

    def rates(params, count):
        """-lr(count) per leaf (float32 scalars)."""
        lr = -schedule(count)
        if embedding_schedule is None:
            return jax.tree.map(lambda _: lr, params)
        lr_embedding = -embedding_schedule(count)
        return jax.tree.map(lambda label: lr_embedding if label == "embedding" else lr, embedding_labels(params))

    def decays(params):
        """Per leaf, its weight decay (a Python float: weight_decay, or 0.0 where the mask excludes it)."""
        if weight_decay_mask is None:
            return jax.tree.map(lambda _: float(weight_decay), params)
        return jax.tree.map(lambda keep: float(weight_decay) if keep else 0.0, weight_decay_mask(params))

    def leaf_update(g, p, m_prev, v_prev, grad_norm, c1, c2, rate, decay):
        """(float32 update of p, new m, new v) for one leaf or one piece of it; m_prev, v_prev float32."""
        if max_grad_norm and max_grad_norm > 0:
            g = jax.lax.select(grad_norm < max_grad_norm, g, (g / grad_norm.astype(g.dtype)) * max_grad_norm)
        g = g.astype(jnp.float32)
        m, v = _moment(g, m_prev, b1, 1), _moment(g, v_prev, b2, 2)
        u = _direction(m, v, c1, c2, eps)
        if decay:
            u = u + decay * p
        return jnp.asarray(rate, jnp.float32) * u, m, v

    def load(q, like, signed):
        return _dequantize(q, like, signed) if eight_bit else q.reshape(like.shape)

    def store(x, signed):
        return _quantize(x, signed) if eight_bit else x

    is_q = lambda x: isinstance(x, _Q8)  # noqa: E731

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("adamw's update needs params (weight decay reads them)")
        count = optax.safe_increment(state.count)
        c1, c2 = _bias_corrections(b1, b2, count)
        grad_norm = global_norm(updates)
        outs = jax.tree.map(lambda g, p, mq, vq, r, d: leaf_update(g, p, load(mq, g, True), load(vq, g, False),
                                                                   grad_norm, c1, c2, r, d),
                            updates, params, state.mu, state.nu, rates(params, state.count), decays(params),
                            is_leaf=is_q)
        u, m, v = _unzip3(params, outs)
        return u, AdamWState(count, jax.tree.map(lambda x: store(x, True), m),
                             jax.tree.map(lambda x: store(x, False), v))

    def apply(grads, state, params, *, grad_norm, finite, grad_divisor=None, in_chunks: bool = True):
        count = optax.safe_increment(state.count)
        c1, c2 = _bias_corrections(b1, b2, count)

        def one_leaf(g, p, mq, vq, rate, decay):
            def piece(g, p, mq, vq, rate):
                g = scale_gradient(g, grad_divisor).astype(p.dtype)  # the gradient apply_gradients would pass
                u, m, v = leaf_update(g, p, load(mq, p, True), load(vq, p, False), grad_norm, c1, c2, rate, decay)
                return (p + u).astype(p.dtype), store(m, True), store(v, False)

            k = chunk_count(p.shape, chunk_elements) if in_chunks else 1
            return _in_pieces(piece, k, finite, g, p, mq, vq, rate)

        outs = jax.tree.map(one_leaf, grads, params, state.mu, state.nu, rates(params, state.count), decays(params),
                            is_leaf=is_q)
        new_p, mu, nu = _unzip3(params, outs)
        return new_p, AdamWState(jnp.where(finite, count, state.count), mu, nu)

    return FusedAdamW(init, update, apply)


def _in_pieces(piece, k: int, finite, g, p, mq, vq, rate):
    """`piece(g, p, mq, vq, rate) -> (p, mq, vq)` where `finite` (else the old values), over k equal pieces of
    one leaf along its leading axis -> (new p, new mq, new vq). g, p: the leaf's arrays; mq, vq: its moments,
    float32 like p, or _Q8 whose rows are 256-element blocks (chunk_count splits at block boundaries, so piece
    i is the i-th k-th of every array's rows). k > 1: a lax.fori_loop that reads piece i and writes its
    results back into the carried arrays (dynamic_update_slice, in place).

    The guard is a lax.cond, not a select: a cond's results are buffers computed from the old values before
    anything is written. With the elementwise math fused into each write instead, XLA reads old moments again
    after another array's write (the param's update recomputes m and v) and copies whole arrays to keep them.
    """
    def guarded(g_i, old):
        return jax.lax.cond(finite, lambda g_i, old: piece(g_i, *old, rate), lambda g_i, old: old, g_i, old)

    if k == 1 and p.size <= _SELECT_ELEMENTS:
        # a small leaf (LoRA factors, norms): a select, whose extra copies are small, instead of a cond (an XLA
        # GPU conditional may read its predicate on the host, once per leaf per step)
        new = piece(g, p, mq, vq, rate)
        return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, (p, mq, vq))
    if k == 1:
        return guarded(g, (p, mq, vq))
    rows = lambda x: x.shape[0] // k  # noqa: E731

    def body(i, carry):
        at = lambda x: jax.lax.dynamic_slice_in_dim(x, i * rows(x), rows(x))  # noqa: E731
        new = guarded(at(g), jax.tree.map(at, carry))
        return jax.tree.map(lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, y, i * rows(x), 0), carry, new)

    return jax.lax.fori_loop(0, k, body, (p, mq, vq))


def state_dtype(optim: str) -> str:
    """What the optimizer state of `optim` is stored in, for run summaries."""
    if optim == "sgd":
        return "none (SGD keeps no state)"
    if optim in ("adamw_8bit", "paged_adamw_8bit"):
        return "8-bit (int8/uint8 blocks of 256 + float32 scales)"
    return "float32"


EMBEDDING_MODULES = ("embed_tokens", "lm_head")
# transformers' Trainer.get_decay_parameter_names: no weight decay for parameters whose lower-cased name matches one
# of these (biases and norms), nor for those of LayerNorm modules
NO_DECAY_NAME_PATTERNS = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")


def decay_mask(layer_norm_paths=()) -> Callable:
    """params -> a pytree of bools like params: True on the leaves weight decay applies to, as transformers' Trainer
    (and so TRL and Unsloth) groups them: not biases, not norm weights (NO_DECAY_NAME_PATTERNS on the leaf's
    dotted path, lower-cased) and not the parameters of the modules at `layer_norm_paths` (tuples of names: the
    model's LayerNorm modules, which transformers excludes by type whatever their name, e.g. Qwen3-VL's norm1)."""
    patterns = [re.compile(p) for p in NO_DECAY_NAME_PATTERNS]
    prefixes = tuple(tuple(str(n) for n in p) for p in layer_norm_paths)

    def decays(path, _) -> bool:
        names = key_names(path)
        dotted = ".".join(names).lower()
        if any(p.search(dotted) for p in patterns):
            return False
        return not any(names[:len(pre)] == pre for pre in prefixes)

    return lambda params: jax.tree_util.tree_map_with_path(decays, params)


def embedding_labels(params) -> object:
    """A pytree like `params` labelling each leaf "embedding" (under embed_tokens or lm_head) or "default"."""

    def label(path, _):
        return "embedding" if set(key_names(path)) & set(EMBEDDING_MODULES) else "default"

    return jax.tree_util.tree_map_with_path(label, params)


def _learning_rate(schedule: optax.Schedule, embedding_schedule: optax.Schedule | None):
    """The last step of the chain: -lr(t) * update, with the embedding leaves on their own schedule."""
    if embedding_schedule is None:
        return optax.scale_by_learning_rate(schedule)
    return optax.multi_transform({"default": optax.scale_by_learning_rate(schedule),
                                  "embedding": optax.scale_by_learning_rate(embedding_schedule)}, embedding_labels)


def make_optimizer(optim: str, schedule: optax.Schedule, *, weight_decay: float = 0.0, max_grad_norm: float = 1.0,
                   adam_beta1: float = 0.9, adam_beta2: float = 0.999, adam_epsilon: float = 1e-8,
                   embedding_schedule: optax.Schedule | None = None, chunk_elements: int = CHUNK_ELEMENTS,
                   weight_decay_mask: Callable | None = None) -> optax.GradientTransformation | FusedAdamW:
    """The optimizer for an HF `optim` name: AdamW variants are `adamw` (clip by global norm when
    max_grad_norm > 0, torch.optim.AdamW's math with float32 moments, or 8-bit ones for adamw_8bit; applied in
    pieces of at most `chunk_elements` by the train step); "sgd" is an optax chain (clip, weight decay, -lr).
    With `embedding_schedule`, the embedding and head leaves (embedding_labels) step with it instead of
    `schedule`; weight decay and clipping are shared, as in Unsloth's two torch param groups.
    weight_decay_mask (decay_mask(...)): the leaves weight decay applies to, as the trainers pass it (transformers'
    grouping: no decay on biases and norms); None: every leaf, as one torch.optim.AdamW param group."""
    if optim not in OPTIMIZERS:
        raise ValueError(f"optim {optim!r} is not supported; use one of {', '.join(OPTIMIZERS)}")
    if optim != "sgd":
        return adamw(schedule, b1=adam_beta1, b2=adam_beta2, eps=adam_epsilon, weight_decay=weight_decay,
                     max_grad_norm=max_grad_norm, eight_bit=optim in ("adamw_8bit", "paged_adamw_8bit"),
                     embedding_schedule=embedding_schedule, chunk_elements=chunk_elements,
                     weight_decay_mask=weight_decay_mask)
    parts = []
    if max_grad_norm and max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(max_grad_norm))
    parts += [optax.add_decayed_weights(weight_decay, mask=weight_decay_mask) if weight_decay else optax.identity(),
              _learning_rate(schedule, embedding_schedule)]
    return optax.chain(*parts)
