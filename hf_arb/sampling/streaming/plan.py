"""The pure half of streaming: per-bucket counts, the global bucket schedule, and :class:`StreamReport`.

The schedule of a streaming epoch is a pure function of ``(per-bucket counts, global batch, per-rank batch,
seed, epoch)``: bucket ``b`` gets ``counts[b] // global_batch`` global batches, ordered by
:func:`stream_schedule` (by expected arrival of their rows, or a uniform shuffle). Every rank computes the same
array, so every rank knows the bucket of every step and the number of steps without talking to the others.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from hf_arb import rng


def as_counts(counts: Any, buckets: Any = None) -> np.ndarray:
    """Rows per bucket as an ``int64`` array of shape ``(k,)``.

    Args:
        counts: an array/list aligned with the bucket ids; a ``{bucket id: rows}`` dict; an annotation summary
            (anything with a ``counts`` array, e.g. ``AnnotationSummary``); or a summary's ``to_dict()`` /
            dataset-card stats ``{"counts": {"WxH": rows}}`` (then ``buckets`` gives the id order).
        buckets: the ``BucketSet`` (or ``(k, 2)`` resolutions), needed only for ``"WxH"``-keyed counts.

    Raises:
        ValueError: negative or non-integer counts, or ``"WxH"`` labels that ``buckets`` does not have.
    """
    if hasattr(counts, "counts") and not isinstance(counts, dict):
        counts = counts.counts
    if isinstance(counts, dict) and "counts" in counts and isinstance(counts["counts"], dict):
        counts = counts["counts"]
    if isinstance(counts, dict):
        keys = list(counts)
        if keys and all(isinstance(k, str) and "x" in k for k in keys):
            if buckets is None:
                raise ValueError("Counts keyed by 'WxH' labels need `buckets` (the BucketSet) to know the bucket ids.")
            res = np.asarray(getattr(buckets, "resolutions", buckets)).tolist()
            labels = {"x".join(map(str, r)): i for i, r in enumerate(res)}  # "WxH", or "WxHxF" for clips
            unknown = [k for k in keys if k not in labels]
            if unknown:
                raise ValueError(
                    f"Count labels {unknown[:5]} are not buckets of the given BucketSet {list(labels)[:8]}."
                )
            arr = np.zeros(len(res), dtype=np.int64)
            for k, v in counts.items():
                arr[labels[k]] = int(v)
            return arr
        ids = [int(k) for k in keys]
        if ids and min(ids) < 0:
            raise ValueError(f"Bucket ids in `counts` must be >= 0, got {min(ids)}.")
        arr = np.zeros(max(ids) + 1 if ids else 0, dtype=np.int64)
        for k, v in counts.items():
            arr[int(k)] = int(v)
        counts = arr
    arr = np.asarray(counts)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"`counts` must be rows per bucket (1-D integers), got dtype {arr.dtype} shape {arr.shape}.")
    if arr.size and arr.min() < 0:
        raise ValueError(f"`counts` must be >= 0, got {int(arr.min())} for bucket {int(np.argmin(arr))}.")
    return arr.astype(np.int64)


def counts_from_card(card: Any, split: str = "train", buckets: Any = None) -> np.ndarray:
    """Rows per bucket of one split from a dataset card pushed by :func:`hf_arb.push_to_hub` (``hf_arb.stats``).

    Args:
        card: a ``huggingface_hub.DatasetCard`` (or its text).
        split: the split whose counts to read.
        buckets: the BucketSet; default: the one in the card.
    """
    from huggingface_hub import DatasetCard

    from hf_arb.buckets.schema import buckets_from_card
    from hf_arb.buckets.stored import CARD_KEY

    card = card if isinstance(card, DatasetCard) else DatasetCard(str(card))
    stats = (card.data.get(CARD_KEY) or {}).get("stats") or {}
    if split not in stats:
        raise ValueError(f"The dataset card has no `{CARD_KEY}.stats.{split}` counts (splits: {list(stats)}); pass "
                         "`counts=` explicitly (e.g. from hf_arb.summarize_annotation on the map-style data).")
    return as_counts(stats[split], buckets if buckets is not None else buckets_from_card(card))


ORDERS = ("arrival", "shuffle")


def stream_schedule(counts: np.ndarray, global_batch: int, seed: int, epoch: int, *, order: str = "arrival",
                    batch_size: int | None = None, margin: float = 3.0) -> np.ndarray:
    """The bucket of every global step of one epoch: ``int32`` array of shape ``(steps,)``.

    Bucket ``b`` gets ``counts[b] // global_batch`` global batches; buckets with fewer rows than one global
    batch never appear (their rows are counted as skipped). Two orders:

    - ``"arrival"`` (default): batch ``j`` of bucket ``b`` is placed where a rank reading its split in random
      order has, in expectation, already read its rows with ``margin`` standard deviations to spare:
      ``t = (need + margin·sqrt(need) + u·batch) / rows_per_rank[b]`` with ``need = (j + 1)·batch`` and a seeded
      jitter ``u ~ U[0, 1)``; steps are sorted by ``t`` (clamped to the epoch's end, ties in random order). Each
      bucket's batches are spread evenly over the epoch, so the rate of every bucket stays proportional to its
      size, and rare buckets are never asked for before their rows can have arrived: the buffer a rank needs
      stays small (about ``margin`` standard deviations of each bucket's count).
    - ``"shuffle"``: a uniform shuffle of the labels (the map-style plan's order: at every step a bucket with
      probability proportional to its remaining batches). Rare buckets then need a buffer of a sizeable
      fraction of the epoch on a random-order stream.

    Args:
        counts: rows per bucket, shape ``(k,)``.
        global_batch: rows per step over all ranks (``num_replicas * batch_size``).
        seed, epoch: the run's seed and the epoch (non-negative); the random draws come from
            ``rng.generator(seed, epoch, STREAM_ORDER)``.
        order: ``"arrival"`` or ``"shuffle"``.
        batch_size: rows per rank and batch (default ``global_batch``: one rank).
        margin: standard deviations of slack for ``"arrival"``.
    """
    if order not in ORDERS:
        raise ValueError(f"`order` must be one of {ORDERS}, got {order!r}.")
    counts = np.asarray(counts, dtype=np.int64)
    per_bucket = counts // int(global_batch)  # (k,)
    labels = np.repeat(np.arange(per_bucket.size, dtype=np.int32), per_bucket)  # (steps,) bucket-sorted
    g = rng.generator(seed, epoch, rng.STREAM_ORDER)
    if order == "shuffle":
        return g.permutation(labels)
    batch = int(global_batch if batch_size is None else batch_size)
    starts = np.concatenate([[0], np.cumsum(per_bucket)[:-1]])  # (k,)
    j = np.arange(labels.size) - starts[labels]  # (steps,) index of the batch within its bucket
    need = (j + 1) * batch  # rows of its bucket a rank has used after this batch
    per_rank = counts[labels] * batch / int(global_batch)  # (steps,) expected rows of the bucket per rank
    t = np.minimum((need + margin * np.sqrt(need) + g.random(labels.size) * batch) / per_rank, 1.0)
    return labels[np.lexsort((g.random(labels.size), t))]


@dataclass(frozen=True)
class StreamReport:
    """What a streaming epoch did with the rows it read, summed over the ranks this process simulates.

    Every row read is accounted for: ``rows_read == rows_used + rows_buffered + rows_skipped_unassigned +
    rows_skipped_small + rows_skipped_surplus + rows_evicted``.

    Attributes:
        epoch, steps, num_replicas, batch_size: the epoch and its shape (``steps`` per rank).
        step: steps produced so far (``steps`` at the end of the epoch).
        ranks: the ranks whose rows are counted here.
        rows_expected: rows with a bucket according to ``counts`` (over all ranks).
        rows_read: rows read from the stream; rows_used: distinct rows emitted in batches.
        rows_repeated: batch slots filled with a repeat (a rank's stream ran out of a scheduled bucket).
        rows_buffered: rows read but still in a buffer (never emitted if the epoch is over).
        rows_skipped_unassigned: rows with bucket ``-1``/null; rows_skipped_small: rows of a bucket with fewer
            rows than one global batch (no step of the schedule); rows_skipped_surplus: rows beyond what the
            schedule will ever ask of this rank for their bucket; rows_evicted: rows dropped from a full buffer
            (``on_overflow="evict"``).
        peak_buffered: the most rows held at once (buffer plus the repeat reserve), per rank, maximum.
        rows_unread: rows with a bucket never read (``rows_expected`` minus the assigned rows read; the epoch
            stops reading once every scheduled batch is served); None unless every rank is read by this process.
        batches_per_bucket: ``{bucket: global batches}`` of the schedule.
    """

    epoch: int
    steps: int
    step: int
    num_replicas: int
    batch_size: int
    ranks: list[int]
    rows_expected: int
    rows_read: int
    rows_used: int
    rows_repeated: int
    rows_buffered: int
    rows_skipped_unassigned: int
    rows_skipped_small: int
    rows_skipped_surplus: int
    rows_evicted: int
    peak_buffered: int
    rows_unread: int | None = None
    batches_per_bucket: dict[int, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (bucket keys as strings)."""
        d = asdict(self)
        d["batches_per_bucket"] = {str(b): c for b, c in self.batches_per_bucket.items()}
        return d

    def __str__(self) -> str:
        return (
            f"epoch {self.epoch}: step {self.step:,}/{self.steps:,} × {self.num_replicas} ranks × batch "
            f"{self.batch_size} (ranks {self.ranks}); rows: {self.rows_read:,} read, {self.rows_used:,} used, "
            f"{self.rows_repeated:,} repeat slots, {self.rows_buffered:,} buffered, skipped "
            f"{self.rows_skipped_unassigned:,} unassigned + {self.rows_skipped_small:,} small-bucket + "
            f"{self.rows_skipped_surplus:,} surplus, {self.rows_evicted:,} evicted, "
            f"{'?' if self.rows_unread is None else format(self.rows_unread, ',')} unread; peak buffer "
            f"{self.peak_buffered:,} rows"
        )
