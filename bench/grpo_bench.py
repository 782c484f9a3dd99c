"""GRPO throughput through the public API (GRPOTrainer), beside the SFT step of the same model in the same run.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python bench/grpo_bench.py /tmp/ckpt/qwen2-1.5b --prompts 2 \
        --generations 8 --completion 256 --prompt-len 64 --steps 6 --warmup 2
    python bench/grpo_bench.py unsloth_jax/assets/tiny-llama --dtype float32 --prompts 1 --generations 4 \
        --completion 8 --prompt-len 8 --steps 2 --warmup 1          # CPU check with tiny shapes

LoRA r=16, alpha=16 on all seven projections, bf16, AdamW, remat "unsloth" (as train_bench.py). Each GRPO step
samples --generations completions of up to --completion tokens for each of --prompts random prompts of
--prompt-len tokens (the in-process KV-cache generation), scores them with a length reward, and trains on them
in one step. The model directory needs no tokenizer: prompts are random token ids, and a stand-in tokenizer
turns them to text and back. Prints one JSON line per measurement (medians over the steps after --warmup):
  grpo_generate: generated tokens/s (completion tokens / generation time of the step);
  grpo_train:    train tokens/s (prompt + completion tokens / the step's scoring + update time; also counting
                 the padding, comparable with sft_step), generation
                 share of the step time, peak GPU memory after the GRPO steps;
  sft_step:      the SFT train step (make_train_step, as SFTTrainer runs it) on the same model with rows of the
                 GRPO step's shape (rows x padded length): tokens/s, step time, peak memory after it.
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from unsloth_jax import FastLanguageModel, GRPOConfig, GRPOTrainer, lora  # noqa: E402
from unsloth_jax.train.loop import round_up  # noqa: E402
from unsloth_jax.backend import commit_to_devices  # noqa: E402
from unsloth_jax.train.step import make_train_step  # noqa: E402


class IdTokenizer:
    """A stand-in tokenizer whose text is space-separated token ids (random-init checkpoints ship none)."""

    def __init__(self, vocab_size: int, eos_token_id: int):
        self.vocab_size, self.eos_token_id, self.pad_token_id = vocab_size, eos_token_id, 0
        self.eos_token, self.bos_token_id = None, None

    def __call__(self, text, **kwargs):
        return {"input_ids": [int(t) for t in text.split()]}

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(str(t) for t in row) for row in rows]


def peak_gib() -> float:
    stats = jax.devices()[0].memory_stats() or {}
    return round(stats.get("peak_bytes_in_use", 0) / 2**30, 3)


class MemoryByStep:
    """Callback: GPU bytes in use and the peak so far after each optimizer step (GiB), for a flat-memory check."""

    def __init__(self):
        self.in_use, self.peak = [], []

    def on_step_end(self, args, state, control, **kwargs):
        stats = jax.devices()[0].memory_stats() or {}
        self.in_use.append(round(stats.get("bytes_in_use", 0) / 2**30, 3))
        self.peak.append(round(stats.get("peak_bytes_in_use", 0) / 2**30, 3))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step")
    ap.add_argument("--generations", type=int, default=8, help="completions per prompt (num_generations)")
    ap.add_argument("--completion", type=int, default=256, help="max_completion_length")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--remat", default="unsloth", choices=["unsloth", "true", "false"])
    ap.add_argument("--beta", type=float, default=0.0, help="KL coefficient (> 0 adds the reference pass)")
    ap.add_argument("--no-sft-step", action="store_true", help="skip the sft_step line (bench/smoke.py: GRPO only)")
    a = ap.parse_args()
    if a.steps <= a.warmup:
        ap.error("--steps must exceed --warmup")
    remat = {"unsloth": "unsloth", "true": True, "false": False}[a.remat]
    seq = a.prompt_len + a.completion
    model, _ = FastLanguageModel.from_pretrained(a.model_dir, dtype=a.dtype, load_tokenizer=False,
                                                 max_seq_length=round_up(seq))
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0.0,
                                             use_gradient_checkpointing=remat)
    cfg = model.config
    eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, (list, tuple)) else (cfg.eos_token_id or 0)
    tok = IdTokenizer(cfg.vocab_size, int(eos))
    rng = np.random.default_rng(0)
    n_prompts = a.prompts * a.steps
    data = [{"prompt": " ".join(map(str, rng.integers(1, cfg.vocab_size, a.prompt_len)))} for _ in range(n_prompts)]

    def length_reward(prompts, completions, completion_ids, **kwargs):
        return [-len(c) / a.completion for c in completion_ids]

    rows = a.prompts * a.generations
    out = tempfile.mkdtemp()
    args = GRPOConfig(output_dir=out, per_device_train_batch_size=rows, num_generations=a.generations,
                      max_completion_length=a.completion, max_steps=a.steps, logging_steps=1, learning_rate=1e-6,
                      beta=a.beta, report_to="none")
    memory = MemoryByStep()
    trainer = GRPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=data,
                          processing_class=tok, callbacks=[memory])
    result = trainer.train()
    grpo_peak = peak_gib()
    steps = [e for e in trainer.state.log_history if "time/generation" in e]
    timed = steps[a.warmup:]
    seen = [0.0] + [e["num_tokens"] for e in steps]
    step_tokens = [seen[i + 1] - seen[i] for i in range(len(steps))][a.warmup:]
    gen_tokens = [e["completions/mean_length"] * rows for e in timed]
    padded = [rows * round_up(a.prompt_len + e["completions/max_length"]) for e in timed]
    gen_s = [e["time/generation"] for e in timed]
    train_s = [e["time/train"] for e in timed]
    common = {"model_dir": os.path.basename(a.model_dir.rstrip("/")), "dtype": a.dtype, "remat": a.remat,
              "prompts": a.prompts, "generations": a.generations, "max_completion": a.completion,
              "prompt_len": a.prompt_len, "steps_timed": len(timed), "jax": jax.__version__,
              "device": jax.devices()[0].device_kind}
    print(json.dumps({"name": "grpo_generate", **common,
                      "generated_tokens_per_s": round(float(np.median(np.divide(gen_tokens, gen_s))), 1),
                      "generation_s": round(float(np.median(gen_s)), 3),
                      "mean_completion_len": round(float(np.mean([e["completions/mean_length"] for e in timed])), 1),
                      "generation_s_all": [round(e["time/generation"], 3) for e in steps]}), flush=True)
    print(json.dumps({"name": "grpo_train", **common, "beta": a.beta,
                      "train_tokens_per_s": round(float(np.median(np.divide(step_tokens, train_s))), 1),
                      # rows x the step's padded length (prompt + longest completion, rounded up to 64), as sft_step
                      "train_padded_tokens_per_s": round(float(np.median(np.divide(padded, train_s))), 1),
                      "train_step_s": round(float(np.median(train_s)), 3),
                      "generation_fraction": round(float(np.sum(gen_s) / (np.sum(gen_s) + np.sum(train_s))), 3),
                      "peak_gib": grpo_peak, "in_use_gib_by_step": memory.in_use,
                      "peak_gib_by_step": memory.peak, "train_s_all": [round(e["time/train"], 3) for e in steps],
                      "final_loss": result.training_loss}), flush=True)

    if a.no_sft_step:
        return
    # The SFT train step (what SFTTrainer runs: make_train_step) on the same model, rows of the GRPO step's shape.
    sft_seq = round_up(seq)
    graphdef, trainable, frozen = lora.split(model)
    trainable = jax.tree.map(jnp.copy, trainable)
    _, optimizer = trainer.make_optimizer(a.steps)
    opt_state = optimizer.init(trainable)
    trainable, frozen, opt_state = commit_to_devices((trainable, frozen, opt_state))
    step = make_train_step(graphdef, optimizer, remat=model.gradient_checkpointing)
    ids = rng.integers(1, cfg.vocab_size, (1, rows, sft_seq)).astype(np.int32)
    batch = {"input_ids": ids, "labels": ids, "attention_mask": np.ones_like(ids)}
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        trainable, opt_state, metrics = step(trainable, frozen, opt_state, jax.device_put(batch))
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    step_s = float(np.median(times[a.warmup:]))
    print(json.dumps({"name": "sft_step", **common, "rows": rows, "seq": sft_seq,
                      "tokens_per_s": round(rows * sft_seq / step_s, 1), "step_s": round(step_s, 4),
                      "step_s_all": [round(t, 3) for t in times], "peak_gib": peak_gib()}), flush=True)

if __name__ == "__main__":
    main()
