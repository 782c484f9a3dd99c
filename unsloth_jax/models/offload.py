"""The "offload" remat mode's layer scan (Unsloth's use_gradient_checkpointing="unsloth"): each layer's input
kept in pinned host memory for the backward pass, with the copies back to the device fetched one layer ahead.

    h = offloaded_layer_scan(body, h, layers, side)     # what lax.scan over jax.checkpoint(body) computes

It has the values and gradients of a `lax.scan` over per-layer-rematerialised `body` whose inputs jax's
offload policy sends to the host, but a hand-written VJP orders the copies so that none waits on its layer:
- forward: iteration i runs layer i and stores the input of layer i-1 (carried from iteration i-1) in host
  memory as its scan output, so that copy has a whole layer to run beside; the last layer's input stays on
  the device.
- backward: iteration i (in reverse) recomputes layer i from its input, carried from iteration i+1, runs its
  backward, and meanwhile copies the input of layer i-1 back to the device for the next iteration.
Every host read and write is a scan's own per-iteration slice, the pattern XLA turns into async memcpys.

With XLA's default command buffers (CUDA graphs) those memcpys run on the compute stream, in line with it; with
command buffers for fusions, cuBLAS/cuBLASLt, cuDNN and custom calls only (OFFLOAD_COMPILER_OPTIONS, which the
train steps pass for this mode on the GPU) they run on their own streams. Which of the default kinds causes it
was not isolated (leaving out while loops alone did not help). Both are measured in
bench/offload_prefetch_probe.py.

Gradients are taken only for the `layers` leaves that carry a tangent (the trainable ones, via custom_vjp's
symbolic zeros); frozen weights get none and cost no dW. `side` (RoPE tables, masks, positions) must not be
differentiated.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

# XLA debug options for a step that offloads: command buffers for these thunk kinds only (under XLA's default
# kinds the host copies run on the compute stream).
OFFLOAD_COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL"}


def _to_host(x: jax.Array) -> jax.Array:
    return jax.device_put(x, jax.memory.Space.Host)


def _to_device(x: jax.Array) -> jax.Array:
    return jax.device_put(x, jax.memory.Space.Device)


def offloaded_layer_scan(body, h: jax.Array, layers, side, *, unroll: bool = False) -> jax.Array:
    """lax.scan of `body` over the leading axis of `layers`, for training with host-offloaded layer inputs.

    body(h [B, S, D], layer, side) -> [B, S, D]: one step (a layer or a group of layers); `layer` is `layers`
    with its leading axis (n) indexed away. layers: a pytree of arrays [n, ...] (a layer stack's weights);
    side: a pytree of arrays every step reads. Returns the last step's output, [B, S, D] in h's dtype."""
    layer_leaves, layer_tree = jax.tree.flatten(layers)
    side_leaves, side_tree = jax.tree.flatten(side)

    def step(h, layer_leaves_i, side_leaves):
        return body(h, jax.tree.unflatten(layer_tree, layer_leaves_i), jax.tree.unflatten(side_tree, side_leaves))

    masks = {}  # set by fwd while tracing: whether h, and which layer leaves, carry a tangent (static)

    @jax.custom_vjp
    def run(h, layer_leaves, side_leaves):
        return jax.lax.scan(lambda h, x: (step(h, x, side_leaves), None), h, layer_leaves, unroll=unroll)[0]

    def fwd(h, layer_leaves, side_leaves):
        # symbolic_zeros=True: every leaf arrives as CustomVJPPrimal(value, perturbed)
        if any(p.perturbed for p in side_leaves):
            raise NotImplementedError("offloaded_layer_scan: gradients with respect to the side inputs "
                                      "(RoPE tables, masks) are not supported")
        masks["h"], masks["layers"] = h.perturbed, tuple(p.perturbed for p in layer_leaves)
        h, layer_leaves, side_leaves = h.value, [p.value for p in layer_leaves], [p.value for p in side_leaves]

        def forward(carry, layer_leaves_i):
            h, h_prev = carry  # this layer's input and the one before it
            # the copy starts once this layer's weight slices exist: XLA runs those slices on the same async
            # streams as the copy, and one queued behind it would hold up the layer
            h_prev, _ = jax.lax.optimization_barrier((h_prev, layer_leaves_i))
            return (step(h, layer_leaves_i, side_leaves), h), _to_host(h_prev)

        (out, last_input), saved = jax.lax.scan(forward, (h, h), layer_leaves, unroll=unroll)
        # saved[i] is the input of layer i-1 (saved[0]: layer 0's own, unused)
        return out, (saved, last_input, layer_leaves, side_leaves)

    def bwd(res, g):
        saved, last_input, layer_leaves, side_leaves = res
        trainable = masks["layers"]
        if isinstance(g, SymbolicZero):
            g = jnp.zeros(g.aval.shape, g.aval.dtype)

        def backward(carry, xs):
            g, x = carry
            below_host, layer_leaves_i = xs
            below = _to_device(below_host)  # the input of the layer below, for the next iteration
            diff = [a for a, t in zip(layer_leaves_i, trainable) if t]

            def layer_of(x, diff):
                it = iter(diff)
                leaves = [next(it) if t else a for a, t in zip(layer_leaves_i, trainable)]
                return step(x, leaves, side_leaves)

            _, vjp = jax.vjp(layer_of, x, diff)
            g_x, g_diff = vjp(g)
            return (g_x, below), g_diff

        (g_h, _), g_diff = jax.lax.scan(backward, (g, last_input), (saved, layer_leaves), reverse=True,
                                        unroll=unroll)
        it = iter(g_diff)
        g_layers = [next(it) if t else None for t in trainable]
        return (g_h if masks["h"] else None), g_layers, [None] * len(side_leaves)

    run.defvjp(fwd, bwd, symbolic_zeros=True)
    return run(h, layer_leaves, side_leaves)
