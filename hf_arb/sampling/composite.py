"""Batches of edit-model rows that always stack: the sampler keyed by the composite (target bucket, reference
buckets…) rather than by the target bucket alone.

:func:`~hf_arb.buckets.references.composite_bucket_ids` maps the ``bucket`` and ``<name>_bucket`` columns to one id
per row plus the composite table; :class:`~hf_arb.BucketBatchSampler` runs over those ids unchanged (weighting,
resume, report, per-rank view), so every batch on every rank has one target shape and one shape per reference.
``BucketedReferenceDataset`` turns a ``(row, composite id, epoch)`` key back into the target and reference buckets.

Streaming: :func:`composite_stream` adds the composite id as a column of a ``datasets.IterableDataset`` (a fixed
table, looked up row by row with :func:`composite_lookup`) and runs
:class:`~hf_arb.sampling.streaming.stream.BucketedStream` over that column, so streamed batches never mix reference
shapes either, on any number of ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hf_arb.buckets.references import (
    composite_bucket_ids,
    composite_resolutions,
    read_composite,
    stored_reference_columns,
)

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


#: the column :func:`add_composite_column` adds: the composite bucket id of the row (``-1`` = skipped)
COMPOSITE_COLUMN = "composite_bucket"


def composite_lookup(target_ids: Any, reference_ids: Sequence[Any], table: Any) -> np.ndarray:
    """The composite id of each row under a fixed composite ``table``; vectorised.

    Args:
        target_ids: the target bucket per row, shape ``(n,)``.
        reference_ids: one array of shape ``(n,)`` per reference column.
        table: the composite table, shape ``(c, 1 + r)`` (from :func:`composite_bucket_ids`).

    Returns:
        int64 of shape ``(n,)``: the row of ``table`` equal to the row's (target, reference buckets…), ``-1`` where
        any id is ``-1`` or the tuple is not in ``table``. Equals :func:`composite_bucket_ids`'s ids when ``table``
        is its table over the same rows.
    """
    stacked = np.stack([np.asarray(target_ids, dtype=np.int64).reshape(-1)]
                       + [np.asarray(r, dtype=np.int64).reshape(-1) for r in reference_ids], axis=1)  # (n, 1 + r)
    tab = np.asarray(table, dtype=np.int64)
    if tab.ndim != 2 or tab.shape[1] != stacked.shape[1]:
        raise ValueError(f"The composite table has shape {tab.shape}, but the rows have {stacked.shape[1]} bucket "
                         "columns (the target and each reference): build the table over the same reference columns.")
    out = np.full(stacked.shape[0], -1, dtype=np.int64)
    if not tab.size:
        return out
    base = tab.max(axis=0) + 1  # (1 + r,) mixed radix: every table entry is in [0, base)
    weights = np.append(np.cumprod(base[::-1])[::-1][1:], 1)  # (1 + r,)
    valid = (stacked >= 0).all(axis=1) & (stacked < base).all(axis=1)  # (n,)
    keys_t = tab @ weights  # (c,)
    order = np.argsort(keys_t, kind="stable")
    keys = stacked[valid] @ weights  # (m,)
    pos = np.minimum(np.searchsorted(keys_t[order], keys), len(order) - 1)  # (m,)
    out[valid] = np.where(keys_t[order][pos] == keys, order[pos], -1)
    return out


def _composite_batch(batch: Any, *, columns: tuple[str, ...], table: list[list[int]], column: str) -> dict:
    """``map`` function: a batch (dict of lists) → its composite id column."""
    ids = [np.asarray([-1 if v is None else v for v in batch[c]], dtype=np.int64) for c in columns]
    return {column: composite_lookup(ids[0], ids[1:], np.asarray(table, dtype=np.int64).reshape(-1, len(columns)))}


def add_composite_column(ds: Any, table: Any, reference_columns: Sequence[str] | None = None, *,
                         column: str = COMPOSITE_COLUMN) -> Any:
    """``ds`` with a ``column`` of composite ids under ``table`` (:func:`composite_lookup` of ``bucket`` and each
    ``<name>_bucket``), added by a batched ``map``: lazily for a ``datasets.IterableDataset``.

    ``reference_columns`` default: every reference column the dataset's features store."""
    if reference_columns is None and not ds.features:
        raise ValueError("The stream's features are unknown, so its reference columns are too: pass "
                         "reference_columns=[...] (the names given to hf-arb annotate --reference-column).")
    names = tuple(reference_columns) if reference_columns is not None else stored_reference_columns(ds.features)
    columns = ("bucket", *[n + "_bucket" for n in names])
    missing = [c for c in columns if ds.column_names is not None and c not in ds.column_names]
    if missing:
        raise ValueError(f"The dataset has no column(s) {missing}: annotate it with reference_columns={list(names)} "
                         "(hf-arb annotate --reference-column NAME).")
    tab = np.asarray(table, dtype=np.int64)
    if tab.ndim != 2 or tab.shape[1] != len(columns):
        raise ValueError(f"The composite table has shape {tab.shape}, but the key has {len(columns)} columns "
                         f"{list(columns)}: build the table over the same reference columns (read_composite).")
    tab = tab.tolist()
    return ds.map(_composite_batch, batched=True, fn_kwargs=dict(columns=columns, table=tab, column=column))


def composite_stream(dataset: Any, batch_size: int, *, table: Any, counts: Any,
                     reference_columns: Sequence[str] | None = None, **stream_kwargs: Any) -> Any:
    """A :class:`~hf_arb.sampling.streaming.stream.BucketedStream` over the composite key of an annotated streaming edit
    dataset: every rank's batch at every step holds one composite bucket (one target shape, one shape per
    reference), and all ranks serve the same composite bucket at each step.

    Args:
        dataset: a ``datasets.IterableDataset`` annotated with reference columns.
        batch_size: rows per batch per rank.
        table: the composite table, shape ``(c, 1 + r)``, and counts: rows per composite id, shape ``(c,)``; both
            from :func:`composite_bucket_ids` over the whole split (e.g. ``read_composite`` of the map-style
            copy, or one pass over the stream's bucket columns). Rows whose tuple is not in ``table`` are skipped.
        reference_columns: default every reference column stored in the dataset.
        **stream_kwargs: the other :class:`~hf_arb.sampling.streaming.stream.BucketedStream` arguments
        (``num_replicas``,
            ``rank``, ``seed``, ``buffer_size``, ``collate_fn``…). Its ``state_dict``/``load_state_dict`` resume
            exactly, and its ``report().batches_per_bucket`` is keyed by composite id.

    Returns:
        The stream; each row carries its composite id in :data:`COMPOSITE_COLUMN`.
    """
    from .streaming.stream import BucketedStream

    tab = np.asarray(table, dtype=np.int64)
    n = np.asarray(counts, dtype=np.int64).reshape(-1)
    if tab.ndim != 2 or n.size != tab.shape[0]:
        raise ValueError(f"`counts` must give rows per composite id, one per row of `table` (shape {tab.shape}), got "
                         f"{n.size}: use numpy.bincount(ids[ids >= 0], minlength=len(table)).")
    stream = add_composite_column(dataset, tab, reference_columns)
    return BucketedStream(stream, batch_size, counts=n, bucket_column=COMPOSITE_COLUMN, **stream_kwargs)


__all__ = ["COMPOSITE_COLUMN", "add_composite_column", "composite_bucket_ids", "composite_lookup",
           "composite_sampler", "composite_stream"]
