"""Qwen3-VL: its vision tower (learned position embeddings resampled to each image, 2D RoPE, no windows, a patch
merger and the DeepStack mergers) and the Qwen3 text decoder with interleaved M-RoPE and DeepStack.

    model = Qwen3VLForConditionalGeneration(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))  # checkpoints: hf.vision_io
    logits = model(input_ids, attention_mask, pixel_values=pixels, image_grid_thw=grid)  # [B, S, V] float32

Module tree (HF names with the layer index dropped; the vision blocks are stacked on axis 0):

    visual.patch_embed.proj.kernel [C*T*p*p, Dv] (+ bias)     HF's Conv3d weight [Dv, C, T, p, p] flattened
    visual.pos_embed.weight [G*G, Dv]                          the learned G x G position grid
    visual.blocks.norm{1,2}.{weight,bias} [Lv, Dv]             LayerNorm (eps 1e-6)
    visual.blocks.attn.{qkv,proj}.kernel (+ bias)              models.vision_qwen2_5.QwenVisionAttention
    visual.blocks.mlp.linear_fc{1,2}.kernel (+ bias)           gelu (tanh)
    visual.merger.{norm,linear_fc1,linear_fc2}                 LayerNorm over Dv, then 4 Dv -> 4 Dv -> D
    visual.deepstack_merger_{j}.{norm,linear_fc1,linear_fc2}   HF's deepstack_merger_list.{j}: LayerNorm over 4 Dv
    model.* / lm_head.*                                        the Qwen3 text CausalLM (decoder.py)

Inputs are Qwen2.5-VL's (models.vision_qwen2_5): pixel_values [N, C*T*p*p] in the processor's merge-block
order, image_grid_thw [I, 3] (numpy), image i giving t*h*w / merge^2 tokens at the image_token_id positions. The
tower's outputs at blocks deepstack_visual_indexes[k], merged by deepstack merger k, are added at the image tokens
to the output of decoder layer k (DeepStack), as transformers' Qwen3VLTextModel does.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from unsloth_jax.config import Qwen3VisionConfig, Qwen3VLConfig
from unsloth_jax.models.layer_stack import (NO_REMAT, LayerStackPolicy, checkpointed, layer_graphdef, stack_rows,
                                            require_policy, run_layers)
from unsloth_jax.models.layers import Embedding, Linear
from unsloth_jax.models.rope import mrope_tables
from unsloth_jax.models.vision import LayerNorm, merge_image_features
from unsloth_jax.models.vision_qwen2_5 import (PAD_SEGMENT, Qwen2_5_VLForConditionalGeneration, QwenVisionAttention,
                                               _grid, vision_rope)

QWEN3_VISION_PROJS = ("qkv", "proj", "linear_fc1", "linear_fc2")  # the vision blocks' Linears by HF name


# ---------------------------------------------------------------------------------------- host-side layout
def _interpolation_taps(index: np.ndarray, size: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps (align_corners) of target positions `index` on axes of length `size` into a `side`-long
    source: (taps [N, 2] int, weights [N, 2] float32)."""
    src = index.astype(np.float64) * (side - 1) / np.maximum(size - 1, 1)
    floor = np.floor(src)
    raw = floor[:, None].astype(np.int64) + np.arange(2)
    weights = np.clip(1.0 - np.abs(src[:, None] - raw), 0.0, None)
    return np.clip(raw, 0, side - 1), weights


def vision_layout(cfg: Qwen3VisionConfig, image_grid_thw) -> dict[str, np.ndarray]:
    """The host-side layout of the patches of images `image_grid_thw` [I, 3] (pixel_values' order: merge blocks,
    row-major inside a block). Returns numpy arrays (the tower's `layout`; a jitted step may take them as inputs):

    positions [N, 2] int32        each patch's (row, column) in its image (the 2D RoPE)
    segment_ids [N] int32         each patch's (image, frame): attention stays within one
    interp_index [N, 4] int32     the 4 rows of the position grid each patch's embedding mixes (bilinear,
    interp_weight [N, 4] float32  align_corners, as transformers resamples the grid) and their weights
    """
    grid = _grid(image_grid_thw)
    m, side = cfg.spatial_merge_size, cfg.grid_side
    positions, segments, index, weight = [], [], [], []
    frame = 0
    for t, h, w in grid.tolist():
        if h % m or w % m:
            raise ValueError(f"image_grid_thw: grid ({t}, {h}, {w}) is not a multiple of spatial_merge_size {m}")
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        block = lambda a: a.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1)  # noqa: E731
        r, c = block(rows), block(cols)
        rt, rw = _interpolation_taps(r, np.full(r.shape, h), side)
        ct, cw = _interpolation_taps(c, np.full(c.shape, w), side)
        idx = (rt[:, :, None] * side + ct[:, None, :]).reshape(-1, 4)
        wts = (rw[:, :, None] * cw[:, None, :]).reshape(-1, 4)
        positions.append(np.tile(np.stack([r, c], -1), (t, 1)))
        index.append(np.tile(idx, (t, 1)))
        weight.append(np.tile(wts, (t, 1)))
        segments.append(np.repeat(np.arange(frame, frame + t), h * w))
        frame += t
    return dict(positions=np.concatenate(positions).astype(np.int32),
                segment_ids=np.concatenate(segments).astype(np.int32),
                interp_index=np.concatenate(index).astype(np.int32),
                interp_weight=np.concatenate(weight).astype(np.float32))


def padded_vision_layout(cfg: Qwen3VisionConfig, image_grid_thw, patches: int) -> dict[str, np.ndarray]:
    """vision_layout of images image_grid_thw [I, 3] (None or empty: no image) for pixel_values padded with zero
    patches to `patches` rows (a multiple of merge^2, at least the real count). The padding patches attend only to
    each other (segment PAD_SEGMENT), have no position embedding, and give the trailing merged tokens, which no
    image token reads: the real features are unchanged."""
    if image_grid_thw is None or len(image_grid_thw) == 0:
        layout = dict(positions=np.zeros((0, 2), np.int32), segment_ids=np.zeros(0, np.int32),
                      interp_index=np.zeros((0, 4), np.int32), interp_weight=np.zeros((0, 4), np.float32))
    else:
        layout = vision_layout(cfg, image_grid_thw)
    n = layout["segment_ids"].shape[0]
    if patches < n or patches % cfg.merge_unit:
        raise ValueError(f"padded_vision_layout: {patches} patches for {n} real ones; expected a multiple of "
                         f"{cfg.merge_unit} that is at least {n}")
    extra = patches - n
    pad = dict(positions=np.zeros((extra, 2), np.int32), segment_ids=np.full(extra, PAD_SEGMENT, np.int32),
               interp_index=np.zeros((extra, 4), np.int32), interp_weight=np.zeros((extra, 4), np.float32))
    return {k: np.concatenate([v, pad[k]]) for k, v in layout.items()}


# ----------------------------------------------------------------------------------------------- the tower
class Qwen3VisionMLP(nnx.Module):
    """linear_fc2(gelu_tanh(linear_fc1(x))), both biased."""

    def __init__(self, cfg: Qwen3VisionConfig, *, stack: tuple[int, ...] = (), dtype=jnp.float32, rngs: nnx.Rngs):
        common = dict(use_bias=True, stack=stack, dtype=dtype, rngs=rngs)
        self.linear_fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, **common)
        self.linear_fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, **common)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_fc2(jax.nn.gelu(self.linear_fc1(x), approximate=True))


class Qwen3VisionBlock(nnx.Module):
    """x + attn(norm1(x)), then + mlp(norm2(x)); LayerNorms."""

    def __init__(self, cfg: Qwen3VisionConfig, *, stack: tuple[int, ...] = (), dtype=jnp.float32, rngs: nnx.Rngs):
        self.norm1 = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, stack=stack, dtype=dtype)
        self.norm2 = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, stack=stack, dtype=dtype)
        self.attn = QwenVisionAttention(cfg, stack=stack, dtype=dtype, rngs=rngs)
        self.mlp = Qwen3VisionMLP(cfg, stack=stack, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, segment_ids):
        x = x + self.attn(self.norm1(x), cos, sin, segment_ids)
        return x + self.mlp(self.norm2(x))


class Qwen3PatchEmbed(nnx.Module):
    """The Conv3d patch embedding as a matmul over flattened patches (biased)."""

    def __init__(self, cfg: Qwen3VisionConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.proj = Linear(cfg.patch_dim, cfg.hidden_size, use_bias=True, dtype=dtype, rngs=rngs)


class Qwen3PatchMerger(nnx.Module):
    """LayerNorm (over Dv, or over the merge^2 concatenated patches when `postshuffle`: DeepStack's mergers), each
    merge unit's patches concatenated -> linear_fc1 -> GELU (exact) -> linear_fc2 to D."""

    def __init__(self, cfg: Qwen3VisionConfig, *, postshuffle: bool = False, dtype=jnp.float32, rngs: nnx.Rngs):
        wide = cfg.hidden_size * cfg.merge_unit
        self.wide, self.postshuffle = wide, postshuffle
        self.norm = LayerNorm(wide if postshuffle else cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.linear_fc1 = Linear(wide, wide, use_bias=True, dtype=dtype, rngs=rngs)
        self.linear_fc2 = Linear(wide, cfg.out_hidden_size, use_bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [N, Dv] (merge units contiguous) -> [N / merge^2, D]."""
        h = self.norm(x.reshape(-1, self.wide)) if self.postshuffle else self.norm(x).reshape(-1, self.wide)
        return self.linear_fc2(jax.nn.gelu(self.linear_fc1(h), approximate=False))


class Qwen3VisionTower(nnx.Module):
    """Qwen3-VL's vision transformer: patch embedding plus resampled position embeddings, depth blocks (attention
    within each frame), the patch merger and one DeepStack merger per deepstack_visual_indexes entry. The blocks
    are one stacked `Qwen3VisionBlock` run by a lax.scan that also returns every block's output."""

    def __init__(self, cfg: Qwen3VisionConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.patch_embed = Qwen3PatchEmbed(cfg, dtype=dtype, rngs=rngs)
        self.pos_embed = Embedding(cfg.num_position_embeddings, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.blocks = Qwen3VisionBlock(cfg, stack=(cfg.depth,), dtype=dtype, rngs=rngs)
        self.merger = Qwen3PatchMerger(cfg, dtype=dtype, rngs=rngs)
        for j in range(len(cfg.deepstack_visual_indexes)):
            setattr(self, f"deepstack_merger_{j}", Qwen3PatchMerger(cfg, postshuffle=True, dtype=dtype, rngs=rngs))

    def __call__(self, pixel_values: jax.Array, image_grid_thw=None, dtype=jnp.float32, *,
                 layout: dict | None = None, policy: LayerStackPolicy = NO_REMAT) -> tuple[jax.Array, jax.Array]:
        """pixel_values [N, C*T*p*p] float, image_grid_thw [I, 3] (numpy) -> (image features [N / merge^2, D],
        DeepStack features [K, N / merge^2, D]) in `dtype`, in pixel_values' merge-unit order. layout
        (vision_layout's arrays, possibly traced) replaces image_grid_thw; policy: each block's remat."""
        cfg = self.cfg
        if layout is None:
            if image_grid_thw is None:
                raise ValueError("pixel_values needs image_grid_thw (each image's [t, h, w] patch grid) or layout")
            layout = vision_layout(cfg, image_grid_thw)
        n = layout["segment_ids"].shape[0]
        if pixel_values.ndim != 2 or tuple(pixel_values.shape) != (n, cfg.patch_dim):
            raise ValueError(f"pixel_values: shape {list(pixel_values.shape)}, expected [{n}, {cfg.patch_dim}] "
                             f"(the patches of image_grid_thw, each C*T*p*p = {cfg.in_channels}*"
                             f"{cfg.temporal_patch_size}*{cfg.patch_size}*{cfg.patch_size} values)")
        x = self.patch_embed.proj(pixel_values.astype(dtype))
        table = self.pos_embed.weight[...].astype(jnp.float32)
        pos = jnp.einsum("nk,nkd->nd", jnp.asarray(layout["interp_weight"], jnp.float32),
                         table[jnp.asarray(layout["interp_index"])])
        x = x + pos.astype(dtype)
        cos, sin = vision_rope(cfg, jnp.asarray(layout["positions"]))
        segments = jnp.asarray(layout["segment_ids"])
        graphdef, state = nnx.split(self.blocks)

        def body(h, block_state):
            if policy.offload != "none":  # the value the host-offload policies send to pinned host memory
                h = checkpoint_name(h, "layer_input")
            h = nnx.merge(graphdef, block_state)(h, cos, sin, segments)
            return h, h

        x, outs = jax.lax.scan(checkpointed(body, policy), x, state)
        deep = [getattr(self, f"deepstack_merger_{j}")(outs[i]) for j, i in enumerate(cfg.deepstack_visual_indexes)]
        deep = jnp.stack(deep) if deep else jnp.zeros((0, n // cfg.merge_unit, cfg.out_hidden_size), dtype)
        return self.merger(x), deep


# ------------------------------------------------------------------------------------------ the whole model
def layer_slice(layers: nnx.Module, cfg, start: int, stop: int) -> nnx.Module:
    """Layers start .. stop-1 of a stacked layer module (text config `cfg`), as a stacked module of their own:
    each submodule's rows of those layers (config.stack_holders), one no layer of them holds left out (None)."""
    state = nnx.state(layers)
    kept = stack_rows(state, cfg, start, (stop - start,))  # one group of stop - start layers
    return nnx.merge(layer_graphdef(layers, frozenset(state.keys()) - frozenset(kept.keys())), kept)


class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """Qwen3-VL with images (HF's Qwen3VLForConditionalGeneration): CausalLM's Qwen3 text model (`config` is the
    text ModelConfig) plus `visual`; `vl_config` is the whole Qwen3VLConfig. Qwen2.5-VL's M-RoPE positions and
    call signature; image features also added after the first decoder layers (DeepStack)."""

    def __init__(self, cfg: Qwen3VLConfig, *, dtype=jnp.float32, param_dtype=None, rngs: nnx.Rngs):
        super(Qwen2_5_VLForConditionalGeneration, self).__init__(cfg.text, dtype=dtype, param_dtype=param_dtype,
                                                                 rngs=rngs)
        self.vl_config = cfg
        self.visual = Qwen3VisionTower(cfg.vision, dtype=param_dtype or dtype, rngs=rngs)

    def vision_projections(self) -> dict:
        """The stacked vision-block Linears by HF name (qkv, proj, linear_fc1, linear_fc2)."""
        blocks = self.visual.blocks
        return {name: getattr(blocks.attn if name in ("qkv", "proj") else blocks.mlp, name)
                for name in QWEN3_VISION_PROJS}

    def image_features(self, pixel_values: jax.Array, image_grid_thw=None, *, layout=None,
                       policy: LayerStackPolicy | str = NO_REMAT) -> jax.Array:
        """pixel_values [N, C*T*p*p], image_grid_thw [I, 3] (or `layout`) -> [N / merge^2, D] (the merger's)."""
        return self.image_and_deepstack_features(pixel_values, image_grid_thw, layout=layout, policy=policy)[0]

    def image_and_deepstack_features(self, pixel_values, image_grid_thw=None, *, layout=None,
                                     policy: LayerStackPolicy | str = NO_REMAT) -> tuple[jax.Array, jax.Array]:
        """(image features [N / merge^2, D], DeepStack features [K, N / merge^2, D]) in the compute dtype."""
        policy = LayerStackPolicy.parse(policy, argument="remat_mode")
        return self.visual(jnp.asarray(pixel_values), image_grid_thw, self.dtype, layout=layout, policy=policy)

    def vision_layout(self, image_grid_thw) -> dict[str, np.ndarray]:
        return vision_layout(self.vl_config.vision, image_grid_thw)

    def embed_with_deepstack(self, input_ids: jax.Array, pixel_values=None, image_grid_thw=None, *, layout=None,
                             policy: LayerStackPolicy | str = NO_REMAT) -> tuple[jax.Array, jax.Array | None]:
        """input_ids [B, S] -> (embeddings [B, S, D] with the image features at the image tokens, the DeepStack
        residuals [K, B, S, D]: feature k at the image tokens, zero elsewhere; None without images)."""
        x = self.model.embed(input_ids, self.dtype)
        if pixel_values is None:
            return x, None
        feats, deep = self.image_and_deepstack_features(pixel_values, image_grid_thw, layout=layout, policy=policy)
        is_image = input_ids == self.vl_config.image_token_id
        padded = layout is not None  # a padded layout's trailing features no image token reads
        x = merge_image_features(x, is_image, feats, padded=padded)
        zeros = jnp.zeros_like(x)
        residuals = jnp.stack([merge_image_features(zeros, is_image, d, padded=padded) for d in deep]) \
            if deep.shape[0] else None
        return x, residuals

    def embed_with_images(self, input_ids: jax.Array, pixel_values=None, image_grid_thw=None, *,
                          layout=None, policy: LayerStackPolicy | str = NO_REMAT) -> jax.Array:
        """input_ids [B, S] -> [B, S, D]: token embeddings, the image features at the image_token_id positions
        (the DeepStack residuals: embed_with_deepstack)."""
        return self.embed_with_deepstack(input_ids, pixel_values, image_grid_thw, layout=layout, policy=policy)[0]

    def run_layers_with_deepstack(self, x: jax.Array, cos, sin, batch, residuals: jax.Array | None, *,
                                  remat_mode: LayerStackPolicy = NO_REMAT) -> jax.Array:
        """The decoder layers over x [B, S, D], residuals[k] [B, S, D] added to the output of layer k (the first
        K layers run one at a time, the rest as one stack)."""
        if residuals is None:
            return self.model.run_layers(x, cos, sin, batch, remat_mode=remat_mode)[0]
        cfg, policy = self.config, require_policy(remat_mode, "remat_mode")
        if len(set(cfg.layer_kinds)) > 1:  # the one-layer slices below re-read the per-layer tuples from layer 0
            raise NotImplementedError(f"{cfg.model_type}: DeepStack over a decoder whose layers differ in kind")
        k = residuals.shape[0]
        for i in range(k):
            one = layer_slice(self.model.layers, cfg, i, i + 1)
            x = run_layers(one, dataclasses.replace(cfg, num_hidden_layers=1), x, cos, sin, batch, policy=policy)[0]
            x = x + residuals[i].astype(x.dtype)
        rest = cfg.num_hidden_layers - k
        if rest:
            layers = layer_slice(self.model.layers, cfg, k, cfg.num_hidden_layers)
            x = run_layers(layers, dataclasses.replace(cfg, num_hidden_layers=rest), x, cos, sin, batch,
                           policy=policy)[0]
        return x

    def hidden_states(self, input_ids: jax.Array, batch, *, remat_mode: LayerStackPolicy | str = NO_REMAT,
                      router_stats: bool = False, pixel_values=None, image_grid_thw=None,
                      mrope_positions: jax.Array | None = None, vision_layout: dict | None = None):
        """Final-normed hidden states [B, S, D]: as Qwen2.5-VL's, with interleaved M-RoPE and DeepStack."""
        if router_stats:
            raise ValueError("router_stats: Qwen3-VL has no mixture-of-experts layers")
        remat_mode = LayerStackPolicy.parse(remat_mode, argument="remat_mode")
        x, residuals = self.embed_with_deepstack(input_ids, pixel_values, image_grid_thw, layout=vision_layout,
                                                 policy=remat_mode)
        if mrope_positions is None:
            mrope_positions = jnp.broadcast_to(batch.positions[None], (3, *batch.positions.shape))
        cos, sin = mrope_tables(self.config, jnp.asarray(mrope_positions), self.vl_config.mrope_section,
                                interleaved=True)
        x = self.run_layers_with_deepstack(x.astype(self.dtype), cos, sin, batch, residuals, remat_mode=remat_mode)
        return self.model.norm(x)
