"""Gemma 3's vision-language model: a SigLIP vision tower, Gemma 3's multimodal projector, the Gemma 3 text decoder.

    model = Gemma3ForConditionalGeneration(vl_cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))   # checkpoints: hf.vision_io
    logits = model(input_ids, pixel_values=pixels, token_type_ids=types)                  # [B, S, V] float32

Module tree (HF names with the layer index dropped, as in decoder.py; the vision layers are stacked on axis 0):

    vision_tower.embeddings.patch_embedding.kernel [C*p*p, Dv] (+ bias)   HF's conv weight [Dv, C, p, p] flattened
    vision_tower.embeddings.position_embedding.weight [P, Dv]             P = (image_size / patch_size) ** 2
    vision_tower.encoder.layers.layer_norm{1,2}.{weight,bias} [Lv, Dv]
    vision_tower.encoder.layers.self_attn.{q,k,v,out}_proj.kernel [Lv, Dv, Dv] (+ bias)   Linear: LoRA-ready
    vision_tower.encoder.layers.mlp.fc{1,2}.kernel [Lv, Dv, Fv] / [Lv, Fv, Dv] (+ bias)
    vision_tower.post_layernorm.{weight,bias} [Dv]
    multi_modal_projector.mm_soft_emb_norm.weight [Dv]                    Gemma's (1 + w) RMSNorm
    multi_modal_projector.mm_input_projection.kernel [Dv, D]              HF's mm_input_projection_weight as is
    model.* / lm_head.*                                                   the Gemma 3 text CausalLM (decoder.py)

pixel_values are [N, C, H, W] (HF's layout, H = W = image_size), float; each image gives mm_tokens_per_image soft
tokens written, in order, where input_ids hold image_token_index. With token_type_ids (1 = image token), the
tokens of each run of image tokens attend to each other both ways (causal elsewhere; sliding windows still
apply), as transformers' Gemma 3 does.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from unsloth_jax import ops
from unsloth_jax.backend import is_tracer
from unsloth_jax.config import VisionConfig, VisionLanguageConfig
from unsloth_jax.models.decoder import CausalLM, call_inputs
from unsloth_jax.models.layer_stack import NO_REMAT, LayerStackPolicy, checkpointed
from unsloth_jax.models.layers import Embedding, Linear, RMSNorm

VISION_PROJS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")  # the vision layers' Linears by HF name


class LayerNorm(nnx.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis, in float32; weight/bias [*stack, dim]."""

    def __init__(self, dim: int, *, eps: float, stack: tuple[int, ...] = (), dtype=jnp.float32):
        self.eps = float(eps)
        self.weight = nnx.Param(jnp.ones((*stack, int(dim)), dtype))
        self.bias = nnx.Param(jnp.zeros((*stack, int(dim)), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., dim] -> [..., dim] in x.dtype."""
        h = x.astype(jnp.float32)
        mean = jnp.mean(h, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
        h = (h - mean) * jax.lax.rsqrt(var + self.eps)
        return (h * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


def layer_norm_paths(model: nnx.Module) -> tuple[tuple, ...]:
    """The attribute paths of `model`'s LayerNorm modules (vision towers' norms: transformers' Trainer gives the
    parameters of LayerNorm modules no weight decay whatever their names, train.optim.decay_mask)."""
    return tuple(tuple(path) for path, node in nnx.iter_graph(model) if isinstance(node, LayerNorm))


class VisionAttention(nnx.Module):
    """Bidirectional multi-head self-attention over the patches (biased q/k/v/out projections)."""

    def __init__(self, cfg: VisionConfig, *, stack: tuple[int, ...] = (), dtype=jnp.float32, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        common = dict(use_bias=True, stack=stack, dtype=dtype, rngs=rngs)
        self.q_proj = Linear(d, d, **common)
        self.k_proj = Linear(d, d, **common)
        self.v_proj = Linear(d, d, **common)
        self.out_proj = Linear(d, d, **common)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [N, P, Dv] -> [N, P, Dv]."""
        n, p, _ = x.shape
        q, k, v = (proj(x).reshape(n, p, self.num_heads, self.head_dim) for proj in (self.q_proj, self.k_proj,
                                                                                     self.v_proj))
        out = ops.attention(q, k, v, scale=self.head_dim ** -0.5, causal=False)
        return self.out_proj(out.reshape(n, p, self.num_heads * self.head_dim))


class VisionMLP(nnx.Module):
    """fc2(gelu_tanh(fc1(x))), both biased."""

    def __init__(self, cfg: VisionConfig, *, stack: tuple[int, ...] = (), dtype=jnp.float32, rngs: nnx.Rngs):
        common = dict(use_bias=True, stack=stack, dtype=dtype, rngs=rngs)
        self.fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, **common)
        self.fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, **common)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=True))


class VisionEncoderLayer(nnx.Module):
    """One pre-LayerNorm encoder layer: x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, cfg: VisionConfig, *, stack: tuple[int, ...] = (), dtype=jnp.float32, rngs: nnx.Rngs):
        norm = dict(eps=cfg.layer_norm_eps, stack=stack, dtype=dtype)
        self.layer_norm1 = LayerNorm(cfg.hidden_size, **norm)
        self.self_attn = VisionAttention(cfg, stack=stack, dtype=dtype, rngs=rngs)
        self.layer_norm2 = LayerNorm(cfg.hidden_size, **norm)
        self.mlp = VisionMLP(cfg, stack=stack, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nnx.Module):
    """The Lv encoder layers, one `VisionEncoderLayer` with variables stacked on axis 0, run by a lax.scan; each
    layer under the language model's LayerStackPolicy (its per-layer checkpoint and offload), so the backward pass
    keeps one input per layer instead of every activation."""

    def __init__(self, cfg: VisionConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.layers = VisionEncoderLayer(cfg, stack=(cfg.num_hidden_layers,), dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, policy: LayerStackPolicy = NO_REMAT) -> jax.Array:
        graphdef, state = nnx.split(self.layers)

        def body(h, layer_state):
            if policy.offload != "none":  # the value the host-offload policies send to pinned host memory
                h = checkpoint_name(h, "layer_input")
            return nnx.merge(graphdef, layer_state)(h), None

        return jax.lax.scan(checkpointed(body, policy), x, state)[0]


class VisionEmbeddings(nnx.Module):
    """Non-overlapping p x p patches, each flattened (channel, row, column) and projected (the conv as a matmul),
    plus one learned position embedding per patch."""

    def __init__(self, cfg: VisionConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.patch_embedding = Linear(cfg.num_channels * cfg.patch_size ** 2, cfg.hidden_size, use_bias=True,
                                      dtype=dtype, rngs=rngs)
        self.position_embedding = Embedding(cfg.num_patches, cfg.hidden_size, dtype=dtype, rngs=rngs)

    def __call__(self, pixel_values: jax.Array, dtype) -> jax.Array:
        """pixel_values [N, C, H, W] -> [N, P, Dv] in `dtype` (patches in row-major grid order)."""
        cfg = self.cfg
        want = (cfg.num_channels, cfg.image_size, cfg.image_size)
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != want:
            raise ValueError(f"pixel_values: shape {list(pixel_values.shape)}, expected [N, {want[0]}, {want[1]}, "
                             f"{want[2]}] (channels first, image_size {cfg.image_size})")
        n, c, p, g = pixel_values.shape[0], cfg.num_channels, cfg.patch_size, cfg.patches_per_side
        patches = pixel_values.astype(dtype).reshape(n, c, g, p, g, p).transpose(0, 2, 4, 1, 3, 5)
        x = self.patch_embedding(patches.reshape(n, g * g, c * p * p))
        return x + self.position_embedding.weight[...].astype(dtype)[None]


class VisionTower(nnx.Module):
    """SigLIP's vision transformer (no pooling head): embeddings, encoder, post LayerNorm."""

    def __init__(self, cfg: VisionConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.embeddings = VisionEmbeddings(cfg, dtype=dtype, rngs=rngs)
        self.encoder = VisionEncoder(cfg, dtype=dtype, rngs=rngs)
        self.post_layernorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)

    def __call__(self, pixel_values: jax.Array, dtype=jnp.float32,
                 policy: LayerStackPolicy = NO_REMAT) -> jax.Array:
        """pixel_values [N, C, H, W] -> last hidden state [N, P, Dv] in `dtype`; policy: the encoder layers'
        remat (VisionEncoder)."""
        return self.post_layernorm(self.encoder(self.embeddings(pixel_values, dtype), policy))


class MultiModalProjector(nnx.Module):
    """Gemma 3's projector: the patch grid average-pooled to tokens_per_side^2 tokens, RMSNorm (1 + w), then
    projected to the text hidden size."""

    def __init__(self, cfg: VisionLanguageConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        v = cfg.vision
        self.patches_per_side, self.pool = v.patches_per_side, cfg.pool_kernel
        self.mm_soft_emb_norm = RMSNorm(v.hidden_size, eps=v.layer_norm_eps, offset=1.0, dtype=dtype)
        self.mm_input_projection = Linear(v.hidden_size, cfg.text.hidden_size, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [N, P, Dv] -> [N, mm_tokens_per_image, D] in x.dtype."""
        n, _, dv = x.shape
        g, k = self.patches_per_side, self.pool
        t = g // k
        pooled = x.astype(jnp.float32).reshape(n, t, k, t, k, dv).mean(axis=(2, 4)).astype(x.dtype)
        return self.mm_input_projection(self.mm_soft_emb_norm(pooled.reshape(n, t * t, dv)))


def image_block_ids(token_type_ids: jax.Array) -> jax.Array:
    """token_type_ids [B, S] (1 = image token) -> block ids [B, S] int32: each run of consecutive image tokens
    numbered 0, 1, ... per row, -1 for other tokens (ops.attention's `block_ids`)."""
    image = token_type_ids == 1
    starts = image & ~jnp.pad(image, ((0, 0), (1, 0)))[:, :-1]
    return jnp.where(image, jnp.cumsum(starts.astype(jnp.int32), axis=1) - 1, -1).astype(jnp.int32)


def merge_image_features(x: jax.Array, is_image: jax.Array, features: jax.Array, *,
                         padded: bool = False) -> jax.Array:
    """x [B, S, D] with the rows of features [T, D] written, in order, where is_image [B, S] is True (row-major).
    When the arrays are concrete, the number of image positions must equal T (ValueError otherwise); padded:
    trailing padding features are allowed (at most T positions)."""
    flat = is_image.reshape(-1)
    n = None if is_tracer(flat) else int(jnp.sum(flat))
    if n is not None and (n > features.shape[0] if padded else n != features.shape[0]):
        raise ValueError(f"input_ids hold {int(jnp.sum(flat))} image tokens, but pixel_values give "
                         f"{features.shape[0]} image features (one per image token)")
    index = jnp.clip(jnp.cumsum(flat.astype(jnp.int32)) - 1, 0, features.shape[0] - 1)
    rows = jnp.where(flat[:, None], features.astype(x.dtype)[index], x.reshape(-1, x.shape[-1]))
    return rows.reshape(x.shape)


class Gemma3ForConditionalGeneration(CausalLM):
    """Gemma 3 with images (HF's Gemma3ForConditionalGeneration): CausalLM's text model (`config` is the text
    ModelConfig, so the LoRA and training code see a Gemma 3 decoder) plus `vision_tower` and
    `multi_modal_projector`; `vl_config` is the whole VisionLanguageConfig."""

    def __init__(self, cfg: VisionLanguageConfig, *, dtype=jnp.float32, param_dtype=None, rngs: nnx.Rngs):
        super().__init__(cfg.text, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        param_dtype = param_dtype or dtype
        self.vl_config = cfg
        self.vision_tower = VisionTower(cfg.vision, dtype=param_dtype, rngs=rngs)
        self.multi_modal_projector = MultiModalProjector(cfg, dtype=param_dtype, rngs=rngs)

    def vision_projections(self) -> dict:
        """The stacked vision-layer Linears by HF name (q_proj, k_proj, v_proj, out_proj, fc1, fc2)."""
        layer = self.vision_tower.encoder.layers
        return {name: getattr(layer.self_attn if name.endswith("proj") else layer.mlp, name) for name in VISION_PROJS}

    def image_features(self, pixel_values: jax.Array, policy: LayerStackPolicy | str = NO_REMAT) -> jax.Array:
        """pixel_values [N, C, H, W] -> soft tokens [N, mm_tokens_per_image, D] in the compute dtype; policy: the
        tower's remat (a LayerStackPolicy or its name)."""
        policy = LayerStackPolicy.parse(policy, argument="remat_mode")
        return self.multi_modal_projector(self.vision_tower(jnp.asarray(pixel_values), self.dtype, policy))

    def embed_with_images(self, input_ids: jax.Array, pixel_values: jax.Array | None,
                          policy: LayerStackPolicy | str = NO_REMAT) -> jax.Array:
        """input_ids [B, S] -> [B, S, D]: token embeddings (times sqrt(D)), the image features (unscaled) at the
        image-token positions. An image token id outside the vocabulary embeds row 0 before being replaced."""
        cfg = self.vl_config
        is_image = input_ids == cfg.image_token_index
        ids = jnp.where(is_image, 0, input_ids) if cfg.image_token_index >= cfg.text.vocab_size else input_ids
        x = self.model.embed(ids, self.dtype)
        if pixel_values is None:
            return x
        feats = self.image_features(pixel_values, policy)
        return merge_image_features(x, is_image, feats.reshape(-1, feats.shape[-1]))

    def hidden_states(self, input_ids: jax.Array, batch, *, remat_mode: LayerStackPolicy | str = NO_REMAT,
                      router_stats: bool = False, pixel_values: jax.Array | None = None):
        """Final-normed hidden states [B, S, D]; as CausalLM.hidden_states, with the images of pixel_values
        [N, C, H, W] at the image tokens (batch.block_ids for their bidirectional attention)."""
        if router_stats:
            raise ValueError("router_stats: Gemma 3 has no mixture-of-experts layers")
        x = self.embed_with_images(input_ids, pixel_values, remat_mode)
        return self.model(None, batch, remat_mode=remat_mode, dtype=self.dtype, inputs_embeds=x)

    def __call__(self, input_ids, attention_mask=None, positions=None, segment_ids=None, *, pixel_values=None,
                 token_type_ids=None) -> jax.Array:
        """Logits [B, S, V] (float32) for input_ids [B, S] (or [S]) of ints, pixel_values [N, C, H, W] (N images,
        mm_tokens_per_image image tokens each in input_ids), token_type_ids [B, S] (1 = image token: bidirectional
        within each image; None: causal everywhere, as transformers without token_type_ids), attention_mask
        [B, S] 1 = real."""
        input_ids, batch = call_inputs(input_ids, attention_mask, positions, segment_ids)
        if token_type_ids is not None:
            token_type_ids = jnp.asarray(token_type_ids, jnp.int32).reshape(input_ids.shape)
            batch = batch._replace(block_ids=image_block_ids(token_type_ids))
        return self.logits_from_hidden(self.hidden_states(input_ids, batch, pixel_values=pixel_values))
