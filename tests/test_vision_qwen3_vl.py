"""Qwen3-VL equals transformers' Qwen3VLForConditionalGeneration (float32, tiny random config with DeepStack,
interleaved M-RoPE and a resampled position grid): the tower and its DeepStack features, the logits of a batch
with two images of different grids in one row and a right-padded text row; a LoRA step on both towers
(FastVisionModel's switches) lowers the loss, its adapter loads in PEFT with equal logits, its merged export in
transformers with no missing / unexpected keys and equal logits; greedy generation with images on the engine
equals transformers' generate; the config's refusals."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.helpers import rel_err  # noqa: E402
from tests import vl_qwen_models as qm  # noqa: E402
from tests.vl_qwen3_models import assert_greedy_with_images_matches, hf_qwen3_vl, mm_token_type_ids  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_vl")
    hf = hf_qwen3_vl()
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module")
def fast(checkpoint):
    from unsloth_jax import FastVisionModel

    model, _ = FastVisionModel.from_pretrained(checkpoint[0], dtype="float32", load_processor=False)
    return model


def _hf_kwargs(ids, mask, pixels, grids) -> dict:
    return dict(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), pixel_values=torch.tensor(pixels),
                image_grid_thw=torch.tensor(grids), mm_token_type_ids=torch.tensor(mm_token_type_ids(ids)))


def test_tower_and_logits_match_transformers(checkpoint, fast, rng):
    _, hf = checkpoint
    ids, mask, pixels, grids = qm.inputs(rng)
    with torch.no_grad():
        tower = hf.model.visual(torch.tensor(pixels), grid_thw=torch.tensor(grids))
        ref = hf(**_hf_kwargs(ids, mask, pixels, grids)).logits.numpy()
    feats, deep = fast.image_and_deepstack_features(pixels, grids)
    assert rel_err(np.asarray(feats), tower.pooler_output.numpy()) < 1e-5
    assert deep.shape[0] == 2
    for mine, theirs in zip(deep, tower.deepstack_features):
        assert rel_err(np.asarray(mine), theirs.numpy()) < 1e-5
    out = np.asarray(fast(ids, mask, pixel_values=pixels, image_grid_thw=grids))
    real = mask.astype(bool)
    err = rel_err(out[real], ref[real])
    print(f"logits relative error {err:.2e}")
    assert err < 1e-5, err
    # without DeepStack the logits differ: the residuals are applied
    ref_no_deep = np.asarray(fast.logits_from_hidden(fast.model.norm(fast.model.run_layers(
        fast.embed_with_images(ids, pixels, grids), *_tables(fast, ids, mask, grids), _batch(ids, mask))[0])))
    assert rel_err(ref_no_deep[real], ref[real]) > 1e-3


def _tables(model, ids, mask, grids):
    import jax.numpy as jnp

    from unsloth_jax.models.rope import mrope_tables

    return mrope_tables(model.config, jnp.asarray(model.rope_positions(ids, mask, grids)),
                        model.vl_config.mrope_section, interleaved=True)


def _batch(ids, mask):
    import jax.numpy as jnp

    from unsloth_jax.models.decoder import make_batch

    return make_batch(jnp.asarray(ids), jnp.asarray(mask))


def test_config_and_refusals(checkpoint):
    from unsloth_jax.errors import ConfigError, UnsupportedArchitectureError
    from unsloth_jax.families import QWEN3_VL, text_config
    from unsloth_jax.models.rope import mrope_axes

    raw = json.loads((checkpoint[0] / "config.json").read_text())
    cfg = QWEN3_VL.parse_config(raw)
    assert cfg.text.qk_norm and not cfg.text.qkv_bias and cfg.mrope_section == (4, 2, 2) and cfg.mrope_interleaved
    assert cfg.vision.deepstack_visual_indexes == (0, 2) and cfg.vision.grid_side == 4
    assert mrope_axes((4, 2, 2), interleaved=True).tolist() == [0, 1, 2, 0, 1, 2, 0, 0]
    with pytest.raises(UnsupportedArchitectureError, match="FastVisionModel"):
        text_config(raw)
    bad = copy.deepcopy(raw)
    bad["vision_config"]["deepstack_visual_indexes"] = [0, 5]
    with pytest.raises(ConfigError, match="deepstack_visual_indexes"):
        QWEN3_VL.parse_config(bad)
    bad = copy.deepcopy(raw)
    bad["vision_config"]["num_position_embeddings"] = 15
    with pytest.raises(ConfigError, match="num_position_embeddings"):
        QWEN3_VL.parse_config(bad)


def test_lora_step_peft_adapter_and_merged_export(checkpoint, fast, rng, tmp_path):
    """LoRA on both towers (attention and MLP): one optimizer step on a batch with images lowers the loss; the
    saved adapter in transformers + PEFT and the merged float32 export in transformers give our logits."""
    import jax
    import jax.numpy as jnp
    import optax
    import peft
    import transformers
    from flax import nnx

    from unsloth_jax import FastVisionModel, lora
    from unsloth_jax.families import family_of

    path, hf = checkpoint
    model = FastVisionModel.get_peft_model(fast, r=4, lora_alpha=8, finetune_vision_layers=True,
                                           finetune_language_layers=True, finetune_attention_modules=True,
                                           finetune_mlp_modules=True, use_gradient_checkpointing=False)
    ids, mask, pixels, grids = qm.inputs(rng)
    from unsloth_jax.data.vision_loader import pad_patches

    fields = pad_patches(dict(pixel_values=pixels, image_grid_thw=grids), model.vl_config.vision, pixels.shape[0] + 4)
    batch = {k: v for k, v in fields.items() if k != "image_grid_thw"}
    batch |= dict(input_ids=ids, attention_mask=mask, mrope_positions=model.rope_positions(ids, mask, grids))
    inputs = family_of(model).prepare_inputs({k: jnp.asarray(v) for k, v in batch.items()})
    graphdef, trainable, frozen = lora.split(model)
    assert lora.count(trainable) > 0

    def loss(t, inputs):  # a jitted step's inputs: traced, the layout and M-RoPE positions built on the host
        m = nnx.merge(graphdef, t, frozen)
        logits = m.logits_from_hidden(family_of(m).hidden_states(m, inputs))
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        nll = -jnp.take_along_axis(logp, inputs.input_ids[:, 1:, None], axis=-1)[..., 0]
        w = inputs.attention_mask[:, 1:]
        return (nll * w).sum() / w.sum()

    opt = optax.adam(1e-2)
    state = opt.init(trainable)
    step = jax.jit(jax.value_and_grad(loss))
    first, grads = step(trainable, inputs)
    names = {tuple(map(str, p))[:2] for p, g in nnx.to_flat_state(grads) if float(jnp.abs(g[...]).max()) > 0}
    assert ("model", "layers") in names and ("visual", "blocks") in names  # both towers learn
    updates, state = opt.update(grads, state, trainable)
    trainable = optax.apply_updates(trainable, updates)
    second, _ = step(trainable, inputs)
    print(f"loss {float(first):.4f} -> {float(second):.4f}")
    assert float(second) < float(first)
    nnx.update(model, trainable)

    ours = np.asarray(model(ids, mask, pixel_values=pixels, image_grid_thw=grids))
    real = mask.astype(bool)
    with torch.no_grad():
        base = hf(**_hf_kwargs(ids, mask, pixels, grids)).logits.numpy()
    assert rel_err(base[real], ours[real]) > 1e-3  # the adapter changed the logits

    model.save_pretrained(tmp_path / "adapter")
    twin = peft.PeftModel.from_pretrained(copy.deepcopy(hf), str(tmp_path / "adapter")).eval()
    n_peft = sum(p.numel() for n, p in twin.named_parameters() if "lora_" in n)
    assert n_peft == lora.count(lora.split(model)[1])
    with torch.no_grad():
        ref = twin(**_hf_kwargs(ids, mask, pixels, grids)).logits.numpy()
    err = rel_err(ours[real], ref[real])
    print(f"PEFT adapter logits relative error {err:.2e}")
    assert err < 1e-5, err

    model.save_pretrained_merged(tmp_path / "merged", dtype="float32")
    merged, info = transformers.Qwen3VLForConditionalGeneration.from_pretrained(
        tmp_path / "merged", dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        got = merged.eval()(**_hf_kwargs(ids, mask, pixels, grids)).logits.numpy()
    err = rel_err(got[real], ours[real])
    print(f"merged export logits relative error {err:.2e}")
    assert err < 1e-5, err


def test_greedy_generation_with_images_equals_transformers(checkpoint, rng):
    """A left-padded batch: row 0 with two images of different grids, row 1 with a third (M-RoPE and DeepStack in
    the prefill, rope_deltas in the decode)."""
    from unsloth_jax import FastVisionModel

    path, hf = checkpoint
    model, _ = FastVisionModel.from_pretrained(path, dtype="float32", load_processor=False)
    assert_greedy_with_images_matches(model, hf, rng, _hf_kwargs)


def test_processor_collator_and_sft_trainer(tmp_path):
    """A Qwen3-VL folder with processor files (processor_class Qwen3VLProcessor): without torchvision
    FastVisionModel.from_pretrained builds its processor (images only) with the reference processor's ids, pixels
    and grids; SFTTrainer with UnslothVisionDataCollator (the loader's padded Qwen3-VL layout, the jitted step)
    starts at transformers' loss of the batch and lowers it."""
    from unsloth_jax import FastVisionModel, SFTConfig, SFTTrainer, UnslothVisionDataCollator
    from tests.test_vision_qwen_sft import squares

    hf = hf_qwen3_vl(processor_vocab=True)
    hf.save_pretrained(tmp_path / "model")
    reference = qm.processor()
    reference.save_pretrained(tmp_path / "model")
    config = json.loads((tmp_path / "model" / "processor_config.json").read_text())
    config["processor_class"] = "Qwen3VLProcessor"
    (tmp_path / "model" / "processor_config.json").write_text(json.dumps(config))
    model, processor = FastVisionModel.from_pretrained(tmp_path / "model", dtype="float32")
    records = squares([[(16, 16), (16, 24)], [(24, 16)]], seed=2)
    texts = [reference.apply_chat_template(r["messages"], tokenize=False) for r in records]
    ours = processor(text=texts, images=[r["images"] for r in records], padding=True, return_tensors="np")
    ref = reference(text=texts, images=[r["images"] for r in records], padding=True, return_tensors="np")
    for key in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw"):
        np.testing.assert_array_equal(ours[key], ref[key])
    with pytest.raises(ValueError, match="videos"):
        processor(text=texts, videos=[np.zeros((2, 16, 16, 3), np.uint8)])

    model = FastVisionModel.get_peft_model(model, r=4, lora_alpha=8, finetune_vision_layers=True,
                                           use_gradient_checkpointing=False)
    collator = UnslothVisionDataCollator(model, processor)
    full = collator(records)
    with torch.no_grad():  # B = 0: the base model's loss
        ref_loss = hf(input_ids=torch.tensor(full["input_ids"]).long(),
                      attention_mask=torch.tensor(full["attention_mask"]).long(),
                      pixel_values=torch.tensor(full["pixel_values"]),
                      image_grid_thw=torch.tensor(full["image_grid_thw"]),
                      mm_token_type_ids=torch.tensor(mm_token_type_ids(full["input_ids"], qm.P_IMAGE)),
                      labels=torch.tensor(full["labels"]).long()).loss.item()
    args = SFTConfig(per_device_train_batch_size=2, max_steps=4, learning_rate=2e-2, logging_steps=1,
                     output_dir=str(tmp_path / "out"), report_to="none", remove_unused_columns=False,
                     dataset_text_field="", dataset_kwargs={"skip_prepare_dataset": True}, max_length=64)
    trainer = SFTTrainer(model=model, tokenizer=processor, data_collator=collator, train_dataset=records, args=args)
    losses = trainer.train() and trainer.state.loss_history
    print("losses", [round(x, 4) for x in losses])
    assert abs(losses[0] - ref_loss) / ref_loss < 1e-5, (losses[0], ref_loss)
    assert losses[-1] < losses[0], losses
