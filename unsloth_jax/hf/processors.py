"""Image processors of vision-language checkpoints that transformers' AutoProcessor cannot build here.

transformers' Qwen2.5-VL and Qwen3-VL (also Qwen3.5's) processors always build their video half, whose processor imports
torchvision; a JAX user's venv rarely has torchvision, and AutoProcessor then fails. Training and generating with
images never need the video half, so `image_only_processor(model_dir)` builds the same processor without it: the
folder's tokenizer, its Qwen2-VL image processor (the PIL implementation, no torchvision) and its chat template. Its
`__call__` and `apply_chat_template` give what transformers' processor gives for text and images; passing videos
is refused.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger("unsloth_jax")

IMAGE_ONLY_TYPES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5")  # model types image_only_processor builds


def folder_model_type(model_dir: Path) -> str | None:
    """config.json's model_type in `model_dir`, or None."""
    try:
        return json.loads((model_dir / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def _chat_template(model_dir: Path, tokenizer) -> str | None:
    """The folder's processor chat template (chat_template.jinja, or chat_template.json's "chat_template"), else
    the tokenizer's."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    as_json = model_dir / "chat_template.json"
    if as_json.is_file():
        return json.loads(as_json.read_text()).get("chat_template")
    return getattr(tokenizer, "chat_template", None)


def _qwen2_vl_image_processor(model_dir: Path):
    """The Qwen2-VL image processor of the folder's preprocessor settings, in its PIL implementation (no
    torchvision): transformers 5 names it Qwen2VLImageProcessorPil, earlier releases Qwen2VLImageProcessor."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as cls
    except ImportError:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor as cls
    settings = {}
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = model_dir / name
        if path.is_file():
            data = json.loads(path.read_text())
            settings = data.get("image_processor", data)  # transformers 5 nests it in processor_config.json
            break
    keep = ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels", "image_mean",
            "image_std", "size", "do_resize", "do_rescale", "rescale_factor", "do_normalize", "do_convert_rgb",
            "resample")
    return cls(**{k: v for k, v in settings.items() if k in keep})


def image_only_processor(model_dir):
    """The Qwen2.5-VL / Qwen3-VL / Qwen3.5 processor of `model_dir` without its video processor (module
    docstring). Raises ValueError for another model type, OSError for missing tokenizer files."""
    model_dir = Path(model_dir)
    model_type = folder_model_type(model_dir)
    if model_type not in IMAGE_ONLY_TYPES:
        raise ValueError(f"{model_dir}: image_only_processor builds {', '.join(IMAGE_ONLY_TYPES)} processors; "
                         f"config.json says model_type {model_type!r}")
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor, Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    base = Qwen2_5_VLProcessor if model_type == "qwen2_5_vl" else Qwen3VLProcessor  # Qwen3.5 uses Qwen3-VL's
    name = {"qwen2_5_vl": "Qwen2.5-VL", "qwen3_vl": "Qwen3-VL", "qwen3_5": "Qwen3.5"}[model_type]

    class Qwen2_5_VLImageProcessor(base):
        """The Qwen2.5-VL / Qwen3-VL processor with images only (its video processor needs torchvision)."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            for kind, default in (("image", "<|image_pad|>"), ("video", "<|video_pad|>"),
                                  ("vision_start", "<|vision_start|>"), ("vision_end", "<|vision_end|>")):
                token = getattr(tokenizer, f"{kind}_token", None) or default
                setattr(self, f"{kind}_token", token)
                setattr(self, f"{kind}_token_id", tokenizer.convert_tokens_to_ids(token))
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

        def __call__(self, *args, videos=None, **kwargs):
            if videos is not None:
                raise ValueError(f"videos: this {name} processor was built without its video processor "
                                 "(transformers' needs torchvision: pip install torchvision for videos)")
            return super().__call__(*args, **kwargs)

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    processor = Qwen2_5_VLImageProcessor(image_processor=_qwen2_vl_image_processor(model_dir), tokenizer=tokenizer,
                                         chat_template=_chat_template(model_dir, tokenizer))
    log.info("unsloth_jax: %s: built the %s processor without its video half (no torchvision)", model_dir, name)
    return processor


__all__ = ["image_only_processor", "folder_model_type", "IMAGE_ONLY_TYPES"]
