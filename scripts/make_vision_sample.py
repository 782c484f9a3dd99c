#!/usr/bin/env python
"""Write the bundled vision sample and tiny Gemma 3 vision-language model under unsloth_jax/assets/ (deterministic).

    python scripts/make_vision_sample.py              # both (a few seconds)
    python scripts/make_vision_sample.py --data_only  # only shapes_sample/ (no torch needed)

Writes:
  unsloth_jax/assets/shapes_sample/shapes_sample.jsonl  48 chat records with one image each (TRL's format):
      {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the shape."}]},
                    {"role": "assistant", "content": [{"type": "text", "text": "A red circle."}]}],
       "images": ["images/00.png"]}                     (image paths relative to the .jsonl)
  unsloth_jax/assets/shapes_sample/images/NN.png         40 x 40 palette PNGs: a red, green, blue or yellow circle,
      square or triangle (each of the 12 pairs 4 times, at a random size and place) on a plain pale background
  unsloth_jax/assets/tiny-gemma3-vl/                     a random Gemma 3 vision-language model (bf16 safetensors,
      text: hidden 64, 2 layers; SigLIP: hidden 48, 2 layers, 32 x 32 images in 8 x 8 patches, 4 image tokens),
      its processor: the tiny-llama tokenizer plus Gemma 3's three image tokens, and a Gemma 3 style chat template

The shapes are drawn with numpy (no anti-aliasing, no Pillow drawing code whose pixels change between versions)
and stored uncompressed (PNG compress_level 0), so the bytes depend on neither the Pillow nor the zlib version.
The model is torch's seeded initialisation of transformers' Gemma3ForConditionalGeneration (initializer_range
0.1, the final norm's weight 2, the image projector random rather than zero; not trained): a fine-tune on the sample starts from the loss of a random model.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "unsloth_jax" / "assets"
SAMPLE_DIR = ASSETS / "shapes_sample"
MODEL_DIR = ASSETS / "tiny-gemma3-vl"
TOKENIZER = ASSETS / "tiny-llama" / "tokenizer.json"
SEED = 39
# initializer_range 5x transformers' 0.02, and the final norm's weight 2 (a 3x scale): with the initialiser's
# values the tied lm_head's logits stay within a few units whatever LoRA does, and the loss cannot fall far. The
# image projector (zero in transformers' initialisation) is drawn with the same standard deviation.
INIT_STD, FINAL_NORM = 0.1, 2.0

SIZE = 40
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 210), "yellow": (235, 205, 30)}
BACKGROUNDS = [(250, 250, 250), (225, 225, 225), (245, 235, 215), (220, 235, 245)]
SHAPES = ("circle", "square", "triangle")
REPEATS = 4  # records per (colour, shape) pair
QUESTION = "Describe the shape."

BOI, IMAGE, EOI, MM_TOKENS = 2048, 2049, 2050, 4  # the three image tokens appended to the tiny-llama vocabulary
TEXT = dict(vocab_size=2051, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, sliding_window=64, sliding_window_pattern=2, query_pre_attn_scalar=16,
            max_position_embeddings=512, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", pad_token_id=3,
            bos_token_id=1, eos_token_id=2)
VISION = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, image_size=32,
              patch_size=8, num_channels=3)  # 4 x 4 patches, pooled 2 x 2 to MM_TOKENS tokens
# Gemma 3's chat template, reduced: turns, image parts as <start_of_image>, text parts (string or list content)
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
            "{{ '<start_of_turn>' + role + '\n' }}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
            "{% for item in m['content'] %}{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
            "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
            "{{ '<end_of_turn>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


# ------------------------------------------------------------------------------------------------- images
def draw(shape: str, colour: str, background: int, size: int, cx: int, cy: int):
    """A SIZE x SIZE palette image (mode "P"): palette 0 the background, 1 the shape's colour."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:SIZE, 0:SIZE]
    r = size // 2
    if shape == "circle":
        inside = (x - cx) ** 2 + (y - cy) ** 2 <= r * r + r  # r * r + r: no lone pixels at the four tips
    elif shape == "square":
        inside = (abs(x - cx) <= r) & (abs(y - cy) <= r)
    else:  # apex at the top, base at the bottom: |x - cx| grows from 0 to r going down
        inside = (y >= cy - r) & (y <= cy + r) & (2 * abs(x - cx) <= (y - (cy - r)))
    image = Image.fromarray(inside.astype(np.uint8), mode="P")
    image.putpalette([*BACKGROUNDS[background], *COLOURS[colour]] + [0, 0, 0] * 254)
    return image


def sample_specs() -> list[dict]:
    """The 48 images' (shape, colour, background, size, centre), shuffled by SEED."""
    rng = random.Random(SEED)
    specs = []
    for colour in COLOURS:
        for shape in SHAPES:
            for _ in range(REPEATS):
                size = rng.randrange(14, 27)
                lo, hi = size // 2 + 1, SIZE - size // 2 - 2
                specs.append(dict(shape=shape, colour=colour, background=rng.randrange(len(BACKGROUNDS)), size=size,
                                  cx=rng.randint(lo, hi), cy=rng.randint(lo, hi)))
    rng.shuffle(specs)
    return specs


def write_sample(out: Path = SAMPLE_DIR) -> list[Path]:
    """shapes_sample.jsonl and images/NN.png under `out` (replaced); returns the files written."""
    images = out / "images"
    if images.exists():
        shutil.rmtree(images)
    images.mkdir(parents=True)
    lines, written = [], []
    for i, spec in enumerate(sample_specs()):
        name = f"images/{i:02d}.png"
        draw(**spec).save(out / name, format="PNG", compress_level=0)
        written.append(out / name)
        lines.append(json.dumps({"messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
            {"role": "assistant", "content": [{"type": "text", "text": f"A {spec['colour']} {spec['shape']}."}]}],
            "images": [name]}) + "\n")
    jsonl = out / "shapes_sample.jsonl"
    tmp = jsonl.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(lines), encoding="utf-8", newline="\n")
    os.replace(tmp, jsonl)
    return [jsonl, *written]


# -------------------------------------------------------------------------------------------------- model
def build_processor():
    """transformers' Gemma3Processor: the tiny-llama tokenizer with Gemma 3's image tokens, 32 x 32 images."""
    from transformers import Gemma3Processor, PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tok = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER), bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>", extra_special_tokens={
                                      "boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                                      "eoi_token": "<end_of_image>"})
    assert (tok.boi_token_id, tok.image_token_id, tok.eoi_token_id) == (BOI, IMAGE, EOI)
    images = Gemma3ImageProcessorPil(size={"height": VISION["image_size"], "width": VISION["image_size"]},
                                     image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return Gemma3Processor(image_processor=images, tokenizer=tok, chat_template=TEMPLATE, image_seq_length=MM_TOKENS)


def build_model():
    """transformers' Gemma3ForConditionalGeneration with torch's seeded initialisation (float32)."""
    import torch
    import transformers

    torch.manual_seed(SEED)
    cfg = transformers.Gemma3Config(text_config=dict(TEXT, initializer_range=INIT_STD),
                                    vision_config=dict(VISION, initializer_range=INIT_STD),
                                    mm_tokens_per_image=MM_TOKENS, image_token_index=IMAGE, boi_token_index=BOI,
                                    eoi_token_index=EOI, initializer_range=INIT_STD)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # Gemma's RMSNorm scales by 1 + weight: 3x before the tied lm_head (see FINAL_NORM)
        model.model.language_model.norm.weight.fill_(FINAL_NORM)
        # transformers starts the projector at zero, which would give every image the same (zero) features
        projector = model.model.multi_modal_projector.mm_input_projection_weight
        projector.copy_(INIT_STD * torch.randn(projector.shape, generator=torch.Generator().manual_seed(SEED)))
    return model


def write_model(out: Path = MODEL_DIR) -> None:
    """config.json, generation_config.json, model.safetensors (bf16) and the processor files under `out`."""
    import torch

    torch.set_num_threads(1)
    processor, model = build_processor(), build_model()
    model.generation_config.eos_token_id = [TEXT["eos_token_id"], processor.tokenizer.convert_tokens_to_ids(
        "<end_of_turn>")]
    model.generation_config.pad_token_id = TEXT["pad_token_id"]
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(tmp)
    processor.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data_only", action="store_true", help="write shapes_sample/ only")
    args = ap.parse_args()
    files = write_sample()
    if not args.data_only:
        write_model()
        files += sorted(p for p in MODEL_DIR.iterdir())
    for f in files:
        print(f"  {f.relative_to(ROOT)}  {f.stat().st_size:>8d}")
    total = sum(f.stat().st_size for f in files)
    print(f"total {total / 1e3:.0f} kB")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
