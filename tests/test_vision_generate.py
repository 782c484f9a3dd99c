"""Generation with images (Gemma 3, tiny random model, float32): greedy tokens equal transformers'
Gemma3ForConditionalGeneration.generate on a left-padded batch of two rows with images (bidirectional image blocks
wider than the sliding window), with LoRA B = 0 (the base model's computation) and with random LoRA pairs on both
towers (transformers + PEFT with the saved adapter)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from tests import vl_models  # noqa: E402
from tests.test_vision_sft import _load, _randomise_lora  # noqa: E402

pytestmark = pytest.mark.torch
NEW = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny random Gemma 3 with its token embeddings scaled by 0.2, so that greedy decoding does not just
    repeat the last prompt token (tied embeddings dominate the unscaled model's logits): varied tokens, and the
    image blocks' bidirectional attention changes them."""
    path = tmp_path_factory.mktemp("gemma3_vl_generate")
    hf = vl_models.hf_gemma3()
    with torch.no_grad():
        hf.model.language_model.embed_tokens.weight.mul_(0.2)
    hf.save_pretrained(path)
    vl_models.processor().save_pretrained(path)
    return path, hf


def _prompts(processor, rows: int = 2):
    """The processor's left-padded batch (numpy) of `rows` chat prompts with one image each, of different lengths."""
    records = vl_models.shapes_dataset(rows)
    texts = [processor.apply_chat_template([r["messages"][0]], add_generation_prompt=True) + " x" * (2 * i)
             for i, r in enumerate(records)]
    processor.tokenizer.padding_side = "left"
    return dict(processor(text=texts, images=[r["images"] for r in records], return_tensors="np", padding=True))


def _hf_generate(hf, inputs):
    kw = {k: torch.tensor(v) if k == "pixel_values" else torch.tensor(v).long() for k, v in inputs.items()}
    with torch.no_grad():
        return hf.generate(**kw, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW).numpy()


@pytest.fixture(scope="module")
def lora_model(checkpoint):
    """One model with LoRA on both towers for both tests, so they share its compiled prefill and decode step
    (same batch shapes, same graph: only the LoRA values differ)."""
    from unsloth_jax import FastVisionModel

    model, processor = _load(checkpoint[0], finetune_vision_layers=True)
    return FastVisionModel.for_inference(model), processor


def test_greedy_with_images_equals_transformers(checkpoint, lora_model):
    """LoRA B = 0 (PEFT's initialisation): exactly the base model's computation, against transformers' base."""
    import jax.numpy as jnp

    path, hf = checkpoint
    model, processor = lora_model
    for lin in [*model.projections().values(), *model.vision_projections().values()]:
        lin.lora_b[...] = jnp.zeros_like(lin.lora_b[...])
    inputs = _prompts(processor)
    assert inputs["attention_mask"][0, 0] == 0  # row 0 is left padded
    ours = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    theirs = _hf_generate(hf, inputs)
    print("ours", ours[:, -NEW:].tolist(), "transformers", theirs[:, -NEW:].tolist())
    assert ours.shape == theirs.shape and (ours == theirs).all()
    assert len(set(ours[:, -NEW:].ravel().tolist())) > 4  # not one repeated token
    # the image blocks' bidirectional attention matters here: without token_type_ids (causal) transformers differs
    plain = {k: v for k, v in inputs.items() if k != "token_type_ids"}
    assert not (_hf_generate(hf, plain) == theirs).all()


def test_greedy_with_lora_equals_peft(checkpoint, lora_model, tmp_path):
    import copy

    path, hf = checkpoint
    model, processor = lora_model
    _randomise_lora(model, seed=5)
    model.save_pretrained(tmp_path / "adapter")
    twin = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "adapter").eval()
    inputs = _prompts(processor)
    ours = model.generate(**inputs, max_new_tokens=NEW)
    theirs = _hf_generate(twin, inputs)
    base = _hf_generate(hf, inputs)
    print("ours", ours[:, -NEW:].tolist(), "peft", theirs[:, -NEW:].tolist(), "base", base[:, -NEW:].tolist())
    assert (ours == theirs).all() and not (theirs[:, -NEW:] == base[:, -NEW:]).all(axis=1).any()  # both rows moved


def test_bad_inputs_are_named(checkpoint):
    from unsloth_jax import FastVisionModel

    model, processor = FastVisionModel.from_pretrained(checkpoint[0], dtype="float32")
    inputs = _prompts(processor)
    with pytest.raises(ValueError, match="pixel_values is None"):
        model.generate(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    with pytest.raises(ValueError, match="image tokens"):
        model.generate(**{**inputs, "pixel_values": inputs["pixel_values"][:1]})
    with pytest.raises(ValueError, match="min_p"):
        model.generate(**inputs, do_sample=True, min_p=1.5)
    with pytest.raises(TypeError, match="num_beams"):
        model.generate(**inputs, num_beams=2)
