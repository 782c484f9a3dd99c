"""The Family object (one per architecture) and ModelInputs, the typed inputs of a forward pass.

    family = families.family_of(model)                       # or families.family_for(config.json's dict)
    inputs = family.prepare_inputs(batch)                    # a batch dict -> ModelInputs (a pytree)
    h = family.hidden_states(model, inputs, remat=policy)    # [B, S, D]

A text family is a `TextFamily` (one module of families/ each): its config is a `ModelConfig` read by config.py's
generic parser with the family's fields, and its HF tensor table is data hf/mapping.py builds the specs from.
A vision-language family (`VisionFamily`) is a text family plus a tower: the text decoder's `ModelConfig` inside
its config, the tower's HF tensor rows and name spellings as data, its PEFT adapter layout
(`AdapterLayout`), and the image fields of its `ModelInputs`.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable

import jax
import numpy as np

from unsloth_jax.config import ModelConfig, layer_windows, parse_text_config, rope_fields
from unsloth_jax.errors import UnsupportedArchitectureError
from unsloth_jax.families.tensors import LLAMA_TENSORS, LayerTensor
from unsloth_jax.models.decoder import PROJ_PARENT, CausalLM, make_batch
from unsloth_jax.models.layer_stack import NO_REMAT, LayerStackPolicy


@dataclasses.dataclass(frozen=True)
class ModelInputs:
    """What a forward pass reads, as arrays (a pytree: None fields are absent). Shapes per micro-batch:

    input_ids        int32 [B, S]
    attention_mask   int32 [B, S] 1 on real tokens (None: every token real)
    positions        int32 [B, S] (None: from attention_mask)
    segment_ids      int32 [B, S] packed rows (None: one sequence per row, right padded)
    pixel_values     float32: Gemma 3 [N, C, H, W]; Qwen2.5-VL [P, C*T*p*p] (P patches, maybe padded)
    token_type_ids   int32 [B, S] Gemma 3: 1 on image tokens (bidirectional within each image)
    mrope_positions  int32 [3, B, S] Qwen2.5-VL's M-RoPE positions
    vision_layout    dict of arrays [P, ...]: Qwen2.5-VL's padded tower layout (models.vision_qwen2_5)
    """

    input_ids: jax.Array
    attention_mask: jax.Array | None = None
    positions: jax.Array | None = None
    segment_ids: jax.Array | None = None
    pixel_values: jax.Array | None = None
    token_type_ids: jax.Array | None = None
    mrope_positions: jax.Array | None = None
    vision_layout: dict | None = None

    @property
    def has_images(self) -> bool:
        return self.pixel_values is not None

    def side(self):
        """The decoder's side inputs (models.attention.Batch): right padded unless rows are packed."""
        return make_batch(self.input_ids, self.attention_mask, self.positions, self.segment_ids,
                          right_padded=self.segment_ids is None)


@dataclasses.dataclass(frozen=True)
class ImageInputs:
    """The images of one prompt for the generation engine, as the model's processor gives them for that prompt alone.

    pixel_values    Gemma 3: [N, C, H, W] (one image per block of mm_tokens_per_image image tokens, in order);
                    Qwen2.5-VL: [patches, C*T*p*p] (the patches of the images of image_grid_thw, in order)
    image_grid_thw  Qwen2.5-VL: [N, 3] each image's (t, h, w) patch grid, one per run of image tokens; Gemma 3: None
    token_type_ids  Gemma 3: [S] 1 on image tokens (each image's tokens attend to each other both ways in the
                    prefill, as transformers with token_type_ids); None: causal everywhere. Qwen2.5-VL: None
    """

    pixel_values: np.ndarray
    image_grid_thw: np.ndarray | None = None
    token_type_ids: np.ndarray | None = None


def as_numpy(x) -> np.ndarray:
    """x (numpy, torch tensor or nested lists) as a numpy array."""
    return np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x)


def as_id_rows(x, name: str) -> np.ndarray:
    """generate's ids-like argument `name` as [batch, length] numpy ([length] becomes one row)."""
    arr = as_numpy(x)
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2:
        raise ValueError(f"generate: {name} must be [batch, length], got shape {arr.shape}")
    return arr


def checked_pixels(pixel_values, shape: str, ndim: int) -> np.ndarray:
    """generate's pixel_values (numpy or torch) as float32 numpy with `ndim` dimensions (ValueError naming `shape`)."""
    pixels = as_numpy(pixel_values).astype(np.float32)
    if pixels.ndim != ndim:
        raise ValueError(f"generate: pixel_values must be {shape}, got shape {pixels.shape}")
    return pixels


def check_no_image_tokens(n_image_tokens: int) -> None:
    """generate's pixel_values is None: ValueError if input_ids hold image tokens."""
    if n_image_tokens:
        raise ValueError(f"generate: input_ids hold {n_image_tokens} image tokens but pixel_values is None")


jax.tree_util.register_dataclass(ModelInputs, data_fields=[f.name for f in dataclasses.fields(ModelInputs)],
                                 meta_fields=[])
TEXT_FIELDS = ("input_ids", "attention_mask", "positions", "segment_ids")


@dataclasses.dataclass(frozen=True)
class Family:
    """One architecture: `name` for messages, the config.json `model_types` it reads, its NNX `module_class`
    (constructed as module_class(config, dtype=, param_dtype=, rngs=), as the loaders' model_from_params does)."""

    name: str
    model_types: tuple[str, ...]
    module_class: type
    row_fields: tuple[str, ...] = ()  # image batch fields laid out along the rows' sequence axis (last)

    def is_image_field(self, key: str) -> bool:
        """Whether batch field `key` is one of this family's image fields (what prepare_inputs reads besides the
        text fields)."""
        return False

    def batch_row_axis(self, key: str, ndim: int) -> int | None:
        """The axis of a step batch's field `key` (`ndim` dims, the micro-batch axis A first) that runs over the
        rows, along which a mesh splits the batch (unsloth_jax.distributed); None for a field with no row axis
        (a per-micro-batch scalar [A]; a vision-language batch's pixels and tower layouts, which every device
        gets whole)."""
        return 1 if ndim >= 2 else None

    def parse_config(self, raw: dict, source: str = "config.json"):
        """config.json's dict -> this family's frozen config (ConfigError naming `source` and the key)."""
        raise NotImplementedError

    def prepare_inputs(self, batch: dict) -> ModelInputs:
        """A batch dict (the data pipeline's names) -> ModelInputs; TypeError for fields this family cannot read."""
        raise NotImplementedError

    def hidden_states(self, model, inputs: ModelInputs, *, remat: LayerStackPolicy = NO_REMAT):
        """Final-normed hidden states [B, S, D] of `model` (this family's module) on `inputs`."""
        return model.hidden_states(inputs.input_ids, inputs.side(), remat_mode=remat)


@dataclasses.dataclass(frozen=True)
class TextFamily(Family):
    """A text decoder (models.decoder.CausalLM), one module of families/ each, registered in TEXT_FAMILIES
    (families/__init__.py). What shared code asks of it, as data and functions:

    config.json, read by config.parse_text_config (the generic fields; these the family's):
      raw_defaults      (key, value) pairs its transformers config class defaults when config.json lacks them
      config_fields     (raw, source) -> its RoPE and switches, overriding the generic fields
      layer_windows     (raw, n_layers, source) -> per-layer sliding window or None
      activation_key    config.json's key of the MLP activation: "hidden_act", or Gemma's "hidden_activation"
      moe_fields        (raw, n_layers, source) -> its mixture-of-experts fields; None for a dense family
    HF tensors, read by hf/mapping.py (entries: families.tensors):
      layer_tensors     per-layer entries every checkpoint of the family holds (config switches add the optional
                        q/k norms and biases)
      switched_tensors  (ModelConfig field, entries): per-layer entries present where that field is set
      fused_projs       (fused HF suffix, parent module, projections in row order): Phi-3's qkv_proj, gate_up_proj
      model_tensors     cfg -> {HF name: TensorSpec} of the tensors outside the layers beyond embeddings, final
                        norm and head
      ignored_prefixes  checkpoint tensor name prefixes transformers skips on load (read, never mapped)
      expert_layouts    MoE: the expert layouts its checkpoints come in ("per_expert", "fused"), the first the one
                        transformers' save_pretrained writes
      per_expert_names  MoE per-expert layout: (checkpoint module of the MoE block, gate, up, down)
      sparse_specs      MoE: (cfg, layer, add) -> a sparse layer's router and expert specs in place of the
                        generic ones (gpt-oss); add(name, path, layer, kind, shape, **kw) records one
      sparse_extra_specs MoE: (cfg, layer, add) -> more specs of a sparse layer (GLM-4.5's score bias, shared
                        experts)
    PEFT adapters, read by hf/moe_io.py:
      peft_remaps_mlp_targets  MoE: PEFT 0.21 on transformers 5 maps MLP target_modules onto the expert weights
                        (an adapter with LoRA on the dense MLP layers would not load as trained)
    GGUF, read by hf/gguf_*.py:
      gguf_arch         the gguf.MODEL_ARCH member llama.cpp's converter writes it as; None: no GGUF export
      gguf_read         (llama.cpp arch name, transformers class) of a GGUF file read as this family, or None
    """

    raw_defaults: tuple[tuple[str, object], ...] = ()
    config_fields: Callable[[dict, str], dict] = rope_fields
    layer_windows: Callable[[dict, int, str], tuple] = layer_windows
    activation_key: str = "hidden_act"
    moe_fields: Callable[[dict, int, str], dict] | None = None
    layer_tensors: tuple[LayerTensor, ...] = LLAMA_TENSORS
    switched_tensors: tuple[tuple[str, tuple[LayerTensor, ...]], ...] = ()
    fused_projs: tuple[tuple[str, str, tuple[str, ...]], ...] = ()
    model_tensors: Callable | None = None
    ignored_prefixes: tuple[str, ...] = ()
    expert_layouts: tuple[str, ...] = ()
    per_expert_names: tuple[str, str, str, str] | None = None
    sparse_specs: Callable | None = None
    sparse_extra_specs: Callable | None = None
    peft_remaps_mlp_targets: bool = False
    gguf_arch: str | None = None
    gguf_read: tuple[str, str] | None = None
    module_class: type = CausalLM

    def parse_config(self, raw: dict, source: str = "config.json") -> ModelConfig:
        if raw.get("model_type") not in self.model_types:
            raise UnsupportedArchitectureError(f"{source}: model_type {raw.get('model_type')!r} is not "
                                               f"{self.name} ({', '.join(self.model_types)})")
        return parse_text_config(raw, source, self)

    def prepare_inputs(self, batch: dict) -> ModelInputs:
        if "pixel_values" in batch:
            raise TypeError(f"the batch holds pixel_values, but a {self.name} model is not a vision-language model")
        return ModelInputs(**{k: batch.get(k) for k in TEXT_FIELDS})


@dataclasses.dataclass(frozen=True)
class AdapterLayout:
    """How PEFT names a vision-language family's LoRA modules: `language_paths` / `vision_paths`, the module paths
    of each tower's layers (under base_model.model., followed by .{i}.) in every transformers spelling read, the
    first being the one an export writes (transformers 5's module names); `vision_module`, a vision projection's
    parent module (the language projections' is the text decoder's PROJ_PARENT); `target_patterns`, per tower
    (layer-path regex, parent-modules regex) for the target_modules regex an exported adapter_config.json carries."""

    language_paths: tuple[str, ...]
    vision_paths: tuple[str, ...]
    vision_module: Callable[[str], str]
    target_patterns: dict

    def target_modules_regex(self, language: tuple[str, ...], vision: tuple[str, ...]) -> str:
        """target_modules for the adapted projections of each tower: one alternative per tower with any."""
        parts = []
        for tower, names in (("language", language), ("vision", vision)):
            if names:
                path, parents = self.target_patterns[tower]
                parts.append(rf".*{path}\.\d+\.(?:{parents})\.(?:{'|'.join(names)})")
        return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"

    def paths(self, tower: str) -> tuple[str, ...]:
        return self.language_paths if tower == "language" else self.vision_paths

    def module(self, tower: str, proj: str) -> str:
        """The HF parent module (e.g. self_attn, mlp) of projection `proj` of `tower`."""
        return PROJ_PARENT[proj] if tower == "language" else self.vision_module(proj)

    @functools.cached_property
    def key_regex(self) -> re.Pattern:
        """One LoRA key of an adapter: groups path (a layer path of either tower), i, module, proj, which (A/B)."""
        paths = sorted(self.language_paths + self.vision_paths, key=len, reverse=True)
        return re.compile(rf"^base_model\.model\.(?P<path>{'|'.join(map(re.escape, paths))})\.(?P<i>\d+)\."
                          r"(?P<module>\w+)\.(?P<proj>\w+?)\.lora_(?P<which>[AB])(?:\.[\w-]+)?\.weight$")


@dataclasses.dataclass(frozen=True)
class MultimodalTextLayout:
    """A multimodal checkpoint whose text decoder loads alone (ModelConfig.source_layout names it): its text
    tensors are the text family's canonical names (hf/mapping.py's model.*, lm_head.*) with "model." spelled
    `text_prefix` (as a VisionFamily's text_prefix respells them); tensors under `kept_prefixes` (the towers and
    their embedders) are never loaded and are copied through byte for byte by the merged export. PEFT wraps
    `architecture`, so an adapter's keys carry the same spelling under base_model.model."""

    model_type: str  # config.json's model_type (the text decoder's config is its text_config)
    architecture: str  # transformers' class of the whole checkpoint
    text_prefix: str  # what the checkpoint writes for the text decoder's "model."
    kept_prefixes: tuple[str, ...]

    def stored_name(self, name: str) -> str:
        """A canonical text tensor name (or a module name) in the checkpoint's spelling."""
        return self.text_prefix + name[len("model."):] if name.startswith("model.") else name

    def text_name(self, stored: str) -> str | None:
        """A checkpoint tensor's canonical text name; None for a tensor under kept_prefixes."""
        if stored.startswith(self.text_prefix):
            return "model." + stored[len(self.text_prefix):]
        return None if stored.startswith(self.kept_prefixes) else stored

    def adapter_key(self, key: str) -> str:
        """A PEFT key of the text decoder (base_model.model.model.layers...) in the checkpoint's spelling."""
        head = "base_model.model."
        return head + self.stored_name(key[len(head):]) if key.startswith(head) else key

    def text_adapter_key(self, key: str) -> str:
        """The inverse of adapter_key (keys outside the text prefix come back unchanged)."""
        head = "base_model.model."
        if key.startswith(head):
            name = self.text_name(key[len(head):])
            return key if name is None else head + name
        return key


# One row of a tower's checkpoint tensors: (HF name, module path, layer index or None, kind, HF shape). Kinds:
# "patch" (a conv weight [Dv, C, (T,) p, p] <-> kernel [C*(T*)p*p, Dv]), "kernel" ([out, in] <-> [in, out]),
# "norm" / "bias" / "embed" / "copy" (as stored).
TowerTensor = tuple[str, tuple[str, ...], "int | None", str, tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class VisionFamily(Family):
    """A text family plus a vision tower. Data the one loader / exporter (hf.vision_io, hf.vision_export) read:

    text_prefix       what canonical text tensor names carry before "model." (Gemma 3: "language_model.")
    renames           (stored prefix, canonical prefix) pairs; the first match wins
    ignored_prefixes  canonical prefixes the model never runs (skipped on load, copied through on export)
    also_read_as      the other spellings read, for messages
    tower_roots       module-path roots of the tower and projector
    adapter           the PEFT AdapterLayout
    vision_attention / vision_mlp: the tower's projection names FastVisionModel's switches adapt
    image_fields      the batch fields of its images (row_fields: those along the sequence axis)
    """

    text_prefix: str = ""
    renames: tuple[tuple[str, str], ...] = ()
    ignored_prefixes: tuple[str, ...] = ()
    also_read_as: str = ""
    tower_roots: tuple[str, ...] = ()
    adapter: AdapterLayout | None = None
    vision_attention: tuple[str, ...] = ()
    vision_mlp: tuple[str, ...] = ()
    image_fields: tuple[str, ...] = ()

    def is_image_field(self, key: str) -> bool:
        return key in self.image_fields

    def batch_row_axis(self, key: str, ndim: int) -> int | None:
        if key in self.row_fields:  # [A, ..., B, S]: the rows precede the sequence axis
            return ndim - 2
        if self.is_image_field(key):  # pixels, patches and tower layouts are not laid out by rows
            return None
        return super().batch_row_axis(key, ndim)

    def text_name(self, name: str) -> str:
        """A text decoder tensor name (hf/mapping.py's: model.*, lm_head.*) in the canonical spelling."""
        return self.text_prefix + name if name.startswith("model.") else name

    def canonical_name(self, name: str) -> str:
        """A checkpoint tensor name in the canonical spelling (the first matching rename)."""
        for old, new in self.renames:
            if name.startswith(old):
                return new + name[len(old):]
        return name

    def tower_tensors(self, cfg) -> list[TowerTensor]:
        """Every tensor of the tower and projector a checkpoint with config `cfg` holds."""
        raise NotImplementedError

    def image_token_ids(self, cfg) -> list[int]:
        """The ids whose embeddings the image features replace."""
        raise NotImplementedError

    def rl_image_fields(self, cfg, ids, mask, images: list, micro_batches: int) -> dict:
        """The image fields of RL rows ids, mask [A * B, S] (train.rl_images.image_micro_batches)."""
        raise NotImplementedError

    def describe(self, model) -> str:
        """The family's part of the loaded model's repr."""
        raise NotImplementedError

    # ---- generation: what inference.image_inputs and generation.generate_vision ask of a family
    def request_fields(self, model, ids: np.ndarray, pixels: np.ndarray, images: ImageInputs, where: str) -> tuple:
        """One engine prompt's images checked against its ids [S] (image tokens expanded): the fields of an
        inference.image_inputs.ImageRequest (pixel_values, image_grid_thw, token_type_ids, rope_positions,
        position_offset). ValueError names `where` and the field."""
        raise NotImplementedError

    def prefill_fields(self, model, requests: list, pixels: np.ndarray, rows: int, width: int) -> tuple:
        """The image side of one prefill [rows, width] of ImageRequests whose images are `pixels` (concatenated):
        the fields of an inference.image_inputs.ImageBatch (pixel_values padded to a bucket, image_kwargs,
        block_ids or None, rope_positions or None)."""
        raise NotImplementedError

    def row_images(self, cfg, is_image: np.ndarray, pixel_values, image_grid_thw, token_types, cursor: tuple
                   ) -> tuple[ImageInputs, tuple]:
        """One processor-batch row's ImageInputs (is_image [S] marks its image tokens), taken from the batch's
        images at `cursor` (image, patch), and the cursor after them."""
        raise NotImplementedError

    def processor_images(self, cfg, ids: np.ndarray, pixels: np.ndarray, out) -> ImageInputs:
        """A chat prompt's ImageInputs from the processor's output `out` for ids [S] and pixels."""
        raise NotImplementedError

    def generation_images(self, model, ids: np.ndarray, mask: np.ndarray, order: np.ndarray, pixel_values,
                          token_type_ids, image_grid_thw) -> tuple:
        """generate's image arguments for left-padded ids, mask [B, P] (`order`: the columns the caller's rows
        were reordered by), checked: (pixels or None, image_grid_thw or None, token_type_ids [B, P] or None)."""
        raise NotImplementedError

    def _inputs(self, batch: dict, **images) -> ModelInputs:
        return ModelInputs(**{k: batch.get(k) for k in TEXT_FIELDS}, **images)


__all__ = ["AdapterLayout", "Family", "ImageInputs", "ModelInputs", "MultimodalTextLayout", "as_id_rows", "as_numpy",
           "check_no_image_tokens", "checked_pixels", "TextFamily", "TowerTensor", "VisionFamily"]
