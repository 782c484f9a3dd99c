"""Gemma 3 with images (config.json model_type "gemma3" with a vision_config; transformers'
Gemma3ForConditionalGeneration): the Gemma 3 text decoder plus the SigLIP tower and Gemma 3's projector
(models.vision). Images are pixel_values [N, C, H, W], mm_tokens_per_image image tokens each, and token_type_ids
(1 on image tokens) for their bidirectional attention."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from unsloth_jax.config import VisionLanguageConfig
from unsloth_jax.models.layer_stack import NO_REMAT, LayerStackPolicy
from unsloth_jax.data.vision_loader import pad_images
from unsloth_jax.families.gemma3_text import GEMMA3_TEXT
from unsloth_jax.families.base import (AdapterLayout, ImageInputs, ModelInputs, TowerTensor, VisionFamily, as_id_rows,
                                       as_numpy, check_no_image_tokens, checked_pixels)
from unsloth_jax.models.vision import Gemma3ForConditionalGeneration, image_block_ids

VISION_LAYERS = ("vision_tower", "encoder", "layers")  # module path of the stacked vision layers
_LAYER_TENSORS = (  # (HF suffix after vision_tower.encoder.layers.{i}., module path under VISION_LAYERS)
    *[(f"layer_norm{j}.{w}", (f"layer_norm{j}", w)) for j in (1, 2) for w in ("weight", "bias")],
    *[(f"self_attn.{p}.{w}", ("self_attn", p, "kernel" if w == "weight" else w))
      for p in ("q_proj", "k_proj", "v_proj", "out_proj") for w in ("weight", "bias")],
    *[(f"mlp.{p}.{w}", ("mlp", p, "kernel" if w == "weight" else w)) for p in ("fc1", "fc2")
      for w in ("weight", "bias")],
)


def gemma_vision_module(proj: str) -> str:
    """The parent module of a SigLIP encoder-layer projection: self_attn (q/k/v/out_proj) or mlp (fc1, fc2)."""
    return "self_attn" if proj.endswith("proj") else "mlp"


@dataclasses.dataclass(frozen=True)
class Gemma3VisionFamily(VisionFamily):
    def parse_config(self, raw: dict, source: str = "config.json") -> VisionLanguageConfig:
        return VisionLanguageConfig.from_dict(raw, source, text=GEMMA3_TEXT)

    def tower_tensors(self, cfg: VisionLanguageConfig) -> list[TowerTensor]:
        v = cfg.vision
        dv, fv = v.hidden_size, v.intermediate_size
        shapes = {"q_proj": (dv, dv), "k_proj": (dv, dv), "v_proj": (dv, dv), "out_proj": (dv, dv),
                  "fc1": (fv, dv), "fc2": (dv, fv)}
        emb = ("vision_tower", "embeddings")
        rows = [("vision_tower.embeddings.patch_embedding.weight", emb + ("patch_embedding", "kernel"), None, "patch",
                 (dv, v.num_channels, v.patch_size, v.patch_size)),
                ("vision_tower.embeddings.patch_embedding.bias", emb + ("patch_embedding", "bias"), None, "bias",
                 (dv,)),
                ("vision_tower.embeddings.position_embedding.weight", emb + ("position_embedding", "weight"), None,
                 "embed", (v.num_patches, dv))]
        for i in range(v.num_hidden_layers):
            for suffix, sub in _LAYER_TENSORS:
                module = sub[-2]
                if sub[-1] == "kernel":
                    kind, shape = "kernel", shapes[module]
                elif module in shapes:
                    kind, shape = "bias", (shapes[module][0],)
                else:
                    kind, shape = ("norm" if sub[-1] == "weight" else "bias"), (dv,)
                rows.append((f"vision_tower.encoder.layers.{i}.{suffix}", VISION_LAYERS + sub, i, kind, shape))
        for w in ("weight", "bias"):
            rows.append((f"vision_tower.post_layernorm.{w}", ("vision_tower", "post_layernorm", w), None,
                         "norm" if w == "weight" else "bias", (dv,)))
        proj = ("multi_modal_projector",)
        rows.append(("multi_modal_projector.mm_soft_emb_norm.weight", proj + ("mm_soft_emb_norm", "weight"), None,
                     "norm", (dv,)))
        rows.append(("multi_modal_projector.mm_input_projection_weight", proj + ("mm_input_projection", "kernel"),
                     None, "copy", (dv, cfg.text.hidden_size)))
        return rows

    def prepare_inputs(self, batch: dict) -> ModelInputs:
        """input_ids etc., pixel_values [N, C, H, W] and token_type_ids [B, S] (needed with pixel_values)."""
        if "pixel_values" in batch and "token_type_ids" not in batch:
            raise TypeError("the batch holds pixel_values but no token_type_ids (Gemma 3 marks image tokens with "
                            "them; UnslothVisionDataCollator writes both)")
        return self._inputs(batch, pixel_values=batch.get("pixel_values"), token_type_ids=batch.get("token_type_ids"))

    def hidden_states(self, model, inputs: ModelInputs, *, remat: LayerStackPolicy = NO_REMAT):
        """With images: their features at the image tokens, each image's tokens attending to each other both ways
        (token_type_ids -> Batch.block_ids); trailing all-zero padding images, read by no token, are allowed."""
        if not inputs.has_images:
            return super().hidden_states(model, inputs, remat=remat)
        side = inputs.side()._replace(block_ids=image_block_ids(inputs.token_type_ids))
        return model.hidden_states(inputs.input_ids, side, remat_mode=remat, pixel_values=inputs.pixel_values)

    def image_token_ids(self, cfg: VisionLanguageConfig) -> list[int]:
        return [int(cfg.image_token_index)]

    def rl_image_fields(self, cfg: VisionLanguageConfig, ids, mask, images: list, micro_batches: int) -> dict:
        """pixel_values [A, N, C, H, W] (each micro-batch's images in row order, zero images padding N to a
        multiple of B) and token_type_ids [A, B, S] (the prompts', 0 elsewhere)."""
        n, s = ids.shape
        a = int(micro_batches)
        b = n // a
        vision = cfg.vision
        shape = (vision.num_channels, vision.image_size, vision.image_size)
        types = np.zeros((n, s), np.int32)
        pixels = []
        for k in range(a):
            given = [images[r] for r in range(k * b, (k + 1) * b) if images[r] is not None]
            pixels.append(np.concatenate([np.asarray(g.pixel_values, np.float32) for g in given]) if given else None)
        for r, g in enumerate(images):
            if g is not None and g.token_type_ids is not None:
                t = np.asarray(g.token_type_ids, np.int32)
                types[r, :t.shape[0]] = t
        count = max(0 if p is None else p.shape[0] for p in pixels)
        slots = max(b, -(-count // b) * b)
        return {"pixel_values": np.stack([pad_images(p, slots, shape) for p in pixels]),
                "token_type_ids": types.reshape(a, b, s)}

    def describe(self, model) -> str:
        c, v = model.config, model.vl_config.vision
        return (f"gemma3, text layers={c.num_hidden_layers}, hidden={c.hidden_size}, vision layers="
                f"{v.num_hidden_layers}, image {v.image_size}px / patch {v.patch_size}")

    # ---- generation
    def request_fields(self, model, ids, pixels, images: ImageInputs, where: str) -> tuple:
        """pixel_values [N, C, H, W] (N * mm_tokens_per_image image tokens), token_type_ids [S] or None."""
        cfg = model.vl_config
        if images.image_grid_thw is not None:
            raise ValueError(f"{where}['images'].image_grid_thw is Qwen2.5-VL's; Gemma 3 takes pixel_values "
                             "[N, C, H, W]")
        if pixels.ndim != 4 or pixels.shape[0] == 0:
            raise ValueError(f"{where}['images'].pixel_values must be [N, C, H, W] with N >= 1, got shape "
                             f"{pixels.shape}")
        n_tokens, need = int(np.sum(ids == cfg.image_token_index)), pixels.shape[0] * cfg.mm_tokens_per_image
        if n_tokens != need:
            raise ValueError(f"{where}: the prompt holds {n_tokens} image tokens, but its {pixels.shape[0]} images "
                             f"need {need} ({cfg.mm_tokens_per_image} each)")
        types = None
        if images.token_type_ids is not None:
            types = as_numpy(images.token_type_ids).astype(np.int32)
            if types.shape != ids.shape:
                raise ValueError(f"{where}['images'].token_type_ids has shape {types.shape}; the prompt is "
                                 f"{ids.shape}")
        return pixels, None, types, None, 0

    def prefill_fields(self, model, requests: list, pixels, rows: int, width: int) -> tuple:
        """Images padded with zero images to a power-of-two count; block ids of the image blocks (None: causal)."""
        block_ids = None
        if any(r.token_type_ids is not None for r in requests):
            types = np.zeros((rows, width), np.int32)
            for i, r in enumerate(requests):
                if r.token_type_ids is not None:
                    types[i, :r.token_type_ids.shape[0]] = r.token_type_ids
            block_ids = image_block_ids(jnp.asarray(types))
        count = 1 << (max(int(pixels.shape[0]), 1) - 1).bit_length()
        return jnp.asarray(pad_images(pixels, count, pixels.shape[1:])), {}, block_ids, None

    def row_images(self, cfg, is_image, pixel_values, image_grid_thw, token_types, cursor: tuple):
        """The next N images for the row's N * mm_tokens_per_image image tokens."""
        image, patch = cursor
        count = int(is_image.sum()) // cfg.mm_tokens_per_image
        return ImageInputs(pixel_values[image:image + count], token_type_ids=token_types), (image + count, patch)

    def processor_images(self, cfg, ids, pixels, out) -> ImageInputs:
        """The processor's token_type_ids (else 1 on the image tokens)."""
        types = (np.asarray(out["token_type_ids"][0], np.int32) if "token_type_ids" in out
                 else (ids == cfg.image_token_index).astype(np.int32))
        return ImageInputs(pixels, token_type_ids=types)

    def generation_images(self, model, ids, mask, order, pixel_values, token_type_ids, image_grid_thw) -> tuple:
        """pixel_values [N, C, H, W] for N * mm_tokens_per_image image tokens; token_type_ids [B, P] (1 = image
        token: each image's tokens attend to each other both ways in the prefill; None: causal)."""
        cfg = model.vl_config
        if image_grid_thw is not None:
            raise ValueError("generate: image_grid_thw is Qwen2.5-VL's; Gemma 3 takes pixel_values [N, C, H, W]")
        types = None
        if token_type_ids is not None:
            types = as_id_rows(token_type_ids, "token_type_ids").astype(np.int32)
            if types.shape != ids.shape:
                raise ValueError(f"generate: token_type_ids shape {types.shape} differs from input_ids shape "
                                 f"{ids.shape}")
            types = np.take_along_axis(types, order, axis=1)
        n_image_tokens = int(np.sum(ids == cfg.image_token_index))
        pixels = None
        if pixel_values is None:
            check_no_image_tokens(n_image_tokens)
        else:
            pixels = checked_pixels(pixel_values, "[N, C, H, W]", 4)
            if n_image_tokens != pixels.shape[0] * cfg.mm_tokens_per_image:
                raise ValueError(f"generate: input_ids hold {n_image_tokens} image tokens, but pixel_values' "
                                 f"{pixels.shape[0]} images need {pixels.shape[0] * cfg.mm_tokens_per_image} "
                                 f"({cfg.mm_tokens_per_image} each)")
        return pixels, None, types


# transformers 5's module names (the export writes these) and transformers 4's (language_model.model.layers,
# vision_tower.vision_model.encoder.layers), with and without the model. level
GEMMA3_VL = Gemma3VisionFamily(
    "Gemma 3 vision-language", ("gemma3",), Gemma3ForConditionalGeneration,
    text_prefix="language_model.",
    # canonical names are what transformers 5's save_pretrained writes: language_model.model.*, vision_tower.*,
    # multi_modal_projector.*, lm_head.weight (untied only)
    renames=(("model.language_model.", "language_model.model."),  # transformers 5's module names
             ("language_model.lm_head.", "lm_head."),  # older writers
             ("model.vision_tower.vision_model.", "vision_tower."),
             ("model.vision_tower.", "vision_tower."),
             ("vision_tower.vision_model.", "vision_tower."),  # the Hub's Gemma 3 checkpoints (transformers 4)
             ("model.multi_modal_projector.", "multi_modal_projector.")),
    ignored_prefixes=("vision_tower.head.",),  # SigLIP's attention-pooling head: Gemma 3 never runs it
    also_read_as="model.language_model.*, vision_tower.vision_model.*",
    tower_roots=("vision_tower", "multi_modal_projector"),
    adapter=AdapterLayout(
        language_paths=("model.language_model.layers", "model.language_model.model.layers",
                        "language_model.layers", "language_model.model.layers"),
        vision_paths=("model.vision_tower.encoder.layers", "model.vision_tower.vision_model.encoder.layers",
                      "vision_tower.encoder.layers", "vision_tower.vision_model.encoder.layers"),
        vision_module=gemma_vision_module,
        target_patterns={"language": (r"language_model(?:\.model)?\.layers", "self_attn|mlp"),
                         "vision": (r"vision_tower(?:\.vision_model)?\.encoder\.layers", "self_attn|mlp")}),
    vision_attention=("q_proj", "k_proj", "v_proj", "out_proj"), vision_mlp=("fc1", "fc2"),
    image_fields=("pixel_values", "token_type_ids"), row_fields=("token_type_ids",))
