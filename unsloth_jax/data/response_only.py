"""Loss on assistant turns only ("train on responses only"), and on the completion of prompt-completion
records (:func:`completion_only_labels`).

Two ways to find the assistant turns:

* :func:`response_only_labels` matches the markers' token ids. It is exact and fast but only finds a marker
  whose tokenization inside the text equals the given ids; a BPE can tokenize a marker differently in context
  (e.g. "\\n\\n" followed by text may split into two "\\n" tokens), so ids alone can miss markers.
* :func:`train_on_responses_only` (what trainers use) matches the marker *strings* in the decoded text: each
  example is decoded, re-encoded with character offsets (fast tokenizers), and every token that overlaps the
  text after a response marker and before the next instruction marker is kept. This does not depend on how the
  markers tokenize. Where re-encoding does not reproduce an example's ids (non-fast tokenizers, or a tokenizer
  whose decode is lossy), or the decoded text does not contain the response marker (normalizing tokenizers:
  a lowercasing one decodes "### Response:" as "### response:", WordPiece drops newlines), that example falls
  back to id matching with the marker ids and their variant without trailing whitespace.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from unsloth_jax.errors import DatasetFormatError

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100


def _as_alternatives(marker: Any) -> list[tuple[int, ...]]:
    """A marker given as one id sequence or as a list of alternative id sequences."""
    if marker is None:
        return []
    marker = list(marker)
    if not marker:
        return []
    if isinstance(marker[0], (int, np.integer)):
        return [tuple(int(t) for t in marker)]
    alts = [tuple(int(t) for t in m) for m in marker if len(m)]
    return sorted(set(alts), key=len, reverse=True)  # longest first


def _match_at(ids: list[int], i: int, alternatives: list[tuple[int, ...]]) -> int:
    for alt in alternatives:
        if tuple(ids[i:i + len(alt)]) == alt:
            return len(alt)
    return 0


def response_only_mask(input_ids: Sequence[int], instruction_ids: Any, response_ids: Any) -> np.ndarray:
    """Boolean mask (True = keep in the loss) by token-id matching; see :func:`response_only_labels`."""
    ids = [int(t) for t in input_ids]
    instr = _as_alternatives(instruction_ids)
    resp = _as_alternatives(response_ids)
    if not resp:
        raise ValueError("response_ids must be a non-empty token id sequence")
    first_tokens = {a[0] for a in instr} | {a[0] for a in resp}
    mask = np.zeros(len(ids), dtype=bool)
    inside = False
    i = 0
    while i < len(ids):
        if ids[i] in first_tokens:
            n = _match_at(ids, i, resp)
            if n:
                inside = True
                i += n
                continue
            n = _match_at(ids, i, instr)
            if n:
                inside = False
                i += n
                continue
        mask[i] = inside
        i += 1
    return mask


def response_only_labels(input_ids: Sequence[int], instruction_ids: Any, response_ids: Any,
                         labels: Sequence[int] | None = None):
    """Labels with the loss only on assistant turns, by token-id matching.

    Every token after a response marker (``response_ids``) up to the next instruction marker
    (``instruction_ids``) keeps its label; everything else, markers included, becomes -100. Each marker is a
    sequence of token ids, or a list of alternative sequences (e.g. the ids of the marker in several
    contexts). ``instruction_ids`` may be None/empty: then every token after a response marker is kept.
    ``labels`` defaults to ``input_ids``; labels that are already -100 stay -100. Returns a numpy int array
    when ``input_ids`` is one, else a list of ints.

    Limitation: a marker is found only where its ids occur literally; see the module docstring, and
    :func:`train_on_responses_only`, which matches text instead.
    """
    mask = response_only_mask(input_ids, instruction_ids, response_ids)
    base = np.asarray(input_ids if labels is None else labels, dtype=np.int64)
    out = np.where(mask, base, IGNORE_INDEX)
    if isinstance(input_ids, np.ndarray):
        return out.astype(input_ids.dtype)
    return [int(x) for x in out]


def completion_only_labels(input_ids: Sequence[int], prompt_ids: Sequence[int],
                           labels: Sequence[int] | None = None):
    """Labels with the loss on the completion only (TRL's completion_only_loss): the tokens of ``input_ids``
    (prompt + completion, [S] ints) that the prompt's own tokenization ``prompt_ids`` shares as a prefix become
    -100, the rest keep their label.

    Where a token merges the prompt's end with the completion's start, the shared prefix stops before it, so
    that token is trained (it carries completion text). ``labels`` defaults to ``input_ids``; labels already
    -100 stay -100. Returns a numpy array of input_ids' dtype when ``input_ids`` is one, else a list of ints.
    """
    n = 0
    for a, b in zip(input_ids, prompt_ids):
        if int(a) != int(b):
            break
        n += 1
    base = np.asarray(input_ids if labels is None else labels, dtype=np.int64).copy()
    base[:n] = IGNORE_INDEX
    if isinstance(input_ids, np.ndarray):
        return base.astype(input_ids.dtype)
    return [int(x) for x in base]


# ------------------------------------------------------------------------------------------- text matching
def _find_all(text: str, part: str) -> list[int]:
    out, start = [], text.find(part)
    while start != -1:
        out.append(start)
        start = text.find(part, start + len(part))
    return out


def _char_regions(text: str, instruction_part: str | None, response_part: str) -> list[tuple[int, int]]:
    """[start, end) character spans of assistant text: after each response marker up to the next
    instruction marker (or the end)."""
    events = [(p, 1, p + len(response_part)) for p in _find_all(text, response_part)]
    if instruction_part:
        events += [(p, 0, p + len(instruction_part)) for p in _find_all(text, instruction_part)]
    events.sort()
    regions, open_at, last_end = [], None, -1
    for pos, kind, end in events:
        if pos < last_end:  # overlaps a marker already consumed
            continue
        if open_at is not None:
            regions.append((open_at, pos))
            open_at = None
        if kind == 1:
            open_at = end
        last_end = end
    if open_at is not None:
        regions.append((open_at, len(text)))
    return [(a, b) for a, b in regions if b > a]


def _mask_from_offsets(offsets: np.ndarray, regions: list[tuple[int, int]]) -> np.ndarray:
    """Tokens holding any character of a region (a token that straddles the end of a response marker, such
    as " Paris" after "Answer: ", is kept: it carries response text)."""
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(starts), dtype=bool)
    for a, b in regions:
        mask |= (ends > a) & (starts < b)
    return mask


def _text_masks(tokenizer: Any, id_lists: list[list[int]], instruction_part: str | None,
                response_part: str) -> list[np.ndarray | None]:
    """Per example: the mask from text matching, or None where re-encoding does not reproduce the ids or the
    decoded text does not contain ``response_part``."""
    if not getattr(tokenizer, "is_fast", False):
        return [None] * len(id_lists)
    texts = tokenizer.batch_decode(id_lists, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    out: list[np.ndarray | None] = []
    for ids, text, re_ids, offs in zip(id_lists, texts, enc["input_ids"], enc["offset_mapping"]):
        n = len(ids)
        common = 0
        for a, b in zip(ids, re_ids):
            if a != b:
                break
            common += 1
        # A lossy tail (e.g. a multi-byte character cut by truncation) is tolerated; anything else falls back.
        if n and common < max(1, n - 4):
            out.append(None)
            continue
        if response_part not in text:  # a normalizing decode (lowercase, spacing) can hide the marker text
            out.append(None)
            continue
        regions = _char_regions(text, instruction_part, response_part)
        mask = np.zeros(n, dtype=bool)
        if common:
            mask[:common] = _mask_from_offsets(np.asarray(offs[:common], dtype=np.int64).reshape(-1, 2), regions)
        if common < n:  # tail tokens inherit the state at the end of the text
            mask[common:] = bool(regions) and regions[-1][1] == len(text)
        out.append(mask)
    return out


def _marker_id_variants(tokenizer: Any, part: str | None) -> list[list[int]]:
    if not part:
        return []
    variants = [tokenizer(part, add_special_tokens=False)["input_ids"]]
    if part.rstrip() != part and part.rstrip():
        variants.append(tokenizer(part.rstrip(), add_special_tokens=False)["input_ids"])
    return [list(v) for v in variants if len(v)]


def apply_response_only(examples: list[dict], tokenizer: Any, instruction_part: str | None,
                        response_part: str) -> tuple[int, int]:
    """Rewrite ``examples[i]["labels"]`` in place (see :func:`train_on_responses_only`).

    Returns (number of examples left without any trained token, number that used the id-matching fallback).
    """
    if not examples:
        return 0, 0
    id_lists = [[int(t) for t in ex["input_ids"]] for ex in examples]
    masks = _text_masks(tokenizer, id_lists, instruction_part, response_part)
    instr_v = _marker_id_variants(tokenizer, instruction_part)
    resp_v = _marker_id_variants(tokenizer, response_part)
    empty = fallback = 0
    for ex, ids, mask in zip(examples, id_lists, masks):
        if mask is None:
            fallback += 1
            mask = response_only_mask(ids, instr_v, resp_v)
        orig = ex.get("labels")
        labels = np.asarray(ids if orig is None else orig, dtype=np.int64)
        new = np.where(mask, labels, IGNORE_INDEX)
        if not np.any(new != IGNORE_INDEX):
            empty += 1
        ex["labels"] = new.astype(orig.dtype) if isinstance(orig, np.ndarray) else new.tolist()
    return empty, fallback


def train_on_responses_only(trainer: Any, instruction_part: str | None = "<|im_start|>user\n",
                            response_part: str = "<|im_start|>assistant\n", tokenizer: Any = None) -> Any:
    """Mask every label outside assistant turns to -100, as Unsloth's function of the same name.

    Uses ``trainer.tokenizer`` (or ``tokenizer``) and rewrites ``trainer.train_examples`` (a list of
    ``{"input_ids", "labels"}`` dicts) and ``trainer.eval_examples`` (if not None) in place; returns the trainer.
    The trained span of a turn starts right after ``response_part`` and runs to the next ``instruction_part``
    (so the end-of-turn token is learned). Markers are matched as text (see the module docstring), so a marker
    that tokenizes differently in context is still found. Markers per template are in
    :data:`unsloth_jax.data.RESPONSE_PARTS` (e.g. ``RESPONSE_PARTS["llama-3.1"]``).

    Logs a warning with the count of examples left without any trained token; raises DatasetFormatError when
    that is every example (the response marker never occurs). A trainer with an UnslothVisionDataCollator gets
    the markers set on its collator instead, which masks each batch as it collates it.
    """
    if not response_part:
        raise ValueError("response_part must be a non-empty string")
    collator = getattr(trainer, "data_collator", None)
    if collator is not None and hasattr(collator, "train_on_responses_only"):
        # vision records are collated per batch: the collator masks them (unsloth_jax.data.vision)
        collator.train_on_responses_only = True
        collator.instruction_part, collator.response_part = instruction_part, response_part
        return trainer
    tok = tokenizer if tokenizer is not None else getattr(trainer, "tokenizer", None)
    if tok is None:
        tok = getattr(trainer, "processing_class", None)
    if tok is None:
        raise ValueError("train_on_responses_only needs trainer.tokenizer (or pass tokenizer=)")
    for attr in ("train_examples", "eval_examples"):
        examples = getattr(trainer, attr, None)
        if examples is None:
            continue
        empty, fallback = apply_response_only(examples, tok, instruction_part, response_part)
        if fallback:
            logger.info("train_on_responses_only: %d %s used token-id matching (re-encoding differed, or the "
                        "decoded text lacks the marker text)", fallback, attr)
        cut = _cut_by_truncation(examples) if empty else []
        limit = getattr(trainer, "max_seq_length", None)
        if examples and empty == len(examples):
            if cut:
                raise DatasetFormatError(
                    f"train_on_responses_only: no {attr} example has a response token left: {len(cut)} of them were "
                    f"cut by truncation to max_seq_length={limit} before or inside their response ("
                    f"{_first_cut(examples, cut)}), so nothing would be trained; raise max_seq_length (the longest "
                    f"example is {max(examples[i]['untruncated_length'] for i in cut)} tokens)")
            raise DatasetFormatError(
                f"train_on_responses_only: no {attr} example contains the response marker {response_part!r}, so "
                "nothing would be trained; check instruction_part/response_part against the chat template")
        if empty:
            why = (f"{len(cut)} of them were cut by truncation to max_seq_length={limit} before their response "
                   f"({_first_cut(examples, cut)}; raise max_seq_length to keep them)" if cut else
                   f"the response marker {response_part!r} is not in them")
            if cut and len(cut) < empty:
                why += f", {empty - len(cut)} lack the response marker {response_part!r}"
            logger.warning("train_on_responses_only: %d of %d %s have no response tokens left: %s; they add nothing "
                           "to the loss", empty, len(examples), attr, why)
    return trainer


def _cut_by_truncation(examples: list[dict]) -> list[int]:
    """Indices of the examples left without a trained token that tokenization truncated (they carry
    "untruncated_length", unsloth_jax.data.tokenize.tokenize_texts)."""
    return [i for i, ex in enumerate(examples) if "untruncated_length" in ex
            and not np.any(np.asarray(ex["labels"]) != IGNORE_INDEX)]


def _first_cut(examples: list[dict], cut: list[int]) -> str:
    i = cut[0]
    return f"record {i} is {examples[i]['untruncated_length']} tokens"
