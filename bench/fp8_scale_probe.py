"""FP8 scale granularity on the real SmolLM2-135M-Instruct: would finer scales bring the FP8 base's logits
error (8.87% in float32 compute, bench/fp8_quality.py) within 5%?

    python bench/fp8_scale_probe.py [--out DIR] [--prompts 8] [--seeds 4]

What it simulates. The model is loaded through the project's API in float32 compute (as fp8_quality.py's
--dtype float32 does), from the same bf16 checkpoint, on the same alpaca prompts. For each scheme, every
projection (q/k/v/o, gate/up/down) is computed as float32 `dequant(quant(x)) @ dequant(quant(W))`, where
quant/dequant casts to float8_e4m3fn with the scheme's scales and back to float32 (ml_dtypes' e4m3fn through
jnp), with pallas_kernels/fp8.py's scale: scale = scale_of(amax) = max(amax / 448, 1e-12), q = e4m3(v * (1/scale)),
dequant = float32(q) * scale. The weight part replaces each stacked kernel [L, in, out] with its
quantize-dequantized value; the activation part wraps `unsloth_jax.ops.linear` (patched only inside this script,
restored afterwards) so the projection input is quantize-dequantized before the (dense) matmul. Embeddings, the
tied head, norms, attention and the GLU stay float32, as in load_in_fp8. Block scales over an axis whose size is
not a multiple of 128 (SmolLM2's hidden size 576 = 4.5 x 128, k/v out 192) use a ragged last block of 64 (padded
with zeros, which do not change its amax).

Weight scales (per layer W [in, out]):  channel = one per output column (max over all `in`, the current scheme);
block1x128 = one per output column per 128 input features; block128x128 = one per 128x128 tile.
Activation scales (x [..., in]): row = one per token (the current scheme); tile128 = one per token per 128
features; none = not quantized.

Noise. The quantized forward is chaotic at the level of float32 rounding: a 1-ulp change anywhere flips some
e4m3 roundings, which change the next layer's inputs, and so on, so two equally valid FP8 runs give different
quantization noise. Scheme (a) is the same numbers as the real model's plain-jnp twin (fp8_matmul_reference:
dequantize, then a float32 matmul), but fp8_matmul's order (e4m3 GEMM, then both scales) rounds differently and
lands on another realization. So each scheme is also run with --seeds realizations whose kernels are first
perturbed by a relative 1e-7 (about one float32 ulp; the unquantized model moves by far less, see the check
line), and the spread of the error is reported.

Prints first a check line: the real `load_in_fp8=True` model's error on the same prompts, the same model with
fp8_matmul replaced by fp8_matmul_reference (patched inside this script only), scheme (a)'s error and its
difference from both, and the unquantized model's change under the 1e-7 perturbation. Then one JSON line per
scheme: scheme, logits_rel_error and top1_agreement against the unquantized float32 model over the real tokens
(unperturbed kernels), tokens, and the perturbed realizations' errors (rel_error_seeds, mean, std) and top-1
agreements.
"""
import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.fp8_quality import compare_logits as compare, load, prompt_batch, smollm2_checkpoint  # noqa: E402
from pallas_kernels.fp8 import E4M3, scale_of  # noqa: E402

# scheme: (weight blocks over the kernel's (in, out) axes, activation block over x's last axis).
# A block size of None means the whole axis; "none" leaves the activations unquantized.
SCHEMES = {
    "a_channel_w+row_x": ((None, 1), None),
    "b_channel_w+none_x": ((None, 1), "none"),
    "c_block1x128_w+tile128_x": ((128, 1), 128),
    "d_block128x128_w+tile128_x": ((128, 128), 128),
    "e_block1x128_w+none_x": ((128, 1), "none"),
}


def qdq(x: jax.Array, blocks: tuple) -> jax.Array:
    """x (float32 [..., *dims]) quantized to e4m3 and back, one scale per block of the last len(blocks) axes
    (block size None: the whole axis; axes padded with zeros to a multiple of their block)."""
    x = x.astype(jnp.float32)
    nd = len(blocks)
    dims = x.shape[-nd:]
    sizes = [d if b is None else min(b, d) for d, b in zip(dims, blocks)]
    padded = [-(-d // s) * s for d, s in zip(dims, sizes)]
    lead = x.shape[:-nd]
    xp = jnp.pad(x, [(0, 0)] * len(lead) + [(0, p - d) for d, p in zip(dims, padded)])
    split = [v for p, s in zip(padded, sizes) for v in (p // s, s)]  # [..., n0, s0, n1, s1, ...]
    xb = xp.reshape(*lead, *split)
    red = tuple(len(lead) + 2 * i + 1 for i in range(nd))
    amax = jnp.max(jnp.abs(xb), axis=red, keepdims=True)
    scale = scale_of(amax)
    inv = jnp.float32(1.0) / scale
    y = (xb * inv).astype(E4M3).astype(jnp.float32) * scale
    y = y.reshape(*lead, *padded)
    return y[(...,) + tuple(slice(0, d) for d in dims)]


def qdq_activation(x: jax.Array, block) -> jax.Array:
    """x [..., K] quantize-dequantized per row (block None) or per `block` features of each row; same dtype."""
    return qdq(x, (block,)).astype(x.dtype)


@contextlib.contextmanager
def quantized_inputs(block):
    """Within the block, every projection's input (ops.linear's x: the Linear modules and the MLP's down_proj
    through ops.glu_linear, which calls the module-level `linear`) is quantize-dequantized first."""
    from unsloth_jax import ops

    orig = ops.linear

    def linear(x, kernel, *args, **kw):
        return orig(qdq_activation(x, block), kernel, *args, **kw)

    ops.linear = linear
    jax.clear_caches()
    try:
        yield
    finally:
        ops.linear = orig
        jax.clear_caches()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="working directory for the checkpoint (default: a temp dir)")
    ap.add_argument("--prompts", type=int, default=8, help="alpaca prompts (fp8_quality.py uses 8)")
    ap.add_argument("--seeds", type=int, default=4, help="perturbed realizations per scheme (module docstring)")
    a = ap.parse_args()
    t0 = time.time()
    ckpt = smollm2_checkpoint(Path(a.out or tempfile.mkdtemp(prefix="fp8scale-")) / "smollm2")

    dense, tok = load(ckpt, "bf16", "float32")  # the 16-bit checkpoint, float32 compute, unquantized
    ids, mask = prompt_batch(tok, a.prompts)
    real = mask.astype(bool)
    tokens = int(real.sum())

    def logits(model) -> np.ndarray:
        return np.asarray(model(ids, attention_mask=mask), np.float64)

    ref = logits(dense)
    projs = dense.projections()
    kernels = {name: lin.kernel.get_value() for name, lin in projs.items()}

    def set_kernels(wblocks, seed):
        """Every projection kernel quantize-dequantized with `wblocks` (None: left dense), after a relative
        1e-7 gaussian perturbation when seed is not None."""
        for i, (name, lin) in enumerate(projs.items()):
            k = kernels[name].astype(jnp.float32)
            if seed is not None:
                key = jax.random.fold_in(jax.random.key(seed), i)
                k = k * (1 + 1e-7 * jax.random.normal(key, k.shape, jnp.float32))
            lin.kernel.set_value(k if wblocks is None else qdq(k, wblocks))

    def run(wblocks, xblock, seed=None) -> np.ndarray:
        set_kernels(wblocks, seed)
        with contextlib.nullcontext() if xblock == "none" else quantized_inputs(xblock):
            return logits(dense)

    results, sim_a = {}, None
    for scheme, (w, x) in SCHEMES.items():
        out = run(w, x)
        if scheme == "a_channel_w+row_x":
            sim_a = out  # kept for the check line; the other schemes only as their metrics
        results[scheme] = [compare(ref, out, real)] + [compare(ref, run(w, x, seed), real) for seed in range(a.seeds)]
    perturbed_dense = run(None, "none", seed=0)
    set_kernels(None, None)  # the dense model back as loaded

    import pallas_kernels.fp8 as fp8_kernels  # ops.linear imports fp8_matmul from here at each call

    fp8, _ = load(ckpt, "fp8", "float32", load_tokenizer=False)  # the real load_in_fp8=True model
    real_fp8 = logits(fp8)
    orig = fp8_kernels.fp8_matmul
    fp8_kernels.fp8_matmul = lambda x, w, gemm_out="float32": fp8_kernels.fp8_matmul_reference(x, w)
    jax.clear_caches()
    try:
        real_twin = logits(fp8)
    finally:
        fp8_kernels.fp8_matmul = orig
        jax.clear_caches()
    check = {"check": "a_vs_real_load_in_fp8"}
    for key, out in (("real_fp8", real_fp8), ("real_fp8_with_fp8_matmul_reference", real_twin), ("sim_a", sim_a)):
        check[f"{key}_logits_rel_error"], check[f"{key}_top1_agreement"] = compare(ref, out, real)
    check["sim_a_vs_real_fp8_rel_diff"] = compare(real_fp8, sim_a, real)[0]
    check["sim_a_vs_real_fp8_with_fp8_matmul_reference_rel_diff"] = compare(real_twin, sim_a, real)[0]
    check["unquantized_perturbed_1e-7_rel_diff"] = compare(ref, perturbed_dense, real)[0]
    check["tokens"] = tokens
    print(json.dumps(check), flush=True)
    for scheme, res in results.items():
        errs = [e for e, _ in res[1:]]
        print(json.dumps({"scheme": scheme, "logits_rel_error": res[0][0], "top1_agreement": res[0][1],
                          "tokens": tokens, "rel_error_seeds": errs,
                          "rel_error_seeds_mean": float(np.mean(errs)) if errs else None,
                          "rel_error_seeds_std": float(np.std(errs)) if errs else None,
                          "top1_seeds": [t for _, t in res[1:]]}), flush=True)
    print(f"total {time.time() - t0:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
