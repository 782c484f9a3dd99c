#!/usr/bin/env python
"""Benchmark pallas_kernels.decode_linear.stacked_linear (decode GEMM on one layer of a stacked kernel, read in
place, LoRA fused) against XLA, at the Qwen2-1.5B and Llama-3-8B projection shapes, M in {1, 16, 128}, bf16.

Prints one JSON line per measurement: name ("decode_linear"), model, proj, M, K, N, L, r (0 = no LoRA), impl,
ms (median), weight_gbs (K*N*2 bytes of one layer per ms: the roofline is HBM bandwidth), the resolved config
for Pallas rows, jax_version, device. Impls:
  pallas      stacked_linear(x, w, layer) with the layer a Python int (compiled into the kernel)
  pallas_rt   the same with the layer an int32 array (read by the kernel at run time: one compiled kernel for
              every layer)
  xla_layer   x @ w_i with w_i its own [K, N] buffer (the "copy" / per-layer weights of the engine)
  xla_slice   x @ w[layer] inside the jitted function (XLA copies the slice before its GEMM)
With LoRA (r=16), the XLA rows add scale * (x @ a) @ b as XLA ops (what ops.linear does unfused).

Timing: bench/timing.device_ms (K calls on K copies of the arguments inside one jitted program, median wall
time / K, chained by optimization barriers). The stack has L=4 layers and layer 3 is read; only that layer's
bytes are touched, so for the smallest shape (1536 x 256, 0.8 MB) the K copies (<= 64) may partly stay in the
50 MB L2: its GB/s is optimistic for every impl alike.

  python bench/decode_linear_bench.py                 # all shapes, M in {1, 16, 128}, r in {0, 16}
  python bench/decode_linear_bench.py --quick         # two shapes, M=16, r=16
  python bench/decode_linear_bench.py --sweep --m 16  # configs per shape (r=16), then a "best" line per shape
  options: --models qwen2-1.5b,llama-3-8b  --m 1,16,128  --impls pallas,pallas_rt,xla_layer,xla_slice
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import itertools  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.timing import device_ms, emit  # noqa: E402
from pallas_kernels.decode_linear import DecodeConfig, pick_config, resolve_config, stacked_linear  # noqa: E402

SHAPES = [  # (model, projection, K, N)
    ("qwen2-1.5b", "q_o", 1536, 1536),
    ("qwen2-1.5b", "k_v", 1536, 256),
    ("qwen2-1.5b", "gate_up", 1536, 8960),
    ("qwen2-1.5b", "down", 8960, 1536),
    ("llama-3-8b", "q_o", 4096, 4096),
    ("llama-3-8b", "k_v", 4096, 1024),
    ("llama-3-8b", "gate_up", 4096, 14336),
    ("llama-3-8b", "down", 14336, 4096),
]
QUICK = [SHAPES[2], SHAPES[4]]
L_STACK = 4
LAYER = L_STACK - 1
RANK = 16
SCALE = 2.0
DTYPE = jnp.bfloat16
# timing knobs: fewer runs than the default (about 150 measurements must fit in ~90 s); at most 2 GB of copies
TIMING = dict(runs=10, target_ms=2.0, max_bytes=2 << 30)
SWEEP_TIMING = dict(runs=5, target_ms=1.0, max_bytes=1 << 30)




def _inputs(m, k, n, r, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(ks[0], (m, k), DTYPE)
    w = (jax.random.normal(ks[1], (L_STACK, k, n), jnp.float32) / k ** 0.5).astype(DTYPE)
    a = (jax.random.normal(ks[2], (k, r), jnp.float32) / k ** 0.5).astype(DTYPE) if r else None
    b = jax.random.normal(ks[3], (r, n), DTYPE) if r else None
    return x, w, a, b


def _lora_xla(x, a, b):
    return (SCALE * jnp.dot(jnp.dot(x, a), b, preferred_element_type=jnp.float32)).astype(x.dtype)


def _fns(r, cfg: DecodeConfig | None = None):
    """impl -> (fn, builds args from (x, w, a, b))."""
    lora = dict(lora_scale=SCALE) if r else {}

    def pallas(x, w, a, b):
        return stacked_linear(x, w, LAYER, lora_a=a, lora_b=b, config=cfg, interpret=False, **lora)

    def pallas_rt(x, w, layer, a, b):
        return stacked_linear(x, w, layer, lora_a=a, lora_b=b, config=cfg, interpret=False, **lora)

    def xla_layer(x, w_i, a, b):
        y = jnp.dot(x, w_i)
        return y + _lora_xla(x, a, b) if r else y

    def xla_slice(x, w, a, b):
        y = jnp.dot(x, w[LAYER])
        return y + _lora_xla(x, a, b) if r else y

    return {
        "pallas": (pallas, lambda x, w, a, b: (x, w, a, b)),
        "pallas_rt": (pallas_rt, lambda x, w, a, b: (x, w, jnp.int32(LAYER), a, b)),
        "xla_layer": (xla_layer, lambda x, w, a, b: (x, jnp.array(w[LAYER], copy=True), a, b)),
        "xla_slice": (xla_slice, lambda x, w, a, b: (x, w, a, b)),
    }


def _record(model, proj, m, k, n, r, impl, ms, cfg=None, **extra):
    rec = dict(name="decode_linear", model=model, proj=proj, M=m, K=k, N=n, L=L_STACK, r=r, dtype="bfloat16",
               impl=impl, ms=None if ms is None else round(ms, 5),
               weight_gbs=None if not ms else round(k * n * 2 / (ms * 1e-3) / 1e9, 1))
    if cfg is not None:
        rec["config"] = dataclasses.asdict(cfg)
    rec.update(extra)
    emit(**rec)


def _resolved(m, k, n, r, cfg=None):
    if cfg is None:
        return resolve_config(pick_config(m, k, n, DTYPE, r), m, k, n, DTYPE, r)
    return resolve_config(cfg, m, k, n, DTYPE, r, auto_shrink=False)


def run_compare(shapes, ms_, ranks, impls):
    for (model, proj, k, n), m, r in itertools.product(shapes, ms_, ranks):
        x, w, a, b = _inputs(m, k, n, r)
        ref = None
        for impl in impls:
            fn, make_args = _fns(r)[impl]
            args = make_args(x, w, a, b)
            try:
                y = jax.jit(fn)(*args)
                err = None
                if ref is None:
                    ref = y
                else:
                    err = float(jnp.linalg.norm((y - ref).astype(jnp.float32)) /
                                jnp.linalg.norm(ref.astype(jnp.float32)))
                ms = device_ms(fn, *args, **TIMING)
            except Exception as e:  # noqa: BLE001 - report and go on
                _record(model, proj, m, k, n, r, impl, None, error=f"{type(e).__name__}: {str(e)[:300]}")
                continue
            cfg = _resolved(m, k, n, r) if impl.startswith("pallas") else None
            _record(model, proj, m, k, n, r, impl, ms, cfg, rel_err_vs_first=err)
            del args


SWEEP_BLOCKS = [(32, 128), (64, 64), (64, 128), (64, 256), (128, 64), (128, 128)]   # (block_n, block_k)
SWEEP_SPLITS = [None, 1, 2, 4, 8]
SWEEP_WARPS = [4, 8]


def run_sweep(shapes, ms_, r, budget_s):
    t_end = time.time() + budget_s
    for (model, proj, k, n), m in itertools.product(shapes, ms_):
        x, w, a, b = _inputs(m, k, n, r)
        base = pick_config(m, k, n, DTYPE, r)
        xla_ms = device_ms(_fns(r)["xla_layer"][0], x, jnp.array(w[LAYER], copy=True), a, b, **SWEEP_TIMING)
        _record(model, proj, m, k, n, r, "xla_layer", xla_ms)
        best = None
        candidates = [None] + [dataclasses.replace(base, block_n=bn, block_k=bk, splits=s, num_warps=nw)
                               for (bn, bk), s, nw in itertools.product(SWEEP_BLOCKS, SWEEP_SPLITS, SWEEP_WARPS)]
        seen = set()
        for cand in candidates:
            if time.time() > t_end:
                emit(name="decode_linear_sweep", note="time budget reached; later configs not timed")
                return
            cfg = _resolved(m, k, n, r, cand)   # what stacked_linear will run for config=cand
            if cfg in seen:
                continue
            seen.add(cfg)
            fn = _fns(r, cand)["pallas"][0]
            try:
                ms = device_ms(fn, x, w, a, b, **SWEEP_TIMING)
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                _record(model, proj, m, k, n, r, "pallas_sweep", None, cfg, error=f"{type(e).__name__}: "
                                                                                   f"{str(e)[:200]}")
                continue
            _record(model, proj, m, k, n, r, "pallas_sweep" if cand is not None else "pallas_default", ms, cfg,
                    vs_xla_layer=round(xla_ms / ms, 3))
            if best is None or ms < best[0]:
                best = (ms, cfg)
        if best is not None:
            _record(model, proj, m, k, n, r, "pallas_best", best[0], best[1], vs_xla_layer=round(xla_ms / best[0], 3))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="two shapes, M=16, r=16")
    p.add_argument("--sweep", action="store_true", help="time block_n/block_k/splits/num_warps choices (r=16)")
    p.add_argument("--models", default="qwen2-1.5b,llama-3-8b")
    p.add_argument("--proj", default="", help="comma list of projections (q_o,k_v,gate_up,down); empty = all")
    p.add_argument("--m", default="1,16,128")
    p.add_argument("--impls", default="pallas,xla_layer,xla_slice",
                   help="comma list of pallas, pallas_rt, xla_layer, xla_slice")
    p.add_argument("--budget-s", type=float, default=540.0, help="sweep: stop timing configs after this long")
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("decode_linear_bench: needs a GPU (the Pallas kernel is timed compiled, not interpreted)",
              file=sys.stderr)
        return 2
    models = set(args.models.split(","))
    projs = set(filter(None, args.proj.split(",")))
    shapes = [s for s in (QUICK if args.quick else SHAPES) if s[0] in models and (not projs or s[1] in projs)]
    ms_ = [16] if args.quick else [int(v) for v in args.m.split(",")]
    if args.sweep:
        run_sweep(shapes, ms_, RANK, args.budget_s)
    else:
        run_compare(shapes, ms_, [RANK] if args.quick else [0, RANK], args.impls.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())
