"""A tiny random Qwen2.5-VL (transformers' Qwen2_5_VLForConditionalGeneration, eager attention, float32) and
matching inputs built directly (no image processor): pixel_values [patches, C*T*p*p] random, image_grid_thw.
For the SFT tests, hf_qwen_vl(processor_vocab=True) takes the ids of processor(): the bundled tiny-llama tokenizer
(2048 ids) plus Qwen's vision tokens (2048-2051), a Qwen2.5-VL processor without the video half (it needs
torchvision) and a minimal chat template."""
from __future__ import annotations

import numpy as np

IMAGE, VIDEO, VSTART, VEND = 250, 251, 252, 253
TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]))  # head_dim 16
# patch 4, merge 2, window 16 px = 2 x 2 merged tokens: the grids below have 2 windows each; block 1 attends fully
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, window_size=16, fullatt_block_indexes=[1], in_channels=3)
GRIDS = np.array([[1, 4, 8], [1, 6, 4]])  # 32 + 24 patches -> 8 + 6 language tokens
PATCH_DIM = 3 * 2 * 4 * 4
# processor() ids: the tiny-llama tokenizer's 2048, then <|vision_start|>, <|image_pad|>, <|vision_end|>, <|video_pad|>
P_VSTART, P_IMAGE, P_VEND, P_VIDEO = 2048, 2049, 2050, 2051
# Qwen's chat template, reduced to what the tests use: <|im_start|>role\n ... <|im_end|>\n, images as
# <|vision_start|><|image_pad|><|vision_end|> (the processor repeats the pad once per merged patch)
TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['content'] is string %}"
            "{{ m['content'] }}{% else %}{% for item in m['content'] %}{% if item['type'] == 'image' %}"
            "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{% elif item['type'] == 'text' %}{{ item['text'] }}"
            "{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
INSTRUCTION_PART, RESPONSE_PART = "<|im_start|>user\n", "<|im_start|>assistant\n"


def random_qwen_vl(config_class: str, model_class: str, text: dict, vision: dict, seed: int, processor_vocab: bool):
    """transformers' `model_class` (a Qwen-VL ForConditionalGeneration, eager attention, float32) of
    `config_class`(text_config=text, vision_config=vision) with random weights everywhere (norm weights around 1);
    processor_vocab: 2052 ids with processor()'s vision token ids (else text's vocabulary, the tokens above)."""
    import torch
    import transformers

    text, ids = dict(text), (IMAGE, VIDEO, VSTART, VEND)
    if processor_vocab:
        text["vocab_size"], ids = 2052, (P_IMAGE, P_VIDEO, P_VSTART, P_VEND)
    cfg = getattr(transformers, config_class)(text_config=text, vision_config=dict(vision), image_token_id=ids[0],
                                              video_token_id=ids[1], vision_start_token_id=ids[2],
                                              vision_end_token_id=ids[3])
    for c in (cfg, cfg.text_config, cfg.vision_config):
        c._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("norm" in name or "ln_q" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
    return model.eval()


def hf_qwen_vl(seed: int = 0, processor_vocab: bool = False):
    """transformers' Qwen2_5_VLForConditionalGeneration with random weights (random_qwen_vl)."""
    return random_qwen_vl("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", TEXT, VISION, seed,
                          processor_vocab)


def image_tokens(grid) -> int:
    t, h, w = grid
    return int(t * h * w // 4)


def inputs(rng, *, s: int = 32):
    """Two rows of s tokens: row 0 holds both images of GRIDS (each between vision start/end tokens), row 1 is
    text only with 6 tokens of right padding. Returns (input_ids, attention_mask, pixel_values, image_grid_thw)."""
    ids = rng.integers(3, 240, size=(2, s))
    at = 2
    for grid in GRIDS:
        n = image_tokens(grid)
        ids[0, at], ids[0, at + 1:at + 1 + n], ids[0, at + 1 + n] = VSTART, IMAGE, VEND
        at += n + 4
    assert at <= s
    mask = np.ones_like(ids)
    mask[1, s - 6:] = 0
    ids[1, s - 6:] = 0
    pixels = rng.standard_normal((int(GRIDS.prod(-1).sum()), PATCH_DIM)).astype(np.float32)
    return ids, mask, pixels, GRIDS.copy()


def processor():
    """A Qwen2_5_VLProcessor without its video processor: the tiny-llama tokenizer with Qwen's vision tokens, the
    Qwen2-VL image processor with patch 4 / merge 2 (sides resized to multiples of 8, 64 to 4096 pixels)."""
    from pathlib import Path

    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyProcessor(Qwen2_5_VLProcessor):  # transformers' video processor imports torchvision
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id, self.video_token_id = tokenizer.image_token_id, tokenizer.video_token_id
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    asset = Path(__file__).resolve().parents[1] / "unsloth_jax" / "assets" / "tiny-llama" / "tokenizer.json"
    tok = PreTrainedTokenizerFast(tokenizer_file=str(asset), bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>", extra_special_tokens={
                                      "vision_start_token": "<|vision_start|>", "image_token": "<|image_pad|>",
                                      "vision_end_token": "<|vision_end|>", "video_token": "<|video_pad|>"})
    assert tok.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]) == [
        P_VSTART, P_IMAGE, P_VEND, P_VIDEO]
    images = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64,
                                      max_pixels=4096, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return ImageOnlyProcessor(image_processor=images, tokenizer=tok, chat_template=TEMPLATE)
