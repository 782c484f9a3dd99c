"""Growing the vocabulary: Unsloth's `add_new_tokens`, and resizing the embedding table and the output head.

    add_new_tokens(model, tokenizer, new_tokens=["<think>", "</think>"])    # tokenizer and model, in place

New rows start at the mean of the trained rows (Unsloth's rule: a row whose largest entry is <= 1e-16 counts
as untrained and is left out of the mean; the head's mean leaves out the same rows). transformers'
`resize_token_embeddings(mean_resizing=True)` uses the plain mean plus a 1e-9-covariance Gaussian jitter; with
no untrained rows the two agree to that jitter. `ModelConfig` is frozen, so the model gets a new config with the
new `vocab_size` (CausalLM.config and DecoderModel.config, the two places the module tree holds it).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from unsloth_jax.models.decoder import CausalLM

UNTRAINED_EPS = 1e-16  # Unsloth's threshold: max(row) <= eps marks a row as never trained


def _tables(model: CausalLM) -> list:
    """The [V, D] variables indexed by token id: the embedding table, and the head when untied."""
    tables = [model.model.embed_tokens.weight]
    if model.lm_head is not None:
        tables.append(model.lm_head.weight)
    return tables


def mean_of_trained_tokens(model: CausalLM, eps: float = UNTRAINED_EPS) -> list[np.ndarray]:
    """The float32 mean row [D] of each table (embedding, then the untied head) over the trained tokens:
    rows of the embedding whose largest entry is > eps (the same rows for the head)."""
    embed = np.asarray(model.model.embed_tokens.weight[...], np.float32)
    trained = embed.max(axis=1) > eps
    if not trained.any():
        raise ValueError("every row of the embedding table is <= 1e-16 (untrained): no mean to start new tokens from")
    return [np.asarray(var[...], np.float32)[trained].mean(axis=0, dtype=np.float32) for var in _tables(model)]


def set_vocab_size(model: CausalLM, vocab_size: int) -> None:
    """Replace the frozen config, on the model and everywhere the module tree holds it, by one with vocab_size."""
    cfg = dataclasses.replace(model.config, vocab_size=int(vocab_size))
    model.config = cfg
    model.model.config = cfg


def resize_token_embeddings(model: CausalLM, new_num_tokens: int, init_rows: slice | None = None,
                            means: list[np.ndarray] | None = None) -> None:
    """Grow the embedding table (and the untied head) to `new_num_tokens` rows, in place, keeping dtypes; the
    rows in `init_rows` (default: every new row) are set to `means` (default: mean_of_trained_tokens(model)).
    config.vocab_size follows. Shrinking is refused (it would drop trained rows)."""
    old = int(model.model.embed_tokens.weight[...].shape[0])
    new_num_tokens = int(new_num_tokens)
    if model.config.per_layer_input_size and new_num_tokens != old:
        raise ValueError(f"resize_token_embeddings: {model.config.model_type} has per-layer input embeddings "
                         "(embed_tokens_per_layer, vocab_size_per_layer_input), which are not resized here; growing "
                         "its vocabulary is not supported")
    if new_num_tokens < old:
        raise ValueError(f"resize_token_embeddings: {new_num_tokens} rows is fewer than the model's {old}; "
                         "shrinking the vocabulary is not supported")
    init_rows = slice(old, new_num_tokens) if init_rows is None else init_rows
    means = mean_of_trained_tokens(model) if means is None else means
    for var, mean in zip(_tables(model), means):
        table = var[...]
        grown = jnp.concatenate([table, jnp.zeros((new_num_tokens - table.shape[0], table.shape[1]), table.dtype)])
        var.set_value(grown.at[init_rows].set(jnp.asarray(mean).astype(table.dtype)))
    set_vocab_size(model, new_num_tokens)


def add_new_tokens(model: CausalLM, tokenizer, new_tokens, method: str = "mean", interpolation: float = 0.5) -> None:
    """Add `new_tokens` (strings) to `tokenizer` and grow the model's embedding and head to match, in place
    (Unsloth's add_new_tokens). Tokens the tokenizer already has are skipped. The model grows to
    max(its rows, len(tokenizer)); the new tokens' rows are the mean of the trained rows. Afterwards
    get_peft_model trains embed_tokens and lm_head (modules_to_save), as Unsloth does, and a transformers
    model matches after `hf_model.resize_token_embeddings(model.config.vocab_size)`."""
    if method == "interpolation":
        raise NotImplementedError("add_new_tokens(method='interpolation') is not supported; use method='mean'")
    if method != "mean":
        raise ValueError(f"add_new_tokens: method must be 'mean', got {method!r}")
    if isinstance(new_tokens, str) or not isinstance(new_tokens, (list, tuple)) or not new_tokens:
        raise TypeError(f"add_new_tokens: new_tokens must be a non-empty list of strings, got {new_tokens!r}")
    bad = [t for t in new_tokens if not isinstance(t, str) or not t]
    if bad:
        raise TypeError(f"add_new_tokens: new_tokens must be non-empty strings; got {bad!r}")
    known = set(tokenizer.get_vocab())
    overlap = [t for t in new_tokens if t in known]
    if overlap:
        print(f"unsloth_jax: add_new_tokens: {overlap} are already in the tokenizer and are skipped")
    fresh = list(dict.fromkeys(t for t in new_tokens if t not in known))
    if not fresh:
        return
    rows = max(int(t[...].shape[0]) for t in _tables(model))
    if model.config.per_layer_input_size and len(tokenizer) + len(fresh) > rows:
        raise ValueError(f"add_new_tokens: {model.config.model_type} has per-layer input embeddings "
                         "(embed_tokens_per_layer), which are not grown here; adding tokens past its "
                         f"{rows} embedding rows is not supported")
    means = mean_of_trained_tokens(model)  # before the tokenizer changes: it raises on an untrained table
    old_length = len(tokenizer)
    tokenizer.add_tokens(fresh)
    new_length = len(tokenizer)
    resize_token_embeddings(model, max(rows, new_length), init_rows=slice(old_length, new_length), means=means)
    model.need_to_train_embeddings = True  # get_peft_model adds embed_tokens / lm_head to modules_to_save


__all__ = ["add_new_tokens", "resize_token_embeddings", "mean_of_trained_tokens", "set_vocab_size", "UNTRAINED_EPS"]
