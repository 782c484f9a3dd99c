"""Op dispatch: one function per op, choosing a Pallas kernel, cuDNN or the plain-XLA reference.

Which implementation runs is decided by an immutable `Policy` value, resolved by `current_policy()` from three
layers, each validated, later ones overriding earlier ones:
  1. the measured table `PALLAS_WINS` ("auto": a kernel runs only where the GPU benchmarks showed it faster
     than XLA's fusion of the same math; BENCHMARKS.md has the figures),
  2. `set_impl(op, impl)` calls,
  3. the environment variable `UNSLOTH_JAX_IMPL="op=impl,op=impl"`.
Every jitted entry point of the project takes the policy as a static argument (`policy_jit`), so it is part
of the jit cache key: after `set_impl` the next call of any model or train step retraces with the new choice.
Inside a trace the active policy is the one `policy_scope` set; code traced outside the project's entry
points (a user's own `nnx.jit`) uses the policy current at trace time.

Ops: rms_norm, rope, glu, glu_fp8 (the GLU fused with an FP8 down_proj's row quantization), linear (dense,
4-bit or FP8, with or without LoRA), grouped_matmul, attention, cross_entropy, gated_delta (Qwen3.5's linear
attention), and
token_logprobs (per-token log-probabilities for preference and RL losses; XLA only). Two choices are not kernels:
fp8_gemm, the dtype XLA's FP8 GEMMs write before their scales ("bf16" for 16-bit activations by default, or "f32",
`fp8_gemm_out`), and nf4_gemm,
how an NF4 base multiplies: "dequantized" to the compute dtype (QLoRA as bitsandbytes runs it; the default) or
"fp8" (dequantized straight to e4m3 for the FP8 GEMMs, pallas_kernels.nf4_fp8: FP8 numerics, asked for only).
How the decoder layers loop, save, recompute and offload is not an ops setting: it is the layer-stack policy
(unsloth_jax.models.layer_stack.LayerStackPolicy, given with the remat mode); asking for its settings here
(layer_loop, offload_attention, offload_weights, offload_copies, MOVED_TO_LAYER_STACK) is an error saying so.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels import reference as ref
from pallas_kernels._common import on_gpu
from pallas_kernels.fp8 import FP8Weight
from pallas_kernels.gated_delta_chunked import chunked_gated_delta_rule
from pallas_kernels.nf4_format import NF4Weight
from unsloth_jax.backend import mesh_batch_axes

@jax.tree_util.register_pytree_node_class
class LayerSlice:
    """Layer `layer` of a stacked projection kernel `stack` (a dense [L, in, out] array, or an NF4Weight stacked
    over L layers), not yet sliced: the generation engine hands these to `linear`, whose decode kernels read the
    layer in place (slicing inside a compiled step copies the slice). `layer` is static (pytree aux data);
    `value()` is the plain slice (a [in, out] array or a one-layer NF4Weight)."""

    def __init__(self, stack, layer: int):
        self.stack, self.layer = stack, int(layer)

    def value(self):
        return jax.tree.map(lambda a: a[self.layer], self.stack)

    @property
    def shape(self):
        return self.stack.shape if isinstance(self.stack, NF4Weight) else self.stack.shape[1:]

    @property
    def dtype(self):
        return self.stack.dtype

    def tree_flatten(self):
        return (self.stack,), self.layer

    @classmethod
    def tree_unflatten(cls, layer, children):
        return cls(children[0], layer)


ENV_VAR = "UNSLOTH_JAX_IMPL"
# The implementations each op can be forced to ("auto" restores the measured choice).
IMPLS = {
    "rms_norm": ("xla", "pallas"),
    "rope": ("xla", "pallas"),
    "glu": ("xla", "pallas"),
    "glu_fp8": ("xla", "pallas"),
    "linear": ("xla", "pallas"),
    "nf4_matmul": ("xla", "pallas"),
    "attention": ("xla", "pallas", "cudnn"),
    "paged_attention": ("xla", "pallas"),  # decode attention over the generation engine's page pool
    "decode_linear": ("xla", "pallas"),  # the engine's decode GEMMs on a stacked kernel's layer, LoRA fused
    "nf4_decode": ("xla", "pallas"),  # the same on a stacked NF4 weight, dequantized in registers
    # not a kernel: the engine's decode loop compiled with XLA's default GEMMs ("xla") or with cuBLAS GEMMs
    # that read a layer's weights in place from the stacked kernels (dynamic-slice fusion, "cublas_inplace")
    "decode_gemm": ("xla", "cublas_inplace"),
    "cross_entropy": ("xla", "pallas"),
    "grouped_matmul": ("xla", "pallas"),
    "gated_delta": ("xla", "pallas"),  # Qwen3.5's linear attention: XLA's chunked form or the Pallas kernel
    "fp8_gemm": ("f32", "bf16"),  # not a kernel: the FP8 GEMMs' output dtype before the scales
    "nf4_gemm": ("dequantized", "fp8"),  # not a kernel: NF4 bases in the compute dtype or as FP8 GEMMs
}
OPS = tuple(IMPLS)
KERNEL_OPS = tuple(op for op in OPS if "pallas" in IMPLS[op])  # the ops with a Pallas kernel
# Settings that were ops settings and are now the layer stack's (unsloth_jax.models.layer_stack.SETTINGS)
MOVED_TO_LAYER_STACK = ("layer_loop", "offload_attention", "offload_weights", "offload_copies")


def _check(op: str, impl: str, source: str) -> None:
    if op in MOVED_TO_LAYER_STACK:
        example = ("offload_attention" if op == "offload_attention" else "offload") + f",{op}={impl}"
        raise ValueError(f"{source}: {op} is not an ops setting any more: it is a setting of the layer-stack "
                         f"policy, given with the remat mode, e.g. use_gradient_checkpointing=\"{example}\" "
                         f"(get_peft_model, from_pretrained, the CLI's --use_gradient_checkpointing), "
                         f"make_train_step(..., remat=\"{example}\") or "
                         f"unsloth_jax.models.layer_stack.LayerStackPolicy({op}=...)")
    if op not in IMPLS:
        raise ValueError(f"{source}: unknown op {op!r}; ops: {', '.join(OPS)}")
    if impl != "auto" and impl not in IMPLS[op]:
        raise ValueError(f"{source}: unknown implementation {impl!r} for {op}; use auto or "
                         f"{', '.join(IMPLS[op])}")


@dataclasses.dataclass(frozen=True)
class Policy:
    """The implementation choice of every op: `forced` holds (op, impl) pairs that override the measured
    table; `gpu` says whether the backend is a GPU (the table applies there only). Hashable and comparable, so
    jitted functions take it as a static argument."""

    forced: tuple[tuple[str, str], ...] = ()
    gpu: bool = False

    def requested(self, op: str) -> str:
        """The forced implementation of `op`, or "auto"."""
        return dict(self.forced).get(op, "auto")

    def with_impl(self, op: str, impl: str) -> "Policy":
        """A copy with `op` forced to `impl` ("auto" removes the override)."""
        _check(op, impl, "Policy.with_impl")
        forced = {k: v for k, v in self.forced if k != op}
        if impl != "auto":
            forced[op] = impl
        return Policy(tuple(sorted(forced.items())), self.gpu)


_set_impls: dict[str, str] = {}


def set_impl(op: str, impl: str) -> None:
    """Force `impl` for `op` ("auto" restores the measured choice); takes effect on the next call of any model."""
    _check(op, impl, "set_impl")
    if impl == "auto":
        _set_impls.pop(op, None)
    else:
        _set_impls[op] = impl


def _env_impls() -> dict[str, str]:
    raw = os.environ.get(ENV_VAR, "")
    out = {}
    for item in filter(None, (s.strip() for s in raw.split(","))):
        op, sep, impl = item.partition("=")
        if not sep:
            raise ValueError(f"{ENV_VAR}={raw!r}: entry {item!r} is not of the form op=impl")
        op, impl = op.strip(), impl.strip()
        _check(op, impl, f"{ENV_VAR}={raw!r}")
        out[op] = impl
    return out


def current_policy() -> Policy:
    """The policy now in force: the measured table, overridden by set_impl, overridden by UNSLOTH_JAX_IMPL."""
    forced = {**_set_impls, **_env_impls()}
    forced = {k: v for k, v in forced.items() if v != "auto"}
    return Policy(tuple(sorted(forced.items())), on_gpu())


_active: contextvars.ContextVar[Policy | None] = contextvars.ContextVar("unsloth_jax_policy", default=None)


@contextlib.contextmanager
def policy_scope(policy: Policy):
    """Make `policy` the one the ops below use while tracing (or running eagerly) inside the block."""
    token = _active.set(policy)
    try:
        yield policy
    finally:
        _active.reset(token)


def active_policy() -> Policy:
    """The policy of the enclosing `policy_scope`, else the current one."""
    return _active.get() or current_policy()


def policy_jit(fn, *, static_argnames=(), donate_argnums=(), donate_argnames=(), in_shardings=None,
               out_shardings=None, compiler_options=None):
    """jax.jit of `fn` with the current policy as an extra static argument, active while `fn` traces.

    The returned function reads `current_policy()` at every call, so a changed policy means a new cache entry
    (a retrace) rather than a stale compiled program. `.lower(*args)` lowers with the current policy too.
    in_shardings / out_shardings are jax.jit's (a step on a device mesh); with in_shardings, jax.jit takes
    positional arguments only. compiler_options: jax.jit's (XLA debug options for this program only), or a
    function of the policy returning them (or None), read at every call like the policy: e.g.
    unsloth_jax.train.step.step_compiler_options. The policy is passed first, positionally, so it needs no
    keyword."""

    def with_policy(policy: Policy, *args, **kwargs):
        with policy_scope(policy):
            return fn(*args, **kwargs)

    shardings = {k: v for k, v in (("in_shardings", in_shardings), ("out_shardings", out_shardings)) if v is not None}

    def make(options):
        return jax.jit(with_policy, static_argnums=(0,), static_argnames=static_argnames,
                       donate_argnums=tuple(i + 1 for i in donate_argnums), donate_argnames=donate_argnames,
                       compiler_options=options, **shardings)

    return functools.update_wrapper(_PolicyJit(make, compiler_options), fn)


class _PolicyJit:
    """What policy_jit returns: callable like the jitted function, with `.lower(*args)` and `.jitted` (the
    jax.jit object for the current policy's compiler options: cache introspection in tests). One jax.jit per
    distinct compiler options, made at the first call that needs it (nothing touches the backend before)."""

    def __init__(self, make, compiler_options):
        self._make, self._options, self._by_options = make, compiler_options, {}

    def _for(self, policy: Policy):
        options = self._options(policy) if callable(self._options) else self._options
        key = tuple(sorted((options or {}).items()))
        if key not in self._by_options:
            self._by_options[key] = self._make(options)
        return self._by_options[key]

    def __call__(self, *args, **kwargs):
        policy = current_policy()
        return self._for(policy)(policy, *args, **kwargs)

    def lower(self, *args, **kwargs):
        policy = current_policy()
        return self._for(policy).lower(policy, *args, **kwargs)

    @property
    def jitted(self):
        return self._for(current_policy())


# What each op chose while tracing, per policy (reported once in the run summary).
_choices: dict[Policy, dict[str, list[str]]] = {}


# The choices of the calls traced inside the innermost `recording_choices` block, if one is open.
_recording: contextvars.ContextVar[dict | None] = contextvars.ContextVar("unsloth_jax_recording", default=None)


def _note(op: str, impl: str) -> None:
    for seen in (_choices.setdefault(active_policy(), {}), _recording.get()):
        if seen is not None and impl not in seen.setdefault(op, []):
            seen[op].append(impl)


@contextlib.contextmanager
def recording_choices():
    """Collect what each op chose in the calls traced inside the block (one model's train step, say, apart
    from other models traced under the same policy): yields a dict {op: [impl, ...]} filled as they trace."""
    seen: dict[str, list[str]] = {}
    token = _recording.set(seen)
    try:
        yield seen
    finally:
        _recording.reset(token)


def format_choices(seen: dict[str, list[str]]) -> str:
    """"op=impl, op=a+b, ..." (sorted by op) of a `recording_choices` dict; "none traced" when empty."""
    parts = [f"{op}={'+'.join(impls)}" for op, impls in sorted(seen.items())]
    return ", ".join(parts) if parts else "none traced"


def chosen_impls(policy: Policy | None = None) -> dict[str, str]:
    """{op: impl} chosen in the calls traced under `policy` (default: the current one); "a+b" where an op
    took different paths for different calls (e.g. cuDNN attention in training, XLA when decoding)."""
    seen = _choices.get(policy or current_policy(), {})
    return {op: "+".join(impls) for op, impls in sorted(seen.items())}


# Where a Pallas kernel beat XLA's fusion of the same math on the H200 inside the model's train step
# (BENCHMARKS.md holds the measurements). "auto" runs a kernel only where its predicate holds. Each kernel module's
# docstring opens with where it wins and this default (tests/test_kernel_defaults.py holds the two together).
_BF16 = jnp.dtype(jnp.bfloat16)


def flash_head_dim(head_dim: int) -> int | None:
    """The head dim the flash kernel runs a call of `head_dim` at: the smallest of 64, 128, 256 that holds it
    (q, k, v zero-padded up to it: the scores and the output's first head_dim columns are unchanged), or None
    above 256."""
    return next((d for d in (64, 128, 256) if head_dim <= d), None)


PALLAS_WINS = {
    # bf16 RMSNorm at the hidden sizes measured (Qwen2-1.5B, Llama-3-8B); other sizes were not measured in a step.
    "rms_norm": lambda x: x.dtype == _BF16 and x.shape[-1] in (1536, 4096),
    # RoPE, GLU and the fused LoRA linear win standalone but not in the train step (XLA fuses them into the
    # neighbouring matmuls), so they stay off.
    "rope": lambda q: False,
    "glu": lambda gate: False,
    # The GLU fused with down_proj's e4m3 row quantization (FP8 bases): slower than XLA's fusions in the 8B step.
    "glu_fp8": lambda gate: False,
    "linear": lambda x: False,
    # Fused linear cross-entropy: faster and a tenth of the memory of the chunked XLA loss.
    "cross_entropy": lambda h: h.dtype == _BF16,
    # Flash attention serves the 16-bit calls cuDNN cannot (softcap, packing segments, left padding, Gemma 3's
    # image blocks, the vision towers' windows); timed at head_dim 128 and 256 (64 by inference: see
    # pallas_kernels/flash_attention.py). Other head dims up to 256 run zero-padded to the next of those
    # (the vision towers' 72 and 80: 128), where XLA's alternative is a dense [S, S] mask and scores.
    "attention": lambda q: q.dtype in (_BF16, jnp.float16) and flash_head_dim(q.shape[-1]) is not None,
    # The generation engine's decode kernels (BENCHMARKS.md, "Generation engine, 2026-12-04"): with both, the
    # Qwen2-1.5B decode step at 16 rows took 2.99 ms against 4.46 ms for XLA's page gather and slice copies.
    "paged_attention": lambda q: q.dtype in (_BF16, jnp.float16) and q.shape[-1] in (64, 128, 256),
    "decode_linear": lambda x: x.dtype in (_BF16, jnp.float16),
    "nf4_decode": lambda x: x.dtype in (_BF16, jnp.float16),
    # NF4 projections: the Pallas dequantize, then XLA's matmul.
    "nf4_matmul": lambda x: x.dtype == _BF16,
    # MoE expert GEMMs: XLA's GPU lowering of ragged_dot is a dense product against every expert (E times the
    # work, and an E-times padded copy that does not fit at Qwen3-30B-A3B's shape).
    "grouped_matmul": lambda x: x.dtype in (_BF16, jnp.float16),
    # The gated delta rule (Qwen3.5's linear attention): the Pallas state pass beside XLA's chunk-local terms,
    # faster than the chunked XLA form alone and in the Qwen3.5-9B step; timed with bf16 inputs at head dim 128.
    "gated_delta": lambda v: v.dtype == _BF16 and v.shape[-1] == 128,
}


def fp8_gemm_out(x: jax.Array) -> str:
    """The dtype the FP8 GEMMs of an activation like `x` write before their scales (pallas_kernels.fp8's
    gemm_out): "bfloat16" for 16-bit activations unless fp8_gemm=f32 is asked for (auto: the in-step A/B on the
    H200 in BENCHMARKS.md), "float32" for float32 activations (the choice is the policy's, so part of every jit
    key)."""
    f32 = active_policy().requested("fp8_gemm") == "f32"
    out = "bfloat16" if not f32 and x.dtype in (_BF16, jnp.float16) else "float32"
    _note("fp8_gemm", "bf16" if out == "bfloat16" else "f32")
    return out


def use_pallas(op: str, probe) -> bool:
    """Whether `op` runs its Pallas kernel for an input like `probe` under the active policy."""
    policy = active_policy()
    impl = policy.requested(op)
    if impl == "pallas":
        return True
    if impl != "auto":
        return False
    return policy.gpu and bool(PALLAS_WINS[op](probe))


# ------------------------------------------------------------------------------------- kernels on a mesh
def per_batch_shard(fn, batched: tuple, whole: tuple = ()):
    """fn(*batched, *whole), where under a mesh that splits the batch each device runs `fn` on its own rows.

    A Pallas kernel is a per-device program that XLA's SPMD partitioner cannot split: given batch-sharded
    operands it would gather them and run the whole batch on every device. Under a mesh in context
    (`jax.set_mesh`) whose batch axes are larger than 1, `fn` therefore runs in `jax.shard_map` over those
    axes: the `batched` arrays split on axis 0, the `whole` pytrees (weights) replicated, the output split on
    axis 0 like the batch. Without such a mesh (or when axis 0 does not divide), just fn(*batched, *whole)."""
    axes = mesh_batch_axes()
    shards = 1
    for a in axes:
        shards *= jax.sharding.get_abstract_mesh().shape[a]
    if not axes or any(x.shape[0] % shards for x in batched):
        return fn(*batched, *whole)
    rows, replicated = P(axes), P()
    mapped = jax.shard_map(fn, in_specs=(rows,) * len(batched) + (replicated,) * len(whole), out_specs=rows,
                           check_vma=False)
    return mapped(*batched, *whole)


# ----------------------------------------------------------------------------------------------- norms
def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """x [..., D] -> x * rsqrt(mean(x^2) + eps) * (offset + weight); statistics in f32, output in x.dtype."""
    if use_pallas("rms_norm", x):
        from pallas_kernels.rms_norm import rms_norm as kernel

        _note("rms_norm", "pallas")
        w = weight.astype(x.dtype) if weight.dtype != x.dtype else weight
        return per_batch_shard(lambda x, w: kernel(x, w, eps, offset), (x,), (w,))
    _note("rms_norm", "xla")
    return ref.rms_norm(x, weight, eps, offset)


# ------------------------------------------------------------------------------------------------ rope
def rope(q: jax.Array, k: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rotate q [B,S,Hq,D] and k [B,S,Hkv,D] by cos/sin [B,S,D] (HF rotate-half layout)."""
    if use_pallas("rope", q):
        from pallas_kernels.rope import rope as kernel

        _note("rope", "pallas")
        return per_batch_shard(kernel, (q, k, cos, sin))
    _note("rope", "xla")
    return ref.rope(q, k, cos, sin)


# ------------------------------------------------------------------------------------------------- glu
def glu(gate: jax.Array, up: jax.Array, activation: str) -> jax.Array:
    """act(gate) * up for activation in {"silu", "gelu", "gelu_tanh"}; math in f32, output in gate.dtype."""
    if activation not in ("silu", "gelu", "gelu_tanh"):
        raise ValueError(f"unknown activation {activation!r}")
    if use_pallas("glu", gate):
        from pallas_kernels.glu import geglu, swiglu

        _note("glu", "pallas")
        if activation == "silu":
            return per_batch_shard(swiglu, (gate, up))
        return per_batch_shard(lambda g, u: geglu(g, u, approximate=activation == "gelu_tanh"), (gate, up))
    _note("glu", "xla")
    if activation == "silu":
        return ref.swiglu(gate, up)
    return ref.geglu(gate, up, approximate=activation == "gelu_tanh")


def glu_linear(gate: jax.Array, up: jax.Array, activation: str, kernel, bias: jax.Array | None = None, lora=None,
               *, kernel_grad: bool = False) -> jax.Array:
    """linear(glu(gate, up, activation), kernel, bias, lora): the MLP's down projection of its gated activation.

    With an FP8Weight kernel and the "glu_fp8" op on Pallas, one kernel (pallas_kernels.glu_fp8) writes h's
    e4m3 rows and scales for the FP8 GEMM (and h itself only for the LoRA path), instead of XLA computing h and
    then its absmax and quantization; the same numbers (the backward follows the "glu" op's choice)."""
    if isinstance(kernel, FP8Weight) and not kernel_grad and use_pallas("glu_fp8", gate):
        from pallas_kernels.glu_fp8 import glu_fp8_matmul  # checks the activation (glu_fp8.KINDS)

        _note("glu_fp8", "pallas")
        _note("linear", "fp8")
        glu_backward = "pallas" if use_pallas("glu", gate) else "xla"
        _note("glu", glu_backward)  # the GLU backward follows the glu op's choice
        with_h = lora is not None
        gemm_out = fp8_gemm_out(gate)

        def fused(g, u, w):
            return glu_fp8_matmul(g, u, w, activation, with_h=with_h, glu_backward=glu_backward,
                                  gemm_out=gemm_out)

        out = per_batch_shard(fused, (gate, up), (kernel,))
        y, h = out if with_h else (out, None)
        y = y + _lora_delta(h, lora)
        return y if bias is None else y + bias.astype(y.dtype)
    if isinstance(kernel, FP8Weight):
        _note("glu_fp8", "xla")
    return linear(glu(gate, up, activation), kernel, bias, lora, kernel_grad=kernel_grad)


# ---------------------------------------------------------------------------------------------- linear
def linear(x: jax.Array, kernel, bias: jax.Array | None = None, lora=None, *, kernel_grad: bool = False
           ) -> jax.Array:
    """x [..., in] @ kernel (+ bias) (+ scale * (x @ a) @ b); output in x.dtype.

    kernel: a dense [in, out] array, an NF4Weight or an FP8Weight (both HF [out, in]); lora: None or
    (a [in, r], b [r, out], scale). A frozen kernel (kernel_grad=False, the LoRA case) is wrapped in
    stop_gradient, so even a caller differentiating with respect to every weight gets no gradient computation
    for it; kernel_grad=True (full fine-tuning, a dense kernel) lets its gradient through.
    """
    if kernel_grad and (isinstance(kernel, (NF4Weight, FP8Weight)) or lora is not None):
        raise ValueError("ops.linear: kernel_grad=True needs a dense kernel without LoRA (full fine-tuning)")
    if isinstance(kernel, LayerSlice):
        if isinstance(kernel.stack, NF4Weight):
            if _nf4_decode_applies(x, kernel.stack):
                return _decode_linear_nf4(x, kernel, bias, lora)
        elif use_pallas("decode_linear", x):
            return _decode_linear(x, kernel, bias, lora)
        kernel = kernel.value()
    if isinstance(kernel, NF4Weight):
        y = _linear_nf4(x, kernel, lora)
    elif isinstance(kernel, FP8Weight):
        from pallas_kernels.fp8 import fp8_matmul

        _note("linear", "fp8")
        y = fp8_matmul(x, kernel, gemm_out=fp8_gemm_out(x)) + _lora_delta(x, lora)
    elif lora is not None and use_pallas("linear", x):
        from pallas_kernels.lora_linear import lora_linear

        _note("linear", "pallas")
        a, b, scale = lora
        w = jax.lax.stop_gradient(kernel).astype(x.dtype)
        y = per_batch_shard(lambda x, w, a, b: lora_linear(x, w, a, b, float(scale)), (x,), (w, a, b))
    else:
        _note("linear", "xla")
        w = kernel if kernel_grad else jax.lax.stop_gradient(kernel)
        y = jnp.einsum("...i,io->...o", x, w.astype(x.dtype)) + _lora_delta(x, lora)
    if bias is not None:
        y = y + bias.astype(x.dtype)
    return y


def _decode_linear(x: jax.Array, kernel: LayerSlice, bias, lora) -> jax.Array:
    """linear() of decode rows x [..., in] on layer kernel.layer of the stacked kernel, read in place by
    pallas_kernels.decode_linear (LoRA and bias added in the same kernel)."""
    from pallas_kernels.decode_linear import stacked_linear

    _note("decode_linear", "pallas")
    a, b, scale = lora if lora is not None else (None, None, 1.0)
    flat = x.reshape(-1, x.shape[-1])
    # the layer as an int32 operand: one compiled kernel per shape for every layer (a Python int would put the
    # layer into the Triton program, one compile per layer)
    y = stacked_linear(flat, jax.lax.stop_gradient(kernel.stack), jnp.int32(kernel.layer),
                       bias=None if bias is None else bias.astype(x.dtype),
                       lora_a=None if a is None else a.astype(x.dtype),
                       lora_b=None if b is None else b.astype(x.dtype), lora_scale=float(scale))
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _nf4_decode_applies(x: jax.Array, stack: NF4Weight) -> bool:
    """Whether an NF4 decode projection runs pallas_kernels.nf4_decode (the policy picks it, the weight's layout
    suits it, and the NF4 base multiplies in the compute dtype rather than as FP8 GEMMs)."""
    from pallas_kernels.nf4_decode import supported

    return (use_pallas("nf4_decode", x) and supported(stack)
            and active_policy().requested("nf4_gemm") != "fp8")


def _decode_linear_nf4(x: jax.Array, kernel: LayerSlice, bias, lora) -> jax.Array:
    """linear() of decode rows x [..., in] on layer kernel.layer of a stacked NF4 weight, dequantized in
    registers by pallas_kernels.nf4_decode (the layer read in place; LoRA and bias added by the kernel)."""
    from pallas_kernels.nf4_decode import nf4_decode_linear

    _note("nf4_decode", "pallas")
    a, b, scale = lora if lora is not None else (None, None, 1.0)
    flat = x.reshape(-1, x.shape[-1])
    stack = jax.tree.map(jax.lax.stop_gradient, kernel.stack)
    y = nf4_decode_linear(flat, stack, jnp.int32(kernel.layer), bias=bias, lora_a=a, lora_b=b,
                          lora_scale=float(scale))
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _lora_delta(x: jax.Array, lora):
    """scale * (x @ a) @ b in x.dtype, or 0 without LoRA."""
    if lora is None:
        return 0
    a, b, scale = lora
    xa = jnp.einsum("...i,ir->...r", x, a.astype(x.dtype))
    return (scale * jnp.einsum("...r,ro->...o", xa, b.astype(x.dtype))).astype(x.dtype)


def _linear_nf4(x: jax.Array, q, lora) -> jax.Array:
    """QLoRA linear: frozen NF4 base (HF [out, in]) + optional LoRA; dX never keeps a dequantized weight.
    Under nf4_gemm=fp8 the base runs as FP8 GEMMs (pallas_kernels.nf4_fp8; the e4m3 weight written by the
    Pallas dequantize kernel where the nf4_matmul op picks Pallas)."""
    if active_policy().requested("nf4_gemm") == "fp8":
        from pallas_kernels.nf4_fp8 import nf4_fp8_matmul

        use_kernel = use_pallas("nf4_matmul", x)
        _note("nf4_gemm", "fp8")
        _note("nf4_matmul", "pallas" if use_kernel else "xla")
        y = nf4_fp8_matmul(x, q, use_kernel=use_kernel, gemm_out=fp8_gemm_out(x))
        return y + _lora_delta(x, lora)
    _note("nf4_gemm", "dequantized")
    if use_pallas("nf4_matmul", x):
        from pallas_kernels import nf4 as impl

        _note("nf4_matmul", "pallas")
    else:
        impl = ref
        _note("nf4_matmul", "xla")
    if lora is None:
        fn, whole = impl.nf4_matmul, (q,)
    else:
        a, b, scale = lora
        fn = lambda x, q, a, b: impl.qlora_linear(x, q, a, b, float(scale))  # noqa: E731
        whole = (q, a.astype(x.dtype), b.astype(x.dtype))
    return fn(x, *whole) if impl is ref else per_batch_shard(fn, (x,), whole)


# ------------------------------------------------------------------------------------- gated delta rule
def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                     initial_state: jax.Array | None = None, *, scale: float) -> tuple[jax.Array, jax.Array]:
    """Qwen3.5's linear attention (the gated delta rule; see pallas_kernels.reference.gated_delta_rule for the
    math): q, k [B, T, Hk, Dk] (L2-normalized by the caller), v [B, T, Hv, Dv], g (log decay, <= 0; -1e4 at a
    packed segment's start) and beta [B, T, Hv], initial_state [B, Hv, Dk, Dv] or None -> (o [B, T, Hv, Dv] in
    v.dtype, final state [B, Hv, Dk, Dv] float32). XLA: the chunked form (pallas_kernels.gated_delta_chunked);
    Pallas: pallas_kernels.gated_delta_state (the chunk-local terms in XLA, the state pass over the chunks in
    Pallas kernels; per batch shard under a mesh)."""
    if use_pallas("gated_delta", v):
        from pallas_kernels.gated_delta_state import gated_delta_rule as kernel

        _note("gated_delta", "pallas")
        interpret = not active_policy().gpu
        if initial_state is None:
            fn = lambda q, k, v, g, beta: kernel(q, k, v, g, beta, None, scale=scale, interpret=interpret)  # noqa: E731
            return per_batch_shard(fn, (q, k, v, g, beta))
        fn = lambda q, k, v, g, beta, s: kernel(q, k, v, g, beta, s, scale=scale, interpret=interpret)  # noqa: E731
        return per_batch_shard(fn, (q, k, v, g, beta, initial_state))
    _note("gated_delta", "xla")
    return chunked_gated_delta_rule(q, k, v, g, beta, initial_state, scale=scale)


# ------------------------------------------------------------------------------------------- attention
def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """jax.lax.ragged_dot's grouped GEMM: x [N, K] (rows sorted by group), w [E, K, M], group_sizes [E] int32
    -> [N, M] in x.dtype (float32 accumulation; rows past sum(group_sizes) are zero). Differentiable in x and
    w (w's gradient is formed only when asked for). Pallas (pallas_kernels.grouped_matmul) or XLA's ragged_dot.
    Under a mesh the kernel runs on gathered rows (the rows are sorted across the whole batch)."""
    if use_pallas("grouped_matmul", x):
        from pallas_kernels.grouped_matmul import grouped_matmul as pallas_grouped_matmul

        _note("grouped_matmul", "pallas")
        return pallas_grouped_matmul(x, w.astype(x.dtype), group_sizes, interpret=not active_policy().gpu)
    _note("grouped_matmul", "xla")
    return jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes)


def attention_mask(
    q_len: int,
    kv_len: int,
    *,
    causal: bool,
    window: int | None,
    kv_valid: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    q_offset: jax.Array | int = 0,
    block_ids: jax.Array | None = None,
) -> jax.Array:
    """Boolean mask [B or 1, q_len, kv_len]: True where query i may attend key j.

    Query i sits at absolute index q_offset + i (decoding with a cache); causal means j <= that index; a
    window w keeps only keys with index > query index - w (HF's definition); kv_valid [B, kv_len] masks padding;
    segment_ids [B, S] restricts attention to equal ids (packing). block_ids [B, S] int (q_len == kv_len,
    q_offset 0): tokens of one block (equal ids >= 0; -1 for none) also see each other's later tokens (Gemma 3's
    image tokens), i.e. (causal or same block) and window, as transformers' create_masks_for_vision_model.
    """
    qi = (jnp.arange(q_len) + q_offset)[:, None]
    kj = jnp.arange(kv_len)[None, :]
    mask = jnp.ones((q_len, kv_len), bool)
    if causal:
        mask = mask & (kj <= qi)
    mask = mask[None]
    if block_ids is not None:
        same = (block_ids[:, :, None] == block_ids[:, None, :]) & (block_ids[:, :, None] >= 0)
        mask = mask | same
    if window is not None:
        mask = mask & (qi - kj < window)[None]
    if kv_valid is not None:
        mask = mask & kv_valid[:, None, :].astype(bool)
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return mask


def _cudnn_serves(q: jax.Array) -> bool:
    """cuDNN's fused attention: 16-bit inputs, head_dim a multiple of 8 up to 128 (the sizes measured here)."""
    return q.dtype in (_BF16, jnp.float16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 128


def _flash(q, k, v, *, scale, causal, window, softcap, kv_valid, segment_ids, block_ids):
    """ops.attention's call of the Pallas flash kernel (full sequence): padding (kv_valid) becomes its own segment,
    a head dim the kernel has no tiles for is zero-padded (flash_head_dim) and the output sliced back."""
    from pallas_kernels.flash_attention import flash_attention

    _note("attention", "pallas")
    segments = segment_ids
    if kv_valid is not None:  # padding tokens get their own segment (id 0 never matches a real token's)
        valid = kv_valid.astype(jnp.int32)
        segments = valid if segments is None else jnp.where(valid > 0, segments + 1, 0)
    d = q.shape[-1]
    padded = flash_head_dim(d) or d
    ids = tuple(a for a in (segments, block_ids) if a is not None)

    def flash(q, k, v, *ids):
        pad = ((0, 0),) * 3 + ((0, padded - d),)
        if padded != d:
            q, k, v = (jnp.pad(a, pad) for a in (q, k, v))
        it = iter(ids)
        masks = {}
        if segments is not None:
            masks["segment_ids"] = next(it)
        if block_ids is not None:
            masks["block_ids"] = next(it)
        out = flash_attention(q, k, v, causal=causal, sliding_window=window, softcap=softcap, sm_scale=scale,
                              **masks)
        return out[..., :d] if padded != d else out

    return per_batch_shard(flash, (q, k, v) + ids)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float,
    causal: bool = True,
    window: int | None = None,
    softcap: float | None = None,
    kv_valid: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    q_offset: jax.Array | int = 0,
    kv_lengths: jax.Array | None = None,
    sinks: jax.Array | None = None,
    block_ids: jax.Array | None = None,
) -> jax.Array:
    """Multi-head attention with GQA. q [B,Sq,Hq,D], k/v [B,Skv,Hkv,D] -> [B,Sq,Hq,D] in q.dtype.

    block_ids [B, S] (full-sequence calls only): bidirectional blocks on top of the causal mask (see
    attention_mask; Gemma 3's image tokens): the flash kernel where it serves the call, else XLA (cuDNN takes no
    such mask).

    kv_lengths [B] int32, when given, says the padding is on the right (training batches): tokens at or past
    the length are padding. sinks [Hq] (gpt-oss): a learned logit per head added to every softmax denominator
    (softmax over [scores, sink], the sink's share dropped). On a GPU: cuDNN when the call needs only
    causal/window masking and right padding (16-bit, head_dim <= 128), the Pallas flash kernel for the other
    full-sequence calls, XLA for decoding and for every call with sinks.
    """
    policy = active_policy()
    impl = policy.requested("attention")
    padding_ok = kv_valid is None or kv_lengths is not None
    full_sequence = q.shape[1] == k.shape[1] and isinstance(q_offset, int) and q_offset == 0
    simple = padding_ok and segment_ids is None and softcap is None and full_sequence
    # TODO(sinks): neither cuDNN (jax.nn.dot_product_attention has no sink argument) nor the Pallas flash kernel
    # (pallas_kernels/flash_attention.py) takes attention sinks, so calls with sinks run on XLA, which
    # materialises the [B, H, S, S] scores. A flash kernel that adds exp(sink - m) to its running denominator
    # (or returns its log-sum-exp, so out * sigmoid(lse - sink) corrects it) would serve them.
    flash = dict(scale=scale, causal=causal, window=window, softcap=softcap, kv_valid=kv_valid,
                 segment_ids=segment_ids, block_ids=block_ids)
    if block_ids is not None:
        if not full_sequence:
            raise ValueError("attention: block_ids needs a full-sequence call (no cache, q_len == kv_len)")
        if impl != "cudnn" and sinks is None and use_pallas("attention", q):
            return _flash(q, k, v, **flash)
        _note("attention", "xla")
        mask = attention_mask(q.shape[1], k.shape[1], causal=causal, window=window, kv_valid=kv_valid,
                              segment_ids=segment_ids, block_ids=block_ids)
        return ref.attention(q, k, v, mask, scale=scale, softcap=softcap, sinks=sinks)
    if sinks is not None:
        _note("attention", "xla")
        mask = attention_mask(q.shape[1], k.shape[1], causal=causal, window=window, kv_valid=kv_valid,
                              segment_ids=segment_ids, q_offset=q_offset)
        return ref.attention(q, k, v, mask, scale=scale, softcap=softcap, sinks=sinks)
    if impl in ("auto", "cudnn") and policy.gpu and simple and _cudnn_serves(q):
        _note("attention", "cudnn")
        local = None if window is None else (window - 1, 0)
        return jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=causal, local_window_size=local, implementation="cudnn",
            query_seq_lengths=kv_lengths, key_value_seq_lengths=kv_lengths,
        )
    if impl != "cudnn" and use_pallas("attention", q) and full_sequence:
        return _flash(q, k, v, **flash)
    _note("attention", "xla")
    mask = attention_mask(q.shape[1], k.shape[1], causal=causal, window=window, kv_valid=kv_valid,
                          segment_ids=segment_ids, q_offset=q_offset)
    return ref.attention(q, k, v, mask, scale=scale, softcap=softcap)


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                    lengths: jax.Array, *, scale: float, window: int | None = None, softcap: float | None = None,
                    sinks: jax.Array | None = None) -> jax.Array:
    """Decode attention of one new token per row over a page pool. q [B, Hq, D]; k_pages / v_pages
    [P, BS, Hkv, D]; block_tables [B, MAXB] int32 (row b's token t lives in page block_tables[b, t // BS], slot
    t % BS); lengths [B] int32 (the row's tokens, the query's own included; 0: an idle row, whose output is 0).
    A key j is attended when j < length and, with a window, (length - 1) - j < window. -> [B, Hq, D] in q.dtype.
    The Pallas kernel (pallas_kernels.decode_attention) reads only the pages in use; the XLA path
    (pallas_kernels.reference.paged_decode_attention) gathers every page of the table."""
    if use_pallas("paged_attention", q):
        from pallas_kernels.decode_attention import paged_decode_attention

        _note("paged_attention", "pallas")
        return paged_decode_attention(q, k_pages, v_pages, block_tables, lengths, scale=scale, softcap=softcap,
                                      window=window, sinks=sinks)
    _note("paged_attention", "xla")
    return ref.paged_decode_attention(q, k_pages, v_pages, block_tables, lengths, scale=scale, softcap=softcap,
                                      window=window, sinks=sinks)


def _setting(op: str, auto: str, policy: Policy | None = None) -> str:
    """A non-kernel choice under `policy` (default: the active one): the forced value, else `auto`; recorded as a
    choice."""
    requested = (policy or active_policy()).requested(op)
    chosen = auto if requested == "auto" else requested
    _note(op, chosen)
    return chosen


def decode_compiler_options(policy: Policy) -> dict | None:
    """XLA options of the engine's decode loop under `policy` (decode_gemm): None, or cuBLAS GEMMs with
    dynamic-slice fusion, which lets a GEMM read layer i's slice of a stacked kernel without copying it."""
    if _setting("decode_gemm", "xla", policy) == "cublas_inplace":
        return {"xla_gpu_enable_triton_gemm": False, "xla_gpu_enable_dynamic_slice_fusion": True}
    return None


# --------------------------------------------------------------------------------------- cross entropy
def cross_entropy(hidden: jax.Array, lm_head: jax.Array, labels: jax.Array, *, softcap: float | None = None,
                  ignore_index: int = -100, chunk: int = 1024) -> jax.Array:
    """Mean next-token loss (f32) of hidden [T, D] against labels [T] with lm_head [V, D], chunked over T.

    Under a mesh that splits the batch, each device takes the loss of its own rows (`per_batch_shard`, for
    the kernel and the XLA twin alike: XLA's partitioner would otherwise gather every row's hidden state to
    every device to follow the chunked loop's reshapes, as the compiled 8-device step showed), and the
    per-device sums and token counts are added up."""
    if use_pallas("cross_entropy", hidden):
        from pallas_kernels.cross_entropy import cross_entropy as kernel

        _note("cross_entropy", "pallas")
        lm_head = lm_head.astype(hidden.dtype)
    else:
        _note("cross_entropy", "xla")

        def kernel(h, w, y, softcap, ignore_index):
            return ref.cross_entropy(h, w, y, softcap=softcap, ignore_index=ignore_index, chunk_size=chunk)

    if not mesh_batch_axes():
        return kernel(hidden, lm_head, labels, softcap=softcap, ignore_index=ignore_index)

    def shard_sum(h, y, w):  # one device's token-loss sum and token count
        n = jnp.sum(y != ignore_index)
        return (kernel(h, w, y, softcap=softcap, ignore_index=ignore_index) * n)[None], n[None]

    sums, counts = per_batch_shard(shard_sum, (hidden, labels), (lm_head,))
    return jnp.sum(sums) / jnp.maximum(jnp.sum(counts), 1).astype(jnp.float32)


def token_logprobs(hidden: jax.Array, lm_head: jax.Array, labels: jax.Array, *, softcap: float | None = None,
                   temperature: float = 1.0, ignore_index: int = -100, chunk: int = 1024) -> jax.Array:
    """Per-token log-probabilities [T] (f32) of labels [T] under softmax(softcap(hidden @ lm_head.T) / temperature),
    chunked over T so [T, V] logits never exist; 0.0 where label == ignore_index. XLA only (no kernel yet)."""
    _note("token_logprobs", "xla")
    return ref.token_logprobs(hidden, lm_head, labels, softcap=softcap, temperature=float(temperature),
                              ignore_index=ignore_index, chunk_size=chunk)


def token_mean_logits(hidden: jax.Array, lm_head: jax.Array, *, softcap: float | None = None,
                      chunk: int = 1024) -> jax.Array:
    """Mean over the vocabulary of each token's logits [T] (f32) for hidden [T, D] and lm_head [V, D], without
    [T, V] logits (pallas_kernels.reference.token_mean_logits); no gradient (TRL's logits/* log keys)."""
    _note("token_mean_logits", "xla")
    return ref.token_mean_logits(hidden, lm_head, softcap=softcap, chunk_size=chunk)


__all__ = ["OPS", "IMPLS", "Policy", "LayerSlice", "set_impl", "current_policy", "policy_scope", "active_policy", "policy_jit",
           "chosen_impls", "recording_choices", "format_choices", "per_batch_shard", "rms_norm", "rope", "glu",
           "glu_linear", "linear", "grouped_matmul", "attention", "paged_attention", "attention_mask",
           "cross_entropy", "token_logprobs", "token_mean_logits", "use_pallas", "PALLAS_WINS"]
