"""Continued pretraining: UnslothTrainer's embedding_learning_rate equals torch AdamW with Unsloth's two param
groups; raw text trains packed; pre-tokenized records train as given and bad ones are named."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.helpers import ASSETS, TINY_MODEL, rel_err  # noqa: E402
from tests.hf_models import save_hf_model  # noqa: E402
from unsloth_jax import (FastLanguageModel, SFTTrainer, TrainingArguments, UnslothTrainer,  # noqa: E402
                         UnslothTrainingArguments)
from unsloth_jax.data import load_records  # noqa: E402
from unsloth_jax.errors import DatasetFormatError  # noqa: E402
from unsloth_jax.hf.safetensors_io import SafetensorsFile  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_hf_model("llama", path, seed=31)
    return path


@pytest.fixture(scope="module")
def small_peft_model(llama_dir):
    model, _ = FastLanguageModel.from_pretrained(llama_dir, dtype="float32", load_tokenizer=False, progress=False)
    return FastLanguageModel.get_peft_model(model, r=4)


def _adapter_tensors(path) -> dict[str, np.ndarray]:
    with SafetensorsFile(path / "adapter_model.safetensors") as f:
        return {k: np.array(f.get(k)) for k in f.keys()}


def test_embedding_learning_rate_equals_torch_param_groups(llama_dir, tmp_path, rng, capsys):
    """LoRA + modules_to_save embed_tokens/lm_head, UnslothTrainer with embedding_learning_rate = lr / 10, linear
    schedule with warmup, weight decay, clipping: after 4 steps every trained tensor moved as it does under
    torch.optim.AdamW with Unsloth's groups (params named *.modules_to_save.default.weight at the embedding
    rate, the rest at learning_rate, both scheduled by the same LambdaLR) on the PEFT model."""
    lr, emb_lr, steps, eps = 2e-3, 2e-4, 4, 1e-5  # eps: see test_full_finetuning (near-zero gradients)
    model, _ = FastLanguageModel.from_pretrained(llama_dir, dtype="float32", load_tokenizer=False, progress=False)
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, target_modules=TARGETS,
                                             modules_to_save=["embed_tokens", "lm_head"])
    model.save_pretrained(tmp_path / "init")
    init = _adapter_tensors(tmp_path / "init")
    records = [{"input_ids": rng.integers(0, 256, 20).tolist()} for _ in range(4)]
    args = UnslothTrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, max_steps=steps,
                                    learning_rate=lr, embedding_learning_rate=emb_lr, lr_scheduler_type="linear",
                                    warmup_steps=1, weight_decay=0.01, max_grad_norm=1.0, adam_epsilon=eps,
                                    save_steps=0, logging_steps=1)
    UnslothTrainer(model=model, train_dataset=records, args=args, max_seq_length=32).train()  # batch = all records
    printed = capsys.readouterr().out
    assert "setting lr = 2.00e-04 instead of 2.00e-03 for model.embed_tokens.weight" in printed
    assert "for lm_head.weight" in printed
    model.save_pretrained(tmp_path / "trained")
    ours = _adapter_tensors(tmp_path / "trained")

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32,
                                                           attn_implementation="eager")
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                 modules_to_save=["embed_tokens", "lm_head"]))
    peft.set_peft_model_state_dict(pm, {k: torch.from_numpy(v) for k, v in init.items()})  # our LoRA init
    pm.train()
    named = [(n, p) for n, p in pm.named_parameters() if p.requires_grad]
    embedding = [p for n, p in named if n.endswith("modules_to_save.default.weight")]
    rest = [p for n, p in named if not n.endswith("modules_to_save.default.weight")]
    assert len(embedding) == 2
    opt = torch.optim.AdamW([{"params": rest, "lr": lr, "weight_decay": 0.01},
                             {"params": embedding, "lr": emb_lr, "weight_decay": 0.01}],
                            lr=lr, betas=(0.9, 0.999), eps=eps, weight_decay=0.01)
    sched = transformers.get_scheduler("linear", opt, num_warmup_steps=1, num_training_steps=steps)
    ids = torch.tensor([r["input_ids"] for r in records])
    for _ in range(steps):
        loss = pm(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in named], 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    theirs = {k: v.detach().numpy() for k, v in peft.get_peft_model_state_dict(pm).items()}
    assert set(ours) == set(theirs) == set(init)
    for key in ours:
        moved = theirs[key] - init[key]
        assert np.linalg.norm(moved) > 0, key
        err = rel_err(ours[key] - init[key], moved)
        assert err < 1e-3, f"{key}: update differs from torch's by {err:.2e}"
    emb = "base_model.model.model.embed_tokens.weight"
    lora_key = next(k for k in ours if "lora_B" in k)
    # the embedding rate really is 10x lower: Adam's steps scale with the rate
    ratio = np.abs(ours[emb] - init[emb]).max() / np.abs(ours[lora_key] - init[lora_key]).max()
    assert ratio < 0.3, ratio


def test_raw_text_trains_packed(tmp_path):
    """Continued pretraining on raw text: documents are packed into full rows (several per row, attention kept
    within each), the embedding rate applies, and the loss falls."""
    model, tok = FastLanguageModel.from_pretrained(TINY_MODEL, dtype="float32", progress=False)
    model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=16, modules_to_save=["embed_tokens", "lm_head"],
                                             use_gradient_checkpointing=False)
    texts = load_records(ASSETS / "text_sample.jsonl")[:60]
    args = UnslothTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=6,
                                    learning_rate=5e-3, embedding_learning_rate=5e-4, save_steps=0, logging_steps=1,
                                    warmup_steps=0, lr_scheduler_type="constant")
    trainer = UnslothTrainer(model=model, tokenizer=tok, train_dataset=texts, dataset_text_field="text",
                             packing=True, max_seq_length=256, args=args)
    loader = trainer._loader(trainer.train_examples, 2, shuffle=False)
    batch = loader.batch(0, 0)
    assert batch["input_ids"].shape == (2, 256) and batch["segment_ids"].max() >= 2
    assert (batch["attention_mask"] == 1).mean() > 0.9  # rows are full
    trainer.train()
    losses = trainer.state.loss_history
    assert np.isfinite(losses).all() and np.mean(losses[-2:]) < np.mean(losses[:2])


def test_pretokenized_records_train_as_given(llama_dir, tmp_path, rng):
    """Records with input_ids (labels default to them, HF's shift is the loss's), given labels (-100 masked) and
    attention_mask (0 = padding, dropped): the trainer's loss equals transformers' on the same records."""
    model, _ = FastLanguageModel.from_pretrained(llama_dir, dtype="float32", load_tokenizer=False, progress=False)
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8)
    ids = [rng.integers(0, 256, 18) for _ in range(3)]
    labels = ids[1].copy()
    labels[:9] = -100
    mask = np.ones(18, np.int64)
    mask[-4:] = 0
    records = [{"input_ids": ids[0].tolist()},
               {"input_ids": ids[1].tolist(), "labels": labels.tolist()},
               {"input_ids": ids[2].tolist(), "attention_mask": mask.tolist()}]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=1, save_steps=0)
    trainer = SFTTrainer(model=model, train_dataset=records, eval_dataset=records, args=args, max_seq_length=32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32,
                                                           attn_implementation="eager")
    total = count = 0.0
    with torch.no_grad():  # the untrained adapter is the identity (B = 0): the base model's loss
        for x, y in ((ids[0], ids[0]), (ids[1], labels), (ids[2][:-4], ids[2][:-4])):
            n = int((np.asarray(y[1:]) != -100).sum())
            total += hf(input_ids=torch.from_numpy(np.asarray(x))[None], labels=torch.from_numpy(np.asarray(y))[None]
                        ).loss.item() * n
            count += n
    np.testing.assert_allclose(trainer.evaluate()["eval_loss"], total / count, rtol=1e-5)


@pytest.mark.parametrize("record, message", [
    ({"input_ids": [1, 2.5, 3]}, r"record 1: 'input_ids'\[1\] = 2.5 is not an integer"),
    ({"input_ids": [1, "2"]}, r"record 1: 'input_ids'\[1\] = '2' is not an integer"),
    ({"input_ids": [1, True]}, r"record 1: 'input_ids'\[1\] = True"),
    ({"input_ids": [1, 256]}, r"record 1: input_ids \[256\] are outside the model's vocabulary \[0, 256\)"),
    ({"input_ids": [-1, 3]}, r"record 1: input_ids \[-1\]"),
    ({"input_ids": "1 2 3"}, r"record 1: 'input_ids' must be a list"),
    ({"input_ids": [1, 2], "labels": [1]}, r"record 1: 1 labels for 2 input_ids"),
    ({"input_ids": [1, 2], "labels": [-5, 2]}, r"record 1: labels \[-5\] are neither -100"),
    ({"input_ids": [1, 2], "attention_mask": [1, 2]}, r"record 1: attention_mask must be 0/1"),
    ({"text": "hello"}, r"record 1: no 'input_ids'"),
])
def test_bad_pretokenized_records_are_named(small_peft_model, tmp_path, record, message):
    model = small_peft_model
    with pytest.raises(DatasetFormatError, match=message):
        SFTTrainer(model=model, train_dataset=[{"input_ids": [1, 2, 3]}, record],
                   args=TrainingArguments(output_dir=str(tmp_path)), max_seq_length=16)
