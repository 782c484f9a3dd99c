"""Benchmark RMSNorm, RoPE and SwiGLU/GEGLU Pallas kernels against their jitted plain-jnp twins.

    python bench/kernels_elementwise.py            # ANCHORS.md shapes, bf16 (about 1-2 minutes on an H200)
    python bench/kernels_elementwise.py --full     # + [16384,4096] RMSNorm, 8x2048 Llama-3-8B RoPE, erf-GEGLU
    python bench/kernels_elementwise.py --quick    # one shape per kernel (smoke run)
    python bench/kernels_elementwise.py --sweep    # sweep block configs, print the best per table key
    python bench/kernels_elementwise.py --sweep --only glu      # sweep one family (rms_norm, rope, glu)
    python bench/kernels_elementwise.py --tiny     # tiny shapes, runs anywhere (CPU interpret mode)

One JSON line per measurement: name, shape, dtype, impl ("pallas" | "xla"), fwd_ms, fwdbwd_ms, bwd_ms, gbps (forward), gbps_fwdbwd, gbps_bwd, pct_of_ceiling, peak_bytes, config, jax_version, device.
- fwd_ms: the op alone. fwdbwd_ms: one jit returning the output and the input gradients. bwd_ms: the backward alone, on
  residuals saved by a forward outside the timed program - the case inside a model, where the forward and
  backward of one op are separated by other layers and cannot be fused into one pass. In fwdbwd_ms XLA may
  fuse its forward and backward into one pass over the inputs, which no model step lets it do.
- Bytes are logical: each input read once, each output written once (identical for both impls; the
  kernel's extra float32 rstd for RMSNorm is not counted). Forward: inputs + output. Backward: the saved
  inputs + the output cotangent read, the input gradients written.
- pct_of_ceiling: gbps_fwdbwd over the ~3000 GB/s elementwise read+write ceiling measured on the H200.
  The summary line adds copy_gbps_same_bytes: a plain `a * 2` pass moving the forward's bytes, timed the
  same way (what any kernel of that size reaches), and the Pallas forward / backward as % of it.
- peak_bytes: arguments + outputs + temporaries of the compiled fwd+bwd program (XLA memory analysis).
Timing: bench/timing.py (K calls on K distinct input copies inside one jitted program, median / K).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels.glu as glu_mod  # noqa: E402
import pallas_kernels.reference as ref  # noqa: E402
from pallas_kernels.rms_norm import (BwdConfig, FwdConfig, _shape_class, bwd_config, fwd_config,  # noqa: E402
                                     rms_norm_with_config)
from pallas_kernels.rope import RopeConfig, config as rope_config, rope_with_config  # noqa: E402
from pallas_kernels._common import next_pow2  # noqa: E402
from bench.timing import device_ms, peak_bytes  # noqa: E402

CEILING_GBPS = 3000.0  # ANCHORS.md: elementwise read+write on the H200 through JAX
DEVICE = f"{jax.devices()[0].platform}:{jax.devices()[0].device_kind}"


# --------------------------------------------------------------------------------- timed functions
def _fwd(f, nconst):
    return lambda *a: f(*a)


def _fwdbwd(f, nconst):
    def run(*a):
        *prims, ct = a
        consts, diff = prims[:nconst], prims[nconst:]
        out, vjp = jax.vjp(lambda *d: f(*consts, *d), *diff)
        return out, vjp(ct)
    return run


def _bwd_only(f, nconst, args, ct):
    """(g, (vjp closure, ct)): g(vjp, ct) runs only the backward, on residuals saved by a forward run
    outside the timed program (inside a model the forward and backward are far apart and cannot fuse)."""
    consts, diff = args[:nconst], args[nconst:]
    _, vjp = jax.vjp(lambda *d: f(*consts, *d), *diff)
    return (lambda v, c: v(c)), (vjp, ct)


def _grad(f, nconst):
    def run(*a):
        *prims, ct = a
        consts, diff = prims[:nconst], prims[nconst:]
        return jax.vjp(lambda *d: f(*consts, *d), *diff)[1](ct)
    return run


# -------------------------------------------------------------------------------------------- cases
@dataclass
class Case:
    name: str
    shape: str
    dtype: str
    args: tuple  # (consts..., differentiable...)
    nconst: int
    ct: Any
    bytes_fwd: int
    bytes_bwd: int
    kernel: Callable  # kernel(fwd_cfg=None, bwd_cfg=None) -> f(*args); None -> the module's table config
    reference: Callable  # f(*args)
    config: Any = None
    # () -> (fwd space, bwd space, refine | None); a space is a list of (phase, fwd cfg | None, bwd cfg | None),
    # refine(best config of the last non-empty phase) -> more candidates for that phase.
    sweep: Callable | None = None
    extra: dict = field(default_factory=dict)


def _rand(key, shape, dtype, scale=1.0):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def rms_case(rows, d, dtype, offset=0.0, label=""):
    k = jax.random.split(jax.random.PRNGKey(rows + d), 3)
    x, w, dy = _rand(k[0], (rows, d), dtype, 2.0), _rand(k[1], (d,), dtype, 0.2) + 1.0, _rand(k[2], (rows, d), dtype)
    s = jnp.dtype(dtype).itemsize
    fcfg, bcfg = fwd_config(rows, d, dtype), bwd_config(rows, d, dtype)

    def kernel(fwd=None, bwd=None):
        return lambda a, b: rms_norm_with_config(a, b, 1e-6, offset, interpret=None,
                                                 fwd=fwd or fcfg, bwd=bwd or bcfg)

    return Case(
        name=f"rms_norm{label}", shape=f"[{rows},{d}]", dtype=jnp.dtype(dtype).name, args=(x, w), nconst=0,
        ct=dy, bytes_fwd=(2 * rows * d + d) * s, bytes_bwd=(3 * rows * d + 2 * d) * s,
        kernel=kernel, reference=lambda a, b: ref.rms_norm(a, b, 1e-6, offset),
        config={"fwd": fcfg._asdict(), "bwd": bcfg._asdict()},
        sweep=lambda: _rms_sweep(rows, d, fcfg, bcfg),
        extra={"table_key": [_shape_class(rows), jnp.dtype(dtype).name, next_pow2(d)]},
    )


def rope_case(b, s_, hq, hkv, d, dtype, label=""):
    k = jax.random.split(jax.random.PRNGKey(b * s_ + hq), 4)
    q, kk = _rand(k[0], (b, s_, hq, d), dtype), _rand(k[1], (b, s_, hkv, d), dtype)
    pos = jnp.arange(s_, dtype=jnp.float32)[None, :, None]
    inv = 1.0 / (10000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    ang = jnp.broadcast_to(pos * inv[None, None, :], (b, s_, d // 2))
    ang = jnp.concatenate([ang, ang], axis=-1)
    cos, sin = jnp.cos(ang).astype(dtype), jnp.sin(ang).astype(dtype)  # HF hands cos/sin over in x.dtype
    ct = (_rand(k[2], q.shape, dtype), _rand(k[3], kk.shape, dtype))
    sz = jnp.dtype(dtype).itemsize
    qk = b * s_ * (hq + hkv) * d * sz
    cs = 2 * b * s_ * d * sz
    cfg = rope_config(b * s_, hq, hkv, d, dtype)

    def kernel(fwd=None, bwd=None):
        return lambda c, sn, qq, kv: rope_with_config(qq, kv, c, sn, interpret=None, cfg=fwd or cfg)

    return Case(
        name=f"rope{label}", shape=f"q[{b},{s_},{hq},{d}] k[{b},{s_},{hkv},{d}]", dtype=jnp.dtype(dtype).name,
        args=(cos, sin, q, kk), nconst=2, ct=ct, bytes_fwd=2 * qk + cs, bytes_bwd=2 * qk + cs,
        kernel=kernel, reference=lambda c, sn, qq, kv: ref.rope(qq, kv, c, sn), config=cfg._asdict(),
        sweep=lambda: _rope_sweep(b * s_, hq, d, cfg),
        extra={"table_key": [f"{hq}/{hkv}", jnp.dtype(dtype).name, d]},
    )


def glu_case(kind, shape, dtype, label=""):
    k = jax.random.split(jax.random.PRNGKey(shape[0] + shape[1]), 3)
    g, u, dh = _rand(k[0], shape, dtype, 2.0), _rand(k[1], shape, dtype), _rand(k[2], shape, dtype)
    n = int(np.prod(shape))
    sz = jnp.dtype(dtype).itemsize
    fcfg, bcfg = glu_mod.config(n, dtype, "fwd", kind), glu_mod.config(n, dtype, "bwd", kind)
    refs = {"silu": ref.swiglu, "gelu": ref.geglu, "gelu_tanh": lambda a, b_: ref.geglu(a, b_, True)}
    names = {"silu": "swiglu", "gelu": "geglu", "gelu_tanh": "geglu_tanh"}

    def kernel(fwd=None, bwd=None):
        return lambda a, b_: glu_mod.glu_with_config(a, b_, kind, interpret=None, fwd=fwd or fcfg, bwd=bwd or bcfg)

    return Case(
        name=f"{names[kind]}{label}", shape=f"[{shape[0]},{shape[1]}]", dtype=jnp.dtype(dtype).name,
        args=(g, u), nconst=0, ct=dh, bytes_fwd=3 * n * sz, bytes_bwd=5 * n * sz,
        kernel=kernel, reference=refs[kind], config={"fwd": fcfg._asdict(), "bwd": bcfg._asdict()},
        sweep=lambda: _glu_sweep(n, fcfg, bcfg),
        extra={"table_key": [kind, jnp.dtype(dtype).name]},
    )


# ------------------------------------------------------------------------------------ sweep spaces
def _tile_candidates(unit: int, max_rows: int, sizes=(2048, 4096, 8192, 16384), per_thread=(16, 8)):
    """(rows, warps): rows * unit elements per tile in `sizes`, `per_thread` elements per thread."""
    out = []
    for elems in sizes:
        rows = elems // unit
        if rows < 1 or rows > max_rows:
            continue
        for pt in per_thread:
            warps = max(2, min(16, elems // (32 * pt)))
            if (rows, warps) not in out:
                out.append((rows, warps))
    if not out:
        out = [(1, 8), (1, 16)]
    return out


def _rms_sweep(rows, d, fcfg, bcfg):
    bd = next_pow2(d)
    max_rows = min(64, next_pow2(rows))
    fwd = [("fwd", fcfg, None)] + [("fwd", FwdConfig(r, w, 1), None)
                                   for r, w in _tile_candidates(bd, max_rows) if (r, w) != fcfg[:2]]
    bwd = [("bwd", None, bcfg)] + [("bwd", None, BwdConfig(r, 528, w, 2))
                                   for r, w in _tile_candidates(bd, max_rows, (2048, 4096, 8192), per_thread=(8, 4))
                                   if (r, w) != (bcfg.block_rows, bcfg.num_warps)]
    return fwd, bwd, lambda best_b: [
        ("bwd", None, best_b._replace(max_programs=p, num_stages=st)) for p in (264, 528, 1056) for st in (1, 2)
        if (p, st) != (best_b.max_programs, best_b.num_stages)
    ]


def _rope_sweep(tokens, hq, d, cfg):
    hb = min(8, hq & -hq)
    # unit = one token of one head block, both halves; 8-16 elements per thread per half (larger steps spill).
    tiles = _tile_candidates(hb * d, 64, (2048, 4096, 8192), per_thread=(16, 8))
    fwd = [("fwd", cfg, None)] + [("fwd", RopeConfig(t, 8, w, 1, True), None) for t, w in tiles]
    return fwd, [], lambda best: [
        ("fwd", best._replace(max_heads=h, block_tokens=max(1, best.block_tokens * hb // h)), None)
        for h in (2, 4) if h < hb
    ] + [("fwd", best._replace(unroll_heads=False), None)]


def _glu_sweep(n, fcfg, bcfg):
    cands = [(2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16)]
    fwd = [("fwd", fcfg, None)] + [("fwd", glu_mod.GluConfig(b, w, 1), None) for b, w in cands if (b, w) != fcfg[:2]]
    bwd = [("bwd", None, bcfg)] + [("bwd", None, glu_mod.GluConfig(b, w, 1)) for b, w in cands if (b, w) != bcfg[:2]]
    return fwd, bwd, None


# ------------------------------------------------------------------------------------------- runner
def _emit(rec):
    print(json.dumps(rec), flush=True)


def measure(case: Case, runs: int):
    base = {"name": case.name, "shape": case.shape, "dtype": case.dtype, "jax_version": jax.__version__,
            "device": DEVICE}
    results = {}
    for impl, f in (("xla", case.reference), ("pallas", case.kernel())):
        args = case.args
        fwd_ms = device_ms(_fwd(f, case.nconst), *args, runs=runs)
        fwdbwd = _fwdbwd(f, case.nconst)  # one function object: peak_bytes reuses device_ms's compilation
        fb_ms = device_ms(fwdbwd, *args, case.ct, runs=runs)
        peak = peak_bytes(fwdbwd, *args, case.ct)
        bwd_fn, bwd_args = _bwd_only(f, case.nconst, args, case.ct)
        b_ms = device_ms(bwd_fn, *bwd_args, runs=runs)
        gbps = case.bytes_fwd / (fwd_ms * 1e-3) / 1e9
        gbps_fb = (case.bytes_fwd + case.bytes_bwd) / (fb_ms * 1e-3) / 1e9
        rec = dict(base, impl=impl, fwd_ms=round(fwd_ms, 4), fwdbwd_ms=round(fb_ms, 4), bwd_ms=round(b_ms, 4), gbps=round(gbps, 1), gbps_fwdbwd=round(gbps_fb, 1),
                   gbps_bwd=round(case.bytes_bwd / (b_ms * 1e-3) / 1e9, 1),
                   pct_of_ceiling=round(100 * gbps_fb / CEILING_GBPS, 1), peak_bytes=peak,
                   config=case.config if impl == "pallas" else None)
        results[impl] = rec
        _emit(rec)
    # A plain elementwise pass (read n, write n) moving the forward's bytes, timed the same way: the bandwidth
    # a kernel of this size can reach at all (small tensors do not reach the large-copy ceiling).
    item = jnp.dtype(case.dtype).itemsize
    z = _rand(jax.random.PRNGKey(7), (max(1, case.bytes_fwd // (2 * item)),), jnp.dtype(case.dtype))
    copy_gbps = case.bytes_fwd / (device_ms(lambda a: a * 2, z, runs=runs) * 1e-3) / 1e9
    x, p = results["xla"], results["pallas"]
    _emit(dict(base, impl="summary", copy_gbps_same_bytes=round(copy_gbps, 1),
               pallas_fwd_pct_of_copy=round(100 * p["gbps"] / copy_gbps, 1),
               pallas_bwd_pct_of_copy=round(100 * p["gbps_bwd"] / copy_gbps, 1), speedup_fwd=round(x["fwd_ms"] / p["fwd_ms"], 3),
               speedup_fwdbwd=round(x["fwdbwd_ms"] / p["fwdbwd_ms"], 3),
               speedup_bwd=round(x["bwd_ms"] / p["bwd_ms"], 3), pallas_pct_of_ceiling=p["pct_of_ceiling"]))


def sweep(case: Case, runs: int):
    base = {"name": case.name, "shape": case.shape, "dtype": case.dtype, "jax_version": jax.__version__,
            "device": DEVICE, "impl": "pallas", "sweep": True}
    fwd_space, bwd_space, refine = case.sweep()

    def run(label, fcfg, bcfg):
        f = case.kernel(fcfg, bcfg)
        try:
            if label == "fwd":
                ms = device_ms(_fwd(f, case.nconst), *case.args, runs=runs)
                gbps = case.bytes_fwd / (ms * 1e-3) / 1e9
            else:  # the gradient program: fwd (fixed table config) + the bwd config under test
                ms = device_ms(_grad(f, case.nconst), *case.args, case.ct, runs=runs)
                gbps = None
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is reported and skipped
            _emit(dict(base, phase=label, config=(fcfg or bcfg)._asdict(), error=repr(e)[:300]))
            return float("inf")
        _emit(dict(base, phase=label, config=(fcfg or bcfg)._asdict(), ms=round(ms, 4),
                   gbps=None if gbps is None else round(gbps, 1)))
        return ms

    best = {}
    for phase, space in (("fwd", fwd_space), ("bwd", bwd_space)):
        scored = [(run(label, fc, bc), fc or bc) for label, fc, bc in space]
        if scored:
            best[phase] = min(scored, key=lambda t: t[0])
    if refine is not None:
        phase = "bwd" if bwd_space else "fwd"
        if phase in best:
            extra = refine(best[phase][1])
            scored = [(run(label, fc, bc), fc or bc) for label, fc, bc in extra]
            best[phase] = min(scored + [best[phase]], key=lambda t: t[0])
    _emit(dict(base, sweep="best", table_key=case.extra.get("table_key"),
               **{f"best_{k}": {"config": v[1]._asdict(), "ms": round(v[0], 4)} for k, v in best.items()}))


def build_cases(quick: bool, tiny: bool, dtype, only: set[str] | None, full: bool = False, sweep: bool = False):
    if tiny:
        cases = [rms_case(37, 2304, dtype), rope_case(1, 17, 4, 2, 64, dtype), glu_case("silu", (7, 100), dtype)]
    else:
        cases = [
            rms_case(8192, 1536, dtype, label="/qwen2-1.5b"),
            rms_case(4096, 4096, dtype, label="/llama3-8b"),
            rms_case(8192, 2304, dtype, offset=1.0, label="/gemma2-2b"),
            rms_case(8192 * 16, 128, dtype, label="/qk-norm-D128"),
            *([rms_case(16384, 4096, dtype, label="/llama3-8b-16k-rows")] if full else []),
            rope_case(4, 2048, 12, 2, 128, dtype, label="/qwen2-1.5b"),
            rope_case(2, 2048, 32, 8, 128, dtype, label="/llama3-8b"),
            rope_case(4, 2048, 8, 4, 256, dtype, label="/gemma2-2b"),
            *([rope_case(8, 2048, 32, 8, 128, dtype, label="/llama3-8b-b8")] if full else []),
            glu_case("silu", (8192, 8960), dtype, label="/qwen2-1.5b"),
            glu_case("silu", (4096, 14336), dtype, label="/llama3-8b"),
            glu_case("gelu_tanh", (8192, 9216), dtype, label="/gemma2-2b"),
            *([glu_case("gelu", (8192, 9216), dtype, label="/gemma2-2b-erf")] if full or sweep else []),
        ]
        if quick:
            keep = {"rms_norm/gemma2-2b", "rope/llama3-8b", "swiglu/qwen2-1.5b"}
            cases = [c for c in cases if c.name in keep]
    if only:
        fam = lambda c: "glu" if "glu" in c.name else c.name.split("/")[0]
        cases = [c for c in cases if fam(c) in only]
    return cases


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one shape per kernel")
    ap.add_argument("--sweep", action="store_true", help="sweep block configs and print the best per table key")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (runs on CPU in interpret mode)")
    ap.add_argument("--full", action="store_true", help="also [16384,4096] RMSNorm, RoPE at batch 8 and erf-GEGLU")
    ap.add_argument("--only", default="", help="comma list of kernel families: rms_norm,rope,glu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--runs", type=int, default=25)
    a = ap.parse_args()
    only = {s.strip() for s in a.only.split(",") if s.strip()} or None
    cases = build_cases(a.quick, a.tiny, jnp.dtype(a.dtype), only, a.full, a.sweep)
    if a.sweep:
        seen = set()
        for c in cases:
            key = (c.name.split("/")[0], json.dumps(c.extra.get("table_key")))
            if key in seen:  # one sweep per table key
                continue
            seen.add(key)
            sweep(c, max(20, a.runs - 5) if not a.tiny else 3)
    else:
        for c in cases:
            measure(c, a.runs if not a.tiny else 3)


if __name__ == "__main__":
    main()
