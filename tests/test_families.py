"""The Family registry (unsloth_jax.families) and ModelInputs: each vision-language family's checkpoint table against
transformers' own model (every parameter name, after the family's renames, with its shape), the registry by
config.json, prepare_inputs, and ModelInputs as a pytree a jitted function takes."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from tests import vl_models as gm  # noqa: E402
from tests import vl_qwen_models as qm  # noqa: E402
from unsloth_jax.errors import UnsupportedArchitectureError  # noqa: E402
from unsloth_jax.families import (GEMMA3_VL, LLAMA, QWEN2_5_VL, ModelInputs, family_for, family_of,  # noqa: E402
                                  vision_family_for)
from unsloth_jax.hf.vision_checkpoint import vision_language_specs  # noqa: E402


def _gemma3_config():
    return transformers.Gemma3Config(text_config=dict(gm.TEXT), vision_config=dict(gm.VISION),
                                     mm_tokens_per_image=gm.MM_TOKENS, image_token_index=gm.IMAGE,
                                     boi_token_index=gm.BOI, eoi_token_index=gm.EOI)


def _qwen_config():
    return transformers.Qwen2_5_VLConfig(text_config=dict(qm.TEXT), vision_config=dict(qm.VISION),
                                         image_token_id=qm.IMAGE, video_token_id=qm.VIDEO,
                                         vision_start_token_id=qm.VSTART, vision_end_token_id=qm.VEND)


@pytest.mark.parametrize("family, hf_config, hf_class", [
    (GEMMA3_VL, _gemma3_config, "Gemma3ForConditionalGeneration"),
    (QWEN2_5_VL, _qwen_config, "Qwen2_5_VLForConditionalGeneration"),
])
def test_tensor_table_matches_transformers(family, hf_config, hf_class):
    """Every parameter of transformers' model (built on the meta device: names and shapes only), renamed by the
    family, is one spec of vision_language_specs with that shape, and no spec is left over (the tied lm_head
    and the family's ignored prefixes excepted)."""
    cfg_hf = hf_config()
    with torch.device("meta"):
        hf = getattr(transformers, hf_class)(cfg_hf)
    raw = cfg_hf.to_dict()
    assert family_for(raw) is family
    cfg = family.parse_config(raw)
    tied = cfg.text.tie_word_embeddings
    got = {}
    for name, p in hf.state_dict().items():
        canon = family.canonical_name(name)
        if canon.startswith(family.ignored_prefixes) or (tied and canon == "lm_head.weight"):
            continue
        got[canon] = tuple(p.shape)
    want = {name: spec.hf_shape for name, spec in vision_language_specs(family, cfg).items()}
    assert got.keys() == want.keys(), (sorted(got.keys() - want.keys())[:5], sorted(want.keys() - got.keys())[:5])
    assert got == want
    assert family_of(cfg) is family
    roots = {spec.path[0] for spec in vision_language_specs(family, cfg).values()}
    assert roots == {"model", "lm_head"} - ({"lm_head"} if tied else set()) | set(family.tower_roots)


def test_registry_by_config_json():
    assert family_for({"model_type": "llama"}) is LLAMA
    assert vision_family_for({"model_type": "gemma3"}) is None  # Gemma 3 without a vision_config: not VL
    assert vision_family_for({"model_type": "qwen2_5_vl"}) is QWEN2_5_VL
    with pytest.raises(UnsupportedArchitectureError, match=r"dir/config.json: model_type 'bert'.*qwen2_5_vl"):
        family_for({"model_type": "bert"}, "dir/config.json")


def test_prepare_inputs_per_family(rng):
    ids = jnp.asarray(rng.integers(0, 100, (2, 8)), jnp.int32)
    mask = jnp.ones((2, 8), jnp.int32)
    pixels = jnp.asarray(rng.standard_normal((2, 3, 4, 4)), jnp.float32)
    text = LLAMA.prepare_inputs({"input_ids": ids, "attention_mask": mask, "labels": ids})
    assert text.input_ids is ids and text.attention_mask is mask and not text.has_images
    with pytest.raises(TypeError, match="not a vision-language model"):
        LLAMA.prepare_inputs({"input_ids": ids, "pixel_values": pixels})
    with pytest.raises(TypeError, match="token_type_ids"):
        GEMMA3_VL.prepare_inputs({"input_ids": ids, "pixel_values": pixels})
    types = (ids > 50).astype(jnp.int32)
    gemma = GEMMA3_VL.prepare_inputs({"input_ids": ids, "pixel_values": pixels, "token_type_ids": types})
    assert gemma.has_images and gemma.token_type_ids is types and gemma.mrope_positions is None
    window = jnp.asarray(rng.permutation(16), jnp.int32)
    mrope = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (3, 2, 8))
    batch = {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels, "mrope_positions": mrope,
             "vision_window_index": window}
    qwen = QWEN2_5_VL.prepare_inputs(batch)
    assert qwen.vision_layout == {"window_index": window} and qwen.mrope_positions is mrope
    # the fields the trainers pad and plan by: every image field prepare_inputs read is the family's, text is not
    assert [k for k in batch if QWEN2_5_VL.is_image_field(k)] == ["pixel_values", "mrope_positions",
                                                                  "vision_window_index"]
    assert GEMMA3_VL.is_image_field("token_type_ids") and not LLAMA.is_image_field("pixel_values")
    assert QWEN2_5_VL.row_fields == ("mrope_positions",) and GEMMA3_VL.row_fields == ("token_type_ids",)
    with pytest.raises(TypeError, match="mrope_positions"):
        QWEN2_5_VL.prepare_inputs({"input_ids": ids, "pixel_values": pixels})


def test_model_inputs_is_a_pytree(rng):
    """Absent fields are no leaves; jit and tree_map keep the type; lax.map slices every field's leading axis."""
    ids = jnp.asarray(rng.integers(0, 100, (3, 2, 8)), jnp.int32)
    layout = {"window_index": jnp.asarray(rng.integers(0, 9, (3, 16)), jnp.int32)}
    inputs = ModelInputs(ids, jnp.ones_like(ids), vision_layout=layout)
    assert len(jax.tree.leaves(inputs)) == 3
    doubled = jax.jit(lambda x: jax.tree.map(lambda a: 2 * a, x))(inputs)
    assert isinstance(doubled, ModelInputs) and doubled.positions is None
    np.testing.assert_array_equal(doubled.vision_layout["window_index"], 2 * layout["window_index"])
    sums = jax.lax.map(lambda mb: mb.input_ids.sum() + mb.vision_layout["window_index"].sum(), inputs)
    np.testing.assert_array_equal(sums, ids.sum((1, 2)) + layout["window_index"].sum(1))
