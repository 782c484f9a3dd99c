"""NF4 benchmarks: dequantization bandwidth, fused 4-bit matmul vs dequantize+matmul vs bf16 matmul.

    python bench/nf4.py            # full run (ANCHORS.md layer shapes, M = 1, 16, 4096, 8192 + threshold)
    python bench/nf4.py --quick    # smoke run: two shapes, M = 1 and 4096
    python bench/nf4.py --sweep    # block-size sweeps; prints the best config per table key
    python bench/nf4.py --only llama3-8b   # restrict the full run to some layers

One JSON line per measurement: name, shape, dtype, impl ("pallas" | "xla"), fwd_ms, fwdbwd_ms, gbps or tflops,
peak_bytes (XLA's temp allocation of the single-call executable), jax_version, device, plus extras.

Timing: bench/timing.py (K calls on K distinct input copies inside one jitted program, median / K). "fwd" is y = f(x); "fwdbwd" is y plus dx for a random cotangent. Shapes "AxB" are in x out
features: the weight is [B, A] (HF layout).
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_kernels.nf4 as nf4  # noqa: E402
import pallas_kernels.nf4_format as nf4_format  # noqa: E402
import pallas_kernels.reference as ref  # noqa: E402
from pallas_kernels._common import resolve_interpret  # noqa: E402
from bench.timing import device_ms, emit, temp_bytes  # noqa: E402

# (label, in_features, out_features)
LAYERS = [
    ("qwen2-1.5b/gate_up", 1536, 8960),
    ("qwen2-1.5b/down", 8960, 1536),
    ("qwen2-1.5b/o", 1536, 1536),
    ("llama3-8b/gate_up", 4096, 14336),
    ("llama3-8b/down", 14336, 4096),
    ("llama3-8b/o", 4096, 4096),
]
M_MAIN = [1, 16, 4096, 8192]
M_THRESHOLD = [64, 256, 1024]
HBM_CEILING_GBPS = 3000.0
INTERPRET = resolve_interpret(None)  # False on a GPU; lets the harness be smoke-tested on a CPU


def make_weight(key, n_out, n_in):
    w = (jax.random.normal(key, (n_out, n_in), jnp.float32) * 0.02).astype(jnp.bfloat16)
    return w, nf4_format.quantize_nf4(w)


# ------------------------------------------------------------------------------------------------------
# dequantization
# ------------------------------------------------------------------------------------------------------


def dequant_bytes(q: nf4_format.NF4Weight, out_itemsize: int) -> int:
    return q.nbytes_packed + q.nblocks + 4 * q.nblocks2 + 4 + q.numel * out_itemsize


def bench_dequant(layers, dtype="bfloat16"):
    key = jax.random.PRNGKey(0)
    for label, n_in, n_out in layers:
        _, q = make_weight(key, n_out, n_in)
        nbytes = dequant_bytes(q, jnp.dtype(dtype).itemsize)
        for impl, fn in (("pallas", lambda q: nf4.dequantize_nf4(q, dtype)),
                         ("xla", lambda q: ref.dequantize_nf4(q, dtype))):
            ms = device_ms(fn, q)
            gbps = nbytes / ms / 1e6
            emit(name="nf4_dequantize", layer=label, shape=[n_out, n_in], dtype=dtype, impl=impl, fwd_ms=ms,
                 fwdbwd_ms=None, gbps=gbps, pct_of_3tbps=100 * gbps / HBM_CEILING_GBPS,
                 peak_bytes=temp_bytes(fn, q), bytes_moved=nbytes)


# ------------------------------------------------------------------------------------------------------
# matmul
# ------------------------------------------------------------------------------------------------------


def _impls():
    return {
        "fused": ("pallas", lambda x, q, w: nf4.nf4_matmul(x, q, impl="fused")),
        "dequant+dot": ("pallas", lambda x, q, w: nf4.nf4_matmul(x, q, impl="dequant")),
        "auto": ("pallas", lambda x, q, w: nf4.nf4_matmul(x, q)),
        "reference": ("xla", lambda x, q, w: ref.nf4_matmul(x, q)),
        "bf16_dense": ("xla", lambda x, q, w: jnp.dot(x, w.T)),
    }


def _steps(fn):
    def fwd(x, q, w, g):
        return fn(x, q, w)

    def fwdbwd(x, q, w, g):
        y, vjp = jax.vjp(lambda x_: fn(x_, q, w), x)
        return y, vjp(g)[0]

    return fwd, fwdbwd


def bench_matmul(layers, ms_list, impls, with_bwd=True, dtype="bfloat16"):
    key = jax.random.PRNGKey(1)
    table = _impls()
    results = {}
    for label, n_in, n_out in layers:
        w, q = make_weight(key, n_out, n_in)
        for m in ms_list:
            kx, kg = jax.random.split(jax.random.fold_in(key, m))
            x = jax.random.normal(kx, (m, n_in), jnp.float32).astype(dtype)
            g = jax.random.normal(kg, (m, n_out), jnp.float32).astype(dtype)
            flops = 2.0 * m * n_in * n_out
            for name in impls:
                kind, fn = table[name]
                fwd, fwdbwd = _steps(fn)
                t_f = device_ms(fwd, x, q, w, g)
                # M = 1 is decoding (no backward); the backward is timed from M = 16 up.
                t_fb = device_ms(fwdbwd, x, q, w, g) if with_bwd and m > 1 else None
                results[(label, m, name)] = t_f
                emit(name=f"nf4_matmul/{name}", layer=label, shape=[m, n_in, n_out], dtype=dtype, impl=kind,
                     fwd_ms=t_f, fwdbwd_ms=t_fb, tflops=flops / t_f / 1e9,
                     tflops_fwdbwd=(2 * flops / t_fb / 1e9) if t_fb else None,
                     peak_bytes=(temp_bytes(fwd, x, q, w, g)  # the program device_ms compiled
                                 if m == max(ms_list) and m >= 4096 and name != "bf16_dense" else None),
                     auto_path=nf4._choose_impl(m, q, dtype, None))
    return results


def report_threshold(results, layers, ms_list):
    """Largest M where the fused kernel beats dequantize + XLA matmul (forward), per layer and overall."""
    per_layer = {}
    for label, _, _ in layers:
        wins = [m for m in ms_list if (label, m, "fused") in results and (label, m, "dequant+dot") in results
                and results[(label, m, "fused")] < results[(label, m, "dequant+dot")]]
        losses = [m for m in ms_list if (label, m, "fused") in results and m not in wins]
        # threshold = largest M below the first loss
        first_loss = min(losses) if losses else None
        thr = max([m for m in wins if first_loss is None or m < first_loss], default=0)
        per_layer[label] = thr
        emit(name="nf4_fused_threshold", layer=label, dtype="bfloat16", impl="pallas", fwd_ms=None,
             fwdbwd_ms=None, max_m_fused_wins=thr, tested_m=sorted(ms_list))
    overall = min(per_layer.values()) if per_layer else 0
    emit(name="nf4_fused_threshold_summary", dtype="bfloat16", impl="pallas", fwd_ms=None, fwdbwd_ms=None,
         suggested_FUSED_MAX_M=overall, per_layer=per_layer,
         current_FUSED_MAX_M=nf4._FUSED_MAX_M["bfloat16"])


# ------------------------------------------------------------------------------------------------------
# sweeps
# ------------------------------------------------------------------------------------------------------


def sweep_dequant():
    key = jax.random.PRNGKey(2)
    best = {}
    for label, n_in, n_out in (LAYERS[3], LAYERS[0]):
        _, q = make_weight(key, n_out, n_in)
        nbytes = dequant_bytes(q, 2)
        cls = "large" if q.numel >= (1 << 22) else "small"
        for bb, nw, lut in itertools.product([1024, 2048, 4096, 8192], [4, 8], ["select", "gather"]):
            cfg = dict(block_bytes=bb, num_warps=nw, num_stages=1, lut=lut)

            def step(q, cfg=cfg):
                return nf4._dequant_flat_call(q, "bfloat16", cfg, INTERPRET)
            try:
                ms = device_ms(step, q, runs=10)
            except Exception as e:  # a config that does not compile is just skipped
                emit(name="sweep/dequant", layer=label, config=cfg, error=str(e)[:200], fwd_ms=None,
                     fwdbwd_ms=None, dtype="bfloat16", impl="pallas")
                continue
            gbps = nbytes / ms / 1e6
            emit(name="sweep/dequant", layer=label, shape=[n_out, n_in], config=cfg, dtype="bfloat16",
                 impl="pallas", fwd_ms=ms, fwdbwd_ms=None, gbps=gbps)
            k = (cls, "bfloat16")
            if k not in best or gbps > best[k][1]:
                best[k] = (cfg, gbps)
    for k, (cfg, gbps) in best.items():
        emit(name="sweep/dequant/best", key=list(k), config=cfg, gbps=gbps, dtype="bfloat16", impl="pallas",
             fwd_ms=None, fwdbwd_ms=None)


def sweep_matmul():
    key = jax.random.PRNGKey(3)
    label, n_in, n_out = LAYERS[3]  # 4096 -> 14336
    w, q = make_weight(key, n_out, n_in)
    best = {}
    for m, direction in itertools.product([16, 64], ["fwd", "bwd"]):
        cls = "m16" if m <= 16 else "m64"
        a = jax.random.normal(jax.random.fold_in(key, m), (m, n_in if direction == "fwd" else n_out),
                              jnp.float32).astype(jnp.bfloat16)

        def run(cfg):
            def step(a, q, cfg=cfg):
                return nf4._fused_call(a, q, direction, cfg, INTERPRET)
            return device_ms(step, a, q, runs=10)

        base = dict(nf4._matmul_config(m, "bfloat16", direction))
        results = []
        stage1 = itertools.product([32, 64, 128], [64, 128, 256], [132, 264, 528])
        for bn, bk, tp in stage1:
            cfg = dict(base, block_n=bn, block_k=bk, target_programs=tp, num_warps=4, num_stages=3)
            results.append(_try_cfg(run, cfg, f"sweep/matmul_{direction}", m, label))
        results = [r for r in results if r is not None]
        top = min(results, key=lambda r: r[1])[0]
        for nw, ns, lut in itertools.product([2, 4, 8], [2, 3, 4], ["select", "gather"]):
            cfg = dict(top, num_warps=nw, num_stages=ns, lut=lut)
            r = _try_cfg(run, cfg, f"sweep/matmul_{direction}", m, label)
            if r is not None:
                results.append(r)
        cfg, ms = min(results, key=lambda r: r[1])
        best[(cls, "bfloat16", direction)] = (cfg, ms)
    for k, (cfg, ms) in best.items():
        emit(name="sweep/matmul/best", key=list(k), config=cfg, fwd_ms=ms, fwdbwd_ms=None, dtype="bfloat16",
             impl="pallas")


def _try_cfg(run, cfg, name, m, label):
    try:
        ms = run(cfg)
    except Exception as e:
        emit(name=name, layer=label, m=m, config=cfg, error=str(e)[:200], fwd_ms=None, fwdbwd_ms=None,
             dtype="bfloat16", impl="pallas")
        return None
    emit(name=name, layer=label, m=m, config=cfg, fwd_ms=ms, fwdbwd_ms=None, dtype="bfloat16", impl="pallas")
    return cfg, ms


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two shapes, M = 1 and 4096 (smoke run)")
    ap.add_argument("--sweep", nargs="?", const="all", choices=["all", "dequant", "matmul"],
                    help="sweep block sizes (all, or only the dequant / fused matmul kernels); print the best")
    ap.add_argument("--m", default=None, help="comma list of M for the matmul table (default 1,16,4096,8192 "
                    "plus the fused-threshold M values)")
    ap.add_argument("--only", default=None, help="only layers whose label contains this (e.g. llama3-8b)")
    args = ap.parse_args()
    if jax.default_backend() != "gpu":
        print("# warning: no GPU; kernels run in interpret mode and timings are meaningless", file=sys.stderr)
    if args.sweep:
        if args.sweep in ("all", "dequant"):
            sweep_dequant()
        if args.sweep in ("all", "matmul"):
            sweep_matmul()
        return
    if args.quick:
        layers = [LAYERS[0], LAYERS[5]]
        bench_dequant(layers)
        res = bench_matmul(layers, [1, 4096], ["fused", "dequant+dot", "reference", "bf16_dense"], with_bwd=True)
        report_threshold(res, layers, [1, 4096])
        return
    layers = [lay for lay in LAYERS if args.only is None or args.only in lay[0]]
    bench_dequant(LAYERS)  # cheap: every layer shape
    # --m: just those M; else the main M values plus forward-only threshold points
    ms, extra = ([int(m) for m in args.m.split(",")], []) if args.m else (M_MAIN, M_THRESHOLD)
    res = bench_matmul(layers, ms, ["fused", "dequant+dot", "reference", "bf16_dense"])
    if extra:
        res.update(bench_matmul(layers, extra, ["fused", "dequant+dot"], with_bwd=False))
    report_threshold(res, layers, ms + extra)


if __name__ == "__main__":
    main()
