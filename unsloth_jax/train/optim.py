"""Optimizers and learning-rate schedules with the names HF/TRL users pass (`optim`, `lr_scheduler_type`).

Schedules follow transformers' definitions exactly (the rate used for update number t, counting from 0), so a
run here and an HF Trainer run see the same learning rates. AdamW keeps its moments in float32 whatever the
weights' dtype (bf16 weights in full fine-tuning get float32 moments); `adamw_8bit` keeps both moments in 8
bits, block-wise (see `scale_by_adam_8bit`). `embedding_schedule` gives the embedding table and the output head
their own learning rate (Unsloth's embedding_learning_rate), through optax.multi_transform on the last step.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

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
    """Block-wise 8-bit with square-root companding: x ~ scale * sign(c) * (|c| / 127)^2 (m) or
    scale * (c / 255)^2 (v). Companding keeps relative precision for small entries, which Adam's second moment
    needs; the scale is each block's absmax."""
    flat = x.reshape(-1).astype(jnp.float32)
    pad = -flat.size % _BLOCK
    blocks = jnp.pad(flat, (0, pad)).reshape(-1, _BLOCK)
    scale = jnp.max(jnp.abs(blocks), axis=1)
    unit = jnp.sqrt(jnp.abs(blocks) / jnp.where(scale > 0, scale, 1.0)[:, None])
    if signed:
        codes = jnp.round(jnp.sign(blocks) * unit * 127).astype(jnp.int8)
    else:
        codes = jnp.round(unit * 255).astype(jnp.uint8)
    return _Q8(codes, scale)


def _dequantize(q: _Q8, like: jax.Array, signed: bool) -> jax.Array:
    c = q.codes.astype(jnp.float32) / (127.0 if signed else 255.0)
    vals = jnp.sign(c) * c * c * q.scale[:, None]
    return vals.reshape(-1)[: like.size].reshape(like.shape)


class Adam8bitState(NamedTuple):
    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates


def scale_by_adam_8bit(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> optax.GradientTransformation:
    """Adam's update direction with both moments stored block-wise in 8 bits (a quarter of fp32 Adam's state)."""

    def init(params):
        mu = jax.tree.map(lambda p: _quantize(jnp.zeros(p.shape, jnp.float32), True), params)
        nu = jax.tree.map(lambda p: _quantize(jnp.zeros(p.shape, jnp.float32), False), params)
        return Adam8bitState(jnp.zeros((), jnp.int32), mu, nu)

    def update(updates, state, params=None):
        del params
        count = state.count + 1
        is_q = lambda x: isinstance(x, _Q8)  # noqa: E731
        mu = jax.tree.map(lambda g, q: b1 * _dequantize(q, g, True) + (1 - b1) * g.astype(jnp.float32),
                          updates, state.mu, is_leaf=is_q)
        nu = jax.tree.map(lambda g, q: b2 * _dequantize(q, g, False) + (1 - b2) * jnp.square(g.astype(jnp.float32)),
                          updates, state.nu, is_leaf=is_q)
        c1 = 1 - b1 ** count.astype(jnp.float32)
        c2 = 1 - b2 ** count.astype(jnp.float32)
        direction = jax.tree.map(lambda m, v, g: ((m / c1) / (jnp.sqrt(v / c2) + eps)).astype(g.dtype), mu, nu, updates)
        new_state = Adam8bitState(count, jax.tree.map(lambda m: _quantize(m, True), mu),
                                  jax.tree.map(lambda v: _quantize(v, False), nu))
        return direction, new_state

    return optax.GradientTransformation(init, update)


def in_float32(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` run on float32 copies of the updates and params: its state (Adam's moments) is float32 even for
    bf16/fp16 weights, and its updates come out float32 (optax.apply_updates casts the sum to the weight's
    dtype)."""

    def f32(tree):
        return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def init(params):
        return tx.init(f32(params))

    def update(updates, state, params=None):
        return tx.update(f32(updates), state, None if params is None else f32(params))

    return optax.GradientTransformation(init, update)


def state_dtype(optim: str) -> str:
    """What the optimizer state of `optim` is stored in, for run summaries."""
    if optim == "sgd":
        return "none (SGD keeps no state)"
    if optim in ("adamw_8bit", "paged_adamw_8bit"):
        return "8-bit (int8/uint8 blocks of 256 + float32 scales)"
    return "float32"


EMBEDDING_MODULES = ("embed_tokens", "lm_head")


def embedding_labels(params) -> object:
    """A pytree like `params` labelling each leaf "embedding" (under embed_tokens or lm_head) or "default"."""

    def label(path, _):
        names = {getattr(k, "key", getattr(k, "name", None)) for k in path}
        return "embedding" if names & set(EMBEDDING_MODULES) else "default"

    return jax.tree_util.tree_map_with_path(label, params)


def _learning_rate(schedule: optax.Schedule, embedding_schedule: optax.Schedule | None):
    """The last step of the chain: -lr(t) * update, with the embedding leaves on their own schedule."""
    if embedding_schedule is None:
        return optax.scale_by_learning_rate(schedule)
    return optax.multi_transform({"default": optax.scale_by_learning_rate(schedule),
                                  "embedding": optax.scale_by_learning_rate(embedding_schedule)}, embedding_labels)


def make_optimizer(optim: str, schedule: optax.Schedule, *, weight_decay: float = 0.0, max_grad_norm: float = 1.0,
                   adam_beta1: float = 0.9, adam_beta2: float = 0.999, adam_epsilon: float = 1e-8,
                   embedding_schedule: optax.Schedule | None = None) -> optax.GradientTransformation:
    """The optax chain for an HF `optim` name: clip by global norm (when max_grad_norm > 0), then the optimizer
    (AdamW: torch.optim.AdamW's math, moments in float32). With `embedding_schedule`, the embedding and head
    leaves (embedding_labels) step with it instead of `schedule`; weight decay and clipping are shared, as in
    Unsloth's two torch param groups."""
    if optim not in OPTIMIZERS:
        raise ValueError(f"optim {optim!r} is not supported; use one of {', '.join(OPTIMIZERS)}")
    parts = []
    if max_grad_norm and max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(max_grad_norm))
    lr = _learning_rate(schedule, embedding_schedule)
    if optim == "sgd":
        parts += [optax.add_decayed_weights(weight_decay) if weight_decay else optax.identity(), lr]
    elif optim in ("adamw_8bit", "paged_adamw_8bit"):
        parts += [in_float32(scale_by_adam_8bit(adam_beta1, adam_beta2, adam_epsilon)),
                  optax.add_decayed_weights(weight_decay) if weight_decay else optax.identity(), lr]
    else:  # optax.adamw's own chain, with float32 moments
        parts.append(optax.chain(in_float32(optax.scale_by_adam(adam_beta1, adam_beta2, adam_epsilon)),
                                 optax.add_decayed_weights(weight_decay), lr))
    return optax.chain(*parts)
