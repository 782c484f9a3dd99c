"""Gemma 3 with images equals transformers' Gemma3ForConditionalGeneration (float32, relative error < 1e-5): the
SigLIP vision tower alone, the projected image features, and the logits with the bidirectional image-block mask
(token_type_ids) and without it; checkpoint key spellings and loading errors."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.helpers import rel_err  # noqa: E402
from unsloth_jax.config import read_config_json  # noqa: E402
from unsloth_jax.families import GEMMA3_VL  # noqa: E402
from unsloth_jax.errors import MissingTensorError, UnexpectedTensorError  # noqa: E402
from unsloth_jax.hf.vision_io import load_vision_language_model  # noqa: E402

pytestmark = pytest.mark.torch

IMAGE, BOI, EOI, MM_TOKENS = 250, 251, 252, 4
# sliding window 3 < the 4 image tokens of a block: a block's last token may not see its first on sliding layers
TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, sliding_window=3, sliding_window_pattern=2, query_pre_attn_scalar=24,
            max_position_embeddings=512, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh")
VISION = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, image_size=32,
              patch_size=8, num_channels=3)  # 4 x 4 patches, pooled 2 x 2 to 4 tokens


def _hf_model(seed: int = 0):
    import transformers

    cfg = transformers.Gemma3Config(text_config=dict(TEXT), vision_config=dict(VISION), mm_tokens_per_image=MM_TOKENS,
                                    image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI)
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    cfg.vision_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # random weights everywhere (HF inits the projection to 0, norms to constants)
        for name, p in model.named_parameters():
            siglip_norm = "vision_tower" in name and ("layer_norm" in name or "layernorm" in name)
            if siglip_norm and name.endswith("weight"):  # LayerNorm: weights around 1
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "norm" in name and not siglip_norm:  # Gemma's (1 + w) RMSNorms: around 0
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3_vl")
    hf = _hf_model()
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module")
def ours(checkpoint):
    return load_vision_language_model(checkpoint[0], dtype="float32")


def _inputs(rng):
    """Two rows of 24 tokens: row 0 with two images, row 1 with one image and 5 tokens of right padding."""
    s = 24

    def row(images_at, length):
        ids = rng.integers(3, 240, size=s)
        types = np.zeros(s, np.int64)
        for at in images_at:
            ids[at] = BOI
            ids[at + 1:at + 1 + MM_TOKENS] = IMAGE
            types[at + 1:at + 1 + MM_TOKENS] = 1
            ids[at + 1 + MM_TOKENS] = EOI
        ids[0] = 2
        ids[length:] = 0
        return ids, types

    (i0, t0), (i1, t1) = row([3, 12], s), row([6], s - 5)
    ids, types = np.stack([i0, i1]), np.stack([t0, t1])
    mask = np.ones_like(ids)
    mask[1, s - 5:] = 0
    pixels = rng.standard_normal((3, 3, 32, 32)).astype(np.float32)
    return ids, types, mask, pixels


def _hf_logits(hf, ids, types, mask, pixels):
    kw = dict(attention_mask=torch.tensor(mask), pixel_values=torch.tensor(pixels))
    if types is not None:
        kw["token_type_ids"] = torch.tensor(types)
    with torch.no_grad():
        return hf(torch.tensor(ids), **kw).logits.float().numpy()


def test_vision_tower_and_projector_match_transformers(checkpoint, ours, rng):
    _, hf = checkpoint
    pixels = rng.standard_normal((2, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        ref_tower = hf.model.vision_tower(pixel_values=torch.tensor(pixels)).last_hidden_state.numpy()
        ref_feats = hf.model.get_image_features(torch.tensor(pixels)).pooler_output.numpy()
    tower = np.asarray(ours.vision_tower(pixels))
    feats = np.asarray(ours.image_features(pixels))
    assert tower.shape == (2, 16, 48) and feats.shape == (2, MM_TOKENS, 64)
    assert rel_err(tower, ref_tower) < 1e-5, rel_err(tower, ref_tower)
    assert rel_err(feats, ref_feats) < 1e-5, rel_err(feats, ref_feats)


@pytest.mark.parametrize("with_types", [True, False], ids=["image_blocks", "causal"])
def test_logits_match_transformers_with_images(checkpoint, ours, rng, with_types):
    _, hf = checkpoint
    ids, types, mask, pixels = _inputs(rng)
    types = types if with_types else None
    ref = _hf_logits(hf, ids, types, mask, pixels)
    out = np.asarray(ours(ids, attention_mask=mask, pixel_values=pixels, token_type_ids=types))
    real = mask.astype(bool)
    err = rel_err(out[real], ref[real])
    assert err < 1e-5, f"relative error {err:.2e}"
    if with_types:  # the image blocks' bidirectional mask changes the logits (so the test above sees it)
        causal = np.asarray(ours(ids, attention_mask=mask, pixel_values=pixels))
        assert rel_err(causal[real], out[real]) > 1e-3


def test_image_token_count_must_match_the_images(ours, rng):
    ids, types, mask, pixels = _inputs(rng)
    with pytest.raises(ValueError, match="image tokens"):
        ours(ids, attention_mask=mask, pixel_values=pixels[:2], token_type_ids=types)
    with pytest.raises(ValueError, match="pixel_values"):
        ours(ids, attention_mask=mask, pixel_values=pixels[:, :, :16], token_type_ids=types)


def test_hub_key_spelling_loads_and_missing_keys_are_named(checkpoint, ours, tmp_path, rng):
    """The Hub's transformers-4 names (vision_tower.vision_model.*) and transformers 5's module names
    (model.language_model.*) load to the same model; a missing tensor is named in the error."""
    import shutil

    from safetensors.numpy import load_file, save_file

    path, _ = checkpoint
    tensors = load_file(str(path / "model.safetensors"))
    renamed = {}
    for name, t in tensors.items():
        if name.startswith("vision_tower."):
            name = "vision_tower.vision_model." + name[len("vision_tower."):]
        elif name.startswith("language_model.model."):
            name = "model.language_model." + name[len("language_model.model."):]
        renamed[name] = t
    other = tmp_path / "renamed"
    other.mkdir()
    shutil.copy(path / "config.json", other / "config.json")
    save_file(renamed, str(other / "model.safetensors"))
    model = load_vision_language_model(other, dtype="float32")
    ids, types, mask, pixels = _inputs(rng)
    np.testing.assert_array_equal(np.asarray(model(ids, attention_mask=mask, pixel_values=pixels, token_type_ids=types)),
                                  np.asarray(ours(ids, attention_mask=mask, pixel_values=pixels, token_type_ids=types)))

    gone = "vision_tower.vision_model.encoder.layers.1.mlp.fc2.weight"
    save_file({k: v for k, v in renamed.items() if k != gone}, str(other / "model.safetensors"))
    with pytest.raises(MissingTensorError, match=r"vision_tower\.encoder\.layers\.1\.mlp\.fc2\.weight"):
        load_vision_language_model(other, dtype="float32")
    save_file(dict(renamed, **{"multi_modal_projector.extra": np.zeros(2, np.float32)}), str(other / "model.safetensors"))
    with pytest.raises(UnexpectedTensorError, match="multi_modal_projector.extra"):
        load_vision_language_model(other, dtype="float32")


def test_config_parses_gemma3_vision_fields(checkpoint):
    from unsloth_jax.families import read_text_config
    from unsloth_jax.errors import UnsupportedArchitectureError

    with pytest.raises(UnsupportedArchitectureError, match="FastVisionModel"):
        read_text_config(checkpoint[0])
    raw, path = read_config_json(checkpoint[0])
    cfg = GEMMA3_VL.parse_config(raw, str(path))
    assert (cfg.mm_tokens_per_image, cfg.image_token_index, cfg.pool_kernel) == (MM_TOKENS, IMAGE, 2)
    assert cfg.vision.num_patches == 16 and cfg.text.model_type == "gemma3_text" and cfg.text.tie_word_embeddings


@pytest.mark.slow
def test_fast_vision_model_loads_and_trains_lora_on_the_language_layers(checkpoint, ours, rng):
    """FastVisionModel.from_pretrained gives the same logits (no processor files: processor None);
    get_peft_model adds LoRA to the 7 language projections only; a gradient through images reaches lora_b."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from unsloth_jax import FastVisionModel, lora

    model, processor = FastVisionModel.from_pretrained(checkpoint[0], dtype="float32")
    assert processor is None
    ids, types, mask, pixels = _inputs(rng)
    kw = dict(attention_mask=mask, pixel_values=pixels, token_type_ids=types)
    np.testing.assert_array_equal(np.asarray(model(ids, **kw)), np.asarray(ours(ids, **kw)))
    with pytest.raises(ValueError, match="nothing to adapt"):
        FastVisionModel.get_peft_model(model, r=4, finetune_language_layers=False)
    model = FastVisionModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    paths = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}
    assert len(paths) == 14 and all(p.startswith("model.layers.") for p in paths), sorted(paths)
    assert all(lin.lora_a is None for lin in model.vision_projections().values())
    np.testing.assert_allclose(np.asarray(model(ids, **kw)), np.asarray(ours(ids, **kw)), rtol=0, atol=0)  # B = 0

    graphdef, trainable, frozen = lora.split(model)
    labels = jnp.asarray(np.where(mask == 1, ids, -100)[:, 1:])

    def loss(trainable):
        logits = nnx.merge(graphdef, trainable, frozen)(ids, **kw)[:, :-1]
        logp = jax.nn.log_softmax(logits)
        picked = jnp.take_along_axis(logp, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
        return -jnp.sum(jnp.where(labels >= 0, picked, 0.0)) / jnp.sum(labels >= 0)

    value, grads = jax.value_and_grad(loss)(trainable)
    assert np.isfinite(float(value))
    norms = {".".join(map(str, p)): float(jnp.linalg.norm(v.get_value() if hasattr(v, "get_value") else v))
             for p, v in nnx.to_flat_state(grads)}
    assert all(n > 0 for p, n in norms.items() if p.endswith("lora_b")), norms


def test_image_blocks_mask():
    """token_type_ids -> block ids -> mask: (causal or same image run) and window; two runs stay apart."""
    from unsloth_jax import ops
    from unsloth_jax.models.vision import image_block_ids

    types = np.array([[0, 1, 1, 1, 0, 1, 1, 0]])
    blocks = np.asarray(image_block_ids(types))
    np.testing.assert_array_equal(blocks, [[-1, 0, 0, 0, -1, 1, 1, -1]])
    mask = np.asarray(ops.attention_mask(8, 8, causal=True, window=None, block_ids=blocks))[0]
    want = np.tril(np.ones((8, 8), bool))
    for run in ([1, 2, 3], [5, 6]):
        want[np.ix_(run, run)] = True
    np.testing.assert_array_equal(mask, want)
    windowed = np.asarray(ops.attention_mask(8, 8, causal=True, window=2, block_ids=blocks))[0]
    q, k = np.indices((8, 8))
    np.testing.assert_array_equal(windowed, want & (q - k < 2))  # the window still cuts a block's far past


@pytest.mark.slow
def test_bfloat16_error_is_transformers_own(checkpoint, rng):
    """dtype=bfloat16: ours against transformers' float32 logits errs no more than transformers' bfloat16 does."""
    path, hf = checkpoint
    ids, types, mask, pixels = _inputs(rng)
    real = mask.astype(bool)
    ref = _hf_logits(hf, ids, types, mask, pixels)
    out = np.asarray(load_vision_language_model(path, dtype="bfloat16")(ids, attention_mask=mask, pixel_values=pixels,
                                                                        token_type_ids=types))
    hf16 = _hf_model().to(torch.bfloat16)
    with torch.no_grad():
        ref16 = hf16(torch.tensor(ids), attention_mask=torch.tensor(mask), token_type_ids=torch.tensor(types),
                     pixel_values=torch.tensor(pixels).to(torch.bfloat16)).logits.float().numpy()
    ours, theirs = rel_err(out[real], ref[real]), rel_err(ref16[real], ref[real])
    assert ours < 2 * theirs + 1e-3, (ours, theirs)
