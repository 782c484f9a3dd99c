"""Full-size logits parity on the GPU: a random-init transformers checkpoint (bf16) vs unsloth_jax (bf16).

    XLA_PYTHON_CLIENT_PREALLOCATE=false python bench/gpu_parity.py /tmp/ckpt/llama3-8b [--seq 512]
Prints one JSON line: relative error of the logits and the load time.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--seq", type=int, default=512)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    cfg = json.load(open(os.path.join(a.model_dir, "config.json")))
    ids = rng.integers(0, cfg["vocab_size"], size=(2, a.seq))
    mask = np.ones_like(ids)
    mask[1, a.seq // 2:] = 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32,
                                                           attn_implementation="eager").cuda().eval()
    with torch.no_grad():
        tids, tmask = torch.tensor(ids).cuda(), torch.tensor(mask).cuda()
        ref32 = hf(tids, attention_mask=tmask).logits.float().cpu().numpy()
        hf = hf.to(torch.bfloat16)
        ref16 = hf(tids, attention_mask=tmask).logits.float().cpu().numpy()
    del hf
    torch.cuda.empty_cache()
    import jax
    from flax import nnx

    from unsloth_jax import FastLanguageModel

    t0 = time.time()
    model, _ = FastLanguageModel.from_pretrained(a.model_dir, dtype="bfloat16", load_tokenizer=False)
    jax.block_until_ready(nnx.state(model))
    load_s = time.time() - t0
    out = np.asarray(model(ids, attention_mask=mask))
    real = mask.astype(bool)
    rel = lambda x: float(np.linalg.norm(x[real] - ref32[real]) / np.linalg.norm(ref32[real]))  # noqa: E731
    print(json.dumps({"name": "gpu_parity", "model_dir": os.path.basename(a.model_dir.rstrip("/")), "seq": a.seq,
                      "ours_bf16_vs_hf_fp32": rel(out), "hf_bf16_vs_hf_fp32": rel(ref16), "load_s": round(load_s, 1), "jax": jax.__version__,
                      "device": jax.devices()[0].device_kind}), flush=True)


if __name__ == "__main__":
    main()
