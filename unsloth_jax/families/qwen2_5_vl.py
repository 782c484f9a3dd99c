"""Qwen2.5-VL (config.json model_type "qwen2_5_vl"; transformers' Qwen2_5_VLForConditionalGeneration): the Qwen2
text decoder rotating by M-RoPE positions [3, B, S], plus the windowed vision tower and patch merger
(models.vision_qwen2_5). Images are pixel_values [P, C*T*p*p] with image_grid_thw [I, 3]; in a jitted step the
tower reads the host-built padded layout (vision_* batch fields) instead of the grid."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from unsloth_jax.config import QwenVLConfig
from unsloth_jax.models.layer_stack import NO_REMAT, LayerStackPolicy
from unsloth_jax.data.vision_loader import pad_patches, patch_bucket
from unsloth_jax.families.qwen import QWEN2
from unsloth_jax.families.base import (AdapterLayout, ImageInputs, ModelInputs, TowerTensor, VisionFamily, as_numpy,
                                       check_no_image_tokens, checked_pixels)
from unsloth_jax.models.vision_qwen2_5 import Qwen2_5_VLForConditionalGeneration, mrope_positions

LAYOUT_PREFIX = "vision_"  # batch fields vision_<name>: the tower's padded layout arrays (pad_patches)
_BLOCK_TENSORS = (  # (HF suffix after visual.blocks.{i}., module path under visual.blocks)
    ("norm1.weight", ("norm1", "weight")), ("norm2.weight", ("norm2", "weight")),
    *[(f"attn.{p}.{w}", ("attn", p, "kernel" if w == "weight" else w)) for p in ("qkv", "proj")
      for w in ("weight", "bias")],
    *[(f"mlp.{p}.{w}", ("mlp", p, "kernel" if w == "weight" else w)) for p in ("gate_proj", "up_proj", "down_proj")
      for w in ("weight", "bias")],
)


def qwen_vision_module(proj: str) -> str:
    """The parent module of a vision-block projection: attn (qkv, proj) or mlp (gate/up/down_proj)."""
    return "attn" if proj in ("qkv", "proj") else "mlp"


@dataclasses.dataclass(frozen=True)
class QwenVisionFamily(VisionFamily):
    def parse_config(self, raw: dict, source: str = "config.json") -> QwenVLConfig:
        return QwenVLConfig.from_dict(raw, source, text=QWEN2)

    def tower_tensors(self, cfg: QwenVLConfig) -> list[TowerTensor]:
        v = cfg.vision
        dv, fv, wide = v.hidden_size, v.intermediate_size, v.hidden_size * v.merge_unit
        shapes = {"qkv": (3 * dv, dv), "proj": (dv, dv), "gate_proj": (fv, dv), "up_proj": (fv, dv),
                  "down_proj": (dv, fv)}
        rows = [("visual.patch_embed.proj.weight", ("visual", "patch_embed", "proj", "kernel"), None, "patch",
                 (dv, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size))]
        for i in range(v.depth):
            for suffix, sub in _BLOCK_TENSORS:
                if sub[-1] == "kernel":
                    kind, shape = "kernel", shapes[sub[-2]]
                elif sub[-1] == "bias":
                    kind, shape = "bias", (shapes[sub[-2]][0],)
                else:
                    kind, shape = "norm", (dv,)
                rows.append((f"visual.blocks.{i}.{suffix}", ("visual", "blocks") + sub, i, kind, shape))
        rows.append(("visual.merger.ln_q.weight", ("visual", "merger", "ln_q", "weight"), None, "norm", (dv,)))
        for j, out in ((0, wide), (2, v.out_hidden_size)):
            merger = ("visual", "merger", f"mlp_{j}")
            rows.append((f"visual.merger.mlp.{j}.weight", merger + ("kernel",), None, "kernel", (out, wide)))
            rows.append((f"visual.merger.mlp.{j}.bias", merger + ("bias",), None, "bias", (out,)))
        return rows

    def is_image_field(self, key: str) -> bool:
        return key in self.image_fields or key.startswith(LAYOUT_PREFIX)

    def prepare_inputs(self, batch: dict) -> ModelInputs:
        """input_ids etc., and with images pixel_values [P, C*T*p*p], mrope_positions [3, B, S] and the tower's
        padded layout (the vision_* fields, data.vision_loader.pad_patches)."""
        if "pixel_values" not in batch:
            return self._inputs(batch)
        if "mrope_positions" not in batch:
            raise TypeError(f"the batch holds pixel_values but no mrope_positions ({self.name}'s M-RoPE positions "
                            "[3, B, S]; UnslothVisionDataCollator writes them)")
        layout = {k[len(LAYOUT_PREFIX):]: v for k, v in batch.items() if k.startswith(LAYOUT_PREFIX)}
        return self._inputs(batch, pixel_values=batch["pixel_values"], mrope_positions=batch["mrope_positions"],
                            vision_layout=layout)

    def hidden_states(self, model, inputs: ModelInputs, *, remat: LayerStackPolicy = NO_REMAT):
        """With images: their features at the image tokens, RoPE by mrope_positions; causal text."""
        if not inputs.has_images:
            return super().hidden_states(model, inputs, remat=remat)
        return model.hidden_states(inputs.input_ids, inputs.side(), remat_mode=remat,
                                   pixel_values=inputs.pixel_values, mrope_positions=inputs.mrope_positions,
                                   vision_layout=inputs.vision_layout)

    def image_token_ids(self, cfg: QwenVLConfig) -> list[int]:
        return [int(cfg.image_token_id), int(cfg.video_token_id)]

    def rl_image_fields(self, cfg: QwenVLConfig, ids, mask, images: list, micro_batches: int) -> dict:
        """pixel_values [A, P, C*T*p*p] (each micro-batch's patches padded to one patch_bucket), the vision_*
        layout [A, P, ...] and mrope_positions [A, 3, B, S]."""
        a = int(micro_batches)
        b = ids.shape[0] // a
        micro = []
        for k in range(a):
            rows = slice(k * b, (k + 1) * b)
            given = [g for g in images[rows] if g is not None]
            grid = np.concatenate([np.asarray(g.image_grid_thw, np.int64) for g in given]) if given else None
            pixels = (np.concatenate([np.asarray(g.pixel_values, np.float32) for g in given]) if given
                      else np.zeros((0, cfg.vision.patch_dim), np.float32))
            micro.append({"pixel_values": pixels, "image_grid_thw": grid,
                          "mrope_positions": mrope_positions(cfg, ids[rows], mask[rows], grid)})
        patches = patch_bucket(max(m["pixel_values"].shape[0] for m in micro), cfg.vision.merge_unit)
        padded = [pad_patches(m, cfg.vision, patches) for m in micro]
        return {k: np.stack([np.asarray(m[k]) for m in padded]) for k in padded[0] if k != "image_grid_thw"}

    def describe(self, model) -> str:
        c, v = model.config, model.vl_config.vision
        return (f"qwen2_5_vl, text layers={c.num_hidden_layers}, hidden={c.hidden_size}, vision blocks={v.depth}, "
                f"patch {v.patch_size}")

    # ---- generation
    def request_fields(self, model, ids, pixels, images: ImageInputs, where: str) -> tuple:
        """pixel_values [patches, C*T*p*p] with image_grid_thw [N, 3]; the prompt's M-RoPE positions [3, S] and
        rope_deltas (the largest position + 1 - S)."""
        cfg = model.vl_config
        if images.token_type_ids is not None:
            raise ValueError(f"{where}['images'].token_type_ids are Gemma 3's; {self.name} takes image_grid_thw")
        if images.image_grid_thw is None:
            raise ValueError(f"{where}['images'] needs image_grid_thw [images, 3] for {self.name}")
        if np.any(ids == cfg.video_token_id):
            raise ValueError(f"{where}: the prompt holds video tokens; {self.name} generation takes images only")
        grid = as_numpy(images.image_grid_thw).astype(np.int64)
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
        return pixels, grid, None, positions, int(positions.max()) + 1 - ids.shape[0]

    def prefill_fields(self, model, requests: list, pixels, rows: int, width: int) -> tuple:
        """Patches padded to a patch_bucket with the tower's padded layout; M-RoPE positions [3, rows, width]."""
        vision = model.vl_config.vision
        grid = np.concatenate([r.image_grid_thw for r in requests])
        padded = pad_patches(dict(pixel_values=pixels, image_grid_thw=grid), vision,
                             patch_bucket(pixels.shape[0], vision.merge_unit))
        layout = {k.removeprefix(LAYOUT_PREFIX): jnp.asarray(v) for k, v in padded.items()
                  if k.startswith(LAYOUT_PREFIX)}
        positions = np.zeros((3, rows, width), np.int32)
        for i, r in enumerate(requests):
            positions[:, i, :r.rope_positions.shape[1]] = r.rope_positions
        return jnp.asarray(padded["pixel_values"]), {"layout": layout}, None, jnp.asarray(positions)

    def row_images(self, cfg, is_image, pixel_values, image_grid_thw, token_types, cursor: tuple):
        """The next grid of image_grid_thw for each run of image tokens, and its t*h*w patches."""
        image, patch = cursor
        runs = int(np.sum(is_image & ~np.concatenate([[False], is_image[:-1]])))
        grid = image_grid_thw[image:image + runs]
        size = int(grid.prod(-1).sum())
        return ImageInputs(pixel_values[patch:patch + size], image_grid_thw=grid), (image + runs, patch + size)

    def processor_images(self, cfg, ids, pixels, out) -> ImageInputs:
        return ImageInputs(pixels, image_grid_thw=np.asarray(out["image_grid_thw"], np.int64))

    def generation_images(self, model, ids, mask, order, pixel_values, token_type_ids, image_grid_thw) -> tuple:
        """pixel_values [patches, C*T*p*p] with image_grid_thw [I, 3] (each image's t, h, w patch grid, t*h*w /
        merge^2 image tokens, filling the runs of image_token_id in order), or neither."""
        cfg = model.vl_config
        if token_type_ids is not None:
            raise ValueError(f"generate: token_type_ids are Gemma 3's; {self.name} takes image_grid_thw")
        if np.any(ids == cfg.video_token_id):
            raise ValueError(f"generate: input_ids hold video tokens; {self.name} generation takes images only")
        n_image_tokens = int(np.sum(ids == cfg.image_token_id))
        if pixel_values is None:
            if image_grid_thw is not None:
                raise ValueError("generate: image_grid_thw is given but pixel_values is None")
            check_no_image_tokens(n_image_tokens)
            return None, None, None
        if image_grid_thw is None:
            raise ValueError("generate: pixel_values needs image_grid_thw [images, 3] (each image's t, h, w patches, "
                             "as the image processor gives it)")
        grid = as_numpy(image_grid_thw).astype(np.int64)
        if grid.ndim != 2 or grid.shape[1] != 3:
            raise ValueError(f"generate: image_grid_thw must be [images, 3], got shape {grid.shape}")
        vision = cfg.vision
        pixels = checked_pixels(pixel_values, f"[patches, {vision.patch_dim}]", 2)
        patches = int(grid.prod(-1).sum())
        if pixels.shape != (patches, vision.patch_dim):
            raise ValueError(f"generate: pixel_values shape {pixels.shape}, but image_grid_thw {grid.tolist()} "
                             f"needs [{patches}, {vision.patch_dim}] (C*T*p*p values per patch)")
        needed = int((grid.prod(-1) // vision.merge_unit).sum())
        if n_image_tokens != needed:
            raise ValueError(f"generate: input_ids hold {n_image_tokens} image tokens, but image_grid_thw's "
                             f"{len(grid)} images need {needed} (t*h*w / {vision.merge_unit} each)")
        model.rope_positions(ids, mask, grid)  # ValueError when a run of image tokens does not match its grid
        return pixels, grid, None


# Tensor names are read in the checkpoint spelling (model.*, visual.*, lm_head.*: the Hub's files and transformers
# 5's save_pretrained), which is canonical, and transformers 5's module names (model.language_model.*,
# model.visual.*). PEFT's layer paths: transformers 5's module names (the export writes these) and the checkpoint
# spelling (model.layers, visual.blocks) PEFT on transformers 4 writes.
QWEN2_5_VL = QwenVisionFamily(
    "Qwen2.5-VL", ("qwen2_5_vl",), Qwen2_5_VLForConditionalGeneration,
    renames=(("model.language_model.", "model."), ("model.visual.", "visual.")),
    also_read_as="model.language_model.*, model.visual.*",
    tower_roots=("visual",),
    adapter=AdapterLayout(language_paths=("model.language_model.layers", "model.layers"),
                          vision_paths=("model.visual.blocks", "visual.blocks"), vision_module=qwen_vision_module,
                          target_patterns={"language": (r"language_model\.layers", "self_attn|mlp"),
                                           "vision": (r"visual\.blocks", "attn|mlp")}),
    vision_attention=("qkv", "proj"), vision_mlp=("gate_proj", "up_proj", "down_proj"),
    image_fields=("pixel_values", "mrope_positions"), row_fields=("mrope_positions",))
