"""GRPO: reinforcement learning of a LoRA model from reward functions, with TRL's names, generating in-process.

    def short(prompts, completions, **kwargs):            # TRL's reward signature; kwargs: the other columns
        return [-len(c) / 10 for c in completions]
    trainer = GRPOTrainer(model=model, reward_funcs=[short], args=GRPOConfig(num_generations=8,
                          max_completion_length=64, output_dir="out"), train_dataset=prompts,
                          processing_class=tokenizer)
    trainer.train()

As TRL's GRPOTrainer: a generation (rollout) makes generation_batch_size = per_device_train_batch_size x
steps_per_generation completions (default steps_per_generation = gradient_accumulation_steps: one optimizer
step's), num_generations per prompt, split into steps_per_generation micro-batches that the next optimizer steps'
gradient-accumulation micro-batches take in turn (num_iterations times over):
  1. generate: the next prompts (a seeded permutation per epoch) are sampled num_generations times each by the
     generation engine (unsloth_jax.inference: one prefill per prompt, its num_generations completions share
     the prompt's cache pages; temperature, top_p, top_k, min_p and repetition_penalty as TRL's; in this
     process, with the current LoRA weights: the model the step trains is the model that samples; no server);
  2. score: every reward function on the decoded completions (reward models: torch, on the host CPU); rewards
     (weighted sum) normalised within each prompt's group over the whole generation batch (scale_rewards
     "group"; "batch"; "none") into advantages;
  3. train: each optimizer step's completions as right-padded [A, B, S] micro-batches through one jitted step:
     per-token log-probabilities (chunked, logits / temperature as TRL), the clipped surrogate
     -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) with r = exp(logp - logp_old), plus beta x the k3 KL
     estimate exp(ref - logp) - (ref - logp) - 1 to the reference (the base with the adapters dropped, from the
     same frozen arrays), aggregated per loss_type ("dapo", "grpo", "bnpo", "dr_grpo").
When an optimizer step can end inside a generation's use (gradient_accumulation_steps not a multiple of
steps_per_generation x num_iterations), logp_old is computed once after generation, from the rollout's weights;
otherwise logp_old = stop_gradient(logp). "dapo" normalizes by the generation batch's completion tokens (TRL's
num_items_in_batch). The log has TRL's keys (loss, reward, reward_std, rewards/<func>/mean and /std,
frac_reward_zero_std, completions/mean_length, min/max_length, clipped_ratio, kl, clip_ratio/low_mean,
high_mean, region_mean, num_tokens; the reward keys of the step's latest generation) plus time/generation,
time/rewards, time/train (seconds per step); TrainOutput.metrics holds the totals of that split.

A vision-language model with its processor as processing_class takes TRL's vision rows (a conversational prompt
with image parts, an "image" or "images" column): prompts go to the engine with their images, and the training
rows carry the prompt's image fields (train/rl_images.py; docs/VISION.md, "GRPO with images").

Several devices (one process): GRPOConfig(mesh="data=2") or "fsdp=N" runs the scoring and the update step on the
mesh (per_device_train_batch_size completions per device; every count above is per device, so a generation makes
generation_batch_size x devices completions), while the rollouts generate on the model's own device with its own
weights (the engine runs on one device, which so holds the whole model beside its share of the mesh's copy; a
model an earlier trainer left spread over a mesh is gathered onto the mesh's first device first), the trained
weights copied there before each generation and after training. The losses are of the whole micro-batch
across the mesh, as one device holding it would compute them: for loss_type "bnpo" (tokens summed over all rows,
divided by their count) that is the global token count, where TRL on N processes divides each process's sum by
its own count and averages the gradients; the two agree when every device holds as many completion tokens.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from unsloth_jax import distributed, ops
from unsloth_jax.errors import DatasetFormatError, TrainingError
from unsloth_jax.generation import default_eos_ids, engine_for
from unsloth_jax.families import TEXT, Family, family_of
from unsloth_jax.inference import SamplingParams
from unsloth_jax.inference.image_inputs import chat_request
from unsloth_jax.train.base import RunPlan
from unsloth_jax.train.logprobs import reference_model, token_logps
from unsloth_jax.train.rl_images import (column_images, dataset_has_images, image_micro_batches, prompt_has_images,
                                         request_ids, request_images, row_prompt)
from unsloth_jax.train.loop import RLTrainerBase, pad_token_id, records_of, round_up
from unsloth_jax.train.preference import encode_prompt, is_conversational
from unsloth_jax.backend import commit_to_devices
from unsloth_jax.train.step import StepLoss, jit_on_mesh, make_step
from unsloth_jax.train.trainer import TrainingArguments
from unsloth_jax.validation import require_choice, require_int, require_real

log = logging.getLogger("unsloth_jax")

GRPO_LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")


@dataclasses.dataclass
class GRPOConfig(TrainingArguments):
    """TRL's GRPOConfig (the fields that apply in-process), with TRL's defaults.

    per_device_train_batch_size counts completions, as in TRL. generation_batch_size (completions per generation)
    = per_device_train_batch_size x steps_per_generation (micro-batches per generation): give either (the other
    is derived) or both (they must agree); neither: steps_per_generation = gradient_accumulation_steps. It must
    be a multiple of num_generations.
    beta: the KL coefficient (0: no reference pass). epsilon / epsilon_high: the clipping range (epsilon_high
    None: epsilon). delta: optional upper clamp of the ratio (two-sided GRPO). scale_rewards: "group" (True),
    "batch" or "none" (False). importance_sampling_level "token" or "sequence" (GSPO).
    max_prompt_length (older TRL's): prompts cut to their last tokens; None keeps them whole.
    top_k (0 or None: off), min_p (None: off), repetition_penalty (1: off): sampling as TRL's (transformers'
    logits processors). use_vllm is accepted and changes nothing: generation always runs on the in-process
    engine.
    """

    per_device_train_batch_size: int = 8  # transformers' default, which TRL's GRPO defaults assume
    learning_rate: float = 1e-6
    logging_steps: int = 10
    num_generations: int = 8
    max_completion_length: int = 512
    max_prompt_length: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    beta: float = 0.0
    num_iterations: int = 1
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    importance_sampling_level: str = "token"
    reward_weights: list | None = None
    scale_rewards: str | bool = "group"
    loss_type: str = "dapo"
    mask_truncated_completions: bool = False
    generation_batch_size: int | None = None
    steps_per_generation: int | None = None
    shuffle_dataset: bool = True
    # accepted for TRL compatibility and ignored (use_vllm: see above; every column reaches the reward functions;
    # no dropout runs here; datasets are tokenized in-process)
    remove_unused_columns: bool = False
    disable_dropout: bool = False
    use_vllm: bool = False
    log_completions: bool = False
    dataset_num_proc: int | None = None

    def __post_init__(self):
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        require_choice("scale_rewards", self.scale_rewards, SCALE_REWARDS)
        require_choice("loss_type", self.loss_type, GRPO_LOSS_TYPES)
        require_choice("importance_sampling_level", self.importance_sampling_level, ("token", "sequence"))
        require_int("num_generations", self.num_generations, minimum=2)
        require_int("max_completion_length", self.max_completion_length, minimum=1)
        if self.max_prompt_length is not None:
            require_int("max_prompt_length", self.max_prompt_length, minimum=1)
        require_int("num_iterations", self.num_iterations, minimum=1)
        require_real("temperature", self.temperature, minimum=0, min_exclusive=True)
        require_real("top_p", self.top_p, minimum=0, maximum=1, min_exclusive=True)
        require_real("beta", self.beta, minimum=0)
        require_real("epsilon", self.epsilon, minimum=0)
        if self.epsilon_high is not None:
            require_real("epsilon_high", self.epsilon_high, minimum=0)
        if self.delta is not None:
            require_real("delta", self.delta, minimum=1, min_exclusive=True)
        if self.top_k is not None:
            require_int("top_k", self.top_k, minimum=-1)
        if self.min_p is not None:
            require_real("min_p", self.min_p, minimum=0, maximum=1)
        require_real("repetition_penalty", self.repetition_penalty, minimum=0, min_exclusive=True)
        self._resolve_generation_batch()
        if self.reward_weights is not None:
            self.reward_weights = [float(w) for w in self.reward_weights]

    def _resolve_generation_batch(self) -> None:
        """TRL's generation_batch_size = per_device_train_batch_size x steps_per_generation (completions per
        generation): either one given derives the other, neither gives steps_per_generation =
        gradient_accumulation_steps."""
        b = self.per_device_train_batch_size
        gbs, spg = self.generation_batch_size, self.steps_per_generation
        if gbs is not None:
            require_int("generation_batch_size", gbs, minimum=1)
            if gbs % b:
                raise ValueError(f"generation_batch_size={gbs} must be a multiple of per_device_train_batch_size={b} "
                                 "(a generation is split into micro-batches of that size)")
        if spg is not None:
            require_int("steps_per_generation", spg, minimum=1)
        if gbs is None and spg is None:
            spg = self.gradient_accumulation_steps
        elif spg is None:
            spg = gbs // b
        elif gbs is not None and gbs != b * spg:
            raise ValueError(f"generation_batch_size={gbs} and steps_per_generation={spg} disagree: "
                             f"generation_batch_size must be per_device_train_batch_size x steps_per_generation = "
                             f"{b * spg} (or give only one of them)")
        self.generation_batch_size, self.steps_per_generation = b * spg, spg
        # on a mesh a generation makes generation_batch_size x devices completions: GRPOTrainer checks that count
        if self.mesh is None and self.generation_batch_size % self.num_generations:
            raise ValueError(f"generation_batch_size = per_device_train_batch_size x steps_per_generation = "
                             f"{self.generation_batch_size} completions must be a multiple of "
                             f"num_generations={self.num_generations}")

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def generate_every(self) -> int:
        """Micro-batches (gradient-accumulation steps) served by one generation: steps_per_generation x
        num_iterations."""
        return self.steps_per_generation * self.num_iterations

    @property
    def needs_old_logps(self) -> bool:
        """Whether a generation's samples can meet an updated policy (an optimizer step ends inside a
        generation's use), so the clipped ratio needs the rollout policy's log-probabilities, as TRL decides."""
        return self.gradient_accumulation_steps % self.generate_every != 0


# ------------------------------------------------------------------------------------------ advantages
def _nanmean(x: np.ndarray, axis=None) -> np.ndarray:
    """Mean ignoring NaNs (NaN where every value is NaN), without numpy's empty-slice warning."""
    x = np.asarray(x, np.float64)
    count = np.sum(~np.isnan(x), axis=axis)
    total = np.sum(np.where(np.isnan(x), 0.0, x), axis=axis)
    return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def _nanstd(x: np.ndarray, axis=None) -> np.ndarray:
    """Standard deviation ignoring NaNs with Bessel's correction (NaN for fewer than 2 values), as TRL's."""
    x = np.asarray(x, np.float64)
    count = np.sum(~np.isnan(x), axis=axis, keepdims=True)
    mean = np.sum(np.where(np.isnan(x), 0.0, x), axis=axis, keepdims=True) / np.maximum(count, 1)
    squares = np.sum(np.where(np.isnan(x), 0.0, (x - mean) ** 2), axis=axis, keepdims=True)
    std = np.sqrt(np.where(count > 1, squares / np.maximum(count - 1, 1), np.nan))
    return np.squeeze(std, axis=axis) if axis is not None else std.reshape(())


def grpo_advantages(rewards_per_func: np.ndarray, weights: np.ndarray, num_generations: int,
                    scale_rewards: str = "group"):
    """TRL's advantages ("sum_then_normalize") from rewards [N, F] (NaN: no reward) of N = groups x
    num_generations completions (each group's completions consecutive) and F reward functions.

    Returns (advantages [N], rewards [N] (weighted sums), std [N] (the scale used: group or batch std))."""
    r = np.asarray(rewards_per_func, np.float64)
    unscorable = np.all(np.isnan(r), axis=1)
    rewards = np.nansum(r * np.asarray(weights, np.float64)[None], axis=1)
    rewards[unscorable] = np.nan
    grouped = rewards.reshape(-1, num_generations)
    mean = np.repeat(_nanmean(grouped, axis=1), num_generations)
    if scale_rewards == "batch":
        std = np.full_like(rewards, _nanstd(rewards) if rewards.size > 1 else 0.0)
    else:
        std = np.repeat(_nanstd(grouped, axis=1), num_generations)
    adv = rewards - mean
    if scale_rewards != "none":
        adv = adv / (std + 1e-4)
    return np.nan_to_num(adv, nan=0.0).astype(np.float32), rewards, std


# ------------------------------------------------------------------------------------------------ loss
def grpo_loss(logps, old_logps, ref_logps, advantages, mask, *, beta: float, epsilon_low: float,
              epsilon_high: float, loss_type: str, max_completion_length: int, num_items, accumulation_steps: int,
              delta: float | None = None, importance_sampling_level: str = "token"):
    """One micro-batch's share of TRL's GRPO loss, and its statistics.

    logps, old_logps [B, T] f32 (old: the sampling policy's; equal to logps' values when generations align with
    optimizer steps),
    ref_logps [B, T] or None (beta = 0), advantages [B], mask [B, T] (completion tokens). The value returned
    sums over a step's micro-batches to TRL's loss: "grpo" (per-sequence token means, averaged) and "bnpo"
    (the micro-batch's token mean) and "dr_grpo" (token sum / (B x max_completion_length)) are divided by
    accumulation_steps; "dapo" divides the token sum by num_items, the completion tokens of the micro-batch's
    generation batch (TRL's num_items_in_batch: the whole step's with the default steps_per_generation).
    stats: sums over masked tokens (kl, clip_low, clip_high, clip_region) and their count "n_tokens".
    """
    mask = mask.astype(jnp.float32)
    adv = advantages[:, None]
    log_ratio = logps - old_logps
    if importance_sampling_level == "sequence":
        log_ratio = (jnp.sum(log_ratio * mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0))[:, None]
    coef_1 = jnp.exp(log_ratio)
    coef_2 = jnp.clip(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        coef_1 = jnp.minimum(coef_1, delta)
    per_token = -jnp.minimum(coef_1 * adv, coef_2 * adv)
    kl = None
    if beta != 0.0:
        kl = jnp.exp(ref_logps - logps) - (ref_logps - logps) - 1
        per_token = per_token + beta * kl
    per_token = jnp.broadcast_to(per_token, mask.shape)
    if loss_type == "grpo":
        value = jnp.mean(jnp.sum(per_token * mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0)) / accumulation_steps
    elif loss_type == "bnpo":
        value = jnp.sum(per_token * mask) / jnp.maximum(jnp.sum(mask), 1.0) / accumulation_steps
    elif loss_type == "dr_grpo":
        value = jnp.sum(per_token * mask) / (mask.shape[0] * max_completion_length) / accumulation_steps
    elif loss_type == "dapo":
        value = jnp.sum(per_token * mask) / jnp.maximum(num_items, 1.0)
    else:
        raise ValueError(f"unknown GRPO loss_type {loss_type!r}; use one of {GRPO_LOSS_TYPES}")
    full = lambda x: jnp.broadcast_to(x, mask.shape)  # noqa: E731  (sequence level: one ratio per row)
    low = full((coef_1 < 1 - epsilon_low) & (adv < 0)).astype(jnp.float32)
    high = full((coef_1 > 1 + epsilon_high) & (adv > 0)).astype(jnp.float32)
    stats = {"n_tokens": jnp.sum(mask), "clip_low": jnp.sum(low * mask), "clip_high": jnp.sum(high * mask),
             "clip_region": jnp.sum(jnp.maximum(low, high) * mask)}
    if kl is not None:
        stats["kl"] = jnp.sum(full(kl) * mask)
    return value, stats


def grpo_step_loss(graphdef: nnx.GraphDef, cfg: GRPOConfig, *, chunk: int = 1024) -> StepLoss:
    """GRPO's StepLoss: grpo_loss of each micro-batch (already normalized per loss_type and accumulation, so the
    micro-batches' values and gradients are summed as they are), plus TRL's clip ratios and kl over the
    completion tokens, and tokens (real tokens of the batch). Its prepare gives num_items its [A] axis."""
    accum = cfg.gradient_accumulation_steps

    def micro(trainable, frozen, _ref_state, mb, policy):
        model = nnx.merge(graphdef, trainable, frozen)
        lp = token_logps(model, family_of(model).prepare_inputs(mb), remat=policy, temperature=cfg.temperature,
                         chunk=chunk)
        old = mb["old_logps"] if "old_logps" in mb else jax.lax.stop_gradient(lp)
        return grpo_loss(lp, old, mb.get("ref_logps"), mb["advantages"], mb["completion_mask"][:, 1:],
                         beta=cfg.beta, epsilon_low=cfg.epsilon_low,
                         epsilon_high=cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high,
                         loss_type=cfg.loss_type, max_completion_length=cfg.max_completion_length,
                         num_items=mb["num_items"], accumulation_steps=accum, delta=cfg.delta,
                         importance_sampling_level=cfg.importance_sampling_level)

    def prepare(batch):
        return dict(batch, num_items=jnp.broadcast_to(batch["num_items"], batch["advantages"].shape[:1]))

    def finish(value, sums, batch):
        n = jnp.maximum(sums["n_tokens"], 1.0)
        metrics = {"loss": value, "tokens": jnp.sum(batch["attention_mask"]),
                   "clip_ratio/low_mean": sums["clip_low"] / n, "clip_ratio/high_mean": sums["clip_high"] / n,
                   "clip_ratio/region_mean": sums["clip_region"] / n}
        if "kl" in sums:
            metrics["kl"] = sums["kl"] / n
        return metrics, None

    return StepLoss(micro, finish, prepare)


def make_grpo_step(graphdef: nnx.GraphDef, optimizer, cfg: GRPOConfig, *, remat="full", chunk: int = 1024,
                   mesh=None, family: Family = TEXT):
    """A jitted step(trainable, frozen, opt_state, batch) -> (trainable, opt_state, metrics) over [A, B, S]
    micro-batches (train.step.make_step with `grpo_step_loss`): input_ids, attention_mask, completion_mask
    (int32), advantages [A, B] f32, and when needed old_logps / ref_logps [A, B, S-1] f32; num_items f32 [A] or
    a scalar: "dapo"'s normalizer of each micro-batch, the completion tokens of the generation batch it came
    from (TRL's num_items_in_batch). A vision-language model's rows with images add their image fields
    (rl_images.image_micro_batches: pixel_values and token_type_ids, or Qwen2.5-VL's pixel_values, vision_* and
    mrope_positions), which the log-probabilities read as the SFT step does. remat: the layer-stack policy
    (make_step parses it); mesh, family: make_step's (the family places a vision-language batch's fields)."""
    return make_step(graphdef, optimizer, grpo_step_loss(graphdef, cfg, chunk=chunk), remat=remat, mesh=mesh,
                     family=family)


def make_grpo_scorer(graphdef: nnx.GraphDef, cfg: GRPOConfig, *, want_old: bool, want_ref: bool,
                     chunk: int = 1024, mesh=None, family: Family = TEXT):
    """A jitted score(trainable, frozen, ref_trainable, batch) -> {"old_logps", "ref_logps"} [A, B, S-1] f32
    (the ones asked for), computed once per generation batch without gradients. mesh: run on it with the
    step's placement rules (train.step.jit_on_mesh), the result replicated; family: as make_grpo_step's."""

    def score(trainable, frozen, ref_trainable, batch):
        # [A, ...] per field; lax.map takes one micro-batch at a time
        inputs = family_of(nnx.merge(graphdef, trainable, frozen)).prepare_inputs(batch)

        def one(mb):
            out = {}
            if want_old:
                out["old_logps"] = token_logps(nnx.merge(graphdef, trainable, frozen), mb,
                                               temperature=cfg.temperature, chunk=chunk)
            if want_ref:
                out["ref_logps"] = token_logps(reference_model(graphdef, trainable, frozen, ref_trainable), mb,
                                               temperature=cfg.temperature, chunk=chunk)
            return out

        return jax.lax.map(one, inputs)

    if mesh is not None:
        return jit_on_mesh(score, mesh, ("trainable", "frozen", "frozen"), train=False, family=family)
    return ops.policy_jit(score)


# -------------------------------------------------------------------------------------------- the trainer
def _reward_name(func) -> str:
    """TRL's reward name: a reward model's name_or_path after its last "/", else the function's name."""
    if _is_torch_module(func) and getattr(func, "config", None) is not None:
        return str(getattr(func.config, "_name_or_path", "") or type(func).__name__).rstrip("/").split("/")[-1]
    return getattr(func, "__name__", type(func).__name__)


def _is_torch_module(obj) -> bool:
    """Whether obj is a torch.nn.Module (without importing torch when nothing imported it)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def load_reward_model(path):
    """A reward model from a path or hub name: transformers' AutoModelForSequenceClassification with one label
    (torch, on the CPU), in eval mode; ValueError naming the path when it cannot be loaded."""
    try:
        from transformers import AutoModelForSequenceClassification
    except ImportError as err:  # pragma: no cover - transformers is a dependency of the test setup
        raise ImportError(f"GRPOTrainer: reward model {str(path)!r} needs transformers and torch") from err
    try:
        model = AutoModelForSequenceClassification.from_pretrained(str(path), num_labels=1)
    except Exception as err:  # noqa: BLE001 - transformers raises OSError, ValueError, HFValidationError, ...
        raise ValueError(f"GRPOTrainer: reward_funcs entry {str(path)!r} is neither a callable nor a loadable reward "
                         f"model (AutoModelForSequenceClassification.from_pretrained({str(path)!r}, num_labels=1) "
                         f"failed: {type(err).__name__}: {err})") from err
    return model.eval()


def _reward_tokenizer(model, tokenizer):
    """The tokenizer of a reward model (given, or loaded from the model's name_or_path), with pad_token = eos when
    it has none; the model's config.pad_token_id set to it (the score is read at the last non-pad token)."""
    if getattr(model, "config", None) is None:
        raise TypeError(f"GRPOTrainer: reward model {type(model).__name__} is a torch module without a transformers "
                        "config; pass a transformers AutoModelForSequenceClassification (or wrap it in a function)")
    if tokenizer is None:
        from transformers import AutoTokenizer

        source = getattr(getattr(model, "config", None), "_name_or_path", "")
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except Exception as err:  # noqa: BLE001
            raise ValueError(f"GRPOTrainer: no tokenizer for reward model {source!r} (loading one from its path "
                             f"failed: {type(err).__name__}: {err}); pass it in reward_processing_classes") from err
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    return tokenizer


def _gather_to_one_device(model, mesh):
    """The device the rollouts generate on: the model's, after moving its weights there if they are spread over
    several devices (a model an earlier trainer left on a mesh), to the mesh's first device (or jax's first)."""
    state = nnx.state(model)
    devices = {d for x in jax.tree.leaves(state) if isinstance(x, jax.Array) for d in x.devices()}
    if len(devices) == 1:
        return next(iter(devices))
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    nnx.update(model, jax.tree.map(lambda x: jax.device_put(x, device) if isinstance(x, jax.Array) else x, state))
    return device


class GRPOTrainer(RLTrainerBase):
    """TRL's GRPOTrainer for a LoRA model, generating with the project's KV cache in this process (see the
    module docstring). reward_funcs: one or a list of: callables f(prompts, completions, **kwargs) -> list of
    floats (None: no reward for that completion; kwargs hold completion_ids, trainer_state and every other column
    of the dataset, one entry per completion); reward models, a transformers AutoModelForSequenceClassification
    (torch) or its path (loaded with num_labels=1), scoring logits[:, 0] of each prompt + completion text (the chat
    template of prompt + completion messages for conversational prompts), run by torch on its device (the CPU
    here); reward_processing_classes: their tokenizers, one per reward function (None: loaded from the model's
    path; pad_token = eos when it has none).

    On the trainer base (unsloth_jax.train.base) it supplies a step's batch (micro-batches sliced from the buffered
    generation batch, generated, scored and batched every steps_per_generation x num_iterations micro-batches from
    the prompt stream), the jitted step, its log keys, evaluate() (eval_dataset:
    TRL's eval_reward, eval_rewards/<func>/mean, ... of completions sampled for held-out prompts) and, in its
    checkpoints, the generation counter, the prompt stream position, num_tokens and the generation batch the next
    steps reuse."""

    name = "GRPO"

    def __init__(self, model, reward_funcs, args: GRPOConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, tokenizer=None, callbacks=None, **kwargs):
        if kwargs:
            raise TypeError(f"GRPOTrainer() got unexpected keyword argument(s): {', '.join(kwargs)}")
        args = args if args is not None else GRPOConfig()
        if not isinstance(args, GRPOConfig):
            raise TypeError(f"GRPOTrainer: args must be a GRPOConfig, got {type(args).__name__}")
        super().__init__(model, args, tokenizer, processing_class, callbacks)
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not funcs:
            raise TypeError("GRPOTrainer needs at least one reward function")
        procs = reward_processing_classes
        procs = [None] * len(funcs) if procs is None else list(procs) if isinstance(procs, (list, tuple)) else [procs]
        if len(procs) != len(funcs):
            raise ValueError(f"GRPOTrainer: reward_processing_classes has {len(procs)} entries for {len(funcs)} "
                             "reward functions (one per reward function, None for the callables)")
        for i, f in enumerate(funcs):
            if isinstance(f, (str, os.PathLike)):
                funcs[i] = f = load_reward_model(f)
            if _is_torch_module(f):
                procs[i] = _reward_tokenizer(f, procs[i])
                f.eval()
                continue
            if not callable(f):
                raise TypeError(f"GRPOTrainer: reward_funcs must be callables f(prompts, completions, **kwargs), "
                                f"transformers sequence-classification models or their paths, got {f!r}")
            if inspect.iscoroutinefunction(f):
                raise TypeError(f"GRPOTrainer: async reward function {_reward_name(f)} is not supported")
        self.reward_funcs = funcs
        self.reward_processing_classes = procs
        self.reward_func_names = [_reward_name(f) for f in funcs]
        weights = args.reward_weights or [1.0] * len(funcs)
        if len(weights) != len(funcs):
            raise ValueError(f"reward_weights has {len(weights)} entries for {len(funcs)} reward functions")
        self.reward_weights = np.asarray(weights, np.float64)
        self.records = records_of(train_dataset)
        if not self.records:
            raise TrainingError("GRPOTrainer needs a non-empty train_dataset of records with a 'prompt'")
        self.eval_records = records_of(eval_dataset)
        # a processor's text half tokenizes plain-text prompts and decodes completions
        self.text_tokenizer = getattr(self.tokenizer, "tokenizer", self.tokenizer)
        self.vision = self._check_vision(model)
        # every batch carries image fields (one compiled step shape) when the dataset has images
        self.with_images = self.vision and dataset_has_images(self.records)
        self.prompt_ids, self.prompt_messages = self._encode_prompts(self.records, "train_dataset")
        self.eval_prompt_ids, self.eval_prompt_messages = self._encode_prompts(self.eval_records, "eval_dataset")
        self.conversational = is_conversational(self.records[0])
        self.pad_id = pad_token_id(self.text_tokenizer, model)
        eos = {int(e) for e in default_eos_ids(model)}
        if getattr(self.text_tokenizer, "eos_token_id", None) is not None:
            eos.add(int(self.text_tokenizer.eos_token_id))
        self.eos_ids = sorted(eos)
        self.timing = {"generation": 0.0, "rewards": 0.0, "train": 0.0}
        self._compiled = None
        self._requests = None  # (rows, their engine requests) of the generation round under way
        self._reset_stream()

    def _check_vision(self, model) -> bool:
        """Whether prompts go through the processor with their images: a vision-language model with its
        processor as processing_class. Images in a dataset need both (TypeError / TrainingError otherwise)."""
        is_vl = hasattr(model, "vl_config")
        has_processor = hasattr(self.tokenizer, "image_processor")
        for name, records in (("train_dataset", self.records), ("eval_dataset", self.eval_records)):
            if not dataset_has_images(records):
                continue
            if not is_vl:
                raise TrainingError(f"GRPOTrainer: {name} holds images but {type(model).__name__} is not a "
                                    "vision-language model (FastVisionModel.from_pretrained loads one)")
            if not has_processor:
                raise TypeError(f"GRPOTrainer: {name} holds images; pass the model's processor as processing_class "
                                f"(FastVisionModel.from_pretrained returns it), got {type(self.tokenizer).__name__}")
        return is_vl and has_processor

    def _encode_prompts(self, records: list, name: str) -> tuple[list, list]:
        """(token ids of each record's prompt (cut to its last max_prompt_length tokens), or None for a prompt
        the processor prepares with its images when sampled; those prompts' messages with their images
        (rl_images.row_prompt, checked here), or None)."""
        ids_out, messages_out = [], []
        for i, rec in enumerate(records):
            if not isinstance(rec, dict) or "prompt" not in rec:
                got = f"keys {sorted(rec)}" if isinstance(rec, dict) else type(rec).__name__
                raise DatasetFormatError(f"{name}[{i}]: GRPO records need a 'prompt' (a string or a list of "
                                         f"messages), got {got}")
            if self.vision and (is_conversational(rec) or column_images(rec)):
                messages_out.append(row_prompt(rec, f"{name}[{i}]"))
                ids_out.append(None)
                continue
            if column_images(rec) or prompt_has_images(rec["prompt"]):  # images, but no vision model: refused above
                raise DatasetFormatError(f"{name}[{i}]: the row has images but the trainer has no processor")
            tokenizer = self.tokenizer if isinstance(rec["prompt"], list) else self.text_tokenizer
            ids = encode_prompt(tokenizer, rec["prompt"])
            if self.args.max_prompt_length is not None:
                ids = ids[-self.args.max_prompt_length:]
            if not ids:
                raise DatasetFormatError(f"{name}[{i}]: the prompt is empty after tokenization")
            ids_out.append(ids)
            messages_out.append(None)
        return ids_out, messages_out

    def _request(self, row: int, split: str = "train_dataset"):
        """The engine request of a dataset row's prompt: its token ids, or, for a prompt with images, the
        processor's ids and images ({"prompt_token_ids", "images"}, inference.image_inputs.chat_request; made
        here, when a generation needs it). A prompt with images longer than max_prompt_length is refused (cutting
        it could split an image block)."""
        ids, messages = ((self.prompt_ids, self.prompt_messages) if split == "train_dataset"
                         else (self.eval_prompt_ids, self.eval_prompt_messages))
        if ids[row] is not None:
            return ids[row]
        where, limit = f"{split}[{row}]", self.args.max_prompt_length
        request = chat_request(self.model.vl_config, self.tokenizer, messages[row], where)
        if limit is not None and len(request_ids(request)) > limit:
            if request_images(request) is not None:
                raise DatasetFormatError(f"{where}: the prompt is {len(request_ids(request))} tokens with its image "
                                         f"tokens, more than max_prompt_length={limit}, and cutting it could split "
                                         "an image; raise max_prompt_length or set it to None")
            request = request_ids(request)[-limit:]
        return request

    def _reset_stream(self) -> None:
        """The training-progress state a checkpoint keeps, at the start of a run."""
        self._generation = 0  # generation batches made (the sampling seed of the next is derived from it)
        self._prompt_position = 0  # position in the prompt stream of the next generation batch's first prompt
        self._tokens_seen = 0  # prompt + completion tokens generated so far (TRL's num_tokens)
        self._batch = None  # the generation batch the steps until the next generation use (device arrays)
        self._gen_metrics = None  # its host metrics
        self._score_seconds = 0.0  # time spent on old / reference log-probabilities in the current next_batch

    # ---------------------------------------------------------------------------------------- pieces
    @property
    def batch_devices(self) -> int:
        """Devices the step's rows split over (1 without a mesh): the global micro-batch is
        per_device_train_batch_size x this, and a generation makes generation_batch_size x this completions."""
        return distributed.batch_shards(self.mesh) if self.mesh is not None else 1

    @property
    def prompts_per_generation(self) -> int:
        return self.args.generation_batch_size * self.batch_devices // self.args.num_generations

    def write_back(self, trainable) -> None:
        """The trained weights into the model, on the device of its other weights (the rollouts' device: on a
        mesh the step's copies are sharded, and the engine runs on one device)."""
        if self.mesh is not None:
            trainable = jax.device_put(trainable, self._rollout_device)
        nnx.update(self.model, trainable)

    def _prompt_rows(self, position: int, count: int) -> np.ndarray:
        """Dataset rows at positions position .. position+count-1 of the prompt stream: seeded per-epoch
        permutations of the records, one after another (in order with shuffle_dataset=False)."""
        n = len(self.records)
        out = []
        for pos in range(position, position + count):
            epoch, i = divmod(pos, n)
            perm = (np.random.default_rng([self.args.seed, epoch]).permutation(n) if self.args.shuffle_dataset
                    else np.arange(n))
            out.append(int(perm[i]))
        return np.asarray(out)

    def _image_token_ids(self) -> list[int]:
        """The ids whose embeddings a vision-language model replaces by image features (none for text models)."""
        if not self.vision:
            return []
        return family_of(self.model).image_token_ids(self.model.vl_config)

    def _sample(self, unique: list, seed: int) -> tuple[list[list[int]], list[list[int]], list[bool], list]:
        """(prompt ids, completion ids (cut after the first eos, which stays), truncated flags, the prompts'
        ImageInputs or None) of the engine requests `unique`, each sampled num_generations times by the generation
        engine with the model's current weights.

        TRL suppresses a vision-language model's image token in sampling (its features would be missing in the
        training pass); the engine has no token suppression, so a sampled image token ends the completion there
        instead: the token is dropped and the completion counts as truncated."""
        a, g = self.args, self.args.num_generations
        image_ids = self._image_token_ids()
        params = [SamplingParams(n=g, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k or 0,
                                 min_p=a.min_p or 0.0, repetition_penalty=a.repetition_penalty,
                                 max_tokens=a.max_completion_length, stop_token_ids=self.eos_ids + image_ids,
                                 ignore_eos=True, seed=(seed * 1_000_003 + i) % 2**31) for i in range(len(unique))]
        # the g completions of a prompt share its pages; LoRA merged into a reused buffer where the layout chooser
        # finds that it fits (inference.weights.choose_layout)
        outs = engine_for(self.model, weights="auto").generate(unique, params)
        prompts = [request_ids(p) for p in unique for _ in range(g)]
        images = [request_images(p) for p in unique for _ in range(g)]
        completions = [list(c.token_ids) for o in outs for c in o.outputs]
        truncated = [c.finish_reason == "length" for o in outs for c in o.outputs]
        for i, c in enumerate(completions):
            if c and c[-1] in image_ids:
                completions[i], truncated[i] = c[:-1], True
        return prompts, completions, truncated, images

    def generate_completions(self, rows: np.ndarray, seed: int) -> tuple[list[list[int]], list[list[int]], list[bool]]:
        """(prompt ids, completion ids (cut after the first eos, which stays), truncated flags) for the train
        dataset's rows, each repeated num_generations times, sampled with the model's current weights."""
        return self._sample(self._round_requests(rows), seed)[:3]

    def _round_requests(self, rows: np.ndarray) -> list:
        """The engine requests of the train dataset's rows' prompts, made once per generation round (the processor
        runs once per prompt with images): generate_completions samples them and _row_images reads their images."""
        key = tuple(int(r) for r in rows)
        if self._requests is None or self._requests[0] != key:
            self._requests = (key, [self._request(r) for r in key])
        return self._requests[1]

    def _row_images(self, rows: np.ndarray) -> list:
        """The ImageInputs (or None) of the train dataset's rows' prompts, each num_generations times (the order of
        generate_completions' rows)."""
        g = self.args.num_generations
        return [request_images(request) for request in self._round_requests(rows) for _ in range(g)]

    def _score(self, records: list[dict], completion_ids: list[list[int]], messages: list | None = None
               ) -> np.ndarray:
        """rewards [N, F] (float64, NaN where a function returned None) of completions, each of `records`
        num_generations times. messages: per record, its prompt with the images in their parts (rl_images.row_prompt)
        or None: the reward functions get that prompt, as TRL's (the image columns come as the other columns)."""
        g = self.args.num_generations
        messages = messages or [None] * len(records)
        recs = [rec for rec in records for _ in range(g)]
        prompts = [rec["prompt"] if m is None else m for rec, m in zip(records, messages) for _ in range(g)]
        texts = self.text_tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if self.conversational else texts
        keys = [k for k in recs[0] if k not in ("prompt", "completion", "completion_ids")]
        kwargs = {k: [rec.get(k) for rec in recs] for k in keys}
        out = np.full((len(recs), len(self.reward_funcs)), np.nan)
        for j, (func, name) in enumerate(zip(self.reward_funcs, self.reward_func_names)):
            if _is_torch_module(func):
                out[:, j] = self._model_rewards(func, self.reward_processing_classes[j], prompts, completions)
                continue
            values = func(prompts=prompts, completions=completions, completion_ids=completion_ids,
                          trainer_state=self.state, **kwargs)
            values = list(values)
            if len(values) != len(recs):
                raise TrainingError(f"reward function {name} returned {len(values)} rewards for {len(recs)} "
                                    "completions")
            out[:, j] = [np.nan if v is None else float(v) for v in values]
        if np.any(np.all(np.isnan(out), axis=1)):
            log.warning("unsloth_jax: every reward function returned None for some completions; their advantage is 0")
        return out

    def _model_rewards(self, model, tokenizer, prompts: list, completions: list) -> np.ndarray:
        """[N] float64: a reward model's logits[:, 0] of each prompt + completion text (conversational: the chat
        template of the prompt and completion messages), right padded, one torch forward on the model's device."""
        import torch

        if self.conversational:
            texts = [tokenizer.apply_chat_template(list(p) + list(c), tokenize=False)
                     for p, c in zip(prompts, completions)]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        enc = tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
        device = next(model.parameters()).device
        with torch.inference_mode():
            logits = model(**{k: v.to(device) for k, v in enc.items()}).logits
        return logits[:, 0].float().cpu().numpy().astype(np.float64)

    def score_completions(self, rows: np.ndarray, completion_ids: list[list[int]]) -> np.ndarray:
        """rewards [N, F] (float64, NaN where a function returned None) of the completions of the train
        dataset's `rows`."""
        return self._score([self.records[r] for r in rows], completion_ids,
                           [self.prompt_messages[r] for r in rows])

    def _reward_metrics(self, rewards_per_func: np.ndarray, completions: list, truncated: list) -> dict:
        """TRL's reward and completion log keys of one batch of scored completions."""
        _, rewards, std = grpo_advantages(rewards_per_func, self.reward_weights, self.args.num_generations,
                                          self.args.scale_rewards)
        lengths = np.asarray([len(c) for c in completions], np.float64)
        metrics = {"reward": float(_nanmean(rewards)), "reward_std": float(_nanstd(rewards)),
                   "frac_reward_zero_std": float(np.mean(np.isclose(std, 0.0))),
                   "completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
                   "completions/max_length": float(lengths.max()),
                   "completions/clipped_ratio": float(np.mean(truncated))}
        for j, name in enumerate(self.reward_func_names):
            col = rewards_per_func[:, j]
            metrics[f"rewards/{name}/mean"] = float(_nanmean(col))
            metrics[f"rewards/{name}/std"] = float(_nanstd(col))
        return metrics

    def build_batch(self, prompts, completions, truncated, advantages, rng, images=None) -> dict:
        """A generation batch's [steps_per_generation, B, S] micro-batches (rows shuffled, as TRL does): prompt +
        completion right padded to a multiple of loop.SEQUENCE_MULTIPLE, completion_mask on the completion tokens
        (zeroed for truncated ones with mask_truncated_completions), advantages [steps_per_generation, B],
        num_items (its completion tokens, f32 scalar). images: per row its prompt's ImageInputs or None (None:
        a text batch); then the micro-batches' image fields too (rl_images.image_micro_batches)."""
        a, b = self.args.steps_per_generation, self.args.per_device_train_batch_size * self.batch_devices
        n = len(prompts)
        length = round_up(max(len(p) + len(c) for p, c in zip(prompts, completions)))
        ids = np.full((n, length), self.pad_id, np.int32)
        mask = np.zeros((n, length), np.int32)
        cmask = np.zeros((n, length), np.int32)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            ids[i, :len(p) + len(c)] = list(p) + list(c)
            mask[i, :len(p) + len(c)] = 1
            if not (self.args.mask_truncated_completions and truncated[i]):
                cmask[i, len(p):len(p) + len(c)] = 1
        order = rng.permutation(n)
        batch = {"input_ids": ids[order], "attention_mask": mask[order], "completion_mask": cmask[order],
                 "advantages": np.asarray(advantages, np.float32)[order]}
        batch = {k: v.reshape((a, b) + v.shape[1:]) for k, v in batch.items()}
        batch["num_items"] = np.float32(cmask.sum())
        if images is not None:
            batch.update(image_micro_batches(self.model, ids[order], mask[order], [images[i] for i in order], a))
        return batch

    def _generation_round(self, trainable) -> tuple[dict, dict]:
        """Generate, score and batch the next generation batch of the prompt stream -> (host batch, host metrics);
        advances the generation counter and the stream position."""
        args, generation = self.args, self._generation
        self.write_back(trainable)  # the sampler runs the weights being trained
        t0 = time.perf_counter()
        rows = self._prompt_rows(self._prompt_position, self.prompts_per_generation)
        sample_seed = (args.seed * 1000003 + generation) % 2**31
        prompts, completions, truncated = self.generate_completions(rows, sample_seed)
        images = self._row_images(rows) if self.with_images else None
        self._requests = None  # this round's requests (their pixels) are not kept past it
        t1 = time.perf_counter()
        rewards_per_func = self.score_completions(rows, completions)
        advantages, _, _ = grpo_advantages(rewards_per_func, self.reward_weights, args.num_generations,
                                           args.scale_rewards)
        t2 = time.perf_counter()
        batch = self.build_batch(prompts, completions, truncated, advantages,
                                 np.random.default_rng([args.seed, generation, 7]),
                                 images)
        self._generation += 1
        self._prompt_position += len(rows)
        self._tokens_seen += int(sum(len(p) for p in prompts) + sum(len(c) for c in completions))
        metrics = {**self._reward_metrics(rewards_per_func, completions, truncated),
                   "num_tokens": float(self._tokens_seen)}
        self.timing["generation"] += t1 - t0
        self.timing["rewards"] += t2 - t1
        metrics["time/generation"], metrics["time/rewards"] = t1 - t0, t2 - t1
        return batch, metrics

    def _steps(self) -> int:
        a = self.args
        if a.max_steps and a.max_steps > 0:
            return int(a.max_steps)
        rounds = math.ceil(a.num_train_epochs * len(self.records) / self.prompts_per_generation)
        return max(1, math.ceil(rounds * a.generate_every / a.gradient_accumulation_steps))

    # ------------------------------------------------------------------------ for the trainer base
    def prepare_run(self) -> RunPlan:
        args, model = self.args, self.model
        # On a mesh the scoring and update steps run sharded (the step factory's rules, like SFT's); the rollouts
        # stay on the model's own device with its own weights (the engine runs on one device), the trained
        # weights copied there before each generation
        self.mesh = mesh = distributed.resolve_mesh(args.mesh, "GRPOConfig.mesh")
        if mesh is not None and jax.process_count() > 1:
            raise TrainingError("GRPOConfig.mesh: GRPOTrainer runs on the devices of one process (its rollouts "
                                f"generate in this process); this run has {jax.process_count()} processes")
        completions = args.generation_batch_size * self.batch_devices
        if completions % args.num_generations:
            raise ValueError(f"GRPOConfig: a generation makes generation_batch_size x devices = "
                             f"{args.generation_batch_size} x {self.batch_devices} = {completions} completions, which "
                             f"must be a multiple of num_generations={args.num_generations}")
        total = self._steps()
        want_ref = args.beta != 0.0
        want_old = args.needs_old_logps
        self._rollout_device = _gather_to_one_device(model, mesh)
        graphdef, trainable, frozen, self._ref_trainable = self.split_state(want_ref)
        # The jitted step and scorer are kept for a later train() with the same model structure, step count and
        # arguments (the seed aside: it only steers sampling), so training again does not compile again.
        key = (graphdef, total, model.gradient_checkpointing, repr(dataclasses.replace(args, seed=0)), mesh)
        if self._compiled is None or self._compiled[0] != key:
            schedule, optimizer = self.make_optimizer(total)
            family = family_of(model)
            step_fn = make_grpo_step(graphdef, optimizer, args, remat=model.gradient_checkpointing, mesh=mesh,
                                     family=family)
            scorer = (make_grpo_scorer(graphdef, args, want_old=want_old, want_ref=want_ref, mesh=mesh,
                                       family=family) if (want_old or want_ref) else None)
            self._compiled = (key, schedule, optimizer, step_fn, scorer)
        _, schedule, optimizer, self._step_fn, self._scorer = self._compiled
        opt_state = commit_to_devices(optimizer.init(trainable))
        if mesh is not None:  # the step's copies; the model keeps its own for the rollouts
            trainable, frozen, opt_state = distributed.shard_state(mesh, (trainable, frozen, opt_state))
            self._ref_trainable = distributed.put(self._ref_trainable,
                                                  distributed.state_shardings(mesh, self._ref_trainable))
        self._frozen = frozen
        self.timing = {"generation": 0.0, "rewards": 0.0, "train": 0.0}
        self._reset_stream()
        return RunPlan(total=total, schedule=schedule,
                       epoch_at=lambda done: (done * args.gradient_accumulation_steps / args.generate_every
                                              * self.prompts_per_generation / len(self.records)),
                       planned_samples=(total * args.per_device_train_batch_size * self.batch_devices
                                        * args.gradient_accumulation_steps),
                       summary=(f"{len(self.records)} prompts, {total} steps, {args.num_generations} generations of "
                                f"up to {args.max_completion_length} tokens per prompt, loss_type={args.loss_type}, "
                                f"beta={args.beta}"),
                       train_state={"trainable": trainable, "opt_state": opt_state})

    def _new_generation(self) -> dict:
        """Generate, score and batch the next generation batch and give it its old / reference log-probabilities
        (when the loss needs them, from the weights at this point: the rollout policy); it becomes the buffer the
        next generate_every micro-batches are sliced from. Returns its host metrics."""
        host_batch, metrics = self._generation_round(self.train_state["trainable"])
        t0 = time.perf_counter()
        batch = jax.device_put(host_batch)
        if self._scorer is not None:
            batch.update(self._scorer(self.train_state["trainable"], self._frozen, self._ref_trainable, batch))
        self._batch, self._gen_metrics = batch, metrics
        self._score_seconds += time.perf_counter() - t0
        return metrics

    def next_batch(self, step: int):
        """The [A, B, S] micro-batches of optimizer step `step`, as TRL's buffering: micro-step m (step x A + a)
        takes slice m % steps_per_generation of the generation buffer, and a new generation (current weights) is
        made at every m that is a multiple of steps_per_generation x num_iterations. A step can take slices of two
        or more generations (then padded to one length); "dapo"'s num_items is per micro-batch, its generation's."""
        args = self.args
        accum, spg, every = args.gradient_accumulation_steps, args.steps_per_generation, args.generate_every
        self._score_seconds = 0.0
        made, pieces = [], []  # pieces: (generation buffer, slice index)
        for m in range(step * accum, (step + 1) * accum):
            if m % every == 0 or self._batch is None:
                made.append(self._new_generation())
            pieces.append((self._batch, m % spg))
        if all(buf is pieces[0][0] for buf, _ in pieces) and [i for _, i in pieces] == list(
                range(pieces[0][1], pieces[0][1] + accum)):
            first, buf = pieces[0][1], pieces[0][0]
            arrays = {k: v for k, v in buf.items() if k != "num_items"}
            arrays = arrays if accum == spg else {k: v[first:first + accum] for k, v in arrays.items()}
            arrays["num_items"] = jnp.full((accum,), buf["num_items"], jnp.float32)
        else:
            arrays = _stack_micro_batches(pieces, self.pad_id, family_of(self.model))
        if not made:
            metrics = {**self._gen_metrics, "time/generation": 0.0, "time/rewards": 0.0}
        elif len(made) == 1:
            metrics = made[0]
        else:  # several generations in one step: their means averaged (TRL averages a logging window's values)
            metrics = {k: float(np.mean([x[k] for x in made])) for k in made[0]}
            metrics.update({k: float(sum(x[k] for x in made)) for k in ("time/generation", "time/rewards")},
                           num_tokens=made[-1]["num_tokens"])
        return {"arrays": arrays, "metrics": metrics, "score_seconds": self._score_seconds}

    def run_step(self, state: dict, batch) -> tuple[dict, dict]:
        t0 = time.perf_counter()
        trainable, opt_state, metrics = self._step_fn(state["trainable"], self._frozen, state["opt_state"],
                                                      dict(batch["arrays"]))
        jax.block_until_ready(metrics)
        train_s = time.perf_counter() - t0 + batch["score_seconds"]
        self.timing["train"] += train_s
        return {"trainable": trainable, "opt_state": opt_state}, {**metrics, **batch["metrics"], "time/train": train_s}

    def final_metrics(self) -> dict:
        t = self.timing
        busy = max(sum(t.values()), 1e-9)
        if distributed.is_main_process():
            print(f"unsloth_jax GRPO time: generation {t['generation']:.1f}s ({100 * t['generation'] / busy:.0f}%), "
                  f"rewards {t['rewards']:.1f}s, training {t['train']:.1f}s ({100 * t['train'] / busy:.0f}%)")
        return {"generation_runtime": round(t["generation"], 4), "reward_runtime": round(t["rewards"], 4),
                "update_runtime": round(t["train"], 4)}

    # ----------------------------------------------------------------------------------- checkpoints
    def checkpoint_record(self) -> dict:
        return {"generation": self._generation, "prompt_position": self._prompt_position,
                "tokens_seen": self._tokens_seen, "generation_metrics": self._gen_metrics}

    def _buffer_in_use(self) -> bool:
        """Whether the next step continues the buffered generation batch (it does not start with a generation)."""
        a = self.args
        return (self._batch is not None
                and (self.state.global_step * a.gradient_accumulation_steps) % a.generate_every != 0)

    def write_checkpoint_files(self, directory) -> None:
        """The generation batch in use (with its old / reference log-probabilities), when the next steps take
        more of its micro-batches (num_iterations > 1 or steps_per_generation > gradient_accumulation_steps,
        saved inside a generation's use)."""
        if self._buffer_in_use():
            with open(directory / GENERATION_BATCH, "wb") as fh:
                np.savez(fh, **jax.device_get(self._batch))

    def restore_trainer_state(self, record: dict, directory) -> None:
        self._generation = int(record["generation"])
        self._prompt_position = int(record["prompt_position"])
        self._tokens_seen = int(record["tokens_seen"])
        self._gen_metrics = record["generation_metrics"]
        path = directory / GENERATION_BATCH
        if path.is_file():
            with np.load(path) as saved:
                self._batch = jax.device_put({k: saved[k] for k in saved.files})
        elif self.state.global_step * self.args.gradient_accumulation_steps % self.args.generate_every:
            raise TrainingError(f"{directory} was saved inside a generation batch but holds no {GENERATION_BATCH}: "
                                "it cannot be resumed exactly")

    # ------------------------------------------------------------------------------------ evaluation
    def has_eval_data(self) -> bool:
        return bool(self.eval_records)

    def evaluate(self) -> dict:
        """TRL's eval_ keys of the model's current weights on eval_dataset: num_generations completions per
        held-out prompt, sampled by the generation engine with this trainer's sampling settings and the same
        seed at every evaluation (evaluations differ by the weights only), per_device_eval_batch_size completions
        per engine call, scored by the reward functions: eval_reward, eval_reward_std, eval_rewards/<func>/mean
        and /std, eval_frac_reward_zero_std, eval_completions/* and eval_runtime, eval_samples_per_second,
        eval_steps_per_second."""
        if not self.eval_records:
            raise TrainingError("evaluate() needs an eval_dataset (GRPOTrainer(..., eval_dataset=...))")
        a = self.args
        t0 = time.perf_counter()
        per_call = max(1, a.per_device_eval_batch_size // a.num_generations)
        rewards, completions, truncated = [], [], []
        calls = range(0, len(self.eval_records), per_call)
        for start in calls:
            rows = range(start, min(start + per_call, len(self.eval_records)))
            _, comps, trunc, _ = self._sample([self._request(r, "eval_dataset") for r in rows],
                                              seed=(a.seed * 1000003 + 999_983 + start) % 2**31)
            rewards.append(self._score([self.eval_records[r] for r in rows], comps,
                                       [self.eval_prompt_messages[r] for r in rows]))
            completions += comps
            truncated += trunc
        metrics = self._reward_metrics(np.concatenate(rewards), completions, truncated)
        runtime = time.perf_counter() - t0
        out = {f"eval_{k}": v for k, v in metrics.items()}
        out.update({"eval_runtime": round(runtime, 4),
                    "eval_samples_per_second": round(len(self.eval_records) / runtime, 3),
                    "eval_steps_per_second": round(len(calls) / runtime, 3)})
        return out


_ROW_FIELDS = ("input_ids", "attention_mask", "completion_mask", "old_logps", "ref_logps")


def _stack_micro_batches(pieces: list, pad_id: int, family) -> dict:
    """One step's [A, B, S] arrays from (generation buffer, slice index) pairs of buffers of different lengths:
    each slice right padded to the longest (pad_id for input_ids, 0 elsewhere; the family's row_fields too:
    Gemma 3's token_type_ids, Qwen2.5-VL's mrope_positions [3, B, S]),
    num_items [A] per slice. Image fields: Gemma 3's pixel_values [N, C, H, W] padded with zero images to the
    largest N; Qwen2.5-VL's patch arrays must agree (the same patch bucket), else a TrainingError."""
    length = max(buf["input_ids"].shape[-1] for buf, _ in pieces)
    out = {}
    for key in pieces[0][0]:
        if key == "num_items":
            out[key] = jnp.stack([jnp.asarray(buf[key], jnp.float32) for buf, _ in pieces])
            continue
        rows = []
        for buf, i in pieces:
            x = buf[key][i]
            width = length - buf["input_ids"].shape[-1]
            if key in _ROW_FIELDS or key in family.row_fields:  # [B, S], [B, S-1] or [3, B, S]: the sequence axis
                pad = [(0, 0)] * (x.ndim - 1) + [(0, width)]
                x = jnp.pad(x, pad, constant_values=pad_id if key == "input_ids" else 0)
            elif key == "pixel_values" and x.ndim == 4:  # Gemma 3's images: trailing zero images are never read
                most = max(buf[key].shape[1] for buf, _ in pieces)
                x = jnp.pad(x, [(0, most - x.shape[0])] + [(0, 0)] * 3)
            rows.append(x)
        if len({r.shape for r in rows}) > 1:
            raise TrainingError(f"GRPO: one optimizer step takes micro-batches of generations whose {key} shapes "
                                f"differ ({sorted({r.shape for r in rows})}): Qwen2.5-VL's patches fall in different "
                                "buckets; make gradient_accumulation_steps a multiple of steps_per_generation x "
                                "num_iterations (or equal to it)")
        out[key] = jnp.stack(rows)
    return out


GENERATION_BATCH = "generation_batch.npz"  # in a GRPO checkpoint: the generation batch its next steps reuse

__all__ = ["GRPOConfig", "GRPOTrainer", "GRPO_LOSS_TYPES", "grpo_advantages", "grpo_loss", "make_grpo_step",
           "make_grpo_scorer"]
