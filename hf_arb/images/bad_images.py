"""What happens to an image that fails to decode at training time: a deterministic replacement, recorded.

Header-only annotation keeps an image whose body is broken (an interrupted download). Instead of ending the run,
:class:`~hf_arb.BucketedImageDataset` with ``on_bad_image="replace"`` trains on another row of the same bucket:
the replacement is a pure function of ``(seed, epoch, row, bucket)`` (:func:`replacement_order`), so batches stay
full, every rank still trains the same bucket at a step, and a resumed run makes the same substitutions. Each bad
row is logged once and appended to a JSON-lines file (``skipped_rows.jsonl`` in the training output dir), one
object per row::

    {"row": 3, "reason": "OSError: image file is truncated (8 bytes not processed)", "source": "'/data/003.jpg'",
     "replaced_by": 17, "bucket": 2, "epoch": 0}
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger("hf_arb")

#: ``on_bad_image`` values.
BAD_IMAGE_POLICIES = ("replace", "error")


def replacement_order(rng: np.random.Generator, row: int, bucket: int, own_buckets: np.ndarray) -> np.ndarray:
    """Rows to try, in order, in place of ``row`` when fitting to ``bucket``; shape ``(m,)``.

    First the other rows whose own bucket is ``bucket`` (closest aspect, so the crop stays small), in an order
    drawn from ``rng``; then every other kept row (fitted to ``bucket`` too, so the batch keeps its shape), for a
    catch-all batch or a bucket whose images are all broken. ``rng`` fixes the order: the choice is reproducible.
    """
    same = np.flatnonzero(own_buckets == bucket)
    other = np.flatnonzero((own_buckets >= 0) & (own_buckets != bucket))
    same, other = same[same != row], other[other != row]
    return np.concatenate([rng.permutation(same), rng.permutation(other)])


class BadImageLog:
    """Appends one JSON line per bad row to ``path`` (if given) and logs a warning the first time a row is seen.

    Safe across DataLoader workers and ranks on one file system: each line is a single ``O_APPEND`` write, and
    rows already in the file are not written again.

    Args:
        path: the JSON-lines file, e.g. ``<output_dir>/skipped_rows.jsonl``; ``None`` only logs.
    """

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = None if path is None else Path(path)
        self.count = 0
        self._seen: set[int] | None = None

    def _load_seen(self) -> set[int]:
        if self._seen is None:
            self._seen = {r["row"] for r in read_bad_rows(self.path)} if self.path is not None else set()
        return self._seen

    @property
    def rows(self) -> list[int]:
        """The distinct bad rows seen, ascending (in this process; with ``path``, also those already in the file)."""
        return sorted(self._load_seen())

    def record(self, row: int, reason: str, **fields: Any) -> None:
        """Count ``row`` as bad; the first time (in this file) log it and append its line."""
        self.count += 1
        seen = self._load_seen()
        if int(row) in seen:
            return
        seen.add(int(row))
        entry = {"row": int(row), "reason": reason, **fields}
        logger.warning("Bad image in row %d (%s): %s", int(row), reason,
                       ", ".join(f"{k}={v}" for k, v in fields.items()))
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (json.dumps(entry, default=str) + "\n").encode())
            finally:
                os.close(fd)

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers: start from the file, not a stale copy
        return {"path": self.path, "count": 0, "_seen": None}


def read_bad_rows(path: str | os.PathLike | None) -> list[dict[str, Any]]:
    """The entries of a ``skipped_rows.jsonl`` file, first per row; ``[]`` when it does not exist."""
    if path is None or not Path(path).is_file():
        return []
    out, seen = [], set()
    for line in Path(path).read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill: the row is recorded again next time
        if isinstance(entry, dict) and "row" in entry and entry["row"] not in seen:
            seen.add(entry["row"])
            out.append(entry)
    return out
