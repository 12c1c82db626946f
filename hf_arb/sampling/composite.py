"""Batches of edit-model rows that always stack: the sampler keyed by the composite (target bucket, reference
buckets…) rather than by the target bucket alone.

:func:`~hf_arb.buckets.references.composite_bucket_ids` maps the ``bucket`` and ``<name>_bucket`` columns to one id
per row plus the composite table; :class:`~hf_arb.BucketBatchSampler` runs over those ids unchanged (weighting,
resume, report, per-rank view), so every batch on every rank has one target shape and one shape per reference.
``BucketedReferenceDataset`` turns a ``(row, composite id, epoch)`` key back into the target and reference buckets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hf_arb.buckets.references import composite_bucket_ids, composite_resolutions, read_composite, \
    stored_reference_columns
from .sampler import BucketBatchSampler


def composite_sampler(ds: Any, batch_size: Any, drop_last: bool | None = None, *,
                      reference_columns: Sequence[str] | None = None, **kwargs: Any
                      ) -> tuple[BucketBatchSampler, np.ndarray]:
    """A :class:`BucketBatchSampler` over the composite key of an annotated edit dataset, and its composite table.

    Args:
        ds: a map-style ``datasets.Dataset`` annotated with reference columns.
        batch_size, drop_last, **kwargs: as for :class:`BucketBatchSampler` (``return_keys=True`` yields
            ``(row, composite id, epoch)``, the key :class:`~hf_arb.images.references.BucketedReferenceDataset` takes).
        reference_columns: default every reference column stored in the dataset.

    Returns:
        ``(sampler, table)``: ``table`` of shape ``(c, 1 + r)`` gives composite id ``k``'s (target bucket, reference
        buckets…). The sampler's ``resolutions`` are each composite's target size (catch-all choice, merging,
        pixel budgets and the report read them).
    """
    names = tuple(reference_columns) if reference_columns is not None else stored_reference_columns(ds.features)
    ids, table = read_composite(ds, names)
    res = composite_resolutions(ds, names)[0]
    target_res = res[table[:, 0]] if table.size else np.zeros((0, 2), np.int64)  # (c, 2)
    sampler = BucketBatchSampler(ids, batch_size, drop_last, buckets=target_res if len(target_res) else None,
                                 **kwargs)
    return sampler, table


__all__ = ["composite_bucket_ids", "composite_sampler"]
