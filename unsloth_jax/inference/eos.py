"""The end-of-sequence ids of a model: generation_config.json's eos_token_id when its directory has one, else
config.json's."""
from __future__ import annotations

import json
from pathlib import Path


def generation_config(model) -> dict:
    """The model directory's generation_config.json as a dict ({} when there is none or it does not parse)."""
    model_dir = getattr(model, "model_dir", None)
    if model_dir:
        path = Path(model_dir) / "generation_config.json"
        if path.is_file():
            try:
                return json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                return {}
    return {}


def default_eos_ids(model) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json's eos_token_id when the model directory has one, else
    config.json's."""
    return id_tuple(generation_config(model).get("eos_token_id", model.config.eos_token_id))


def id_tuple(raw) -> tuple[int, ...]:
    """None, an int or a list of ints -> a tuple of ints."""
    if raw is None:
        return ()
    return tuple(int(t) for t in raw) if isinstance(raw, (list, tuple)) else (int(raw),)


__all__ = ["generation_config", "default_eos_ids", "id_tuple"]
