"""Tiny random Gemma 3 vision-language models and a matching processor for the vision SFT / LoRA / export tests:
the text half uses the bundled tiny-llama tokenizer (2048 ids) plus Gemma 3's three image tokens (2048-2050), so
transformers' Gemma3Processor expands images and the chat template renders image parts as Gemma 3's does."""
from __future__ import annotations

import numpy as np

BOI, IMAGE, EOI, MM_TOKENS = 2048, 2049, 2050, 4
TEXT = dict(vocab_size=2051, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, sliding_window=3, sliding_window_pattern=2, query_pre_attn_scalar=24,
            max_position_embeddings=512, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", pad_token_id=3,
            bos_token_id=1, eos_token_id=2)
VISION = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, image_size=32,
              patch_size=8, num_channels=3)  # 4 x 4 patches, pooled 2 x 2 to 4 tokens
# Gemma 3's chat template, reduced to what the tests use: turns, image parts as <start_of_image>, text parts
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
            "{{ '<start_of_turn>' + role + '\n' }}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
            "{% for item in m['content'] %}{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
            "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
            "{{ '<end_of_turn>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
INSTRUCTION_PART, RESPONSE_PART = "<start_of_turn>user\n", "<start_of_turn>model\n"


def hf_gemma3(seed: int = 0):
    """transformers' Gemma3ForConditionalGeneration (eager attention, float32) with random weights everywhere."""
    import torch
    import transformers

    cfg = transformers.Gemma3Config(text_config=dict(TEXT), vision_config=dict(VISION), mm_tokens_per_image=MM_TOKENS,
                                    image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI)
    for c in (cfg, cfg.text_config, cfg.vision_config):
        c._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            siglip_norm = "vision_tower" in name and ("layer_norm" in name or "layernorm" in name)
            if siglip_norm and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "norm" in name and not siglip_norm:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
    return model.eval()


def processor():
    """A Gemma3Processor: the tiny-llama tokenizer with Gemma 3's image tokens, 32 x 32 images in [-1, 1]."""
    from pathlib import Path

    from transformers import Gemma3Processor, PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    asset = Path(__file__).resolve().parents[1] / "unsloth_jax" / "assets" / "tiny-llama" / "tokenizer.json"
    tok = PreTrainedTokenizerFast(tokenizer_file=str(asset), bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>", extra_special_tokens={
                                      "boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                                      "eoi_token": "<end_of_image>"})
    assert (tok.boi_token_id, tok.image_token_id, tok.eoi_token_id) == (BOI, IMAGE, EOI)
    images = Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return Gemma3Processor(image_processor=images, tokenizer=tok, chat_template=TEMPLATE, image_seq_length=MM_TOKENS)


def shapes_dataset(n: int, seed: int = 0) -> list[dict]:
    """n chat records, each a coloured square on a random background (an array in `images`) and its colour."""
    rng = np.random.default_rng(seed)
    colours = {"red": (230, 30, 30), "green": (30, 200, 40), "blue": (40, 60, 220)}
    out = []
    for i in range(n):
        name = list(colours)[i % 3]
        h, w = rng.integers(24, 48, size=2)
        image = rng.integers(0, 60, size=(h, w, 3)).astype(np.uint8)
        image[h // 4:3 * h // 4, w // 4:3 * w // 4] = colours[name]
        out.append({"messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": f"The square is {name}."}]}],
            "images": [image]})
    return out
