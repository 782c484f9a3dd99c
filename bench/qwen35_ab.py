"""Qwen3.5 LoRA step, unsloth_jax beside transformers + PEFT, one call (issue 46): tokens/s and peak memory.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python bench/qwen35_ab.py /tmp/ckpt/qwen3.5-9b [--batch 4 --seq 2048]
    python bench/qwen35_ab.py CKPT --side hf     # one side in this process (what the line above spawns)

Both sides train the same random-init bf16 checkpoint (bench/make_checkpoint.py qwen3.5-9b: Qwen3_5ForCausalLM) on
batches of --batch rows of --seq random token ids drawn alike (numpy default_rng(0), as train_bench), every token
labelled; LoRA r=16, alpha 16, dropout 0 on the seven attention / MLP projections (q/k/v/o_proj of the gated-attention
layers, gate/up/down_proj of every layer; the DeltaNet projections are not targets on either side), AdamW lr 1e-4,
gradient clipping at 1.0, gradient checkpointing, bf16 weights.

- side "ours": bench/train_bench.py (FastLanguageModel + SFTTrainer, --remat unsloth: Unsloth's
  use_gradient_checkpointing="unsloth"), its JSON line with "side": "ours" (its trainable_params equals PEFT's: each
  token mixer's projections are stacked over its own layers only).
- side "hf": transformers Qwen3_5ForCausalLM bf16 (sdpa attention) + peft.get_peft_model, gradient checkpointing
  (use_reentrant=False, as Unsloth's "unsloth" setting is for PEFT), torch.optim.AdamW; forward(labels) + backward
  + clip + step, each step synchronised. Which gated-delta / conv1d path transformers ran is recorded: the
  functions the DeltaNet layer calls, whether the fla / causal_conv1d / kernels packages are importable, and every
  transformers warning logged while loading and training (without those packages its Qwen3.5 runs the torch
  fallback loops, which the comparison must say).

Each side runs in its own process, one after the other, so each peak (jax memory_stats()["peak_bytes_in_use"] /
torch.cuda.max_memory_allocated, null on the CPU) is its own. Lines on stdout: one per side ("name":
"qwen35_train_step"; a side that fails prints one with "error"), then "name": "qwen35_ab" with both sides'
tokens/s and peak and ours / hf.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LR = 1e-4


def token_batch(vocab: int, batch: int, seq: int):
    """int64 [batch, seq] random ids as train_bench draws its first batch (default_rng(0), rows in order)."""
    import numpy as np

    rng = np.random.default_rng(0)
    return np.stack([rng.integers(0, vocab, seq) for _ in range(batch)]).astype(np.int64)


class _Collect(logging.Handler):
    """Keeps the messages of the transformers log records at WARNING and above."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        msg = record.getMessage().strip()
        if msg and msg[:300] not in self.messages:
            self.messages.append(msg[:300])


def linear_attention_path(model) -> dict:
    """What transformers' gated DeltaNet layers run: the packages that give the fast path, and the functions the
    first DeltaNet layer holds (module-level functions where this transformers resolves them at call time)."""
    packages = {name: importlib.util.find_spec(name) is not None for name in ("fla", "causal_conv1d", "kernels")}
    layer = next((m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")), None)
    functions = {}
    if layer is not None:
        module = sys.modules[type(layer).__module__]
        for name in ("chunk_gated_delta_rule", "causal_conv1d_fn", "torch_chunk_gated_delta_rule",
                     "causal_conv1d_forward"):
            fn = getattr(layer, name, None) or getattr(module, name, None)
            if fn is not None:
                functions[name] = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
        fast = getattr(module, "is_fast_path_available", None)
        if fast is not None:
            functions["is_fast_path_available"] = bool(fast)
    return {"packages": packages, "functions": functions, "layer": type(layer).__name__ if layer else None}


def run_hf(a) -> dict:
    """transformers + PEFT side (module docstring): the fields of its JSON line."""
    import numpy as np
    import peft
    import torch
    import transformers

    log = _Collect()
    logging.getLogger("transformers").addHandler(log)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.time()
    base = transformers.AutoModelForCausalLM.from_pretrained(a.checkpoint, dtype=torch.bfloat16,
                                                             attn_implementation="sdpa").to(device)
    sync()
    load_s = time.time() - t0
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.config.use_cache = False
    model = peft.get_peft_model(base, peft.LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, bias="none",
                                                      target_modules=TARGETS))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    ids = torch.as_tensor(token_batch(base.config.vocab_size, a.batch, a.seq), device=device)
    step_s, losses = [], []
    for _ in range(a.steps):
        sync()
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        step_s.append(time.perf_counter() - t)
        losses.append(float(loss.detach()))
    timed = step_s[a.warmup:]
    ms = float(np.median(timed)) * 1e3
    peak = round(torch.cuda.max_memory_allocated() / 2**30, 3) if device.type == "cuda" else None
    return {"model": type(base).__name__, "step_ms": round(ms, 2),
            "tokens_per_s": round(a.batch * a.seq / (ms / 1e3), 1), "peak_gib": peak, "load_s": round(load_s, 1),
            "first_step_s": round(step_s[0], 2), "steps_timed": len(timed),
            "step_ms_all": [round(t * 1e3, 1) for t in step_s], "final_loss": losses[-1],
            "losses_finite": bool(np.all(np.isfinite(losses))),
            "trainable_params": int(sum(p.numel() for p in params)), "attention": "sdpa",
            "gradient_checkpointing": "use_reentrant=False", "linear_attention": linear_attention_path(base),
            "transformers_warnings": log.messages, "transformers": transformers.__version__,
            "torch": torch.__version__, "peft": peft.__version__,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}


def side_command(a, side: str) -> list[str]:
    """The command of one side's process."""
    common = ["--batch", str(a.batch), "--seq", str(a.seq), "--steps", str(a.steps), "--warmup", str(a.warmup)]
    if side == "ours":
        return [sys.executable, os.path.join(ROOT, "bench", "train_bench.py"), a.checkpoint, "--remat", "unsloth",
                *common]
    return [sys.executable, os.path.abspath(__file__), a.checkpoint, "--side", "hf", *common]


def run_sides(a) -> list[dict]:
    """Each of a.sides in its own process, in order; their lines (one with "error" for a side that failed)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    lines = []
    for side in a.sides.split(","):
        base = {"name": "qwen35_train_step", "side": side, "batch": a.batch, "seq": a.seq}
        try:
            run = subprocess.run(side_command(a, side), env=env, capture_output=True, text=True, timeout=a.timeout)
            out = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
            err = run.stderr.strip().splitlines()
            if run.returncode != 0 or not out:
                line = dict(base, error=f"exit {run.returncode}: {err[-1][:300] if err else ''}")
            else:
                line = {**base, **{k: v for k, v in json.loads(out[-1]).items() if k != "name"}}
        except subprocess.TimeoutExpired:
            line = dict(base, error=f"timed out after {a.timeout} s")
        print(json.dumps(line), flush=True)
        lines.append(line)
    return lines


def summary(lines: list[dict]) -> dict:
    """The "qwen35_ab" line: each side's tokens/s and peak, and ours / hf where both ran."""
    by = {ln["side"]: ln for ln in lines}
    out = {"name": "qwen35_ab"}
    for side, ln in by.items():
        out[f"{side}_tokens_per_s"] = ln.get("tokens_per_s")
        out[f"{side}_peak_gib"] = ln.get("peak_gib")
        if "error" in ln:
            out[f"{side}_error"] = ln["error"]
    ours, hf = by.get("ours", {}), by.get("hf", {})
    if ours.get("tokens_per_s") and hf.get("tokens_per_s"):
        out["speedup_ours_over_hf"] = round(ours["tokens_per_s"] / hf["tokens_per_s"], 3)
    if ours.get("peak_gib") and hf.get("peak_gib"):
        out["peak_ratio_ours_over_hf"] = round(ours["peak_gib"] / hf["peak_gib"], 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="a Qwen3_5ForCausalLM checkpoint folder (bench/make_checkpoint.py qwen3.5-9b)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--side", choices=("hf",), help="run the transformers + PEFT side in this process")
    ap.add_argument("--sides", default="ours,hf", help="the sides to run, in order (default ours,hf)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds for each side's process")
    a = ap.parse_args(argv)
    if a.steps <= a.warmup:
        ap.error(f"--steps {a.steps} must exceed --warmup {a.warmup}")
    unknown = set(a.sides.split(",")) - {"ours", "hf"}
    if unknown:
        ap.error(f"--sides: unknown side(s) {', '.join(sorted(unknown))} (ours, hf)")
    if a.side == "hf":
        print(json.dumps({"name": "qwen35_train_step", **run_hf(a)}), flush=True)
        return 0
    lines = run_sides(a)
    print(json.dumps(summary(lines)), flush=True)
    return 0 if all("error" not in ln for ln in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
