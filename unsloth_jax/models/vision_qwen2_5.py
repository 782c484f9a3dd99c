"""Qwen2.5-VL: its vision transformer (window attention, 2D RoPE, patch merger) and the Qwen2 text decoder with
multimodal RoPE (M-RoPE).

    model = Qwen2_5_VLForConditionalGeneration(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))  # checkpoints: hf.vision_io
    logits = model(input_ids, attention_mask, pixel_values=pixels, image_grid_thw=grid)   # [B, S, V] float32

Module tree (HF names with the layer index dropped; the vision blocks are stacked on axis 0):

    visual.patch_embed.proj.kernel [C*T*p*p, Dv]           HF's Conv3d weight [Dv, C, T, p, p] flattened (no bias)
    visual.blocks.norm{1,2}.weight [Lv, Dv]                RMSNorm (eps 1e-6)
    visual.blocks.attn.qkv.kernel [Lv, Dv, 3 Dv] (+ bias)  Linear: LoRA-ready
    visual.blocks.attn.proj.kernel [Lv, Dv, Dv] (+ bias)
    visual.blocks.mlp.{gate,up,down}_proj.kernel (+ bias)  SwiGLU
    visual.merger.ln_q.weight [Dv]
    visual.merger.mlp_0.kernel [4 Dv, 4 Dv] (+ bias)       HF's merger.mlp.0 (then exact GELU)
    visual.merger.mlp_2.kernel [4 Dv, D] (+ bias)          HF's merger.mlp.2
    model.* / lm_head.*                                    the Qwen2 text CausalLM (decoder.py)

Images arrive as transformers' Qwen2-VL image processor gives them: pixel_values [N, C*T*p*p] (N patches of all
images, each image's patches in the processor's order: spatial_merge_size^2 blocks, row-major inside a block) and
image_grid_thw [I, 3] (each image's temporal, height, width patch counts). Image i gives t*h*w / merge^2
language tokens, written in order where input_ids hold image_token_id. image_grid_thw must be concrete (numpy):
the window layout and the 3-axis positions are built on the host from it (as transformers does).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from unsloth_jax import ops
from unsloth_jax.backend import is_tracer
from unsloth_jax.config import QwenVisionConfig, QwenVLConfig
from unsloth_jax.models.decoder import CausalLM, call_inputs
from unsloth_jax.models.layer_stack import NO_REMAT, LayerStackPolicy, checkpointed
from unsloth_jax.models.layers import Linear, RMSNorm
from unsloth_jax.models.rope import mrope_tables
from unsloth_jax.models.vision import merge_image_features

QWEN_VISION_PROJS = ("qkv", "proj", "gate_proj", "up_proj", "down_proj")  # the vision blocks' Linears by HF name


# ---------------------------------------------------------------------------------------- host-side layout
def _grid(image_grid_thw) -> np.ndarray:
    """image_grid_thw as an [I, 3] int64 numpy array (ValueError for a traced or malformed one)."""
    if is_tracer(image_grid_thw):
        raise ValueError("image_grid_thw must be concrete (numpy), not traced: the window layout is built on the host")
    grid = np.asarray(image_grid_thw, np.int64)
    if grid.ndim != 2 or grid.shape[1] != 3 or (grid <= 0).any():
        raise ValueError(f"image_grid_thw: expected [num_images, 3] positive (t, h, w), got {grid.tolist()}")
    return grid


def vision_layout(cfg: QwenVisionConfig, image_grid_thw) -> dict[str, np.ndarray]:
    """The host-side layout of the patches of images `image_grid_thw` [I, 3], as transformers' vision tower
    builds it. Returns int32 numpy arrays (the tower's `layout`; a jitted step may take them as inputs):

    order [N]          the window order: patch order[j] is the j-th patch the blocks see (windows contiguous;
                       whole merge units move together)
    positions [N, 2]   in window order: each patch's (row, column) in its image
    frame_ids [N]      in window order: the (image, frame) of each patch (full-attention blocks attend within one)
    window_ids [N]     in window order: the window of each patch (the other blocks attend within one)
    restore [N / merge^2]  the merged tokens (window order) gathered back into pixel_values' order
    """
    grid = _grid(image_grid_thw)
    m, unit = cfg.spatial_merge_size, cfg.merge_unit
    win = cfg.window_size // m // cfg.patch_size  # window side in merged tokens
    positions, units, frames, windows = [], [], [], []
    unit_base, frame, window = 0, 0, 0
    for t, h, w in grid.tolist():
        if h % m or w % m:
            raise ValueError(f"image_grid_thw: grid ({t}, {h}, {w}) is not a multiple of spatial_merge_size {m}")
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        block = lambda a: a.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1)  # noqa: E731
        positions.append(np.tile(np.stack([block(rows), block(cols)], -1), (t, 1)))
        gh, gw = h // m, w // m
        for ti in range(t):
            ids = np.arange(gh * gw).reshape(gh, gw) + unit_base + ti * gh * gw
            for r0 in range(0, gh, win):
                for c0 in range(0, gw, win):
                    chunk = ids[r0:r0 + win, c0:c0 + win].reshape(-1)
                    units.append(chunk)
                    windows.append(np.full(chunk.size * unit, window))
                    frames.append(np.full(chunk.size * unit, frame))
                    window += 1
            frame += 1
        unit_base += t * gh * gw
    unit_order = np.concatenate(units)
    order = (unit_order[:, None] * unit + np.arange(unit)[None]).reshape(-1)
    out = dict(order=order, positions=np.concatenate(positions)[order], frame_ids=np.concatenate(frames),
               window_ids=np.concatenate(windows), restore=np.argsort(unit_order))
    return {k: v.astype(np.int32) for k, v in out.items()}


PAD_SEGMENT = 2 ** 30  # the attention segment of padding patches (no real frame or window has this id)


def padded_vision_layout(cfg: QwenVisionConfig, image_grid_thw, patches: int) -> dict[str, np.ndarray]:
    """vision_layout of images image_grid_thw [I, 3] (None or empty: no image) for pixel_values padded with
    zero patches to `patches` rows (a multiple of merge^2, at least the real count). The padding patches come
    after the real ones in window order, attend only to each other (segment PAD_SEGMENT) and give the last
    merged tokens, which no image token reads: the real features are unchanged. int32 arrays as vision_layout."""
    unit = cfg.merge_unit
    if image_grid_thw is None or len(image_grid_thw) == 0:
        layout = dict(order=np.zeros(0, np.int32), positions=np.zeros((0, 2), np.int32),
                      frame_ids=np.zeros(0, np.int32), window_ids=np.zeros(0, np.int32), restore=np.zeros(0, np.int32))
    else:
        layout = vision_layout(cfg, image_grid_thw)
    n = layout["order"].shape[0]
    if patches < n or patches % unit:
        raise ValueError(f"padded_vision_layout: {patches} patches for {n} real ones; expected a multiple of "
                         f"{unit} that is at least {n}")
    extra = patches - n
    pad = np.full(extra, PAD_SEGMENT, np.int32)
    return dict(order=np.concatenate([layout["order"], np.arange(n, patches, dtype=np.int32)]),
                positions=np.concatenate([layout["positions"], np.zeros((extra, 2), np.int32)]),
                frame_ids=np.concatenate([layout["frame_ids"], pad]),
                window_ids=np.concatenate([layout["window_ids"], pad]),
                restore=np.concatenate([layout["restore"], np.arange(n // unit, patches // unit, dtype=np.int32)]))


def mrope_positions(cfg: QwenVLConfig, input_ids, attention_mask=None, image_grid_thw=None) -> np.ndarray:
    """The 3-axis (temporal, height, width) positions [3, B, S] int32 of transformers' get_rope_index for
    input_ids [B, S] (concrete): text tokens count up on all three axes; each run of image_token_id tokens (one
    image, in image_grid_thw order) takes, from the current position p, (p + t, p + row, p + column) over its
    merged grid, and the text after it continues at p + max(h, w) / merge. With attention_mask [B, S] only the
    real tokens are counted (padding gets position 0). ValueError when an image run's length does not match its
    grid."""
    ids = np.asarray(input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    mask = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask).reshape(ids.shape) != 0
    grids = iter(_grid(image_grid_thw).tolist() if image_grid_thw is not None else [])
    m = cfg.vision.spatial_merge_size
    out = np.zeros((3, *ids.shape), np.int64)
    for b in range(ids.shape[0]):
        real = ids[b][mask[b]]
        is_image = real == cfg.image_token_id
        pos, parts, i = 0, [], 0
        while i < real.size:
            j = i
            while j < real.size and is_image[j] == is_image[i]:
                j += 1
            if not is_image[i]:
                parts.append(np.broadcast_to(np.arange(j - i) + pos, (3, j - i)))
                pos += j - i
            else:
                grid = next(grids, None)
                if grid is None:
                    raise ValueError(f"input_ids row {b} has more image-token runs than image_grid_thw has images")
                t, h, w = grid[0], grid[1] // m, grid[2] // m
                if t * h * w != j - i:
                    raise ValueError(f"input_ids row {b}: a run of {j - i} image tokens, but its image_grid_thw "
                                     f"entry {grid} gives {t * h * w} tokens")
                tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
                parts.append(np.stack([tt, hh, ww]).reshape(3, -1) + pos)
                pos += max(h, w)
            i = j
        if parts:
            out[:, b, mask[b]] = np.concatenate(parts, axis=1)
    if next(grids, None) is not None:
        raise ValueError("image_grid_thw has more images than input_ids has runs of image tokens")
    return out.astype(np.int32)


# ----------------------------------------------------------------------------------------------- the tower
def vision_rope(cfg, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The towers' 2D RoPE (Qwen2.5-VL, Qwen3-VL; cfg: head_dim, rope_theta): positions [N, 2] (row, column) ->
    cos, sin [N, head_dim] float32: head_dim/4 frequencies rotate by the row, the next head_dim/4 by the column,
    the whole repeated twice (rotate-half layout)."""
    quarter = cfg.head_dim // 2
    inv = 1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, quarter, 2, dtype=np.float32) / quarter))
    freqs = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(inv, jnp.float32)  # [N, 2, hd/4]
    emb = freqs.reshape(positions.shape[0], -1)
    emb = jnp.concatenate([emb, emb], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


class QwenVisionAttention(nnx.Module):
    """Bidirectional attention over the patches, within equal segment ids; fused qkv (biased) and proj."""

    def __init__(self, cfg: QwenVisionConfig, *, stack: tuple[int, ...] = (), dtype=jnp.float32, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = Linear(d, 3 * d, use_bias=True, stack=stack, dtype=dtype, rngs=rngs)
        self.proj = Linear(d, d, use_bias=True, stack=stack, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """x [N, Dv], cos/sin [N, head_dim] float32, segment_ids [N] int32 -> [N, Dv]."""
        n = x.shape[0]
        qkv = self.qkv(x).reshape(1, n, 3, self.num_heads, self.head_dim)
        q, k = ops.rope(qkv[:, :, 0], qkv[:, :, 1], cos[None], sin[None])
        out = ops.attention(q, k, qkv[:, :, 2], scale=self.head_dim ** -0.5, causal=False,
                            segment_ids=segment_ids[None])
        return self.proj(out.reshape(n, self.num_heads * self.head_dim))


class QwenVisionMLP(nnx.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), all biased."""

    def __init__(self, cfg: QwenVisionConfig, *, stack: tuple[int, ...] = (), dtype=jnp.float32, rngs: nnx.Rngs):
        common = dict(use_bias=True, stack=stack, dtype=dtype, rngs=rngs)
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, **common)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, **common)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, **common)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class QwenVisionBlock(nnx.Module):
    """x + attn(norm1(x)), then + mlp(norm2(x))."""

    def __init__(self, cfg: QwenVisionConfig, *, stack: tuple[int, ...] = (), dtype=jnp.float32, rngs: nnx.Rngs):
        self.norm1 = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, stack=stack, dtype=dtype)
        self.norm2 = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, stack=stack, dtype=dtype)
        self.attn = QwenVisionAttention(cfg, stack=stack, dtype=dtype, rngs=rngs)
        self.mlp = QwenVisionMLP(cfg, stack=stack, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, segment_ids):
        x = x + self.attn(self.norm1(x), cos, sin, segment_ids)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nnx.Module):
    """The Conv3d patch embedding as a matmul over flattened patches (no bias)."""

    def __init__(self, cfg: QwenVisionConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.proj = Linear(cfg.patch_dim, cfg.hidden_size, dtype=dtype, rngs=rngs)

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        return self.proj(pixel_values)


class PatchMerger(nnx.Module):
    """RMSNorm, then each merge unit's merge^2 patches concatenated -> Linear -> GELU (exact) -> Linear to D."""

    def __init__(self, cfg: QwenVisionConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        wide = cfg.hidden_size * cfg.merge_unit
        self.ln_q = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.mlp_0 = Linear(wide, wide, use_bias=True, dtype=dtype, rngs=rngs)
        self.mlp_2 = Linear(wide, cfg.out_hidden_size, use_bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [N, Dv] (merge units contiguous) -> [N / merge^2, D]."""
        h = self.ln_q(x).reshape(-1, self.mlp_0.in_features)
        return self.mlp_2(jax.nn.gelu(self.mlp_0(h), approximate=False))


class QwenVisionTower(nnx.Module):
    """Qwen2.5-VL's vision transformer: patch embedding, depth blocks (window attention except in
    fullatt_block_indexes), patch merger. The blocks are one stacked `QwenVisionBlock` run by a lax.scan."""

    def __init__(self, cfg: QwenVisionConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, dtype=dtype, rngs=rngs)
        self.blocks = QwenVisionBlock(cfg, stack=(cfg.depth,), dtype=dtype, rngs=rngs)
        self.merger = PatchMerger(cfg, dtype=dtype, rngs=rngs)

    def rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        return vision_rope(self.cfg, positions)

    def __call__(self, pixel_values: jax.Array, image_grid_thw=None, dtype=jnp.float32, *,
                 layout: dict | None = None, policy: LayerStackPolicy = NO_REMAT) -> jax.Array:
        """pixel_values [N, C*T*p*p] float, image_grid_thw [I, 3] (numpy) -> image features [N / merge^2, D] in
        `dtype`, in the order of pixel_values' merge units (the language tokens' order). layout (vision_layout's
        arrays, possibly traced) replaces image_grid_thw. policy: each block's remat (the language model's
        LayerStackPolicy: its per-layer checkpoint and offload). Attention runs over all patches as one sequence
        with segment ids (a window, or a frame in the full-attention blocks): the flash kernel on a GPU, which
        visits only the key blocks whose segments meet the query block's."""
        cfg = self.cfg
        if layout is None:
            if image_grid_thw is None:
                raise ValueError("pixel_values needs image_grid_thw (each image's [t, h, w] patch grid) or layout")
            layout = vision_layout(cfg, image_grid_thw)
        n = layout["order"].shape[0]
        if pixel_values.ndim != 2 or tuple(pixel_values.shape) != (n, cfg.patch_dim):
            raise ValueError(f"pixel_values: shape {list(pixel_values.shape)}, expected [{n}, {cfg.patch_dim}] "
                             f"(the patches of image_grid_thw, each C*T*p*p = {cfg.in_channels}*"
                             f"{cfg.temporal_patch_size}*{cfg.patch_size}*{cfg.patch_size} values)")
        x = self.patch_embed(pixel_values.astype(dtype))[jnp.asarray(layout["order"])]
        cos, sin = self.rope(jnp.asarray(layout["positions"]))
        full = np.zeros(cfg.depth, bool)
        full[list(cfg.fullatt_block_indexes)] = True
        frames, windows = jnp.asarray(layout["frame_ids"]), jnp.asarray(layout["window_ids"])
        graphdef, state = nnx.split(self.blocks)

        def body(h, xs):
            block_state, is_full = xs
            if policy.offload != "none":  # the value the host-offload policies send to pinned host memory
                h = checkpoint_name(h, "layer_input")
            segments = jnp.where(is_full, frames, windows)
            return nnx.merge(graphdef, block_state)(h, cos, sin, segments), None

        x = jax.lax.scan(checkpointed(body, policy), x, (state, jnp.asarray(full)))[0]
        return self.merger(x)[jnp.asarray(layout["restore"])]


# ------------------------------------------------------------------------------------------ the whole model
class Qwen2_5_VLForConditionalGeneration(CausalLM):
    """Qwen2.5-VL with images (HF's Qwen2_5_VLForConditionalGeneration): CausalLM's Qwen2 text model (`config` is
    the text ModelConfig) plus `visual`; `vl_config` is the whole QwenVLConfig. The language model rotates by
    M-RoPE positions [3, B, S] (mrope_positions) instead of the text models' [B, S]."""

    def __init__(self, cfg: QwenVLConfig, *, dtype=jnp.float32, param_dtype=None, rngs: nnx.Rngs):
        super().__init__(cfg.text, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.vl_config = cfg
        self.visual = QwenVisionTower(cfg.vision, dtype=param_dtype or dtype, rngs=rngs)

    def vision_projections(self) -> dict:
        """The stacked vision-block Linears by HF name (qkv, proj, gate_proj, up_proj, down_proj)."""
        blocks = self.visual.blocks
        return {name: getattr(blocks.attn if name in ("qkv", "proj") else blocks.mlp, name)
                for name in QWEN_VISION_PROJS}

    def image_features(self, pixel_values: jax.Array, image_grid_thw=None, *, layout=None,
                       policy: LayerStackPolicy | str = NO_REMAT) -> jax.Array:
        """pixel_values [N, C*T*p*p], image_grid_thw [I, 3] (or `layout`, vision_layout's arrays) -> [N / merge^2,
        D] in the compute dtype; policy: the tower's remat (a LayerStackPolicy or its name)."""
        policy = LayerStackPolicy.parse(policy, argument="remat_mode")
        return self.visual(jnp.asarray(pixel_values), image_grid_thw, self.dtype, layout=layout, policy=policy)

    def vision_layout(self, image_grid_thw) -> dict[str, np.ndarray]:
        """The vision tower's host-side layout (vision_layout) of images image_grid_thw [I, 3]."""
        return vision_layout(self.vl_config.vision, image_grid_thw)

    def embed_with_images(self, input_ids: jax.Array, pixel_values=None, image_grid_thw=None, *,
                          layout=None, policy: LayerStackPolicy | str = NO_REMAT) -> jax.Array:
        """input_ids [B, S] -> [B, S, D]: token embeddings, the image features at the image_token_id positions."""
        x = self.model.embed(input_ids, self.dtype)
        if pixel_values is None:
            return x
        feats = self.image_features(pixel_values, image_grid_thw, layout=layout, policy=policy)
        # a layout may come with padding patches (padded_vision_layout): their features trail the real ones
        return merge_image_features(x, input_ids == self.vl_config.image_token_id, feats, padded=layout is not None)

    def rope_positions(self, input_ids, attention_mask=None, image_grid_thw=None) -> np.ndarray:
        """M-RoPE positions [3, B, S] int32 (mrope_positions) for concrete input_ids [B, S]."""
        return mrope_positions(self.vl_config, input_ids, attention_mask, image_grid_thw)

    def hidden_states(self, input_ids: jax.Array, batch, *, remat_mode: LayerStackPolicy | str = NO_REMAT,
                      router_stats: bool = False, pixel_values=None, image_grid_thw=None,
                      mrope_positions: jax.Array | None = None, vision_layout: dict | None = None):
        """Final-normed hidden states [B, S, D]; as CausalLM.hidden_states, with the images of pixel_values at the
        image tokens and RoPE by mrope_positions [3, B, S] (None: batch.positions on all three axes, i.e. plain
        RoPE, right for text without images); vision_layout replaces image_grid_thw for the tower (traceable)."""
        if router_stats:
            raise ValueError("router_stats: Qwen2.5-VL has no mixture-of-experts layers")
        x = self.embed_with_images(input_ids, pixel_values, image_grid_thw, layout=vision_layout, policy=remat_mode)
        if mrope_positions is None:
            mrope_positions = jnp.broadcast_to(batch.positions[None], (3, *batch.positions.shape))
        cos, sin = mrope_tables(self.config, jnp.asarray(mrope_positions), self.vl_config.mrope_section)
        x, _ = self.model.run_layers(x.astype(self.dtype), cos, sin, batch, remat_mode=remat_mode)
        return self.model.norm(x)

    def __call__(self, input_ids, attention_mask=None, positions=None, segment_ids=None, *, pixel_values=None,
                 image_grid_thw=None, vision_layout=None) -> jax.Array:
        """Logits [B, S, V] (float32) for input_ids [B, S] (or [S]), attention_mask [B, S] 1 = real,
        pixel_values [N, C*T*p*p] with image_grid_thw [I, 3]. positions: [3, B, S] M-RoPE positions, or [B, S]
        (the same on all axes); None: computed from concrete input_ids (mrope_positions). Traced inputs (a
        jitted step) take positions and vision_layout (model.rope_positions / model.vision_layout, on the host)
        instead of image_grid_thw."""
        input_ids, batch = call_inputs(input_ids, attention_mask, None, segment_ids)
        if positions is None:
            if is_tracer(input_ids):
                raise ValueError("positions: pass M-RoPE positions [3, B, S] (model.rope_positions) when "
                                 "input_ids are traced")
            mrope = jnp.asarray(self.rope_positions(input_ids, attention_mask, image_grid_thw))
        else:
            positions = jnp.asarray(positions, jnp.int32)
            if positions.ndim == 3 and positions.shape[0] == 3:
                mrope = positions
            elif positions.shape == input_ids.shape:
                mrope = jnp.broadcast_to(positions[None], (3, *input_ids.shape))
            else:
                raise ValueError(f"positions: shape {list(positions.shape)}, expected [3, B, S] or [B, S] for "
                                 f"input_ids {list(input_ids.shape)}")
        return self.logits_from_hidden(self.hidden_states(input_ids, batch, pixel_values=pixel_values,
                                                          image_grid_thw=image_grid_thw, mrope_positions=mrope,
                                                          vision_layout=vision_layout))
