"""Pre-tokenized records (`{"input_ids": [...]}`, optionally `labels` and `attention_mask`), checked.

    examples = pretokenized_examples(records, vocab_size=model.config.vocab_size)

Each record trains as given: `labels` default to a copy of `input_ids` (HF's causal-LM convention: aligned with
the inputs, the loss shifts them, so position t predicts labels[t + 1]; -100 marks tokens that do not count).
Tokens whose `attention_mask` is 0 are padding and are dropped (with their labels). Every problem raises
DatasetFormatError naming the record: ids that are not integers, ids outside [0, vocab_size), labels that are
neither -100 nor a valid id, lengths that differ, a mask that is not 0/1.
"""
from __future__ import annotations

import numbers
from typing import Sequence

from unsloth_jax.data.response_only import IGNORE_INDEX
from unsloth_jax.errors import DatasetFormatError

def _int_list(record_index: int, field: str, value) -> list[int]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise DatasetFormatError(f"record {record_index}: '{field}' must be a list of token ids, got "
                                 f"{type(value).__name__}")
    out = []
    for pos, x in enumerate(value):
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise DatasetFormatError(f"record {record_index}: '{field}'[{pos}] = {x!r} is not an integer")
        out.append(int(x))
    return out


def is_pretokenized(records: Sequence[dict]) -> bool:
    """True when the first record carries `input_ids` (the whole dataset is then taken as pre-tokenized)."""
    return bool(records) and isinstance(records[0], dict) and "input_ids" in records[0]


def pretokenized_examples(records: Sequence[dict], vocab_size: int) -> list[dict]:
    """`{"input_ids", "labels"}` examples from pre-tokenized records, validated against `vocab_size`."""
    examples = []
    for i, rec in enumerate(records):
        if not isinstance(rec, dict) or "input_ids" not in rec:
            raise DatasetFormatError(f"record {i}: no 'input_ids' (the first record is pre-tokenized, so every "
                                     "record must be)")
        ids = _int_list(i, "input_ids", rec["input_ids"])
        bad = [x for x in ids if not 0 <= x < vocab_size]
        if bad:
            raise DatasetFormatError(f"record {i}: input_ids {bad[:5]} are outside the model's vocabulary "
                                     f"[0, {vocab_size})")
        labels = ids if rec.get("labels") is None else _int_list(i, "labels", rec["labels"])
        bad = [x for x in labels if x != IGNORE_INDEX and not 0 <= x < vocab_size]
        if bad:
            raise DatasetFormatError(f"record {i}: labels {bad[:5]} are neither {IGNORE_INDEX} nor in [0, {vocab_size})")
        if len(labels) != len(ids):
            raise DatasetFormatError(f"record {i}: {len(labels)} labels for {len(ids)} input_ids")
        if rec.get("attention_mask") is not None:
            mask = _int_list(i, "attention_mask", rec["attention_mask"])
            if len(mask) != len(ids) or any(m not in (0, 1) for m in mask):
                raise DatasetFormatError(f"record {i}: attention_mask must be 0/1 with one entry per input id")
            ids = [x for x, m in zip(ids, mask) if m]
            labels = [y for y, m in zip(labels, mask) if m]
        examples.append({"input_ids": ids, "labels": list(labels)})
    return examples


__all__ = ["is_pretokenized", "pretokenized_examples"]
