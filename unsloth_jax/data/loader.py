"""Deterministic batching of tokenized examples, with optional packing."""
from __future__ import annotations

import logging
from typing import Iterator, Sequence

import numpy as np

from unsloth_jax.data.packing import bucket_lengths, first_fit_decreasing, pick_bucket
from unsloth_jax.data.response_only import IGNORE_INDEX

logger = logging.getLogger(__name__)


class DataLoader:
    """Batches of ``{"input_ids", "labels"}`` examples as numpy int32 arrays of shape [batch_size, S].

    ``loader.batch(epoch, index)`` is a pure function of (epoch, index) (and the constructor arguments), so a
    resumed run gets exactly the same batches. ``len(loader)`` is the number of batches per epoch.

    Each batch is a dict with:
      * ``input_ids``: token ids, ``pad_token_id`` on padding;
      * ``labels``: the example's labels, -100 on padding (and on the first token of every packed example);
      * ``attention_mask``: 1 on real tokens, 0 on padding;
      * ``segment_ids``: 1, 2, ... for the examples in a row (always 1 without packing), 0 on padding;
      * ``positions``: 0, 1, ... restarting at each packed example, 0 on padding.

    Without packing, examples (shuffled with ``seed`` and ``epoch`` when ``shuffle``) are taken ``batch_size``
    at a time and the batch is padded to ``S`` = the smallest bucket length that holds its longest example:
    powers of two from 64 below ``max_seq_length``, then ``max_seq_length`` (see :attr:`bucket_lengths`), so a
    jitted step compiles only a few shapes. With ``packing=True`` examples are packed once, greedily first-fit
    (longest first) into rows of ``max_seq_length`` tokens, S is always ``max_seq_length``, and the rows are
    shuffled per epoch. Labels of the first token of every packed example are -100: the loss compares
    logits[t] with labels[t + 1], so no token is predicted across an example boundary.

    The last batch is padded with empty rows (all padding, labels -100) to ``batch_size`` rows unless
    ``drop_last``, in which case it is dropped when incomplete. Examples longer than ``max_seq_length`` are
    truncated; empty examples are dropped.
    """

    def __init__(self, examples: Sequence[dict], batch_size: int, max_seq_length: int, pad_token_id: int,
                 packing: bool = False, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 min_bucket: int = 64):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if max_seq_length <= 0:
            raise ValueError(f"max_seq_length must be positive, got {max_seq_length}")
        if pad_token_id is None:
            raise ValueError("pad_token_id is None: the tokenizer has no pad token; pass e.g. "
                             "pad_token_id=tokenizer.eos_token_id")
        self.batch_size = int(batch_size)
        self.max_seq_length = int(max_seq_length)
        self.pad_token_id = int(pad_token_id)
        self.packing = bool(packing)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.bucket_lengths = (self.max_seq_length,) if packing else bucket_lengths(max_seq_length, min_bucket)
        self.epoch = 0  # used by __iter__; see set_epoch

        self._ids: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []
        truncated = dropped = 0
        for ex in examples:
            ids = np.asarray(ex["input_ids"], dtype=np.int32).reshape(-1)
            lab = np.asarray(ex.get("labels", ids), dtype=np.int32).reshape(-1)
            if lab.shape != ids.shape:
                raise ValueError(f"labels length {lab.shape[0]} differs from input_ids length {ids.shape[0]}")
            if len(ids) == 0:
                dropped += 1
                continue
            if len(ids) > self.max_seq_length:
                truncated += 1
                ids, lab = ids[:self.max_seq_length], lab[:self.max_seq_length]
            self._ids.append(ids)
            self._labels.append(lab)
        if truncated:
            logger.warning("DataLoader: truncated %d example(s) to max_seq_length=%d", truncated, self.max_seq_length)
        if dropped:
            logger.warning("DataLoader: dropped %d empty example(s)", dropped)
        self.lengths = np.array([len(x) for x in self._ids], dtype=np.int64)
        self.num_examples = len(self._ids)
        self.num_tokens = int(self.lengths.sum())
        if self.packing:
            self.rows = first_fit_decreasing(self.lengths, self.max_seq_length)
        else:
            self.rows = [[i] for i in range(self.num_examples)]
        self.num_rows = len(self.rows)
        self._perm_cache: dict[int, np.ndarray] = {}

    # ------------------------------------------------------------------------------------------- structure
    def __len__(self) -> int:
        if self.drop_last:
            return self.num_rows // self.batch_size
        return -(-self.num_rows // self.batch_size)

    @property
    def fill_ratio(self) -> float:
        """Real tokens / (rows * max_seq_length): how full packed rows are (1.0 = no padding)."""
        return self.num_tokens / max(1, self.num_rows * self.max_seq_length)

    @property
    def longest_bucket(self) -> int:
        """The largest padded length S any batch of this loader has (max_seq_length when packing)."""
        if self.packing:
            return self.max_seq_length
        return pick_bucket(max((int(n) for n in self.lengths), default=1), self.bucket_lengths)

    def order(self, epoch: int) -> np.ndarray:
        """The order of rows (examples when not packing) in ``epoch``: a permutation drawn from
        ``SeedSequence([seed, epoch])`` when shuffling, else 0..n-1."""
        if not self.shuffle:
            return np.arange(self.num_rows)
        perm = self._perm_cache.get(epoch)
        if perm is None:
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, int(epoch)]))
            perm = rng.permutation(self.num_rows)
            if len(self._perm_cache) > 4:
                self._perm_cache.clear()
            self._perm_cache[epoch] = perm
        return perm

    def batch_rows(self, epoch: int, index: int) -> list[list[int]]:
        """The example indices of each row of batch ``index`` in ``epoch`` (empty lists for padding rows)."""
        if not 0 <= index < len(self):
            raise IndexError(f"batch index {index} out of range for {len(self)} batches per epoch")
        sel = self.order(epoch)[index * self.batch_size:(index + 1) * self.batch_size]
        rows = [self.rows[r] for r in sel.tolist()]
        return rows + [[] for _ in range(self.batch_size - len(rows))]

    # --------------------------------------------------------------------------------------------- batches
    def batch(self, epoch: int, index: int, rows: slice | None = None) -> dict[str, np.ndarray]:
        """Batch ``index`` (0 <= index < len(self)) of ``epoch``: a dict of int32 arrays [batch_size, S].

        ``rows``: build only these rows of the batch (one host's share of a global batch on several hosts,
        see unsloth_jax.distributed.host_rows); S is still the whole batch's, so every host agrees on it."""
        every_row = self.batch_rows(epoch, index)
        if self.packing:
            S = self.max_seq_length
        else:
            longest = max((int(self.lengths[r[0]]) for r in every_row if r), default=1)
            S = pick_bucket(longest, self.bucket_lengths)
        rows = every_row if rows is None else every_row[rows]
        B = len(rows)
        out = {
            "input_ids": np.full((B, S), self.pad_token_id, dtype=np.int32),
            "labels": np.full((B, S), IGNORE_INDEX, dtype=np.int32),
            "attention_mask": np.zeros((B, S), dtype=np.int32),
            "segment_ids": np.zeros((B, S), dtype=np.int32),
            "positions": np.zeros((B, S), dtype=np.int32),
        }
        for b, row in enumerate(rows):
            pos = 0
            for seg, ex in enumerate(row, start=1):
                ids, lab = self._ids[ex], self._labels[ex]
                n = len(ids)
                sl = slice(pos, pos + n)
                out["input_ids"][b, sl] = ids
                out["labels"][b, sl] = lab
                if self.packing:
                    out["labels"][b, pos] = IGNORE_INDEX
                out["attention_mask"][b, sl] = 1
                out["segment_ids"][b, sl] = seg
                out["positions"][b, sl] = np.arange(n, dtype=np.int32)
                pos += n
        return out

    def epoch_batches(self, epoch: int, start: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """Batches ``start``, ``start + 1``, ... of ``epoch`` (resume mid-epoch with ``start``)."""
        for i in range(start, len(self)):
            yield self.batch(epoch, i)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch that ``iter(loader)`` yields."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self.epoch_batches(self.epoch)

    def __repr__(self) -> str:
        return (f"DataLoader(examples={self.num_examples}, rows={self.num_rows}, batches={len(self)}, "
                f"batch_size={self.batch_size}, max_seq_length={self.max_seq_length}, packing={self.packing}, "
                f"buckets={self.bucket_lengths})")
