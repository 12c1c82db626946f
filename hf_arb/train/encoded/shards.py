"""The shards of an encoded dataset: which entries each holds, atomic Parquet writes, and the check that tells a
finished shard from a missing or damaged one (an interrupted encode resumes by shard).

A shard is complete when its file opens (Parquet footer intact: a truncated file has none), holds the rows its
slice says, and (``full=True``) every page's CRC checks out (pages are written with checksums). Files are written
to a temporary name in the same folder and renamed, so a killed writer never leaves a shard that looks finished.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

#: the tables of an encoded dataset (``datasets`` configs), each a folder of shards under ``data/``
TABLES = ("latents", "prompts", "rows")


def shard_slices(n: int, size: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` covering ``0..n`` in pieces of ``size`` (the last one shorter); one empty shard
    for ``n == 0`` so every table has a file."""
    if size < 1:
        raise ValueError(f"shard size must be >= 1, got {size}.")
    return [(s, min(s + size, n)) for s in range(0, n, size)] or [(0, 0)]


def rank_shards(count: int, rank: int, world: int) -> list[int]:
    """The shards rank ``rank`` of ``world`` writes: ``i % world == rank`` (ranks never disagree, whoever resumes)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world) = [0, {world}), got {rank}.")
    return list(range(rank, count, world))


def shard_path(root: str | os.PathLike, table: str, i: int, count: int) -> Path:
    return Path(root) / "data" / table / f"{table}-{i:05d}-of-{count:05d}.parquet"


def shard_problem(path: Path, rows: int, *, full: bool = False) -> str | None:
    """None when the shard at ``path`` is complete with ``rows`` rows, else why not (``"missing"``, a truncated or
    unreadable file, another row count, a page checksum)."""
    import pyarrow.parquet as pq

    if not path.exists():
        return "missing"
    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as e:  # noqa: BLE001  (pyarrow raises ArrowInvalid / OSError for a truncated footer)
        return f"truncated or unreadable ({type(e).__name__}: {str(e)[:80]})"
    if meta.num_rows != rows:
        return f"holds {meta.num_rows} rows, expected {rows}"
    if full:
        try:
            pq.ParquetFile(path, page_checksum_verification=True).read()
        except Exception as e:  # noqa: BLE001
            return f"damaged pages ({type(e).__name__}: {str(e)[:80]})"
    return None


def write_shard(table: Any, path: Path) -> None:
    """Write an Arrow table to ``path`` atomically (temporary file in the same folder, then rename), with page
    checksums."""
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp, write_page_checksum=True, row_group_size=max(1, min(len(table), 4096)))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def entry_keys(rows: np.ndarray, buckets: np.ndarray, variants: np.ndarray, num_buckets: int,
               num_variants: int) -> np.ndarray:
    """One int64 per (row, bucket, variant): sorting by it sorts by row, then bucket, then variant."""
    rows, buckets, variants = (np.asarray(x, np.int64) for x in (rows, buckets, variants))
    return (rows * num_buckets + buckets) * num_variants + variants


def find_entries(sorted_keys: np.ndarray, order: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Positions (into the table) of ``wanted`` keys, -1 where a key is absent (vectorised ``searchsorted``)."""
    at = np.searchsorted(sorted_keys, wanted)
    at_c = np.minimum(at, max(len(sorted_keys) - 1, 0))
    hit = (at < len(sorted_keys)) & (sorted_keys[at_c] == wanted) if len(sorted_keys) else np.zeros(len(wanted), bool)
    return np.where(hit, order[at_c] if len(order) else -1, -1)


__all__ = ["TABLES", "entry_keys", "find_entries", "rank_shards", "shard_path", "shard_problem", "shard_slices",
           "write_shard"]
