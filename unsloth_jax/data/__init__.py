"""Datasets for supervised fine-tuning: load -> format -> tokenize -> (mask responses) -> batch.

Typical use (what SFTTrainer does)::

    from unsloth_jax.data import load_records, build_examples, DataLoader
    records = load_records("data.jsonl")                     # .jsonl, .json, or a folder of .jsonl
    examples = build_examples(records, tokenizer, max_seq_length=1024)  # formats auto-detected (below)
    loader = DataLoader(examples, batch_size=8, max_seq_length=1024, pad_token_id=tokenizer.pad_token_id)
    batch = loader.batch(epoch, index)                        # dict of int32 numpy arrays [B, S]

Formats: text, alpaca, sharegpt, chatml, and TRL's prompt-completion ({"prompt", "completion"} as strings or
as lists of {role, content} turns; the loss is on the completion only, as TRL's completion_only_loss).
``build_examples`` is ``prepare_texts`` + ``tokenize_texts`` + that prompt masking.

Modules: ``records`` (formats, role table, locations, per-record checks) is imported by ``loading`` (files,
validation) and ``formats`` (rendering), which do not import each other.
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
    format_alpaca,
    prepare_texts,
    prompt_completion_texts,
    record_to_messages,
    render_messages,
    standardize_sharegpt,
)
from unsloth_jax.data.loader import DataLoader
from unsloth_jax.data.loading import load_records, validate_records
from unsloth_jax.data.packing import bucket_lengths, first_fit_decreasing, pick_bucket
from unsloth_jax.data.records import FORMATS, Records, detect_format
from unsloth_jax.data.response_only import (
    IGNORE_INDEX,
    completion_only_labels,
    response_only_labels,
    response_only_mask,
    train_on_responses_only,
)
from unsloth_jax.data.tokenize import build_examples, suggest_max_seq_length, tokenize_texts

__all__ = [
    "ALPACA_PROMPT",
    "ALPACA_PROMPT_NO_INPUT",
    "CHAT_TEMPLATE_NAMES",
    "FORMATS",
    "IGNORE_INDEX",
    "RESPONSE_PARTS",
    "STOP_TOKENS",
    "DataLoader",
    "Records",
    "alpaca_prompt",
    "bucket_lengths",
    "build_examples",
    "chat_template_string",
    "completion_only_labels",
    "detect_format",
    "first_fit_decreasing",
    "format_alpaca",
    "get_chat_template",
    "load_records",
    "pick_bucket",
    "prepare_texts",
    "prompt_completion_texts",
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
