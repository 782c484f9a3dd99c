"""Compile time of a LoRA train step and of generation, through the public API, summed from jax.monitoring's events.

    python bench/compile_time.py /tmp/ckpt/qwen2-1.5b-4l --seq 128 --batch 2 --rows 4 --new 8

Loads the checkpoint (float32 on the CPU, bf16 on a GPU), adds LoRA r=16 on the seven projections, trains --steps
steps of random ids with SFTTrainer, then generates --new tokens for --rows prompts with `model.generate`. For each
phase it prints the seconds jax spent tracing to jaxprs, lowering to MLIR and in the backend compiler (the three
duration events jax records for every compile), so two trees compare without timing the execution. Used for the
architecture step's "compile time not worse" A/B: run the same command in both trees, alternately, with no
persistent compile cache. One JSON line.
"""
import argparse
import collections
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from unsloth_jax import FastLanguageModel, SFTTrainer, TrainingArguments  # noqa: E402

EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
          "/jax/core/compile/backend_compile_duration": "backend_s"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    totals: dict = collections.defaultdict(float)

    def listen(event: str, seconds: float, **_) -> None:
        if event in EVENTS:
            totals[EVENTS[event]] += seconds

    jax.monitoring.register_event_duration_secs_listener(listen)
    gpu = jax.default_backend() == "gpu"
    model, _ = FastLanguageModel.from_pretrained(a.model_dir, dtype="bfloat16" if gpu else "float32",
                                                 load_tokenizer=False, max_seq_length=a.seq, progress=False)
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0.0)
    rng = np.random.default_rng(0)
    data = [{"input_ids": rng.integers(3, model.config.vocab_size, a.seq).tolist()} for _ in range(a.batch * a.steps)]
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=a.batch, max_steps=a.steps,
                             logging_steps=1, save_steps=0, learning_rate=1e-4, report_to="none")
    trainer = SFTTrainer(model=model, train_dataset=data, args=args, max_seq_length=a.seq)
    phases = {}
    totals.clear()
    t0 = time.perf_counter()
    trainer.train()
    phases["train"] = dict(totals, wall_s=time.perf_counter() - t0)
    totals.clear()
    ids = rng.integers(3, model.config.vocab_size, (a.rows, a.prompt_len))
    t0 = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=np.ones_like(ids), max_new_tokens=a.new, do_sample=False)
    phases["generate"] = dict(totals, wall_s=time.perf_counter() - t0)
    line = {"name": "compile_time", "tag": a.tag, "model_dir": os.path.basename(a.model_dir.rstrip("/")),
            "backend": jax.default_backend(), "jax": jax.__version__,
            **{f"{phase}_{k}": round(v, 3) for phase, d in phases.items() for k, v in d.items()},
            **{f"{phase}_compile_s": round(sum(v for k, v in d.items() if k != "wall_s"), 3)
               for phase, d in phases.items()}}
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
