"""Exception types users can catch. Each message names the file, key or line at fault and what to do."""
from __future__ import annotations


class UnslothJaxError(Exception):
    """Base class of every error raised on purpose by unsloth_jax."""


class CheckpointNotFoundError(UnslothJaxError, FileNotFoundError):
    """A model directory, config.json or weight file is missing."""


class CorruptCheckpointError(UnslothJaxError, ValueError):
    """A safetensors file or index cannot be parsed (bad header, truncated data, bad JSON)."""


class UnsupportedArchitectureError(UnslothJaxError, ValueError):
    """config.json names a model_type this package does not implement."""


class MissingTensorError(UnslothJaxError, KeyError):
    """A tensor the model needs is absent from the checkpoint."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class UnexpectedTensorError(UnslothJaxError, ValueError):
    """The checkpoint holds tensors the model does not know."""


class ShapeMismatchError(UnslothJaxError, ValueError):
    """A tensor's shape (or dtype) differs from what the config implies."""


class ConfigError(UnslothJaxError, ValueError):
    """A config.json field is missing or has a value this package cannot use."""


class DatasetFormatError(UnslothJaxError, ValueError):
    """A dataset file or record is malformed (bad JSON, missing field); names file and line."""


class TrainingError(UnslothJaxError, RuntimeError):
    """Training cannot continue (for example, repeated non-finite losses)."""
