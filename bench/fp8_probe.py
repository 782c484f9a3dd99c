"""FP8 frozen-base matmul vs bf16 at the Llama-3-8B and Qwen2-1.5B projection shapes (one JSON line each).

    python bench/fp8_probe.py [--quick]

For each GEMM M x K -> N: bf16 forward (x @ W), bf16 input gradient (g @ W^T), and pallas_kernels.fp8's
fp8_matmul forward and input gradient including the on-the-fly per-row quantization of x (or g), timed with
bench/timing.py. Also reports whether the compiled forward calls a cuBLASLt FP8 GEMM (an f8 custom call in the
optimized HLO) and the relative error of the FP8 result against the float32 matmul.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.timing import device_ms  # noqa: E402
from pallas_kernels.fp8 import fp8_matmul, quantize_fp8_weight  # noqa: E402

SHAPES = [  # (name, M tokens, K in, N out)
    ("8b_gate_up", 4096, 4096, 14336), ("8b_down", 4096, 14336, 4096), ("8b_q_o", 4096, 4096, 4096),
    ("8b_kv", 4096, 4096, 1024), ("1.5b_gate_up", 8192, 1536, 8960), ("1.5b_down", 8192, 8960, 1536),
]


def _uses_fp8_gemm(fn, *args) -> bool:
    text = jax.jit(fn).lower(*args).compile().as_text()
    return any(tag in text for tag in ("f8e4m3fn", "f8e5m2")) and "cublas" in text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU check)")
    a = ap.parse_args()
    shapes = [(n, 64, 128, 96) for n, *_ in SHAPES[:2]] if a.quick else SHAPES
    key = jax.random.PRNGKey(0)
    for name, m, k, n in shapes:
        kx, kw, kg = jax.random.split(jax.random.fold_in(key, m * k + n), 3)
        x = jax.random.normal(kx, (m, k), jnp.bfloat16)
        w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
        g = jax.random.normal(kg, (m, n), jnp.bfloat16)
        q = quantize_fp8_weight(w)
        flop = 2 * m * k * n
        rows = {
            "bf16_fwd": (lambda x_, w_: x_ @ w_, (x, w)),
            "bf16_dx": (lambda g_, w_: g_ @ w_.T, (g, w)),
            "fp8_fwd": (fp8_matmul, (x, q)),
            "fp8_dx": (lambda g_, x_, q_: jax.vjp(lambda t: fp8_matmul(t, q_), x_)[1](g_)[0], (g, x, q)),
        }
        out = {"name": "fp8_probe", "gemm": name, "m": m, "k": k, "n": n}
        for label, (fn, args) in rows.items():
            ms = device_ms(fn, *args)
            out[f"{label}_ms"] = round(ms, 4)
            out[f"{label}_tflops"] = round(flop / ms / 1e9, 1)
        ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
        got = np.asarray(fp8_matmul(x, q), np.float32)
        out["fp8_fwd_relerr"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        out["fp8_gemm_in_hlo"] = _uses_fp8_gemm(fp8_matmul, x, q)
        out["device"] = jax.devices()[0].device_kind
        out["jax"] = jax.__version__
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
