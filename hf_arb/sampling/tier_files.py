"""The tiered sampler's node-shared files: the tier columns and the ``random`` schedule's per-epoch row index.

At web scale the tier columns (int16 ``(T, n)``: 2 bytes per row and tier) and the grouped row indexes (4 bytes per
eligible row) would cost every rank hundreds of MB. Under ``index_dir`` each is written once per node to a ``.npy``
file named after the fingerprint of the rows' sizes and tiers (atomically: a temporary name, then a rename;
processes racing to write produce identical bytes) and memory-mapped read-only by every process, so the node holds
it once in its page cache and a restarted process maps it instead of recomputing it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .index import RowIndex, build_index, count_blocks, open_index
from .tier_plan import Tiers, random_tier_ids, tier_bucket_ids


def shared_tier_columns(widths: np.ndarray, heights: np.ndarray, tiers: Tiers, path: Path) -> np.ndarray:
    """:func:`~hf_arb.sampling.tier_plan.tier_bucket_ids` as a read-only memory-mapped int16 ``(T, n)`` array at
    ``path``, computed (in chunks, straight into the file) only when no such file exists."""
    shape = (tiers.num_tiers, int(np.asarray(widths).size))
    if path.exists():
        try:
            arr = np.load(path, mmap_mode="r")
            if arr.shape == shape and arr.dtype == np.int16:
                return arr
        except (OSError, ValueError):
            pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    mm = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.int16, shape=shape)
    tier_bucket_ids(widths, heights, tiers, out=mm)
    mm.flush()
    del mm
    os.replace(tmp, path)
    return np.load(path, mmap_mode="r")


def random_epoch_index(tier_ids: np.ndarray, tiers: Tiers, seed: int, epoch: int, folder: Path | None,
                       fingerprint: str) -> RowIndex:
    """Rows grouped by the (tier, bucket) drawn for them in ``epoch`` (``random`` schedule): an ``O(rows)`` pass.

    ``folder`` None: in memory (2 + 4 bytes per row of temporaries and index). Else the draw goes through a
    temporary memory-mapped column and the index is a shared file with its per-block counts beside it
    (``.blocks.npy``); when both exist already (another rank drew this epoch, or a resume) they are mapped, in
    milliseconds.
    """
    K = int(tiers.offsets[-1])
    if folder is None:
        return build_index(random_tier_ids(tier_ids, tiers.offsets, seed, epoch), None, K)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"random-{fingerprint}-s{seed}-e{epoch}-k{K}.npy"
    counts = path.with_name(path.name.replace(".npy", ".blocks.npy"))  # (H, K) rows per block of 2^32 rows, pair
    if path.exists() and counts.exists():
        try:
            blocks = np.load(counts)
            if np.load(path, mmap_mode="r").shape == (int(blocks.sum()),):
                return open_index(np.empty(0, np.int16), None, K, blocks, path)
        except (OSError, ValueError):
            pass
    tmp = folder / f"draw-{fingerprint}-e{epoch}.{os.getpid()}.tmp.npy"
    comb = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.int16, shape=(tier_ids.shape[1],))
    try:
        random_tier_ids(tier_ids, tiers.offsets, seed, epoch, out=comb)
        blocks = count_blocks(comb, K)
        index = build_index(comb, None, K, blocks, path=path)
        tmp_counts = counts.with_name(f"{counts.name}.{os.getpid()}.tmp.npy")
        np.save(tmp_counts, blocks)
        os.replace(tmp_counts, counts)
        return index
    finally:
        del comb
        tmp.unlink(missing_ok=True)


__all__ = ["random_epoch_index", "shared_tier_columns"]
