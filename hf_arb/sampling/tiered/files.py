"""The tiered sampler's node-shared files: the tier columns and the ``random`` schedule's row groups.

At web scale the tier columns (int16 ``(T, n)``: 2 bytes per row and tier) and the grouped row indexes (4 bytes per
eligible row: one per tier for the step schedules, one by row group for ``random``) would cost every rank hundreds
of MB. Under ``index_dir`` each is written once per node to a ``.npy`` file named after the fingerprint of the rows'
sizes and tiers (atomically: a temporary name, then a rename; processes racing to write produce identical bytes)
and memory-mapped read-only by every process, so the node holds it once in its page cache and a restarted process
maps it instead of recomputing it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..planning.index import build_index, count_blocks, open_index
from .draw import GroupColumn, RowGroups, find_groups
from .plan import Tiers, tier_bucket_ids


def shared_tier_columns(widths: np.ndarray, heights: np.ndarray, tiers: Tiers, path: Path) -> np.ndarray:
    """:func:`~hf_arb.sampling.tiered.plan.tier_bucket_ids` as a read-only memory-mapped int16 ``(T, n)`` array at
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


def random_groups(tier_ids: np.ndarray, tiers: Tiers, folder: Path | None, fingerprint: str) -> RowGroups:
    """The ``random`` schedule's row groups (:mod:`~hf_arb.sampling.tiered.draw`): built once, in chunks.

    ``folder`` None: in memory (the group index, 4 bytes per eligible row). Else the group index is a shared file
    ``random-groups-<fingerprint>.npy`` with the groups' buckets and per-block counts beside it (``.meta.npz``);
    when both exist (another rank built them, or a restart) they are mapped, in milliseconds.
    """
    k = tiers.num_buckets
    path = None if folder is None else folder / f"random-groups-{fingerprint}.npy"
    meta = None if path is None else path.with_name(path.name.replace(".npy", ".meta.npz"))
    if meta is not None and meta.exists() and path.exists():
        try:
            with np.load(meta) as z:
                buckets, blocks = z["buckets"], z["blocks"]
            if (buckets.shape[1:] == (tiers.num_tiers,) and blocks.shape[1] == buckets.shape[0]
                    and np.load(path, mmap_mode="r").shape == (int(blocks.sum()),)):
                index = open_index(np.empty(0, np.int16), None, buckets.shape[0], blocks, path)
                return RowGroups(buckets, index, tiers.offsets)
        except (OSError, ValueError, KeyError):
            pass
    buckets = find_groups(tier_ids, k)  # (G, T)
    column = GroupColumn(tier_ids, buckets, k)
    blocks = count_blocks(column, buckets.shape[0])  # (H, G)
    index = build_index(column, None, buckets.shape[0], blocks, path=path)
    if meta is not None:
        tmp = meta.with_name(f"{meta.name}.{os.getpid()}.tmp.npz")
        np.savez(tmp, buckets=buckets, blocks=blocks)
        os.replace(tmp, meta)
    return RowGroups(buckets, index, tiers.offsets)


__all__ = ["random_groups", "shared_tier_columns"]
