"""The paged KV cache: per-layer page pools on the device and their allocator on the host.

Each layer's keys and values live in pools [P, BS, Hkv, hd] of P pages of BS token slots (`make_pools`). A
sequence owns a list of pages in order (its block table): its token t sits in page table[t // BS], slot t % BS.
The n completions of one prompt share the prompt's full pages (reference counted); each gets its own copy of
the prompt's last, partly filled page, where it goes on writing. Pages are reserved for a sequence's whole
length (prompt + max_tokens) when it is admitted, so a running sequence never waits for memory.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from unsloth_jax.config import attention_dims, layer_module
from unsloth_jax.models.linear_attention import RecurrentState, make_state


class PageAllocator:
    """Free list and reference counts of `num_pages` pages (host side)."""

    def __init__(self, num_pages: int):
        self.num_pages = int(num_pages)
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._refs = np.zeros(self.num_pages, np.int32)

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[int]:
        """`count` fresh pages (reference count 1); raises MemoryError when fewer are free."""
        if count > len(self._free):
            raise MemoryError(f"{count} pages asked for, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(count)]
        self._refs[pages] = 1
        return pages

    def share(self, pages, owners: int = 1) -> None:
        """`owners` more owners for each of `pages`."""
        for p in pages:
            self._refs[p] += owners

    def release(self, pages) -> None:
        """Drop one owner of each page; pages left without one return to the free list."""
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
            elif self._refs[p] < 0:
                raise RuntimeError(f"page {p} released more often than taken")


def pages_for(tokens: int, page_size: int) -> int:
    """Pages holding `tokens` token slots."""
    return -(-int(tokens) // int(page_size))


def pool_shapes(cfg, num_pages: int, page_size: int) -> tuple:
    """Per layer, the shape [P, BS, Hkv, hd] of its key and value pools, each layer at its attention's shape
    (Gemma 4's full-attention layers at global_head_dim / global_kv_heads: config.attention_dims), or None for a
    linear-attention layer. A KV-shared layer (Gemma 4) reads its source layer's pools and writes none: its own
    are empty (Hkv = 0)."""
    out = []
    for i in range(cfg.num_hidden_layers):
        if cfg.layer_linear and cfg.layer_linear[i]:
            out.append(None)
            continue
        hd, hkv = attention_dims(cfg, layer_module(cfg, "self_attn", i))
        out.append((num_pages, page_size, hkv if cfg.kv_source(i) == i else 0, hd))
    return tuple(out)


def page_bytes(cfg, page_size: int, dtype) -> int:
    """Bytes of one page across every attention layer, keys and values."""
    shapes = [s for s in pool_shapes(cfg, 1, page_size) if s is not None]
    return 2 * sum(math.prod(s) for s in shapes) * jnp.dtype(dtype).itemsize


def state_bytes(cfg, dtype) -> int:
    """Bytes of one row's recurrent state across the linear-attention layers (Qwen3.5; 0 for other models):
    the conv window [C, K-1] in `dtype` and the float32 delta-rule state [Hv, Dk, Dv]."""
    layers = sum(cfg.layer_linear)
    if not layers:
        return 0
    conv = cfg.linear_conv_dim * (cfg.linear_conv_kernel - 1) * jnp.dtype(dtype).itemsize
    delta = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return layers * (conv + delta)


def make_pools(cfg, num_pages: int, page_size: int, dtype, rows: int = 0) -> tuple:
    """Zeroed pools: a tuple over layers of (k_pages, v_pages), each of the layer's pool_shapes; a
    linear-attention layer (Qwen3.5) holds its `rows` rows' RecurrentState instead."""
    return tuple(make_state(cfg, rows, dtype) if shape is None else (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
                 for shape in pool_shapes(cfg, num_pages, page_size))


def attention_pool(pools) -> tuple:
    """The (k_pages, v_pages) of the first attention layer (the pools' page count and size)."""
    return next(p for p in pools if not isinstance(p, RecurrentState))


def _copy_pages(pools, src, dst):
    return tuple(p if isinstance(p, RecurrentState) else (p[0].at[dst].set(p[0][src]), p[1].at[dst].set(p[1][src]))
                 for p in pools)


copy_pages = jax.jit(_copy_pages, donate_argnums=(0,))
copy_pages.__doc__ = "pools with pages src [N] copied onto pages dst [N] in every layer (the pools are donated)."


__all__ = ["PageAllocator", "pages_for", "pool_shapes", "page_bytes", "make_pools", "copy_pages", "attention_pool",
           "state_bytes"]
