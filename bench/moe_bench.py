"""MoE LoRA train step (Qwen3-30B-A3B shape) with grouped expert GEMMs, against a per-expert loop.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python bench/moe_bench.py --layers 4 --experts-impl both
    python bench/moe_bench.py --preset tiny --experts-impl both          # the CPU check (tiny shapes)

Model: random init in JAX (no checkpoint), Qwen3-30B-A3B's shape by default (hidden 2048, 128 experts, top-8,
moe_intermediate 768, 32 heads / 4 KV heads of 128, vocab 151936, 48 layers; --layers N runs the first N).
LoRA r=16 alpha=16 on q/k/v/o and on both expert weights (target_parameters), AdamW, bf16, random ids, median
step time after the warm-up steps. One JSON line per measurement:

  moe_train_step   tokens/s, step ms, peak GiB (memory_stats, or XLA's buffer analysis where the backend has
                   no memory_stats), how XLA lowered the ragged dots (counts in the optimized HLO), the expert
                   GEMM FLOPs of the step / step time / 989e12 (a lower bound of their MFU, as if the step did
                   nothing else; the loop's counts the grouped path's FLOPs) for --experts-impl grouped (the library path: tokens sorted by expert,
                   jax.lax.ragged_dot) and loop (bench-only reference: a Python loop over the experts, each
                   expert on every token weighted by its routing weight -- the math of transformers' loop without
                   its data-dependent gather, E / top_k times the expert FLOPs). "both" runs each in its own
                   process (so each peak is its own) and adds a ratio line.
  moe_expert_block the expert block of one layer alone (sort, gathers, 2 grouped GEMMs + LoRA, activation,
                   combine), forward + backward (dX and the LoRA factors' gradients, base frozen), at the step's
                   token count with a random router: ms, the GEMM FLOPs counted (below) and MFU against the
                   H200's 989e12 dense bf16 peak and against ~790e12, a measured ceiling of large bf16 GEMMs.
  moe_ragged_dot   one ragged_dot [T*k, 2048] x [128, 2048, 1536] forward, and forward + dX backward: ms, MFU.

FLOPs counted for the expert GEMMs of one layer (N = tokens * top_k rows, D hidden, F expert width, r rank):
forward 2*N*D*2F + 2*N*F*D (+ LoRA 2*N*r*(D + 2F) + 2*N*r*(F + D)); backward dX the same base GEMMs again
(+ LoRA dX and dA/dB, twice the LoRA forward); no dW of the frozen base.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from bench.timing import device_ms  # noqa: E402
from unsloth_jax import lora  # noqa: E402
from unsloth_jax.config import ModelConfig  # noqa: E402
from unsloth_jax.families import text_config  # noqa: E402
from unsloth_jax.models import moe  # noqa: E402
from unsloth_jax.models.decoder import CausalLM  # noqa: E402
from unsloth_jax.backend import commit_to_devices  # noqa: E402
from unsloth_jax.train.step import make_train_step  # noqa: E402

PEAK_BF16 = 989e12  # H200 dense bf16 (SXM)
CEILING_BF16 = 790e12  # about what large bf16 GEMMs reach on the H200

PRESETS = {
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, batch=4, seq=2048),
    "tiny": dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, batch=2, seq=64),
}


def model_config(p: dict, layers: int) -> ModelConfig:
    raw = {"model_type": "qwen3_moe", "vocab_size": p["vocab_size"], "hidden_size": p["hidden_size"],
           "intermediate_size": 6144, "num_hidden_layers": layers, "num_attention_heads": p["num_attention_heads"],
           "num_key_value_heads": p["num_key_value_heads"], "head_dim": p["head_dim"],
           "num_experts": p["num_experts"], "num_experts_per_tok": p["num_experts_per_tok"],
           "moe_intermediate_size": p["moe_intermediate_size"], "norm_topk_prob": True, "rms_norm_eps": 1e-6,
           "max_position_embeddings": 40960, "rope_theta": 1000000.0, "tie_word_embeddings": False}
    return text_config(raw, "bench preset")


def loop_expert_ffn(x, weights, experts, block, cfg):
    """Bench-only reference for moe.expert_ffn: a Python loop over the E experts, each run on every token and
    weighted by its routing weight (0 where the token did not choose it). Same math, E / top_k x the FLOPs."""
    t = x.shape[0]
    combine = jnp.zeros((t, cfg.num_experts), jnp.float32).at[jnp.arange(t)[:, None], experts].set(weights)
    out = jnp.zeros(x.shape, jnp.float32)
    gu, dn = block.gate_up_proj, block.down_proj
    for e in range(cfg.num_experts):
        def one(g, inp):
            y = inp @ jax.lax.stop_gradient(g.kernel[...][e]).astype(inp.dtype)
            if g.lora_a is not None:
                y = y + (g.lora_scale * ((inp @ g.lora_a[...][e].astype(inp.dtype)) @ g.lora_b[...][e].astype(inp.dtype)))
            return y.astype(inp.dtype)
        h = moe.expert_activation(one(gu, x), cfg)
        out = out + combine[:, e:e + 1] * one(dn, h).astype(jnp.float32)
    return out.astype(x.dtype)


def sig(x: float) -> float:
    """x rounded to 4 significant digits (CPU-sized rates stay visible)."""
    return float(f"{x:.4g}")


def expert_gemm_flops(tokens: int, cfg: ModelConfig, r: int, recompute: bool = False) -> float:
    """Forward + backward (dX, LoRA dA/dB; no frozen dW) FLOPs of one layer's expert GEMMs; recompute adds the
    forward once more (rematerialisation in the backward pass)."""
    n, d, f = tokens * cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    base = 2 * n * d * 2 * f + 2 * n * f * d
    lora_fwd = 2 * n * r * (d + 2 * f) + 2 * n * r * (f + d)
    return 2 * base + 3 * lora_fwd + (base + lora_fwd if recompute else 0)


def random_model(cfg: ModelConfig, dtype) -> CausalLM:
    """A random-init model built without ever holding a float32 copy of a layer stack: abstract first
    (nnx.eval_shape), then each variable drawn on the device in `dtype`, one layer at a time for stacks."""
    from unsloth_jax.models.state import fill

    model = nnx.eval_shape(lambda: CausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    values: dict = {}
    key = jax.random.PRNGKey(0)
    for i, (path, var) in enumerate(nnx.to_flat_state(nnx.state(model))):
        names = [str(x) for x in path]
        shape, dt = tuple(var.get_value().shape), var.get_value().dtype
        if names[-1] == "bias":
            value = jnp.zeros(shape, dt)
        elif names[-1] == "weight" and any("norm" in x for x in names):
            value = jnp.ones(shape, dt)
        else:
            draw = lambda k, s=shape[1:]: (0.02 * jax.random.normal(k, s, jnp.float32)).astype(dt)  # noqa: E731
            keys = jax.random.split(jax.random.fold_in(key, i), shape[0])
            value = jax.jit(lambda ks: jax.lax.map(draw, ks))(keys)
        node = values
        for x in names[:-1]:
            node = node.setdefault(x, {})
        node[names[-1]] = value
    return fill(model, values)


def _hlo_facts(compiled) -> dict:
    """How XLA lowered the step's ragged dots (from the optimized HLO) and its buffer sizes."""
    facts = {}
    try:
        text = compiled.as_text()
        facts["hlo_ragged_dot_ops"] = text.count("ragged-dot(")
        facts["hlo_cudnn_fusions"] = text.count("__cudnn$fusion")
        facts["hlo_grouped_gemm_calls"] = text.count("groupedMatmul")
    except Exception as e:  # noqa: BLE001 - diagnostics only
        facts["hlo_error"] = repr(e)[:200]
    ma = compiled.memory_analysis()
    if ma is not None:
        facts["temp_gib"] = round(ma.temp_size_in_bytes / 2**30, 3)
        facts["buffer_peak_gib"] = round((ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
                                          - getattr(ma, "alias_size_in_bytes", 0)) / 2**30, 3)
    return facts


def train_step(a, p: dict) -> dict:
    """Time the LoRA train step with the chosen experts implementation; one result dict."""
    if a.experts_impl == "loop":
        moe.expert_ffn = loop_expert_ffn  # this process only: the step below traces the loop instead
    cfg = model_config(p, a.layers)
    dtype = jnp.bfloat16 if a.dtype == "bfloat16" else jnp.float32
    t0 = time.perf_counter()
    model = random_model(cfg, dtype)
    lora.add_lora(model, lora.LoraSettings(r=a.rank, lora_alpha=a.rank, target_modules=lora.ATTN_PROJS,
                                           target_parameters=tuple(moe.EXPERT_PARAMETERS)), jax.random.PRNGKey(1))
    jax.block_until_ready(nnx.state(model))
    init_s = time.perf_counter() - t0
    opt = optax.adamw(1e-4)
    graphdef, trainable, frozen = lora.split(model)
    del model
    opt_state = opt.init(trainable)
    step = make_train_step(graphdef, opt, remat=a.remat)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (1, p["batch"], p["seq"])).astype(np.int32)
    batch = jax.device_put({"input_ids": ids, "labels": ids, "attention_mask": np.ones_like(ids)})
    trainable, frozen, opt_state = commit_to_devices((trainable, frozen, opt_state))
    t0 = time.perf_counter()
    compiled = step.lower(trainable, frozen, opt_state, batch).compile()  # one compile, run below
    compile_s = time.perf_counter() - t0
    facts = _hlo_facts(compiled)
    times, loss = [], None
    for _ in range(a.steps):
        t = time.perf_counter()
        trainable, opt_state, m = compiled(trainable, frozen, opt_state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
        loss = float(m["loss"])
    ms = float(np.median(times[a.warmup:])) * 1e3
    stats = jax.devices()[0].memory_stats() or {}
    peak = round(stats["peak_bytes_in_use"] / 2**30, 3) if "peak_bytes_in_use" in stats else facts.get(
        "buffer_peak_gib")
    tokens = p["batch"] * p["seq"]
    # the expert GEMMs' FLOPs of the whole step over its time: a lower bound of their MFU inside the step
    step_flops = a.layers * expert_gemm_flops(tokens, cfg, a.rank, recompute=a.remat != "none")
    return {"name": "moe_train_step", "experts_impl": a.experts_impl, "preset": a.preset, "layers": a.layers,
            "batch": p["batch"], "seq": p["seq"], "rank": a.rank, "remat": a.remat, "dtype": a.dtype,
            "step_ms": round(ms, 2), "tokens_per_s": round(tokens / (ms / 1e3), 1), "peak_gib": peak,
            "peak_source": "memory_stats" if "peak_bytes_in_use" in stats else "xla_buffer_analysis",
            "compile_s": round(compile_s, 1), "init_s": round(init_s, 1), "final_loss": loss,
            "steps_timed": len(times) - a.warmup, "step_ms_all": [round(x * 1e3, 1) for x in times],
            "expert_gemm_flops_per_step": step_flops,
            "expert_gemm_mfu_989_lower_bound": sig(step_flops / (ms / 1e3) / PEAK_BF16), **facts,
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "jax": jax.__version__,
            "device": jax.devices()[0].device_kind}


def expert_block(a, p: dict) -> list[dict]:
    """The expert block of one layer and the raw ragged_dot, timed alone (bench/timing.device_ms)."""
    cfg = model_config(p, 1)
    dtype = jnp.bfloat16 if a.dtype == "bfloat16" else jnp.float32
    tokens = p["batch"] * p["seq"]
    key = jax.random.PRNGKey(0)
    block = moe.Experts(cfg, dtype=dtype, rngs=nnx.Rngs(0))  # one layer: kernels [E, in, out]
    for i, g in enumerate((block.gate_up_proj, block.down_proj)):
        ka, kb = jax.random.split(jax.random.fold_in(key, i))
        g.lora_a = nnx.LoRAParam(0.01 * jax.random.normal(ka, (cfg.num_experts, g.in_features, a.rank)))
        g.lora_b = nnx.LoRAParam(0.01 * jax.random.normal(kb, (cfg.num_experts, a.rank, g.out_features)))
        g.lora_scale = 1.0  # alpha = r
    graphdef, lora_state, rest = nnx.split(block, nnx.LoRAParam, ...)
    x = (jax.random.normal(jax.random.fold_in(key, 7), (tokens, cfg.hidden_size))).astype(dtype)
    logits = jax.random.normal(jax.random.fold_in(key, 8), (tokens, cfg.num_experts), jnp.float32)
    weights, experts = moe.route(logits, cfg)

    def fwd_bwd(x, lora_state, rest):
        def f(x, lora_state):
            y = moe.expert_ffn(x, weights, experts, nnx.merge(graphdef, lora_state, rest), cfg)
            return jnp.sum(y.astype(jnp.float32) ** 2)
        return jax.grad(f, argnums=(0, 1))(x, lora_state)

    flops = expert_gemm_flops(tokens, cfg, a.rank)
    ms = device_ms(fwd_bwd, x, lora_state, rest, runs=a.runs)
    out = [{"name": "moe_expert_block", "pass": "fwd+bwd", "tokens": tokens, "experts": cfg.num_experts,
            "top_k": cfg.num_experts_per_tok, "hidden": cfg.hidden_size, "moe_intermediate": cfg.moe_intermediate_size,
            "rank": a.rank, "dtype": a.dtype, "ms": round(ms, 4), "gemm_flops": flops,
            "tflops": sig(flops / ms / 1e9), "mfu_989": sig(flops / (ms / 1e3) / PEAK_BF16),
            "mfu_790": sig(flops / (ms / 1e3) / CEILING_BF16), "jax": jax.__version__,
            "device": jax.devices()[0].device_kind}]
    # the raw grouped GEMM: [N, D] x [E, D, 2F], rows sorted by expert with the router's group sizes
    n = tokens * cfg.num_experts_per_tok
    group_sizes = jnp.bincount(experts.reshape(-1), length=cfg.num_experts).astype(jnp.int32)
    rows = jax.random.normal(jax.random.fold_in(key, 9), (n, cfg.hidden_size)).astype(dtype)
    w = block.gate_up_proj.kernel[...]
    base = 2 * n * cfg.hidden_size * 2 * cfg.moe_intermediate_size
    fwd = lambda r, w: jax.lax.ragged_dot(r, w, group_sizes)  # noqa: E731
    fwd_dx = jax.grad(lambda r, w: jnp.sum(jax.lax.ragged_dot(r, jax.lax.stop_gradient(w), group_sizes)
                                           .astype(jnp.float32)), argnums=0)
    for name, fn, fl in (("fwd", fwd, base), ("fwd+bwd_dx", lambda r, w: fwd_dx(r, w), 2 * base)):
        ms = device_ms(fn, rows, w, runs=a.runs)
        out.append({"name": "moe_ragged_dot", "pass": name, "m": n, "k": cfg.hidden_size,
                    "n": 2 * cfg.moe_intermediate_size, "groups": cfg.num_experts, "dtype": a.dtype,
                    "ms": round(ms, 4), "flops": fl, "tflops": sig(fl / ms / 1e9),
                    "mfu_989": sig(fl / (ms / 1e3) / PEAK_BF16), "mfu_790": sig(fl / (ms / 1e3) / CEILING_BF16),
                    "jax": jax.__version__, "device": jax.devices()[0].device_kind})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers to run (default: the preset's)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--remat", default="full", choices=["none", "full", "offload"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--runs", type=int, default=10, help="timing runs of the expert-block benchmarks")
    ap.add_argument("--experts-impl", default="both", choices=["grouped", "loop", "both"],
                    help="grouped: the library's sorted ragged_dot path; loop: the bench-only per-expert loop")
    ap.add_argument("--skip-block", action="store_true", help="only the train step(s)")
    a = ap.parse_args()
    p = dict(PRESETS[a.preset])
    p["batch"] = a.batch or p["batch"]
    p["seq"] = a.seq or p["seq"]
    a.layers = a.layers or p["num_hidden_layers"]
    if a.steps <= a.warmup:
        ap.error("--steps must exceed --warmup")
    if a.experts_impl == "both":  # each implementation in its own process, so each peak memory is its own
        lines = {}
        for impl in ("grouped", "loop"):
            argv, skip = [], False
            for x in sys.argv[1:]:  # this command line without its --experts-impl
                if skip or x.startswith("--experts-impl"):
                    skip = x == "--experts-impl"
                    continue
                argv.append(x)
            cmd = [sys.executable, os.path.abspath(__file__), *argv, "--experts-impl", impl, "--skip-block"]
            res = subprocess.run(cmd, capture_output=True, text=True)
            sys.stderr.write(res.stderr[-4000:])
            got = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
            if res.returncode or not got:
                print(json.dumps({"name": "moe_train_step", "experts_impl": impl, "error": res.returncode,
                                  "stderr_tail": res.stderr[-600:]}), flush=True)
                continue
            print(got[-1], flush=True)
            lines[impl] = json.loads(got[-1])
        if len(lines) == 2:
            g, lp = lines["grouped"], lines["loop"]
            print(json.dumps({"name": "moe_train_step_ratio", "layers": a.layers, "preset": a.preset,
                              "grouped_over_loop_tokens_per_s": round(g["tokens_per_s"] / lp["tokens_per_s"], 3),
                              "grouped_peak_gib": g["peak_gib"], "loop_peak_gib": lp["peak_gib"]}), flush=True)
    else:
        print(json.dumps(train_step(a, p)), flush=True)
    if not a.skip_block:
        for line in expert_block(a, p):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
