"""The host-offload remat modes' layer scan ("offload", Unsloth's use_gradient_checkpointing="unsloth", and
"offload_attention"): each layer's input kept in pinned host memory for the backward pass, with the copies back
to the device fetched one layer ahead.

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

Each offloaded array goes to the host and back in pieces of at most `chunk_bytes` (OFFLOAD_CHUNK_BYTES, 32 MiB;
contiguous blocks of its rows), each its own async copy: XLA's latency-hiding scheduler sizes every host copy's
overlap window the same (a few kernels), whatever its size. With `prefetch_weights` each iteration also slices
the next layer's weights out of the stack (carried to the next iteration) instead of its own at its start: the
profiles showed the layers' first kernels waiting for their weight slices (MemcpyD2D on the copy streams, queued
behind the host copies). Both are measured in benchmarks/HISTORY.md (fourteenth session); the layer stack takes both
from its LayerStackPolicy (models.layer_stack: offload_copies, offload_weights; prefetching by default with `keep`
only, where it measured faster).

Gradients are taken only for the `layers` leaves that carry a tangent (the trainable ones, via custom_vjp's
symbolic zeros); frozen weights get none and cost no dW. `side` (RoPE tables, masks, positions) must not be
differentiated.

With `keep` (a jax.checkpoint policy, e.g. one saving attention's forward outputs: "offload_attention"), each
layer runs forward under `jax.checkpoint(policy=keep)` and the values the policy saves go to the host beside the
layer's input, one layer late like it, and come back one layer ahead, so the backward pass reads them instead of
recomputing them. They are found as the leaves of the layer's VJP closure (backend.vjp_closure) that are not
the layer's own inputs: the inputs are the very tracers passed in, so they are matched by identity.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from unsloth_jax.backend import is_tracer, vjp_closure

# XLA debug options for a step that offloads: command buffers for these thunk kinds only (under XLA's default
# kinds the host copies run on the compute stream).
OFFLOAD_COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL"}

# The largest piece of an offloaded array copied to or from the host as one async copy (layer-stack setting
# offload_copies=blocks).
OFFLOAD_CHUNK_BYTES = 32 * 2 ** 20


def _to_host(x: jax.Array) -> jax.Array:
    return jax.device_put(x, jax.memory.Space.Host)


def _to_device(x: jax.Array) -> jax.Array:
    return jax.device_put(x, jax.memory.Space.Device)


def copy_chunks(rows: int, row_bytes: int, chunk_bytes: int | None = OFFLOAD_CHUNK_BYTES) -> int:
    """How many equal blocks of rows a [rows, ...] array (row_bytes bytes per row) is copied in: the fewest
    that divide `rows` with none over `chunk_bytes` (one if the array fits, or for chunk_bytes None; rows at
    most)."""
    if chunk_bytes is None:
        return 1
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    k = max(1, -(-rows * row_bytes // chunk_bytes))
    while k < rows and rows % k:
        k += 1
    return min(k, rows)


def _host_pieces(x: jax.Array, chunk_bytes: int | None) -> tuple:
    """x [..., D] -> its rows ([rows, D], x reshaped) in copy_chunks equal contiguous blocks, each sent to the
    host."""
    rows = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    k = copy_chunks(rows.shape[0], rows.shape[1] * rows.dtype.itemsize, chunk_bytes)
    return tuple(_to_host(c) for c in jnp.split(rows, k))


def _device_whole(pieces: tuple, shape: tuple) -> jax.Array:
    """The inverse of _host_pieces: the blocks back on the device, joined and reshaped to `shape`."""
    return jnp.concatenate([_to_device(c) for c in pieces]).reshape(shape)


def _layer(leaves: list, i) -> list:
    """The [i] slices of stacked arrays [n, ...], i clamped into [0, n)."""
    i = jnp.clip(i, 0, leaves[0].shape[0] - 1)
    return [jax.lax.dynamic_index_in_dim(a, i, keepdims=False) for a in leaves]


def offloaded_layer_scan(body, h: jax.Array, layers, side, *, keep=None, unroll: bool = False,
                         chunk_bytes: int | None = OFFLOAD_CHUNK_BYTES, prefetch_weights: bool = False) -> jax.Array:
    """lax.scan of `body` over the leading axis of `layers`, for training with host-offloaded layer inputs.

    body(h [B, S, D], layer, side) -> [B, S, D]: one step (a layer or a group of layers); `layer` is `layers`
    with its leading axis (n) indexed away. layers: a pytree of arrays [n, ...] (a layer stack's weights);
    side: a pytree of arrays every step reads. keep: None (the backward recomputes the whole step), or a
    jax.checkpoint policy whose saved values are offloaded with the input and not recomputed. chunk_bytes: the
    largest piece of an offloaded array copied as one async copy (None: whole arrays). prefetch_weights: slice
    each layer's weights one iteration ahead. Returns the last step's output, [B, S, D] in h's dtype."""
    layer_leaves, layer_tree = jax.tree.flatten(layers)
    side_leaves, side_tree = jax.tree.flatten(side)
    n = layer_leaves[0].shape[0]  # layers (or groups) in the stack

    def step(h, layer_leaves_i, side_leaves):
        return body(h, jax.tree.unflatten(layer_tree, layer_leaves_i), jax.tree.unflatten(side_tree, side_leaves))

    masks = {}  # set by fwd while tracing: whether h, and which layer leaves, carry a tangent (static)
    closure = {}  # with keep: the layer VJP's treedef and where each of its leaves comes from (static)

    def differentiable_step(layer_leaves_i, side_leaves):
        """step as a function of (input, trainable leaves of this layer), the rest closed over."""
        def layer_of(x, diff):
            it = iter(diff)
            leaves = [next(it) if t else a for a, t in zip(layer_leaves_i, masks["layers"])]
            return step(x, leaves, side_leaves)

        return layer_of, [a for a, t in zip(layer_leaves_i, masks["layers"]) if t]

    def forward_keeping(x, layer_leaves_i, side_leaves):
        """(step output, the values `keep` saves): the step under jax.checkpoint(policy=keep); the VJP closure's
        other leaves (x, this layer's leaves, the side inputs, constants) are recorded in `closure`."""
        layer_of, diff = differentiable_step(layer_leaves_i, side_leaves)
        out, vjp = jax.vjp(jax.checkpoint(layer_of, policy=keep), x, diff)
        leaves, tree = vjp_closure(vjp)
        origin = {id(a): ("side", j) for j, a in enumerate(side_leaves)}
        origin |= {id(a): ("layer", j) for j, a in enumerate(layer_leaves_i)} | {id(x): ("x", 0)}
        sources, kept = [], []
        for leaf in leaves:
            if id(leaf) in origin:
                sources.append(origin[id(leaf)])
            elif is_tracer(leaf):
                sources.append(("kept", len(kept)))
                kept.append(leaf)
            else:  # a constant of the trace (not a tracer): reused as it is
                sources.append(("const", leaf))
        closure["tree"], closure["sources"] = tree, sources
        return out, kept

    def vjp_keeping(x, layer_leaves_i, side_leaves, kept):
        """The layer VJP that forward_keeping built, from this trace's values."""
        pools = {"x": [x], "layer": layer_leaves_i, "side": side_leaves, "kept": kept}
        leaves = [ref if kind == "const" else pools[kind][ref] for kind, ref in closure["sources"]]
        return jax.tree.unflatten(closure["tree"], leaves)

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
        kept_init = []
        if keep is not None:  # the kept values' shapes, for the carry of the layer before the first (zeros)
            shapes = jax.eval_shape(lambda x, f, s: forward_keeping(x, f, s)[1], h, _layer(layer_leaves, 0),
                                    side_leaves)
            kept_init = [jnp.zeros(a.shape, a.dtype) for a in shapes]

        def forward(carry, xs):
            # this layer's input; the input and kept values of the one before; [this layer's weights]
            h, h_prev, kept_prev, weights = carry
            layer_leaves_i, next_weights = (weights, _layer(layer_leaves, xs + 1)) if prefetch_weights else (xs, xs)
            # the copies start once the weight slices exist: XLA runs those slices on the same async streams as
            # the copies, and one queued behind them would hold up the layer
            h_prev, kept_prev, _ = jax.lax.optimization_barrier((h_prev, kept_prev, next_weights))
            if keep is None:
                out, kept = step(h, layer_leaves_i, side_leaves), []
            else:
                out, kept = forward_keeping(h, layer_leaves_i, side_leaves)
            carry = (out, h, kept, next_weights if prefetch_weights else [])
            return carry, (_host_pieces(h_prev, chunk_bytes), [_host_pieces(a, chunk_bytes) for a in kept_prev])

        xs, first = (jnp.arange(n), _layer(layer_leaves, 0)) if prefetch_weights else (layer_leaves, [])
        (out, last_input, last_kept, _), saved = jax.lax.scan(forward, (h, h, kept_init, first), xs, unroll=unroll)
        # saved: the input and kept values of layer i-1 at [i] (at [0]: unused), each as host row blocks
        return out, (saved, last_input, last_kept, layer_leaves, side_leaves)

    def bwd(res, g):
        saved, last_input, last_kept, layer_leaves, side_leaves = res
        if isinstance(g, SymbolicZero):
            g = jnp.zeros(g.aval.shape, g.aval.dtype)

        def backward(carry, xs):
            g, x, kept, weights = carry
            (below_host, kept_below_host), layer_xs = xs
            layer_leaves_i, below_weights = ((weights, _layer(layer_leaves, layer_xs - 1)) if prefetch_weights
                                             else (layer_xs, []))
            # the input and kept values of the layer below, for the next iteration
            below = _device_whole(below_host, x.shape)
            kept_below = [_device_whole(p, a.shape) for p, a in zip(kept_below_host, kept)]
            if keep is None:
                layer_of, diff = differentiable_step(layer_leaves_i, side_leaves)
                _, vjp = jax.vjp(layer_of, x, diff)
            else:
                vjp = vjp_keeping(x, layer_leaves_i, side_leaves, kept)
            g_x, g_diff = vjp(g)
            return (g_x, below, kept_below, below_weights), g_diff

        xs, last = (jnp.arange(n), _layer(layer_leaves, n - 1)) if prefetch_weights else (layer_leaves, [])
        (g_h, _, _, _), g_diff = jax.lax.scan(backward, (g, last_input, last_kept, last), (saved, xs),
                                              reverse=True, unroll=unroll)
        it = iter(g_diff)
        g_layers = [next(it) if t else None for t in masks["layers"]]
        return (g_h if masks["h"] else None), g_layers, [None] * len(side_leaves)

    run.defvjp(fwd, bwd, symbolic_zeros=True)
    return run(h, layer_leaves, side_leaves)
