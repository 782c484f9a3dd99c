"""User API: `FastLanguageModel` (the names Unsloth users type) and the `Model` object it returns."""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from unsloth_jax.config import ModelConfig
from unsloth_jax.errors import CheckpointNotFoundError, ConfigError
from unsloth_jax.hf.loading import load_params
from unsloth_jax.models import decoder

log = logging.getLogger("unsloth_jax")

_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_DTYPES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float16": jnp.float16, "fp16": jnp.float16,
           "float32": jnp.float32, "fp32": jnp.float32}


def is_bfloat16_supported() -> bool:
    """True on GPUs of compute capability 8.0 or newer (and TPUs); False on the CPU."""
    dev = jax.devices()[0]
    if dev.platform == "tpu":
        return True
    if dev.platform != "gpu":
        return False
    cc = getattr(dev, "compute_capability", None)
    try:
        return cc is None or float(cc) >= 8.0
    except (TypeError, ValueError):
        return True


def resolve_dtype(dtype) -> jnp.dtype:
    """None -> bf16 where supported else fp32; accepts names ("bfloat16", "float16", "float32") and jnp dtypes."""
    if dtype is None:
        return jnp.dtype(jnp.bfloat16 if is_bfloat16_supported() else jnp.float32)
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ConfigError(f"dtype {dtype!r} is not supported; use one of {', '.join(sorted(_DTYPES))} or None")
        return jnp.dtype(_DTYPES[dtype])
    dt = jnp.dtype(dtype)
    if dt not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        raise ConfigError(f"dtype {dt} is not supported; use bfloat16, float16 or float32")
    return dt


def device_memory_gib() -> float | None:
    """Bytes in use on the first device, in GiB (None where the backend does not report it)."""
    stats = jax.devices()[0].memory_stats() or {}
    used = stats.get("bytes_in_use")
    return None if used is None else used / 2**30


@dataclasses.dataclass
class LoraSettings:
    """The LoRA configuration of a model (as PEFT's LoraConfig names it)."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    lora_dropout: float = 0.0
    bias: str = "none"
    use_rslora: bool = False
    modules_to_save: tuple[str, ...] | None = None

    @property
    def scale(self) -> float:
        return self.lora_alpha / (self.r ** 0.5 if self.use_rslora else self.r)


class Model:
    """A loaded decoder: `config`, `params` (a plain nested dict of jax arrays, layers stacked on axis 0), the
    compute `dtype`, and after `get_peft_model` the `lora` settings. Call it for logits."""

    def __init__(self, config: ModelConfig, params: dict, dtype, model_dir: str | None = None,
                 max_seq_length: int = 2048, lora: LoraSettings | None = None):
        self.config = config
        self.params = params
        self.dtype = jnp.dtype(dtype)
        self.model_dir = model_dir
        self.max_seq_length = max_seq_length
        self.lora = lora
        self.gradient_checkpointing: str = "none"
        self.training = True

    @property
    def lora_scale(self) -> float | None:
        return None if self.lora is None else self.lora.scale

    @property
    def is_trainable(self):
        """The rule (param path -> bool) that lora.split uses for this model."""
        from unsloth_jax import lora

        if self.lora is None:
            return lora.is_lora_leaf
        return lora.make_is_trainable(self.lora.modules_to_save or (), self.lora.bias, self.lora.target_modules)

    def __call__(self, input_ids, attention_mask=None, positions=None, segment_ids=None) -> jax.Array:
        """Logits [batch, seq, vocab] (float32) for input_ids [batch, seq]."""
        input_ids = jnp.asarray(input_ids, jnp.int32)
        if input_ids.ndim == 1:
            input_ids = input_ids[None]
        if attention_mask is not None:
            attention_mask = jnp.asarray(attention_mask, jnp.int32).reshape(input_ids.shape)
        return decoder.forward(self.params, self.config, input_ids, attention_mask, positions, segment_ids,
                               lora_scale=self.lora_scale)

    # ---- export (implemented in unsloth_jax.hf.export / gguf_export) ----
    def save_pretrained(self, save_directory, **kwargs) -> None:
        """Write a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)."""
        from unsloth_jax.hf import export

        export.save_adapter(self, save_directory, **kwargs)

    def save_pretrained_merged(self, save_directory, tokenizer=None, save_method: str = "merged_16bit",
                               max_shard_size="5GB", **kwargs) -> None:
        """Write the merged model (W + scale * A @ B) as a 16-bit HF checkpoint, or just the adapter ("lora")."""
        from unsloth_jax.hf import export

        export.save_merged(self, save_directory, tokenizer, save_method=save_method, max_shard_size=max_shard_size,
                           **kwargs)

    def save_pretrained_gguf(self, save_directory, tokenizer, quantization_method: str = "f16") -> str:
        """Write a llama.cpp GGUF file of the merged model; returns its path."""
        from unsloth_jax.hf import gguf_export

        return gguf_export.save_gguf(self, save_directory, tokenizer, quantization_method=quantization_method)

    def generate(self, input_ids, attention_mask=None, **kwargs):
        """Sample or greedy-decode continuations with a KV cache (see unsloth_jax.generation.generate)."""
        from unsloth_jax.generation import generate

        return generate(self, input_ids, attention_mask=attention_mask, **kwargs)

    def __repr__(self) -> str:
        c = self.config
        lora = f", lora r={self.lora.r}" if self.lora else ""
        return (f"Model({c.model_type}, layers={c.num_hidden_layers}, hidden={c.hidden_size}, "
                f"vocab={c.vocab_size}, dtype={self.dtype.name}{lora})")


def _bnb_4bit_checkpoint(model_dir: Path) -> bool:
    """True when config.json says the weights were saved pre-quantized by bitsandbytes in NF4."""
    import json

    qc = json.loads((model_dir / "config.json").read_text()).get("quantization_config") or {}
    if qc.get("quant_method") != "bitsandbytes":
        if qc:
            raise ConfigError(f"{model_dir}/config.json: quantization method {qc.get('quant_method')!r} is not "
                              "supported (only bitsandbytes NF4 4-bit checkpoints are)")
        return False
    if qc.get("load_in_8bit") or qc.get("_load_in_8bit"):
        raise ConfigError(f"{model_dir}/config.json: bitsandbytes 8-bit checkpoints are not supported; "
                          "use the 16-bit model with load_in_4bit=True, or a 4-bit NF4 checkpoint")
    if qc.get("bnb_4bit_quant_type", "nf4") != "nf4":
        raise ConfigError(f"{model_dir}/config.json: bnb_4bit_quant_type {qc.get('bnb_4bit_quant_type')!r} is not "
                          "supported (only nf4)")
    return True


def _load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as e:
        log.warning("unsloth_jax: no usable tokenizer in %s (%s); returning None", model_dir, e)
        return None


class FastLanguageModel:
    """Unsloth's entry points, for JAX."""

    @staticmethod
    def from_pretrained(model_name: str | os.PathLike, max_seq_length: int = 2048, dtype=None,
                        load_in_4bit: bool = False, *, load_tokenizer: bool = True, progress: bool = True,
                        **kwargs):
        """Load a local Hugging Face model directory. Returns (model, tokenizer).

        dtype: None (bf16 where supported, else fp32), "bfloat16", "float16", "float32" or a jnp dtype.
        """
        for key in kwargs:
            if key not in ("token", "device_map", "trust_remote_code", "fix_tokenizer", "rope_scaling"):
                raise TypeError(f"from_pretrained() got an unexpected keyword argument {key!r}")
        model_dir = Path(model_name)
        from unsloth_jax.hf import peft_io

        if model_dir.is_dir() and peft_io.is_adapter_dir(model_dir):
            base = peft_io.base_model_path(model_dir)
            model, tokenizer = FastLanguageModel.from_pretrained(
                base, max_seq_length, dtype, load_in_4bit, load_tokenizer=False, progress=progress, **kwargs)
            model = peft_io.load_adapter(model, model_dir)
            tokenizer = (_load_tokenizer(model_dir) if (model_dir / "tokenizer_config.json").is_file()
                         else _load_tokenizer(Path(base))) if load_tokenizer else None
            return model, tokenizer
        if not model_dir.is_dir():
            raise CheckpointNotFoundError(
                f"model directory not found: {model_dir} (unsloth_jax loads local Hugging Face directories; "
                "download the model first, e.g. with `huggingface-cli download`)")
        cfg = ModelConfig.from_pretrained(model_dir)
        compute_dtype = resolve_dtype(dtype)
        start = time.perf_counter()
        placer = None
        prequantized = _bnb_4bit_checkpoint(model_dir)
        if load_in_4bit and not prequantized:
            from unsloth_jax.quant import nf4_placer

            placer = nf4_placer
        load_in_4bit = load_in_4bit or prequantized
        params = load_params(model_dir, cfg, compute_dtype, placer=placer, progress=progress, bnb_4bit=prequantized)
        jax.block_until_ready(params)
        seconds = time.perf_counter() - start
        model = Model(cfg, params, compute_dtype, str(model_dir), max_seq_length)
        tokenizer = _load_tokenizer(model_dir) if load_tokenizer else None
        mem = device_memory_gib()
        log.info("unsloth_jax: loaded %s (%s, %d layers) in %.1fs as %s%s on %s%s", model_dir.name, cfg.model_type,
                 cfg.num_hidden_layers, seconds, compute_dtype.name, " + NF4 4-bit" if load_in_4bit else "",
                 jax.devices()[0].platform, f", {mem:.2f} GiB in use" if mem is not None else "")
        return model, tokenizer

    @staticmethod
    def get_peft_model(model: Model, r: int = 16, target_modules=_DEFAULT_TARGETS, lora_alpha: float = 16,
                        lora_dropout: float = 0.0, bias: str = "none", use_gradient_checkpointing="unsloth",
                        random_state: int = 3407, use_rslora: bool = False, modules_to_save=None, loftq_config=None,
                        max_seq_length: int | None = None, **kwargs) -> Model:
        from unsloth_jax import lora
        from unsloth_jax.train.step import resolve_remat

        if kwargs:
            raise TypeError(f"get_peft_model() got unexpected keyword argument(s): {', '.join(kwargs)}")
        if loftq_config:
            raise NotImplementedError("loftq_config is not supported")
        if lora_dropout:
            log.warning("unsloth_jax: lora_dropout=%s is accepted for compatibility but not applied "
                        "(dropout 0 is what Unsloth recommends and what the fast path uses)", lora_dropout)
        targets = (target_modules,) if isinstance(target_modules, str) else tuple(target_modules)
        saved = tuple(modules_to_save) if modules_to_save else None
        settings = LoraSettings(r=r, lora_alpha=lora_alpha, target_modules=targets, lora_dropout=lora_dropout,
                                bias=bias, use_rslora=use_rslora, modules_to_save=saved)
        lora.make_is_trainable(saved or (), bias, targets)  # validates bias
        # LoRA factors are float32 master weights (tiny); matmuls cast them to the compute dtype.
        model.params = lora.add_lora(model.params, targets, r, jax.random.PRNGKey(random_state), dtype=jnp.float32)
        model.lora = settings
        model.gradient_checkpointing = resolve_remat(use_gradient_checkpointing)
        if max_seq_length:
            model.max_seq_length = max_seq_length
        trainable, frozen = lora.split(model.params, model.is_trainable)
        n_train, n_all = lora.count(trainable), lora.count(model.params)
        print(f"trainable params: {n_train:,d} || all params: {n_all:,d} || trainable%: {100 * n_train / n_all:.4f}")
        return model

    @staticmethod
    def for_inference(model: Model) -> Model:
        model.training = False
        return model

    @staticmethod
    def for_training(model: Model, use_gradient_checkpointing=True) -> Model:
        model.training = True
        return model
