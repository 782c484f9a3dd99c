"""Deterministic batches of vision-language records for the trainers (the vision counterpart of DataLoader).

    loader = VisionLoader(records, collator, batch_size=2, max_seq_length=512, seed=3407)
    batch = loader.batch(epoch, index)          # the collator's dict, padded to a bucket length (below)

`batch(epoch, index)` is a pure function of (epoch, index) and the constructor arguments, so a resumed run sees
the same batches. Records are shuffled per epoch as DataLoader shuffles examples (SeedSequence([seed, epoch])),
collated by an UnslothVisionDataCollator when their batch is asked for (images are preprocessed lazily, never
all at once), and padded to the smallest of DataLoader's bucket lengths (powers of two from 64, then
max_seq_length) that holds the batch, so a jitted step compiles for few shapes. Qwen2.5-VL's patches are
padded likewise (patch_bucket: 64, 128, then four buckets per octave) and the tower's window layout is added (pad_patches).
The last batch is filled with empty rows (all padding, labels -100, no image) unless drop_last.

    records = load_vision_records("shapes_sample.jsonl")   # `images` given as file paths -> PIL images

reads a .jsonl (or a folder of them) whose records' `images` are image file paths, relative to the file they are
in (or absolute), and decodes every image once, up front, so a bad one stops the run before training, with its
file and line named.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np

from unsloth_jax.data.loading import load_records
from unsloth_jax.data.packing import bucket_lengths, pick_bucket
from unsloth_jax.data.records import Records, where
from unsloth_jax.data.response_only import IGNORE_INDEX
from unsloth_jax.data.vision import image_parts
from unsloth_jax.errors import DatasetFormatError

# what padding holds in each [B, S] field; pixel_values are padded along the image axis with zero images
_FILL = {"labels": IGNORE_INDEX}


def pad_rows(batch: dict, length: int, rows: int, pad_token_id: int) -> dict:
    """The [B, S] fields padded to [rows, length] (input_ids with pad_token_id, labels -100, others 0), and
    mrope_positions [3, B, S] with 0; the image fields (pixel_values, image_grid_thw, vision_*) kept as they are."""
    out = {}
    for key, value in batch.items():
        if key in ("pixel_values", "image_grid_thw") or key.startswith("vision_"):
            out[key] = value
            continue
        b, s = value.shape[-2:]
        fill = pad_token_id if key == "input_ids" else _FILL.get(key, 0)
        lead = ((0, 0),) * (value.ndim - 2)
        out[key] = np.pad(value, (*lead, (0, rows - b), (0, length - s)), constant_values=fill)
    return out


def patch_bucket(count: int, unit: int) -> int:
    """The padded patch count of a Qwen2.5-VL batch with `count` patches, so steps compile once per bucket, not per
    set of grids: the smallest bucket that holds it, a multiple of the merge unit `unit`. Buckets: 64, 128, then
    four per octave (256, 320, 384, 448, 512, 640, ...), so padding stays under a quarter of the real patches
    above 256 (a 448-pixel image is 1,024 patches; powers of two alone padded 1,025 to 2,048)."""
    size = 64
    while size < count:
        octave = 1 << (size.bit_length() - 1)  # the power of two at or below size
        size += octave // 4 if octave >= 256 else octave
    return max(size, -(-count // unit) * unit)


def pad_patches(batch: dict, vision_config, patches: int) -> dict:
    """A Qwen2.5-VL / Qwen3-VL batch (the collator's, image_grid_thw possibly absent: no image) with pixel_values
    zero-padded to [patches, C*T*p*p] and the tower's layout for them (padded_vision_layout of
    models.vision_qwen2_5, or of models.vision_qwen3 for a Qwen3VisionConfig) as vision_<name> fields (Qwen2.5-VL:
    vision_order, vision_positions, vision_frame_ids, vision_window_ids, vision_restore); image_grid_thw kept
    (host only)."""
    from unsloth_jax.config import Qwen3VisionConfig
    from unsloth_jax.models import vision_qwen2_5, vision_qwen3

    tower = vision_qwen3 if isinstance(vision_config, Qwen3VisionConfig) else vision_qwen2_5
    padded_vision_layout = tower.padded_vision_layout
    grid = batch.get("image_grid_thw")
    pixels = batch.get("pixel_values")
    pixels = np.zeros((0, vision_config.patch_dim), np.float32) if pixels is None else pixels
    out = dict(batch)
    out["pixel_values"] = np.pad(pixels, ((0, patches - pixels.shape[0]), (0, 0)))
    for key, value in padded_vision_layout(vision_config, grid, patches).items():
        out["vision_" + key] = value
    return out


def pad_images(pixel_values: np.ndarray | None, count: int, image_shape: tuple[int, ...]) -> np.ndarray:
    """pixel_values [N, C, H, W] (or None: no image) followed by zero images up to [count, C, H, W] float32.
    The model reads image n at the n-th image-token block, so trailing images no token reads change nothing."""
    pixel_values = np.zeros((0, *image_shape), np.float32) if pixel_values is None else pixel_values
    extra = count - pixel_values.shape[0]
    return np.concatenate([pixel_values, np.zeros((extra, *pixel_values.shape[1:]), np.float32)]) if extra else \
        pixel_values


def _image_slots(count: int, rows: int) -> int:
    """count images rounded up to a multiple of rows (at least rows): one image per row keeps one shape."""
    return max(rows, -(-count // rows) * rows)


def stack_micro_batches(micro: list[dict], pad_token_id: int, image_shape: tuple[int, ...],
                        vision_config=None) -> dict:
    """Micro-batches (each [B, S_j] fields, pixel_values [N_j, C, H, W]) -> one [A, B, S] batch with
    pixel_values [A, N, C, H, W]: S the longest S_j, N the largest N_j rounded up to a multiple of B (so steps
    with one image per row keep one shape). With vision_config (Qwen2.5-VL): every micro-batch's patches padded
    to the largest patch count P_j (pad_patches), giving pixel_values [A, P, C*T*p*p] and vision_* [A, P, ...];
    mrope_positions [A, 3, B, S]; image_grid_thw dropped."""
    rows = micro[0]["input_ids"].shape[0]
    length = max(m["input_ids"].shape[1] for m in micro)
    if vision_config is not None:
        patches = max(m["pixel_values"].shape[0] for m in micro)
        padded = [pad_patches(pad_rows(m, length, rows, pad_token_id), vision_config, patches) for m in micro]
        return {k: np.stack([m[k] for m in padded]) for k in padded[0] if k != "image_grid_thw"}
    n = _image_slots(max(0 if m.get("pixel_values") is None else m["pixel_values"].shape[0] for m in micro), rows)
    padded = [pad_rows(m, length, rows, pad_token_id) for m in micro]
    out = {k: np.stack([m[k] for m in padded]) for k in padded[0] if k != "pixel_values"}
    out["pixel_values"] = np.stack([pad_images(m.get("pixel_values"), n, image_shape) for m in micro])
    return out


class VisionLoader:
    """Batches of vision records through `collator` (an UnslothVisionDataCollator); see the module docstring."""

    def __init__(self, records: Sequence[dict], collator, batch_size: int, max_seq_length: int, *,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, image_shape: tuple[int, ...]):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.records, self.collator = list(records), collator
        self.batch_size, self.max_seq_length = int(batch_size), int(max_seq_length)
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.image_shape = tuple(image_shape)
        cfg = getattr(collator, "vl_config", None)
        self.vision_config = cfg.vision if getattr(collator, "is_qwen", False) else None  # Qwen2.5-VL's patches
        self.bucket_lengths = bucket_lengths(self.max_seq_length)
        self.num_rows = self.num_examples = len(self.records)
        self.pad_token_id = collator.pad_token_id

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_rows // self.batch_size
        return -(-self.num_rows // self.batch_size)

    @property
    def longest_bucket(self) -> int:
        """The largest padded length a batch may have (row lengths are known only once collated)."""
        return self.bucket_lengths[-1]

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_rows)
        return np.random.default_rng(np.random.SeedSequence([self.seed, int(epoch)])).permutation(self.num_rows)

    def batch(self, epoch: int, index: int, rows: slice | None = None) -> dict:
        """Batch `index` of `epoch`: [batch_size, S] int32 fields and pixel_values [N, C, H, W] float32 (only
        `rows` of it when given: one host's share)."""
        picked = self.order(epoch)[index * self.batch_size:(index + 1) * self.batch_size]
        out = self.collator([self.records[i] for i in picked], indices=[int(i) for i in picked])
        length = pick_bucket(out["input_ids"].shape[1], self.bucket_lengths)
        out = pad_rows(out, length, self.batch_size, self.pad_token_id)
        if rows is not None:
            raise NotImplementedError("vision batches are not split over hosts yet")
        if self.vision_config is not None:  # Qwen2.5-VL: patches padded to a bucket, with the tower's layout
            count = 0 if out.get("pixel_values") is None else out["pixel_values"].shape[0]
            return pad_patches(out, self.vision_config, patch_bucket(count, self.vision_config.merge_unit))
        n = 0 if out.get("pixel_values") is None else out["pixel_values"].shape[0]
        out["pixel_values"] = pad_images(out.get("pixel_values"), _image_slots(n, self.batch_size),
                                         self.image_shape)
        return out

    def stack(self, micro: list[dict]) -> dict:
        """The micro-batches of one optimizer step as one [A, B, S] batch (stack_micro_batches)."""
        return stack_micro_batches(micro, self.pad_token_id, self.image_shape, self.vision_config)


def _open_image(path: Path, location: str):
    """The image file at `path` decoded as an RGB PIL image; DatasetFormatError naming `location` if it is
    missing or does not decode."""
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise DatasetFormatError(f"{location}: image file {path} not found")
    try:
        with Image.open(path) as image:
            return image.convert("RGB")  # convert() decodes the whole image
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise DatasetFormatError(f"{location}: image file {path} cannot be decoded ({e})") from None


def load_vision_records(path: str | os.PathLike) -> Records:
    """The records of a .jsonl file (or a folder of them, as load_records reads) with each `images` entry, a file
    path relative to its .jsonl (or absolute), replaced by the decoded RGB PIL image. DatasetFormatError naming
    the file and line for: a malformed line, a record without `messages` or with a malformed turn, `images` that
    is not a list of path strings, a count of images different from the {"type": "image"} parts, an image file
    that is missing or does not decode."""
    records = load_records(path)
    out = []
    for index, record in enumerate(records):
        location = where(records, index)
        if "messages" not in record:
            raise DatasetFormatError(f"{location}: no 'messages' (the record has {sorted(record)}); a vision dataset "
                                     "holds chat records with 'messages' and 'images' (docs/VISION.md)")
        try:
            parts = image_parts(record["messages"], index)
        except DatasetFormatError as e:
            raise DatasetFormatError(f"{location}, field 'messages': {str(e).split(': ', 1)[1]}") from None
        paths = record.get("images", [])
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise DatasetFormatError(f"{location}: 'images' must be a list of image file paths (strings), got "
                                     f"{paths!r:.80}")
        if len(paths) != len(parts):
            raise DatasetFormatError(f"{location}: {len(parts)} image placeholder(s) ({{'type': 'image'}}) in the "
                                     f"messages but {len(paths)} image(s) in 'images'")
        base = Path(records.locations[index][0]).parent if records.locations[index] else Path(path).parent
        out.append({**record, "images": [_open_image(base / p, location) for p in paths]})
    return Records(out, source=records.source, locations=records.locations, skipped=records.skipped)


__all__ = ["VisionLoader", "load_vision_records", "pad_images", "pad_patches", "pad_rows", "patch_bucket",
           "stack_micro_batches"]
