"""Sequence-length buckets and first-fit packing of examples into fixed-length rows."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def bucket_lengths(max_seq_length: int, min_bucket: int = 64) -> tuple[int, ...]:
    """The padded lengths a batch can have: powers of two from ``min_bucket`` below ``max_seq_length``, then
    ``max_seq_length`` itself. E.g. max 1000 -> (64, 128, 256, 512, 1000); max 48 -> (48,).

    A jitted train step therefore compiles at most ``log2(max_seq_length / min_bucket) + 2`` shapes.
    """
    if max_seq_length <= 0:
        raise ValueError(f"max_seq_length must be positive, got {max_seq_length}")
    out, b = [], int(min_bucket)
    while b < max_seq_length:
        out.append(b)
        b *= 2
    out.append(int(max_seq_length))
    return tuple(out)


def pick_bucket(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= length (the largest bucket when length exceeds them all)."""
    for b in buckets:
        if b >= length:
            return int(b)
    return int(buckets[-1])


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Greedy first-fit packing of items (taken longest first, ties in index order) into rows of
    ``capacity`` tokens. Returns rows as lists of item indices, in the order the items were placed.

    Runs in O(n log n) with a max segment tree over the rows' free space (unopened rows are all free, so the
    leftmost row that fits is an open one when any fits, else the next new row).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    if n == 0:
        return []
    if lengths.min() < 1 or lengths.max() > capacity:
        raise ValueError(f"item lengths must be in [1, {capacity}]")
    order = np.argsort(-lengths, kind="stable")
    size = 1
    while size < n:
        size *= 2
    tree = [0] * (2 * size)
    for i in range(n):
        tree[size + i] = capacity
    for i in range(size - 1, 0, -1):
        tree[i] = max(tree[2 * i], tree[2 * i + 1])
    rows: list[list[int]] = []
    for idx in order.tolist():
        need = int(lengths[idx])
        node = 1
        while node < size:  # descend to the leftmost leaf with free space >= need
            node = 2 * node if tree[2 * node] >= need else 2 * node + 1
        row = node - size
        if row == len(rows):
            rows.append([])
        rows[row].append(idx)
        tree[node] -= need
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return rows
