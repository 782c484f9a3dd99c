"""Wrong argument types and values fail at once in the API, naming the argument and the value."""
from __future__ import annotations

import pytest

from unsloth_jax import FastLanguageModel
from unsloth_jax.cli import DEFAULT_MODEL


@pytest.fixture(scope="module")
def tiny():
    model, _ = FastLanguageModel.from_pretrained(DEFAULT_MODEL, dtype="float32", load_tokenizer=False,
                                                 progress=False)
    return model


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(r=8.5), TypeError, "r must be an integer, got 8.5"),
    (dict(r=0), ValueError, "r must be >= 1, got 0"),
    (dict(r=True), TypeError, "r must be an integer"),
    (dict(lora_alpha="16"), TypeError, "lora_alpha must be a number, got '16'"),
    (dict(lora_alpha=0), ValueError, "lora_alpha must be > 0"),
    (dict(lora_dropout=1.0), ValueError, "lora_dropout must be < 1"),
    (dict(bias="some"), ValueError, "bias 'some' is not supported"),
    (dict(target_modules=["q_proj", "qkv"]), ValueError, "unknown target module(s) ['qkv']"),
    (dict(target_modules=[]), ValueError, "target_modules is empty"),
    (dict(use_rslora="yes"), TypeError, "use_rslora must be True or False"),
    (dict(random_state=1.5), TypeError, "random_state must be an integer"),
    (dict(max_seq_length=0), ValueError, "max_seq_length must be >= 1"),
])
def test_get_peft_model_rejects_bad_arguments(tiny, kwargs, error, words):
    with pytest.raises(error) as e:
        FastLanguageModel.get_peft_model(tiny, **kwargs)
    assert words in str(e.value)
    assert tiny.lora is None  # nothing was added


def test_all_linear_targets_every_projection(tiny):
    import jax
    from flax import nnx

    model = nnx.clone(tiny)
    FastLanguageModel.get_peft_model(model, r=2, target_modules="all-linear")
    assert set(model.lora.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj"}
    assert all(lin.lora_a is not None for lin in model.projections().values())
    assert jax.tree.leaves(nnx.state(model, nnx.LoRAParam))


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(max_seq_length=0), ValueError, "max_seq_length must be >= 1, got 0"),
    (dict(max_seq_length="2048"), TypeError, "max_seq_length must be an integer"),
    (dict(load_in_4bit="yes"), TypeError, "load_in_4bit must be True or False"),
    (dict(dtype="int8"), ValueError, "dtype='int8' is not supported"),
])
def test_from_pretrained_rejects_bad_arguments(kwargs, error, words):
    with pytest.raises(error) as e:
        FastLanguageModel.from_pretrained(DEFAULT_MODEL, load_tokenizer=False, progress=False, **kwargs)
    assert words in str(e.value)


def test_for_inference_and_for_training_return_the_model_unchanged(tiny):
    """Unsloth's switches are kept for its users and change nothing (for_training's use_gradient_checkpointing is
    accepted and ignored: the remat mode stays the one get_peft_model chose)."""
    from flax import nnx

    model = nnx.clone(tiny)
    FastLanguageModel.get_peft_model(model, r=2, use_gradient_checkpointing=True)
    mode, graph = model.gradient_checkpointing, nnx.graphdef(model)
    assert FastLanguageModel.for_inference(model) is model
    assert FastLanguageModel.for_training(model, use_gradient_checkpointing=False) is model
    assert FastLanguageModel.for_training(model) is model
    assert model.gradient_checkpointing == mode and nnx.graphdef(model) == graph


def test_moved_names_say_where_they_went():
    """Public names that moved fail with an error naming the replacement (issue 38, item 17)."""
    import pallas_kernels.nf4 as nf4_kernels
    from unsloth_jax import lora

    with pytest.raises(AttributeError, match=r"pallas_kernels\.nf4_format\.quantize_nf4"):
        nf4_kernels.quantize_nf4
    with pytest.raises(AttributeError, match=r"pallas_kernels\.nf4_format\.stack_nf4"):
        nf4_kernels.stack_nf4
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        nf4_kernels.no_such_name
    with pytest.raises(TypeError, match=r"lora\.split\(model\).*nnx\.merge"):
        lora.split({"model": {"layers": {}}})
