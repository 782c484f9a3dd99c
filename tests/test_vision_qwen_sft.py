"""Qwen2.5-VL SFT on a tiny random model, against transformers + PEFT (float32): UnslothVisionDataCollator's batch
is the Qwen2.5-VL processor's (image pads expanded per grid, patches normalised) with Unsloth's masks; after the
loader's padding (sequence bucket, patch bucket with the padded window layout) the loss and the LoRA gradients of
both towers equal transformers + PEFT's on the unpadded batch; SFTTrainer with the collator lowers the loss over 6
steps of 2 accumulated micro-batches; a record whose image count is wrong is named."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from tests import vl_qwen_models as qm  # noqa: E402
from tests.helpers import rel_err  # noqa: E402
from unsloth_jax.errors import DatasetFormatError  # noqa: E402

pytestmark = pytest.mark.torch
COLOURS = {"red": (230, 30, 30), "green": (30, 200, 40), "blue": (40, 60, 220)}


def squares(sizes: list[list[tuple[int, int]]], seed: int = 0) -> list[dict]:
    """One chat record per entry of `sizes` (the (height, width) of each of its images): coloured squares on a
    dark background, the colour of the first as the answer."""
    rng = np.random.default_rng(seed)
    out = []
    for i, shapes in enumerate(sizes):
        name = list(COLOURS)[i % 3]
        images = []
        for h, w in shapes:
            image = rng.integers(0, 60, size=(h, w, 3)).astype(np.uint8)
            image[h // 4:3 * h // 4, w // 4:3 * w // 4] = COLOURS[name]
            images.append(image)
        content = [{"type": "image"} for _ in shapes] + [{"type": "text", "text": "What colour is the square?"}]
        out.append({"messages": [{"role": "user", "content": content},
                                 {"role": "assistant", "content": [{"type": "text", "text": f"It is {name}."}]}],
                    "images": images})
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_5_vl_sft")
    hf = qm.hf_qwen_vl(processor_vocab=True)
    hf.save_pretrained(path)
    return path, hf


def _load(path):
    from unsloth_jax import FastVisionModel

    model, _ = FastVisionModel.from_pretrained(path, dtype="float32")
    model = FastVisionModel.get_peft_model(model, r=4, lora_alpha=8, finetune_vision_layers=True,
                                           use_gradient_checkpointing=False)
    return model, qm.processor()


def test_loss_and_lora_gradients_match_transformers_peft(checkpoint):
    """Row 0: two images of different grids (4 x 6 and 8 x 4 patches), row 1: one (6 x 6), responses only. The
    collated batch is the processor's; the loader pads it to 64 tokens and 128 patches (92 real); our loss and
    every LoRA gradient (language and vision blocks) equal transformers + PEFT's on the unpadded batch."""
    loss_err, worst = compare_with_peft(checkpoint, seed=0)
    assert loss_err < 1e-5, loss_err
    assert worst < 1e-4, worst  # seeds 0-3: loss within 1.2e-7, gradients within 3.6e-5 (docs/VISION.md)


def compare_with_peft(checkpoint, seed: int) -> tuple[float, float]:
    """(relative loss error, worst relative LoRA-gradient error) of the test above with LoRA weights and image
    contents from `seed`."""
    import copy

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from unsloth_jax import UnslothVisionDataCollator, lora
    from unsloth_jax.data.vision_loader import VisionLoader
    from unsloth_jax.train.step import loss_and_count

    path, hf = checkpoint
    model, processor = _load(path)
    rng = np.random.default_rng(seed)
    state = nnx.state(model, nnx.LoRAParam)  # random A and B (B = 0 would give A no gradient)
    nnx.update(model, nnx.from_flat_state({p: jnp.asarray(0.2 * rng.standard_normal(v.shape), jnp.float32)
                                           for p, v in nnx.to_flat_state(state)}))
    records = squares([[(16, 24), (32, 16)], [(24, 24)]], seed=seed)
    collator = UnslothVisionDataCollator(model, processor, train_on_responses_only=True,
                                         instruction_part=qm.INSTRUCTION_PART, response_part=qm.RESPONSE_PART)
    batch = collator(records)

    # the processor's ids and patches; labels: -100 on padding, vision tokens and the prompt
    texts = [processor.apply_chat_template(r["messages"], tokenize=False) for r in records]
    ref = processor(text=texts, images=[r["images"] for r in records], padding=True, return_tensors="np",
                    add_special_tokens=False)
    np.testing.assert_array_equal(batch["input_ids"], ref["input_ids"])
    np.testing.assert_array_equal(batch["attention_mask"], ref["attention_mask"])
    np.testing.assert_array_equal(batch["pixel_values"], ref["pixel_values"])
    np.testing.assert_array_equal(batch["image_grid_thw"], [[1, 4, 6], [1, 8, 4], [1, 6, 6]])
    ids, labels = batch["input_ids"], batch["labels"]
    assert labels.dtype == np.int32 and (ids == qm.P_IMAGE).sum() == (24 + 32 + 36) // 4
    tok = processor.tokenizer
    for b, answer in enumerate(["It is red.<|im_end|>\n", "It is green.<|im_end|>\n"]):
        assert tok.decode(labels[b][labels[b] != -100]) == answer
    mm = (ids == qm.P_IMAGE).astype(np.int64)
    ref_pos, _ = hf.model.get_rope_index(torch.tensor(ids).long(), mm_token_type_ids=torch.tensor(mm),
                                         image_grid_thw=torch.tensor(batch["image_grid_thw"]).long(),
                                         attention_mask=torch.tensor(batch["attention_mask"]).long())
    np.testing.assert_array_equal(batch["mrope_positions"], ref_pos.numpy())

    # transformers + PEFT on the collated batch as it is
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=(
        r".*language_model\.layers\.\d+\.(?:self_attn|mlp)\.(?:q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|"
        r"down_proj)|.*visual\.blocks\.\d+\.(?:attn|mlp)\.(?:qkv|proj|gate_proj|up_proj|down_proj)"))
    twin = peft.get_peft_model(copy.deepcopy(hf), cfg)
    params = dict(twin.named_parameters())
    graphdef, trainable, frozen = lora.split(model)
    names = {}
    for p, v in nnx.to_flat_state(trainable):
        p = tuple(map(str, p))
        tower = "model.language_model.layers" if p[0] == "model" else "model.visual.blocks"
        ab = {"lora_a": "lora_A", "lora_b": "lora_B"}[p[-1]]
        value = np.asarray(v.get_value() if hasattr(v, "get_value") else v)
        for i in range(value.shape[0]):
            name = f"base_model.model.{tower}.{i}.{'.'.join(p[2:-1])}.{ab}.default.weight"
            with torch.no_grad():
                params[name].copy_(torch.tensor(value[i].T))
            names[(p, i)] = name
    assert len(names) == len([n for n in params if "lora_" in n]) == 2 * (7 * 2 + 5 * 3)
    out = twin(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(batch["attention_mask"]).long(),
               pixel_values=torch.tensor(batch["pixel_values"]), image_grid_thw=torch.tensor(batch["image_grid_thw"]),
               mm_token_type_ids=torch.tensor(mm), labels=torch.tensor(labels).long())
    out.loss.backward()
    ref_loss = float(out.loss.detach())

    # ours on the loader's padded batch (what the jitted step sees)
    loader = VisionLoader(records, collator, batch_size=2, max_seq_length=64, shuffle=False, image_shape=())
    padded = loader.batch(0, 0)
    assert padded["input_ids"].shape == (2, 64) and padded["pixel_values"].shape == (128, qm.PATCH_DIM)
    assert padded["mrope_positions"].shape == (3, 2, 64) and padded["vision_restore"].shape == (32,)
    dev = {k: jnp.asarray(v) for k, v in padded.items() if k != "image_grid_thw"}

    def f(t, dev):
        return loss_and_count(nnx.merge(graphdef, t, frozen), dev)[0]

    loss, grads = jax.jit(jax.value_and_grad(f))(trainable, dev)
    loss_err = abs(float(loss) - ref_loss) / ref_loss
    worst = 0.0
    flat = {tuple(map(str, p)): np.asarray(g.get_value() if hasattr(g, "get_value") else g)
            for p, g in nnx.to_flat_state(grads)}
    for (p, i), name in names.items():
        theirs = params[name].grad.numpy().T
        assert np.abs(theirs).max() > 0, name
        worst = max(worst, rel_err(flat[p][i], theirs))
    print(f"loss {float(loss):.7f} vs {ref_loss:.7f} (relative {loss_err:.1e}); LoRA gradients worst relative "
          f"error {worst:.1e}")
    return loss_err, worst


def test_sft_trainer_trains_on_images(checkpoint, tmp_path):
    """SFTTrainer with the collator (Unsloth's notebook arguments): 4 records (one with two images), 2 rows x 2
    accumulated micro-batches, one compiled step shape (64 tokens, 64 patches): step 1's loss is transformers'
    loss of the 4 rows as one batch, and 6 steps lower it."""
    from unsloth_jax import SFTConfig, SFTTrainer, UnslothVisionDataCollator

    path, hf = checkpoint
    model, processor = _load(path)
    records = squares([[(16, 16), (16, 16)], [(16, 24)], [(24, 16)], [(16, 16)]], seed=1)
    collator = UnslothVisionDataCollator(model, processor)
    full = collator(records)
    with torch.no_grad():  # B = 0: the base model's loss
        ref = hf(input_ids=torch.tensor(full["input_ids"]).long(),
                 attention_mask=torch.tensor(full["attention_mask"]).long(),
                 pixel_values=torch.tensor(full["pixel_values"]), image_grid_thw=torch.tensor(full["image_grid_thw"]),
                 mm_token_type_ids=torch.tensor((full["input_ids"] == qm.P_IMAGE).astype(np.int64)),
                 labels=torch.tensor(full["labels"]).long()).loss.item()
    args = SFTConfig(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=6, learning_rate=2e-2,
                     logging_steps=1, output_dir=str(tmp_path / "out"), report_to="none",
                     remove_unused_columns=False, dataset_text_field="",
                     dataset_kwargs={"skip_prepare_dataset": True}, max_length=64)
    trainer = SFTTrainer(model=model, tokenizer=processor, data_collator=collator, train_dataset=records, args=args)
    losses = trainer.train() and trainer.state.loss_history
    print("losses", [round(x, 4) for x in losses])
    assert abs(losses[0] - ref) / ref < 1e-5, (losses[0], ref)
    assert losses[-1] < 0.85 * losses[0], losses  # measured: 7.77 -> 6.05


def test_bad_record_is_named(checkpoint):
    from unsloth_jax import UnslothVisionDataCollator

    model, processor = _load(checkpoint[0])
    collator = UnslothVisionDataCollator(model, processor)
    records = squares([[(16, 16)], [(16, 16)], [(16, 16), (16, 16)]])
    records[2]["images"] = records[2]["images"][:1]
    with pytest.raises(DatasetFormatError, match=r"record 2, field 'images'.*2 image placeholder.*1 image"):
        collator.check(records)
    with pytest.raises(DatasetFormatError, match=r"record 7, field 'images'"):
        collator(records[2:], indices=[7])


def test_micro_batches_with_different_patch_buckets_stack(checkpoint):
    """Two micro-batches in different patch buckets (64 and 128) stack to [2, 128, ...]: each keeps its real
    patches, layout and positions; the padding is its own attention segment after them (no compile)."""
    from unsloth_jax import UnslothVisionDataCollator
    from unsloth_jax.data.vision_loader import VisionLoader
    from unsloth_jax.models.vision_qwen2_5 import PAD_SEGMENT, vision_layout

    model, processor = _load(checkpoint[0])
    collator = UnslothVisionDataCollator(model, processor)
    records = squares([[(16, 16)], [(16, 24)], [(32, 32)], [(24, 24)]])  # 16 + 24, then 64 + 36 patches
    loader = VisionLoader(records, collator, batch_size=2, max_seq_length=64, shuffle=False, image_shape=())
    micro = [loader.batch(0, 0), loader.batch(0, 1)]
    assert [m["pixel_values"].shape[0] for m in micro] == [64, 128]
    out = loader.stack(micro)
    assert "image_grid_thw" not in out and out["pixel_values"].shape == (2, 128, qm.PATCH_DIM)
    assert out["mrope_positions"].shape == (2, 3, 2, 64) and out["vision_order"].shape == (2, 128)
    cfg = model.vl_config.vision
    for a, m in enumerate(micro):
        real = vision_layout(cfg, m["image_grid_thw"])
        n = real["order"].size
        np.testing.assert_array_equal(out["pixel_values"][a, :n], m["pixel_values"][:n])
        assert not out["pixel_values"][a, n:].any()
        for key, value in real.items():
            np.testing.assert_array_equal(out["vision_" + key][a, :len(value)], value)
        assert (out["vision_window_ids"][a, n:] == PAD_SEGMENT).all()
        np.testing.assert_array_equal(out["mrope_positions"][a], m["mrope_positions"])


def test_processor_is_built_without_torchvision(checkpoint, tmp_path):
    """A Qwen2.5-VL folder with processor files as transformers writes them (processor_class Qwen2_5_VLProcessor):
    without torchvision (this venv's case, and a JAX user's usual one) transformers' AutoProcessor cannot build its
    video half; FastVisionModel.from_pretrained still returns a processor (images only) whose ids, pixel values
    and grids equal the reference processor's, and the collator runs on it."""
    import json
    import shutil

    from unsloth_jax import FastVisionModel, UnslothVisionDataCollator

    path, _ = checkpoint
    folder = tmp_path / "qwen_with_processor"
    shutil.copytree(path, folder)
    reference = qm.processor()
    reference.save_pretrained(folder)
    config = json.loads((folder / "processor_config.json").read_text())
    config["processor_class"] = "Qwen2_5_VLProcessor"  # what transformers writes for the released models
    (folder / "processor_config.json").write_text(json.dumps(config))
    model, processor = FastVisionModel.from_pretrained(folder, dtype="float32")
    assert processor is not None
    records = squares([[(16, 24)], [(24, 24), (8, 16)]])
    texts = [reference.apply_chat_template(r["messages"], tokenize=False) for r in records]
    assert [processor.apply_chat_template(r["messages"], tokenize=False) for r in records] == texts
    ours = processor(text=texts, images=[r["images"] for r in records], padding=True, return_tensors="np")
    ref = reference(text=texts, images=[r["images"] for r in records], padding=True, return_tensors="np")
    for key in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw"):
        np.testing.assert_array_equal(ours[key], ref[key])
    batch = UnslothVisionDataCollator(model, processor)(records)
    assert batch["pixel_values"].shape == ref["pixel_values"].shape
    with pytest.raises(ValueError, match="videos"):
        processor(text=texts, videos=[np.zeros((2, 16, 16, 3), np.uint8)])


def test_patch_buckets_keep_padding_small():
    """Patch buckets: multiples of the merge unit, growing, and above 256 patches under a quarter of padding."""
    from unsloth_jax.data.vision_loader import patch_bucket

    sizes = [patch_bucket(n, 4) for n in range(1, 20000)]
    assert all(b >= n and b % 4 == 0 for n, b in enumerate(sizes, start=1))
    assert sizes == sorted(sizes) and patch_bucket(1024, 4) == 1024 and patch_bucket(1025, 4) == 1280
    assert max(b / n for n, b in enumerate(sizes, start=1) if n > 256) <= 1.25
    assert len(set(sizes)) <= 4 * 9  # four per octave up to 2**15: a bounded number of compiles
