"""Prompts with images for the RL and preference trainers (GRPO, DPO), as TRL takes them.

A dataset row holds a conversational "prompt" and its images: an "images" column (a list, in placeholder order)
or an "image" column (one image), PIL images or arrays [H, W, C]; or the images inside the prompt's image parts
({"type": "image", "image": img}). `row_prompt` joins them as TRL's prepare_multimodal_messages does (a prompt
whose first user turn is a plain string gets one placeholder per image before its text);
inference.image_inputs.chat_request turns the result into an engine request {"prompt_token_ids": ids,
"images": ImageInputs(...)} through the model's processor, when a generation needs it (images are
preprocessed lazily, never all at once).

`image_micro_batches` gives the image fields of a batch of right-padded rows (prompt + completion) split into
micro-batches, in the layout of the vision SFT step (the family's prepare_inputs reads them):

    Gemma 3      pixel_values [A, N, C, H, W] (the rows' images in row order, zero images padding N to a multiple
                 of B), token_type_ids [A, B, S] (the processor's, 1 on the prompt's image tokens, 0 elsewhere)
    Qwen2.5-VL   pixel_values [A, P, C*T*p*p] (patches padded to vision_loader.patch_bucket of the largest
                 micro-batch), vision_* [A, P, ...] (the tower's padded window layout), mrope_positions
                 [A, 3, B, S] (get_rope_index's over prompt + completion: the completion continues at the prompt's
                 largest position + 1, as the engine decodes it)
"""
from __future__ import annotations

import numpy as np

from unsloth_jax.data.vision import multimodal_messages
from unsloth_jax.errors import DatasetFormatError
from unsloth_jax.families import family_of


def column_images(record: dict) -> list | None:
    """TRL's image columns of a row: "images" (a list; None: none), else "image" (one image; None: none); None
    when the row has neither column."""
    if "images" in record:
        images = record["images"]
        if images is None:
            return []
        return list(images) if isinstance(images, (list, tuple)) else [images]
    if "image" in record:
        return [] if record["image"] is None else [record["image"]]
    return None


def prompt_has_images(prompt) -> bool:
    """Whether a conversational prompt holds image parts."""
    return isinstance(prompt, list) and any(
        isinstance(turn, dict) and isinstance(turn.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") == "image" for p in turn["content"]) for turn in prompt)


def dataset_has_images(records: list) -> bool:
    """Whether any row gives images (an image column with an image, or image parts in its prompt)."""
    return any(isinstance(r, dict) and (bool(column_images(r)) or prompt_has_images(r.get("prompt")))
               for r in records)


def row_prompt(record: dict, where: str, key: str = "prompt") -> list:
    """The row's prompt messages with its images in their image parts (data.vision.multimodal_messages, TRL's
    prepare_multimodal_messages). DatasetFormatError naming `where` for a prompt that is not a list of messages,
    or a count of image placeholders unlike the images given (a placeholder without an image included)."""
    prompt = record.get(key)
    if not (isinstance(prompt, list) and prompt and isinstance(prompt[0], dict) and "role" in prompt[0]):
        raise DatasetFormatError(
            f"{where}: multimodal training needs a conversational '{key}' (a list of {{'role', 'content'}} "
            f"messages; the trainer applies the chat template), got {type(prompt).__name__}")
    images = column_images(record)
    return multimodal_messages(prompt, images or [], where)


def request_ids(request) -> list[int]:
    """The prompt token ids of an engine request (a dict with prompt_token_ids, or the ids themselves)."""
    return list(request["prompt_token_ids"]) if isinstance(request, dict) else list(request)


def request_images(request):
    """The ImageInputs of an engine request (None for token ids alone)."""
    return request.get("images") if isinstance(request, dict) else None


def image_micro_batches(model, ids: np.ndarray, mask: np.ndarray, images: list, micro_batches: int) -> dict:
    """The image fields (module docstring) of rows ids, mask [A * B, S] (right padded, rows in micro-batch order)
    whose prompts hold the images `images` (one ImageInputs or None per row; a row's images fill its image
    tokens, which all lie in its prompt): the model's family builds them (rl_image_fields)."""
    return family_of(model).rl_image_fields(model.vl_config, ids, mask, images, micro_batches)


__all__ = ["column_images", "dataset_has_images", "image_micro_batches", "prompt_has_images", "request_ids",
           "request_images", "row_prompt"]
