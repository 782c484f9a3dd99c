"""Prompts with images on the generation engine: Gemma 3 (models.vision.Gemma3ForConditionalGeneration) and
Qwen2.5-VL (models.vision_qwen2_5.Qwen2_5_VLForConditionalGeneration).

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

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from unsloth_jax.config import QwenVLConfig
from unsloth_jax.data.vision import message_images, processor_image, text_only_messages
from unsloth_jax.data.vision_loader import pad_images, pad_patches, patch_bucket
from unsloth_jax.models.vision import image_block_ids


@dataclasses.dataclass(frozen=True)
class ImageInputs:
    """The images of one prompt, as the model's processor gives them for that prompt alone.

    pixel_values    Gemma 3: [N, C, H, W] (one image per block of mm_tokens_per_image image tokens, in order);
                    Qwen2.5-VL: [patches, C*T*p*p] (the patches of the images of image_grid_thw, in order)
    image_grid_thw  Qwen2.5-VL: [N, 3] each image's (t, h, w) patch grid, one per run of image tokens; Gemma 3: None
    token_type_ids  Gemma 3: [S] 1 on image tokens (each image's tokens attend to each other both ways in the
                    prefill, as transformers with token_type_ids); None: causal everywhere. Qwen2.5-VL: None
    """

    pixel_values: np.ndarray
    image_grid_thw: np.ndarray | None = None
    token_type_ids: np.ndarray | None = None


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


def _pow2(n: int) -> int:
    """The next power of two >= max(n, 1)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def _numpy(x) -> np.ndarray:
    """x (numpy, torch tensor or nested lists) as a numpy array."""
    return np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x)


def image_request(model, ids: list[int], images: ImageInputs, where: str) -> ImageRequest:
    """Check `images` (ImageInputs) against the prompt ids (token ids, image tokens expanded) of `model` (a
    vision-language model) and prepare them. ValueError / TypeError name `where` (e.g. "prompts[3]") and the
    field."""
    if not isinstance(images, ImageInputs):
        raise TypeError(f"{where}['images'] must be an ImageInputs, got {type(images).__name__}")
    cfg = getattr(model, "vl_config", None)
    if cfg is None:
        raise ValueError(f"{where} has images, but the model ({type(model).__name__}) has no vision tower")
    if images.pixel_values is None:
        raise ValueError(f"{where}['images'].pixel_values is None; give a prompt without images as token ids alone")
    pixels = _numpy(images.pixel_values).astype(np.float32)
    ids = np.asarray(ids)
    if isinstance(cfg, QwenVLConfig):
        return _qwen_request(model, cfg, ids, pixels, images, where)
    return _gemma_request(cfg, ids, pixels, images, where)


def _gemma_request(cfg, ids: np.ndarray, pixels: np.ndarray, images: ImageInputs, where: str) -> ImageRequest:
    if images.image_grid_thw is not None:
        raise ValueError(f"{where}['images'].image_grid_thw is Qwen2.5-VL's; Gemma 3 takes pixel_values [N, C, H, W]")
    if pixels.ndim != 4 or pixels.shape[0] == 0:
        raise ValueError(f"{where}['images'].pixel_values must be [N, C, H, W] with N >= 1, got shape {pixels.shape}")
    n_tokens, need = int(np.sum(ids == cfg.image_token_index)), pixels.shape[0] * cfg.mm_tokens_per_image
    if n_tokens != need:
        raise ValueError(f"{where}: the prompt holds {n_tokens} image tokens, but its {pixels.shape[0]} images need "
                         f"{need} ({cfg.mm_tokens_per_image} each)")
    types = None
    if images.token_type_ids is not None:
        types = _numpy(images.token_type_ids).astype(np.int32)
        if types.shape != ids.shape:
            raise ValueError(f"{where}['images'].token_type_ids has shape {types.shape}; the prompt is {ids.shape}")
    return ImageRequest(pixels, None, types, None, 0)


def _qwen_request(model, cfg: QwenVLConfig, ids: np.ndarray, pixels: np.ndarray, images: ImageInputs,
                  where: str) -> ImageRequest:
    if images.token_type_ids is not None:
        raise ValueError(f"{where}['images'].token_type_ids are Gemma 3's; Qwen2.5-VL takes image_grid_thw")
    if images.image_grid_thw is None:
        raise ValueError(f"{where}['images'] needs image_grid_thw [images, 3] for Qwen2.5-VL")
    if np.any(ids == cfg.video_token_id):
        raise ValueError(f"{where}: the prompt holds video tokens; Qwen2.5-VL generation takes images only")
    grid = _numpy(images.image_grid_thw).astype(np.int64)
    if grid.ndim != 2 or grid.shape[1] != 3 or grid.shape[0] == 0:
        raise ValueError(f"{where}['images'].image_grid_thw must be [images, 3] with images >= 1, got shape "
                         f"{grid.shape}")
    vision = cfg.vision
    patches = int(grid.prod(-1).sum())
    if pixels.shape != (patches, vision.patch_dim):
        raise ValueError(f"{where}['images'].pixel_values has shape {pixels.shape}, but image_grid_thw "
                         f"{grid.tolist()} needs [{patches}, {vision.patch_dim}]")
    n_tokens, need = int(np.sum(ids == cfg.image_token_id)), int((grid.prod(-1) // vision.merge_unit).sum())
    if n_tokens != need:
        raise ValueError(f"{where}: the prompt holds {n_tokens} image tokens, but image_grid_thw's {len(grid)} "
                         f"images need {need}")
    try:
        positions = model.rope_positions(ids[None], None, grid)[:, 0]
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return ImageRequest(pixels, grid, None, positions, int(positions.max()) + 1 - ids.shape[0])


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
    """The ImageBatch of the prompts `requests` (ImageRequests, in prefill row order) prefilled as [rows, width].
    Gemma 3's images are padded with zero images to a power-of-two count, Qwen2.5-VL's patches to
    vision_loader.patch_bucket (with the tower's padded layout): the padding's features come after the real
    ones, where no image token reads them, and the embedding compiles once per bucket."""
    pixels = np.concatenate([r.pixel_values for r in requests])
    if isinstance(model.vl_config, QwenVLConfig):
        vision = model.vl_config.vision
        grid = np.concatenate([r.image_grid_thw for r in requests])
        padded = pad_patches(dict(pixel_values=pixels, image_grid_thw=grid), vision,
                             patch_bucket(pixels.shape[0], vision.merge_unit))
        layout = {k.removeprefix("vision_"): jnp.asarray(v) for k, v in padded.items() if k.startswith("vision_")}
        positions = np.zeros((3, rows, width), np.int32)
        for i, r in enumerate(requests):
            positions[:, i, :r.rope_positions.shape[1]] = r.rope_positions
        return ImageBatch(jnp.asarray(padded["pixel_values"]), {"layout": layout}, None, jnp.asarray(positions))
    block_ids = None
    if any(r.token_type_ids is not None for r in requests):
        types = np.zeros((rows, width), np.int32)
        for i, r in enumerate(requests):
            if r.token_type_ids is not None:
                types[i, :r.token_type_ids.shape[0]] = r.token_type_ids
        block_ids = image_block_ids(jnp.asarray(types))
    images = pad_images(pixels, _pow2(pixels.shape[0]), pixels.shape[1:])
    return ImageBatch(jnp.asarray(images), {}, block_ids, None)


def batch_image_prompts(vl_config, ids: np.ndarray, mask: np.ndarray, pixel_values: np.ndarray | None,
                        image_grid_thw: np.ndarray | None = None, token_type_ids: np.ndarray | None = None
                        ) -> list:
    """A processor batch (ids [B, P] LEFT padded, mask [B, P]; the images of pixel_values fill the rows' image
    tokens in row-major order, as transformers reads them) as one engine prompt per row: {"prompt_token_ids": the
    row's real tokens, "images": ImageInputs of its images}, or the token ids alone for a row without images.
    Gemma 3: each block of mm_tokens_per_image image tokens takes the next image of pixel_values [N, C, H, W]
    (token_type_ids [B, P] or None). Qwen2.5-VL: each run of image tokens takes the next grid of
    image_grid_thw [N, 3] and its t*h*w patches of pixel_values."""
    qwen = isinstance(vl_config, QwenVLConfig)
    image_id = vl_config.image_token_id if qwen else vl_config.image_token_index
    prompts, image, patch = [], 0, 0
    for b in range(ids.shape[0]):
        keep = mask[b] > 0
        row = ids[b][keep]
        is_image = row == image_id
        if pixel_values is None or not is_image.any():
            prompts.append(row.tolist())
            continue
        if qwen:
            runs = int(np.sum(is_image & ~np.concatenate([[False], is_image[:-1]])))
            grid = image_grid_thw[image:image + runs]
            size = int(grid.prod(-1).sum())
            images = ImageInputs(pixel_values[patch:patch + size], image_grid_thw=grid)
            image, patch = image + runs, patch + size
        else:
            count = int(is_image.sum()) // vl_config.mm_tokens_per_image
            types = None if token_type_ids is None else token_type_ids[b][keep]
            images = ImageInputs(pixel_values[image:image + count], token_type_ids=types)
            image += count
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
    if isinstance(vl_config, QwenVLConfig):
        inputs = ImageInputs(pixels, image_grid_thw=np.asarray(out["image_grid_thw"], np.int64))
    else:
        types = (np.asarray(out["token_type_ids"][0], np.int32) if "token_type_ids" in out
                 else (ids == vl_config.image_token_index).astype(np.int32))
        inputs = ImageInputs(pixels, token_type_ids=types)
    return {"prompt_token_ids": ids.tolist(), "images": inputs}


__all__ = ["ImageInputs", "ImageRequest", "ImageBatch", "image_request", "image_batch", "batch_image_prompts",
           "chat_request"]
