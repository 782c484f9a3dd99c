"""Flash attention benchmark: Pallas kernel vs cuDNN vs XLA (the jitted reference), one JSON line each.

    python bench/attention.py            # D=128 and 256, S=2048/4096/8192, causal, GQA 4:1 and 1:1, + Gemma 2
    python bench/attention.py --quick    # two shapes, for a smoke run
    python bench/attention.py --sweep    # time each kernel over block sizes / warps / stages, print the best

FLOPs: a causal forward counts half of 4*B*Hq*S*S*D (a sliding window w < S counts the pairs inside the
band, S*S/2 - (S-w)^2/2, instead of S*S/2); forward+backward counts 3.5x the forward (the backward's five
matmuls are 2.5x the forward's two), the convention under which ANCHORS.md's cuDNN figures are quoted.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.timing import device_ms, peak_bytes  # noqa: E402
from pallas_kernels.flash_attention import (KernelBlocks, _Static, _delta, _dkdv_call, _dq_call, _fwd_call,  # noqa: E402
                                            dkdv_head_split, flash_attention, get_config, shape_class)
import pallas_kernels.reference as reference  # noqa: E402
from pallas_kernels._common import resolve_interpret  # noqa: E402

FWDBWD_FACTOR = 3.5


def _device() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '?')}"


def _fwd_flops(b, s, hq, d, causal, window):
    if not causal:
        pairs = s * s
    elif window is not None and window < s:
        pairs = s * s / 2 - (s - window) ** 2 / 2
    else:
        pairs = s * s / 2
    return 4.0 * b * hq * d * pairs


def _inputs(b, s, hq, hkv, d, dtype, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(keys[0], (b, s, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (b, s, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (b, s, hkv, d), jnp.float32).astype(dtype)
    do = jax.random.normal(keys[3], (b, s, hq, d), jnp.float32).astype(dtype)
    return q, k, v, do


def _make(impl, causal, window, softcap):
    if impl == "pallas":
        def f(q, k, v):
            return flash_attention(q, k, v, causal=causal, sliding_window=window, softcap=softcap)
    elif impl == "xla":
        def f(q, k, v):
            return reference.flash_attention(q, k, v, causal=causal, sliding_window=window, softcap=softcap)
    elif impl == "cudnn":
        if softcap is not None:
            return None
        local = None if window is None else (window - 1, 0)

        def f(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, local_window_size=local,
                                                implementation="cudnn")
    else:
        raise ValueError(impl)
    return f


def _measure(name, impl, b, s, hq, hkv, d, dtype, causal=True, window=None, softcap=None, iters=20):
    f = _make(impl, causal, window, softcap)
    if f is None:
        return None
    q, k, v, do = _inputs(b, s, hq, hkv, d, dtype)

    def fwdbwd(q_, k_, v_, do_):
        out, vjp = jax.vjp(f, q_, k_, v_)
        return vjp(do_)

    rec = dict(name=name, shape=dict(B=b, S=s, Hq=hq, Hkv=hkv, D=d), dtype=jnp.dtype(dtype).name, impl=impl,
               causal=causal, window=window, softcap=softcap, jax_version=jax.__version__, device=_device())
    try:
        out = jax.jit(f)(q, k, v)
        rec["fwd_ms"] = device_ms(f, q, k, v, runs=iters)
        rec["fwdbwd_ms"] = device_ms(fwdbwd, q, k, v, do, runs=iters)
        flops = _fwd_flops(b, s, hq, d, causal, window)
        rec["fwd_tflops"] = flops / rec["fwd_ms"] / 1e9
        rec["fwdbwd_tflops"] = FWDBWD_FACTOR * flops / rec["fwdbwd_ms"] / 1e9
        rec["peak_bytes"] = peak_bytes(fwdbwd, q, k, v, do)
        rec["_out"] = out
    except Exception as e:  # noqa: BLE001 - report and continue with the other measurements
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return rec


def _rel(a, b):
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _emit(recs):
    by = {r["impl"]: r for r in recs if r is not None}
    p = by.get("pallas")
    for impl in ("cudnn", "xla"):
        r = by.get(impl)
        if p is None or r is None or "error" in p or "error" in r:
            continue
        p[f"fwd_speedup_vs_{impl}"] = r["fwd_ms"] / p["fwd_ms"]
        p[f"fwdbwd_speedup_vs_{impl}"] = r["fwdbwd_ms"] / p["fwdbwd_ms"]
        p[f"out_rel_err_vs_{impl}"] = _rel(p["_out"], r["_out"])
    for r in by.values():
        r.pop("_out", None)
        print(json.dumps(r), flush=True)


def run_default(quick: bool, seqs=None, tokens: int = 16384, softcap_only: bool = False):
    """tokens = B * S per shape; `seqs` overrides the sequence lengths (e.g. tiny ones for a CPU check)."""
    dt = jnp.bfloat16
    cases = []
    if softcap_only:
        for s in (4096, 8192):
            cases.append(("gemma2_softcap_window", 256, s, 8, 4, 4096, 50.0))
    elif seqs:
        for s in seqs:
            cases.append(("mha_causal", 128, s, 16, 4, None, None))
            cases.append(("gemma2_softcap_window", 256, s, 8, 4, max(1, s // 2), 50.0))
    elif quick:
        cases.append(("mha_causal", 128, 2048, 16, 4, None, None))
        cases.append(("gemma2_softcap_window", 256, 8192, 8, 4, 4096, 50.0))
    else:
        for d, hq in ((128, 16), (256, 8)):
            for s in (2048, 4096, 8192):
                for g in (4, 1):
                    cases.append(("mha_causal", d, s, hq, hq // g, None, None))
        for s in (4096, 8192):
            cases.append(("gemma2_softcap_window", 256, s, 8, 4, 4096, 50.0))
    for name, d, s, hq, hkv, window, softcap in cases:
        b = max(1, tokens // s)
        recs = []
        for impl in ("pallas", "cudnn", "xla"):
            iters = 10 if (impl == "xla" and s >= 8192) else 20
            recs.append(_measure(name, impl, b, s, hq, hkv, d, dt, causal=True, window=window,
                                 softcap=softcap, iters=iters))
        _emit(recs)


# ------------------------------------------------------------------------------------------ sweep
def _kernel_inputs(st, b, s, hq, hkv, d, dtype):
    """Inputs of the three kernels (the forward's lse and delta computed once with the table's config)."""
    q, k, v, do = _inputs(b, s, hq, hkv, d, dtype)
    o, lse = jax.jit(lambda *a: _fwd_call(*a, None, None, None, st))(q, k, v)
    delta = _delta(o, do)
    return {"fwd": (q, k, v), "dkdv": (q, k, v, do, lse, delta), "dq": (q, k, v, do, lse, delta)}


def _kernel_fn(kernel, st):
    """A jitted single-kernel callable, to time one kernel at a time."""
    if kernel == "fwd":
        return jax.jit(lambda q_, k_, v_: _fwd_call(q_, k_, v_, None, None, None, st))
    call = _dkdv_call if kernel == "dkdv" else _dq_call
    return jax.jit(lambda q_, k_, v_, do_, l_, d_: call(q_, k_, v_, do_, l_, d_, None, None, None, st))


# Matmul work of each kernel in units of the forward's (2 matmuls): dK/dV recomputes S and dP and does
# dV and dK (4), dQ recomputes S and dP and does dQ (3).
_WORK = {"fwd": 1.0, "dkdv": 2.0, "dq": 1.5}


# Candidates per (head_dim, kernel): (block_q, block_k, num_warps, num_stages). Picked around the table's
# entries among tiles that compile for sm_90a without (or with few) register spills.
_CANDIDATES = {
    64: {
        "fwd": [(128, 64, 4, 3), (128, 64, 4, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3),
                (64, 64, 4, 3), (64, 128, 4, 2), (128, 32, 4, 3)],
        "dkdv": [(64, 128, 8, 2), (32, 128, 8, 2), (64, 128, 8, 3), (32, 128, 4, 2), (64, 64, 4, 2),
                 (128, 128, 8, 2), (32, 64, 4, 3)],
        "dq": [(128, 64, 8, 2), (128, 64, 4, 2), (128, 32, 4, 3), (128, 128, 8, 2), (64, 64, 4, 2),
               (128, 64, 8, 3)],
    },
    128: {
        "fwd": [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3),
                (64, 64, 4, 2), (64, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3), (128, 64, 8, 4)],
        "dkdv": [(32, 128, 8, 2), (32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 8, 2), (16, 128, 8, 2),
                 (64, 64, 8, 2), (32, 64, 4, 2), (32, 128, 4, 3), (64, 64, 4, 3), (64, 128, 8, 3)],
        "dq": [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 2), (128, 32, 8, 3), (64, 64, 4, 2),
               (64, 32, 4, 3), (128, 128, 8, 2), (64, 64, 8, 2), (64, 128, 8, 2), (128, 64, 4, 3)],
    },
    256: {
        "fwd": [(64, 64, 8, 2), (64, 32, 8, 2), (64, 32, 8, 3), (64, 64, 8, 3), (128, 32, 8, 2),
                (128, 64, 8, 2), (64, 32, 4, 2), (64, 64, 4, 2), (128, 32, 8, 3), (128, 64, 8, 3)],
        "dkdv": [(64, 32, 8, 2), (32, 32, 8, 2), (32, 64, 8, 2), (16, 64, 8, 2), (64, 64, 8, 2),
                 (32, 32, 4, 2), (16, 32, 4, 2), (32, 64, 4, 2), (64, 64, 8, 3), (32, 128, 8, 2)],
        "dq": [(64, 32, 8, 2), (64, 64, 8, 2), (32, 64, 4, 2), (128, 32, 8, 2), (64, 16, 4, 2),
               (32, 32, 4, 2), (64, 32, 8, 3), (64, 64, 4, 2), (128, 64, 8, 2)],
    },
}


# Edge candidates (`--extra`): deeper pipelines and larger tiles than the winners among _CANDIDATES.
_EXTRA_CANDIDATES = {
    128: {
        "fwd": [(128, 128, 8, 3), (128, 128, 8, 4), (128, 128, 8, 5), (128, 64, 8, 5)],
        "dkdv": [(64, 128, 8, 3), (64, 128, 8, 4), (64, 128, 8, 5), (128, 128, 8, 2), (128, 128, 8, 3),
                 (64, 128, 4, 3)],
        "dq": [(128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 8, 5), (128, 128, 8, 3), (128, 32, 8, 4)],
    },
    256: {
        "fwd": [(128, 64, 8, 2), (128, 32, 8, 4), (128, 64, 4, 2), (64, 64, 4, 3)],
        "dkdv": [(64, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3), (128, 32, 8, 2)],
        "dq": [(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (128, 32, 4, 2), (64, 128, 8, 2)],
    },
}


def _candidates(kernel, d):
    for c in _CANDIDATES[min(_CANDIDATES, key=lambda x: abs(x - d))][kernel]:
        yield KernelBlocks(*c)


def _split_sweep(d, kb, dt, s, b, hq=12, hkv=2):
    """dK/dV time vs how many programs share a KV group (default: a small-grid GQA shape, Qwen2-1.5B-like)."""
    auto = dkdv_head_split(hq // hkv, b, hkv, -(-s // kb.block_k))
    for split in [n for n in range(1, hq // hkv + 1) if (hq // hkv) % n == 0]:
        cfg = dataclasses.replace(get_config(s, dt, d), dkdv=kb, dkdv_split=split)
        st = _Static(seq_len=s, groups=hq // hkv, causal=True, window=None, softcap=None, scale=d ** -0.5,
                     has_segments=False, interpret=resolve_interpret(None), config=cfg)
        rec = dict(name="sweep_dkdv_split", D=d, shape=dict(B=b, S=s, Hq=hq, Hkv=hkv), config=dataclasses.astuple(kb),
                   dkdv_split=split, auto_split=auto, jax_version=jax.__version__, device=_device())
        try:
            inputs = _kernel_inputs(st, b, s, hq, hkv, d, dt)["dkdv"]
            rec["ms"] = device_ms(_kernel_fn("dkdv", st), *inputs)
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(json.dumps(rec), flush=True)


def run_sweep(dims, seq, softcap_case: bool, tokens: int = 16384, kernels=("fwd", "dkdv", "dq"),
              table_only: bool = False, exp2_ab: bool = False):
    """Time each kernel alone over candidate blocks (table_only: the table's own blocks), and over the math
    options: fast_tanh off/on in the softcap case, fast_exp2 off/on with exp2_ab."""
    dt = jnp.bfloat16
    best_all = {}
    for d in dims:
        hq = 16 if d <= 128 else 8
        hkv = hq // 4
        b = max(1, tokens // seq)
        base = get_config(seq, dt, d)
        window = 4096 if (softcap_case and seq > 4096) else None
        softcap = 50.0 if softcap_case else None
        tanh_opts = (False, True) if softcap_case else (base.fast_tanh,)
        exp2_opts = (False, True) if exp2_ab else (base.fast_exp2,)
        flops = _fwd_flops(b, seq, hq, d, True, window)

        def static(cfg):
            return _Static(seq_len=seq, groups=hq // hkv, causal=True, window=window, softcap=softcap,
                           scale=d ** -0.5, has_segments=False, interpret=resolve_interpret(None),
                           config=cfg)

        inputs = _kernel_inputs(static(base), b, seq, hq, hkv, d, dt)
        for kernel in kernels:
            results = []
            blocks = [getattr(base, kernel)] if table_only else list(_candidates(kernel, d))
            for fast, fast_exp2 in itertools.product(tanh_opts, exp2_opts):
                for kb in blocks:
                    cfg = dataclasses.replace(base, **{kernel: kb}, fast_tanh=fast, fast_exp2=fast_exp2)
                    rec = dict(name="sweep", kernel=kernel, D=d, S=seq, softcap=softcap, window=window,
                               fast_tanh=fast, fast_exp2=fast_exp2, config=dataclasses.astuple(kb),
                               jax_version=jax.__version__, device=_device())
                    try:
                        ms = device_ms(_kernel_fn(kernel, static(cfg)), *inputs[kernel])
                        rec.update(ms=ms, tflops=_WORK[kernel] * flops / ms / 1e9)
                        results.append((ms, cfg))
                    except Exception as e:  # noqa: BLE001 - out of shared memory etc.
                        rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    print(json.dumps(rec), flush=True)
            if results:
                ms, best = min(results, key=lambda r: r[0])
                kb = getattr(best, kernel)
                best_all[(d, kernel)] = best
                if kernel == "dkdv" and not softcap_case and not table_only:
                    _split_sweep(d, kb, dt, min(seq, 2048), max(1, tokens // (2 * min(seq, 2048))))
                    _split_sweep(d, kb, dt, seq, b, hq, hkv)  # the sweep's own shape
                print(json.dumps(dict(name="sweep_best", kernel=kernel, D=d, S=seq, softcap=softcap,
                                      fast_tanh=best.fast_tanh, fast_exp2=best.fast_exp2,
                                      config=dataclasses.astuple(kb), ms=ms, jax_version=jax.__version__,
                                      device=_device())), flush=True)
    for d in dims:
        parts = {kn: best_all.get((d, kn)) for kn in ("fwd", "dkdv", "dq")}
        if all(parts.values()):
            print(json.dumps(dict(name="sweep_table_entry", key=[shape_class(seq), "bfloat16", d],
                                  **{kn: dataclasses.astuple(getattr(c, kn)) for kn, c in parts.items()},
                                  fast_tanh=any(c.fast_tanh for c in parts.values()),
                                  fast_exp2=any(c.fast_exp2 for c in parts.values()))), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two shapes only (smoke run)")
    ap.add_argument("--sweep", action="store_true", help="time each kernel over candidate configs")
    ap.add_argument("--dims", default="128,256", help="head dims for --sweep (comma separated)")
    ap.add_argument("--seq", type=int, default=4096, help="sequence length for --sweep")
    ap.add_argument("--softcap", action="store_true", help="--sweep the Gemma 2 softcap(+window) case")
    ap.add_argument("--kernels", default="fwd,dkdv,dq", help="kernels to --sweep (comma separated)")
    ap.add_argument("--extra", action="store_true", help="--sweep only the extra (edge) candidates")
    ap.add_argument("--table-only", action="store_true", help="--sweep only the table's own blocks")
    ap.add_argument("--exp2", action="store_true", help="--sweep fast_exp2 off and on")
    ap.add_argument("--seqs", default="", help="override the default run's sequence lengths (comma separated)")
    ap.add_argument("--tokens", type=int, default=16384, help="B * S of each default-run shape")
    ap.add_argument("--softcap-only", action="store_true", help="only the Gemma 2 softcap+window rows")
    args = ap.parse_args()
    if args.sweep:
        if args.extra:
            _CANDIDATES.clear()
            _CANDIDATES.update(_EXTRA_CANDIDATES)
        run_sweep([int(x) for x in args.dims.split(",")], args.seq, args.softcap, args.tokens,
                  tuple(args.kernels.split(",")), args.table_only, args.exp2)
    else:
        run_default(args.quick, [int(x) for x in args.seqs.split(",") if x], args.tokens, args.softcap_only)


if __name__ == "__main__":
    main()
