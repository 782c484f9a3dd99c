"""Generation engine throughput at the issue's shapes, one JSON line per (rows, weights) run.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python bench/generate_bench.py /tmp/ckpt/qwen2-1.5b --rows 16,128 \
        --weights shared,copy,merged --prompt-len 64 --new 256
    python bench/generate_bench.py unsloth_jax/assets/tiny-llama --dtype float32 --rows 2 --new 8   # CPU check

bf16 random-init checkpoint, LoRA r=16 on the seven projections (B random, so LoRA is live), prompts of
--prompt-len random tokens, --new tokens forced (ignore_eos), sampling at temperature 1, top_p 1 (or --greedy).
Each configuration runs once to compile, then --repeats timed calls. Reported: tokens/s over the whole call
(prefill included), ms per decode step (the decode loop's time / steps), the compile seconds (first call minus a
timed one), peak GPU memory, the fraction of the weight-reading bound (bf16 weights + head once per step over
the measured copy bandwidth) and the decode loop's kernel count per step (fusions, custom calls and copies in
its compiled loop body).
"""
import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--decode-configs" in sys.argv[:-1]:  # pallas_kernels.decode_linear reads its table when imported (below)
    os.environ["UNSLOTH_JAX_DECODE_LINEAR_CONFIGS"] = sys.argv[sys.argv.index("--decode-configs") + 1]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from unsloth_jax import FastLanguageModel, ops  # noqa: E402
from unsloth_jax.inference import Engine, SamplingParams  # noqa: E402
from unsloth_jax.inference import runner  # noqa: E402

COPY_BW = 4.3e12  # bytes/s, device-to-device copy (read + write) measured on the H200 (KINDS.md)


def peak_gib() -> float:
    stats = jax.devices()[0].memory_stats() or {}
    return round(stats.get("peak_bytes_in_use", 0) / 2**30, 3)


def weight_bytes(model) -> int:
    cfg = model.config
    n = sum(int(np.prod(lin.kernel.get_value().shape)) for lin in model.projections().values())
    return 2 * (n + cfg.vocab_size * cfg.hidden_size)


def loop_kernels(hlo: str) -> int:
    """Kernel-launching instructions (fusion, custom-call, copy) in the body of the while loop with the most."""
    bodies = re.findall(r"while\([^)]*\), condition=%[\w.]+, body=%([\w.]+)", hlo)
    best = 0
    for name in bodies:
        m = re.search(r"^%" + re.escape(name) + r" .*?^}", hlo, re.S | re.M)
        if m:
            best = max(best, len(re.findall(r"= \S+ (?:fusion|custom-call|copy)\(", m.group(0))))
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--rows", default="16")
    ap.add_argument("--weights", default="shared")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--load-in-4bit", action="store_true")
    ap.add_argument("--load-in-fp8", action="store_true")
    ap.add_argument("--no-lora", action="store_true")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--tag", default="")
    ap.add_argument("--count-kernels", action="store_true", help="compile the decode loop again to count kernels")
    ap.add_argument("--dump-hlo", metavar="FILE", help="with --count-kernels: write the compiled decode loop's HLO")
    ap.add_argument("--profile", metavar="DIR", help="trace one more (untimed) call with jax.profiler into DIR")
    ap.add_argument("--decode-configs", metavar="FILE", help="decode_linear configs to use (decode_linear_chain.py "
                    "--write-best), in place of pallas_kernels.decode_linear's measured table (for the shapes it lists)")
    a = ap.parse_args()
    if a.decode_configs:  # set in os.environ before the imports above
        from pallas_kernels import decode_linear
        if os.environ.get(decode_linear.CONFIGS_ENV) != a.decode_configs:
            ap.error("--decode-configs: give it as two arguments (--decode-configs FILE)")
    kw = {"load_in_4bit": True} if a.load_in_4bit else {"load_in_fp8": True} if a.load_in_fp8 else {}
    model, _ = FastLanguageModel.from_pretrained(a.model_dir, dtype=a.dtype, load_tokenizer=False,
                                                 max_seq_length=a.prompt_len + a.new, progress=False, **kw)
    if not a.no_lora:
        model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0.0)
        key = jax.random.PRNGKey(1)
        for i, lin in enumerate(model.projections().values()):
            b = lin.lora_b
            b[...] = 0.01 * jax.random.normal(jax.random.fold_in(key, i), b[...].shape, jnp.float32)
    cfg = model.config
    bound_ms = weight_bytes(model) / COPY_BW * 1e3
    rng = np.random.default_rng(0)
    for weights in a.weights.split(","):
        for rows in (int(r) for r in a.rows.split(",")):
            engine = Engine(model, max_rows=rows, weights=weights, chunk=a.chunk)
            prompts = [rng.integers(1, cfg.vocab_size, a.prompt_len).tolist() for _ in range(rows)]
            params = SamplingParams(temperature=0.0 if a.greedy else 1.0, top_p=1.0, max_tokens=a.new,
                                    ignore_eos=True, seed=0)
            t0 = time.perf_counter()
            engine.generate(prompts, params)
            first = time.perf_counter() - t0
            times, stats = [], []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                outs = engine.generate(prompts, params)
                times.append(time.perf_counter() - t0)
                stats.append(dict(engine.last_stats))
            assert all(len(o.outputs[0].token_ids) == a.new for o in outs)
            wall = float(np.median(times))
            st = stats[int(np.argsort(times)[len(times) // 2])]
            ms_step = st["decode_s"] / max(st["steps"], 1) * 1e3
            kernels = None
            if a.count_kernels:
                try:
                    hlo = _decode_hlo(engine, prompts, params)
                    kernels = loop_kernels(hlo)
                    if a.dump_hlo:
                        with open(a.dump_hlo, "w") as f:
                            f.write(hlo)
                except Exception as e:  # noqa: BLE001 - a diagnostic only
                    kernels = f"unavailable: {type(e).__name__}"
            if a.profile:
                jax.profiler.start_trace(a.profile)
                engine.generate(prompts, params)
                jax.profiler.stop_trace()
            print(json.dumps({
                "name": "engine_generate", "tag": a.tag, "model_dir": os.path.basename(a.model_dir.rstrip("/")),
                "rows": rows, "weights": weights, "prompt_len": a.prompt_len, "new_tokens": a.new,
                "greedy": a.greedy, "base": "nf4" if a.load_in_4bit else "fp8" if a.load_in_fp8 else a.dtype,
                "lora": not a.no_lora, "impl": os.environ.get("UNSLOTH_JAX_IMPL", ""),
                "tokens_per_s": round(rows * a.new / wall, 1), "wall_s": round(wall, 4),
                "decode_tokens_per_s": round(rows / ms_step * 1e3, 1), "ms_per_step": round(ms_step, 4),
                "prefill_s": round(st["prefill_s"], 4), "prepare_s": round(st["prepare_s"], 4),
                "compile_s": round(first - wall, 2), "bound_ms": round(bound_ms, 4),
                "fraction_of_bound": round(bound_ms / ms_step, 3), "kernels_per_step": kernels,
                "peak_gib": peak_gib(), "chosen": ops.chosen_impls(),
                "decode_configs": a.decode_configs or "", "jax": jax.__version__,
                "device": jax.devices()[0].device_kind}), flush=True)


def _decode_hlo(engine, prompts, params) -> str:
    """The compiled decode loop of the engine's last configuration, as HLO text."""
    from unsloth_jax.inference import pages as paging
    from unsloth_jax.inference.sampling import SamplerFlags
    from unsloth_jax.inference.weights import prepare

    st = engine.last_stats
    plan, weights = prepare(engine.model, engine.weights)
    cfg = engine.model.config
    pools = paging.make_pools(cfg, st["pool_pages"], engine.page_size, engine.model.dtype)
    flags = SamplerFlags.of([params])
    rows = runner.empty_rows(st["rows"], 1 + len(params.stop_token_ids), cfg.vocab_size, flags)
    max_pages = paging.pages_for(len(prompts[0]) + params.max_tokens, engine.page_size)
    tables = jnp.zeros((st["rows"], max_pages), jnp.int32)
    lowered = runner.decode_chunk.lower(weights, pools, rows, tables, jnp.int32(engine.chunk), plan=plan,
                                        flags=flags, cap=engine.chunk)
    return lowered.compile().as_text()


if __name__ == "__main__":
    main()
