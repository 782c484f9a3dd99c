"""4-bit Gemma 3 vision-language loading (FastVisionModel.from_pretrained(..., load_in_4bit=True)): the language
model's projections in NF4, the vision tower and projector dense; logits equal transformers' with the dequantized
NF4 weights put in its language Linears (the text path's bound, tests/test_qlora.py), and QLoRA SFT with images
(one batch of two rows, 3 steps) starts at that model's loss and lowers it; greedy generation with images equals
transformers' with those weights."""
from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests import vl_models  # noqa: E402
from tests.helpers import rel_err  # noqa: E402
from tests.test_vision_export import _batch, _ours, _theirs  # noqa: E402
from tests.test_vision_sft import checkpoint  # noqa: E402,F401

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def quantized(checkpoint):  # noqa: F811
    """Our 4-bit model, its processor, and transformers' model with our dequantized NF4 language weights."""
    import jax.numpy as jnp

    from pallas_kernels.nf4 import dequantize_nf4
    from unsloth_jax import FastVisionModel
    from unsloth_jax.models import NF4Param

    path, hf = checkpoint
    model, processor = FastVisionModel.from_pretrained(path, dtype="float32", load_in_4bit=True)
    twin = copy.deepcopy(hf)
    layers = twin.model.language_model.layers
    for name, lin in model.projections().items():
        assert isinstance(lin.kernel, NF4Param), name
        deq = np.asarray(dequantize_nf4(lin.kernel.get_value(), jnp.float32))  # [L, out, in], HF layout
        for i, layer in enumerate(layers):
            linear = getattr(layer.self_attn, name, None) or getattr(layer.mlp, name)
            assert 0.05 < rel_err(deq[i], linear.weight.detach().numpy()) < 0.12, (name, i)  # NF4's usual error
            with torch.no_grad():
                linear.weight.copy_(torch.from_numpy(np.array(deq[i])))
    for name, lin in model.vision_projections().items():  # the vision tower and projector stay dense
        assert not isinstance(lin.kernel, NF4Param) and lin.kernel[...].dtype == jnp.float32, name
    assert model.multi_modal_projector.mm_input_projection.kernel[...].dtype == jnp.float32
    return model, processor, twin


def test_4bit_logits_equal_transformers_with_dequantized_weights(checkpoint, quantized):  # noqa: F811
    model, processor, twin = quantized
    batch = _batch(model, processor)
    real = batch["attention_mask"].astype(bool)
    ours = _ours(model, batch)[real]
    err = rel_err(ours, _theirs(twin, batch)[real])
    dense = rel_err(ours, _theirs(checkpoint[1], batch)[real])
    print(f"4-bit: logits relative error {err:.1e} vs transformers with the dequantized weights, {dense:.1e} vs "
          "the unquantized model")
    assert err < 1e-4 and dense > err, (err, dense)


def test_4bit_generation_equals_transformers_with_dequantized_weights(checkpoint, quantized):  # noqa: F811
    """Greedy generation with images on a fresh 4-bit load (NF4 decode path) equals transformers' generate with
    the dequantized weights, on a left-padded batch of two prompts with one image each (the unquantized model's
    tokens differ: checked once by hand)."""
    from tests.test_vision_generate import NEW, _hf_generate, _prompts
    from unsloth_jax import FastVisionModel

    model, _ = FastVisionModel.from_pretrained(checkpoint[0], dtype="float32", load_in_4bit=True,
                                               load_processor=False)
    inputs = _prompts(quantized[1])
    ours = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    np.testing.assert_array_equal(ours, _hf_generate(quantized[2], inputs))


def test_qlora_sft_with_images_lowers_the_loss(quantized, tmp_path):
    from unsloth_jax import FastVisionModel, SFTConfig, SFTTrainer, UnslothVisionDataCollator

    model, processor, twin = quantized
    model = FastVisionModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    records = vl_models.shapes_dataset(2)
    collator = UnslothVisionDataCollator(model, processor)
    with torch.no_grad():
        ref = twin(**{k: torch.tensor(v).long() if k != "pixel_values" else torch.tensor(v)
                      for k, v in collator(records).items()}).loss.item()  # B = 0: the 4-bit base's loss
    args = SFTConfig(per_device_train_batch_size=2, gradient_accumulation_steps=1, max_steps=3, learning_rate=1e-2,
                     logging_steps=1, output_dir=str(tmp_path / "out"), report_to="none",
                     remove_unused_columns=False, dataset_text_field="",
                     dataset_kwargs={"skip_prepare_dataset": True}, max_length=128)
    trainer = SFTTrainer(model=model, tokenizer=processor, data_collator=collator, train_dataset=records, args=args)
    losses = trainer.train() and trainer.state.loss_history
    print("QLoRA losses", [round(x, 4) for x in losses], "transformers (dequantized) step-1 loss", round(ref, 4))
    assert abs(losses[0] - ref) / ref < 1e-4, (losses[0], ref)
    assert losses[-1] < 0.9 * losses[0], losses
