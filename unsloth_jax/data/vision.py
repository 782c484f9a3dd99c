"""Vision-language SFT data: chat records with images -> model batches (Unsloth's UnslothVisionDataCollator).

    collator = UnslothVisionDataCollator(model, processor)            # processor: transformers' Gemma3Processor
    batch = collator(records)                                         # dict of numpy arrays, below

A record holds `messages`, chat turns whose `content` is a string or a list of parts {"type": "text", "text": ...}
and {"type": "image"} (the image itself in the part's "image" key, or, in order, in the record's `images` list:
PIL images or uint8 / float arrays [H, W, C]). The collator renders each record with the processor's chat template,
then lets the processor expand every image placeholder into its image-token block (Gemma 3: "\\n\\n<start_of_image>"
+ mm_tokens_per_image x "<image_soft_token>" + "<end_of_image>\\n\\n") and resize / normalise the images, so the
ids and pixels are the processor's own. The batch:

    input_ids, attention_mask, token_type_ids (1 = image soft token), labels: int32 [B, S], right-padded
    pixel_values: float32 [N, C, H, W], the N images of the batch in row order

Qwen2.5-VL (transformers' Qwen2_5_VLProcessor: each image becomes "<|vision_start|>" + t*h*w/merge^2 x
"<|image_pad|>" + "<|vision_end|>") instead gives no token_type_ids, and:

    pixel_values: float32 [N, C*T*p*p], the patches of all images of the batch in row order
    image_grid_thw: int32 [I, 3], each image's (t, h, w) patch grid
    mrope_positions: int32 [3, B, S], the M-RoPE positions (transformers' get_rope_index; padding 0)

with labels -100 on the vision start / end and image (video) pad tokens. VisionLoader pads the patches to a
bucket and adds the tower's window layout (vision_* fields), so a jitted step never sees the grids.

labels are input_ids with -100 on padding and on the image tokens (soft tokens and the begin / end-of-image
markers, as Unsloth masks them), and with train_on_responses_only on everything outside the assistant turns
(between response_part and the next instruction_part, the text trainers' rule, unsloth_jax.data.response_only).
Bad records (no messages, no images where the content asks for them, a placeholder count different from the
images given) raise DatasetFormatError naming the record index and field.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from unsloth_jax.config import QwenVLConfig
from unsloth_jax.data.response_only import IGNORE_INDEX, apply_response_only
from unsloth_jax.errors import DatasetFormatError


def _bad(index: int, field: str, reason: str) -> DatasetFormatError:
    return DatasetFormatError(f"vision dataset record {index}, field '{field}': {reason}")


def image_parts(messages: Any, index: int) -> list[dict]:
    """The {"type": "image"} parts of a record's messages, in order (DatasetFormatError on a malformed turn)."""
    if not isinstance(messages, list) or not messages:
        raise _bad(index, "messages", f"expected a non-empty list of chat turns, got {type(messages).__name__}")
    parts = []
    for t, turn in enumerate(messages):
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise _bad(index, "messages", f"turn {t} is not a {{'role', 'content'}} dict")
        content = turn["content"]
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise _bad(index, "messages", f"turn {t}'s content is {type(content).__name__}, expected a string or "
                                          "a list of {'type': 'text' | 'image'} parts")
        for p, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "image"):
                raise _bad(index, "messages", f"turn {t} part {p} has type {kind!r}; expected 'text' or 'image'")
            if kind == "image":
                parts.append(part)
    return parts


def _is_pil(image: Any) -> bool:
    return hasattr(image, "convert") and hasattr(image, "size")  # PIL.Image.Image


def _checked_array(image: Any, index: int, field: str) -> np.ndarray | None:
    """None for a PIL image; an array image [H, W, C] as an ndarray; DatasetFormatError for anything else."""
    if _is_pil(image):
        return None
    if image is None or isinstance(image, (str, bytes, dict)):
        raise _bad(index, field, f"an image must be a PIL image or an array [H, W, C], got {type(image).__name__}")
    arr = np.asarray(image)
    if arr.ndim != 3 or arr.shape[-1] not in (1, 3, 4):
        raise _bad(index, field, f"image array of shape {list(arr.shape)}; expected [H, W, C] with C = 1, 3 or 4")
    if np.issubdtype(arr.dtype, np.floating) and not np.all(np.isfinite(arr)):
        raise _bad(index, field, "image array holds NaN or infinite values")
    return arr


def _as_image(image: Any, index: int, field: str):
    """A PIL image as RGB; an array [H, W, C] (uint8, or float in [0, 1]) as a uint8 array the processor reads."""
    arr = _checked_array(image, index, field)
    if arr is None:
        return image.convert("RGB")
    if np.issubdtype(arr.dtype, np.floating):
        arr = np.clip(np.rint(arr * 255.0), 0, 255)
    arr = arr.astype(np.uint8)
    if arr.shape[-1] == 1:
        arr = np.repeat(arr, 3, axis=-1)
    return arr[..., :3]


def record_images(record: Any, index: int, convert: bool = True) -> list:
    """The images of one record, in placeholder order: its `images` list, else the images inside the image
    parts. DatasetFormatError (naming `index` and the field) when they are missing or their count differs from
    the {"type": "image"} parts. convert=False: only checked, returned as given (no RGB / uint8 copies)."""
    if not isinstance(record, dict):
        raise _bad(index, "messages", f"a record must be a dict, got {type(record).__name__}")
    if "messages" not in record:
        raise _bad(index, "messages", f"missing (the record has {sorted(record)})")
    parts = image_parts(record["messages"], index)
    if "images" in record and record["images"] is not None:
        images = record["images"]
        images = [images] if not isinstance(images, (list, tuple)) else list(images)
        field = "images"
    else:
        embedded = [p.get("image") for p in parts]
        if parts and any(im is None for im in embedded):
            raise _bad(index, "images", f"missing: the messages hold {len(parts)} image placeholder(s) but the "
                                        "record has no 'images' list and the parts carry no 'image'")
        images, field = embedded, "messages"
    if len(images) != len(parts):
        raise _bad(index, field, f"{len(parts)} image placeholder(s) in the messages but {len(images)} image(s)")
    if not convert:
        for im in images:
            _checked_array(im, index, field)
        return images
    return [_as_image(im, index, field) for im in images]


def _without_embedded_images(messages: list) -> list:
    """The messages with each image part reduced to {"type": "image"} (chat templates only need the marker)."""
    out = []
    for turn in messages:
        content = turn["content"]
        if isinstance(content, list):
            content = [{"type": "image"} if p.get("type") == "image" else p for p in content]
        out.append({**turn, "content": content})
    return out


def processor_image(image: Any, where: str):
    """An image as the processor reads it (a PIL image as RGB; an array [H, W, C], uint8 or float in [0, 1], as
    uint8 RGB); DatasetFormatError naming `where` for anything else."""
    try:
        return _as_image(image, 0, "images")
    except DatasetFormatError as e:
        raise DatasetFormatError(f"{where}: {str(e).split(': ', 1)[1]}") from None


def multimodal_messages(messages: Any, images: Sequence | None, where: str) -> list[dict]:
    """TRL's prepare_multimodal_messages: chat turns with every content a list of parts and the images put into
    the image parts ({"type": "image", "image": img}), in order. Turns whose content is a string become one text
    part; the first user turn with string content gets one {"type": "image"} placeholder per image before its
    text (so a dataset may give plain-text prompts and an image column). Image parts that already carry an
    "image" keep it; the placeholders without one must be exactly as many as `images`. DatasetFormatError naming
    `where` otherwise."""
    images = list(images or [])
    if not isinstance(messages, list) or not messages:
        raise DatasetFormatError(f"{where}: the prompt must be a non-empty list of chat messages to hold images, got "
                                 f"{type(messages).__name__}")
    out, placed = [], False
    for t, turn in enumerate(messages):
        if not isinstance(turn, dict) or "role" not in turn:
            raise DatasetFormatError(f"{where}: message {t} is not a {{'role', 'content'}} dict")
        role, content = turn["role"], turn.get("content")
        if role not in ("system", "user", "assistant", "tool"):
            raise DatasetFormatError(f"{where}: message {t} has role {role!r}; expected 'system', 'user', "
                                     "'assistant' or 'tool'")
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
            if role == "user" and not placed:
                parts = [{"type": "image"} for _ in images] + parts
                placed = True
            turn = {**turn, "content": parts}
        elif content is not None and not isinstance(content, list):
            raise DatasetFormatError(f"{where}: message {t}'s content is {type(content).__name__}; expected a "
                                     "string or a list of {'type': 'text' | 'image'} parts")
        out.append(turn)
    empty = sum(1 for turn in out if turn.get("content") and turn["role"] != "tool"
                for part in turn["content"] if isinstance(part, dict) and part.get("type") == "image"
                and "image" not in part)
    if empty != len(images):
        raise DatasetFormatError(f"{where}: {empty} image placeholder(s) ({{'type': 'image'}}) in the prompt but "
                                 f"{len(images)} image(s) in the row's 'image' / 'images' column")
    queue = iter(images)
    for i, turn in enumerate(out):
        if turn.get("content") and turn["role"] != "tool":
            out[i] = {**turn, "content": [{**part, "image": next(queue)} if isinstance(part, dict) and
                                          part.get("type") == "image" and "image" not in part else part
                                          for part in turn["content"]]}
    return out


def message_images(messages: list[dict]) -> list:
    """The images inside the image parts of chat messages (multimodal_messages' output), in order."""
    return [part["image"] for turn in messages if isinstance(turn.get("content"), list)
            for part in turn["content"] if isinstance(part, dict) and part.get("type") == "image"]


def text_only_messages(messages: list) -> list:
    """The messages with each image part reduced to {"type": "image"} (chat templates only need the marker)."""
    return _without_embedded_images(messages)


class UnslothVisionDataCollator:
    """Records of chat `messages` with images -> a training batch (module docstring), with transformers'
    processor doing the chat template, the image-token expansion and the pixel preprocessing.

    model: the VisionModel (its vl_config gives the image token ids); processor: the model's transformers
    processor (FastVisionModel.from_pretrained returns it). max_seq_length: longer rows are cut at the end
    (None: no limit), but never inside an image block (DatasetFormatError). train_on_responses_only with
    instruction_part / response_part (e.g. "<start_of_turn>user\\n" / "<start_of_turn>model\\n" for Gemma 3):
    the loss on the assistant turns only."""

    def __init__(self, model, processor, *, max_seq_length: int | None = None, ignore_index: int = IGNORE_INDEX,
                 train_on_responses_only: bool = False, instruction_part: str | None = None,
                 response_part: str | None = None, formatting_func=None):
        if processor is None or not hasattr(processor, "apply_chat_template"):
            raise TypeError("UnslothVisionDataCollator needs the model's transformers processor (FastVisionModel."
                            f"from_pretrained returns it), got {type(processor).__name__}")
        if train_on_responses_only and not response_part:
            raise ValueError("train_on_responses_only=True needs response_part (e.g. '<start_of_turn>model\\n')")
        cfg = model.vl_config
        is_qwen = isinstance(cfg, QwenVLConfig)  # Qwen2.5-VL and its kin: Qwen3-VL, Qwen3.5
        if cfg.model_type != "gemma3" and not is_qwen:
            raise NotImplementedError(f"UnslothVisionDataCollator: training {cfg.model_type} is not supported "
                                      "(Gemma 3, Qwen2.5-VL, Qwen3-VL and Qwen3.5 are)")
        self.vl_config, self.is_qwen = cfg, is_qwen
        self.processor, self.tokenizer = processor, getattr(processor, "tokenizer", processor)
        self.max_seq_length = max_seq_length
        self.ignore_index = int(ignore_index)
        self.train_on_responses_only = bool(train_on_responses_only)
        self.instruction_part, self.response_part = instruction_part, response_part
        self.formatting_func = formatting_func
        if self.is_qwen:  # <|image_pad|> (and <|video_pad|>) between <|vision_start|> and <|vision_end|>
            self.image_token_index = int(cfg.image_token_id)
            self.masked_ids = np.array([cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id,
                                        cfg.vision_end_token_id])
        else:
            self.image_token_index = int(cfg.image_token_index)
            self.masked_ids = np.array([cfg.image_token_index, cfg.boi_token_index, cfg.eoi_token_index])
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad if pad is not None else getattr(self.tokenizer, "eos_token_id", 0) or 0)

    def check(self, records: Sequence[dict], first_index: int = 0) -> None:
        """Validate records without preprocessing their images (DatasetFormatError naming the first bad one)."""
        for i, record in enumerate(records):
            self._prepared(record, first_index + i, convert_images=False)

    def _prepared(self, record: Any, index: int, convert_images: bool = True) -> tuple[str, list]:
        if self.formatting_func is not None:
            record = self.formatting_func(record)
        images = record_images(record, index, convert=convert_images)
        messages = _without_embedded_images(record["messages"])
        text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        return text, images

    def __call__(self, records: Sequence[dict], indices: Sequence[int] | None = None) -> dict:
        """records (B dicts; `indices` their dataset indices, for errors) -> the batch of the module docstring."""
        indices = list(range(len(records))) if indices is None else list(indices)
        texts, images = [], []
        for record, index in zip(records, indices):
            text, ims = self._prepared(record, index)
            texts.append(text)
            images.append(ims)
        kw = {"images": images} if any(images) else {}
        if kw and not all(images):
            raise _bad(indices[[bool(x) for x in images].index(False)], "images",
                       "a batch mixing rows with and without images is not supported; give every row an image")
        # the chat template already wrote the special tokens (bos), so the processor must not add them again
        out = self.processor(text=texts, padding=True, return_tensors="np", add_special_tokens=False, **kw)
        ids = np.asarray(out["input_ids"], np.int32)
        mask = np.asarray(out["attention_mask"], np.int32)
        labels = self._labels(ids, mask)
        if self.is_qwen:
            return self._qwen_batch(out, ids, mask, labels, indices)
        types = (np.asarray(out["token_type_ids"], np.int32) if "token_type_ids" in out
                 else (ids == self.image_token_index).astype(np.int32))
        batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types, "labels": labels}
        batch = self._truncate(batch, indices, types == 1)
        if kw:
            batch["pixel_values"] = np.asarray(out["pixel_values"], np.float32)
        return batch

    def _qwen_batch(self, out, ids: np.ndarray, mask: np.ndarray, labels: np.ndarray, indices: list[int]) -> dict:
        """Qwen2.5-VL: the [B, S] fields, pixel_values [N, C*T*p*p] float32 (the patches of all images, row
        order), image_grid_thw [I, 3] int32 and the M-RoPE positions [3, B, S] int32 (get_rope_index's)."""
        from unsloth_jax.models.vision_qwen2_5 import mrope_positions

        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        batch = self._truncate(batch, indices, np.isin(ids, self.masked_ids))
        grid = np.asarray(out["image_grid_thw"], np.int32) if "image_grid_thw" in out else None
        batch["mrope_positions"] = mrope_positions(self.vl_config, batch["input_ids"], batch["attention_mask"], grid)
        if grid is not None:
            batch["pixel_values"] = np.asarray(out["pixel_values"], np.float32)
            batch["image_grid_thw"] = grid
        return batch

    def _labels(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        labels = np.where((mask == 0) | np.isin(ids, self.masked_ids), self.ignore_index, ids).astype(np.int32)
        if self.train_on_responses_only:
            rows = [{"input_ids": ids[b][mask[b] == 1], "labels": labels[b][mask[b] == 1]} for b in range(len(ids))]
            apply_response_only(rows, self.tokenizer, self.instruction_part, self.response_part)
            for b, row in enumerate(rows):
                labels[b, mask[b] == 1] = np.asarray(row["labels"], np.int32)
        return labels

    def _truncate(self, batch: dict, indices: list[int], in_image: np.ndarray) -> dict:
        """The [B, S] fields cut to max_seq_length; in_image [B, S] bool marks what must not be cut."""
        limit = self.max_seq_length
        if limit is None or batch["input_ids"].shape[1] <= limit:
            return batch
        cut = in_image[:, limit:]
        if np.any(cut):
            row = int(np.nonzero(cut.any(axis=1))[0][0])
            raise _bad(indices[row], "messages", f"the row is {int(batch['attention_mask'][row].sum())} tokens "
                                                 f"with its image tokens, more than max_seq_length={limit}, and "
                                                 "cutting it would split an image; raise max_seq_length")
        return {k: v[:, :limit] for k, v in batch.items()}


VisionDataCollator = UnslothVisionDataCollator

__all__ = ["UnslothVisionDataCollator", "VisionDataCollator", "image_parts", "message_images", "multimodal_messages",
           "processor_image", "record_images", "text_only_messages"]
