"""Vision SFT on tiny random Gemma 3 models, against transformers + PEFT (float32): the collator's batch is the
processor's (image tokens expanded, pixels normalised) with the loss masks Unsloth uses; the loss and the LoRA
gradients of one batch equal transformers + PEFT's; SFTTrainer with UnslothVisionDataCollator lowers the loss;
bad records are named."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from tests import vl_models  # noqa: E402
from tests.helpers import rel_err  # noqa: E402
from unsloth_jax.errors import DatasetFormatError  # noqa: E402

pytestmark = pytest.mark.torch
LANG = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3_vl_sft")
    hf = vl_models.hf_gemma3()
    hf.save_pretrained(path)
    vl_models.processor().save_pretrained(path)
    return path, hf


def _load(path, **peft_kw):
    from unsloth_jax import FastVisionModel

    model, processor = FastVisionModel.from_pretrained(path, dtype="float32")
    model = FastVisionModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False, **peft_kw)
    return model, processor


def _randomise_lora(model, seed=0):
    """Random A and B on every LoRA pair (B = 0 would give A no gradient)."""
    import jax.numpy as jnp
    from flax import nnx

    rng = np.random.default_rng(seed)
    state = nnx.state(model, nnx.LoRAParam)
    flat = {p: jnp.asarray(0.2 * rng.standard_normal(v.shape), jnp.float32) for p, v in nnx.to_flat_state(state)}
    nnx.update(model, nnx.from_flat_state(flat))


def _peft_pairs(peft_model):
    """{(tower, layer, name): (lora_A Linear, lora_B Linear)} of a PEFT-wrapped Gemma3ForConditionalGeneration."""
    pairs = {}
    for name, mod in peft_model.named_modules():
        if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {}):
            parts = name.split(".")
            layer = int(parts[parts.index("layers") + 1])
            tower = "vision" if "vision_tower" in name else "language"
            pairs[(tower, layer, parts[-1])] = (mod.lora_A["default"], mod.lora_B["default"])
    return pairs


def _ours_pairs(model):
    """{(tower, name): Linear} of our model's LoRA-carrying projections (stacked over layers)."""
    out = {("language", n): lin for n, lin in model.projections().items() if lin.lora_a is not None}
    out.update({("vision", n): lin for n, lin in model.vision_projections().items() if lin.lora_a is not None})
    return out


def peft_twin(hf, model, target_modules):
    """transformers + PEFT with LoRA on `target_modules` holding our model's LoRA weights."""
    import copy

    cfg = peft.LoraConfig(r=model.lora.r, lora_alpha=model.lora.lora_alpha, lora_dropout=0.0,
                          target_modules=target_modules)
    twin = peft.get_peft_model(copy.deepcopy(hf), cfg)
    theirs, ours = _peft_pairs(twin), _ours_pairs(model)
    assert {(t, n) for t, _, n in theirs} == set(ours), (sorted(theirs)[:4], sorted(ours))
    with torch.no_grad():
        for (tower, layer, name), (a, b) in theirs.items():
            lin = ours[(tower, name)]
            a.weight.copy_(torch.tensor(np.asarray(lin.lora_a[...][layer]).T))
            b.weight.copy_(torch.tensor(np.asarray(lin.lora_b[...][layer]).T))
    return twin


def ours_loss_and_grads(model, batch):
    """(loss, {(tower, name): (dA [L, in, r], dB [L, r, out])}) of the training loss on one collated batch."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from unsloth_jax import lora
    from unsloth_jax.train.step import loss_and_count

    graphdef, trainable, frozen = lora.split(model)
    dev = {k: jnp.asarray(v) for k, v in batch.items()}

    def f(t):
        return loss_and_count(nnx.merge(graphdef, t, frozen), dev)[0]

    loss, grads = jax.value_and_grad(f)(trainable)
    nnx.update(model, trainable)
    flat = {tuple(map(str, p)): np.asarray(v.get_value() if hasattr(v, "get_value") else v)
            for p, v in nnx.to_flat_state(grads)}
    out = {}
    for key, lin in _ours_pairs(model).items():
        prefix = ("vision_tower", "encoder", "layers") if key[0] == "vision" else ("model", "layers")
        hits = {p[-1]: g for p, g in flat.items() if p[:len(prefix)] == prefix and key[1] in p}
        out[key] = (hits["lora_a"], hits["lora_b"])
    return float(loss), out


def peft_loss_and_grads(twin, batch):
    kw = {k: torch.tensor(v) for k, v in batch.items()}
    twin.zero_grad()
    out = twin(**{k: v.long() if k != "pixel_values" else v for k, v in kw.items()})
    out.loss.backward()
    grads = {}
    for (tower, layer, name), (a, b) in _peft_pairs(twin).items():
        grads.setdefault((tower, name), {})[layer] = (a.weight.grad.numpy().T, b.weight.grad.numpy().T)
    stacked = {k: (np.stack([v[i][0] for i in sorted(v)]), np.stack([v[i][1] for i in sorted(v)]))
               for k, v in grads.items()}
    return float(out.loss.detach()), stacked


def assert_grads_match(ours, theirs, bound):
    assert set(ours) == set(theirs)
    worst = 0.0
    for key in ours:
        for g, r in zip(ours[key], theirs[key]):
            assert np.abs(r).max() > 0, key
            worst = max(worst, rel_err(g, r))
    assert worst < bound, f"LoRA gradients: relative error {worst:.2e}"
    return worst


def test_collator_batch_is_the_processors_with_unsloths_masks(checkpoint):
    from unsloth_jax import UnslothVisionDataCollator

    model, processor = _load(checkpoint[0])
    records = vl_models.shapes_dataset(3)
    records[1]["messages"][0]["content"].append({"type": "image"})  # row 1: two images, one embedded in a part
    records[1]["messages"][0]["content"][-1]["image"] = records[0]["images"][0]
    records[1]["images"] = records[1]["images"] + [records[0]["images"][0]]
    batch = UnslothVisionDataCollator(model, processor)(records)
    texts = [processor.apply_chat_template(r["messages"], tokenize=False) for r in records]
    ref = processor(text=texts, images=[r["images"] for r in records], padding=True, return_tensors="np",
                    add_special_tokens=False)
    np.testing.assert_array_equal(batch["input_ids"], ref["input_ids"])
    np.testing.assert_array_equal(batch["token_type_ids"], ref["token_type_ids"])
    np.testing.assert_array_equal(batch["attention_mask"], ref["attention_mask"])
    np.testing.assert_array_equal(batch["pixel_values"], ref["pixel_values"])
    assert batch["pixel_values"].shape == (4, 3, 32, 32) and batch["input_ids"].dtype == np.int32
    ids, labels = batch["input_ids"], batch["labels"]
    assert (ids == vl_models.IMAGE).sum() == 4 * vl_models.MM_TOKENS
    masked = np.isin(ids, [vl_models.BOI, vl_models.IMAGE, vl_models.EOI]) | (batch["attention_mask"] == 0)
    np.testing.assert_array_equal(labels, np.where(masked, -100, ids))

    only = UnslothVisionDataCollator(model, processor, train_on_responses_only=True,
                                     instruction_part=vl_models.INSTRUCTION_PART,
                                     response_part=vl_models.RESPONSE_PART)
    kept = only(records[:1])
    tok = processor.tokenizer
    row = kept["labels"][0]
    assert tok.decode(row[row != -100]) == "The square is red.<end_of_turn>\n"

    from types import SimpleNamespace

    from unsloth_jax.data import train_on_responses_only

    plain = UnslothVisionDataCollator(model, processor)  # the function form sets the collator's markers
    train_on_responses_only(SimpleNamespace(data_collator=plain), vl_models.INSTRUCTION_PART, vl_models.RESPONSE_PART)
    np.testing.assert_array_equal(plain(records[:1])["labels"], kept["labels"])


def test_bad_records_are_named(checkpoint):
    from unsloth_jax import UnslothVisionDataCollator

    model, processor = _load(checkpoint[0])
    collator = UnslothVisionDataCollator(model, processor)
    records = vl_models.shapes_dataset(3)
    records[2]["images"] = records[2]["images"] * 2
    with pytest.raises(DatasetFormatError, match=r"record 2, field 'images'.*1 image placeholder.*2 image"):
        collator.check(records)
    records = vl_models.shapes_dataset(2)
    del records[1]["images"]
    with pytest.raises(DatasetFormatError, match=r"record 1, field 'images': missing"):
        collator.check(records)
    with pytest.raises(DatasetFormatError, match=r"record 0, field 'messages'"):
        collator.check([{"images": []}])


def test_loss_and_lora_gradients_match_transformers_peft(checkpoint):
    """One batch of two rows (different lengths: right padding), one image each, responses only: the loss and
    every LoRA gradient equal transformers + PEFT's."""
    from unsloth_jax import UnslothVisionDataCollator

    path, hf = checkpoint
    model, processor = _load(path)
    _randomise_lora(model)
    records = vl_models.shapes_dataset(2)
    records[1]["messages"][1]["content"][0]["text"] += " It sits in the middle of a dark picture."
    batch = UnslothVisionDataCollator(model, processor, train_on_responses_only=True,
                                      instruction_part=vl_models.INSTRUCTION_PART,
                                      response_part=vl_models.RESPONSE_PART)(records)
    assert batch["attention_mask"][0].sum() < batch["attention_mask"][1].sum()
    twin = peft_twin(hf, model, LANG)
    ref_loss, ref_grads = peft_loss_and_grads(twin, batch)
    loss, grads = ours_loss_and_grads(model, batch)
    assert abs(loss - ref_loss) / ref_loss < 1e-5, (loss, ref_loss)
    worst = assert_grads_match(grads, ref_grads, 1e-4)
    print(f"loss {loss:.7f} vs {ref_loss:.7f} (relative {abs(loss - ref_loss) / ref_loss:.1e}); LoRA gradients: "
          f"worst relative error {worst:.1e}")


def test_sft_trainer_trains_on_images(checkpoint, tmp_path):
    """SFTTrainer with UnslothVisionDataCollator (Unsloth's notebook arguments), 2 rows x 2 accumulated micro-
    batches holding 3 and 2 images: step 1's loss is transformers' loss of the 4 rows as one batch, and 12 steps
    lower it by a third."""
    from unsloth_jax import SFTConfig, SFTTrainer, UnslothVisionDataCollator

    path, hf = checkpoint
    model, processor = _load(path)
    records = vl_models.shapes_dataset(4)
    records[0]["messages"][0]["content"].insert(0, {"type": "image"})  # 2 images: micro-batches differ in N
    records[0]["images"] = records[0]["images"] * 2
    collator = UnslothVisionDataCollator(model, processor)
    ref = hf(**{k: torch.tensor(v).long() if k != "pixel_values" else torch.tensor(v)
                for k, v in collator(records).items()}).loss.item()  # B = 0: the base model's loss
    args = SFTConfig(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=12, learning_rate=1e-2,
                     logging_steps=1,
                     output_dir=str(tmp_path / "out"), report_to="none", remove_unused_columns=False,
                     dataset_text_field="", dataset_kwargs={"skip_prepare_dataset": True}, max_length=128)
    trainer = SFTTrainer(model=model, tokenizer=processor, data_collator=collator, train_dataset=records, args=args)
    losses = trainer.train() and trainer.state.loss_history
    assert abs(losses[0] - ref) / ref < 1e-5, (losses[0], ref)
    assert losses[-1] < 0.67 * losses[0], losses
