"""Vision-language LoRA / QLoRA train step with images: unsloth_jax beside transformers + PEFT (issue 39).

    python bench/vision_bench.py make --family qwen2_5_vl --shape 7b [--checkpoint DIR]
    XLA_PYTHON_CLIENT_PREALLOCATE=false python bench/vision_bench.py run --side ours --family qwen2_5_vl \
        --shape 7b [--batch 2 --seq 2048 --images-per-row 2] [--load-in-4bit] [--remat unsloth] [--steps 10]
    python bench/vision_bench.py run --side hf --family gemma3 --shape 4b

`make` writes a random-init bfloat16 checkpoint of a VL_SHAPES entry (bench/shapes.py) with transformers
(Qwen2_5_VLForConditionalGeneration / Qwen3VLForConditionalGeneration / Gemma3ForConditionalGeneration from the
config, on the GPU if present) to
--checkpoint (default /tmp/ckpt/FAMILY-SHAPE), unless it holds a config.json already. Every weight is redrawn at
1/sqrt(fan-in) (norms around their unit scale), so activations stay near unit size at any width and the first loss
depends on the images (transformers starts Gemma 3's projector at zero).

`run` trains one side for --steps steps on one fixed batch, built directly from the config (no processor; the
same ids, labels and pixels on both sides): --batch rows of --seq tokens, each row a few random text tokens, then
--images-per-row images framed as the chat templates frame them (Qwen2.5-VL: <|vision_start|>, 256 x
<|image_pad|> for a 448 x 448 image (grid 1 x 32 x 32), <|vision_end|>; Qwen3-VL the same for a 512 x 512
image (patch 16); Gemma 3: <start_of_image>, 256 image
tokens for its 896 x 896 image, <end_of_image>), then random text to the end of the row, the loss on that text
(labels -100 on the prompt and the image blocks; no padding, so every token is real).

- side "ours": FastVisionModel.from_pretrained(dtype=bfloat16, load_in_4bit=...) + get_peft_model(r=16,
  lora_alpha=16, vision and language layers, attention and MLP), then SFTTrainer.train() with AdamW: the batch
  goes through the trainer's own VisionLoader (sequence and patch buckets, Qwen's window layout) and jitted step;
  only the processor is replaced (FixedBatchCollator returns the built batch).
- side "hf": transformers bf16 (sdpa attention) + PEFT LoRA on the same modules, gradient checkpointing
  (use_reentrant=False) when ours checkpoints, torch.optim.AdamW, forward(labels) + backward + clip + step.
  No QLoRA here (no bitsandbytes on the GPU image): ours NF4 is reported beside this 16-bit row.

One JSON line on stdout per run (the trainer's own lines go to stderr): median step time after --warmup steps,
tokens/s = real tokens per step / median seconds, peak device memory (jax memory_stats()["peak_bytes_in_use"]
/ torch.cuda.max_memory_allocated; null on the CPU), load / compile / first-step seconds, trainable parameters,
the first and last loss. A model ours refuses to load (a ConfigError) prints a line with "error"
and exits 2.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from bench.shapes import VL_SHAPES  # noqa: E402

HF_CLASS = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration",
            "gemma3": "Gemma3ForConditionalGeneration"}
QWEN_FAMILIES = ("qwen2_5_vl", "qwen3_vl")  # patches + image_grid_thw + M-RoPE positions
PROMPT_TOKENS = 8  # text tokens before the images of a row
LR = 1e-4
# PEFT targets (regexes matched in full against transformers' module names) of the modules ours adapts
_LANGUAGE_TARGETS = r".*language_model.*\.layers\.\d+\.(?:self_attn\.(?:q|k|v|o)_proj|mlp\.(?:gate|up|down)_proj)"
_VISION_TARGETS = {
    "qwen2_5_vl": r".*visual\.blocks\.\d+\.(?:attn\.(?:qkv|proj)|mlp\.(?:gate|up|down)_proj)",
    "qwen3_vl": r".*visual\.blocks\.\d+\.(?:attn\.(?:qkv|proj)|mlp\.linear_fc[12])",
    "gemma3": r".*vision_tower.*encoder\.layers\.\d+\.(?:self_attn\.(?:q|k|v|out)_proj|mlp\.fc[12])",
}


# ------------------------------------------------------------------------------------------------ checkpoint
def hf_config(family: str, shape: str):
    """transformers' config object of VL_SHAPES[family][shape]."""
    import transformers

    kw = dict(VL_SHAPES[family][shape]["config"])
    return transformers.AutoConfig.for_model(kw.pop("model_type"), **kw)


def redraw_weights(model, seed: int = 0) -> None:
    """Every weight of `model` (in place, its dtype kept): matrices and conv kernels N(0, 1 / fan_in) (fan_in =
    the product of all but the first dim); norm weights and biases their value + N(0, 0.1^2) (Gemma's (1 + w)
    norms and the unit-scale norms both stay near 1); other vectors (biases) N(0, 0.02^2)."""
    import torch

    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
            if p.ndim >= 2:
                p.copy_(noise / math.sqrt(math.prod(p.shape[1:])))
            elif "norm" in name or "ln_" in name:
                p.copy_(p.float() + 0.1 * noise)
            else:
                p.copy_(0.02 * noise)


def default_checkpoint(family: str, shape: str) -> str:
    return f"/tmp/ckpt/{family}-{shape}"


def make_checkpoint(family: str, shape: str, out: str) -> bool:
    """Write the random-init bfloat16 checkpoint of VL_SHAPES[family][shape] to `out` (module docstring), on the
    GPU if present; False (nothing done) when `out` already holds a config.json."""
    import torch
    import transformers

    if os.path.isfile(os.path.join(out, "config.json")):
        return False
    t0 = time.time()
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.AutoModelForImageTextToText.from_config(hf_config(family, shape), dtype=torch.bfloat16)
    redraw_weights(model)
    model.save_pretrained(out)
    print(f"wrote {family}-{shape} to {out} in {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
    return True


# ----------------------------------------------------------------------------------------------------- batch
@dataclasses.dataclass(frozen=True)
class ImageFraming:
    """How one image sits in a row: `start` token, `count` x `token`, `end` token; `text_below` is the first
    special id (text ids are drawn below it)."""

    start: int
    token: int
    end: int
    count: int
    text_below: int


def image_framing(family: str, shape: str) -> ImageFraming:
    """The image-token block of one image of VL_SHAPES[family][shape] at its image_side."""
    entry = VL_SHAPES[family][shape]
    cfg, side = entry["config"], entry["image_side"]
    if family in QWEN_FAMILIES:
        v = cfg["vision_config"]
        per_side = side // v["patch_size"]
        count = per_side * per_side // v["spatial_merge_size"] ** 2
        ids = (cfg["vision_start_token_id"], cfg["image_token_id"], cfg["vision_end_token_id"])
        special = ids + (cfg["video_token_id"],)
    else:
        count = cfg["mm_tokens_per_image"]
        ids = (cfg["boi_token_index"], cfg["image_token_index"], cfg["eoi_token_index"])
        special = ids
    return ImageFraming(*ids, count=count, text_below=min(special))


def token_rows(framing: ImageFraming, rows: int, seq: int, images_per_row: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, labels) int32 [rows, seq]: PROMPT_TOKENS random text ids, the image blocks, random text to
    the end; labels = ids on the text after the last image block, -100 before it."""
    block = [framing.start] + [framing.token] * framing.count + [framing.end]
    images_end = PROMPT_TOKENS + images_per_row * len(block)
    if images_end >= seq - 1:
        raise ValueError(f"--seq {seq} holds no text after {images_per_row} image(s) of {len(block)} tokens "
                         f"and a {PROMPT_TOKENS}-token prompt; raise --seq")
    ids = rng.integers(3, framing.text_below, size=(rows, seq)).astype(np.int32)
    ids[:, PROMPT_TOKENS:images_end] = np.tile(block, images_per_row)
    labels = ids.copy()
    labels[:, :images_end] = -100
    return ids, labels


def image_pixels(family: str, shape: str, images: int, rng) -> dict:
    """The pixel inputs of `images` random images as the processor returns them (normalised, float32):
    Qwen2.5-VL pixel_values [images * patches, C*T*p*p] and image_grid_thw int32 [images, 3]; Gemma 3
    pixel_values [images, C, H, W]."""
    entry = VL_SHAPES[family][shape]
    v, side = entry["config"]["vision_config"], entry["image_side"]
    if family in QWEN_FAMILIES:
        per_side = side // v["patch_size"]
        patch_dim = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
        pixels = rng.standard_normal((images * per_side * per_side, patch_dim), dtype=np.float32)
        return {"pixel_values": pixels, "image_grid_thw": np.tile(np.int32([1, per_side, per_side]), (images, 1))}
    if side != v["image_size"]:
        raise ValueError(f"gemma3 {shape}: image_side {side} differs from the vision tower's {v['image_size']}")
    return {"pixel_values": rng.uniform(-1, 1, (images, v["num_channels"], side, side)).astype(np.float32)}


def build_batch(family: str, shape: str, rows: int, seq: int, images_per_row: int, seed: int = 0) -> dict:
    """One batch (numpy) for both sides: input_ids, attention_mask (all ones), labels int32 [rows, seq], the
    image_pixels fields, and image_token_mask int32 [rows, seq] (1 on the image tokens: Gemma's token_type_ids,
    Qwen's mm_token_type_ids)."""
    rng = np.random.default_rng(seed)
    framing = image_framing(family, shape)
    ids, labels = token_rows(framing, rows, seq, images_per_row, rng)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": labels,
            "image_token_mask": (ids == framing.token).astype(np.int32),
            **image_pixels(family, shape, rows * images_per_row, rng)}


# ------------------------------------------------------------------------------------------------------ ours
def ours_collator_class():
    """FixedBatchCollator (defined on first use: the hf side never imports unsloth_jax)."""
    from unsloth_jax import UnslothVisionDataCollator

    class FixedBatchCollator(UnslothVisionDataCollator):
        """UnslothVisionDataCollator's interface around one batch built without a processor: every call returns
        that batch as the collator would (Gemma 3: token_type_ids; Qwen2.5-VL: mrope_positions [3, B, S] int32
        and image_grid_thw), so the trainer's VisionLoader pads and lays it out as it does a collated one."""

        def __init__(self, model, batch: dict):  # no processor: nothing of the parent's constructor applies
            from unsloth_jax.models.vision_qwen2_5 import mrope_positions

            cfg = model.vl_config
            self.vl_config, self.is_qwen = cfg, cfg.model_type in QWEN_FAMILIES
            self.pad_token_id, self.max_seq_length = 0, None
            out = {k: batch[k] for k in ("input_ids", "attention_mask", "labels", "pixel_values")}
            if self.is_qwen:
                out["image_grid_thw"] = batch["image_grid_thw"]
                out["mrope_positions"] = mrope_positions(cfg, batch["input_ids"], batch["attention_mask"],
                                                         batch["image_grid_thw"]).astype(np.int32)
            else:
                out["token_type_ids"] = batch["image_token_mask"]
            self.batch = out

        def check(self, records, first_index: int = 0) -> None:
            pass

        def __call__(self, records, indices=None) -> dict:
            return dict(self.batch)

    return FixedBatchCollator


def timed_trainer_class():
    """SFTTrainer that records the ahead-of-time compile (run_summary_lines) and each step's seconds, the step
    synchronised (jax.block_until_ready) so its time is the device's."""
    import jax

    from unsloth_jax import SFTTrainer

    class TimedSFTTrainer(SFTTrainer):
        compile_s = 0.0
        step_s: list

        def run_summary_lines(self, start):
            t0 = time.perf_counter()
            lines = super().run_summary_lines(start)
            self.compile_s = time.perf_counter() - t0
            return lines

        def run_step(self, state, batch):
            t0 = time.perf_counter()
            out = jax.block_until_ready(super().run_step(state, batch))
            self.step_s.append(time.perf_counter() - t0)
            return out

    return TimedSFTTrainer


def jax_memory() -> tuple[float | None, float | None]:
    """(peak, in use) GiB of the first jax device; None where the backend keeps no statistics (CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    if not stats:
        return None, None
    return gib(stats.get("peak_bytes_in_use", 0)), gib(stats.get("bytes_in_use", 0))


def gib(n: int | None) -> float | None:
    return None if n is None else round(n / 2**30, 3)


def run_ours(a, batch: dict) -> dict:
    """Train with unsloth_jax (module docstring); the fields of the JSON line this side measures."""
    import jax

    from unsloth_jax import FastVisionModel, TrainingArguments, lora
    from unsloth_jax.errors import ConfigError

    t0 = time.time()
    try:
        model, _ = FastVisionModel.from_pretrained(a.checkpoint, dtype=a.dtype, load_in_4bit=a.load_in_4bit,
                                                   max_seq_length=a.seq, load_processor=False, progress=False)
    except ConfigError as e:
        return {"error": str(e)}
    load_s = time.time() - t0
    model = FastVisionModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0.0,
                                           finetune_vision_layers=a.finetune_vision_layers,
                                           finetune_language_layers=True, finetune_attention_modules=True,
                                           finetune_mlp_modules=True, use_gradient_checkpointing=a.remat_value)
    trainable = lora.count(lora.split(model)[1])
    peak_before, in_use_before = jax_memory()
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=a.batch, max_steps=a.steps,
                             logging_steps=1, save_steps=0, optim="adamw_torch", learning_rate=LR, report_to="none",
                             lr_scheduler_type="constant")  # as the hf side's AdamW
    trainer = timed_trainer_class()(model=model, train_dataset=[{}] * a.batch, args=args, max_seq_length=a.seq,
                                    data_collator=ours_collator_class()(model, batch))
    trainer.step_s = []
    trainer.train()
    peak, _ = jax_memory()
    return {"load_s": round(load_s, 1), "compile_s": round(trainer.compile_s, 1), "step_s": trainer.step_s,
            "losses": list(trainer.state.loss_history), "trainable_params": trainable, "peak_gib": peak,
            "peak_gib_before_train": peak_before, "gib_in_use_before_train": in_use_before,
            "remat_mode": str(model.gradient_checkpointing), "jax": jax.__version__,
            "device": jax.devices()[0].device_kind}


# -------------------------------------------------------------------------------------------------------- hf
def hf_target_modules(family: str, vision: bool) -> str:
    """PEFT's target_modules regex for the modules ours adapts: the language projections, and with `vision` the
    vision blocks' (Qwen: attn.qkv / attn.proj / mlp.gate|up|down_proj; Gemma: q|k|v|out_proj, fc1, fc2)."""
    return f"{_LANGUAGE_TARGETS}|{_VISION_TARGETS[family]}" if vision else _LANGUAGE_TARGETS


def hf_inputs(model, batch: dict, device) -> dict:
    """The forward's keyword arguments on `device`: ids, mask, labels (int64), pixel_values float32 (as the
    processor gives them), image_grid_thw (Qwen), and the image-token mask under whichever of token_type_ids
    (Gemma 3) / mm_token_type_ids (Qwen2.5-VL in transformers >= 5.x) the model's forward takes."""
    import inspect

    import torch

    params = inspect.signature(type(model).forward).parameters
    out = {k: torch.as_tensor(batch[k], dtype=torch.long) for k in ("input_ids", "attention_mask", "labels")}
    out["pixel_values"] = torch.as_tensor(batch["pixel_values"])
    if "image_grid_thw" in batch:
        out["image_grid_thw"] = torch.as_tensor(batch["image_grid_thw"], dtype=torch.long)
    for name in ("token_type_ids", "mm_token_type_ids"):
        if name in params:
            out[name] = torch.as_tensor(batch["image_token_mask"], dtype=torch.long)
    return {k: v.to(device) for k, v in out.items()}


def run_hf(a, batch: dict) -> dict:
    """Train with transformers + PEFT (module docstring); the fields of the JSON line this side measures."""
    import peft
    import torch
    import transformers

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[a.dtype]
    t0 = time.time()
    base = getattr(transformers, HF_CLASS[a.family]).from_pretrained(a.checkpoint, dtype=dtype,
                                                                     attn_implementation="sdpa").to(device)
    sync()
    load_s = time.time() - t0
    if a.remat_value is not False:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    inputs = hf_inputs(base, batch, device)
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=16, lora_alpha=16, lora_dropout=0.0, bias="none",
        target_modules=hf_target_modules(a.family, a.finetune_vision_layers)))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    cuda_peak = (lambda: gib(torch.cuda.max_memory_allocated())) if device.type == "cuda" else (lambda: None)
    peak_before = cuda_peak()
    step_s, losses = [], []
    for _ in range(a.steps):
        sync()
        t = time.perf_counter()
        loss = model(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        step_s.append(time.perf_counter() - t)
        losses.append(float(loss.detach()))
    return {"load_s": round(load_s, 1), "step_s": step_s, "losses": losses,
            "trainable_params": int(sum(p.numel() for p in params)), "peak_gib": cuda_peak(),
            "peak_gib_before_train": peak_before, "torch": torch.__version__, "peft": peft.__version__,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}


# ------------------------------------------------------------------------------------------------------- run
def record(a, batch: dict, measured: dict) -> dict:
    """The JSON line of a run: what ran, then the measurements (step_s and losses summarised)."""
    import transformers

    images = int(batch["pixel_values"].shape[0]) if a.family == "gemma3" else len(batch["image_grid_thw"])
    line = {"name": "vision_train_step", "family": a.family, "shape": a.shape, "side": a.side,
            "precision": ("NF4 QLoRA" if a.load_in_4bit else "bf16 LoRA" if a.dtype == "bfloat16"
                          else f"{a.dtype} LoRA"),
            "batch": a.batch, "seq": a.seq, "images_per_row": a.images_per_row, "images": images,
            "image_side": VL_SHAPES[a.family][a.shape]["image_side"],
            "image_tokens_per_step": int(batch["image_token_mask"].sum()),
            "real_tokens_per_step": int(batch["attention_mask"].sum()),
            "label_tokens_per_step": int((batch["labels"][:, 1:] != -100).sum()),
            "remat": a.remat, "finetune_vision_layers": a.finetune_vision_layers,
            "transformers": transformers.__version__}
    if "error" in measured:
        return {**line, **measured}
    step_s, losses = measured.pop("step_s"), measured.pop("losses")
    timed = step_s[a.warmup:]
    ms = float(np.median(timed)) * 1e3  # parse_args asks steps > warmup: never empty
    line.update({"step_ms": round(ms, 2), "tokens_per_s": round(line["real_tokens_per_step"] / (ms / 1e3), 1),
                 "first_step_s": round(step_s[0], 2), "steps_timed": len(timed),
                 "step_ms_all": [round(t * 1e3, 1) for t in step_s],
                 "loss_first": losses[0], "loss_last": losses[-1],
                 "losses_finite": bool(np.all(np.isfinite(losses))), **measured})
    return line


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for name in ("make", "run"):
        p = sub.add_parser(name)
        p.add_argument("--family", required=True, choices=sorted(VL_SHAPES))
        p.add_argument("--shape", required=True, help="7b (qwen2_5_vl), 8b (qwen3_vl), 4b (gemma3) or tiny")
        p.add_argument("--checkpoint", help="the checkpoint folder (default /tmp/ckpt/FAMILY-SHAPE)")
    run = sub.choices["run"]
    run.add_argument("--side", required=True, choices=("ours", "hf"))
    run.add_argument("--batch", type=int, default=2)
    run.add_argument("--seq", type=int, default=2048)
    run.add_argument("--images-per-row", type=int, default=2)
    run.add_argument("--load-in-4bit", action="store_true", help="ours only: NF4 language projections (QLoRA)")
    run.add_argument("--remat", default="unsloth", help="use_gradient_checkpointing: unsloth, true or false (hf: "
                                                        "gradient checkpointing on unless false)")
    run.add_argument("--no-vision-lora", dest="finetune_vision_layers", action="store_false",
                     help="LoRA on the language layers only (default: both towers, as Unsloth's vision notebooks)")
    run.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    run.add_argument("--steps", type=int, default=10)
    run.add_argument("--warmup", type=int, default=3)
    run.add_argument("--seed", type=int, default=0, help="of the batch's ids and pixels")
    a = ap.parse_args(argv)
    if a.shape not in VL_SHAPES[a.family]:
        ap.error(f"--shape {a.shape}: {a.family} has {', '.join(VL_SHAPES[a.family])}")
    a.checkpoint = a.checkpoint or default_checkpoint(a.family, a.shape)
    if a.command == "run":
        if a.side == "hf" and a.load_in_4bit:
            ap.error("--load-in-4bit is for --side ours only: transformers' QLoRA needs bitsandbytes, which the GPU "
                     "image lacks; ours NF4 is compared with --side hf's 16-bit LoRA row")
        if a.steps <= a.warmup:
            ap.error(f"--steps {a.steps} must exceed --warmup {a.warmup}")
        a.remat_value = {"true": True, "false": False}.get(a.remat, a.remat)
    return a


def run(a) -> dict:
    """Train side a.side on the built batch; the JSON line's dict (with "error" when ours refuses the model).
    The trainers' own prints go to stderr, so stdout holds only the line."""
    batch = build_batch(a.family, a.shape, a.batch, a.seq, a.images_per_row, a.seed)
    with contextlib.redirect_stdout(sys.stderr):
        measured = run_ours(a, batch) if a.side == "ours" else run_hf(a, batch)
    return record(a, batch, measured)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.command == "make":
        make_checkpoint(a.family, a.shape, a.checkpoint)
        return 0
    line = run(a)
    print(json.dumps(line), flush=True)
    return 2 if "error" in line else 0


if __name__ == "__main__":
    sys.exit(main())
