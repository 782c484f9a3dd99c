"""Tokenizing training texts, and choosing a max_seq_length from the data."""
from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import numpy as np

from unsloth_jax.data.formats import prepare_texts, prompt_completion_texts
from unsloth_jax.data.records import detect_format
from unsloth_jax.data.response_only import completion_only_labels

logger = logging.getLogger(__name__)

_CHUNK = 1024  # texts per tokenizer call


def encode_texts(texts: Sequence[str], tokenizer: Any) -> list[list[int]]:
    """Token ids of each text with the tokenizer's own special tokens (its BOS); a BOS doubled because the
    text already starts with the BOS string (chat templates such as llama-3.1 / gemma write it) is dropped."""
    bos_id = getattr(tokenizer, "bos_token_id", None)
    bos = getattr(tokenizer, "bos_token", None)
    out: list[list[int]] = []
    for start in range(0, len(texts), _CHUNK):
        chunk = list(texts[start:start + _CHUNK])
        ids_list = tokenizer(chunk, add_special_tokens=True)["input_ids"]
        for text, ids in zip(chunk, ids_list):
            ids = list(ids)
            if (bos_id is not None and bos and len(ids) >= 2 and ids[0] == bos_id and ids[1] == bos_id
                    and text.startswith(bos)):
                ids = ids[1:]
            out.append(ids)
    return out


def tokenize_texts(texts: Sequence[str], tokenizer: Any, max_seq_length: int, add_eos: bool = False) -> list[dict]:
    """Tokenize training texts into examples ``{"input_ids": list[int], "labels": list[int]}``.

    BOS is added the way the tokenizer adds it (``add_special_tokens=True``), but not twice when the text
    already begins with the BOS string. ``add_eos=True`` appends ``tokenizer.eos_token_id`` unless the ids
    already end with it. Sequences are then truncated to ``max_seq_length`` (the number truncated is logged once,
    with the longest); a truncated example also carries ``"untruncated_length"`` (its length before the cut), so
    train_on_responses_only can say that truncation removed a response.
    ``labels`` is a copy of ``input_ids`` (the loss shifts them; mask with train_on_responses_only).
    """
    if max_seq_length <= 0:
        raise ValueError(f"max_seq_length must be positive, got {max_seq_length}")
    if isinstance(texts, str):
        texts = [texts]
    eos_id = getattr(tokenizer, "eos_token_id", None)
    if add_eos and eos_id is None:
        raise ValueError("add_eos=True but the tokenizer has no eos_token_id")
    examples, truncated, longest = [], 0, 0
    for ids in encode_texts(texts, tokenizer):
        if add_eos and (not ids or ids[-1] != eos_id):
            ids.append(eos_id)
        example = {}
        if len(ids) > max_seq_length:
            truncated += 1
            longest = max(longest, len(ids))
            example["untruncated_length"] = len(ids)
            ids = ids[:max_seq_length]
        examples.append({"input_ids": ids, "labels": list(ids), **example})
    if truncated:
        logger.warning("tokenize_texts: %d of %d texts were longer than max_seq_length=%d and were truncated (the "
                       "longest is %d tokens; raise max_seq_length to keep them whole)", truncated, len(examples),
                       max_seq_length, longest)
    return examples


def suggest_max_seq_length(examples_or_texts: Sequence[Any], tokenizer: Any = None, quantile: float = 0.99,
                           multiple_of: int = 64, cap: int | None = None) -> int:
    """A max_seq_length that covers ``quantile`` of the data, rounded up to a multiple of ``multiple_of``.

    ``examples_or_texts``: tokenized examples (dicts with ``input_ids``), id sequences, or strings (then
    ``tokenizer`` is required and BOS counts as :func:`tokenize_texts` adds it). The result is at least
    ``multiple_of`` and at most ``cap`` (when given).
    """
    if not 0.0 < quantile <= 1.0:
        raise ValueError(f"quantile must be in (0, 1], got {quantile}")
    if multiple_of <= 0:
        raise ValueError(f"multiple_of must be positive, got {multiple_of}")
    items = list(examples_or_texts)
    if not items:
        raise ValueError("suggest_max_seq_length needs at least one example or text")
    if isinstance(items[0], str):
        if tokenizer is None:
            raise ValueError("suggest_max_seq_length got texts: pass the tokenizer to measure them")
        lengths = [len(ids) for ids in encode_texts(items, tokenizer)]
    else:
        lengths = [len(x["input_ids"]) if isinstance(x, dict) else len(x) for x in items]
    q = float(np.quantile(np.asarray(lengths, dtype=np.float64), quantile, method="higher"))
    value = max(multiple_of, int(math.ceil(q / multiple_of)) * multiple_of)
    if cap is not None:
        value = min(value, int(cap))
    return int(value)


def mask_prompts(examples: list[dict], records: Sequence[dict], tokenizer: Any,
                 dataset_text_field: str = "text") -> int:
    """Set the labels of each prompt-completion record's prompt tokens to -100, in place.

    ``examples[i]`` must be the tokenization of ``records[i]``'s text (as :func:`build_examples` makes them
    without a formatting_func). The prompt is tokenized alone the way :func:`tokenize_texts` tokenizes texts
    and the tokens it shares as a prefix are masked (:func:`completion_only_labels`). Returns how many examples
    had a prompt whose tokens are not a prefix of the whole text's (a merge at the boundary; logged).
    """
    picked = [i for i, rec in enumerate(records) if detect_format(rec, dataset_text_field) == "prompt_completion"]
    if not picked:
        return 0
    prompts = [prompt_completion_texts(records[i], tokenizer)[0] for i in picked]
    merged = 0
    for i, prompt_ids in zip(picked, encode_texts(prompts, tokenizer)):
        ex = examples[i]
        ids = ex["input_ids"]
        if list(ids[:len(prompt_ids)]) != list(prompt_ids) and len(ids) > len(prompt_ids):
            merged += 1
        ex["labels"] = completion_only_labels(ids, prompt_ids, ex["labels"])
    if merged:
        logger.warning("%d of %d prompt-completion examples tokenize the prompt differently alone than before "
                       "its completion; their loss starts at the first token that differs", merged, len(picked))
    return merged


def build_examples(records: Sequence[dict], tokenizer: Any, max_seq_length: int, dataset_text_field: str = "text",
                   formatting_func: Any = None, add_eos: bool = False, completion_only_loss: bool = True) -> list[dict]:
    """:func:`prepare_texts` then :func:`tokenize_texts`: records -> ``{"input_ids", "labels"}`` examples.

    With ``completion_only_loss`` (the default, as TRL's SFTTrainer) and no ``formatting_func``, the prompt
    tokens of prompt-completion records get label -100 (:func:`mask_prompts`); other records are unchanged.
    """
    texts = prepare_texts(records, tokenizer, dataset_text_field=dataset_text_field, formatting_func=formatting_func)
    examples = tokenize_texts(texts, tokenizer, max_seq_length, add_eos=add_eos)
    if completion_only_loss and formatting_func is None:
        mask_prompts(examples, records, tokenizer, dataset_text_field)
    return examples
