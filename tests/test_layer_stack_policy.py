"""The layer-stack policy (unsloth_jax.models.layer_stack.LayerStackPolicy): one typed value, parsed once where the
user gives it, named by the remat mode users know, and refused with the argument's name when unknown."""
from __future__ import annotations

import dataclasses

import optax
import pytest
from flax import nnx

from unsloth_jax import FastLanguageModel
from unsloth_jax.models.layer_stack import MODES, NO_REMAT, SETTINGS, LayerStackPolicy
from unsloth_jax.train import make_train_step

TINY = "unsloth_jax/assets/tiny-llama"


def test_names_parse_back_to_the_same_policy():
    parse = LayerStackPolicy.parse
    names = list(MODES) + ["full_every_4", "offload_every_2", "offload,layer_loop=unrolled",
                           "offload_attention,offload_attention=policy,offload_weights=in_step,offload_copies=whole",
                           "full_every_3,layer_loop=unrolled"]
    for name in names:
        policy = parse(name)
        assert str(policy) == policy.name == name and parse(policy.name) == policy and parse(policy) is policy
        assert policy == name and hash(policy) == hash(parse(name)) and repr(policy) == f"LayerStackPolicy({name!r})"
    assert {parse(v).name for v in (False, None, True, "unsloth")} == {"none", "full", "offload"}
    assert parse("unsloth,layer_loop=unrolled") == "offload,layer_loop=unrolled"
    assert parse("full", 4) == parse("full_every_4") == LayerStackPolicy("full", layers_per_checkpoint=4)
    assert parse("offload") == LayerStackPolicy("full", "inputs") and NO_REMAT == "none"
    assert parse(" offload , layer_loop = unrolled ") == "offload,layer_loop=unrolled"
    # the settings' defaults are left out of the name; the fields say what the stack does
    assert parse("offload,layer_loop=scan").name == "offload"
    assert parse("offload_attention").prefetch_weights and not parse("offload").prefetch_weights
    assert parse("offload,offload_weights=prefetch").prefetch_weights
    assert parse("offload_attention").offload_scan and not parse("offload_attention,offload_attention=policy").offload_scan
    assert parse("offload,offload_copies=whole").copy_chunk_bytes is None
    # different settings, different values (and jit keys)
    assert len({parse("offload"), parse("offload,layer_loop=unrolled"), parse("offload_every_2")}) == 3
    assert parse("full") != parse("none") and parse("full") != "offload" and parse("full") != True  # noqa: E712


def test_unknown_values_name_the_argument():
    parse = LayerStackPolicy.parse
    with pytest.raises(ValueError, match=r"^remat: unknown remat mode 'fast'"):
        parse("fast")
    with pytest.raises(ValueError, match=r"^use_gradient_checkpointing: unknown remat mode 3"):
        parse(3, argument="use_gradient_checkpointing")
    with pytest.raises(ValueError, match=r"^remat: 'layer_loop=sideways' in 'offload,layer_loop=sideways' is not a "
                                         r"layer-stack setting; layer_loop: scan\|unrolled"):
        parse("offload,layer_loop=sideways")
    with pytest.raises(ValueError, match="'colour=red' .* is not a layer-stack setting"):
        parse("full,colour=red")
    with pytest.raises(ValueError, match="already keeps every 2-th layer input; layers_per_checkpoint=4"):
        parse("full_every_2", 4)
    with pytest.raises(ValueError, match="checkpoint='save_attention' with offload='inputs' is not a remat mode"):
        LayerStackPolicy("save_attention", "inputs")
    with pytest.raises(ValueError, match="layer_loop must be one of 'scan', 'unrolled', got 'loop'"):
        LayerStackPolicy(layer_loop="loop")
    with pytest.raises(ValueError, match="layers_per_checkpoint needs gradient checkpointing"):
        LayerStackPolicy("full", "inputs_and_attention", 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        NO_REMAT.layer_loop = "unrolled"
    assert set(SETTINGS) == {"layer_loop", "offload_attention", "offload_weights", "offload_copies"}


def test_user_arguments_are_parsed_once_where_given(monkeypatch):
    """get_peft_model parses use_gradient_checkpointing (+ layers_per_checkpoint) into model.gradient_checkpointing,
    a LayerStackPolicy (in the model's graphdef: hashable), before it changes the model; make_train_step parses its
    remat, Unsloth's values included, and refuses an unknown one when it is made."""
    import unsloth_jax.train.step as step_mod

    model, _ = FastLanguageModel.from_pretrained(TINY, dtype="float32", load_tokenizer=False, progress=False)
    with pytest.raises(ValueError, match="^use_gradient_checkpointing: unknown remat mode 'sometimes'"):
        FastLanguageModel.get_peft_model(model, r=2, use_gradient_checkpointing="sometimes")
    assert model.lora is None  # refused before the adapters were added
    monkeypatch.setattr(step_mod, "host_offload_supported", lambda: True)
    FastLanguageModel.get_peft_model(model, r=2, use_gradient_checkpointing="unsloth,offload_copies=whole",
                                     layers_per_checkpoint=1)
    assert isinstance(model.gradient_checkpointing, LayerStackPolicy)
    assert model.gradient_checkpointing == "offload,offload_copies=whole"
    assert hash(nnx.graphdef(model)) == hash(nnx.graphdef(model))
    graphdef = nnx.graphdef(model)
    for remat in (True, False, "unsloth", "full_every_2", model.gradient_checkpointing):
        make_train_step(graphdef, optax.sgd(0.1), remat=remat)
    with pytest.raises(ValueError, match="^remat: unknown remat mode 'offload_every_two'"):
        make_train_step(graphdef, optax.sgd(0.1), remat="offload_every_two")


def test_offload_fallback_without_pinned_host_memory_keeps_the_rest(monkeypatch, caplog):
    import unsloth_jax.train.step as step_mod

    monkeypatch.setattr(step_mod, "host_offload_supported", lambda: False)
    assert step_mod.resolve_remat("unsloth") == "full"
    assert step_mod.resolve_remat("offload_attention,offload_weights=in_step,layer_loop=unrolled", 4) \
        == "full_every_4,layer_loop=unrolled"
    assert step_mod.resolve_remat("save_attention") == "save_attention"
    assert "host offload of checkpointed activations needs a GPU" in caplog.text
