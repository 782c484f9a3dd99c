"""LoRA on Gemma 3's vision tower (FastVisionModel.get_peft_model's finetune_vision_layers / language / attention /
mlp switches, Unsloth's names) against transformers + PEFT targeting the same modules: the same modules adapted,
the same trainable parameter count, and equal loss and LoRA gradients (float32) on a batch with images."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from tests import vl_models  # noqa: E402
from tests.test_vision_sft import (_load, _randomise_lora, assert_grads_match, checkpoint,  # noqa: E402,F401
                                   ours_loss_and_grads, peft_loss_and_grads, peft_twin)

pytestmark = pytest.mark.torch

ATTN = {"language": ("q_proj", "k_proj", "v_proj", "o_proj"), "vision": ("q_proj", "k_proj", "v_proj", "out_proj")}
MLP = {"language": ("gate_proj", "up_proj", "down_proj"), "vision": ("fc1", "fc2")}
TOWER = {"language": r"language_model\.layers", "vision": r"vision_tower\.encoder\.layers"}  # not SigLIP's head


def peft_targets(towers, attention, mlp) -> str:
    """PEFT's target_modules regex for Unsloth's switches (as Unsloth builds it: tower, then module name)."""
    mods = sorted({m for t in towers for m in (ATTN[t] if attention else ()) + (MLP[t] if mlp else ())})
    return rf".*(?:{'|'.join(TOWER[t] for t in towers)})\.\d+\.(?:self_attn|mlp)\.(?:{'|'.join(mods)})"


SWITCHES = [  # (towers, attention, mlp)
    (("language", "vision"), True, True),
    (("vision",), True, False),
    (("vision",), False, True),
]


@pytest.mark.parametrize("towers,attention,mlp", SWITCHES, ids=["both_all", "vision_attention", "vision_mlp"])
def test_vision_lora_gradients_match_peft(checkpoint, towers, attention, mlp):  # noqa: F811
    from unsloth_jax import UnslothVisionDataCollator, lora

    path, hf = checkpoint
    model, processor = _load(path, finetune_vision_layers="vision" in towers,
                             finetune_language_layers="language" in towers, finetune_attention_modules=attention,
                             finetune_mlp_modules=mlp)
    _randomise_lora(model, seed=1)
    twin = peft_twin(hf, model, peft_targets(towers, attention, mlp))
    n_peft = sum(p.numel() for n, p in twin.named_parameters() if "lora_" in n)
    assert lora.count(lora.split(model)[1]) == n_peft
    records = vl_models.shapes_dataset(3)
    records[2]["messages"][0]["content"].append({"type": "image"})
    records[2]["images"] = records[2]["images"] * 2
    batch = UnslothVisionDataCollator(model, processor)(records)
    ref_loss, ref_grads = peft_loss_and_grads(twin, batch)
    loss, grads = ours_loss_and_grads(model, batch)
    assert abs(loss - ref_loss) / ref_loss < 1e-5, (loss, ref_loss)
    worst = assert_grads_match(grads, ref_grads, 1e-4)
    print(f"{towers} attention={attention} mlp={mlp}: {n_peft} LoRA parameters; loss relative error "
          f"{abs(loss - ref_loss) / ref_loss:.1e}; LoRA gradients worst relative error {worst:.1e}")


def test_switches_and_refusals(checkpoint):  # noqa: F811
    from unsloth_jax import FastVisionModel

    model, _ = FastVisionModel.from_pretrained(checkpoint[0], dtype="float32")
    with pytest.raises(ValueError, match="nothing to adapt"):
        FastVisionModel.get_peft_model(model, r=4, finetune_language_layers=False)
    with pytest.raises(ValueError, match="nothing to adapt"):
        FastVisionModel.get_peft_model(model, r=4, finetune_attention_modules=False, finetune_mlp_modules=False)
    with pytest.raises(ValueError, match="bias"):
        FastVisionModel.get_peft_model(model, r=4, finetune_vision_layers=True, bias="all")
    model = FastVisionModel.get_peft_model(model, r=4, finetune_vision_layers=True, finetune_language_layers=False,
                                           use_gradient_checkpointing=False)
    assert all(lin.lora_a is None for lin in model.projections().values())
    assert all(lin.lora_a is not None for lin in model.vision_projections().values())
    assert model.lora.vision_target_modules == ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
    assert model.lora.target_modules == ()


@pytest.mark.slow
def test_sft_trainer_trains_the_vision_lora_and_evaluates(checkpoint, tmp_path):  # noqa: F811
    """SFTTrainer with finetune_vision_layers=True moves the vision pairs' B away from 0 (the gradient reaches
    the tower inside the jitted step), and evaluate() on an eval_dataset gives the token-mean loss of the trained
    model on the collated batch."""
    import jax.numpy as jnp

    from unsloth_jax import SFTConfig, SFTTrainer, UnslothVisionDataCollator
    from unsloth_jax.train.step import loss_and_count

    model, processor = _load(checkpoint[0], finetune_vision_layers=True)
    records = vl_models.shapes_dataset(6)
    collator = UnslothVisionDataCollator(model, processor)
    args = SFTConfig(per_device_train_batch_size=2, per_device_eval_batch_size=2, max_steps=3, learning_rate=1e-2,
                     output_dir=str(tmp_path / "out"), report_to="none", dataset_text_field="",
                     dataset_kwargs={"skip_prepare_dataset": True}, max_length=128)
    trainer = SFTTrainer(model=model, tokenizer=processor, data_collator=collator, train_dataset=records[:4],
                         eval_dataset=records[4:], args=args)
    trainer.train()
    assert all(float(jnp.abs(lin.lora_b[...]).max()) > 0 for lin in model.vision_projections().values())
    metrics = trainer.evaluate()
    batch = {k: jnp.asarray(v) for k, v in collator(records[4:]).items()}
    want = float(loss_and_count(model, batch)[0])
    assert abs(metrics["eval_loss"] - want) / want < 1e-5, (metrics["eval_loss"], want)
