"""transformers' generate with the static cache (its compiled decode step): the baseline of generate_bench.py.

    python bench/hf_generate_bench.py /tmp/ckpt/qwen2-1.5b --rows 16,128 --prompt-len 64 --new 256

bf16 on the GPU, random prompts of --prompt-len tokens, --new tokens forced (min_new_tokens), sampling at
temperature 1, top_p 1, top_k 0, `cache_implementation="static"` (transformers compiles the decode step). Two
calls per row count compile and warm up, then --repeats timed ones; one JSON line per row count (tokens/s over
the call, prefill included, and the peak memory torch allocated).
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import transformers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--rows", default="16")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cache", default="static")
    a = ap.parse_args()
    model = transformers.AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.bfloat16).cuda().eval()
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    for rows in (int(r) for r in a.rows.split(",")):
        ids = torch.tensor(rng.integers(1, vocab, (rows, a.prompt_len)), device="cuda")
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=a.new, min_new_tokens=a.new, do_sample=True,
                  temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0, cache_implementation=a.cache)
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(2):
                model.generate(ids, **kw)
        torch.cuda.synchronize()
        warm = time.perf_counter() - t0
        times = []
        for _ in range(a.repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, **kw)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        assert out.shape[1] == a.prompt_len + a.new
        wall = float(np.median(times))
        print(json.dumps({"name": "hf_generate", "cache": a.cache, "model_dir": os.path.basename(a.model_dir.rstrip("/")),
                          "rows": rows, "prompt_len": a.prompt_len, "new_tokens": a.new,
                          "tokens_per_s": round(rows * a.new / wall, 1), "wall_s": round(wall, 4),
                          "ms_per_step": round(wall / a.new * 1e3, 4), "warmup_s": round(warm, 1),
                          "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
                          "torch": torch.__version__, "transformers": transformers.__version__,
                          "device": torch.cuda.get_device_name()}), flush=True)


if __name__ == "__main__":
    main()
