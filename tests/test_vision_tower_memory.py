"""The vision towers at training time: under the language model's layer-stack policy each tower layer keeps only
its input for the backward pass (same gradients as without remat, less memory in XLA's own analysis of the
compiled step), and their attention runs on the flash kernel with segment ids (Qwen2.5-VL's windows and frames)
at head dims the kernel has no tiles for (72, 80: zero-padded), equal to the XLA reference, so no dense
[patches, patches] mask is built on a GPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers import rel_err
from unsloth_jax import ops
from unsloth_jax.models.layer_stack import LayerStackPolicy

transformers = pytest.importorskip("transformers")
FULL, NONE = LayerStackPolicy.parse("full"), LayerStackPolicy.parse("none")


@pytest.fixture
def clean_policy(monkeypatch):
    monkeypatch.delenv(ops.ENV_VAR, raising=False)
    yield
    ops.set_impl("attention", "auto")


def _qwen_tower(depth=4):
    from unsloth_jax.families import QWEN2_5_VL
    from unsloth_jax.models.vision_qwen2_5 import QwenVisionTower

    hf = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[2, 3, 3])),
        vision_config=dict(depth=depth, hidden_size=160, intermediate_size=128, num_heads=2, out_hidden_size=64,
                           patch_size=4, temporal_patch_size=2, spatial_merge_size=2, window_size=16,
                           fullatt_block_indexes=[1], in_channels=3),
        image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)
    cfg = QWEN2_5_VL.parse_config(hf.to_dict())
    assert cfg.vision.head_dim == 80
    return cfg.vision, QwenVisionTower(cfg.vision, rngs=nnx.Rngs(0))


def _siglip_tower(layers=4):
    from unsloth_jax.config import VisionConfig
    from unsloth_jax.models.vision import VisionTower

    cfg = VisionConfig(hidden_size=144, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=2,
                       image_size=32, patch_size=4)
    assert cfg.head_dim == 72
    return cfg, VisionTower(cfg, rngs=nnx.Rngs(0))


def _qwen_inputs(cfg, rng, grids):
    from unsloth_jax.models.vision_qwen2_5 import padded_vision_layout

    n = int(np.prod(grids, axis=-1).sum())
    pixels = jnp.asarray(rng.standard_normal((n + 16, cfg.patch_dim)), jnp.float32)  # 16 padding patches
    layout = {k: jnp.asarray(v) for k, v in padded_vision_layout(cfg, grids, n + 16).items()}
    return pixels, layout


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_tower_remat_keeps_gradients_and_frees_memory(family, rng):
    if family == "qwen2_5_vl":
        cfg, tower = _qwen_tower()
        pixels, layout = _qwen_inputs(cfg, rng, np.array([[1, 8, 8], [1, 4, 12]]))

        def run(policy):
            graphdef, params = nnx.split(tower)

            def loss(params, pixels, layout):
                out = nnx.merge(graphdef, params)(pixels, layout=layout, policy=policy)
                return jnp.sum(out * jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape)))

            grad = jax.jit(jax.grad(loss))
            compiled = grad.lower(params, pixels, layout).compile()
            return compiled(params, pixels, layout), compiled.memory_analysis()
    else:
        cfg, tower = _siglip_tower()
        pixels = jnp.asarray(rng.standard_normal((3, 3, 32, 32)), jnp.float32)

        def run(policy):
            graphdef, params = nnx.split(tower)

            def loss(params, pixels):
                out = nnx.merge(graphdef, params)(pixels, policy=policy)
                return jnp.sum(out * jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape)))

            compiled = jax.jit(jax.grad(loss)).lower(params, pixels).compile()
            return compiled(params, pixels), compiled.memory_analysis()

    with jax.default_matmul_precision("highest"):
        want, mem_none = run(NONE)
        got, mem_full = run(FULL)
    # all gradients as one vector (a key bias's gradient is zero up to rounding: softmax ignores it)
    flat = lambda tree: np.concatenate([np.asarray(a, np.float64).ravel() for a in jax.tree.leaves(tree)])  # noqa: E731
    err = rel_err(flat(got), flat(want))
    assert err < 1e-6 and np.abs(flat(want)).max() > 0, err
    print(f"{family}: temp bytes without remat {mem_none.temp_size_in_bytes}, with {mem_full.temp_size_in_bytes}")
    assert mem_full.temp_size_in_bytes < 0.8 * mem_none.temp_size_in_bytes


@pytest.mark.parametrize("head_dim", [72, 80])
def test_padded_flash_attention_with_segments_equals_xla(head_dim, rng, clean_policy):
    """ops.attention as the towers call it (bidirectional, segment ids of windows with a padding segment) on the
    flash kernel (interpret mode here), head_dim zero-padded to 128: output and gradients equal the XLA path."""
    from unsloth_jax.models.vision_qwen2_5 import PAD_SEGMENT

    s, h = 88, 2
    q, k, v = (jnp.asarray(rng.standard_normal((1, s, h, head_dim)), jnp.float32) for _ in range(3))
    seg = np.repeat(np.arange(5), [16, 16, 12, 16, 28]).astype(np.int32)
    seg[-8:] = PAD_SEGMENT
    seg = jnp.asarray(seg)[None]
    cot = jnp.asarray(rng.standard_normal((1, s, h, head_dim)), jnp.float32)

    def run(impl):
        ops.set_impl("attention", impl)

        def f(q, k, v):
            return jnp.sum(ops.attention(q, k, v, scale=head_dim ** -0.5, causal=False, segment_ids=seg) * cot)

        with jax.default_matmul_precision("highest"):
            out = ops.attention(q, k, v, scale=head_dim ** -0.5, causal=False, segment_ids=seg)
            return out, jax.grad(f, argnums=(0, 1, 2))(q, k, v), ops.chosen_impls()

    want, want_grads, _ = run("xla")
    got, got_grads, chosen = run("pallas")
    assert "pallas" in chosen["attention"]
    assert got.shape == want.shape
    assert rel_err(np.asarray(got), np.asarray(want)) < 1e-5
    for g, w in zip(got_grads, want_grads):
        assert rel_err(np.asarray(g), np.asarray(w)) < 1e-5


def test_default_dispatch_pads_tower_head_dims_to_flash():
    """On a GPU the default (auto) sends 16-bit calls at the towers' head dims to the flash kernel (padded to
    128), never above 256 and never float32."""
    probe = lambda dt, d: jax.ShapeDtypeStruct((1, 64, 2, d), dt)  # noqa: E731
    assert ops.flash_head_dim(72) == ops.flash_head_dim(80) == 128 and ops.flash_head_dim(64) == 64
    assert ops.PALLAS_WINS["attention"](probe(jnp.bfloat16, 80)) and ops.PALLAS_WINS["attention"](probe(jnp.bfloat16, 72))
    assert not ops.PALLAS_WINS["attention"](probe(jnp.float32, 80))
    assert not ops.PALLAS_WINS["attention"](probe(jnp.bfloat16, 512))


def test_image_blocks_through_ops_attention_equal_xla(rng, clean_policy):
    """ops.attention as Gemma 3's language model calls it with images (causal, right padding as kv_valid /
    kv_lengths, a sliding window, token_type_ids as block_ids) on the flash kernel equals the XLA path (jitted;
    interpret mode here): the image blocks reach the kernel, not a dense [B, H, S, S] mask."""
    from unsloth_jax.models.vision import image_block_ids

    b, s, hq, hkv, d = 2, 40, 4, 2, 16
    q = jnp.asarray(rng.standard_normal((b, s, hq, d)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.float32) for _ in range(2))
    types = np.zeros((b, s), np.int32)
    types[0, 3:11] = types[0, 20:28] = types[1, 5:13] = 1
    blocks = image_block_ids(jnp.asarray(types))
    lengths = jnp.asarray([s, s - 7], jnp.int32)
    valid = (jnp.arange(s)[None] < lengths[:, None]).astype(jnp.int32)

    def run(impl):
        ops.set_impl("attention", impl)
        f = jax.jit(lambda q, k, v: ops.attention(q, k, v, scale=0.25, window=12, kv_valid=valid, kv_lengths=lengths,
                                                  block_ids=blocks))
        with jax.default_matmul_precision("highest"):
            return np.asarray(f(q, k, v))

    want, got = run("xla"), run("pallas")
    real = np.asarray(valid, bool)
    assert rel_err(got[real], want[real]) < 1e-5
    causal = np.asarray(jax.jit(lambda q, k, v: ops.attention(q, k, v, scale=0.25, window=12, kv_valid=valid,
                                                              kv_lengths=lengths))(q, k, v))
    assert rel_err(causal[real], want[real]) > 1e-3  # the blocks change the result, so the check bites
