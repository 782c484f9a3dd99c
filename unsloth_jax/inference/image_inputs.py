"""Prompts with images on the generation engine, for every vision-language family (unsloth_jax.families: Gemma 3,
Qwen2.5-VL); what differs by family is the family's (request_fields, prefill_fields, row_images,
processor_images).

    images = ImageInputs(pixel_values, token_type_ids=types)            # Gemma 3: [N, C, H, W], types [S] or None
    images = ImageInputs(pixel_values, image_grid_thw=grid)             # Qwen2.5-VL: [patches, C*T*p*p], [N, 3]
    engine.generate([{"prompt_token_ids": ids, "images": images}, ...], SamplingParams(...))

A request carries its prompt's token ids with the image tokens already expanded (what the model's processor
gives for that prompt alone) and its images' arrays. `batch_image_prompts` splits a processor batch (left padded)
into such requests, one per row. The engine checks and prepares each request once (`image_request`: the M-RoPE
positions [3, S] of a Qwen2.5-VL prompt and its rope_deltas, `position_offset`), then prefills the image prompts
of one admission together (`image_batch`: their images concatenated and padded to a bucket, so the compiled
vision tower and embedding sees few shapes; block ids of Gemma 3's image blocks, M-RoPE positions).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from unsloth_jax.data.vision import message_images, processor_image, text_only_messages
from unsloth_jax.families import VisionFamily, family_of
from unsloth_jax.families.base import ImageInputs, as_numpy


class ImageRequest(NamedTuple):
    """One image prompt, checked and prepared by `image_request`: pixel_values float32, image_grid_thw [N, 3] int64
    (Qwen2.5-VL) or None, token_type_ids [S] int32 (Gemma 3) or None, rope_positions [3, S] int32 (Qwen2.5-VL's
    M-RoPE positions) or None, and position_offset: a decode step's position minus its cache slot (transformers'
    rope_deltas: the largest M-RoPE position + 1 - S; 0 for Gemma 3)."""

    pixel_values: np.ndarray
    image_grid_thw: np.ndarray | None
    token_type_ids: np.ndarray | None
    rope_positions: np.ndarray | None
    position_offset: int


def image_request(model, ids: list[int], images: ImageInputs, where: str) -> ImageRequest:
    """Check `images` (ImageInputs) against the prompt ids (token ids, image tokens expanded) of `model` (a
    vision-language model) and prepare them (the family's request_fields). ValueError / TypeError name `where`
    (e.g. "prompts[3]") and the field."""
    if not isinstance(images, ImageInputs):
        raise TypeError(f"{where}['images'] must be an ImageInputs, got {type(images).__name__}")
    family = family_of(model)
    if not isinstance(family, VisionFamily):
        raise ValueError(f"{where} has images, but the model ({type(model).__name__}) has no vision tower")
    if images.pixel_values is None:
        raise ValueError(f"{where}['images'].pixel_values is None; give a prompt without images as token ids alone")
    pixels = as_numpy(images.pixel_values).astype(np.float32)
    return ImageRequest(*family.request_fields(model, np.asarray(ids), pixels, images, where))


class ImageBatch(NamedTuple):
    """The image side of one prefill of prompts [P, S] (right padded), built by `image_batch`: pixel_values (the
    prompts' images in order, padded to a bucket) and embed_with_images' other arguments image_kwargs
    (Qwen2.5-VL: the tower's padded window layout), block_ids [P, S] int32 (Gemma 3's image blocks) or None
    (causal), rope_positions [3, P, S] int32 (Qwen2.5-VL) or None."""

    pixel_values: jax.Array
    image_kwargs: dict
    block_ids: jax.Array | None
    rope_positions: jax.Array | None


def image_batch(model, requests: list[ImageRequest], rows: int, width: int) -> ImageBatch:
    """The ImageBatch of the prompts `requests` (ImageRequests, in prefill row order) prefilled as [rows, width]:
    the images padded to a bucket by the family (Gemma 3: zero images to a power-of-two count; Qwen2.5-VL: patches
    to vision_loader.patch_bucket, with the tower's padded layout), so the padding's features come after the real
    ones, where no image token reads them, and the embedding compiles once per bucket."""
    pixels = np.concatenate([r.pixel_values for r in requests])
    return ImageBatch(*family_of(model).prefill_fields(model, requests, pixels, rows, width))


def batch_image_prompts(vl_config, ids: np.ndarray, mask: np.ndarray, pixel_values: np.ndarray | None,
                        image_grid_thw: np.ndarray | None = None, token_type_ids: np.ndarray | None = None
                        ) -> list:
    """A processor batch (ids [B, P] LEFT padded, mask [B, P]; the images of pixel_values fill the rows' image
    tokens in row-major order, as transformers reads them) as one engine prompt per row: {"prompt_token_ids": the
    row's real tokens, "images": ImageInputs of its images}, or the token ids alone for a row without images.
    Gemma 3: each block of mm_tokens_per_image image tokens takes the next image of pixel_values [N, C, H, W]
    (token_type_ids [B, P] or None). Qwen2.5-VL: each run of image tokens takes the next grid of
    image_grid_thw [N, 3] and its t*h*w patches of pixel_values."""
    family = family_of(vl_config)
    image_id = family.image_token_ids(vl_config)[0]
    prompts, cursor = [], (0, 0)
    for b in range(ids.shape[0]):
        keep = mask[b] > 0
        row = ids[b][keep]
        is_image = row == image_id
        if pixel_values is None or not is_image.any():
            prompts.append(row.tolist())
            continue
        types = None if token_type_ids is None else token_type_ids[b][keep]
        images, cursor = family.row_images(vl_config, is_image, pixel_values, image_grid_thw, types, cursor)
        prompts.append({"prompt_token_ids": row.tolist(), "images": images})
    return prompts


def chat_request(vl_config, processor, messages: list[dict], where: str):
    """One chat prompt (messages whose image parts carry their images, as data.vision.multimodal_messages gives
    them) as an engine request: the processor's chat template with the generation prompt, then the processor on
    that text and the images (image tokens expanded, pixels resized and normalised, as transformers feeds the
    model) -> {"prompt_token_ids": ids, "images": ImageInputs(...)}; the token ids alone when it has no image.
    Gemma 3's ImageInputs carry the processor's token_type_ids (1 on image tokens: each image's block attends both
    ways); Qwen2.5-VL's its image_grid_thw. `where` names the prompt in errors."""
    if processor is None or not hasattr(processor, "image_processor"):
        raise TypeError(f"{where}: a chat prompt with images needs the model's transformers processor "
                        f"(FastVisionModel.from_pretrained returns it), got {type(processor).__name__}")
    images = [processor_image(im, where) for im in message_images(messages)]
    text = processor.apply_chat_template(text_only_messages(messages), tokenize=False, add_generation_prompt=True)
    tokenizer = getattr(processor, "tokenizer", processor)
    if not images:  # the chat template writes the special tokens (bos) itself
        return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
    out = processor(text=[text], images=[images], return_tensors="np", add_special_tokens=False)
    ids = np.asarray(out["input_ids"][0]).astype(np.int64)
    pixels = np.asarray(out["pixel_values"], np.float32)
    inputs = family_of(vl_config).processor_images(vl_config, ids, pixels, out)
    return {"prompt_token_ids": ids.tolist(), "images": inputs}


__all__ = ["ImageInputs", "ImageRequest", "ImageBatch", "image_request", "image_batch", "batch_image_prompts",
           "chat_request"]
