"""SFTTrainer and TrainingArguments with the names TRL/Unsloth users type, over the functional train step.

SFTTrainer supplies the trainer base (unsloth_jax.train.base, which runs the loop, logging, checkpoints, resume
and evaluation of every trainer) with its tokenized examples, the loader's batches, the jitted step
(make_train_step, with the step memory plan printed before step 1) and the eval loss.

`SFTTrainer(...).train()` tokenizes the dataset, runs the jitted step with a progress bar, logs to stdout,
`output_dir/metrics.jsonl`, `trainer.state.log_history` and the `report_to` integrations (TensorBoard), saves
orbax checkpoints every `save_steps`, resumes exactly, writes the trained weights (LoRA, or every weight after
from_pretrained(full_finetuning=True)) back into the model (in place, `nnx.update`, as HF and Unsloth do) and
returns a `TrainOutput` (`trainer_stats.metrics["train_runtime"]`).

Several devices: `TrainingArguments(mesh="data=2,fsdp=4")` (see unsloth_jax.distributed) runs the same step
sharded over a device mesh; `per_device_train_batch_size` is per device, so a step sees per_device * data *
fsdp rows (times gradient_accumulation_steps). After training the model's weights stay on the mesh. On
several hosts each process loads its own rows of each batch and only process 0 logs, writes metrics.jsonl and
TensorBoard events.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from unsloth_jax import backend, distributed, lora, ops
from unsloth_jax.data import DataLoader, build_examples
from unsloth_jax.data.vision import UnslothVisionDataCollator
from unsloth_jax.data.vision_loader import VisionLoader
from unsloth_jax.data.pretokenized import is_pretokenized, pretokenized_examples
from unsloth_jax.errors import TrainingError
from unsloth_jax.families import TEXT, Family, family_of
from unsloth_jax.train.base import RunPlan, TrainerBase, as_records
from unsloth_jax.train.reporting import resolve_report_to
from unsloth_jax.train.state import planned_train_samples
from unsloth_jax.backend import commit_to_devices
from unsloth_jax.train.step import eval_loss, make_train_step
from unsloth_jax.train.validation import check_max_seq_length, validate_sft_config, validate_training_arguments

log = logging.getLogger("unsloth_jax")


@dataclasses.dataclass
class TrainingArguments:
    """The TRL/transformers training arguments unsloth_jax understands (others are rejected by name).

    Values are checked here, at construction: TypeError for a wrong type (learning_rate="2e-4"), ValueError for
    a value out of range (per_device_train_batch_size=0); report_to becomes a list, as in transformers.
    """

    output_dir: str = "outputs"
    per_device_train_batch_size: int = 2
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 2e-4
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    num_train_epochs: float = 1.0
    max_steps: int = -1
    lr_scheduler_type: str = "linear"
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    logging_steps: int = 1
    save_steps: int = 500
    save_total_limit: int | None = None
    seed: int = 3407
    optim: str = "adamw_torch"
    bf16: bool | None = None
    fp16: bool | None = None
    dataloader_drop_last: bool = False
    report_to: str | list | None = "none"  # "tensorboard", "none"/None/[], "all", or a list
    logging_dir: str | None = None  # TensorBoard event files; None: OUTPUT_DIR/runs/<datetime>_<host>
    max_nonfinite_steps: int = 5  # consecutive skipped (non-finite) steps before training stops
    logging_first_step: bool = True
    # An output_dir holding an earlier run's files (metrics.jsonl, checkpoint-N, runs/) is refused unless
    # overwrite_output_dir=True (they are removed when train() starts) or the run resumes.
    overwrite_output_dir: bool = False
    # train()'s default resume_from_checkpoint: True (the newest checkpoint in output_dir) or a checkpoint path.
    resume_from_checkpoint: str | bool | None = None
    # With an eval_dataset: None evaluates once, after training; "no" never; "steps" every eval_steps steps (None:
    # logging_steps) and after training; "epoch" after each epoch and after training.
    eval_strategy: str | None = None
    eval_steps: int | None = None
    # Several devices: a jax.sharding.Mesh from unsloth_jax.distributed.make_mesh, "data=2,fsdp=4" or
    # {"data": 2, "fsdp": 4}; None trains on one device. Checked (and built) when train() starts.
    mesh: object = None

    def __post_init__(self):
        validate_training_arguments(self)
        self.report_to = resolve_report_to(self.report_to)


@dataclasses.dataclass
class SFTConfig(TrainingArguments):
    """TRL's SFTConfig: TrainingArguments plus the SFT data arguments, which SFTTrainer reads when its own keyword
    arguments do not give them (SFTTrainer(model=..., args=SFTConfig(...), train_dataset=..., processing_class=...)).

    dataset_text_field: the field of plain-text records. max_length (TRL's name; max_seq_length, its older one, is
    the same value): the longest training sequence; None (unlike TRL's 1024): the model's max_seq_length, as
    Unsloth. packing: several examples per row. completion_only_loss: the loss on the completion of
    prompt-completion records only (None: yes, as TRL). assistant_only_loss: only False (for chat data use
    unsloth_jax.data.train_on_responses_only). dataset_num_proc: accepted, unused. remove_unused_columns and
    dataset_kwargs (Unsloth's vision notebooks: False and {"skip_prepare_dataset": True}, which also lets
    dataset_text_field be ""): accepted, unused.
    """

    dataset_text_field: str = "text"
    max_length: int | None = None
    max_seq_length: int | None = None
    packing: bool = False
    completion_only_loss: bool | None = None
    assistant_only_loss: bool = False
    dataset_num_proc: int | None = None
    # Unsloth's vision notebooks pass these with a data collator; accepted (the collator prepares the data)
    remove_unused_columns: bool = True
    dataset_kwargs: dict | None = None

    def __post_init__(self):
        super().__post_init__()
        validate_sft_config(self)
        self.max_length = self.max_seq_length = (self.max_length if self.max_length is not None
                                                 else self.max_seq_length)


class StepMemoryPlan(str):
    """The one-line memory summary of a compiled train step (a str), with the byte counts as attributes."""

    device_bytes: int
    host_bytes: int
    limit_bytes: int | None


def plan_step_memory(step_fn, state: tuple, batch: dict, longest: int, max_seq_length: int,
                     family: Family = TEXT) -> StepMemoryPlan:
    """Compile the train step for the largest batch the loader yields (sequence length `longest`) and read XLA's
    memory analysis of it, before step 1. Raises TrainingError when the step needs more device memory than the
    device has, naming the largest max_seq_length that would fit (estimated from the step's temporaries, which
    grow linearly with the tokens). The jit cache keeps the compiled step, so step 1 does not compile again."""
    # the [A, B, S] text fields and the family's image fields along the rows (Qwen2.5-VL's mrope_positions
    # [A, 3, B, S]) at the longest length; its other image fields (pixel_values, layouts) as they are
    def at_longest(k, v):
        seq = k in family.row_fields or (v.ndim == 3 and not family.is_image_field(k))
        return jax.ShapeDtypeStruct((*v.shape[:-1], longest) if seq else v.shape, v.dtype)

    shapes = {k: at_longest(k, v) for k, v in batch.items()}
    compiled = step_fn.lower(*state, shapes).compile()
    ma = compiled.memory_analysis()
    if ma is None:
        line = StepMemoryPlan("step memory: not reported by this backend")
        line.device_bytes = line.host_bytes = 0
        line.limit_bytes = None
        return line
    fixed = ma.argument_size_in_bytes + ma.output_size_in_bytes - getattr(ma, "alias_size_in_bytes", 0)
    device = fixed + ma.temp_size_in_bytes
    host = getattr(ma, "host_temp_size_in_bytes", 0) + getattr(ma, "host_argument_size_in_bytes", 0)
    limit = backend.device_memory_limit()
    gib = 2 ** 30
    text = f"step memory (XLA's analysis, S={longest}): {device / gib:.2f} GiB on the device"
    if host:
        text += f" + {host / gib:.2f} GiB pinned host (offloaded activations)"
        host_limit = backend.host_memory_limit()
        if host_limit and host > 0.9 * host_limit:
            raise TrainingError(f"the train step at sequence length {longest} (max_seq_length={max_seq_length}) "
                                f"offloads {host / gib:.1f} GiB of activations to pinned host memory, but this "
                                f"machine has {host_limit / gib:.1f} GiB; use "
                                "use_gradient_checkpointing='unsloth' (layer inputs only) instead of "
                                "'offload_attention', get_peft_model(layers_per_checkpoint=4) (every 4th layer "
                                "input), use_gradient_checkpointing=True (on the device), or a shorter "
                                "max_seq_length")
    if limit:
        text += f" of {limit / gib:.1f} GiB"
        if device > 0.98 * limit:
            per_token = ma.temp_size_in_bytes / max(longest, 1)
            fits = int((0.95 * limit - fixed) / max(per_token, 1))
            hint = (f"the largest max_seq_length that fits is about {fits:,d}" if fits > 0 else
                    "even the weights and optimizer state do not fit")
            raise TrainingError(f"the train step at sequence length {longest} (max_seq_length={max_seq_length}) "
                                f"needs {device / gib:.1f} GiB of device memory, but the device has "
                                f"{limit / gib:.1f} GiB; {hint} (or lower per_device_train_batch_size, use "
                                "use_gradient_checkpointing='unsloth', get_peft_model(layers_per_checkpoint=4) "
                                "for long sequences, or load_in_4bit=True)")
    line = StepMemoryPlan(text)
    line.device_bytes, line.host_bytes, line.limit_bytes = int(device), int(host), limit
    return line


def _pad_to(batch: dict, length: int, pad_id: int) -> dict:
    s = batch["input_ids"].shape[1]
    if s == length:
        return batch
    fill = {"input_ids": pad_id, "labels": -100}
    return {k: np.pad(v, ((0, 0), (0, length - s)), constant_values=fill.get(k, 0)) for k, v in batch.items()}




def _vision_collator(data_collator, model):
    """SFTTrainer's data_collator: None, or an UnslothVisionDataCollator for a vision-language model."""
    if data_collator is None:
        return None
    if not isinstance(data_collator, UnslothVisionDataCollator):
        raise TypeError(f"SFTTrainer(data_collator=...): only unsloth_jax's UnslothVisionDataCollator is supported "
                        f"(text data is tokenized and batched by the trainer), got {type(data_collator).__name__}")
    if not hasattr(model, "vl_config"):
        raise TrainingError("data_collator=UnslothVisionDataCollator needs a vision-language model "
                            "(FastVisionModel.from_pretrained)")
    return data_collator


class SFTTrainer(TrainerBase):
    """Supervised fine-tuning of a LoRA (or fully trained) model on the shared trainer loop (see the module
    docstring and unsloth_jax.train.base). It supplies the tokenized examples, the loader's batches, the jitted
    step (make_train_step) and the eval loss."""

    def __init__(self, model, tokenizer=None, train_dataset=None, eval_dataset=None,
                 dataset_text_field: str | None = None, max_seq_length: int | None = None, formatting_func=None,
                 packing: bool | None = None, args: TrainingArguments | None = None, processing_class=None,
                 dataset_num_proc=None, callbacks=None, data_collator=None, **kwargs):
        """dataset_text_field, max_seq_length and packing not given here come from an SFTConfig `args` (TRL's
        way), else default to "text", the model's max_seq_length and False. data_collator: an
        UnslothVisionDataCollator (unsloth_jax.data.vision) to train a FastVisionModel on chat records with
        images; the records are checked here and collated batch by batch (no packing)."""
        if kwargs:
            raise TypeError(f"SFTTrainer() got unexpected keyword argument(s): {', '.join(kwargs)}")
        self.model = model
        self.tokenizer = tokenizer if tokenizer is not None else processing_class
        self.data_collator = _vision_collator(data_collator, model)
        check_max_seq_length(max_seq_length)  # 0 is an error, not "not given"
        self.args = args or TrainingArguments()
        if dataset_text_field is None:
            dataset_text_field = getattr(self.args, "dataset_text_field", "text")
        if max_seq_length is None:
            max_seq_length = getattr(self.args, "max_length", None)
        if packing is None:
            packing = getattr(self.args, "packing", False)
        self.completion_only_loss = getattr(self.args, "completion_only_loss", None) is not False
        self.max_seq_length = int(max_seq_length if max_seq_length is not None else model.max_seq_length)
        self.packing = packing
        if self.data_collator is not None and packing:
            raise TrainingError("packing=True is not supported with a vision data collator; use packing=False")
        if self.data_collator is not None and self.data_collator.max_seq_length is None:
            self.data_collator.max_seq_length = self.max_seq_length  # rows are cut (never inside an image)
        if model.lora is None and not model.full_finetuning:
            raise TrainingError("the model has no LoRA adapters: call FastLanguageModel.get_peft_model(model, ...) "
                                "first (or load it with full_finetuning=True to train every weight)")
        if train_dataset is None:
            raise TrainingError("SFTTrainer needs a train_dataset")
        self.train_examples = self._tokenize(train_dataset, dataset_text_field, formatting_func)
        self.eval_examples = (self._tokenize(eval_dataset, dataset_text_field, formatting_func)
                              if eval_dataset is not None else None)
        if not self.train_examples:
            raise TrainingError("the training dataset is empty after tokenization")
        super().__init__(model, self.args, callbacks)
        self.kernel_choices = "none traced"  # what each op chose in the last train() call's step

    # ------------------------------------------------------------------------------------------ data
    def _tokenize(self, dataset, text_field, formatting_func) -> list[dict]:
        records = as_records(dataset)
        if self.data_collator is not None:  # vision records: checked now, collated per batch by the loader
            self.data_collator.check(records)
            return records
        if is_pretokenized(records):
            return pretokenized_examples(records, self.model.config.vocab_size)
        if self.tokenizer is None:
            raise TrainingError("a tokenizer is needed to tokenize a text dataset")
        return build_examples(records, self.tokenizer, self.max_seq_length, text_field, formatting_func,
                              completion_only_loss=self.completion_only_loss)

    def _pad_id(self) -> int:
        tok = self.tokenizer
        for cand in (getattr(tok, "pad_token_id", None), getattr(tok, "eos_token_id", None),
                     self.model.config.pad_token_id, 0):
            if cand is not None:
                return int(cand)
        return 0

    def _loader(self, examples, batch_size, shuffle) -> DataLoader:
        if self.data_collator is not None:
            v = self.model.vl_config.vision
            return VisionLoader(examples, self.data_collator, batch_size, self.max_seq_length, shuffle=shuffle,
                                seed=self.args.seed, drop_last=self.args.dataloader_drop_last,
                                image_shape=(v.num_channels, v.image_size, v.image_size)
                                if hasattr(v, "image_size") else ())  # Qwen2.5-VL: patches, not images
        return DataLoader(examples, batch_size, self.max_seq_length, self._pad_id(), packing=self.packing,
                          shuffle=shuffle, seed=self.args.seed, drop_last=self.args.dataloader_drop_last)

    def _step_batch(self, loader: DataLoader, step: int, rows: slice | None = None) -> dict:
        """The [A, B, S] batch of optimizer step `step` (A = gradient_accumulation_steps), a pure function of step
        (only `rows` of each micro-batch when given: one host's share)."""
        accum = self.args.gradient_accumulation_steps
        micro = []
        for j in range(accum):
            g = step * accum + j
            micro.append(loader.batch(g // len(loader), g % len(loader), rows))
        if isinstance(loader, VisionLoader):
            return loader.stack(micro)
        length = max(m["input_ids"].shape[1] for m in micro)
        micro = [_pad_to(m, length, self._pad_id()) for m in micro]
        keys = [k for k in micro[0] if self.packing or k != "segment_ids"]  # unpacked rows: right padding only
        return {k: np.stack([m[k] for m in micro]) for k in keys}

    def _device_batch(self, loader: DataLoader, step: int, mesh):
        """The step's batch on the device(s): on a mesh, the global batch assembled from this host's rows."""
        if mesh is None:
            return jax.device_put(self._step_batch(loader, step))
        if isinstance(loader, VisionLoader):  # one process: the step places the whole batch by its row axes
            return self._step_batch(loader, step)
        rows = distributed.host_rows(mesh, loader.batch_size)
        return distributed.global_batch(mesh, self._step_batch(loader, step, rows), loader.batch_size)

    # ----------------------------------------------------------------------------------------- train
    def make_optimizer(self, total: int, warmup: int, embedding_learning_rate: float | None = None):
        """(optax optimizer, learning-rate schedule) of a run of `total` steps with `warmup` warmup steps; with
        embedding_learning_rate, the embedding and head leaves follow the same schedule from that rate."""
        return self.build_optimizer(total, warmup, embedding_learning_rate)

    def total_steps(self, loader: DataLoader) -> int:
        if self.args.max_steps and self.args.max_steps > 0:
            return int(self.args.max_steps)
        per_epoch = len(loader) / self.args.gradient_accumulation_steps
        return max(1, int(math.ceil(self.args.num_train_epochs * per_epoch)))

    def prepare_run(self) -> RunPlan:
        args, model = self.args, self.model
        self.mesh = mesh = distributed.resolve_mesh(args.mesh, "TrainingArguments.mesh")
        if mesh is not None and self.data_collator is not None and jax.process_count() > 1:
            raise TrainingError("TrainingArguments.mesh: vision-language batches run on the devices of one process "
                                f"for now, not over {jax.process_count()} processes")
        shards = distributed.batch_shards(mesh) if mesh is not None else 1  # the loader yields the global batch
        loader = self._loader(self.train_examples, args.per_device_train_batch_size * shards, shuffle=True)
        self._train_loader = loader
        total = self.total_steps(loader)
        optimizer, schedule = self.make_optimizer(total, self._warmup_steps(total))
        graphdef, trainable, frozen = lora.split(model)
        if not model.full_finetuning:  # the step donates its input; keep the model's arrays valid
            trainable = jax.tree.map(jnp.copy, trainable)
        # (full fine-tuning donates the model's own weights instead of holding them twice; the trained ones are
        # written back into the model when train() returns or raises)
        opt_state = optimizer.init(trainable)
        if mesh is not None:
            trainable, frozen, opt_state = self.state_on_mesh(mesh, trainable, frozen, opt_state)
        else:
            # Commit the step's state to its device(s) before the first call. A step that offloads to pinned
            # host memory returns committed arrays; uncommitted inputs on step 1 then meant a second, full
            # compilation on step 2 (2.7-3.9 s at 8B on the H200; reproduced on the CPU with the offload policy).
            trainable, frozen, opt_state = commit_to_devices((trainable, frozen, opt_state))
        self._frozen = frozen
        self._step_fn = make_train_step(graphdef, optimizer, remat=model.gradient_checkpointing, mesh=mesh,
                                        family=family_of(model))
        accum = args.gradient_accumulation_steps
        planned = planned_train_samples(args.max_steps, args.per_device_train_batch_size, accum, loader.num_rows,
                                        args.num_train_epochs)
        return RunPlan(total=total, schedule=schedule, epoch_at=lambda done: done * accum / len(loader),
                       planned_samples=planned, summary=f"{len(self.train_examples)} examples, {total} steps",
                       train_state={"trainable": trainable, "opt_state": opt_state})

    def run_summary_lines(self, start: int) -> list[str]:
        """Compile the step for the longest batch and read its memory plan (refusing one that does not fit);
        the kernels each op chose in it."""
        loader, s = self._train_loader, self.train_state
        with ops.recording_choices() as seen:  # this step's choices, not those of other models traced before
            plan = plan_step_memory(self._step_fn, (s["trainable"], self._frozen, s["opt_state"]),
                                    self._step_batch(loader, start), loader.longest_bucket, self.max_seq_length,
                                    family_of(self.model))
        self.kernel_choices = ops.format_choices(seen)
        return [f"unsloth_jax: kernels: {self.kernel_choices} | {plan}" + (" (per device)" if self.mesh else "")]

    def next_batch(self, step: int):
        return self._device_batch(self._train_loader, step, self.mesh)

    def run_step(self, state: dict, batch) -> tuple[dict, dict]:
        trainable, opt_state, metrics = self._step_fn(state["trainable"], self._frozen, state["opt_state"], batch)
        return {"trainable": trainable, "opt_state": opt_state}, metrics

    # ------------------------------------------------------------------------------------ evaluation
    def has_eval_data(self) -> bool:
        return bool(self.eval_examples)

    def evaluate(self) -> dict:
        """Mean token loss over eval_dataset, as transformers' Trainer.evaluate reports it: {"eval_loss",
        "eval_runtime" (s), "eval_samples_per_second", "eval_steps_per_second", "epoch"}."""
        if not self.eval_examples:
            raise TrainingError("evaluate() needs an eval_dataset (SFTTrainer(..., eval_dataset=...))")
        graphdef, trainable, frozen = lora.split(self.model)
        t0 = time.perf_counter()
        loader = self._loader(self.eval_examples, self.args.per_device_eval_batch_size, shuffle=False)
        total = count = 0.0
        for i in range(len(loader)):
            batch = {k: v[None] for k, v in loader.batch(0, i).items()}
            s, n = eval_loss(trainable, frozen, batch, graphdef=graphdef)
            total += float(s)
            count += int(n)
        runtime = time.perf_counter() - t0
        return {"eval_loss": total / max(count, 1), "eval_runtime": round(runtime, 4),
                "eval_samples_per_second": round(len(self.eval_examples) / runtime, 3),
                "eval_steps_per_second": round(len(loader) / runtime, 3), "epoch": self.state.epoch}
