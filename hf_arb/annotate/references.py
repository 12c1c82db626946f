"""The vectorised core of reference-image annotation: the target's bucket columns plus each reference's header
size → the reference columns (:mod:`hf_arb.buckets.references`), under the ``"strict"`` or ``"own"`` policy.

A row whose reference is missing or unreadable (or, under ``"own"``, cannot be bucketed) is skipped like a row whose
target is: ``bucket = -1`` and ``skip_reason = "reference <name>: <reason>"``, so the summary counts it under the
category ``reference <name>`` and the sampler never draws it. Pure numpy/pyarrow; :func:`hf_arb.annotate.arrow_batch.
bucket_columns` (every engine) calls it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hf_arb.buckets.references import check_policy, reference_column_names
from hf_arb.buckets.sets import BucketSet

from .core import annotate_sizes


def annotate_references(
    target: pa.Table,
    reference_sizes: Mapping[str, tuple[Any, Any, Any]],
    buckets: BucketSet,
    *,
    policy: str = "strict",
    reference_buckets: BucketSet | None = None,
    max_upscale: float | None = None,
    min_size: int | None = None,
) -> pa.Table:
    """The target's bucket columns updated for its references, followed by every reference's columns.

    Args:
        target: the bucket columns of ``n`` rows (what :func:`~hf_arb.annotate.core.annotate_sizes` returns).
        reference_sizes: ``{column: (widths (n,), heights (n,), reasons (n,) or None)}``, displayed sizes read from
            the reference images' headers (NaN / None where unknown) and per-row unreadable reasons.
        buckets: the target's BucketSet.
        policy: ``"strict"``: each reference takes the target's bucket (its id, ``bucket_width``/``bucket_height``);
            only a missing, unreadable or invalid reference skips the row. ``"own"``: each reference is assigned in
            ``reference_buckets`` (default ``buckets``) with the same rules as a target (``max_upscale``,
            ``min_size``, the set's aspect limits), and any skip of the reference skips the row.
        reference_buckets: the references' BucketSet under ``"own"`` (its own pixel budget).
        max_upscale, min_size: as for the target; applied to references under ``"own"`` only.

    Returns:
        ``n`` rows: the columns of ``target`` (``bucket`` ``-1``, ``bucket_width``/``bucket_height`` null and
        ``skip_reason`` ``"reference <name>: <reason>"`` for rows newly skipped, the first failing reference
        winning), then per reference the five columns of :func:`~hf_arb.buckets.references.reference_column_names`.
        Every reference bucket is ``-1`` exactly where the row's ``bucket`` is ``-1``.
    """
    check_policy(policy)
    n = target.num_rows
    ids = pc.fill_null(target.column("bucket"), -1).to_numpy().astype(np.int64)  # (n,)
    kept = ids >= 0  # (n,)
    skip = target.column("skip_reason")
    own_set = reference_buckets if (policy == "own" and reference_buckets is not None) else buckets
    per_ref: list[tuple[str, pa.Table, np.ndarray]] = []
    for name, (w, h, reasons) in reference_sizes.items():
        t = annotate_sizes(w, h, own_set, reasons=reasons,
                           max_upscale=max_upscale if policy == "own" else None,
                           min_size=min_size if policy == "own" else None)
        if t.num_rows != n:
            raise ValueError(f"reference column {name!r} has {t.num_rows} sizes for {n} target rows.")
        if policy == "strict":
            ok = t.column("original_width").is_valid().to_numpy(zero_copy_only=False)  # (n,) a readable, valid size
            reason = pc.fill_null(t.column("skip_reason"), "missing")
        else:
            ok = pc.fill_null(t.column("bucket"), -1).to_numpy() >= 0
            reason = pc.fill_null(t.column("skip_reason"), "")
        newly = kept & ~ok  # (n,)
        if newly.any():
            text = pc.binary_join_element_wise(pa.scalar(f"reference {name}"), reason, ": ")
            skip = pc.if_else(pa.array(newly), text, skip)
        kept &= ok
        per_ref.append((name, t, ok))
    out_ids = np.where(kept, ids, -1)  # (n,)
    cols = {c: target.column(c) for c in target.column_names}
    cols["bucket"] = pa.array(out_ids.astype(np.int32), pa.int32())
    cols["bucket_width"] = _masked(target.column("bucket_width"), kept)
    cols["bucket_height"] = _masked(target.column("bucket_height"), kept)
    cols["skip_reason"] = skip
    for name, t, _ in per_ref:
        wc, hc, bc, bwc, bhc = reference_column_names(name)
        cols[wc], cols[hc] = t.column("original_width"), t.column("original_height")
        if policy == "strict":
            cols[bc] = cols["bucket"]
            cols[bwc], cols[bhc] = cols["bucket_width"], cols["bucket_height"]
        else:
            rid = pc.fill_null(t.column("bucket"), -1).to_numpy().astype(np.int64)
            cols[bc] = pa.array(np.where(kept, rid, -1).astype(np.int32), pa.int32())
            cols[bwc] = _masked(t.column("bucket_width"), kept)
            cols[bhc] = _masked(t.column("bucket_height"), kept)
    return pa.table(cols)


def _masked(column: Any, kept: np.ndarray) -> pa.Array:
    """An int32 column with nulls where ``kept`` (shape (n,)) is False."""
    values = pc.fill_null(column, 0).to_numpy(zero_copy_only=False).astype(np.int32)
    return pa.array(values, pa.int32(), mask=~kept)
