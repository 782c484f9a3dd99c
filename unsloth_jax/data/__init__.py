"""Datasets for supervised fine-tuning: load -> format -> tokenize -> (mask responses) -> batch.

Typical use (what SFTTrainer does)::

    from unsloth_jax.data import load_records, prepare_texts, tokenize_texts, DataLoader
    records = load_records("data.jsonl")                     # .jsonl, .json, or a folder of .jsonl
    texts = prepare_texts(records, tokenizer)                # text / alpaca / sharegpt / chatml, auto-detected
    examples = tokenize_texts(texts, tokenizer, max_seq_length=1024)
    loader = DataLoader(examples, batch_size=8, max_seq_length=1024, pad_token_id=tokenizer.pad_token_id)
    batch = loader.batch(epoch, index)                        # dict of int32 numpy arrays [B, S]
"""
from unsloth_jax.data.chat_templates import (
    CHAT_TEMPLATE_NAMES,
    RESPONSE_PARTS,
    STOP_TOKENS,
    chat_template_string,
    get_chat_template,
)
from unsloth_jax.data.formats import (
    ALPACA_PROMPT,
    ALPACA_PROMPT_NO_INPUT,
    alpaca_prompt,
    detect_format,
    format_alpaca,
    prepare_texts,
    record_to_messages,
    render_messages,
    standardize_sharegpt,
)
from unsloth_jax.data.loader import DataLoader
from unsloth_jax.data.loading import Records, load_records, validate_records
from unsloth_jax.data.packing import bucket_lengths, first_fit_decreasing, pick_bucket
from unsloth_jax.data.response_only import (
    IGNORE_INDEX,
    response_only_labels,
    response_only_mask,
    train_on_responses_only,
)
from unsloth_jax.data.tokenize import build_examples, suggest_max_seq_length, tokenize_texts

__all__ = [
    "ALPACA_PROMPT",
    "ALPACA_PROMPT_NO_INPUT",
    "CHAT_TEMPLATE_NAMES",
    "IGNORE_INDEX",
    "RESPONSE_PARTS",
    "STOP_TOKENS",
    "DataLoader",
    "Records",
    "alpaca_prompt",
    "bucket_lengths",
    "build_examples",
    "chat_template_string",
    "detect_format",
    "first_fit_decreasing",
    "format_alpaca",
    "get_chat_template",
    "load_records",
    "pick_bucket",
    "prepare_texts",
    "record_to_messages",
    "render_messages",
    "response_only_labels",
    "response_only_mask",
    "standardize_sharegpt",
    "suggest_max_seq_length",
    "tokenize_texts",
    "train_on_responses_only",
    "validate_records",
]
