"""Headline benchmark: LoRA fine-tuning of an ANCHORS.md shape through the public API (SFTTrainer).

    XLA_PYTHON_CLIENT_PREALLOCATE=false python bench/train_bench.py /tmp/ckpt/qwen2-1.5b --batch 4 --seq 2048 \
        --remat unsloth [--steps 13] [--load-in-4bit] [--full-finetuning] [--optim adamw_8bit]

Configuration as ANCHORS.md: LoRA r=16, alpha=16, dropout 0, all seven projections, AdamW, bf16, random token
ids, median step time of the steps after 3 warm-up steps. --full-finetuning trains every weight instead
(from_pretrained(full_finetuning=True): bf16 weights, AdamW moments float32, or 8-bit with --optim adamw_8bit).
Prints one JSON line (with the trainable parameter count and the optimizer state's dtypes and size).
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from unsloth_jax import FastLanguageModel, SFTTrainer, TrainingArguments, ops  # noqa: E402
from unsloth_jax.train.optim import state_dtype  # noqa: E402


PEAK_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16, datasheet


def model_flops_per_token(cfg, seq: int) -> float | None:
    """6 x (matmul weights per token) + causal attention (6 S Hq hd per layer): the usual MFU numerator,
    without rematerialisation (recomputed work is not useful work). For a dense decoder whose layers all hold
    q/k/v/o and one GLU MLP; None for the layouts this count does not model (linear-attention layers, experts,
    per-layer inputs, KV-shared layers), whose lines then carry mfu null rather than a wrong figure."""
    if any(cfg.layer_linear) or cfg.is_moe or cfg.per_layer_input_size or cfg.layer_kv_source:
        return None
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    hq, hkv, n = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers
    per_layer = d * hq * hd + 2 * d * hkv * hd + hq * hd * d + 3 * d * f
    return 6.0 * (n * per_layer + cfg.vocab_size * d) + n * 6.0 * seq * hq * hd


def mfu(tokens_per_s: float, cfg, seq: int) -> float | None:
    flops = model_flops_per_token(cfg, seq)
    return None if flops is None else round(tokens_per_s * flops / PEAK_BF16_FLOPS, 4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--remat", default="unsloth",
                    help="use_gradient_checkpointing: unsloth, true, false, or a remat mode of "
                         "unsloth_jax.models.layer_stack (full, offload_attention, save_attention, ...), layer-stack "
                         "settings after commas: unsloth,layer_loop=unrolled or offload_attention,offload_copies=whole")
    ap.add_argument("--layers-per-checkpoint", type=int, default=1,
                    help="two-level checkpointing with --remat unsloth/true: keep every K-th layer input only")
    ap.add_argument("--steps", type=int, default=13)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--load-in-4bit", action="store_true")
    ap.add_argument("--load-in-fp8", action="store_true", help="FP8 (e4m3) frozen projections")
    ap.add_argument("--full-finetuning", action="store_true", help="train every weight (no LoRA)")
    ap.add_argument("--optim", default="adamw_torch")
    ap.add_argument("--memory-analysis", action="store_true",
                    help="also compile the step once more and report XLA's device/host buffer sizes for it")
    ap.add_argument("--profile", metavar="DIR",
                    help="trace the last --profile-steps steps with jax.profiler into DIR (left out of the timing) "
                         "and add bench/trace_summary.py's per-step GPU time breakdown to the JSON line")
    ap.add_argument("--profile-steps", type=int, default=2)
    a = ap.parse_args()
    remat = {"true": True, "false": False}.get(a.remat, a.remat)
    t0 = time.time()
    model, _ = FastLanguageModel.from_pretrained(a.model_dir, dtype="bfloat16", load_in_4bit=a.load_in_4bit,
                                                 load_in_fp8=a.load_in_fp8, load_tokenizer=False,
                                                 max_seq_length=a.seq, full_finetuning=a.full_finetuning,
                                                 use_gradient_checkpointing=remat,
                                                 layers_per_checkpoint=a.layers_per_checkpoint)
    load_s = time.time() - t0
    if not a.full_finetuning:
        model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0.0,
                                                 use_gradient_checkpointing=remat,
                                                 layers_per_checkpoint=a.layers_per_checkpoint)
    rng = np.random.default_rng(0)
    n = a.batch * a.steps
    data = [{"input_ids": rng.integers(0, model.config.vocab_size, a.seq).tolist()} for _ in range(n)]
    out = tempfile.mkdtemp()
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=a.batch, max_steps=a.steps,
                             logging_steps=1, save_steps=0, optim=a.optim, learning_rate=1e-4, logging_first_step=True)
    trainer = SFTTrainer(model=model, train_dataset=data, args=args, max_seq_length=a.seq)
    trainer._pad_id = lambda: 0
    step_times = []
    real_step = None
    arg_specs = None  # shapes/shardings of the first step's arguments (they are donated, so keep specs)
    stats0 = jax.devices()[0].memory_stats() or {}
    profile_from = a.steps - a.profile_steps if a.profile else a.steps  # profiled steps are not timed
    if a.profile and profile_from <= a.warmup:
        ap.error("--profile needs --steps > --warmup + --profile-steps")

    # time each step exactly: wrap the compiled step with a device sync
    import unsloth_jax.train.trainer as tr

    orig = tr.make_train_step

    def timed_make(*args_, **kw):
        nonlocal real_step
        real_step = orig(*args_, **kw)

        def timed(*xs):
            nonlocal arg_specs
            if arg_specs is None:
                arg_specs = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding), xs)
            if a.profile and len(step_times) == profile_from:
                jax.profiler.start_trace(a.profile)
            t = time.perf_counter()
            outs = real_step(*xs)
            jax.block_until_ready(outs)
            step_times.append(time.perf_counter() - t)
            if a.profile and len(step_times) == a.steps:
                jax.profiler.stop_trace()
            return outs

        timed.lower = real_step.lower  # the trainer compiles the step ahead for its memory plan
        return timed

    tr.make_train_step = timed_make
    trainer.train()
    tr.make_train_step = orig
    times = step_times[a.warmup:profile_from]
    ms = float(np.median(times)) * 1e3
    stats = jax.devices()[0].memory_stats() or {}
    line = {"name": "train_step", "model_dir": os.path.basename(a.model_dir.rstrip("/")), "batch": a.batch,
            "seq": a.seq, "remat": a.remat,
            "layers_per_checkpoint": a.layers_per_checkpoint, "remat_mode": str(model.gradient_checkpointing),
            "load_in_4bit": a.load_in_4bit, "load_in_fp8": a.load_in_fp8,
            "optim": a.optim, "full_finetuning": a.full_finetuning, "optimizer_state": state_dtype(a.optim),
            "step_ms": round(ms, 2), "tokens_per_s": round(a.batch * a.seq / (ms / 1e3), 1),
            "mfu": mfu(a.batch * a.seq / (ms / 1e3), model.config, a.seq),
            "peak_gib": round(stats.get("peak_bytes_in_use", 0) / 2**30, 3), "load_s": round(load_s, 1),
            # peak before the first step (loading, LoRA init): if it equals peak_gib, the step is not the peak
            "peak_gib_before_train": round(stats0.get("peak_bytes_in_use", 0) / 2**30, 3),
            "gib_in_use_before_train": round(stats0.get("bytes_in_use", 0) / 2**30, 3),
            "final_loss": trainer.state.loss_history[-1], "steps_timed": len(times),
            "step_ms_all": [round(t * 1e3, 1) for t in step_times],
            "jax": jax.__version__, "device": jax.devices()[0].device_kind,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            # what each op ran (FP8 rows: linear=fp8, or nf4_gemm=fp8 for an NF4 base multiplied in FP8)
            "impls": ops.chosen_impls(), "unsloth_jax_impl": os.environ.get(ops.ENV_VAR, "")}
    if arg_specs is not None:  # the step's (trainable, frozen, opt_state, batch) as the first call saw them
        # the step's trainable arrays (Qwen3.5: both token mixers' slots in every layer), and PEFT's count
        line["trainable_params"] = int(sum(np.prod(x.shape) for x in jax.tree.leaves(arg_specs[0])))
        line["trainable_params_peft"] = int(model.get_nb_trainable_parameters()[0])
        line["optimizer_state_dtypes"] = sorted({str(x.dtype) for x in jax.tree.leaves(arg_specs[2]) if x.ndim})
        line["optimizer_state_gib"] = round(sum(np.prod(x.shape) * x.dtype.itemsize
                                                for x in jax.tree.leaves(arg_specs[2])) / 2**30, 3)
    if a.memory_analysis and real_step is not None and arg_specs is not None:
        ma = real_step.lower(*arg_specs).compile().memory_analysis()
        line["step_program_gib"] = {k: round(getattr(ma, k) / 2**30, 3) for k in (
            "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
            "host_argument_size_in_bytes", "host_output_size_in_bytes", "host_temp_size_in_bytes")
            if getattr(ma, k, None) is not None}
    if a.profile:
        from bench.trace_summary import newest_trace, summarize

        line["profile"] = summarize(newest_trace(a.profile), steps=a.profile_steps)
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
