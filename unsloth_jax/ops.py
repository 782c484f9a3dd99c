"""Op dispatch: one function per op, choosing a Pallas kernel, cuDNN or the plain-XLA reference.

The choice depends on the backend, the features a call asks for, and the measured table below (a kernel is
dispatched only where the GPU benchmarks showed it faster than XLA's fusion of the same math). Users override
it with `set_impl(op, "xla" | "pallas" | "cudnn" | "auto")` or the environment variable
`UNSLOTH_JAX_IMPL="op=impl,op=impl"`. Each op logs its choice once.

Ops: rms_norm, rope, glu, linear (dense or 4-bit, with or without LoRA), attention, cross_entropy.
"""
from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp

from pallas_kernels import reference as ref
from pallas_kernels._common import on_gpu


log = logging.getLogger("unsloth_jax")

OPS = ("rms_norm", "rope", "glu", "linear", "nf4_matmul", "attention", "cross_entropy")
_overrides: dict[str, str] = {}
_logged: set[tuple[str, str]] = set()


def _env_overrides() -> dict[str, str]:
    raw = os.environ.get("UNSLOTH_JAX_IMPL", "")
    out = {}
    for item in filter(None, (s.strip() for s in raw.split(","))):
        op, _, impl = item.partition("=")
        out[op.strip()] = impl.strip()
    return out


def set_impl(op: str, impl: str) -> None:
    """Force an implementation for `op` ("auto" restores the measured choice)."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; ops: {', '.join(OPS)}")
    if impl not in ("auto", "xla", "pallas", "cudnn"):
        raise ValueError(f"unknown implementation {impl!r}; use auto, xla, pallas or cudnn")
    if impl == "auto":
        _overrides.pop(op, None)
    else:
        _overrides[op] = impl


def requested_impl(op: str) -> str:
    """The user's override for `op` ("auto" when none)."""
    return _overrides.get(op) or _env_overrides().get(op) or "auto"


def _note(op: str, impl: str, why: str = "") -> None:
    if (op, impl) not in _logged:
        _logged.add((op, impl))
        log.info("unsloth_jax: %s -> %s%s", op, impl, f" ({why})" if why else "")


def chosen_impls() -> dict[str, str]:
    """What each op used so far in this process (for the one-line summary)."""
    out: dict[str, str] = {}
    for op, impl in sorted(_logged):
        out[op] = impl if op not in out else out[op] + "+" + impl
    return out


# Where a Pallas kernel beat XLA's fusion of the same math on the H200 (bench/results/, BENCHMARKS.md).
# `auto` dispatches a kernel only where its predicate holds; everything else stays on XLA (or cuDNN).
_BF16 = jnp.dtype(jnp.bfloat16)
PALLAS_WINS = {
    # RMSNorm, bf16: backward alone 1.44-2.29x XLA's at every shape in every run (three device calls, third
    # session); forwards tie (0.84-1.54x across runs at D=1536/4096, within the run-to-run spread). D=2304
    # (Gemma 2) and D=128 (q/k norm) forwards 0.92-1.37x: not measured in a model step, so not enabled. In the
    # Qwen2-1.5B step it ties (XLA fuses the norm into neighbours).
    "rms_norm": lambda x: x.dtype == _BF16 and x.shape[-1] in (1536, 4096),
    # RoPE: forward 0.72-1.30x (not reliably at XLA's speed at model shapes), backward alone 1.17-1.44x XLA
    # (second and third sessions); in the Qwen2-1.5B step 178.6 vs 178.8 ms (a tie: XLA fuses the rotation into
    # the projection epilogue). Off: a kernel must beat XLA in the step.
    "rope": lambda q: False,
    # GLU: forward at par, backward alone 1.99-2.60x XLA's (second and third sessions); but the Qwen2-1.5B step
    # got slower with it on (187.6 vs 178.8 ms): XLA fuses the activation into the neighbouring matmuls'
    # prologue/epilogue. Off.
    "glu": lambda gate: False,
    # LoRA linear, bf16, r=16: standalone fwd+bwd 1.03-1.28x XLA, forward alone 0.63-1.03x. In the model it
    # loses: Qwen2-1.5B step 218.8 ms with only this kernel switched on vs 178.8 ms without (isolated A/B,
    # H200 2026-11-29). Off.
    "linear": lambda probe: False,
    # Fused linear cross-entropy, bf16: fwd+bwd 1.58x (Qwen2-1.5B) and 1.25x (Llama-3-8B) the chunked XLA
    # version with a tenth of its temporary memory; in the model it cut peak memory (5.46 -> 5.08 GiB at
    # 1.5B, 19.2 -> 17.1 GiB at 8B) without slowing the step (see above).
    "cross_entropy": lambda h: h.dtype == _BF16,
    # Flash attention serves the calls cuDNN cannot (Gemma 2's softcap, packing segments, left padding; cuDNN
    # is tried first, see attention()). GPU tests 9/9 on the H200 with the swept table (fourth session, 2026-11-29):
    # fwd+bwd 2.4-9.3x XLA and 0.60-0.78x cuDNN; Gemma 2 softcap+window 3.6x (S=4096) / 5.1x (S=8192) XLA;
    # Gemma-2-2B 4x2048 LoRA step 320 vs 417 ms with XLA attention, 8.65 vs 10.75 GiB.
    "attention": lambda q: q.dtype in (_BF16, jnp.float16) and q.shape[-1] in (64, 128, 256),
    # NF4 (QLoRA) projections: Pallas dequantize (table-load decode, 57-63% of 3 TB/s at Llama-3-8B layer
    # sizes) then XLA's matmul. In the Qwen2-1.5B QLoRA step: 182.1 ms vs 185.9 ms with the XLA twin (H200,
    # 2026-11-29, bench/gpu_session.sh final), peak 3.08 vs 3.11 GiB; Llama-3-8B QLoRA 390.5 vs 410.5 ms.
    "nf4_matmul": lambda x: x.dtype == _BF16,
}


def use_pallas(op: str, probe) -> bool:
    """Whether `op` runs its Pallas kernel for an input like `probe` (override > measured table)."""
    impl = requested_impl(op)
    if impl == "pallas":
        return True
    if impl in ("xla", "cudnn"):
        return False
    return on_gpu() and bool(PALLAS_WINS[op](probe))


# ----------------------------------------------------------------------------------------------- norms
def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """x [..., D] -> x * rsqrt(mean(x^2) + eps) * (offset + weight); statistics in f32, output in x.dtype."""
    if use_pallas("rms_norm", x):
        from pallas_kernels.rms_norm import rms_norm as kernel

        _note("rms_norm", "pallas")
        return kernel(x, weight.astype(x.dtype) if weight.dtype != x.dtype else weight, eps, offset)
    _note("rms_norm", "xla")
    return ref.rms_norm(x, weight, eps, offset)


# ------------------------------------------------------------------------------------------------ rope
def rope(q: jax.Array, k: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rotate q [B,S,Hq,D] and k [B,S,Hkv,D] by cos/sin [B,S,D] (HF rotate-half layout)."""
    if use_pallas("rope", q):
        from pallas_kernels.rope import rope as kernel

        _note("rope", "pallas")
        return kernel(q, k, cos, sin)
    _note("rope", "xla")

    def rot(x):
        xf = x.astype(jnp.float32)
        half = x.shape[-1] // 2
        rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
        return (xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(x.dtype)

    return rot(q), rot(k)


# ------------------------------------------------------------------------------------------------- glu
def glu(gate: jax.Array, up: jax.Array, activation: str) -> jax.Array:
    """act(gate) * up for activation in {"silu", "gelu", "gelu_tanh"}; math in f32, output in gate.dtype."""
    if use_pallas("glu", gate):
        from pallas_kernels.glu import geglu, swiglu

        _note("glu", "pallas")
        if activation == "silu":
            return swiglu(gate, up)
        return geglu(gate, up, approximate=activation == "gelu_tanh")
    _note("glu", "xla")
    g = gate.astype(jnp.float32)
    if activation == "silu":
        a = g * jax.nn.sigmoid(g)
    elif activation == "gelu":
        a = jax.nn.gelu(g, approximate=False)
    elif activation == "gelu_tanh":
        a = jax.nn.gelu(g, approximate=True)
    else:
        raise ValueError(f"unknown activation {activation!r}")
    return (a * up.astype(jnp.float32)).astype(gate.dtype)


# ---------------------------------------------------------------------------------------------- linear
def linear(x: jax.Array, p: dict, lora_scale: float | None = None) -> jax.Array:
    """x [..., in] @ p["kernel"] [in, out] (+ bias) (+ lora_scale * (x @ lora_a) @ lora_b); output in x.dtype.

    The frozen kernel is wrapped in stop_gradient, so even a caller differentiating w.r.t. all params gets
    no gradient computation for it.
    """
    from unsloth_jax.quant import is_nf4

    if is_nf4(p["kernel"]):
        return _linear_nf4(x, p, lora_scale)
    if "lora_a" in p and lora_scale is not None and use_pallas("linear", (x, p["kernel"].shape[-2:])):
        from pallas_kernels.lora_linear import lora_linear

        _note("linear", "pallas")
        y = lora_linear(x, jax.lax.stop_gradient(p["kernel"]).astype(x.dtype), p["lora_a"], p["lora_b"],
                        float(lora_scale))
        return y + p["bias"].astype(x.dtype) if "bias" in p else y
    _note("linear", "xla")
    w = jax.lax.stop_gradient(p["kernel"])
    y = jnp.einsum("...i,io->...o", x, w.astype(x.dtype))  # f32 accumulation, output in x.dtype
    if "lora_a" in p and lora_scale is not None:
        xa = jnp.einsum("...i,ir->...r", x, p["lora_a"].astype(x.dtype))
        y = y + (lora_scale * jnp.einsum("...r,ro->...o", xa, p["lora_b"].astype(x.dtype))).astype(x.dtype)
    if "bias" in p:
        y = y + p["bias"].astype(x.dtype)
    return y


def _linear_nf4(x: jax.Array, p: dict, lora_scale: float | None) -> jax.Array:
    """QLoRA linear: frozen NF4 base (HF [out, in]) + optional LoRA, dX never keeps a dequantized weight."""
    q = p["kernel"]
    lora = "lora_a" in p and lora_scale is not None
    if use_pallas("nf4_matmul", x):
        from pallas_kernels import nf4 as impl

        _note("nf4_matmul", "pallas")
    else:
        from pallas_kernels import reference as impl

        _note("nf4_matmul", "xla")
    if lora:
        y = impl.qlora_linear(x, q, p["lora_a"].astype(x.dtype), p["lora_b"].astype(x.dtype), float(lora_scale))
    else:
        y = impl.nf4_matmul(x, q)
    return y + p["bias"].astype(x.dtype) if "bias" in p else y


# ------------------------------------------------------------------------------------------- attention
NEG_INF = -1e30


def attention_mask(
    q_len: int,
    kv_len: int,
    *,
    causal: bool,
    window: int | None,
    kv_valid: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    q_offset: jax.Array | int = 0,
) -> jax.Array:
    """Boolean mask [B or 1, q_len, kv_len]: True where query i may attend key j.

    Query i sits at absolute index q_offset + i (decoding with a cache); causal means j <= that index; a
    window w keeps only keys with index > query index - w (HF's definition); kv_valid [B, kv_len] masks padding;
    segment_ids [B, S] restricts attention to equal ids (packing).
    """
    qi = (jnp.arange(q_len) + q_offset)[:, None]
    kj = jnp.arange(kv_len)[None, :]
    mask = jnp.ones((q_len, kv_len), bool)
    if causal:
        mask = mask & (kj <= qi)
    if window is not None:
        mask = mask & (qi - kj < window)
    mask = mask[None]
    if kv_valid is not None:
        mask = mask & kv_valid[:, None, :].astype(bool)
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return mask


def _attention_xla(q, k, v, mask, scale, softcap):
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    qg = q.reshape(b, s, hkv, g, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    scores = jnp.where(mask[:, None, None], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, s, hq, d).astype(q.dtype)


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
) -> jax.Array:
    """Multi-head attention with GQA. q [B,Sq,Hq,D], k/v [B,Skv,Hkv,D] -> [B,Sq,Hq,D] in q.dtype.

    kv_lengths [B] int32, when given, says the padding is on the right (training batches): tokens at or past
    the length are padding. Chooses cuDNN on GPU when the call needs only causal/window masking and right
    padding, else the XLA reference.
    """
    impl = requested_impl("attention")
    padding_ok = kv_valid is None or kv_lengths is not None
    simple = padding_ok and segment_ids is None and softcap is None and q.shape[1] == k.shape[1]
    if impl in ("auto", "cudnn") and on_gpu() and simple and isinstance(q_offset, int) and q_offset == 0:
        _note("attention", "cudnn")
        local = None if window is None else (window - 1, 0)
        return jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=causal, local_window_size=local, implementation="cudnn",
            query_seq_lengths=kv_lengths, key_value_seq_lengths=kv_lengths,
        )
    if use_pallas("attention", q) and q.shape[1] == k.shape[1] and isinstance(q_offset, int) and q_offset == 0:
        from pallas_kernels.flash_attention import flash_attention

        _note("attention", "pallas")
        segments = segment_ids
        if kv_valid is not None:  # padding tokens get their own segment (id 0 never matches a real token's)
            valid = kv_valid.astype(jnp.int32)
            segments = valid if segments is None else jnp.where(valid > 0, segments + 1, 0)
        return flash_attention(q, k, v, causal=causal, segment_ids=segments, sliding_window=window,
                               softcap=softcap, sm_scale=scale)
    _note("attention", "xla")
    mask = attention_mask(q.shape[1], k.shape[1], causal=causal, window=window, kv_valid=kv_valid,
                          segment_ids=segment_ids, q_offset=q_offset)
    return _attention_xla(q, k, v, mask, scale, softcap)


# --------------------------------------------------------------------------------------- cross entropy
def cross_entropy(hidden: jax.Array, lm_head: jax.Array, labels: jax.Array, *, softcap: float | None = None,
                  ignore_index: int = -100, chunk: int = 1024) -> jax.Array:
    """Mean next-token loss (f32) of hidden [T, D] against labels [T] with lm_head [V, D], chunked over T."""
    if use_pallas("cross_entropy", hidden):
        from pallas_kernels.cross_entropy import cross_entropy as kernel

        _note("cross_entropy", "pallas")
        return kernel(hidden, lm_head.astype(hidden.dtype), labels, softcap=softcap, ignore_index=ignore_index)
    _note("cross_entropy", "xla")
    return ref.cross_entropy(hidden, lm_head, labels, softcap=softcap, ignore_index=ignore_index, chunk_size=chunk)


__all__ = ["OPS", "set_impl", "requested_impl", "chosen_impls", "rms_norm", "rope", "glu", "linear",
           "attention", "attention_mask", "cross_entropy", "use_pallas", "PALLAS_WINS"]
