"""Weight decay goes where transformers' Trainer puts it (and so TRL's and Unsloth's trainers): not on biases, norm
weights or LayerNorm modules' parameters. The update-by-update check against torch.optim.AdamW with Trainer's two
groups is tests/test_full_finetuning.py (qwen2); here, the grouping of the vision-language families (LayerNorm
modules excluded by type, whatever their names) and the trainers' optimizer applying it."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.hf_models import save_hf_model  # noqa: E402
from unsloth_jax import FastLanguageModel, FastVisionModel, SFTTrainer, TrainingArguments, lora  # noqa: E402
from unsloth_jax.models.vision import layer_norm_paths  # noqa: E402
from unsloth_jax.train.optim import decay_mask  # noqa: E402


def _short(name: str) -> str:
    """A parameter's last module and tensor name in HF's spelling: "norm1.weight", "q_proj.bias" (our Linear's
    `kernel` is HF's `weight`; nnx's trailing `value` dropped)."""
    parts = [p for p in name.split(".") if p != "value" and not p.isdigit()]
    parts[-1] = "weight" if parts[-1] == "kernel" else parts[-1]
    return re.sub(r"deepstack_merger_\d+", "deepstack_merger_list", ".".join(parts[-2:]))


def _groups(named_decays) -> dict[str, bool]:
    """{short name: decays} from (full name, decays) pairs; a short name must get one answer."""
    out: dict[str, bool] = {}
    for name, decays in named_decays:
        key = _short(name)
        assert out.setdefault(key, decays) == decays, f"{key}: mixed answers ({name})"
    return out


def _ours(model) -> dict[str, bool]:
    mask = decay_mask(layer_norm_paths(model))(nnx.state(model, nnx.Param))
    return _groups((".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path), bool(v))
                   for path, v in jax.tree_util.tree_leaves_with_path(mask))


def _theirs(hf) -> dict[str, bool]:
    """HF's decisions; Gemma 3's SigLIP pooling head (unused, not loaded: hf.vision_io's ignored prefixes) left
    out, and its projector's bare parameter spelled as our Linear."""
    decayed = set(transformers.Trainer.get_decay_parameter_names(None, hf))
    return _groups((n.replace("mm_input_projection_weight", "mm_input_projection.weight"), n in decayed)
                   for n, _ in hf.named_parameters() if ".vision_tower.head." not in n)


@pytest.mark.parametrize("family", ["qwen3_vl", "gemma3"])
def test_vision_language_groups_equal_transformers_trainers(family, tmp_path):
    """Every parameter of a tiny Qwen3-VL (LayerNorm norm1/norm2 and merger norms in the tower, RMSNorms in the
    text decoder, biases) and Gemma 3 (SigLIP's layer_norm1/2 and post_layernorm, mm_soft_emb_norm) gets the
    decay decision transformers' Trainer.get_decay_parameter_names gives its HF twin, matched by module and tensor
    name; both kinds occur."""
    if family == "qwen3_vl":
        from tests.vl_qwen3_models import hf_qwen3_vl
        hf = hf_qwen3_vl()
    else:
        from tests.vl_models import hf_gemma3
        hf = hf_gemma3()
    hf.save_pretrained(tmp_path)
    model, _ = FastVisionModel.from_pretrained(tmp_path, dtype="float32", load_processor=False)
    ours, theirs = _ours(model), _theirs(hf)
    assert set(theirs) <= set(ours), sorted(set(theirs) - set(ours))
    assert {k: ours[k] for k in theirs} == theirs
    assert True in theirs.values() and False in theirs.values()
    assert any(not theirs[k] for k in theirs if re.match(r"(norm\d|layer_norm\d)\.weight", k))  # by type only


def test_trainers_optimizer_decays_only_the_grouped_leaves(tmp_path, rng):
    """SFTTrainer's optimizer (full fine-tuning, qwen2 with q/k/v biases) applied to a zero gradient moves exactly
    the leaves decay_mask says by -lr * weight_decay * w (AdamW's direction is 0 there), and leaves norms and
    biases where they are."""
    save_hf_model("qwen2", tmp_path / "base", seed=int(rng.integers(1 << 30)))
    model, _ = FastLanguageModel.from_pretrained(tmp_path / "base", dtype="float32", full_finetuning=True,
                                                 load_tokenizer=False, progress=False)
    records = [{"input_ids": rng.integers(0, 256, 12).tolist()} for _ in range(4)]
    args = TrainingArguments(output_dir=str(tmp_path / "run"), learning_rate=1e-2, weight_decay=0.5,
                             max_grad_norm=0.0, lr_scheduler_type="constant", max_steps=1, save_steps=0)
    trainer = SFTTrainer(model=model, train_dataset=records, args=args, max_seq_length=16)
    optimizer, _ = trainer.build_optimizer(total=1, warmup=0)
    _, params, _ = lora.split(model)
    state = optimizer.init(params)
    updates, _ = optimizer.update(jax.tree.map(jnp.zeros_like, params), state, params)
    want = decay_mask()(params)
    seen = set()
    for (path, u), p, decays in zip(jax.tree_util.tree_leaves_with_path(updates), jax.tree.leaves(params),
                                    jax.tree.leaves(want)):
        name = ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        expect = -1e-2 * 0.5 * np.asarray(p) if decays else np.zeros(np.shape(p))
        np.testing.assert_allclose(np.asarray(u), expect, rtol=1e-6, atol=1e-12, err_msg=name)
        seen.add(("bias" in name or "norm" in name, decays))
    assert seen == {(True, False), (False, True)}
