"""Training: the functional jitted steps (`make_train_step`; every trainer's step comes from `make_step`),
optimizers/schedules, SFTTrainer, UnslothTrainer (continued pretraining with embedding_learning_rate), and the
preference/RL trainers (DPOTrainer, ORPOTrainer in `preference`; GRPOTrainer in `grpo`)."""
from unsloth_jax.train.optim import make_optimizer, make_schedule, scale_by_adam_8bit
from unsloth_jax.train.state import TrainerState, TrainOutput
from unsloth_jax.train.step import StepLoss, loss_and_count, make_step, make_train_step, resolve_remat
from unsloth_jax.train.trainer import SFTConfig, SFTTrainer, TrainingArguments
from unsloth_jax.train.continued import UnslothTrainer, UnslothTrainingArguments

__all__ = ["make_train_step", "make_step", "StepLoss", "loss_and_count", "resolve_remat", "make_optimizer",
           "make_schedule", "scale_by_adam_8bit", "SFTConfig", "SFTTrainer", "TrainingArguments", "TrainOutput", "TrainerState",
           "UnslothTrainer", "UnslothTrainingArguments"]
