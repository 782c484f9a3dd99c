"""GRPO with images on the CPU: the bundled tiny random Gemma 3 vision-language model learns a reward that depends
on the picture (docs/VISION.md, "GRPO with images").

    python examples/grpo_vision.py [--max_steps 12] [--output_dir outputs/grpo-vision]

The data are the bundled shapes pictures (unsloth_jax/assets/shapes_sample), as TRL's GRPOTrainer takes them: a
conversational "prompt" with an image part and an "images" column. The model is random and cannot name a colour, so
the reward is a toy, as the text GRPO tests use: the share of a completion's tokens whose id is even. The reward
function also gets the row's other columns, as TRL passes them (here "images" and "colour"), and checks that the
prompt it gets holds the picture. Prints the mean reward per colour before and after training.

(A reward that pays even ids for red pictures and odd ones for blue, so that only reading the picture can raise
it, was tried at this size: 20 steps, with or without LoRA on the vision tower, collapse to one parity for both
colours; the tiny random tower's features of a red and a blue shape are too alike for this signal.)
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

ASSETS = Path(__file__).resolve().parents[1] / "unsloth_jax" / "assets"
COLOURS = ("red", "blue")


def colour_of(answer: str) -> str:
    return answer.split()[1]  # "A red circle." -> "red"


def picture_reward(prompts, completions, completion_ids, colour=None, images=None, **kwargs):
    """TRL's reward signature: prompts (the chat with the picture in its image part), completions, and the other
    columns (here "images" and "colour"), one entry per completion."""
    if prompts is not None:
        assert all(p[0]["content"][0]["image"] is im[0] for p, im in zip(prompts, images))
    return [float(np.mean([t % 2 == 0 for t in ids])) if ids else 0.0 for ids in completion_ids]


def dataset(per_colour: int) -> list[dict]:
    """The first `per_colour` red and blue pictures of the sample, alternating."""
    from unsloth_jax.data.vision_loader import load_vision_records

    records = load_vision_records(ASSETS / "shapes_sample" / "shapes_sample.jsonl")
    rows = {c: [r for r in records if colour_of(r["messages"][1]["content"][0]["text"]) == c][:per_colour]
            for c in COLOURS}
    return [{"prompt": [r["messages"][0]],  # the user turn: {"type": "image"} and "Describe the shape."
             "images": r["images"], "colour": c}
            for pair in zip(*([(c, r) for r in rows[c]] for c in COLOURS)) for c, r in pair]


def mean_rewards(trainer, data, seed: int) -> dict:
    """The mean reward per colour group of completions sampled for every prompt (fixed sampling seed)."""
    rows = np.arange(len(data))
    _, completions, _ = trainer.generate_completions(rows, seed=seed)
    colours = [data[r]["colour"] for r in rows for _ in range(trainer.args.num_generations)]
    rewards = picture_reward(None, None, completions, colours)
    return {c: float(np.mean([x for x, k in zip(rewards, colours) if k == c])) for c in COLOURS}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_steps", type=int, default=12)
    parser.add_argument("--per_colour", type=int, default=8)
    parser.add_argument("--seed", type=int, default=3407)
    parser.add_argument("--output_dir", default="outputs/grpo-vision")
    args = parser.parse_args(argv)

    from unsloth_jax import FastVisionModel, GRPOConfig, GRPOTrainer

    model, processor = FastVisionModel.from_pretrained(ASSETS / "tiny-gemma3-vl", dtype="float32")
    model = FastVisionModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False,
                                           random_state=args.seed)
    data = dataset(args.per_colour)
    config = GRPOConfig(output_dir=args.output_dir, per_device_train_batch_size=16, num_generations=8,
                        max_completion_length=8, max_steps=args.max_steps, learning_rate=2e-2, logging_steps=4,
                        save_steps=0, seed=args.seed)
    trainer = GRPOTrainer(model=model, reward_funcs=picture_reward, args=config, train_dataset=data,
                          processing_class=processor)
    before = mean_rewards(trainer, data, seed=args.seed + 1)
    trainer.train()
    after = mean_rewards(trainer, data, seed=args.seed + 1)
    for colour in before:
        print(f"{colour} pictures: mean reward {before[colour]:.3f} -> {after[colour]:.3f}")
    return {"before": before, "after": after}


if __name__ == "__main__":
    main()
