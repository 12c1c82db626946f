"""What one epoch of a tiered plan does with the rows: :class:`TierReport` (``TieredBatchSampler.report()``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from hf_arb.wording import count


@dataclass(frozen=True)
class TierReport:
    """Rows, batches, repeats and drops per tier and bucket.

    Attributes:
        epoch: the sampler epoch described; schedule: the schedule's kind.
        rows_total: rows of the dataset; rows_no_tier: rows eligible in no tier (no bucket, or too small for every
            tier under ``max_upscale``): never trained.
        steps: steps per rank in the epoch; num_replicas: ranks.
        tiers: one dict per tier: ``tier``, ``resolution``, ``rows`` (rows eligible there; ``random``: rows drawn
            for it this epoch), ``steps`` (its steps in this epoch), ``passes`` (those steps over the steps of one
            pass over its rows) and ``buckets``: ``{bucket: {"rows", "batch_size", "batches", "repeats", "drops"}}``
            for one pass (``batches``: global batches; ``repeats``: extra samples of ``leftover="fill"``; ``drops``:
            rows left out of the pass by ``leftover="drop"``).
    """

    epoch: int
    schedule: str
    rows_total: int
    rows_no_tier: int
    steps: int
    num_replicas: int
    leftover: str
    tiers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def rows_dropped(self) -> int:
        """Rows left out of one pass, summed over tiers and buckets."""
        return sum(b["drops"] for t in self.tiers for b in t["buckets"].values())

    @property
    def rows_repeated(self) -> int:
        """Extra samples of one pass (``leftover="fill"``), summed over tiers and buckets."""
        return sum(b["repeats"] for t in self.tiers for b in t["buckets"].values())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (bucket keys as strings)."""
        d = asdict(self)
        for t in d["tiers"]:
            t["buckets"] = {str(b): v for b, v in t["buckets"].items()}
        d["rows_dropped"], d["rows_repeated"] = self.rows_dropped, self.rows_repeated
        return d

    def __str__(self) -> str:
        lines = [f"epoch {self.epoch} ({self.schedule}): {self.steps:,} steps/rank × "
                 f"{count(self.num_replicas, 'rank')}; "
                 f"rows: {self.rows_total:,} total, {self.rows_no_tier:,} in no tier; per pass "
                 f"{self.rows_dropped:,} dropped, {self.rows_repeated:,} repeated (leftover={self.leftover!r})"]
        for t in self.tiers:
            b = t["buckets"]
            lines.append(f"  tier {t['tier']} ({t['resolution']}): {count(t['rows'], 'row')}, "
                         f"{count(t['steps'], 'step')} "
                         f"({t['passes']:.2f} passes), {sum(v['batches'] for v in b.values()):,} batches/pass in "
                         f"{count(len(b), 'bucket')}, {sum(v['drops'] for v in b.values()):,} dropped, "
                         f"{sum(v['repeats'] for v in b.values()):,} repeated")
        return "\n".join(lines)


def bucket_table(counts: np.ndarray, batch: np.ndarray, world: int, leftover: str) -> dict[int, dict[str, int]]:
    """One pass over a tier's buckets, closed form: ``{bucket: {"rows", "batch_size", "batches", "repeats",
    "drops"}}`` for buckets with rows (``counts``, ``batch``: int ``(k,)``; global batch ``world × batch``)."""
    out = {}
    for b in np.flatnonzero(counts).tolist():
        n, G = int(counts[b]), world * int(batch[b])
        full = n // G
        batches = -(-n // G) if leftover == "fill" else full
        out[b] = {"rows": n, "batch_size": int(batch[b]), "batches": batches,
                  "repeats": batches * G - n if leftover == "fill" else 0,
                  "drops": n - full * G if leftover == "drop" else 0}
    return out


def tier_row_counts(tier_ids: np.ndarray, num_buckets: Any) -> tuple[list[np.ndarray], int]:
    """Rows per (tier, bucket) of the tier columns, and the rows eligible in no tier.

    Args:
        tier_ids: :func:`~hf_arb.sampling.tiered.plan.tier_bucket_ids`, int ``(T, n)``, ``-1``: not eligible there.
        num_buckets: buckets per tier, int ``(T,)`` (:attr:`~hf_arb.sampling.tiered.plan.Tiers.num_buckets`).

    Returns:
        ``(counts, no_tier)``: ``counts[t]`` int64 ``(k_t,)``, the rows whose bucket in tier ``t`` is ``b`` (a row
        counts once in every tier it is eligible for: nothing is copied, a schedule picks among them);
        ``no_tier``: rows with ``-1`` in every tier.
    """
    ids = np.asarray(tier_ids)
    k = np.asarray(num_buckets, np.int64).reshape(-1)
    if ids.ndim != 2 or ids.shape[0] != k.size:
        raise ValueError(f"`tier_ids` must be (tiers, rows) with {k.size} tiers, got shape {ids.shape}: pass "
                         "tier_bucket_ids(widths, heights, tiers) and tiers.num_buckets.")
    counts = []
    for t in range(k.size):
        row = ids[t]
        kept = row[row >= 0].astype(np.int64)
        if kept.size and int(kept.max()) >= k[t]:
            raise ValueError(f"Tier {t} has bucket id {int(kept.max())}, but only {int(k[t])} buckets.")
        counts.append(np.bincount(kept, minlength=int(k[t])).astype(np.int64))
    no_tier = int((ids < 0).all(axis=0).sum()) if ids.shape[1] else 0
    return counts, no_tier


__all__ = ["TierReport", "bucket_table", "tier_row_counts"]
