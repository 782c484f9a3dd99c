"""User API: `FastLanguageModel` (the names Unsloth users type) and `Model`, the NNX module it returns.

`Model` is the decoder (`unsloth_jax.models.CausalLM`, an `nnx.Module`) with Unsloth's methods on it:
`save_pretrained` (PEFT adapter; after full fine-tuning, the whole model), `save_pretrained_merged`,
`save_pretrained_gguf`, `generate`. Calling it gives logits; `nnx.split(model, nnx.LoRAParam, ...)` gives the
trainable LoRA state and the frozen rest (`unsloth_jax.lora.split(model)` picks the model's own filter: every
nnx.Param in full fine-tuning).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from unsloth_jax import lora as lora_lib
from unsloth_jax.backend import device_memory_gib, is_bfloat16_supported, resolve_dtype
from unsloth_jax.config import ModelConfig
from unsloth_jax.errors import CheckpointNotFoundError, ConfigError
from unsloth_jax.families import family_of, read_text_config, vision_family_for
from unsloth_jax.hf.loading import load_model
from unsloth_jax.models.decoder import PROJ_PARENT, CausalLM
from unsloth_jax.models.layer_stack import NO_REMAT
from unsloth_jax.validation import require_bool, require_choice, require_int, require_real

log = logging.getLogger("unsloth_jax")

_DEFAULT_TARGETS = lora_lib.ALL_TARGETS
_FROM_PRETRAINED_IGNORED = ("token", "device_map", "trust_remote_code", "fix_tokenizer", "rope_scaling",
                            # Unsloth's vLLM switches: the generation engine is always on and takes any rank
                            "fast_inference", "max_lora_rank")
# config.json fields from_pretrained(**kwargs) may override, as transformers' from_pretrained does (MoE families).
_CONFIG_OVERRIDES = {"output_router_logits": bool, "router_aux_loss_coef": float}


class _PeftMethods:
    """PEFT's and Unsloth's methods every loaded model class has (Model, VisionLanguageModel); each class brings its
    own save_pretrained / save_pretrained_merged, which the push_to_hub* methods upload."""

    def trainable_filter(self):
        """The nnx filter of the variables that train (see unsloth_jax.lora.trainable_filter)."""
        return lora_lib.trainable_filter(self.lora, self.full_finetuning)

    def print_trainable_parameters(self) -> None:
        """PEFT's line: trainable params: N || all params: M || trainable%: X."""
        _print_trainable(self)

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        """PEFT's (trainable parameters, all parameters)."""
        return _trainable_counts(self)

    def push_to_hub(self, repo_id: str, tokenizer=None, *, token=None, private=None,
                    commit_message: str | None = None, **kwargs) -> str:
        """save_pretrained (the adapter; after full fine-tuning, the model; with the tokenizer or processor when
        given) into a temporary directory, uploaded to the Hub repository repo_id (created if needed) with
        huggingface_hub; returns the repository's URL."""
        return _push_to_hub(lambda d: self.save_pretrained(d, tokenizer=tokenizer, **kwargs), repo_id, token,
                            private, commit_message, "save_pretrained")

    def push_to_hub_merged(self, repo_id: str, tokenizer=None, save_method: str = "merged_16bit", *, token=None,
                           private=None, commit_message: str | None = None, **kwargs) -> str:
        """save_pretrained_merged into a temporary directory, uploaded to the Hub repository repo_id."""
        return _push_to_hub(lambda d: self.save_pretrained_merged(d, tokenizer, save_method=save_method, **kwargs),
                            repo_id, token, private, commit_message, "save_pretrained_merged")


class Model(_PeftMethods, CausalLM):
    """A loaded decoder with Unsloth's methods. Besides CausalLM's `config`, `dtype`, `lora` and `model_dir`:
    `max_seq_length`, `gradient_checkpointing` (the layer-stack policy get_peft_model chose, an
    unsloth_jax.models.layer_stack.LayerStackPolicy that prints as, and compares equal to, its remat mode: "none",
    "full", "offload", "offload_attention", "save_attention", or with layers_per_checkpoint=K "full_every_K" /
    "offload_every_K"; the trainers pass it to their steps)."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=None, rngs: nnx.Rngs):
        super().__init__(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.max_seq_length = 2048
        self.gradient_checkpointing = NO_REMAT
        self.gpu_memory_utilization: float | None = None  # the generation engine's KV pool cap (from_pretrained)

    # ---- export (implemented in unsloth_jax.hf.export / gguf_export) ----
    def save_pretrained(self, save_directory, **kwargs) -> str:
        """Write a PEFT adapter directory (adapter_config.json + adapter_model.safetensors; kwargs: tokenizer, also
        written there); after full fine-tuning, the whole model as a transformers checkpoint in its own dtype
        (hf.export.save_full; kwargs: tokenizer, max_shard_size). A GGUF-loaded model's adapter directory also
        gets the base and tokenizer that transformers and PEFT need (hf.export.save_adapter). Returns the
        directory's path."""
        from unsloth_jax.hf import export

        if self.full_finetuning:
            return export.save_full(self, save_directory, **kwargs)
        return export.save_adapter(self, save_directory, **kwargs)

    def save_pretrained_merged(self, save_directory, tokenizer=None, save_method: str = "merged_16bit",
                               max_shard_size="5GB", **kwargs) -> str:
        """Write the merged model (W + scale * A @ B) as a 16-bit HF checkpoint, or just the adapter ("lora");
        returns the directory's path."""
        from unsloth_jax.hf import export

        return export.save_merged(self, save_directory, tokenizer, save_method=save_method, max_shard_size=max_shard_size,
                           **kwargs)

    def save_pretrained_gguf(self, save_directory, tokenizer=None, quantization_method="f16"):
        """Write a llama.cpp GGUF file of the merged model and return its path; quantization_method may be a list
        (as Unsloth's), one file per method, and then the paths come back as a list."""
        from unsloth_jax.hf import gguf_export

        methods = _gguf_methods(quantization_method)
        paths = [gguf_export.save_gguf(self, save_directory, tokenizer, quantization_method=m) for m in methods]
        return paths if isinstance(quantization_method, (list, tuple)) else paths[0]

    def push_to_hub_gguf(self, repo_id: str, tokenizer=None, quantization_method="f16", *, token=None,
                         private=None, commit_message: str | None = None) -> str:
        """save_pretrained_gguf into a temporary directory, uploaded to the Hub repository repo_id (created if
        needed); returns the repository's URL."""
        return _push_to_hub(lambda d: self.save_pretrained_gguf(d, tokenizer, quantization_method), repo_id, token,
                            private, commit_message, "save_pretrained_gguf")

    def save_lora(self, save_directory) -> str:
        """Unsloth's name (its GRPO notebooks) for save_pretrained: the PEFT adapter directory (its path returned)."""
        if not self.lora:
            raise ValueError("save_lora: the model has no LoRA adapters (add them with FastLanguageModel."
                             "get_peft_model, or use save_pretrained)")
        return self.save_pretrained(save_directory)

    def load_lora(self, lora_path, load_tensors: bool = True) -> "LoRARequest":
        """A saved adapter as vLLM's LoRARequest (Unsloth's name), for fast_generate(..., lora_request=...): a twin
        of this model that shares its base weights and holds the adapter's LoRA, so the model's own LoRA weights
        are left as they are. load_tensors is accepted for compatibility."""
        from unsloth_jax.hf import peft_io

        lora_path = Path(lora_path)
        if not peft_io.is_adapter_dir(lora_path):
            raise CheckpointNotFoundError(f"load_lora: {lora_path} is not a PEFT adapter directory (no "
                                          "adapter_config.json); write one with model.save_lora(path)")
        graphdef, state = nnx.split(self)
        twin = nnx.merge(graphdef, state)  # new modules, the same (immutable) arrays
        twin = peft_io.load_adapter(twin, lora_path)  # replaces the twin's LoRA pairs (hf.peft_io, lora.add_lora)
        _LORA_IDS.append(str(lora_path))
        return LoRARequest(lora_name=lora_path.name, lora_int_id=len(_LORA_IDS), lora_path=str(lora_path),
                           model=twin)

    def generate(self, input_ids=None, attention_mask=None, **kwargs):
        """Sample or greedy-decode continuations with a KV cache, with transformers' arguments (max_new_tokens,
        max_length, do_sample, temperature, top_k, top_p, min_p, repetition_penalty, num_return_sequences,
        generation_config, use_cache, eos_token_id, pad_token_id, streamer; see unsloth_jax.generation.generate).
        input_ids may be the tokenizer's output mapping (as input_ids=, or **inputs)."""
        from unsloth_jax.generation import generate

        return generate(self, input_ids, attention_mask=attention_mask, **kwargs)

    def fast_generate(self, prompts, sampling_params=None, *, lora_request=None, **kwargs):
        """vLLM's generate (Unsloth's fast_inference name): prompts -> RequestOutputs, on the generation engine
        (see unsloth_jax.generation.fast_generate; kwargs: tokenizer, use_tqdm). lora_request: None (the model's
        own weights, LoRA included) or model.load_lora(path) (that adapter's weights instead)."""
        from unsloth_jax.generation import fast_generate

        return fast_generate(self, prompts, sampling_params, lora_request=lora_request, **kwargs)

    def __repr__(self) -> str:
        c = self.config
        lora = f", lora r={self.lora.r}" if self.lora else ", full fine-tuning" if self.full_finetuning else ""
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


def _with_overrides(cfg: ModelConfig, kwargs: dict) -> ModelConfig:
    """cfg with the from_pretrained config overrides in kwargs applied (validated; MoE families only)."""
    import dataclasses

    given = {k: v for k, v in kwargs.items() if k in _CONFIG_OVERRIDES}
    if not given:
        return cfg
    if not cfg.is_moe:
        raise TypeError(f"from_pretrained(): {', '.join(given)} apply to mixture-of-experts models only, not "
                        f"{cfg.model_type}")
    if "output_router_logits" in given:
        given["output_router_logits"] = require_bool("output_router_logits", given["output_router_logits"])
        if given["output_router_logits"] and cfg.router == "sigmoid_group":  # GLM-4.5 MoE
            raise ConfigError(f"from_pretrained(): output_router_logits=True adds the softmax load-balancing loss, "
                              f"which {cfg.model_type} (sigmoid router balanced by its e_score_correction_bias) "
                              "does not train with, as in transformers")
    if "router_aux_loss_coef" in given:
        given["router_aux_loss_coef"] = float(require_real("router_aux_loss_coef", given["router_aux_loss_coef"],
                                                           minimum=0))
    return dataclasses.replace(cfg, **given)


def _check_full_finetuning(full_finetuning, load_in_4bit, load_in_fp8, kwargs: dict, model_name) -> bool:
    """full_finetuning as a bool; ConfigError when it is asked for together with a quantized base."""
    full_finetuning = require_bool("full_finetuning", full_finetuning)
    if full_finetuning:
        quantized = [k for k, v in (("load_in_4bit", load_in_4bit), ("load_in_8bit", kwargs.get("load_in_8bit")),
                                    ("load_in_fp8", load_in_fp8)) if v]
        if quantized:
            raise ConfigError(f"from_pretrained({str(model_name)!r}): full_finetuning=True trains every weight, which "
                              f"needs the dense 16/32-bit model, but {' and '.join(quantized)}=True asks for a "
                              "quantized base; drop it (or train LoRA / QLoRA with get_peft_model instead)")
    return full_finetuning


def _setup_full_finetuning(model: Model, gradient_checkpointing) -> None:
    """Mark every weight of a freshly loaded model trainable and set its layer-stack policy (from_pretrained's
    use_gradient_checkpointing and layers_per_checkpoint, resolved before loading)."""
    lora_lib.enable_full_finetuning(model)
    model.gradient_checkpointing = gradient_checkpointing
    weights = {str(v.dtype) for v in jax.tree.leaves(nnx.state(model, nnx.Param))}
    print(f"unsloth_jax: full fine-tuning: {lora_lib.count(model):,d} trainable parameters in "
          f"{'/'.join(sorted(weights))}; AdamW moments in float32 (8-bit with optim='adamw_8bit')")


def _saved_modules(model: CausalLM, modules_to_save) -> tuple[str, ...] | None:
    """get_peft_model's modules_to_save as a tuple. After add_new_tokens, embed_tokens and lm_head are added
    (as Unsloth does: the new rows must train). With tied embeddings the output head is the embedding table, so
    "lm_head" names the embedding ("embed_tokens"), as PEFT's ensure_weight_tying does."""
    from unsloth_jax.hf.peft_io import SAVED_MODULE_KEYS

    if isinstance(modules_to_save, str):
        modules_to_save = [modules_to_save]
    saved = list(modules_to_save or ())
    if getattr(model, "need_to_train_embeddings", False) and not {"embed_tokens", "lm_head"} <= set(saved):
        print("unsloth_jax: new tokens were added, so embed_tokens and lm_head train too (modules_to_save)")
        saved += ["embed_tokens", "lm_head"]
    if not saved:
        return None
    unknown = [m for m in saved if m not in SAVED_MODULE_KEYS]
    if unknown:
        raise ValueError(f"modules_to_save {unknown} are not supported; choose from {', '.join(SAVED_MODULE_KEYS)}")
    if model.lm_head is None and "lm_head" in saved:
        log.info("unsloth_jax: the embeddings are tied, so modules_to_save 'lm_head' trains the embedding table "
                 "(embed_tokens)")
        saved = ["embed_tokens" if m == "lm_head" else m for m in saved]
    return tuple(dict.fromkeys(saved))


def _check_model_name(model_name) -> Path:
    if not isinstance(model_name, (str, os.PathLike)):
        raise TypeError(f"model_name must be a path to a local model directory, got {model_name!r}")
    return Path(model_name)


def _from_gguf(path: Path, max_seq_length: int, compute_dtype, load_in_4bit: bool, load_in_fp8: bool,
               load_tokenizer: bool, progress: bool):
    """(model, tokenizer) from a llama.cpp GGUF file (unsloth_jax.hf.gguf_loading): weights dequantized to
    compute_dtype (then NF4 with load_in_4bit, FP8 with load_in_fp8), config and tokenizer from its metadata."""
    from unsloth_jax import quant
    from unsloth_jax.hf import gguf_loading

    start = time.perf_counter()
    placer = quant.nf4_placer if load_in_4bit else quant.fp8_placer if load_in_fp8 else None
    model = gguf_loading.load_gguf_model(path, compute_dtype, model_class=Model, placer=placer, progress=progress)
    jax.block_until_ready(nnx.state(model))
    model.max_seq_length = max_seq_length
    tokenizer = gguf_loading.gguf_tokenizer(path) if load_tokenizer else None
    if tokenizer is not None:  # fast_generate's text prompts: the model's path is the file, no tokenizer beside it
        from unsloth_jax import generation

        generation.set_default_tokenizer(model, tokenizer)
    cfg = model.config
    log.info("unsloth_jax: loaded %s (GGUF, %s, %d layers) in %.1fs as %s%s", path.name, cfg.model_type,
             cfg.num_hidden_layers, time.perf_counter() - start, compute_dtype.name,
             " + NF4 4-bit" if load_in_4bit else " + FP8 e4m3" if load_in_fp8 else "")
    return model, tokenizer


class LoRARequest:
    """vLLM's LoRARequest (lora_name, lora_int_id, lora_path), as Model.load_lora returns it; `model` is the twin
    holding the adapter that fast_generate generates with."""

    def __init__(self, lora_name: str, lora_int_id: int, lora_path: str, model=None):
        self.lora_name, self.lora_int_id, self.lora_path, self.model = lora_name, lora_int_id, lora_path, model

    def __repr__(self) -> str:
        return f"LoRARequest(lora_name={self.lora_name!r}, lora_int_id={self.lora_int_id}, lora_path={self.lora_path!r})"


_LORA_IDS: list[str] = []  # the adapters load_lora has read, in order (lora_int_id = position + 1)


def _gguf_methods(quantization_method) -> list[str]:
    """save_pretrained_gguf's quantization_method (a name, or a list of names as Unsloth's) as a list."""
    if isinstance(quantization_method, str):
        return [quantization_method]
    if not isinstance(quantization_method, (list, tuple)) or not quantization_method:
        raise TypeError(f"quantization_method must be a name such as 'q8_0' or a non-empty list of names, got "
                        f"{quantization_method!r}")
    bad = [m for m in quantization_method if not isinstance(m, str)]
    if bad:
        raise TypeError(f"quantization_method: every entry must be a name such as 'q8_0', got {bad!r}")
    return list(dict.fromkeys(quantization_method))


def _trainable_counts(model) -> tuple[int, int]:
    _, trainable, _ = lora_lib.split(model)
    return lora_lib.count(trainable), lora_lib.count(model)


def _print_trainable(model) -> None:
    n_train, n_all = _trainable_counts(model)
    print(f"trainable params: {n_train:,d} || all params: {n_all:,d} || trainable%: {100 * n_train / n_all:.4f}")


def _push_to_hub(save, repo_id: str, token, private, commit_message, save_name: str) -> str:
    """save(dir) into a temporary directory, then huggingface_hub's create_repo (exist_ok) and upload_folder to
    repo_id; ConnectionError naming repo_id when the Hub cannot be reached."""
    import tempfile

    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, HTTPError

    if not isinstance(repo_id, str) or not repo_id.strip():
        raise TypeError(f"repo_id must be a Hub repository name such as 'user/my-model', got {repo_id!r}")
    with tempfile.TemporaryDirectory(prefix="unsloth-jax-push-") as folder:
        save(folder)
        api = HfApi(token=token)
        try:
            url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
            api.upload_folder(repo_id=repo_id, folder_path=folder, repo_type="model",
                              commit_message=commit_message or f"Upload with unsloth_jax ({save_name})")
        except (ConnectionError, HTTPError) as e:
            if isinstance(e, HfHubHTTPError):  # the Hub answered (authentication, permissions, ...)
                raise
            raise ConnectionError(f"push to the Hugging Face Hub repository {repo_id!r} failed: the Hub cannot be "
                                  f"reached ({type(e).__name__}: {e}). Save locally with model.{save_name}(dir) "
                                  f"and upload that directory later (`hf upload {repo_id} dir`)") from e
    return str(url)


class FastLanguageModel:
    """Unsloth's entry points, for JAX."""

    @staticmethod
    def from_pretrained(model_name: str | os.PathLike, max_seq_length: int = 2048, dtype=None,
                        load_in_4bit: bool = False, *, load_in_fp8: bool = False, full_finetuning: bool = False,
                        use_gradient_checkpointing="unsloth", layers_per_checkpoint: int = 1,
                        load_tokenizer: bool = True, progress: bool = True, **kwargs):
        """Load a local Hugging Face model directory, a PEFT adapter directory, or a llama.cpp GGUF file (or a
        directory holding exactly one .gguf and no config.json). Returns (model, tokenizer).

        dtype: None (bf16 where supported, else fp32), "bfloat16", "float16", "float32" or a jnp dtype.
        load_in_4bit: frozen projections in NF4 (QLoRA); load_in_fp8: frozen projections in FP8 (e4m3 with
        per-output-channel scales; FP8 GEMMs on Hopper GPUs, emulated elsewhere).
        full_finetuning=True: every weight trains (no LoRA; get_peft_model then has no effect), the weights in
        `dtype` and AdamW's moments in float32 (or 8-bit with optim="adamw_8bit"); use_gradient_checkpointing
        (False / True / "unsloth" ...) and layers_per_checkpoint (see get_peft_model) are its remat mode. A 4-bit
        or FP8 base, or a mixture-of-experts model, cannot be fully fine-tuned.
        MoE families also take transformers' config overrides output_router_logits=True (add
        router_aux_loss_coef * the load-balancing loss to the training loss) and router_aux_loss_coef.
        A vision-language checkpoint (e.g. Qwen3.5 as released, model_type "qwen3_5") loads whole, as
        FastVisionModel.from_pretrained does, with its tokenizer: it trains on text batches, and its saves load in
        transformers' model class of the checkpoint (_vision_checkpoint_as_text_model). Gemma 4 as released (model_type
        "gemma4", Gemma4ForConditionalGeneration) loads its text decoder only, the vision/audio towers left on disk;
        its adapters and merged checkpoints are for Gemma4ForConditionalGeneration (the towers copied through).
        """
        full_finetuning = _check_full_finetuning(full_finetuning, load_in_4bit, load_in_fp8, kwargs, model_name)
        gradient_checkpointing = None
        if full_finetuning:  # the remat arguments are read in full fine-tuning only (else get_peft_model's)
            from unsloth_jax.train.step import resolve_remat

            gradient_checkpointing = resolve_remat(use_gradient_checkpointing, layers_per_checkpoint)
        gpu_memory_utilization = kwargs.pop("gpu_memory_utilization", None)
        if gpu_memory_utilization is not None:
            gpu_memory_utilization = require_real("gpu_memory_utilization", gpu_memory_utilization, minimum=0,
                                                  min_exclusive=True, maximum=1)
        for key in kwargs:
            if key not in _FROM_PRETRAINED_IGNORED and key not in _CONFIG_OVERRIDES:
                raise TypeError(f"from_pretrained() got an unexpected keyword argument {key!r}")
        model_dir = _check_model_name(model_name)
        if _is_vision_checkpoint(model_dir):
            return _vision_checkpoint_as_text_model(model_dir, max_seq_length, dtype, load_in_4bit, load_in_fp8,
                                                    full_finetuning, load_tokenizer, progress, kwargs)
        max_seq_length = require_int("max_seq_length", max_seq_length, minimum=1)
        load_in_4bit = require_bool("load_in_4bit", load_in_4bit)
        load_in_fp8 = require_bool("load_in_fp8", load_in_fp8)
        if load_in_4bit and load_in_fp8:
            raise ValueError("load_in_4bit=True and load_in_fp8=True: pick one quantization of the base weights")
        compute_dtype = resolve_dtype(dtype)
        from unsloth_jax.hf import peft_io

        if model_dir.is_dir() and peft_io.is_adapter_dir(model_dir):
            if full_finetuning:
                raise ConfigError(f"{model_dir} is a PEFT adapter directory: full_finetuning=True needs a full "
                                  "model (merge the adapter first with save_pretrained_merged)")
            base = peft_io.base_model_path(model_dir)
            model, tokenizer = FastLanguageModel.from_pretrained(
                base, max_seq_length, dtype, load_in_4bit, load_in_fp8=load_in_fp8, load_tokenizer=False,
                progress=progress, **kwargs)
            model = peft_io.load_adapter(model, model_dir)
            model.gpu_memory_utilization = gpu_memory_utilization
            tokenizer = (_load_tokenizer(model_dir) if (model_dir / "tokenizer_config.json").is_file()
                         else _load_tokenizer(Path(base))) if load_tokenizer else None
            return model, tokenizer
        from unsloth_jax.hf import gguf_loading

        gguf_file = gguf_loading.find_gguf(model_dir)
        if gguf_file is not None:
            model, tokenizer = _from_gguf(gguf_file, max_seq_length, compute_dtype, load_in_4bit, load_in_fp8,
                                          load_tokenizer, progress)
            model.gpu_memory_utilization = gpu_memory_utilization
            if full_finetuning:
                _setup_full_finetuning(model, gradient_checkpointing)
            return model, tokenizer
        if not model_dir.is_dir():
            raise CheckpointNotFoundError(
                f"model directory not found: {model_dir} (unsloth_jax loads local Hugging Face directories; "
                "download the model first, e.g. with `huggingface-cli download`)")
        cfg = _with_overrides(read_text_config(model_dir), kwargs)
        if cfg.source_layout:
            from unsloth_jax.families import source_layout
            from unsloth_jax.hf.export import announce

            layout = source_layout(cfg)
            announce("unsloth_jax: %s is a %s checkpoint: loading its %s text decoder for text fine-tuning; the "
                     "tower tensors (%s) stay on disk, not loaded, and are copied into merged exports", model_dir.name,
                     layout.architecture, cfg.model_type, ", ".join(p.rstrip(".") + ".*" for p in layout.kept_prefixes))
        start = time.perf_counter()
        placer = None
        prequantized = _bnb_4bit_checkpoint(model_dir)
        if cfg.is_moe and (load_in_4bit or load_in_fp8 or prequantized):
            raise ConfigError(f"{model_dir}: quantized loading (4-bit / FP8) of {cfg.model_type} (mixture-of-experts) "
                              "is not supported; load it in 16 bits")
        if cfg.is_moe and full_finetuning:
            raise ConfigError(f"{model_dir}: full_finetuning=True is not supported for {cfg.model_type} "
                              "(mixture-of-experts): its router, expert and sink weights are frozen by design; "
                              "train LoRA with get_peft_model (target_parameters adapts the experts)")
        if full_finetuning and prequantized:
            raise ConfigError(f"{model_dir}/config.json: a bitsandbytes 4-bit checkpoint cannot be fully fine-tuned "
                              "(its weights are quantized); load the 16-bit model with full_finetuning=True")
        if prequantized and load_in_fp8:
            raise ConfigError(f"{model_dir} holds a bitsandbytes 4-bit checkpoint; load_in_fp8 needs 16-bit weights")
        if load_in_4bit and not prequantized:
            from unsloth_jax.quant import nf4_placer

            placer = nf4_placer
        elif load_in_fp8:
            from unsloth_jax.quant import fp8_placer

            placer = fp8_placer
        load_in_4bit = load_in_4bit or prequantized
        model = load_model(model_dir, cfg, compute_dtype, model_class=Model, placer=placer, progress=progress,
                           bnb_4bit=prequantized)
        jax.block_until_ready(nnx.state(model))
        model.max_seq_length = max_seq_length
        model.gpu_memory_utilization = gpu_memory_utilization
        if full_finetuning:
            _setup_full_finetuning(model, gradient_checkpointing)
        seconds = time.perf_counter() - start
        tokenizer = _load_tokenizer(model_dir) if load_tokenizer else None
        mem = device_memory_gib()
        log.info("unsloth_jax: loaded %s (%s, %d layers) in %.1fs as %s%s on %s%s", model_dir.name, cfg.model_type,
                 cfg.num_hidden_layers, seconds, compute_dtype.name,
                 " + NF4 4-bit" if load_in_4bit else " + FP8 e4m3" if load_in_fp8 else "",
                 jax.devices()[0].platform, f", {mem:.2f} GiB in use" if mem is not None else "")
        return model, tokenizer

    @staticmethod
    def get_peft_model(model: CausalLM, r: int = 16, target_modules=_DEFAULT_TARGETS, lora_alpha: float = 16,
                       lora_dropout: float = 0.0, bias: str = "none", use_gradient_checkpointing="unsloth",
                       random_state: int = 3407, use_rslora: bool = False, modules_to_save=None, loftq_config=None,
                       max_seq_length: int | None = None, target_parameters=None, layers_per_checkpoint: int = 1,
                       vision_target_modules=None, **kwargs):
        """Add LoRA adapters in place (nnx.LoRAParam lora_a / lora_b on each targeted projection) and return the
        model. target_modules may be PEFT's "all-linear" (the attention and dense MLP projections).
        target_parameters (MoE families, PEFT's name and form): expert weights to adapt, e.g.
        ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], one rank-r pair per expert.
        use_gradient_checkpointing: "unsloth" (each layer's input kept in pinned host memory on GPUs, on the
        device elsewhere, the layer recomputed in the backward pass), True (kept on the device), False (no
        recomputation), "offload_attention" (as "unsloth", and each layer's attention output and softmax
        statistics go to pinned host memory too, so the backward pass skips attention's forward: long
        sequences) or "save_attention" (also keep each layer's q, k, v and attention output); any of these
        (or "none", "full", "offload") may carry layer-stack settings after commas, "offload,layer_loop=unrolled",
        or be an unsloth_jax.models.layer_stack.LayerStackPolicy. It is parsed here, once, into
        model.gradient_checkpointing (a LayerStackPolicy).
        layers_per_checkpoint (an unsloth_jax extension, for sequences whose L layer inputs do not fit in host
        or device memory): with "unsloth" or True, keep only every layers_per_checkpoint-th layer input across
        the stack (rounded up to whole groups of alternating layer kinds: Gemma 2: 2, Gemma 3: 6) and recompute
        one group at a time in the backward pass: L / K + K layer inputs kept instead of L, for one more
        forward pass of the layers. 1 (default): per-layer checkpointing.
        vision_target_modules (vision-language models; FastVisionModel.get_peft_model sets it from
        finetune_vision_layers): the vision tower's Linears to adapt (q_proj, k_proj, v_proj, out_proj, fc1, fc2);
        target_modules may then be empty (no language LoRA)."""
        if kwargs:
            raise TypeError(f"get_peft_model() got unexpected keyword argument(s): {', '.join(kwargs)}")
        if not isinstance(model, CausalLM):
            raise TypeError(f"get_peft_model needs a model from FastLanguageModel.from_pretrained, got "
                            f"{type(model).__name__}")
        if model.full_finetuning:  # as Unsloth: every weight already trains
            print("unsloth_jax: full fine-tuning is enabled, so get_peft_model has no effect")
            return model
        if loftq_config:
            raise NotImplementedError("loftq_config is not supported")
        from unsloth_jax.train.step import resolve_remat

        gradient_checkpointing = resolve_remat(use_gradient_checkpointing, layers_per_checkpoint)
        r = require_int("r", r, minimum=1)
        lora_alpha = require_real("lora_alpha", lora_alpha, minimum=0, min_exclusive=True)
        lora_dropout = require_real("lora_dropout", lora_dropout, minimum=0, maximum=1, max_exclusive=True)
        require_choice("bias", bias, lora_lib.BIAS_MODES)
        random_state = require_int("random_state", random_state)
        use_rslora = require_bool("use_rslora", use_rslora)
        if max_seq_length is not None:
            max_seq_length = require_int("max_seq_length", max_seq_length, minimum=1)
        vision_targets = tuple(vision_target_modules or ())
        language = target_modules or not (target_parameters or vision_targets)  # empty only beside other targets
        targets = lora_lib.expand_targets(target_modules) if language else ()
        saved = _saved_modules(model, modules_to_save)
        if lora_dropout:
            log.warning("unsloth_jax: lora_dropout=%s is accepted for compatibility but not applied "
                        "(dropout 0 is what Unsloth recommends and what the fast path uses)", lora_dropout)
        expert_targets = lora_lib.expand_target_parameters(target_parameters, model)
        if expert_targets and lora_dropout:
            raise ValueError("lora_dropout must be 0 with target_parameters (PEFT's ParamWrapper cannot apply "
                             "dropout to a LoRA folded into an expert weight)")
        settings = lora_lib.LoraSettings(r=r, lora_alpha=lora_alpha, target_modules=targets,
                                         lora_dropout=lora_dropout, bias=bias, use_rslora=use_rslora,
                                         modules_to_save=saved, target_parameters=expert_targets or None,
                                         vision_target_modules=vision_targets or None)
        lora_lib.add_lora(model, settings, jax.random.PRNGKey(random_state))
        if isinstance(model, (Model, VisionLanguageModel)):
            model.gradient_checkpointing = gradient_checkpointing
            if max_seq_length:
                model.max_seq_length = max_seq_length
        _print_trainable(model)
        return model

    @staticmethod
    def for_inference(model: Model) -> Model:
        """Unsloth's switch to inference, kept for its users: returns `model` unchanged (generate and
        fast_generate need no switch, and nothing here behaves differently in training)."""
        return model

    @staticmethod
    def for_training(model: Model, use_gradient_checkpointing=True) -> Model:
        """Unsloth's switch back to training, kept for its users: returns `model` unchanged.
        use_gradient_checkpointing is accepted for compatibility and ignored: the remat mode stays the one
        get_peft_model (or from_pretrained, with full fine-tuning) set, `model.gradient_checkpointing`."""
        return model


def _given(**kwargs) -> dict:
    """kwargs without the None values."""
    return {k: v for k, v in kwargs.items() if v is not None}


class VisionLanguageModel(_PeftMethods):
    """A loaded vision-language model (FastVisionModel.from_pretrained) of any family (unsloth_jax.families:
    Gemma 3, Qwen2.5-VL): the family's NNX module class (models.vision / models.vision_qwen2_5) with this class
    mixed in before it (`loaded_vision_class`), adding `max_seq_length` and `gradient_checkpointing` (as `Model`).
    Calling it takes input_ids, attention_mask, pixel_values and the family's image fields (Gemma 3:
    token_type_ids; Qwen2.5-VL: image_grid_thw) and gives logits [B, S, V] float32. SFTTrainer trains it with
    data_collator=UnslothVisionDataCollator(model, processor) (docs/VISION.md); save_pretrained /
    save_pretrained_merged write a PEFT adapter / a merged 16-bit checkpoint for transformers (hf.vision_export);
    generate and fast_generate continue prompts with images."""

    def __init__(self, cfg, *, dtype=jnp.float32, param_dtype=None, rngs: nnx.Rngs):
        super().__init__(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.max_seq_length = 2048
        self.gradient_checkpointing = NO_REMAT

    def save_pretrained(self, save_directory, tokenizer=None, **kwargs) -> str:
        """Write the PEFT adapter (language and vision LoRA pairs) that PEFT loads onto transformers' model class
        of the family, with the processor or tokenizer when given; returns the directory's path."""
        from unsloth_jax.hf.vision_export import save_vision_adapter

        return save_vision_adapter(self, save_directory, tokenizer, **kwargs)

    def save_pretrained_merged(self, save_directory, tokenizer=None, save_method: str = "merged_16bit",
                               max_shard_size="5GB", dtype=None) -> str:
        """Write the merged model (W + scale * A @ B) as a 16-bit transformers checkpoint with the processor
        (save_method="merged_16bit"), or the adapter ("lora"); returns the directory's path."""
        from unsloth_jax.hf.vision_export import save_vision_merged

        return save_vision_merged(self, save_directory, tokenizer, save_method=save_method,
                                  max_shard_size=max_shard_size, dtype=dtype)

    def save_pretrained_gguf(self, save_directory, tokenizer=None, quantization_method="f16", **kwargs):
        """Not available for vision-language models: NotImplementedError saying what to use."""
        raise NotImplementedError(_VISION_GGUF)

    def push_to_hub_gguf(self, repo_id: str, tokenizer=None, quantization_method="f16", **kwargs):
        """Not available for vision-language models: NotImplementedError saying what to use."""
        raise NotImplementedError(_VISION_GGUF)

    def generate(self, input_ids=None, attention_mask=None, pixel_values=None, token_type_ids=None,
                 image_grid_thw=None, **kwargs):
        """Greedy or sampled continuations of prompts with images (transformers' names; the processor's output
        works as `**inputs` or as input_ids=inputs): input_ids [B, P] (padded left or right), attention_mask
        [B, P], pixel_values (the images of the rows' image tokens, in order: Gemma 3 [N, C, H, W] with
        token_type_ids [B, P] (1 = image token) or None; Qwen2.5-VL [patches, C*T*p*p] with image_grid_thw
        [images, 3]). kwargs as Model.generate (max_new_tokens, max_length, do_sample, temperature, top_p, top_k,
        min_p, repetition_penalty, num_return_sequences, generation_config, eos_token_id, pad_token_id, seed,
        streamer). Returns [B * n, P + new] numpy int64 (generation.generate_vision)."""
        from unsloth_jax.generation import generate_vision

        images = _given(attention_mask=attention_mask, pixel_values=pixel_values, token_type_ids=token_type_ids,
                        image_grid_thw=image_grid_thw)
        if isinstance(input_ids, Mapping):  # the processor's output passed as input_ids=
            return self.generate(**{**input_ids, **images}, **kwargs)
        return generate_vision(self, input_ids, **images, **kwargs)

    def fast_generate(self, prompts, sampling_params=None, *, processor=None, use_tqdm: bool = False):
        """vLLM's `LLM.generate` for prompts with images (unsloth_jax.generation.fast_generate_vision): each prompt
        an engine request {"prompt_token_ids": ids, "images": ImageInputs(...)}, token ids, a chat (a list of
        messages whose image parts carry their images) or {"messages": chat, "images": [...]} (TRL's columns),
        with processor (default: the one from_pretrained loaded) for chats and text. Returns RequestOutputs."""
        from unsloth_jax.generation import fast_generate_vision

        return fast_generate_vision(self, prompts, sampling_params, processor=processor, use_tqdm=use_tqdm)

    def __repr__(self) -> str:
        lora = f", lora r={self.lora.r}" if self.lora else ""
        return f"VisionLanguageModel({family_of(self).describe(self)}, dtype={self.dtype.name}{lora})"


# The names the docs and notebooks use (both families load as VisionLanguageModel)
VisionModel = QwenVisionModel = VisionLanguageModel

_VISION_GGUF = ("GGUF export of vision-language models is not supported here: write the merged 16-bit checkpoint "
                "with model.save_pretrained_merged(dir, processor), then convert it with llama.cpp's "
                "convert_hf_to_gguf.py dir (the language model) and convert_hf_to_gguf.py dir --mmproj (the vision "
                "tower and projector)")
_LOADED_CLASSES: dict[str, type] = {}


def loaded_vision_class(family) -> type:
    """The class FastVisionModel loads `family`'s checkpoints as: VisionLanguageModel mixed into the family's
    module class (one class per family, so jit caches keyed by the module's graph stay warm)."""
    cls = _LOADED_CLASSES.get(family.name)
    if cls is None:
        base = family.module_class
        cls = type(f"VisionLanguageModel_{base.__name__}", (VisionLanguageModel, base),
                   {"__module__": __name__, "__doc__": VisionLanguageModel.__doc__})
        _LOADED_CLASSES[family.name] = cls
    return cls


def _remember_processor(model, processor):
    """processor, kept as the one model.fast_generate uses for chats and text (generation.set_default_tokenizer)."""
    if processor is not None:
        from unsloth_jax.generation import set_default_tokenizer

        set_default_tokenizer(model, processor)
    return processor


def _load_processor(model_dir: Path):
    """transformers' AutoProcessor of `model_dir`, or None where it has no processor files or it cannot be built."""
    processor_files = ("preprocessor_config.json", "processor_config.json")  # transformers 4 / 5 names
    if not any((model_dir / f).is_file() for f in processor_files):
        return None
    try:
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(str(model_dir))
    except (OSError, ValueError, ImportError) as e:
        first = e
    # transformers' Qwen2.5-VL processor fails without torchvision (its video half): build it without videos
    from unsloth_jax.hf.processors import IMAGE_ONLY_TYPES, folder_model_type, image_only_processor

    if folder_model_type(model_dir) in IMAGE_ONLY_TYPES:
        try:
            return image_only_processor(model_dir)
        except (OSError, ValueError, ImportError) as e:
            first = f"{first}; without its video processor: {e}"
    log.warning("unsloth_jax: no usable processor in %s (%s); returning None", model_dir, first)
    return None


class FastVisionModel:
    """Unsloth's vision-language entry points, for JAX: Gemma 3 (Gemma3ForConditionalGeneration), Qwen2.5-VL,
    Qwen3-VL and Qwen3.5 (each family of unsloth_jax.families.VISION_FAMILIES): loading (16 / 32 bits or NF4),
    saved adapters, LoRA, SFT, generation."""

    @staticmethod
    def from_pretrained(model_name: str | os.PathLike, max_seq_length: int = 2048, dtype=None,
                        load_in_4bit: bool = False, *, load_processor: bool = True, progress: bool = True, **kwargs):
        """Load a local vision-language directory (config.json model_type "gemma3" with a vision_config,
        "qwen2_5_vl", "qwen3_vl" or "qwen3_5"), or a PEFT adapter directory of such a model (a
        VisionLanguageModel's save_pretrained, or PEFT on transformers' model: its base_model_name_or_path is
        loaded, then the adapter's LoRA pairs on both towers: hf.vision_io.load_vision_adapter). Returns (VisionLanguageModel, processor): transformers'
        AutoProcessor of the directory (an adapter's own, else its base's), or None where it has none (no
        preprocessor_config.json or processor_config.json) or it cannot be built. dtype as
        FastLanguageModel.from_pretrained. load_in_4bit=True (every family, also under an adapter): the language
        model's projections in NF4 (QLoRA; the vision tower and projector / merger stay in `dtype`, as Unsloth's
        default)."""
        from unsloth_jax.hf import peft_io
        from unsloth_jax.hf.vision_io import checkpoint_family, load_vision_adapter, load_vision_language_model

        for key in kwargs:
            if key not in _FROM_PRETRAINED_IGNORED and key not in ("use_gradient_checkpointing", "load_in_8bit"):
                raise TypeError(f"FastVisionModel.from_pretrained() got an unexpected keyword argument {key!r}")
        load_in_4bit = require_bool("load_in_4bit", load_in_4bit)
        if kwargs.get("load_in_8bit"):
            raise ConfigError("FastVisionModel.from_pretrained: load_in_8bit is not supported; use load_in_4bit=True "
                              "(NF4) or 16 / 32 bits")
        model_dir = _check_model_name(model_name)
        if model_dir.is_dir() and peft_io.is_adapter_dir(model_dir):
            base = Path(peft_io.base_model_path(model_dir))
            if peft_io.is_adapter_dir(base):
                raise ConfigError(f"{model_dir}/adapter_config.json: base_model_name_or_path {str(base)!r} is itself "
                                  "an adapter directory; point it at the base model")
            model, processor = FastVisionModel.from_pretrained(base, max_seq_length, dtype, load_in_4bit,
                                                               load_processor=False, progress=progress, **kwargs)
            load_vision_adapter(model, model_dir)
            processor = (_load_processor(model_dir) or _load_processor(base)) if load_processor else None
            return model, _remember_processor(model, processor)
        if not model_dir.is_dir():
            raise CheckpointNotFoundError(f"model directory not found: {model_dir}")
        if load_in_4bit and _bnb_4bit_checkpoint(model_dir):
            raise ConfigError(f"{model_dir}: pre-quantized bitsandbytes vision-language checkpoints are not supported; "
                              "load the 16-bit model with load_in_4bit=True")
        max_seq_length = require_int("max_seq_length", max_seq_length, minimum=1)
        compute_dtype = resolve_dtype(dtype)
        start = time.perf_counter()
        family, cfg = checkpoint_family(model_dir)
        from unsloth_jax.quant import nf4_placer

        model = load_vision_language_model(model_dir, cfg, compute_dtype, model_class=loaded_vision_class(family),
                                           placer=nf4_placer if load_in_4bit else None)
        jax.block_until_ready(nnx.state(model))
        model.max_seq_length = max_seq_length
        processor = _load_processor(model_dir) if require_bool("load_processor", load_processor) else None
        log.info("unsloth_jax: loaded %s (%s vision-language, %d + %d layers) in %.1fs as %s%s", model_dir.name,
                 cfg.model_type,
                 cfg.text.num_hidden_layers, cfg.vision.num_hidden_layers, time.perf_counter() - start,
                 compute_dtype.name, " + NF4 4-bit language model" if load_in_4bit else "")
        return model, _remember_processor(model, processor)

    @staticmethod
    def get_peft_model(model: VisionLanguageModel, r: int = 16, *, finetune_vision_layers: bool = False,
                       finetune_language_layers: bool = True, finetune_attention_modules: bool = True,
                       finetune_mlp_modules: bool = True, target_modules=None, **kwargs):
        """LoRA with Unsloth's switches (FastLanguageModel.get_peft_model's arguments in kwargs): on the language
        layers (finetune_language_layers) and / or the vision tower's encoder layers (finetune_vision_layers),
        their attention projections (finetune_attention_modules: language q/k/v/o_proj and Qwen3.5's
        linear-attention in_proj_* / out_proj, vision q/k/v/out_proj) and MLP projections
        (finetune_mlp_modules: gate/up/down_proj, fc1/fc2). target_modules, when given,
        replaces the language choice (the vision choice still follows the switches). The projector stays frozen,
        as in Unsloth."""
        if not isinstance(model, VisionLanguageModel):
            raise TypeError(f"FastVisionModel.get_peft_model needs a model from FastVisionModel.from_pretrained, got "
                            f"{type(model).__name__}")
        vision = require_bool("finetune_vision_layers", finetune_vision_layers)
        language = require_bool("finetune_language_layers", finetune_language_layers)
        attention = require_bool("finetune_attention_modules", finetune_attention_modules)
        mlp = require_bool("finetune_mlp_modules", finetune_mlp_modules)
        if not (attention or mlp) and target_modules is None:
            raise ValueError("finetune_attention_modules=False and finetune_mlp_modules=False: nothing to adapt")
        if target_modules is None:  # attention: every token mixer's projections (Qwen3.5: linear_attn's too)
            projs = model.projections()
            attn_projs = tuple(p for p in projs if PROJ_PARENT[p] != "mlp")
            mlp_projs = tuple(p for p in projs if PROJ_PARENT[p] == "mlp")
            target_modules = ((attn_projs if attention else ()) + (mlp_projs if mlp else ())) if language else ()
        elif not language:
            raise ValueError("target_modules names language projections, but finetune_language_layers=False")
        family = family_of(model)
        vision_attn, vision_mlp = family.vision_attention, family.vision_mlp
        vision_targets = ((vision_attn if attention else ()) + (vision_mlp if mlp else ())) if vision else ()
        if not target_modules and not vision_targets:
            raise ValueError("finetune_language_layers=False and finetune_vision_layers=False: nothing to adapt")
        return FastLanguageModel.get_peft_model(model, r, target_modules=target_modules,
                                                vision_target_modules=vision_targets, **kwargs)

    @staticmethod
    def for_inference(model: VisionLanguageModel) -> VisionLanguageModel:
        """Unsloth's switch to inference: returns `model` unchanged (generate needs no switch)."""
        return model

    @staticmethod
    def for_training(model: VisionLanguageModel, use_gradient_checkpointing=True) -> VisionLanguageModel:
        """Unsloth's switch back to training: returns `model` unchanged (as FastLanguageModel.for_training)."""
        return model


def _is_vision_checkpoint(model_name) -> bool:
    """Whether model_name is a directory (or an adapter directory whose base is one) with the config.json of a
    vision-language model FastVisionModel loads: Gemma 3 with a vision_config, or Qwen2.5-VL."""
    from unsloth_jax.config import read_config_json
    from unsloth_jax.hf import peft_io

    path = _check_model_name(model_name)
    if path.is_dir() and peft_io.is_adapter_dir(path):
        path = Path(peft_io.base_model_path(path))
    if not (path / "config.json").is_file():
        return False  # a GGUF file, or a path from_pretrained reports as missing
    cfg, _ = read_config_json(path)
    return vision_family_for(cfg) is not None


def _vision_checkpoint_as_text_model(model_dir: Path, max_seq_length, dtype, load_in_4bit, load_in_fp8,
                                     full_finetuning, load_tokenizer, progress, kwargs: dict):
    """FastLanguageModel.from_pretrained of a vision-language checkpoint (e.g. Qwen3.5 as released, model_type
    "qwen3_5"), or of an adapter directory on one: as Unsloth's FastLanguageModel hands such a checkpoint to
    FastModel, the whole model loads (FastVisionModel.from_pretrained), so it trains on text batches and its saves
    are the released architecture's (a PEFT adapter for transformers' model class, a merged checkpoint with the
    vision tower). Returns (VisionLanguageModel, tokenizer or None). full_finetuning, load_in_fp8 and config
    overrides are refused (ConfigError / TypeError)."""
    if full_finetuning or load_in_fp8:
        raise ConfigError(f"{model_dir} is a vision-language checkpoint: full_finetuning=True and load_in_fp8=True "
                          "are not supported for it; train LoRA, in 16 / 32 bits or with load_in_4bit=True")
    given = [k for k in kwargs if k in _CONFIG_OVERRIDES]
    if given:
        raise TypeError(f"from_pretrained() got config overrides {given} for the vision-language checkpoint "
                        f"{model_dir}; they apply to mixture-of-experts text models only")
    from unsloth_jax.hf import peft_io

    model, _ = FastVisionModel.from_pretrained(model_dir, max_seq_length, dtype, load_in_4bit, load_processor=False,
                                               progress=progress, **kwargs)
    tokenizer = None
    if load_tokenizer:
        source = model_dir
        if peft_io.is_adapter_dir(model_dir) and not (model_dir / "tokenizer_config.json").is_file():
            source = Path(peft_io.base_model_path(model_dir))
        tokenizer = _load_tokenizer(source)
    return model, _remember_processor(model, tokenizer)


class FastModel:
    """Unsloth's generic loader: FastVisionModel for a vision-language checkpoint (Gemma 3 with images,
    Qwen2.5-VL), FastLanguageModel for any other, chosen by the checkpoint's config.json."""

    @staticmethod
    def from_pretrained(model_name: str | os.PathLike, max_seq_length: int = 2048, dtype=None,
                        load_in_4bit: bool = False, **kwargs):
        """(model, tokenizer or processor): FastVisionModel.from_pretrained or FastLanguageModel.from_pretrained
        with these arguments, by the checkpoint (or an adapter's base)."""
        loader = FastVisionModel if _is_vision_checkpoint(model_name) else FastLanguageModel
        return loader.from_pretrained(model_name, max_seq_length, dtype, load_in_4bit, **kwargs)

    @staticmethod
    def get_peft_model(model, r: int = 16, **kwargs):
        """LoRA: FastVisionModel.get_peft_model for a vision-language model (finetune_* switches), else
        FastLanguageModel.get_peft_model, where the switches pick target_modules when it is not given
        (finetune_attention_modules: q/k/v/o_proj, finetune_mlp_modules: gate/up/down_proj; finetune_vision_layers
        is ignored, as Unsloth does for a text model)."""
        if isinstance(model, VisionLanguageModel):
            return FastVisionModel.get_peft_model(model, r, **kwargs)
        switches = {k: require_bool(k, kwargs.pop(k)) for k in ("finetune_vision_layers", "finetune_language_layers",
                                                                 "finetune_attention_modules", "finetune_mlp_modules")
                    if k in kwargs}
        if switches and "target_modules" not in kwargs:
            if not switches.get("finetune_language_layers", True):
                raise ValueError("finetune_language_layers=False leaves nothing to adapt in a text model")
            targets = ((("q_proj", "k_proj", "v_proj", "o_proj") if switches.get("finetune_attention_modules", True)
                        else ()) + (("gate_proj", "up_proj", "down_proj") if switches.get("finetune_mlp_modules", True)
                                    else ()))
            if not targets:
                raise ValueError("finetune_attention_modules=False and finetune_mlp_modules=False: nothing to adapt")
            kwargs["target_modules"] = list(targets)
        return FastLanguageModel.get_peft_model(model, r, **kwargs)

    @staticmethod
    def for_inference(model):
        """Unsloth's switch to inference: returns `model` unchanged."""
        return model

    @staticmethod
    def for_training(model, use_gradient_checkpointing=True):
        """Unsloth's switch back to training: returns `model` unchanged."""
        return model


__all__ = ["FastLanguageModel", "FastModel", "FastVisionModel", "LoRARequest", "Model", "QwenVisionModel",
           "VisionLanguageModel", "VisionModel", "is_bfloat16_supported"]
