"""Checks of TrainingArguments values, run when the arguments are built (not steps later, inside train()),
with the primitives of unsloth_jax.validation (TypeError for a wrong type, ValueError for a wrong value)."""
from __future__ import annotations

import math

from unsloth_jax.validation import (require_bool, require_choice, require_int, require_optional_bool,
                                    require_path, require_real)


def check_warmup_steps(value) -> None:
    """warmup_steps: an int >= 0, or a float in [0, 1) read as a ratio of the total steps (transformers 5)."""
    if isinstance(value, float) and not isinstance(value, bool):
        if math.isfinite(value) and 0 <= value < 1:
            return
        raise TypeError(f"warmup_steps must be an integer >= 0 or a float in [0, 1) (a ratio of the total steps), "
                        f"got {value!r}")
    require_int("warmup_steps", value, minimum=0)


def check_max_steps(value) -> None:
    """max_steps: a positive int, or negative (-1) to train for num_train_epochs; 0 trains nothing."""
    require_int("max_steps", value)
    if value == 0:
        raise ValueError("max_steps must be a positive number of optimizer steps, or -1 to train for "
                         "num_train_epochs; got 0")


def check_max_seq_length(value) -> None:
    """max_seq_length: None (not given) or an int >= 1."""
    if value is not None:
        require_int("max_seq_length", value, minimum=1)


def validate_training_arguments(args) -> None:
    """Check every TrainingArguments field (see the module docstring for the error types)."""
    from unsloth_jax.train.optim import OPTIMIZERS, SCHEDULERS

    require_path("output_dir", args.output_dir)
    if args.logging_dir is not None:
        require_path("logging_dir", args.logging_dir)
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                 "logging_steps", "max_nonfinite_steps"):
        require_int(name, getattr(args, name), minimum=1)
    require_int("save_steps", args.save_steps, minimum=0)  # 0: no checkpoints
    if args.save_total_limit is not None:
        require_int("save_total_limit", args.save_total_limit, minimum=1)
    require_int("seed", args.seed)
    check_max_steps(args.max_steps)
    check_warmup_steps(args.warmup_steps)
    require_real("learning_rate", args.learning_rate, minimum=0)
    require_real("weight_decay", args.weight_decay, minimum=0)
    require_real("adam_beta1", args.adam_beta1, minimum=0, maximum=1, max_exclusive=True)
    require_real("adam_beta2", args.adam_beta2, minimum=0, maximum=1, max_exclusive=True)
    require_real("adam_epsilon", args.adam_epsilon, minimum=0)
    require_real("max_grad_norm", args.max_grad_norm, minimum=0)  # 0: no clipping
    require_real("warmup_ratio", args.warmup_ratio, minimum=0, maximum=1)
    require_real("num_train_epochs", args.num_train_epochs, minimum=0)
    if args.max_steps < 0 and args.num_train_epochs == 0:
        raise ValueError("num_train_epochs must be > 0 when max_steps is -1 (train for num_train_epochs), got 0")
    require_choice("optim", args.optim, OPTIMIZERS)
    require_choice("lr_scheduler_type", args.lr_scheduler_type, SCHEDULERS)
    for name in ("bf16", "fp16", "dataloader_drop_last", "logging_first_step"):
        require_optional_bool(name, getattr(args, name))
    require_bool("overwrite_output_dir", args.overwrite_output_dir)
    if args.eval_strategy is not None:
        require_choice("eval_strategy", args.eval_strategy, ("no", "steps", "epoch"))
    if args.eval_steps is not None:
        require_int("eval_steps", args.eval_steps, minimum=1)
    if not isinstance(args.resume_from_checkpoint, (bool, type(None))):
        require_path("resume_from_checkpoint", args.resume_from_checkpoint)
    if args.bf16 and args.fp16:
        raise ValueError("bf16=True and fp16=True: pick one")


def validate_sft_config(args) -> None:
    """Check SFTConfig's own fields (see trainer.SFTConfig)."""
    skip_prepare = bool((getattr(args, "dataset_kwargs", None) or {}).get("skip_prepare_dataset"))
    if not isinstance(args.dataset_text_field, str) or not (args.dataset_text_field or skip_prepare):
        raise TypeError(f"dataset_text_field must be a field name (a non-empty string), got "
                        f"{args.dataset_text_field!r}")
    check_max_seq_length(args.max_length)
    check_max_seq_length(args.max_seq_length)
    if None not in (args.max_length, args.max_seq_length) and args.max_length != args.max_seq_length:
        raise ValueError(f"max_length={args.max_length} and max_seq_length={args.max_seq_length} name the same "
                         "value (max_seq_length is its older name); pass one")
    require_bool("packing", args.packing)
    require_optional_bool("completion_only_loss", args.completion_only_loss)
    require_bool("assistant_only_loss", args.assistant_only_loss)
    if args.assistant_only_loss:
        raise ValueError("assistant_only_loss=True is not supported; for chat data call "
                         "unsloth_jax.data.train_on_responses_only(trainer, instruction_part, response_part)")
