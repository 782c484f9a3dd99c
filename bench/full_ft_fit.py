"""Which model shapes fit full fine-tuning on this device: XLA's buffer analysis of the compiled train step.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python bench/full_ft_fit.py [--shapes qwen2-1.5b,llama3-8b,...] \
        [--batch 4] [--seq 2048] [--remat unsloth] [--optim adamw_torch|adamw_8bit]

For each shape (bench/shapes.py) the model is built abstractly (nnx.eval_shape: no weights are allocated or
read), every weight is made trainable, and the jitted step (make_train_step over the split state, AdamW or
8-bit AdamW) is lowered and compiled for bf16 weights and a [batch, seq] batch. compiled.memory_analysis() gives
the device bytes of arguments (weights + optimizer state + batch), outputs, aliased (donated) bytes and temps;
`estimate_gib` = arguments + outputs - aliased + temps, the step's peak. One JSON line per shape, with the
device's memory and `fits` (estimate <= 95% of it). `--tiny` uses a toy shape (CPU check of the script).
Then run bench/train_bench.py --full-finetuning on the largest shape that fits to measure it for real.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench.shapes import SHAPES  # noqa: E402
from unsloth_jax import lora  # noqa: E402
from unsloth_jax.config import ModelConfig  # noqa: E402
from unsloth_jax.families import text_config  # noqa: E402
from unsloth_jax.models.decoder import CausalLM  # noqa: E402
from unsloth_jax.train import make_optimizer, make_schedule, make_train_step, resolve_remat  # noqa: E402
from unsloth_jax.train.optim import state_dtype  # noqa: E402

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)
GIB = 2 ** 30


def model_config(shape: dict) -> ModelConfig:
    import transformers

    kw = dict(shape)
    model_type = kw.pop("model_type")
    return text_config(transformers.AutoConfig.for_model(model_type, **kw).to_dict(), "bench/shapes.py")


def _gib(tree) -> float:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)) / GIB


def analyse(name: str, cfg: ModelConfig, batch: int, seq: int, remat, optim: str) -> dict:
    model = nnx.eval_shape(lambda: CausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    lora.enable_full_finetuning(model)
    graphdef, trainable, frozen = lora.split(model)
    tx = make_optimizer(optim, make_schedule("linear", 1e-5, 100, 0))
    opt_state = jax.eval_shape(tx.init, trainable)
    ids = jax.ShapeDtypeStruct((1, batch, seq), jnp.int32)
    spec = {"input_ids": ids, "labels": ids, "attention_mask": ids}
    step = make_train_step(graphdef, tx, remat=remat)
    t0 = time.perf_counter()
    ma = step.lower(trainable, frozen, opt_state, spec).compile().memory_analysis()
    compile_s = time.perf_counter() - t0
    parts = {k: getattr(ma, k) / GIB for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                                 "alias_size_in_bytes", "temp_size_in_bytes")}
    estimate = (parts["argument_size_in_bytes"] + parts["output_size_in_bytes"] - parts["alias_size_in_bytes"]
                + parts["temp_size_in_bytes"])
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    moments = sorted({str(x.dtype) for x in jax.tree.leaves(opt_state) if x.ndim})
    return {"name": "full_ft_fit", "shape": name, "params": lora.count(trainable), "batch": batch, "seq": seq,
            "remat": str(remat), "optim": optim, "optimizer_state": state_dtype(optim), "state_dtypes": moments,
            "weights_gib": round(_gib(trainable), 3), "optimizer_state_gib": round(_gib(opt_state), 3),
            **{k.replace("_size_in_bytes", "_gib"): round(v, 3) for k, v in parts.items()},
            "estimate_gib": round(estimate, 3),
            "device_gib": round(limit / GIB, 3) if limit else None,
            "fits": bool(limit and estimate <= 0.95 * limit / GIB) if limit else None,
            "compile_s": round(compile_s, 1), "jax": jax.__version__, "device": jax.devices()[0].device_kind}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen2-1.5b,qwen2.5-3b,qwen2.5-7b,llama3-8b,qwen2.5-14b")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--remat", default="unsloth", choices=["unsloth", "true", "false"])
    ap.add_argument("--optim", default="adamw_torch", choices=["adamw_torch", "adamw_8bit"])
    ap.add_argument("--tiny", action="store_true", help="a toy shape, to check the script on the CPU")
    a = ap.parse_args()
    remat = resolve_remat({"unsloth": "unsloth", "true": True, "false": False}[a.remat])
    shapes = {"tiny": TINY} if a.tiny else {n: SHAPES[n] for n in a.shapes.split(",")}
    for name, shape in shapes.items():
        print(json.dumps(analyse(name, model_config(shape), a.batch, a.seq, remat, a.optim)), flush=True)


if __name__ == "__main__":
    main()
