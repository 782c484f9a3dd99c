"""XLA's memory analysis of the compiled LoRA train step under several remat modes, at several sequence
lengths, for a random-init Llama-shaped model (no checkpoint needed; compiled from shapes, nothing allocated).

    python bench/remat_memory.py --layers 16 --hidden 256 --seqs 256 512 --modes full full_every_4
    python bench/remat_memory.py --layers 32 --hidden 4096 --intermediate 14336 --heads 32 --kv-heads 8 \\
        --batch 1 --seqs 16384 32768 --dtype bfloat16 --modes offload offload_every_4 full full_every_4

Prints one JSON line per (mode, length): temp/argument/output bytes on the device and in host memory (the
pinned-host buffers of the offload modes; 0 where the backend reports none), and `layer_input_bytes`, the size
of one layer input [B, S, D], so `temp_bytes` can be read in layer inputs.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from unsloth_jax import lora  # noqa: E402
from unsloth_jax.config import ModelConfig  # noqa: E402
from unsloth_jax.families import text_config  # noqa: E402
from unsloth_jax.models import CausalLM  # noqa: E402
from unsloth_jax.train import make_train_step  # noqa: E402


def lora_state_specs(cfg: ModelConfig, dtype):
    """(graphdef, trainable specs, frozen specs) of a LoRA (r=16, all projections) model of `cfg`, from
    nnx.eval_shape (no weights allocated)."""
    def build():
        model = CausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0))
        lora.add_lora(model, lora.LoraSettings(r=16, lora_alpha=16, target_modules=lora.ALL_TARGETS),
                      jax.random.PRNGKey(0))
        return model

    graphdef, trainable, frozen = lora.split(nnx.eval_shape(build))
    return graphdef, trainable, frozen


def step_memory(graphdef, trainable, frozen, remat: str, batch: int, seq: int) -> dict:
    """XLA's CompiledMemoryStats of the train step (SGD) on one [batch, seq] micro-batch, as a dict of ints."""
    opt = optax.sgd(1e-3)
    tokens = {k: jax.ShapeDtypeStruct((1, batch, seq), jnp.int32) for k in ("input_ids", "labels", "attention_mask")}
    step = make_train_step(graphdef, opt, remat=remat, donate=False)
    stats = step.lower(trainable, frozen, jax.eval_shape(opt.init, trainable), tokens).compile().memory_analysis()
    names = ("temp", "argument", "output", "host_temp", "host_argument", "host_output")
    return {f"{n}_bytes": int(getattr(stats, f"{n}_size_in_bytes", 0) or 0) for n in names}


def small_config(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int,
                 vocab: int = 128) -> ModelConfig:
    return text_config({"model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
                                  "intermediate_size": intermediate, "num_hidden_layers": layers,
                                  "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                                  "rms_norm_eps": 1e-5})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seqs", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--modes", nargs="+", default=["full", "full_every_4"])
    a = ap.parse_args()
    dtype = jnp.dtype(a.dtype)
    cfg = small_config(a.layers, a.hidden, a.intermediate, a.heads, a.kv_heads, a.vocab)
    graphdef, trainable, frozen = lora_state_specs(cfg, dtype)
    for seq in a.seqs:
        for mode in a.modes:
            t0 = time.time()
            mem = step_memory(graphdef, trainable, frozen, mode, a.batch, seq)
            print(json.dumps({"name": "remat_memory", "remat": mode, "layers": a.layers, "hidden": a.hidden,
                              "batch": a.batch, "seq": seq, "dtype": a.dtype,
                              "layer_input_bytes": a.batch * seq * a.hidden * dtype.itemsize, **mem,
                              "compile_s": round(time.time() - t0, 1), "backend": jax.default_backend(),
                              "jax": jax.__version__}), flush=True)


if __name__ == "__main__":
    main()
