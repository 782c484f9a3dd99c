"""Qwen3.5 as released (model_type qwen3_5) equals transformers' Qwen3_5ForConditionalGeneration (float32, tiny
random config: gated DeltaNet and gated attention layers, partial interleaved M-RoPE, Qwen3-VL's tower without
DeepStack, an mtp.* head in the checkpoint): the tower and the logits of a batch with two images and a
right-padded text row, and of a text-only right-padded batch; a LoRA step on both towers lowers the loss, its
adapter loads in PEFT and back here with equal logits, its merged export in transformers with no missing /
unexpected keys (the mtp.* head copied through) and equal logits; greedy generation with images on the engine
equals transformers' generate; FastLanguageModel loads the checkpoint whole and trains, saves and generates
text; the config's refusals."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from tests import vl_qwen_models as qm  # noqa: E402
from tests.conftest import fresh_seed  # noqa: E402
from tests.family_checks import lora_steps_lower_the_loss, right_padded, torch_logits  # noqa: E402
from tests.helpers import rel_err  # noqa: E402
from tests.vl_qwen3_5_models import hf_qwen3_5, save_with_mtp  # noqa: E402
from tests.vl_qwen3_models import assert_greedy_with_images_matches, mm_token_type_ids  # noqa: E402

pytestmark = pytest.mark.torch

# Largest relative errors over 12 random models and inputs (float32, random LoRA factors on both towers): tower
# 4.3e-7, image-batch logits 4.2e-6, text-batch logits 4.3e-6, PEFT adapter 5.7e-6, merged export 5.9e-6 (float32
# rounding in different summation orders); the bound leaves a margin of 5x over the largest.
BOUND = 3e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, transformers' model, the mtp.* tensors) of a fresh random tiny Qwen3.5."""
    path = tmp_path_factory.mktemp("qwen3_5")
    seed = fresh_seed("qwen3_5 model") % (1 << 31)
    hf = hf_qwen3_5(seed)
    mtp = save_with_mtp(hf, path, seed)
    return path, hf, mtp


@pytest.fixture(scope="module")
def fast(checkpoint):
    from unsloth_jax import FastVisionModel

    model, _ = FastVisionModel.from_pretrained(checkpoint[0], dtype="float32", load_processor=False)
    return model


def _hf_kwargs(ids, mask, pixels, grids) -> dict:
    return dict(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), pixel_values=torch.tensor(pixels),
                image_grid_thw=torch.tensor(grids), mm_token_type_ids=torch.tensor(mm_token_type_ids(ids)))


def test_tower_and_logits_match_transformers(checkpoint, fast, rng):
    from unsloth_jax.families import QWEN3_5, family_of

    _, hf, _ = checkpoint
    assert family_of(fast) is QWEN3_5 and not hasattr(fast.visual, "deepstack_merger_0")
    assert "qwen3_5, text layers=4 (3 linear attention)" in repr(fast)
    ids, mask, pixels, grids = qm.inputs(rng)
    with torch.no_grad():
        tower = hf.model.visual(torch.tensor(pixels), grid_thw=torch.tensor(grids)).pooler_output.numpy()
        ref = hf(**_hf_kwargs(ids, mask, pixels, grids)).logits.numpy()
    feats, deep = fast.image_and_deepstack_features(pixels, grids)
    assert deep.shape[0] == 0
    err = rel_err(np.asarray(feats), tower)
    assert err < BOUND, err
    out = np.asarray(fast(ids, mask, pixel_values=pixels, image_grid_thw=grids))
    real = mask.astype(bool)
    err = rel_err(out[real], ref[real])
    print(f"image batch logits relative error {err:.2e}")
    assert err < BOUND, err

    ids, mask = right_padded(rng, [13, 6, 9], vocab=qm.IMAGE)  # text only (no vision token ids 250-253)
    real = mask.astype(bool)
    err = rel_err(np.asarray(fast(ids, mask))[real], torch_logits(hf, ids, mask)[real])
    print(f"text batch logits relative error {err:.2e}")
    assert err < BOUND, err


def test_config_and_refusals(checkpoint):
    from unsloth_jax.errors import ConfigError, UnsupportedArchitectureError
    from unsloth_jax.families import QWEN3_5, family_for, text_config

    raw = json.loads((checkpoint[0] / "config.json").read_text())
    assert family_for(raw) is QWEN3_5
    cfg = QWEN3_5.parse_config(raw)
    t = cfg.text
    assert t.model_type == "qwen3_5_text" and t.layer_linear == (True, True, True, False) and t.attn_output_gate
    assert t.rope_dim == 8 and cfg.mrope_section == (2, 1, 1) and cfg.mrope_interleaved
    assert cfg.vision.deepstack_visual_indexes == () and cfg.vision.grid_side == 4
    assert (cfg.image_token_id, cfg.vision_start_token_id) == (qm.IMAGE, qm.VSTART)
    with_deepstack = copy.deepcopy(raw)  # transformers' Qwen3_5VisionModel has no DeepStack: the key is ignored
    with_deepstack["vision_config"]["deepstack_visual_indexes"] = [0, 2]
    assert QWEN3_5.parse_config(with_deepstack).vision.deepstack_visual_indexes == ()
    with pytest.raises(UnsupportedArchitectureError, match="FastVisionModel"):
        text_config(raw)

    released = transformers.Qwen3_5Config().to_dict()  # transformers' defaults (Qwen3.5-9B's shapes) with the
    released["vision_config"]["out_hidden_size"] = 4096  # merger's width the text's (the class default is not)
    released["text_config"] |= {"attn_output_gate": True, "mtp_num_hidden_layers": 1}  # keys released files add
    big = QWEN3_5.parse_config(released)
    assert (big.text.hidden_size, big.text.num_hidden_layers, big.text.rope_dim) == (4096, 32, 64)
    assert big.mrope_section == (11, 11, 10) and big.image_token_id == 248056 and big.vision.depth == 27

    for where, change, match in (
            ("text_config", {"model_type": "qwen3_text"}, "text_config.model_type"),
            ("rope_parameters", {"mrope_section": [2, 2, 2]}, "mrope_section"),
            ("rope_parameters", {"mrope_interleaved": False}, "mrope_interleaved"),
            ("vision_config", {"hidden_act": "silu"}, "vision_config.hidden_act"),
            ("vision_config", {"out_hidden_size": 32}, "out_hidden_size")):
        bad = copy.deepcopy(raw)
        target = bad["text_config"]["rope_parameters"] if where == "rope_parameters" else bad[where]
        target.update(change)
        with pytest.raises(ConfigError, match=match):
            QWEN3_5.parse_config(bad)


def test_lora_step_peft_adapter_and_merged_export(checkpoint, fast, rng, tmp_path):
    """LoRA on both towers (attention, linear attention and MLP): one optimizer step on a batch with images lowers
    the loss; the saved adapter in transformers + PEFT and read back here, and the merged float32 export in
    transformers give our logits."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from safetensors.numpy import load_file

    from unsloth_jax import FastVisionModel, lora
    from unsloth_jax.data.vision_loader import pad_patches
    from unsloth_jax.families import family_of
    from unsloth_jax.config import layer_has
    from unsloth_jax.models.decoder import PROJ_PARENT

    path, hf, mtp = checkpoint
    model = FastVisionModel.get_peft_model(fast, r=4, lora_alpha=8, finetune_vision_layers=True,
                                           use_gradient_checkpointing=False)
    assert {"in_proj_qkv", "out_proj", "q_proj", "down_proj"} <= set(model.lora.target_modules)
    ids, mask, pixels, grids = qm.inputs(rng)
    fields = pad_patches(dict(pixel_values=pixels, image_grid_thw=grids), model.vl_config.vision, pixels.shape[0] + 4)
    batch = {k: v for k, v in fields.items() if k != "image_grid_thw"}
    batch |= dict(input_ids=ids, attention_mask=mask, mrope_positions=model.rope_positions(ids, mask, grids))
    inputs = family_of(model).prepare_inputs({k: jnp.asarray(v) for k, v in batch.items()})
    graphdef, trainable, frozen = lora.split(model)

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
    learned = {tuple(map(str, p))[:4] for p, g in nnx.to_flat_state(grads) if float(jnp.abs(g[...]).max()) > 0}
    assert {("model", "layers", "linear_attn", "in_proj_qkv"), ("model", "layers", "self_attn", "q_proj"),
            ("visual", "blocks", "attn", "qkv")} <= learned  # both mixers and the tower learn
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
    held = {"language": lambda i, p: layer_has(model.config, i, f"{PROJ_PARENT[p]}.{p}."),
            "vision": lambda i, p: True}
    expected = sum(4 * (lin.in_features + lin.out_features) * sum(held[tower](i, p) for i in range(layers))
                   for tower, names, lins, layers in (
                       ("language", model.lora.target_modules, model.projections(), model.config.num_hidden_layers),
                       ("vision", model.lora.vision_target_modules, model.vision_projections(),
                        model.vl_config.vision.depth))
                   for p, lin in lins.items() if p in names)
    assert n_peft == expected
    with torch.no_grad():
        ref = twin(**_hf_kwargs(ids, mask, pixels, grids)).logits.numpy()
    err = rel_err(ours[real], ref[real])
    print(f"PEFT adapter logits relative error {err:.2e}")
    assert err < BOUND, err
    back, _ = FastVisionModel.from_pretrained(tmp_path / "adapter", dtype="float32", load_processor=False)
    again = np.asarray(back(ids, mask, pixel_values=pixels, image_grid_thw=grids))
    assert rel_err(again[real], ours[real]) < 1e-6

    model.save_pretrained_merged(tmp_path / "merged", dtype="float32")
    merged, info = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
        tmp_path / "merged", dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    written = load_file(str(tmp_path / "merged" / "model.safetensors"))
    for name, value in mtp.items():  # the head transformers skips, copied through unchanged
        np.testing.assert_array_equal(written[name], value)
    with torch.no_grad():
        got = merged.eval()(**_hf_kwargs(ids, mask, pixels, grids)).logits.numpy()
    err = rel_err(got[real], ours[real])
    print(f"merged export logits relative error {err:.2e}")
    assert err < BOUND, err


def test_greedy_generation_with_images_equals_transformers(checkpoint, rng):
    """A left-padded batch: row 0 with two images of different grids, row 1 with a third (M-RoPE in the prefill,
    rope_deltas in the decode, each row's linear-attention state from its own prompt)."""
    from unsloth_jax import FastVisionModel

    path, hf, _ = checkpoint
    model, _ = FastVisionModel.from_pretrained(path, dtype="float32", load_processor=False)
    assert_greedy_with_images_matches(model, hf, rng, _hf_kwargs)


def test_language_model_loads_whole_and_trains_text(checkpoint, rng, tmp_path):
    """FastLanguageModel.from_pretrained of the released layout gives the whole model (as Unsloth hands a
    vision-language checkpoint to FastModel): its text generation equals transformers', the SFT step on text
    batches lowers the loss, its adapter applies in PEFT to Qwen3_5ForConditionalGeneration with equal logits and
    loads back through FastLanguageModel. full_finetuning is refused by name."""
    from flax import nnx

    from unsloth_jax import FastLanguageModel, VisionLanguageModel
    from unsloth_jax.errors import ConfigError

    path, hf, _ = checkpoint
    with pytest.raises(ConfigError, match="vision-language checkpoint"):
        FastLanguageModel.from_pretrained(path, dtype="float32", full_finetuning=True, load_tokenizer=False)
    model, tokenizer = FastLanguageModel.from_pretrained(path, dtype="float32", load_tokenizer=False)
    assert isinstance(model, VisionLanguageModel) and tokenizer is None

    width, new = 9, 6
    prompts = np.zeros((2, width), np.int64)
    pmask = np.zeros_like(prompts)
    for i, n in enumerate((9, 4)):
        prompts[i, width - n:], pmask[i, width - n:] = rng.integers(3, 240, n), 1
    mine = model.generate(input_ids=prompts, attention_mask=pmask, max_new_tokens=new, do_sample=False)
    with torch.no_grad():
        theirs = hf.generate(input_ids=torch.tensor(prompts), attention_mask=torch.tensor(pmask), max_new_tokens=new,
                             do_sample=False).numpy()
    for row, hf_row in zip(mine[:, width:], theirs[:, width:]):
        stop = list(hf_row).index(2) + 1 if 2 in hf_row else new
        assert row[:stop].tolist() == hf_row[:stop].tolist(), (mine, theirs)

    model = FastLanguageModel.get_peft_model(model, r=4, target_modules="all-linear", use_gradient_checkpointing=False)
    assert {"in_proj_z", "o_proj", "up_proj"} <= set(model.lora.target_modules) and not model.lora.vision_target_modules
    _, trained, _ = lora_steps_lower_the_loss(model, rng, vocab=qm.IMAGE)  # text only
    nnx.update(model, trained)

    ids, mask = right_padded(rng, [11, 5], vocab=qm.IMAGE)
    real = mask.astype(bool)
    ours = np.asarray(model(ids, mask))
    model.save_pretrained(tmp_path / "adapter")
    twin = peft.PeftModel.from_pretrained(copy.deepcopy(hf), str(tmp_path / "adapter")).eval()
    err = rel_err(ours[real], torch_logits(twin, ids, mask)[real])
    print(f"text adapter logits relative error {err:.2e}")
    assert err < BOUND, err
    back, _ = FastLanguageModel.from_pretrained(tmp_path / "adapter", dtype="float32", load_tokenizer=False)
    assert rel_err(np.asarray(back(ids, mask))[real], ours[real]) < 1e-6


def test_processor_and_collator_without_torchvision(tmp_path, rng):
    """A Qwen3.5 folder with processor files (processor_class Qwen3VLProcessor, as released): without torchvision
    FastVisionModel.from_pretrained builds its processor (images only) with the reference processor's ids, pixels
    and grids; UnslothVisionDataCollator's batch (M-RoPE positions, the padded tower layout) gives transformers'
    loss of the same batch."""
    import jax.numpy as jnp

    from tests.test_vision_qwen_sft import squares
    from unsloth_jax import FastVisionModel, UnslothVisionDataCollator
    from unsloth_jax.data.vision_loader import pad_patches
    from unsloth_jax.families import family_of

    folder = tmp_path / "model"
    hf = hf_qwen3_5(fresh_seed("qwen3_5 processor-vocab model") % (1 << 31), processor_vocab=True)
    hf.save_pretrained(folder)
    reference = qm.processor()
    reference.save_pretrained(folder)
    config = json.loads((folder / "processor_config.json").read_text())
    (folder / "processor_config.json").write_text(json.dumps(config | {"processor_class": "Qwen3VLProcessor"}))
    model, processor = FastVisionModel.from_pretrained(folder, dtype="float32")
    records = squares([[(16, 16), (16, 24)], [(24, 16)]], seed=int(rng.integers(1 << 16)))
    texts = [reference.apply_chat_template(r["messages"], tokenize=False) for r in records]
    ours = processor(text=texts, images=[r["images"] for r in records], padding=True, return_tensors="np")
    ref = reference(text=texts, images=[r["images"] for r in records], padding=True, return_tensors="np")
    for key in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw"):
        np.testing.assert_array_equal(ours[key], ref[key])
    with pytest.raises(ValueError, match="videos"):
        processor(text=texts, videos=[np.zeros((2, 16, 16, 3), np.uint8)])

    full = UnslothVisionDataCollator(model, processor)(records)
    fields = pad_patches(full, model.vl_config.vision, full["pixel_values"].shape[0] + 4)
    batch = {k: jnp.asarray(v) for k, v in fields.items() if k != "image_grid_thw"}
    inputs = family_of(model).prepare_inputs(batch)
    logits = np.asarray(model.logits_from_hidden(family_of(model).hidden_states(model, inputs)), np.float64)
    labels = full["labels"][:, 1:]
    logp = logits[:, :-1] - np.log(np.exp(logits[:, :-1]).sum(-1, keepdims=True))
    keep = labels != -100
    loss = -np.take_along_axis(logp, np.where(keep, labels, 0)[..., None], -1)[..., 0][keep].mean()
    with torch.no_grad():
        ref_loss = hf(input_ids=torch.tensor(full["input_ids"]).long(),
                      attention_mask=torch.tensor(full["attention_mask"]).long(),
                      pixel_values=torch.tensor(full["pixel_values"]),
                      image_grid_thw=torch.tensor(full["image_grid_thw"]),
                      mm_token_type_ids=torch.tensor(mm_token_type_ids(full["input_ids"], qm.P_IMAGE)),
                      labels=torch.tensor(full["labels"]).long()).loss.item()
    print(f"collated batch loss {loss:.6f}, transformers {ref_loss:.6f}")
    assert abs(loss - ref_loss) / ref_loss < 1e-5, (loss, ref_loss)
