"""SFTTrainer and TrainingArguments with the names TRL/Unsloth users type, over the functional train step.

`SFTTrainer(...).train()` tokenizes the dataset, runs the jitted step with a progress bar, logs to stdout and
`output_dir/metrics.jsonl`, saves orbax checkpoints every `save_steps`, resumes exactly, and finally writes the
trained LoRA weights back into the model (in place, `nnx.update`, as HF and Unsloth do).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from flax import nnx

from unsloth_jax import lora
from unsloth_jax.backend import device_memory_gib
from unsloth_jax.data import DataLoader, build_examples
from unsloth_jax.errors import TrainingError
from unsloth_jax.train import optim
from unsloth_jax.train.step import commit_to_devices, eval_loss, make_train_step

log = logging.getLogger("unsloth_jax")


@dataclasses.dataclass
class TrainingArguments:
    """The TRL/transformers training arguments unsloth_jax understands (others are rejected by name)."""

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
    report_to: str | list | None = "none"
    max_nonfinite_steps: int = 5  # consecutive skipped (non-finite) steps before training stops
    logging_first_step: bool = True


def cast_weights(model, dtype) -> None:
    """Cast the model's floating dense weights (nnx.Param, not the float32 LoRA masters) to `dtype`, in place."""
    for _, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Param) or isinstance(var, nnx.LoRAParam):
            continue
        value = var.get_value()
        if hasattr(value, "dtype") and jnp.issubdtype(value.dtype, jnp.floating):
            var.set_value(value.astype(dtype))


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

    def __init__(self, model, tokenizer=None, train_dataset=None, eval_dataset=None, dataset_text_field: str = "text",
                 max_seq_length: int | None = None, formatting_func=None, packing: bool = False,
                 args: TrainingArguments | None = None, processing_class=None, dataset_num_proc=None, **kwargs):
        if kwargs:
            raise TypeError(f"SFTTrainer() got unexpected keyword argument(s): {', '.join(kwargs)}")
        self.model = model
        self.tokenizer = tokenizer if tokenizer is not None else processing_class
        self.args = args or TrainingArguments()
        self.max_seq_length = int(max_seq_length or model.max_seq_length)
        self.packing = packing
        if model.lora is None:
            raise TrainingError("the model has no LoRA adapters: call FastLanguageModel.get_peft_model(model, ...) first")
        if train_dataset is None:
            raise TrainingError("SFTTrainer needs a train_dataset")
        self.train_examples = self._tokenize(train_dataset, dataset_text_field, formatting_func)
        self.eval_examples = (self._tokenize(eval_dataset, dataset_text_field, formatting_func)
                              if eval_dataset is not None else None)
        if not self.train_examples:
            raise TrainingError("the training dataset is empty after tokenization")
        self._apply_precision_flags()
        self.state: dict = {}

    # ------------------------------------------------------------------------------------------ data
    def _tokenize(self, dataset, text_field, formatting_func) -> list[dict]:
        records = _as_records(dataset)
        if records and "input_ids" in records[0]:
            return [{"input_ids": list(r["input_ids"]), "labels": list(r.get("labels", r["input_ids"]))} for r in records]
        if self.tokenizer is None:
            raise TrainingError("a tokenizer is needed to tokenize a text dataset")
        return build_examples(records, self.tokenizer, self.max_seq_length, text_field, formatting_func)

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

    def _step_batch(self, loader: DataLoader, step: int) -> dict:
        """The [A, B, S] batch of optimizer step `step` (A = gradient_accumulation_steps), a pure function of step."""
        accum = self.args.gradient_accumulation_steps
        micro = []
        for j in range(accum):
            g = step * accum + j
            micro.append(loader.batch(g // len(loader), g % len(loader)))
        length = max(m["input_ids"].shape[1] for m in micro)
        micro = [_pad_to(m, length, self._pad_id()) for m in micro]
        keys = [k for k in micro[0] if self.packing or k != "segment_ids"]  # unpacked rows: right padding only
        return {k: np.stack([m[k] for m in micro]) for k in keys}

    def _apply_precision_flags(self) -> None:
        want = jnp.bfloat16 if self.args.bf16 else jnp.float16 if self.args.fp16 else None
        if want is not None and jnp.dtype(want) != self.model.dtype:
            log.warning("unsloth_jax: %s=True: casting the model from %s to %s", "bf16" if self.args.bf16 else "fp16",
                        self.model.dtype.name, jnp.dtype(want).name)
            cast_weights(self.model, want)
            self.model.dtype = jnp.dtype(want)

    # ----------------------------------------------------------------------------------- checkpoints
    def _checkpoints(self) -> list[tuple[int, Path]]:
        out = Path(self.args.output_dir)
        found = []
        if out.is_dir():
            for p in out.iterdir():
                m = re.fullmatch(r"checkpoint-(\d+)", p.name)
                if m and (p / "trainer_state.json").is_file():
                    found.append((int(m.group(1)), p))
        return sorted(found)

    def _save_checkpoint(self, step: int, trainable, opt_state, loss_history: list) -> None:
        import orbax.checkpoint as ocp

        path = Path(self.args.output_dir).resolve() / f"checkpoint-{step}"
        if path.exists():
            return  # never overwrite a saved state
        tmp = path.with_name(f".tmp-{path.name}")
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(tmp / "state", {"trainable": trainable, "opt_state": opt_state})
        ckptr.wait_until_finished()
        (tmp / "trainer_state.json").write_text(json.dumps({"global_step": step, "seed": self.args.seed,
                                                             "loss_history": loss_history}))
        os.replace(tmp, path)
        limit = self.args.save_total_limit
        if limit:
            import shutil

            for _, old in self._checkpoints()[:-limit]:
                shutil.rmtree(old, ignore_errors=True)

    def _restore(self, path: Path, trainable, opt_state):
        import orbax.checkpoint as ocp

        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), {"trainable": trainable,
                                                                                   "opt_state": opt_state})
        restored = ocp.StandardCheckpointer().restore(path.resolve() / "state", target)
        meta = json.loads((path / "trainer_state.json").read_text())
        return restored["trainable"], restored["opt_state"], int(meta["global_step"]), meta.get("loss_history", [])

    # ----------------------------------------------------------------------------------------- train
    def total_steps(self, loader: DataLoader) -> int:
        if self.args.max_steps and self.args.max_steps > 0:
            return int(self.args.max_steps)
        per_epoch = len(loader) / self.args.gradient_accumulation_steps
        return max(1, int(math.ceil(self.args.num_train_epochs * per_epoch)))

    def train(self, resume_from_checkpoint: bool | str | None = None) -> dict:
        args, model = self.args, self.model
        loader = self._loader(self.train_examples, args.per_device_train_batch_size, shuffle=True)
        total = self.total_steps(loader)
        warmup = optim.warmup_steps_for(total, args.warmup_steps, args.warmup_ratio)
        schedule = optim.make_schedule(args.lr_scheduler_type, args.learning_rate, total, warmup)
        optimizer = optim.make_optimizer(args.optim, schedule, weight_decay=args.weight_decay,
                                         max_grad_norm=args.max_grad_norm, adam_beta1=args.adam_beta1,
                                         adam_beta2=args.adam_beta2, adam_epsilon=args.adam_epsilon)
        graphdef, trainable, frozen = lora.split(model)
        trainable = jax.tree.map(jnp.copy, trainable)  # the step donates its input; keep the model's arrays valid
        opt_state = optimizer.init(trainable)
        start, history = 0, []
        if resume_from_checkpoint:
            ckpts = self._checkpoints()
            path = Path(resume_from_checkpoint) if isinstance(resume_from_checkpoint, (str, os.PathLike)) else (
                ckpts[-1][1] if ckpts else None)
            if path is None:
                log.warning("unsloth_jax: resume_from_checkpoint=True but %s holds no checkpoint; starting fresh",
                            args.output_dir)
            else:
                trainable, opt_state, start, history = self._restore(path, trainable, opt_state)
                print(f"Resuming from {path} at step {start}")
        step_fn = make_train_step(graphdef, optimizer, remat=model.gradient_checkpointing)
        # Commit the step's state to its device(s) before the first call. A step that offloads to pinned
        # host memory returns committed arrays; uncommitted inputs on step 1 then meant a second, full
        # compilation on step 2 (2.7-3.9 s at 8B on the H200; reproduced on the CPU with the offload policy).
        trainable, frozen, opt_state = commit_to_devices((trainable, frozen, opt_state))
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        metrics_path = Path(args.output_dir) / "metrics.jsonl"
        n_train = lora.count(trainable)
        print(f"unsloth_jax: {len(self.train_examples)} examples, {total} steps, batch "
              f"{args.per_device_train_batch_size} x {args.gradient_accumulation_steps} accumulation, "
              f"{model.dtype.name}, LoRA r={model.lora.r} ({n_train:,d} trainable), remat={model.gradient_checkpointing}")
        bar = tqdm(total=total, initial=start, desc="Training", unit="step")
        t0 = time.perf_counter()
        window_tokens, window_t0 = 0, time.perf_counter()
        bad_in_row = skipped = 0
        # (step, metrics, stamp) read one step late so the host never stalls the device. `stamp` is the wall
        # time when that step's call returned: one step period after the previous stamp both when steps run
        # ahead asynchronously and when each call blocks, so tokens / (stamp - previous stamp) is the rate
        # either way (a timestamp taken when the late metrics are read would make the last window ~0 s long
        # whenever the step was already finished).
        pending = None
        last = {}

        def finish(step_idx, m, stamp):
            nonlocal bad_in_row, skipped, window_tokens, window_t0, last
            m = jax.device_get(m)
            loss, tokens = float(m["loss"]), int(m["tokens"])
            if int(m["skipped"]):
                skipped += 1
                bad_in_row += 1
                tqdm.write(f"step {step_idx + 1}: non-finite loss or gradient ({loss}); update skipped")
                if bad_in_row >= args.max_nonfinite_steps:
                    raise TrainingError(f"{bad_in_row} non-finite steps in a row (last at step {step_idx + 1}); "
                                        "stopping. Lower the learning rate or check the data; saved checkpoints are "
                                        "untouched.")
            else:
                bad_in_row = 0
            history.append(loss)
            window_tokens += tokens
            done = step_idx + 1
            if done % args.logging_steps == 0 or done == total or (args.logging_first_step and done == 1):
                now = stamp
                record = {"step": done, "loss": loss, "learning_rate": float(schedule(step_idx)),
                          "grad_norm": float(m["grad_norm"]), "tokens_per_second": window_tokens / max(now - window_t0, 1e-9),
                          "epoch": done * args.gradient_accumulation_steps / len(loader)}
                if "aux_loss" in m:  # MoE families with output_router_logits (TRL's key)
                    record["aux_loss"] = float(m["aux_loss"])
                mem = device_memory_gib()
                if mem is not None:
                    record["memory_gib"] = round(mem, 3)
                window_tokens, window_t0 = 0, now
                with open(metrics_path, "a") as fh:
                    fh.write(json.dumps(record) + "\n")
                bar.set_postfix(loss=f"{loss:.4f}", lr=f"{record['learning_rate']:.2e}",
                                tok_s=f"{record['tokens_per_second']:.0f}",
                                **({"mem": f"{mem:.1f}G"} if mem is not None else {}))
                tqdm.write(json.dumps(record))
                last = record

        try:
            for step in range(start, total):
                batch = jax.device_put(self._step_batch(loader, step))
                trainable, opt_state, metrics = step_fn(trainable, frozen, opt_state, batch)
                stamp = time.perf_counter()
                if pending is not None:
                    finish(*pending)
                pending = (step, metrics, stamp)
                bar.update(1)
                if args.save_steps and (step + 1) % args.save_steps == 0 and step + 1 < total:
                    finish(*pending)
                    pending = None
                    self._save_checkpoint(step + 1, trainable, opt_state, history)
            if pending is not None:
                finish(*pending)
        finally:
            bar.close()
            nnx.update(model, trainable)
        runtime = time.perf_counter() - t0
        if args.save_steps:
            self._save_checkpoint(total, trainable, opt_state, history)
        out = {"global_step": total, "train_loss": float(np.mean(history[-max(1, total - start):])) if history else float("nan"),
               "final_loss": history[-1] if history else float("nan"), "train_runtime": runtime,
               "skipped_steps": skipped, "loss_history": list(history)}
        if last:
            out["tokens_per_second"] = last.get("tokens_per_second")
        if self.eval_examples:
            out["eval_loss"] = self.evaluate()
        self.state = out
        return out

    def evaluate(self) -> float:
        """Mean token loss over eval_dataset."""
        loader = self._loader(self.eval_examples, self.args.per_device_eval_batch_size, shuffle=False)
        graphdef, trainable, frozen = lora.split(self.model)
        total = count = 0.0
        for i in range(len(loader)):
            batch = {k: v[None] for k, v in loader.batch(0, i).items()}
            s, n = eval_loss(trainable, frozen, batch, graphdef=graphdef)
            total += float(s)
            count += int(n)
        return total / max(count, 1)
