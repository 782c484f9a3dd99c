"""DPO and ORPO: preference training of a LoRA model on (prompt, chosen, rejected) pairs, with TRL's names.

    trainer = DPOTrainer(model=model, ref_model=None, args=DPOConfig(beta=0.1, output_dir="out"),
                         train_dataset=pairs, processing_class=tokenizer)
    trainer.train()
    trainer.state.log_history[-2]["rewards/margins"]

Datasets as TRL takes them: records with "prompt", "chosen", "rejected", each a string (standard) or a list of
{"role", "content"} messages (conversational, rendered with the tokenizer's chat template); without "prompt",
the prompt is the longest common prefix of chosen and rejected (TRL's extract_prompt). Tokenization follows TRL's
DPOTrainer: prompt ids = tokenizer(prompt), completion ids = tokenizer(prompt + completion)[len(prompt ids):]
(an eos appended to standard completions; conversational prompts get the generation prompt); the sequence is
cut to max_length keeping its start, and pairs whose prompt alone fills max_length are dropped.

One jitted step per optimizer step: chosen and rejected rows of A micro-batches [A, 2B, S] (B pairs, chosen rows
first), per-token log-probabilities through the chunked `ops.token_logprobs` (no [B, S, V] logits), summed over
completion tokens, the reference's computed in the same program from the same frozen weights with the adapters
dropped (`ref_model=None`, TRL's PEFT behaviour; no second copy of the base), then the loss and TRL's log keys.
The step comes from the trainers' one step factory (unsloth_jax.train.step.make_step), so `mesh` in the config
("data=2,fsdp=4", see unsloth_jax.distributed) runs it sharded, per_device_train_batch_size pairs per device.
"""
from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from unsloth_jax import distributed
from unsloth_jax.errors import DatasetFormatError, TrainingError
from unsloth_jax.families import ModelInputs
from unsloth_jax.train.logprobs import masked_sum, reference_model, token_logps
from unsloth_jax.train.base import RunPlan
from unsloth_jax.models.layer_stack import NO_REMAT, LayerStackPolicy
from unsloth_jax.train.loop import RLTrainerBase, pad_token_id, records_of, round_up
from unsloth_jax.backend import commit_to_devices
from unsloth_jax.train.step import StepLoss, make_step
from unsloth_jax.train.trainer import TrainingArguments
from unsloth_jax.validation import require_choice, require_int, require_real

log = logging.getLogger("unsloth_jax")

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust")


def _check_lengths(cfg) -> None:
    for name in ("max_length", "max_prompt_length", "max_completion_length"):
        if getattr(cfg, name) is not None:
            require_int(name, getattr(cfg, name), minimum=1)


def _parent_post_init(cfg, cls) -> None:
    parent = getattr(super(cls, cfg), "__post_init__", None)
    if parent is not None:
        parent()


@dataclasses.dataclass
class DPOConfig(TrainingArguments):
    """TRL's DPOConfig: the TrainingArguments plus DPO's parameters, with TRL's defaults (learning_rate 1e-6,
    logging_steps 10).

    beta: the deviation from the reference (IPO: tau). loss_type: "sigmoid" (DPO), "hinge", "ipo" (length
    normalised log-ratios, as TRL), "robust", or a list of them combined with loss_weights. label_smoothing: the
    label-flip probability of "robust" and of the conservative "sigmoid" (cDPO, as TRL <= 0.28 computed it),
    in [0, 0.5). max_length: prompt + completion tokens kept (from the start). max_prompt_length /
    max_completion_length (older TRL's names): optional cuts of the prompt (keeping its end) and of each
    completion. reference_free: a zero reference log-probability.
    """

    learning_rate: float = 1e-6
    logging_steps: int = 10
    beta: float = 0.1
    loss_type: str | list = "sigmoid"
    loss_weights: list | None = None
    label_smoothing: float = 0.0
    max_length: int | None = 1024
    max_prompt_length: int | None = None
    max_completion_length: int | None = None
    truncation_mode: str = "keep_start"
    reference_free: bool = False
    precompute_ref_log_probs: bool = False
    # accepted for TRL compatibility and ignored (no dropout runs here; datasets are tokenized in-process)
    disable_dropout: bool = True
    dataset_num_proc: int | None = None

    def __post_init__(self):
        _parent_post_init(self, DPOConfig)
        if isinstance(self.loss_type, str):
            self.loss_type = [self.loss_type]
        self.loss_type = list(self.loss_type)
        for t in self.loss_type:
            require_choice("loss_type", t, DPO_LOSS_TYPES)
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ValueError(f"loss_weights has {len(self.loss_weights)} entries for {len(self.loss_type)} loss types")
        require_real("beta", self.beta, minimum=0, min_exclusive=True)
        require_real("label_smoothing", self.label_smoothing, minimum=0, maximum=0.5, max_exclusive=True)
        require_choice("truncation_mode", self.truncation_mode, ("keep_start",))
        if self.precompute_ref_log_probs:
            raise ValueError("precompute_ref_log_probs=True is not supported: the reference log-probabilities are "
                             "computed in the train step from the shared base weights (no extra memory)")
        _check_lengths(self)


@dataclasses.dataclass
class ORPOConfig(TrainingArguments):
    """TRL's ORPOConfig: beta is ORPO's lambda (the weight of the odds-ratio term); max_length as DPOConfig's;
    TRL's defaults (learning_rate 1e-6, logging_steps 10)."""

    learning_rate: float = 1e-6
    logging_steps: int = 10
    beta: float = 0.1
    max_length: int | None = 1024
    max_prompt_length: int | None = None
    max_completion_length: int | None = None
    # accepted for TRL compatibility and ignored (no dropout runs here; datasets are tokenized in-process)
    disable_dropout: bool = True
    dataset_num_proc: int | None = None

    def __post_init__(self):
        _parent_post_init(self, ORPOConfig)
        require_real("beta", self.beta, minimum=0)
        _check_lengths(self)


# ----------------------------------------------------------------------------------------------- losses
def dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta: float,
             loss_type: str = "sigmoid", label_smoothing: float = 0.0, chosen_lengths=None, rejected_lengths=None):
    """Per-pair DPO losses [B] (f32) from summed completion log-probabilities [B] of policy and reference, by
    TRL's formulas. chosen_lengths / rejected_lengths [B] (completion tokens) are needed by "ipo", which
    compares per-token log-ratios."""
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    z = beta * (chosen_ratio - rejected_ratio)
    if loss_type == "sigmoid":
        return -jax.nn.log_sigmoid(z) * (1 - label_smoothing) - jax.nn.log_sigmoid(-z) * label_smoothing
    if loss_type == "hinge":
        return jax.nn.relu(1 - z)
    if loss_type == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError("loss_type='ipo' needs chosen_lengths and rejected_lengths")
        delta = chosen_ratio / jnp.maximum(chosen_lengths, 1) - rejected_ratio / jnp.maximum(rejected_lengths, 1)
        return (delta - 1 / (2 * beta)) ** 2
    if loss_type == "robust":
        return (-(1 - label_smoothing) * jax.nn.log_sigmoid(z)
                + label_smoothing * jax.nn.log_sigmoid(-z)) / (1 - 2 * label_smoothing)
    raise ValueError(f"unknown DPO loss_type {loss_type!r}; use one of {DPO_LOSS_TYPES}")


def log1mexp(x):
    """log(1 - exp(x)) for x < 0, without cancellation (branch at -ln 2)."""
    return jnp.where(x < -math.log(2), jnp.log1p(-jnp.exp(x)), jnp.log(-jnp.expm1(x)))


def orpo_odds_ratio(chosen_avg_logps, rejected_avg_logps):
    """(log_odds [B], log_sigmoid(log_odds) [B]) from per-token average completion log-probabilities, as TRL:
    log_odds = (lc - lr) - (log(1 - e^lc) - log(1 - e^lr))."""
    log_odds = (chosen_avg_logps - rejected_avg_logps) - (log1mexp(chosen_avg_logps) - log1mexp(rejected_avg_logps))
    return log_odds, jax.nn.log_sigmoid(log_odds)


def preference_metrics(chosen_rewards, rejected_rewards, chosen_logps, rejected_logps) -> dict:
    """TRL's rewards/* and logps/* log keys (means over the pairs)."""
    return {"rewards/chosen": jnp.mean(chosen_rewards), "rewards/rejected": jnp.mean(rejected_rewards),
            "rewards/accuracies": jnp.mean((chosen_rewards > rejected_rewards).astype(jnp.float32)),
            "rewards/margins": jnp.mean(chosen_rewards - rejected_rewards),
            "logps/chosen": jnp.mean(chosen_logps), "logps/rejected": jnp.mean(rejected_logps)}


def dpo_objective(cfg: DPOConfig):
    """pair_loss(policy, reference) -> (loss, metrics) for make_preference_step, per cfg's loss types."""
    weights = cfg.loss_weights or [1.0] * len(cfg.loss_type)

    def pair_loss(pol, ref):
        b = pol["logps"].shape[0] // 2
        pc, pr = pol["logps"][:b], pol["logps"][b:]
        rc, rr = (ref["logps"][:b], ref["logps"][b:]) if ref is not None else (jnp.zeros_like(pc), jnp.zeros_like(pr))
        lc, lr = pol["lengths"][:b], pol["lengths"][b:]
        loss = 0.0
        for loss_type, w in zip(cfg.loss_type, weights):
            loss = loss + w * jnp.mean(dpo_loss(pc, pr, rc, rr, beta=cfg.beta, loss_type=loss_type,
                                                label_smoothing=cfg.label_smoothing, chosen_lengths=lc,
                                                rejected_lengths=lr))
        metrics = preference_metrics(cfg.beta * (pc - rc), cfg.beta * (pr - rr), pc, pr) | logit_metrics(pol)
        return loss, metrics

    return pair_loss


def orpo_objective(cfg: ORPOConfig):
    """pair_loss(policy, None) -> (loss, metrics): TRL's ORPO, nll(chosen) - beta * mean(log_sigmoid(log_odds)),
    the nll over every real token of the chosen rows (prompt included, as TRL computes it)."""

    def pair_loss(pol, ref):
        b = pol["logps"].shape[0] // 2
        avg = pol["logps"] / jnp.maximum(pol["lengths"], 1)
        ac, ar = avg[:b], avg[b:]
        nll = -jnp.sum(pol["all_logps"][:b]) / jnp.maximum(jnp.sum(pol["all_lengths"][:b]), 1)
        log_odds, ratio = orpo_odds_ratio(ac, ar)
        loss = nll - cfg.beta * jnp.mean(ratio)
        metrics = preference_metrics(cfg.beta * ac, cfg.beta * ar, ac, ar) | logit_metrics(pol)
        metrics.update({"nll_loss": nll, "log_odds_ratio": jnp.mean(ratio), "log_odds_chosen": jnp.mean(log_odds)})
        return loss, metrics

    return pair_loss


# ------------------------------------------------------------------------------------------------ step
def sequence_stats(model, batch: dict, *, remat: LayerStackPolicy = NO_REMAT, chunk: int = 1024) -> dict:
    """Per-row sums over rows [R, S]: logps / lengths over completion tokens (completion_mask), all_logps /
    all_lengths over every real token after the first (attention_mask), all f32 [R]."""
    lp, mean_logits = token_logps(model, ModelInputs(batch["input_ids"], batch["attention_mask"]), remat=remat,
                                  chunk=chunk, mean_logits=True)
    completion = batch["completion_mask"][:, 1:]
    real = batch["attention_mask"][:, 1:]
    return {"logps": masked_sum(lp, completion), "lengths": jnp.sum(completion, axis=-1).astype(jnp.float32),
            "all_logps": masked_sum(lp, real), "all_lengths": jnp.sum(real, axis=-1).astype(jnp.float32),
            "logit_sums": masked_sum(mean_logits, completion)}


def logit_metrics(pol: dict) -> dict:
    """TRL's logits/chosen and logits/rejected: the policy's logits averaged over the vocabulary and over every
    completion token of the chosen (first half) or rejected rows."""
    b = pol["logps"].shape[0] // 2
    sums, lengths = pol["logit_sums"], pol["lengths"]
    return {"logits/chosen": jnp.sum(sums[:b]) / jnp.maximum(jnp.sum(lengths[:b]), 1),
            "logits/rejected": jnp.sum(sums[b:]) / jnp.maximum(jnp.sum(lengths[b:]), 1)}


def preference_loss(graphdef: nnx.GraphDef, pair_loss, *, needs_reference: bool,
                    ref_graphdef: nnx.GraphDef | None = None, chunk: int = 1024) -> StepLoss:
    """The preference trainers' StepLoss: `pair_loss(policy stats, reference stats or None) -> (loss, metrics)`
    of each micro-batch, averaged over the micro-batches (TRL/transformers' accumulation: the gradient divided
    by A), plus tokens (real tokens of the batch)."""

    def micro(trainable, frozen, ref_state, mb, policy):
        model = nnx.merge(graphdef, trainable, frozen)
        pol = sequence_stats(model, mb, remat=policy, chunk=chunk)
        ref = None
        if needs_reference:
            if ref_graphdef is None:
                ref_model = reference_model(graphdef, trainable, frozen, ref_state)
            else:
                ref_model = nnx.merge(ref_graphdef, jax.lax.stop_gradient(ref_state))
            ref = jax.lax.stop_gradient(sequence_stats(ref_model, mb, chunk=chunk))
        return pair_loss(pol, ref)

    def finish(value, stats, batch):
        a = batch["input_ids"].shape[0]
        metrics = {"loss": value / a, **{k: v / a for k, v in stats.items()},
                   "tokens": jnp.sum(batch["attention_mask"])}
        return metrics, jnp.float32(a)

    return StepLoss(micro, finish)


def make_preference_step(graphdef: nnx.GraphDef, optimizer, pair_loss, *, needs_reference: bool,
                         ref_graphdef: nnx.GraphDef | None = None, remat="full", chunk: int = 1024,
                         train: bool = True, mesh=None):
    """A jitted step(trainable, frozen, opt_state, ref_state, batch) -> (trainable, opt_state, metrics)
    (train.step.make_step with `preference_loss`).

    batch: int32 [A, 2B, S] input_ids / attention_mask / completion_mask, chosen rows first in each
    micro-batch. ref_state: None or the pre-training non-LoRA trainable state (reference = the policy's base,
    from `frozen` with adapters dropped), or, with ref_graphdef, the full state of a separate reference model.
    The loss is the mean of the micro-batches' losses (TRL/transformers' accumulation); metrics are their means
    plus grad_norm, skipped and tokens. train=False gives eval(trainable, frozen, ref_state, batch) -> metrics.
    remat: the layer-stack policy (make_step parses it); mesh: make_step's (the rows of a pair's chosen and
    rejected halves may sit on different devices: the loss reads them as one global batch).
    """
    loss = preference_loss(graphdef, pair_loss, needs_reference=needs_reference, ref_graphdef=ref_graphdef,
                           chunk=chunk)
    return make_step(graphdef, optimizer, loss, remat=remat, mesh=mesh, reference=True, train=train)


# ------------------------------------------------------------------------------------------------ data
def is_conversational(record: dict) -> bool:
    """True when the record's prompt / chosen / rejected / completion is a list of {"role", ...} messages."""
    for key in ("prompt", "chosen", "rejected", "completion", "messages"):
        value = record.get(key)
        if isinstance(value, list) and value and isinstance(value[0], dict) and "role" in value[0]:
            return True
    return False


def extract_prompt(record: dict) -> dict:
    """TRL's implicit-prompt rule: the longest common prefix (characters, or whole messages) of chosen and
    rejected is the prompt; a space just before the split stays with the completions."""
    chosen, rejected = record["chosen"], record["rejected"]
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return {**record, "prompt": chosen[:idx], "chosen": chosen[idx:], "rejected": rejected[idx:]}


def encode_prompt(tokenizer, prompt) -> list[int]:
    """Token ids of a prompt: tokenizer(prompt) for a string (its special tokens, e.g. BOS), the chat template
    with the generation prompt for a list of messages."""
    if isinstance(prompt, list):
        return list(tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True,
                                                  return_dict=True)["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


def _completion_ids(tokenizer, prompt, completion, prompt_ids: list[int], where: str) -> list[int]:
    if isinstance(prompt, list):
        if not isinstance(completion, list):
            raise DatasetFormatError(f"{where}: the prompt is a list of messages but the completion is not")
        full = list(tokenizer.apply_chat_template(prompt + completion, tokenize=True, return_dict=True)["input_ids"])
    else:
        if not isinstance(completion, str):
            raise DatasetFormatError(f"{where}: the prompt is a string but the completion is "
                                     f"{type(completion).__name__}")
        eos = tokenizer.eos_token or ""
        text = completion if (not eos or completion.endswith(eos)) else completion + eos
        full = list(tokenizer(prompt + text)["input_ids"])
    if full[:len(prompt_ids)] != prompt_ids:
        log.warning("unsloth_jax: %s: the tokenized prompt is not a prefix of the tokenized prompt + completion "
                    "(tokenizer merges across the boundary); the completion starts after the prompt's length", where)
    return full[len(prompt_ids):]


def tokenize_pairs(dataset, tokenizer, *, max_length: int | None, max_prompt_length: int | None = None,
                   max_completion_length: int | None = None, name: str = "train_dataset") -> list[dict]:
    """Preference records -> [{"prompt_ids", "chosen_ids", "rejected_ids"}] by TRL's rules (module docstring).
    Records already tokenized (prompt_ids / chosen_ids / rejected_ids) pass through."""
    out, dropped = [], 0
    for i, rec in enumerate(records_of(dataset)):
        where = f"{name}[{i}]"
        if not isinstance(rec, dict):
            raise DatasetFormatError(f"{where}: expected a dict with prompt/chosen/rejected, got {type(rec).__name__}")
        if {"prompt_ids", "chosen_ids", "rejected_ids"} <= set(rec):
            ex = {k: list(rec[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
        else:
            missing = [k for k in ("chosen", "rejected") if k not in rec]
            if missing:
                raise DatasetFormatError(f"{where}: missing key(s) {missing}; preference records need 'chosen' and "
                                         f"'rejected' (and usually 'prompt'), got keys {sorted(rec)}")
            if "prompt" not in rec:
                rec = extract_prompt(rec)
            prompt_ids = encode_prompt(tokenizer, rec["prompt"])
            ex = {"prompt_ids": prompt_ids,
                  "chosen_ids": _completion_ids(tokenizer, rec["prompt"], rec["chosen"], prompt_ids, where),
                  "rejected_ids": _completion_ids(tokenizer, rec["prompt"], rec["rejected"], prompt_ids, where)}
        if max_prompt_length is not None:
            ex["prompt_ids"] = ex["prompt_ids"][-max_prompt_length:]
        if max_completion_length is not None:
            ex["chosen_ids"] = ex["chosen_ids"][:max_completion_length]
            ex["rejected_ids"] = ex["rejected_ids"][:max_completion_length]
        if max_length is not None and len(ex["prompt_ids"]) >= max_length:
            dropped += 1
            continue
        if not ex["chosen_ids"] or not ex["rejected_ids"]:
            raise DatasetFormatError(f"{where}: the chosen or rejected completion is empty after tokenization")
        out.append(ex)
    if dropped:
        log.warning("unsloth_jax: %s: dropped %d pairs whose prompt alone fills max_length=%s", name, dropped,
                    max_length)
    return out


def pair_batch(pairs: list[dict], pad_id: int, max_length: int | None) -> dict:
    """Rows [2B, S] (chosen rows, then rejected) of prompt + completion cut to max_length (keeping the start),
    right padded to a multiple of loop.SEQUENCE_MULTIPLE: int32 input_ids, attention_mask, completion_mask."""
    rows = [(p["prompt_ids"], p["chosen_ids"]) for p in pairs] + [(p["prompt_ids"], p["rejected_ids"]) for p in pairs]
    seqs = [(list(pr) + list(c))[:max_length] if max_length else list(pr) + list(c) for pr, c in rows]
    length = round_up(max(len(s) for s in seqs))
    ids = np.full((len(seqs), length), pad_id, np.int32)
    mask = np.zeros((len(seqs), length), np.int32)
    completion = np.zeros((len(seqs), length), np.int32)
    for r, ((prompt, _), seq) in enumerate(zip(rows, seqs)):
        ids[r, :len(seq)] = seq
        mask[r, :len(seq)] = 1
        completion[r, len(prompt):len(seq)] = 1
    return {"input_ids": ids, "attention_mask": mask, "completion_mask": completion}


def stack_micro_batches(micro: list[dict], pad_id: int) -> dict:
    """[A, R, S] arrays from A micro-batches of [R, S_i] (right padded to the longest)."""
    length = max(m["input_ids"].shape[1] for m in micro)
    out = {}
    for key in micro[0]:
        fill = pad_id if key == "input_ids" else 0
        out[key] = np.stack([np.pad(m[key], ((0, 0), (0, length - m[key].shape[1])), constant_values=fill)
                             for m in micro])
    return out


class _PairOrder:
    """Which pairs form micro-batch g: a seeded permutation per epoch, B pairs per batch; an epoch's last short
    batch is filled from the start of the same permutation (one compiled shape), or dropped with drop_last."""

    def __init__(self, n: int, batch_size: int, seed: int, drop_last: bool):
        if n < batch_size and drop_last:
            raise TrainingError(f"{n} pairs cannot fill one batch of {batch_size} with dataloader_drop_last=True")
        self.n, self.b, self.seed = n, batch_size, seed
        self.per_epoch = n // batch_size if drop_last else -(-n // batch_size)

    def indices(self, g: int) -> np.ndarray:
        epoch, i = divmod(g, self.per_epoch)
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return np.resize(perm, max(self.n, (i + 1) * self.b))[i * self.b:(i + 1) * self.b]


# --------------------------------------------------------------------------------------------- trainers
class _PairTrainer(RLTrainerBase):
    """What DPOTrainer and ORPOTrainer supply to the trainer base (unsloth_jax.train.base): the tokenized pairs,
    the batch of a step (pairs of micro-batch g = step x gradient_accumulation_steps + j, a seeded permutation
    per epoch), the jitted preference step, and evaluate()."""

    config_class = TrainingArguments
    needs_reference = False

    def __init__(self, model, ref_model=None, args=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, tokenizer=None, data_collator=None, callbacks=None, **kwargs):
        args = self._args_with(args, kwargs)
        super().__init__(model, args, tokenizer, processing_class, callbacks)
        if data_collator is not None:
            raise TypeError(f"{type(self).__name__}: data_collator is not supported (batches are built internally)")
        if ref_model is not None and ref_model is model:
            raise TrainingError("ref_model is the model being trained; pass ref_model=None to use the base model "
                                "with the adapters switched off")
        self.ref_model = ref_model
        if train_dataset is None:
            raise TrainingError(f"{type(self).__name__} needs a train_dataset of prompt/chosen/rejected records")
        lengths = dict(max_length=args.max_length, max_prompt_length=args.max_prompt_length,
                       max_completion_length=args.max_completion_length)
        self.train_pairs = tokenize_pairs(train_dataset, self.tokenizer, **lengths)
        if not self.train_pairs:
            raise TrainingError("the preference dataset is empty after tokenization")
        self.eval_pairs = (tokenize_pairs(eval_dataset, self.tokenizer, name="eval_dataset", **lengths)
                           if eval_dataset is not None else None)
        self.pad_id = pad_token_id(self.tokenizer, model)
        self._compiled = None  # (key, schedule, optimizer, jitted step), kept between train() calls
        self._ref_state = None  # the step's ref_state argument of the last train()
        self._eval_fn = None  # (key, jitted eval step), kept between evaluations

    def _args_with(self, args, kwargs):
        """args (default: the config class's defaults) with TRL config fields given to the trainer applied
        (older TRL took beta, max_length, ... as trainer arguments); anything else is a TypeError."""
        cls = self.config_class
        args = args if args is not None else cls()
        if not isinstance(args, cls):
            raise TypeError(f"{type(self).__name__}: args must be a {cls.__name__}, got {type(args).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in kwargs if k not in fields]
        if unknown:
            raise TypeError(f"{type(self).__name__}() got unexpected keyword argument(s): {', '.join(unknown)}")
        return dataclasses.replace(args, **kwargs) if kwargs else args

    def objective(self):
        raise NotImplementedError

    def _batch(self, order: _PairOrder, pairs: list[dict], start: int, count: int) -> dict:
        micro = [pair_batch([pairs[i] for i in order.indices(g)], self.pad_id, self.args.max_length)
                 for g in range(start, start + count)]
        return stack_micro_batches(micro, self.pad_id)

    def _steps(self, order: _PairOrder) -> int:
        a = self.args
        if a.max_steps and a.max_steps > 0:
            return int(a.max_steps)
        return max(1, int(math.ceil(a.num_train_epochs * order.per_epoch / a.gradient_accumulation_steps)))

    def _needs_reference(self) -> bool:
        return self.needs_reference and not getattr(self.args, "reference_free", False)

    def _reference_parts(self, ref_trainable):
        """(ref_graphdef or None, the state the step's ref_state argument gets)."""
        if self.ref_model is None:
            return None, ref_trainable
        return nnx.split(self.ref_model)

    # ------------------------------------------------------------------------ for the trainer base
    def prepare_run(self) -> RunPlan:
        args, model = self.args, self.model
        self.mesh = mesh = distributed.resolve_mesh(args.mesh, f"{type(args).__name__}.mesh")
        shards = distributed.batch_shards(mesh) if mesh is not None else 1  # a step sees the global batch
        self._order = order = _PairOrder(len(self.train_pairs), args.per_device_train_batch_size * shards,
                                         args.seed, args.dataloader_drop_last)
        total = self._steps(order)
        needs_ref = self._needs_reference()
        graphdef, trainable, frozen, ref_trainable = self.split_state(needs_ref and self.ref_model is None)
        ref_graphdef, self._ref_state = self._reference_parts(ref_trainable)
        # The jitted step is kept for a later train() with the same model structure, step count and arguments
        # (the seed aside: it only orders the pairs), so training again does not compile again.
        key = (graphdef, ref_graphdef, total, model.gradient_checkpointing, repr(dataclasses.replace(args, seed=0)),
               mesh)
        if self._compiled is None or self._compiled[0] != key:
            schedule, optimizer = self.make_optimizer(total)
            step_fn = make_preference_step(graphdef, optimizer, self.objective(), needs_reference=needs_ref,
                                           ref_graphdef=ref_graphdef, remat=model.gradient_checkpointing, mesh=mesh)
            self._compiled = (key, schedule, optimizer, step_fn)
        _, schedule, optimizer, self._step_fn = self._compiled
        opt_state = commit_to_devices(optimizer.init(trainable))  # committed, like the step's outputs: one compile
        if mesh is not None:  # placed once, as the step's shardings have them
            trainable, frozen, opt_state = self.state_on_mesh(mesh, trainable, frozen, opt_state)
            self._ref_state = distributed.put(self._ref_state, distributed.state_shardings(mesh, self._ref_state))
        self._frozen = frozen
        accum = args.gradient_accumulation_steps
        return RunPlan(total=total, schedule=schedule, epoch_at=lambda done: done * accum / order.per_epoch,
                       planned_samples=total * accum * order.b,
                       summary=f"{len(self.train_pairs)} pairs, {total} steps, beta={args.beta}",
                       train_state={"trainable": trainable, "opt_state": opt_state})

    def next_batch(self, step: int):
        accum = self.args.gradient_accumulation_steps
        return jax.device_put(self._batch(self._order, self.train_pairs, step * accum, accum))

    def run_step(self, state: dict, batch) -> tuple[dict, dict]:
        trainable, opt_state, metrics = self._step_fn(state["trainable"], self._frozen, state["opt_state"],
                                                      self._ref_state, batch)
        return {"trainable": trainable, "opt_state": opt_state}, metrics

    def has_eval_data(self) -> bool:
        return bool(self.eval_pairs)

    def evaluate(self) -> dict:
        """eval_loss and TRL's eval_rewards/*, eval_logps/* over eval_dataset (means over its batches) of the
        model's current weights."""
        if not self.eval_pairs:
            raise TrainingError("evaluate() needs an eval_dataset")
        args = self.args
        needs_ref = self._needs_reference()
        graphdef, trainable, frozen, ref_trainable = self.split_state(needs_ref and self.ref_model is None)
        if ref_trainable is not None and self._ref_state is not None:
            ref_trainable = self._ref_state  # after (or while) training: the values training started from
        ref_graphdef, ref_state = self._reference_parts(ref_trainable)
        key = (graphdef, ref_graphdef, needs_ref)
        if self._eval_fn is None or self._eval_fn[0] != key:
            self._eval_fn = (key, make_preference_step(graphdef, None, self.objective(), needs_reference=needs_ref,
                                                       ref_graphdef=ref_graphdef, remat="none", train=False))
        eval_fn = self._eval_fn[1]
        order = _PairOrder(len(self.eval_pairs), args.per_device_eval_batch_size, args.seed, False)
        sums: dict[str, float] = {}
        for g in range(order.per_epoch):
            idx = np.arange(g * order.b, min((g + 1) * order.b, order.n))
            batch = stack_micro_batches([pair_batch([self.eval_pairs[i] for i in idx], self.pad_id, args.max_length)],
                                        self.pad_id)
            m = jax.device_get(eval_fn(trainable, frozen, ref_state, batch))
            for k, v in m.items():
                if k != "tokens":
                    sums[k] = sums.get(k, 0.0) + float(v) * len(idx)
        return {f"eval_{k}": v / order.n for k, v in sums.items()}


class DPOTrainer(_PairTrainer):
    """TRL's DPOTrainer for a LoRA model: `ref_model=None` is the base with the adapters switched off (the same
    weights, no copy); another Model may be passed as an explicit reference. Log keys: loss, rewards/chosen,
    rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected, logits/chosen,
    logits/rejected."""

    name = "DPO"
    config_class = DPOConfig
    needs_reference = True

    def objective(self):
        return dpo_objective(self.args)


class ORPOTrainer(_PairTrainer):
    """TRL's ORPOTrainer (no reference model). Log keys: loss, rewards/* (beta x average log-probabilities),
    logps/chosen, logps/rejected (per-token averages), logits/chosen, logits/rejected, nll_loss, log_odds_ratio,
    log_odds_chosen."""

    name = "ORPO"
    config_class = ORPOConfig

    def __init__(self, model, args=None, train_dataset=None, eval_dataset=None, processing_class=None,
                 tokenizer=None, data_collator=None, **kwargs):
        super().__init__(model, None, args, train_dataset, eval_dataset, processing_class, tokenizer, data_collator,
                         **kwargs)

    def objective(self):
        return orpo_objective(self.args)


__all__ = ["DPOConfig", "DPOTrainer", "ORPOConfig", "ORPOTrainer", "DPO_LOSS_TYPES", "dpo_loss", "orpo_odds_ratio",
           "log1mexp", "tokenize_pairs", "pair_batch", "make_preference_step", "sequence_stats"]
