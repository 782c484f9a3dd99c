"""SFTTrainer and TrainingArguments with the names TRL/Unsloth users type, over the functional train step.

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
import json
import logging
import math
import os
import re
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from flax import nnx

from unsloth_jax import backend, distributed, lora, ops
from unsloth_jax.backend import device_memory_gib
from unsloth_jax.data import DataLoader, build_examples
from unsloth_jax.data.pretokenized import is_pretokenized, pretokenized_examples
from unsloth_jax.errors import TrainingError
from unsloth_jax.train import optim
from unsloth_jax.train.reporting import Reporters, default_logging_dir, resolve_report_to
from unsloth_jax.train.state import TrainerState, TrainOutput, planned_train_samples, train_metrics
from unsloth_jax.train.step import commit_to_devices, eval_loss, make_train_step
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
    unsloth_jax.data.train_on_responses_only). dataset_num_proc: accepted, unused.
    """

    dataset_text_field: str = "text"
    max_length: int | None = None
    max_seq_length: int | None = None
    packing: bool = False
    completion_only_loss: bool | None = None
    assistant_only_loss: bool = False
    dataset_num_proc: int | None = None

    def __post_init__(self):
        super().__post_init__()
        validate_sft_config(self)
        self.max_length = self.max_seq_length = (self.max_length if self.max_length is not None
                                                 else self.max_seq_length)


def checkpoints_in(output_dir) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoint-N directories in output_dir, oldest first."""
    out = Path(output_dir)
    found = []
    if out.is_dir():
        for p in out.iterdir():
            m = re.fullmatch(r"checkpoint-(\d+)", p.name)
            if m and (p / "trainer_state.json").is_file():
                found.append((int(m.group(1)), p))
    return sorted(found)


def previous_run_files(output_dir) -> list[Path]:
    """What an earlier train() left in output_dir: metrics.jsonl, checkpoint-N directories (complete or not) and
    runs/ (TensorBoard's default logging_dir)."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir()
                  if p.name in ("metrics.jsonl", "runs") or re.fullmatch(r"(\.tmp-)?checkpoint-\d+", p.name))


def remove_paths(paths) -> None:
    """Delete files and directory trees."""
    for p in paths:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def _base_label(model) -> str:
    """" + NF4" / " + FP8" when the frozen projections are quantized."""
    from unsloth_jax.models import FP8Param, NF4Param

    kinds = {type(lin.kernel) for lin in model.projections().values()}
    return " + NF4" if NF4Param in kinds else " + FP8" if FP8Param in kinds else ""


class StepMemoryPlan(str):
    """The one-line memory summary of a compiled train step (a str), with the byte counts as attributes."""

    device_bytes: int
    host_bytes: int
    limit_bytes: int | None


def plan_step_memory(step_fn, state: tuple, batch: dict, longest: int, max_seq_length: int) -> StepMemoryPlan:
    """Compile the train step for the largest batch the loader yields (sequence length `longest`) and read XLA's
    memory analysis of it, before step 1. Raises TrainingError when the step needs more device memory than the
    device has, naming the largest max_seq_length that would fit (estimated from the step's temporaries, which
    grow linearly with the tokens). The jit cache keeps the compiled step, so step 1 does not compile again."""
    shapes = {k: jax.ShapeDtypeStruct((*v.shape[:-1], longest), v.dtype) for k, v in batch.items()}
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


def _mesh_note(mesh) -> str:
    if mesh is None:
        return ""
    return f" per device on {distributed.describe(mesh)} (global batch x{distributed.batch_shards(mesh)})"


def cast_weights(model, dtype) -> None:
    """Cast the model's floating dense weights (nnx.Param, not the float32 LoRA masters) to `dtype`, in place."""
    for _, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Param) or isinstance(var, nnx.LoRAParam):
            continue
        value = var.get_value()
        if hasattr(value, "dtype") and jnp.issubdtype(value.dtype, jnp.floating):
            var.set_value(value.astype(dtype))


def _trained_what(model, n_train: int, optim_name: str) -> str:
    """The run summary's account of what trains and where the optimizer state lives."""
    what = "full fine-tuning" if model.full_finetuning else f"LoRA r={model.lora.r}"
    return f"{what} ({n_train:,d} trainable, optimizer state {optim.state_dtype(optim_name)})"


def _as_records(dataset) -> list[dict]:
    """A list of dicts from a list, any iterable of dicts, or an HF datasets.Dataset."""
    if dataset is None:
        return []
    if isinstance(dataset, list):
        return dataset
    if hasattr(dataset, "to_list"):
        return dataset.to_list()
    return list(dataset)


def _pad_to(batch: dict, length: int, pad_id: int) -> dict:
    s = batch["input_ids"].shape[1]
    if s == length:
        return batch
    fill = {"input_ids": pad_id, "labels": -100}
    return {k: np.pad(v, ((0, 0), (0, length - s)), constant_values=fill.get(k, 0)) for k, v in batch.items()}


class SFTTrainer:
    """Supervised fine-tuning of a LoRA model (see module docstring)."""

    def __init__(self, model, tokenizer=None, train_dataset=None, eval_dataset=None,
                 dataset_text_field: str | None = None, max_seq_length: int | None = None, formatting_func=None,
                 packing: bool | None = None, args: TrainingArguments | None = None, processing_class=None,
                 dataset_num_proc=None, **kwargs):
        """dataset_text_field, max_seq_length and packing not given here come from an SFTConfig `args` (TRL's
        way), else default to "text", the model's max_seq_length and False."""
        if kwargs:
            raise TypeError(f"SFTTrainer() got unexpected keyword argument(s): {', '.join(kwargs)}")
        self.model = model
        self.tokenizer = tokenizer if tokenizer is not None else processing_class
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
        self._apply_precision_flags()
        self.state = TrainerState()
        self.kernel_choices = "none traced"  # what each op chose in the last train() call's step

    # ------------------------------------------------------------------------------------------ data
    def _tokenize(self, dataset, text_field, formatting_func) -> list[dict]:
        records = _as_records(dataset)
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
        length = max(m["input_ids"].shape[1] for m in micro)
        micro = [_pad_to(m, length, self._pad_id()) for m in micro]
        keys = [k for k in micro[0] if self.packing or k != "segment_ids"]  # unpacked rows: right padding only
        return {k: np.stack([m[k] for m in micro]) for k in keys}

    def _device_batch(self, loader: DataLoader, step: int, mesh):
        """The step's batch on the device(s): on a mesh, the global batch assembled from this host's rows."""
        if mesh is None:
            return jax.device_put(self._step_batch(loader, step))
        rows = distributed.host_rows(mesh, loader.batch_size)
        return distributed.global_batch(mesh, self._step_batch(loader, step, rows), loader.batch_size)

    def _to_mesh(self, mesh, trainable, frozen, opt_state):
        """The state placed on the mesh by unsloth_jax.distributed's rules; the model's frozen weights are
        replaced by their sharded copies, so no device keeps the whole unsharded model as well."""
        trainable, frozen, opt_state = distributed.shard_state(mesh, (trainable, frozen, opt_state))
        nnx.update(self.model, frozen)
        return trainable, frozen, opt_state

    def _apply_precision_flags(self) -> None:
        want = jnp.bfloat16 if self.args.bf16 else jnp.float16 if self.args.fp16 else None
        if want is not None and jnp.dtype(want) != self.model.dtype:
            log.warning("unsloth_jax: %s=True: casting the model from %s to %s", "bf16" if self.args.bf16 else "fp16",
                        self.model.dtype.name, jnp.dtype(want).name)
            cast_weights(self.model, want)
            self.model.dtype = jnp.dtype(want)

    # ----------------------------------------------------------------------------------- checkpoints
    def _checkpoints(self) -> list[tuple[int, Path]]:
        return checkpoints_in(self.args.output_dir)

    def _resume_path(self, resume_from_checkpoint) -> Path | None:
        """The checkpoint directory a train() call resumes from, or None (a fresh run)."""
        if not resume_from_checkpoint:
            return None
        if isinstance(resume_from_checkpoint, (str, os.PathLike)):
            path = Path(resume_from_checkpoint)
            if not (path / "trainer_state.json").is_file():
                raise TrainingError(f"resume_from_checkpoint={str(resume_from_checkpoint)!r} is not a checkpoint "
                                    "directory (a checkpoint-N directory with trainer_state.json, saved every "
                                    "save_steps steps); pass one, or True for the newest in output_dir")
            return path
        ckpts = self._checkpoints()
        if not ckpts:
            log.warning("unsloth_jax: resume_from_checkpoint=True but %s holds no checkpoint; starting fresh",
                        self.args.output_dir)
            return None
        return ckpts[-1][1]

    def _prepare_output_dir(self, resuming: bool) -> None:
        """Create output_dir before any slow work. A fresh run refuses one holding an earlier run's files, unless
        overwrite_output_dir=True, which removes them (so only this run's files remain)."""
        args, out = self.args, Path(self.args.output_dir)
        if out.exists() and not out.is_dir():
            raise TrainingError(f"output_dir {out} exists and is not a directory; pass another output_dir")
        earlier = [] if resuming else previous_run_files(out)
        if earlier and not args.overwrite_output_dir:
            names = ", ".join(p.name for p in earlier[:5]) + (", ..." if len(earlier) > 5 else "")
            raise TrainingError(f"output_dir {out} holds an earlier run's files ({names}); pass "
                                "overwrite_output_dir=True to replace them, resume_from_checkpoint=True to continue "
                                "that run, or another output_dir")
        if earlier and distributed.is_main_process():
            remove_paths(earlier)
            log.info("unsloth_jax: overwrite_output_dir=True: removed %s from %s",
                     ", ".join(p.name for p in earlier), out)
        distributed.sync("prepare-output-dir")
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TrainingError(f"output_dir {out} cannot be created ({e}); pass another output_dir") from e

    def _keep_metrics_until(self, step: int) -> None:
        """Drop the metrics.jsonl lines of steps after `step` (logged by the run a resume continues, after its
        checkpoint), so the file holds each step once."""
        path = Path(self.args.output_dir) / "metrics.jsonl"
        if not path.is_file() or not distributed.is_main_process():
            return
        lines = path.read_text().splitlines()
        kept = []
        for line in lines:
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except (json.JSONDecodeError, AttributeError):  # a line cut short by the crash
                pass
        if len(kept) != len(lines):
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, path)

    def _save_checkpoint(self, step: int, trainable, opt_state) -> None:
        import orbax.checkpoint as ocp

        path = Path(self.args.output_dir).resolve() / f"checkpoint-{step}"
        if path.exists():
            return  # never overwrite a saved state
        tmp = path.with_name(f".tmp-{path.name}")
        ckptr = ocp.StandardCheckpointer()  # every process saves its shards (one shared directory)
        ckptr.save(tmp / "state", {"trainable": trainable, "opt_state": opt_state})
        ckptr.wait_until_finished()
        if not distributed.is_main_process():
            distributed.sync(f"checkpoint-{step}")
            return
        (tmp / "trainer_state.json").write_text(json.dumps(self._state_record(step)))
        os.replace(tmp, path)
        distributed.sync(f"checkpoint-{step}")
        limit = self.args.save_total_limit
        if limit:
            for _, old in self._checkpoints()[:-limit]:
                shutil.rmtree(old, ignore_errors=True)

    def _state_record(self, step: int) -> dict:
        """trainer_state.json of a checkpoint at `step`: what a resumed run needs to continue the history."""
        st = self.state
        return {"global_step": step, "seed": self.args.seed, "epoch": st.epoch, "max_steps": st.max_steps,
                "loss_history": list(st.loss_history[:step]), "log_history": list(st.log_history)}

    def _restore(self, path: Path, trainable, opt_state):
        """(trainable, opt_state, step) from a checkpoint directory, placed like `trainable` / `opt_state` (a
        checkpoint saved on N devices restores on today's M); also restores self.state's histories."""
        import orbax.checkpoint as ocp

        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                              {"trainable": trainable, "opt_state": opt_state})
        try:
            restored = ocp.StandardCheckpointer().restore(path.resolve() / "state", target)
        except ValueError as e:  # orbax: the saved tree's structure, shapes or dtypes differ from the target's
            raise TrainingError(
                f"{path}: the saved training state does not match this run's (optim {self.args.optim!r}, the "
                f"model's trainable weights): {str(e)[:300]}. It was saved with other settings, or by an "
                "unsloth_jax older than the fused AdamW state (AdamWState, 2026-12-01), which cannot be resumed; "
                "resume with the run's own settings, or start fresh") from e
        meta = json.loads((path / "trainer_state.json").read_text())
        step = int(meta["global_step"])
        self.state.global_step = step
        self.state.loss_history = list(meta.get("loss_history", []))
        self.state.log_history = list(meta.get("log_history", []))
        return restored["trainable"], restored["opt_state"], step

    # ----------------------------------------------------------------------------------------- train
    def make_optimizer(self, total: int, warmup: int, embedding_learning_rate: float | None = None):
        """(optax optimizer, learning-rate schedule) of a run of `total` steps with `warmup` warmup steps; with
        embedding_learning_rate, the embedding and head leaves follow the same schedule from that rate."""
        args = self.args
        schedule = optim.make_schedule(args.lr_scheduler_type, args.learning_rate, total, warmup)
        embedding_schedule = None if embedding_learning_rate is None else optim.make_schedule(
            args.lr_scheduler_type, embedding_learning_rate, total, warmup)
        optimizer = optim.make_optimizer(args.optim, schedule, weight_decay=args.weight_decay,
                                         max_grad_norm=args.max_grad_norm, adam_beta1=args.adam_beta1,
                                         adam_beta2=args.adam_beta2, adam_epsilon=args.adam_epsilon,
                                         embedding_schedule=embedding_schedule)
        return optimizer, schedule

    def total_steps(self, loader: DataLoader) -> int:
        if self.args.max_steps and self.args.max_steps > 0:
            return int(self.args.max_steps)
        per_epoch = len(loader) / self.args.gradient_accumulation_steps
        return max(1, int(math.ceil(self.args.num_train_epochs * per_epoch)))

    def _warmup_steps(self, total: int) -> int:
        """Warmup steps of a `total`-step run; a float warmup_steps in [0, 1) is a ratio (transformers 5)."""
        w = self.args.warmup_steps
        if isinstance(w, float) and 0 < w < 1:
            return int(math.ceil(w * total))
        return optim.warmup_steps_for(total, int(w), self.args.warmup_ratio)

    def _open_reporters(self) -> None:
        """Start the report_to integrations of this train() call (closed by train() whatever happens); none on
        the processes other than 0 of a multi-host run."""
        args = self.args
        logging_dir = args.logging_dir or default_logging_dir(args.output_dir)
        names = args.report_to if distributed.is_main_process() else []
        self._reporters = Reporters(names, logging_dir, dataclasses.asdict(args))
        if self._reporters.logging_dir:
            print(f"unsloth_jax: TensorBoard logs -> {self._reporters.logging_dir}")

    def _close_reporters(self) -> None:
        reporters = getattr(self, "_reporters", None)
        if reporters is not None:
            reporters.close()
        self._reporters = None

    def train(self, resume_from_checkpoint: bool | str | None = None) -> TrainOutput:
        """Train for the configured steps; resume_from_checkpoint=True continues from the newest checkpoint in
        output_dir (a path: from that checkpoint; None: args.resume_from_checkpoint). Returns a TrainOutput;
        trainer.state keeps the log history."""
        try:
            return self._train(resume_from_checkpoint)
        finally:
            self._close_reporters()

    def _train(self, resume_from_checkpoint) -> TrainOutput:
        args, model = self.args, self.model
        if resume_from_checkpoint is None:
            resume_from_checkpoint = args.resume_from_checkpoint
        resume_path = self._resume_path(resume_from_checkpoint)
        self._prepare_output_dir(resuming=resume_path is not None)
        mesh = distributed.resolve_mesh(args.mesh, "TrainingArguments.mesh")
        main = distributed.is_main_process()
        shards = distributed.batch_shards(mesh) if mesh is not None else 1  # the loader yields the global batch
        loader = self._loader(self.train_examples, args.per_device_train_batch_size * shards, shuffle=True)
        total = self.total_steps(loader)
        warmup = self._warmup_steps(total)
        optimizer, schedule = self.make_optimizer(total, warmup)
        graphdef, trainable, frozen = lora.split(model)
        if not model.full_finetuning:  # the step donates its input; keep the model's arrays valid
            trainable = jax.tree.map(jnp.copy, trainable)
        # (full fine-tuning donates the model's own weights instead of holding them twice; the trained ones are
        # written back into the model when train() returns or raises)
        opt_state = optimizer.init(trainable)
        if mesh is not None:
            trainable, frozen, opt_state = self._to_mesh(mesh, trainable, frozen, opt_state)
        self.state = TrainerState(max_steps=total, logging_steps=args.logging_steps,
                                  num_train_epochs=args.num_train_epochs,
                                  train_batch_size=args.per_device_train_batch_size)
        start = 0
        if resume_path is not None:
            trainable, opt_state, start = self._restore(resume_path, trainable, opt_state)
            self._keep_metrics_until(start)
            if main:
                print(f"Resuming from {resume_path} at step {start}")
        step_fn = make_train_step(graphdef, optimizer, remat=model.gradient_checkpointing, mesh=mesh)
        # Commit the step's state to its device(s) before the first call. A step that offloads to pinned
        # host memory returns committed arrays; uncommitted inputs on step 1 then meant a second, full
        # compilation on step 2 (2.7-3.9 s at 8B on the H200; reproduced on the CPU with the offload policy).
        if mesh is None:
            trainable, frozen, opt_state = commit_to_devices((trainable, frozen, opt_state))
        with ops.recording_choices() as seen:  # this step's choices, not those of other models traced before
            plan = plan_step_memory(step_fn, (trainable, frozen, opt_state), self._step_batch(loader, start),
                                    loader.longest_bucket, self.max_seq_length)
        self.kernel_choices = ops.format_choices(seen)
        self._open_reporters()
        n_train = lora.count(trainable)
        if main:
            print(f"unsloth_jax: {len(self.train_examples)} examples, {total} steps, batch "
                  f"{args.per_device_train_batch_size} x {args.gradient_accumulation_steps} accumulation"
                  f"{_mesh_note(mesh)}, {model.dtype.name}{_base_label(model)}, "
                  f"{_trained_what(model, n_train, args.optim)}, remat={model.gradient_checkpointing}")
            print(f"unsloth_jax: kernels: {self.kernel_choices} | {plan}" + (" (per device)" if mesh is not None else ""))
        # only process 0 shows a bar; on it tqdm's own defaults (TQDM_DISABLE, ...) apply
        bar = tqdm(total=total, initial=start, desc="Training", unit="step", **({} if main else {"disable": True}))
        compile_time = CompileTime()
        float(schedule(start))  # the logged learning rate's jnp ops compile on this first call, before timing
        t0 = time.perf_counter()
        steplog = _StepLog(self, len(loader), schedule, bar, t0)
        self.state.epoch = steplog.epoch_at(start)
        bad_in_row = 0
        # (step, metrics) read one step late so the host never stalls the device; a step's end time is taken
        # when its metrics are read (blocking until it finished). So that a window's time is its steps' own, a
        # step is read before the next is called when it has already finished, and before a call that compiles
        # (a batch shape not seen yet). Compile time spent while no step runs is left out of the window (it
        # would be time the device waits); compiling while a step runs overlaps it and stays in.
        pending = None
        shapes_seen = set()

        def call_step(trainable, opt_state, batch):
            idle = pending is None
            before = compile_time.take()
            if idle:  # e.g. eager ops run for the first time while logging
                steplog.exclude(before, compiled=True)
            t_call = time.perf_counter()
            out = step_fn(trainable, frozen, opt_state, batch)
            compiled = compile_time.take()
            if idle and compiled:
                if not _is_ready(out[2]):  # the call returned before running: all of it was compiling and loading
                    compiled = max(compiled, time.perf_counter() - t_call)
                steplog.exclude(compiled, compiled=True)
            return out

        def finish(step_idx, m):
            nonlocal bad_in_row
            m = jax.device_get(m)
            stamp = time.perf_counter()
            compile_time.take()  # compiled while steps ran: that time stays in the window
            loss = float(m["loss"])
            if int(m["skipped"]):
                bad_in_row += 1
                if main:
                    tqdm.write(f"step {step_idx + 1}: non-finite loss or gradient ({loss}); update skipped")
                if bad_in_row >= args.max_nonfinite_steps:
                    raise TrainingError(f"{bad_in_row} non-finite steps in a row (last at step {step_idx + 1}); "
                                        "stopping. Lower the learning rate or check the data; saved checkpoints are "
                                        "untouched.")
            else:
                bad_in_row = 0
            steplog.step(step_idx, m, stamp, last=step_idx + 1 == total)

        try:
            with compile_time:
                for step in range(start, total):
                    batch = self._device_batch(loader, step, mesh)
                    shape = tuple(sorted((k, tuple(v.shape)) for k, v in batch.items()))
                    if pending is not None and (shape not in shapes_seen or _is_ready(pending[1])):
                        finish(*pending)
                        pending = None
                    shapes_seen.add(shape)
                    trainable, opt_state, metrics = call_step(trainable, opt_state, batch)
                    if pending is not None:
                        finish(*pending)
                    pending = (step, metrics)
                    bar.update(1)
                    if args.save_steps and (step + 1) % args.save_steps == 0 and step + 1 < total:
                        finish(*pending)
                        pending = None
                        t_save = time.perf_counter()
                        self._save_checkpoint(step + 1, trainable, opt_state)
                        steplog.exclude(time.perf_counter() - t_save)
                        compile_time.take()  # (inside the time just left out)
                    if self._evaluates_after(step + 1, total, steplog):
                        if pending is not None:
                            finish(*pending)
                            pending = None
                        t_eval = time.perf_counter()
                        steplog.log({**self._evaluate_state(graphdef, trainable, frozen), "step": step + 1})
                        steplog.exclude(time.perf_counter() - t_eval)
                        compile_time.take()
                if pending is not None:
                    finish(*pending)
        finally:
            bar.close()
            nnx.update(model, trainable)
        t_end = time.perf_counter()
        if args.save_steps:
            self._save_checkpoint(total, trainable, opt_state)
        return self._finish_training(steplog, loader, start, total, t0, t_end)

    def _finish_training(self, steplog: "_StepLog", loader: DataLoader, start: int, total: int, t0: float,
                         t_end: float) -> TrainOutput:
        """Log the eval loss (with an eval_dataset) and the run summary; the TrainOutput of this call."""
        args, state = self.args, self.state
        state.global_step = total
        run = total - start
        planned = planned_train_samples(args.max_steps, args.per_device_train_batch_size,
                                        args.gradient_accumulation_steps, loader.num_rows, args.num_train_epochs)
        metrics = train_metrics(t0, t_end, steps_run=run, total_steps=total, planned_samples=planned,
                                losses_run=state.loss_history[len(state.loss_history) - run:], epoch=state.epoch)
        if self.eval_examples and args.eval_strategy != "no":
            steplog.log({**self.evaluate(), "step": total})
        steplog.log({**metrics, "step": total})
        if distributed.is_main_process():
            print(json.dumps(metrics))
        return TrainOutput(total, metrics["train_loss"], metrics)

    def evaluate(self) -> dict:
        """Mean token loss over eval_dataset, as transformers' Trainer.evaluate reports it: {"eval_loss",
        "eval_runtime" (s), "eval_samples_per_second", "eval_steps_per_second", "epoch"}."""
        if not self.eval_examples:
            raise TrainingError("evaluate() needs an eval_dataset (SFTTrainer(..., eval_dataset=...))")
        return self._evaluate_state(*lora.split(self.model))

    def _evaluates_after(self, done: int, total: int, steplog: "_StepLog") -> bool:
        """Whether eval_strategy asks for an evaluation after `done` of `total` steps, the last excepted (training
        ends with one)."""
        a = self.args
        if not self.eval_examples or done >= total:
            return False
        if a.eval_strategy == "steps":
            return done % (a.eval_steps or a.logging_steps) == 0
        if a.eval_strategy == "epoch":
            return int(steplog.epoch_at(done)) > int(steplog.epoch_at(done - 1))
        return False

    def _evaluate_state(self, graphdef, trainable, frozen) -> dict:
        """evaluate() of the model given as split state (during training: the live trainable state)."""
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


def _is_ready(metrics: dict) -> bool:
    """Whether the step that returned `metrics` has finished (host values count as finished)."""
    is_ready = getattr(metrics["loss"], "is_ready", None)
    return is_ready is None or is_ready()


class CompileTime:
    """Wall seconds jax spends tracing, lowering and compiling while this context is entered, from
    jax.monitoring's compile events (nested events counted once). take() returns the seconds since its last call."""

    EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
              "/jax/core/compile/backend_compile_duration")

    def __init__(self):
        self._spans: list[tuple[float, float]] = []

    def _record(self, event: str, start: float, end: float, **kwargs) -> None:
        if event in self.EVENTS:
            self._spans.append((start, end))

    def __enter__(self) -> "CompileTime":
        jax.monitoring.register_event_time_span_listener(self._record)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_time_span_listener(self._record)

    def take(self) -> float:
        spans, self._spans = self._spans, []
        total, reached = 0.0, float("-inf")
        for start, end in sorted(spans):
            if end > reached:
                total += end - max(start, reached)
                reached = end
        return total


class _StepLog:
    """The per-step bookkeeping of one train() call: trainer.state (global_step, epoch, loss_history) after
    every step; every logging_steps steps (and on the first and last) a log entry averaging the loss over the
    steps since the previous one, written to trainer.state.log_history, metrics.jsonl (with tokens/s and
    memory), stdout, the progress bar and the report_to integrations."""

    def __init__(self, trainer: SFTTrainer, steps_per_epoch: int, schedule, bar, t0: float):
        self.args, self.state, self.reporters = trainer.args, trainer.state, trainer._reporters
        self.window_excluded = 0.0  # seconds of the current window not spent running steps (compiling, saving)
        self.window_compiled = 0.0  # of which compiling
        self.metrics_path = Path(trainer.args.output_dir) / "metrics.jsonl"
        self.steps_per_epoch = steps_per_epoch  # batches per epoch
        self.schedule, self.bar = schedule, bar
        self.window_losses: list[float] = []
        self.window_aux: list[float] = []  # MoE load-balancing loss (output_router_logits), TRL's "aux_loss"
        self.window_tokens, self.window_t0 = 0, t0

    def epoch_at(self, step: int) -> float:
        """Epochs done after `step` optimizer steps (batches consumed / batches per epoch), as transformers."""
        return step * self.args.gradient_accumulation_steps / self.steps_per_epoch

    def _logs_at(self, done: int, last: bool) -> bool:
        a = self.args
        return done % a.logging_steps == 0 or last or (a.logging_first_step and done == 1)

    def exclude(self, seconds: float, compiled: bool = False) -> None:
        """Leave `seconds` (compiling, a checkpoint save, an evaluation) out of the current window's
        tokens_per_second."""
        self.window_excluded += seconds
        if compiled:
            self.window_compiled += seconds

    def step(self, step_idx: int, m: dict, stamp: float, last: bool) -> None:
        """Record optimizer step `step_idx` (0-based) from its host metrics `m`, finished at time `stamp`. A logged
        window's tokens_per_second is its steps' target tokens over the time since the previous window ended,
        without compile time (recorded as compile_seconds) and checkpoint saves."""
        loss = float(m["loss"])
        done = step_idx + 1
        self.state.loss_history.append(loss)
        self.state.global_step, self.state.epoch = done, self.epoch_at(done)
        self.window_losses.append(loss)
        if "aux_loss" in m:
            self.window_aux.append(float(m["aux_loss"]))
        self.window_tokens += int(m["tokens"])
        if not self._logs_at(done, last):
            return
        entry = {"loss": sum(self.window_losses) / len(self.window_losses), "grad_norm": float(m["grad_norm"]),
                 "learning_rate": float(self.schedule(step_idx)), "epoch": self.state.epoch, "step": done}
        if self.window_aux:
            entry["aux_loss"] = sum(self.window_aux) / len(self.window_aux)
        seconds = stamp - self.window_t0 - self.window_excluded
        tokens_per_second = self.window_tokens / max(seconds, 1e-9)
        compiled = self.window_compiled
        self.window_losses, self.window_aux, self.window_tokens, self.window_t0 = [], [], 0, stamp
        self.window_excluded = self.window_compiled = 0.0
        self.log(entry)
        self._write_record(entry, tokens_per_second, compiled)

    def log(self, entry: dict) -> None:
        """Append `entry` (with its "step") to log_history and send it to the report_to integrations."""
        self.state.log_history.append(entry)
        if self.reporters is not None:
            self.reporters.log(entry, entry["step"])

    def _write_record(self, entry: dict, tokens_per_second: float, compile_seconds: float = 0.0) -> None:
        """One metrics.jsonl line (also printed) and the progress bar's postfix."""
        record = {"step": entry["step"], "loss": entry["loss"], "learning_rate": entry["learning_rate"],
                  "grad_norm": entry["grad_norm"], "tokens_per_second": tokens_per_second, "epoch": entry["epoch"]}
        if compile_seconds > 0:
            record["compile_seconds"] = round(compile_seconds, 3)  # left out of tokens_per_second
        if "aux_loss" in entry:
            record["aux_loss"] = entry["aux_loss"]
        mem = device_memory_gib()
        if mem is not None:
            record["memory_gib"] = round(mem, 3)
        if not distributed.is_main_process():  # process 0 writes metrics.jsonl and the console log
            return
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['learning_rate']:.2e}",
                             tok_s=f"{tokens_per_second:.0f}", **({"mem": f"{mem:.1f}G"} if mem is not None else {}))
        tqdm.write(json.dumps(record))
