"""The bucket-grouped row index: 4 bytes per row, built in ``O(chunk)`` memory, shareable as a memory-mapped file.

A synchronised plan needs, for bucket ``b`` and position ``q`` of its permutation, the ``q``-th row of ``b`` in
ascending row order. :class:`RowIndex` answers that from one ``uint32`` array holding every assigned row, grouped
by (effective) bucket and ascending inside a bucket — its *low* 32 bits only. Rows of a bucket ascend, so their
high bits ``row >> 32`` are non-decreasing along the bucket's group: a table of ``H = ceil(n / 2^32)`` counts per
bucket (how many of the bucket's rows lie in each block of ``2^32`` rows) recovers them with one
``searchsorted``. That keeps the index at 4 bytes per row with int64 row ids and no ``2^31`` cap.

Everything is built from the bucket ids in chunks of :data:`CHUNK` rows (a few tens of MB of temporaries,
whatever ``n``): :func:`count_blocks` counts rows per (row block, bucket), :func:`build_index` fills the array —
in memory, or straight into a ``.npy`` file that every process on the node then maps read-only
(:func:`open_index`), so the index exists once per node, in the page cache, not once per rank.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CHUNK = 1 << 18  # rows per chunk of the O(n) passes (bounds their temporaries at ~10 MB)
LOW_BITS = 32  # bits of a row id stored in the index; the rest come from the per-bucket block counts


@dataclass
class RowIndex:
    """Rows grouped by effective bucket, 4 bytes per row.

    Attributes:
        low: uint32 ``(n_valid,)``, in memory or a read-only ``np.memmap``: ``row & (2^low_bits - 1)`` of every
            assigned row, grouped by bucket, ascending inside a group.
        start: int64 ``(k,)``, first position of each bucket in ``low``.
        count: int64 ``(k,)``, rows per bucket.
        block_ends: int64 ``(k, H)``: ``block_ends[b, h]`` is how many of bucket ``b``'s rows are below
            ``(h + 1) · 2^low_bits``; None when every row id is below ``2^low_bits`` (``H = 1``).
        low_bits: bits of a row id held in ``low``.
    """

    low: np.ndarray
    start: np.ndarray
    count: np.ndarray
    block_ends: np.ndarray | None
    low_bits: int = LOW_BITS

    def rows(self, bucket: int, q: np.ndarray) -> np.ndarray:
        """Rows at positions ``q`` (int array of any shape, in ``[0, count[bucket])``) of ``bucket``: int64."""
        out = self.low[self.start[bucket] + q].astype(np.int64)
        if self.block_ends is not None:
            high = np.searchsorted(self.block_ends[bucket], q, side="right")
            out |= high.astype(np.int64) << self.low_bits
        return out


def _chunks(n: int, block: int) -> list[tuple[int, int]]:
    """``[c0, c1)`` ranges of at most :data:`CHUNK` rows that never straddle a block of ``block`` rows."""
    step = min(CHUNK, block)
    return [(c0, min(n, c0 + step, (c0 // block + 1) * block)) for c0 in range(0, n, step)]


def count_blocks(ids: np.ndarray, k: int, low_bits: int = LOW_BITS) -> np.ndarray:
    """Rows per (block of ``2^low_bits`` rows, bucket): int64 ``(H, k)``, ``H = max(1, ceil(n / 2^low_bits))``.

    ``ids``: integer bucket ids, shape ``(n,)`` (``-1`` rows not counted), any integer dtype; read in chunks.
    """
    block = 1 << low_bits
    out = np.zeros((max(1, -(-ids.size // block)), k), dtype=np.int64)
    for c0, c1 in _chunks(ids.size, block):
        chunk = ids[c0:c1].astype(np.intp) + 1  # -1 -> 0
        out[c0 // block] += np.bincount(chunk, minlength=k + 1)[1 : k + 1]
    return out


def merge_blocks(blocks: np.ndarray, merge_map: np.ndarray | None, k: int) -> np.ndarray:
    """Per-block counts of the *effective* buckets ``(H, k)`` from those of the original buckets ``(H, k0)``."""
    if merge_map is None:
        out = np.zeros((blocks.shape[0], k), dtype=np.int64)
        out[:, : blocks.shape[1]] = blocks
        return out
    out = np.zeros((k, blocks.shape[0]), dtype=np.int64)
    np.add.at(out, np.asarray(merge_map, dtype=np.int64)[: blocks.shape[1]], blocks.T)
    return out.T.copy()


def _lookup(merge_map: np.ndarray | None, k0: int) -> np.ndarray:
    """``table[id + 1]`` = effective bucket of ``id`` (``-1`` stays ``-1``), int16 ``(k0 + 1,)``: numpy sorts
    16-bit keys with a radix sort (twice as fast as the merge sort it uses for wider ones)."""
    mm = np.arange(k0) if merge_map is None else np.asarray(merge_map, dtype=np.int64)[:k0]
    return np.concatenate([[-1], mm]).astype(np.int16)


def _fill(ids: np.ndarray, table: np.ndarray, start: np.ndarray, low_bits: int, out: np.ndarray) -> None:
    """Write every assigned row's low bits into ``out`` at its grouped position (chunked, stable)."""
    cursor = start.copy()  # (k,) next free position of each bucket
    k, mask = start.size, (1 << low_bits) - 1
    for c0, c1 in _chunks(ids.size, CHUNK):
        eff = table[ids[c0:c1].astype(np.intp) + 1]  # (m,) effective bucket, -1 = skipped
        order = np.argsort(eff, kind="stable")  # radix sort of small ints: rows of a bucket stay ascending
        eff_sorted = eff[order]
        skip = int(np.searchsorted(eff_sorted, 0))  # the -1 rows sort first
        order, eff_sorted = order[skip:], eff_sorted[skip:]
        counts = np.bincount(eff_sorted, minlength=k)  # (k,)
        first = np.concatenate([[0], np.cumsum(counts)[:-1]])  # (k,) first index of each bucket in the chunk
        dest = cursor[eff_sorted] + (np.arange(order.size) - first[eff_sorted])
        out[dest] = ((order + c0) & mask).astype(np.uint32)
        cursor += counts


def _empty_index(eff_blocks: np.ndarray, low_bits: int) -> RowIndex:
    """Start, count and block table from per-block effective counts ``(H, k)``; ``low`` still empty."""
    count = eff_blocks.sum(axis=0)  # (k,)
    start = np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int64)
    block_ends = np.cumsum(eff_blocks, axis=0).T.copy() if eff_blocks.shape[0] > 1 else None  # (k, H)
    return RowIndex(low=np.empty(0, np.uint32), start=start, count=count, block_ends=block_ends, low_bits=low_bits)


def build_index(ids: np.ndarray, merge_map: np.ndarray | None, k: int, blocks: np.ndarray | None = None, *,
                path: str | os.PathLike | None = None, low_bits: int = LOW_BITS) -> RowIndex:
    """Group the assigned rows by effective bucket.

    Args:
        ids: bucket id per row, shape ``(n,)``, any integer dtype (``-1`` = never sampled).
        merge_map: optional int array ``(k0,)``: rows of bucket ``b`` belong to bucket ``merge_map[b]``.
        k: number of effective buckets (``>`` every effective id).
        blocks: :func:`count_blocks` of ``ids`` (computed when None).
        path: write the grouped array to this ``.npy`` file (atomically: a temporary name, then a rename) and
            return it memory-mapped read-only; None keeps it in memory.
        low_bits: bits of a row id stored per row (32; smaller only to test the high-bit recovery).
    """
    if blocks is None:
        blocks = count_blocks(ids, int(ids.max()) + 1 if ids.size else 0, low_bits)
    empty = _empty_index(merge_blocks(blocks, merge_map, k), low_bits)
    n_valid, start = int(empty.count.sum()), empty.start
    table = _lookup(merge_map, blocks.shape[1])
    if path is None:
        low = np.empty(n_valid, dtype=np.uint32)
        _fill(ids, table, start, low_bits, low)
    else:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
        mm = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint32, shape=(n_valid,))
        _fill(ids, table, start, low_bits, mm)
        mm.flush()
        del mm
        os.replace(tmp, path)  # ranks racing to build the same index write identical bytes: last rename wins
        low = np.load(path, mmap_mode="r")
    empty.low = low
    return empty


def open_index(ids: np.ndarray, merge_map: np.ndarray | None, k: int, blocks: np.ndarray,
               path: str | os.PathLike) -> RowIndex:
    """Map the index at ``path`` read-only if it exists with the expected size, else build it there first.

    The name should identify the input (the sampler uses the fingerprint of the bucket ids and merge map), so
    that an existing file is the index of these ids.
    """
    path = Path(path)
    index = _empty_index(merge_blocks(blocks, merge_map, k), LOW_BITS)
    if path.exists():
        try:
            low = np.load(path, mmap_mode="r")
        except (OSError, ValueError):
            low = None
        if low is not None and low.dtype == np.uint32 and low.shape == (int(index.count.sum()),):
            index.low = low
            return index
    return build_index(ids, merge_map, k, blocks, path=path)


__all__ = ["CHUNK", "LOW_BITS", "RowIndex", "build_index", "count_blocks", "merge_blocks", "open_index"]
