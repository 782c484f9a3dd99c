"""Training: the functional jitted step (`make_train_step`), optimizers/schedules, and SFTTrainer."""
from unsloth_jax.train.optim import make_optimizer, make_schedule, scale_by_adam_8bit
from unsloth_jax.train.state import TrainerState, TrainOutput
from unsloth_jax.train.step import loss_and_count, make_train_step, resolve_remat
from unsloth_jax.train.trainer import SFTTrainer, TrainingArguments

__all__ = ["make_train_step", "loss_and_count", "resolve_remat", "make_optimizer", "make_schedule",
           "scale_by_adam_8bit", "SFTTrainer", "TrainingArguments", "TrainOutput", "TrainerState"]
