"""Reference-image columns of an annotated dataset: their names, their Arrow/``datasets`` types, and the policy and
BucketSet each one was bucketed with (stored in the ``<name>_bucket`` feature, as the target's BucketSet rides in
``bucket``).

An edit-model dataset (Flux Kontext, Qwen-Image-Edit) has a target image column and one or more reference image
columns. Annotating with ``reference_columns=["before"]`` adds, per reference column ``before``:

=========================  ========  ===========================================================================
column                     type      meaning
=========================  ========  ===========================================================================
``before_width``           int32     displayed width of the reference image (header only); null if unreadable
``before_height``          int32     displayed height
``before_bucket``          int32     the reference's bucket id (``-1`` when the row is skipped)
``before_bucket_width``    int32     width of that bucket; null when skipped
``before_bucket_height``   int32     height of that bucket
=========================  ========  ===========================================================================

Two policies (:data:`REFERENCE_POLICIES`), chosen per run:

- ``"strict"``: the reference takes the target's bucket and crop (as Flux Kontext trains): ``before_bucket`` equals
  ``bucket`` and refers to the target's BucketSet;
- ``"own"``: the reference gets its own bucket in its own BucketSet (its own pixel budget), as Qwen-Image-Edit-Plus
  and Flux.2 multi-reference allow.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from .sets import BucketSet

#: the reference policies: ``"strict"`` (target's bucket and crop) and ``"own"`` (own bucket, own pixel budget)
REFERENCE_POLICIES: tuple[str, ...] = ("strict", "own")

#: prefix of the ``<name>_bucket`` feature id that stores ``{"policy": ..., "buckets": BucketSet dict}``
REFERENCE_ID_PREFIX = "hf_arb.reference:"

#: suffixes of the columns added per reference column, in order
REFERENCE_SUFFIXES: tuple[str, ...] = ("_width", "_height", "_bucket", "_bucket_width", "_bucket_height")


def check_policy(policy: str) -> str:
    """``policy`` if it is one of :data:`REFERENCE_POLICIES`, else a ValueError naming the choices."""
    if policy not in REFERENCE_POLICIES:
        raise ValueError(f"`reference_policy` must be one of {REFERENCE_POLICIES}, got {policy!r}: 'strict' fits each "
                         "reference to the target's bucket and crop (Flux Kontext); 'own' gives it its own bucket.")
    return policy


def reference_column_names(name: str) -> tuple[str, ...]:
    """The columns annotation adds for reference column ``name``: ``<name>_width``, ``_height``, ``_bucket``,
    ``_bucket_width``, ``_bucket_height``."""
    return tuple(name + s for s in REFERENCE_SUFFIXES)


def check_reference_columns(names: Sequence[str] | None, image_column: str | None) -> tuple[str, ...]:
    """The reference column names as a tuple; a ValueError for duplicates, the image column itself, or a name whose
    added columns would overwrite the bucket columns."""
    out = tuple(names or ())
    if len(set(out)) != len(out):
        raise ValueError(f"`reference_columns` names a column twice: {list(out)}. Name each reference column once.")
    for n in out:
        if not isinstance(n, str) or not n:
            raise ValueError(f"`reference_columns` must hold column names, got {n!r}.")
        if n == image_column:
            raise ValueError(f"reference column {n!r} is the target `image_column`; pass the reference image column "
                             "(e.g. the 'before' image of an edit pair).")
        if n in ("bucket", "original", "aspect", "skip"):
            raise ValueError(f"reference column {n!r} would overwrite the bucket columns ({n}_width, ...); rename it.")
    return out


def reference_arrow_fields(names: Sequence[str]) -> list[pa.Field]:
    """The Arrow fields of the reference columns of ``names``, in order (all int32)."""
    return [pa.field(c, pa.int32()) for n in names for c in reference_column_names(n)]


def reference_features(names: Sequence[str], policy: str, buckets: BucketSet,
                       reference_buckets: BucketSet | None = None) -> Any:
    """``datasets.Features`` of the reference columns; each ``<name>_bucket`` id stores the policy and the BucketSet
    its ids refer to (the target's for ``"strict"``, ``reference_buckets`` (default the target's) for ``"own"``)."""
    from datasets import Features, Value

    ref = buckets if policy == "strict" or reference_buckets is None else reference_buckets
    meta = REFERENCE_ID_PREFIX + json.dumps({"policy": check_policy(policy), "buckets": json.loads(ref.to_json())},
                                            sort_keys=True)
    out: dict[str, Any] = {}
    for n in names:
        w, h, b, bw, bh = reference_column_names(n)
        out.update({w: Value("int32"), h: Value("int32"), b: Value("int32", id=meta), bw: Value("int32"),
                    bh: Value("int32")})
    return Features(out)


def reference_info(features: Any, name: str) -> tuple[str, BucketSet] | None:
    """``(policy, BucketSet)`` stored for reference column ``name`` in a dataset's features, or None."""
    column = name + "_bucket"
    if not features or column not in features:
        return None
    fid = getattr(features[column], "id", None)
    if not (isinstance(fid, str) and fid.startswith(REFERENCE_ID_PREFIX)):
        return None
    meta = json.loads(fid[len(REFERENCE_ID_PREFIX):])
    return check_policy(meta["policy"]), BucketSet.from_dict(meta["buckets"])


def stored_reference_columns(features: Any) -> tuple[str, ...]:
    """The reference columns an annotated dataset carries (those whose ``<name>_bucket`` stores a policy), in order."""
    out = []
    for column in (features or {}):
        if column.endswith("_bucket") and reference_info(features, column[: -len("_bucket")]) is not None:
            out.append(column[: -len("_bucket")])
    return tuple(out)


# ----------------------------------------------------------------------------------- composite key
def composite_bucket_ids(target_ids: Any, reference_ids: Sequence[Any] = ()) -> tuple[np.ndarray, np.ndarray]:
    """The composite batch key (target bucket, reference buckets…) of every row, as one id per row; vectorised.

    Rows with the same composite id have the same target shape and the same shape for every reference, so any batch
    of them stacks. Feed the ids to :class:`~hf_arb.BucketBatchSampler` in place of the target buckets.

    Args:
        target_ids: the target bucket per row, shape ``(n,)``; ``-1`` = skipped.
        reference_ids: one array of shape ``(n,)`` per reference column (its ``<name>_bucket``); ``-1`` = skipped.

    Returns:
        ``(ids, table)``: ``ids`` int64 of shape ``(n,)``, ``-1`` where the target or any reference is ``-1``;
        ``table`` int64 of shape ``(c, 1 + r)``, row ``k`` = (target bucket, reference buckets…) of composite id
        ``k``, sorted lexicographically (``numpy.unique`` over the stacked ids), so the same annotation gives the
        same ids on every rank.
    """
    stacked = np.stack([np.asarray(target_ids, dtype=np.int64).reshape(-1)]
                       + [np.asarray(r, dtype=np.int64).reshape(-1) for r in reference_ids], axis=1)  # (n, 1 + r)
    valid = (stacked >= 0).all(axis=1)  # (n,)
    ids = np.full(stacked.shape[0], -1, dtype=np.int64)
    table, inverse = np.unique(stacked[valid], axis=0, return_inverse=True)
    ids[valid] = inverse.reshape(-1)
    return ids, table.astype(np.int64).reshape(-1, stacked.shape[1])


def read_composite(ds: Any, reference_columns: Sequence[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`composite_bucket_ids` of an annotated map-style dataset (``bucket`` and each ``<name>_bucket``).

    ``reference_columns`` default: every reference column the dataset's features store
    (:func:`stored_reference_columns`).
    """
    import pyarrow.compute as pc

    names = tuple(reference_columns) if reference_columns is not None else stored_reference_columns(ds.features)
    columns = ["bucket", *[n + "_bucket" for n in names]]
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise ValueError(f"The dataset has no column(s) {missing}: annotate it with reference_columns={list(names)} "
                         "(hf-arb annotate --reference-column NAME).")
    t = ds.select_columns(columns).with_format("arrow")[:]
    arrays = [pc.fill_null(t.column(c), -1).to_numpy().astype(np.int64) for c in columns]
    return composite_bucket_ids(arrays[0], arrays[1:])


def composite_labels(table: np.ndarray, resolutions: Sequence[Any]) -> list[str]:
    """``"WxH + WxH…"`` per composite id: ``table`` of shape ``(c, 1 + r)``; ``resolutions`` one ``(k, 2)`` table per
    column of ``table`` (the target's, then each reference's)."""
    res = [np.asarray(r, dtype=np.int64) for r in resolutions]
    return [" + ".join(f"{res[j][b, 0]}x{res[j][b, 1]}" for j, b in enumerate(row)) for row in table.tolist()]


def composite_counts_text(ids: np.ndarray, table: np.ndarray, labels: Sequence[str], names: Sequence[str]) -> str:
    """Rows per composite bucket (count and share of the kept rows), one line each, most populous first."""
    counts = np.bincount(ids[ids >= 0], minlength=table.shape[0])  # (c,)
    kept = int(counts.sum())
    head = "rows per composite bucket (target + " + " + ".join(names) + "):"
    lines = [head] + [f"  {labels[k]:<28} {int(counts[k]):>8}  {100 * counts[k] / max(kept, 1):5.1f}%"
                      for k in np.argsort(-counts, kind="stable").tolist()]
    return "\n".join(lines)


def composite_resolutions(ds: Any, names: Sequence[str]) -> list[np.ndarray]:
    """The ``(k, 2)`` bucket table of the target and of each reference column ``names`` of an annotated dataset."""
    from .schema import read_resolutions

    out = [read_resolutions(ds)]
    for n in names:
        info = reference_info(ds.features, n)
        out.append(read_resolutions(ds, column=n + "_bucket") if info is None else
                   np.asarray(info[1].resolutions, dtype=np.int64))
    return out


def composite_label_counts(ds: Any, reference_columns: Sequence[str] | None = None) -> dict[str, int]:
    """Rows per composite bucket of an annotated dataset, ``{"WxH + WxH…": rows}`` (kept rows only), most populous
    first: what ``hf-arb stats`` prints and charts. Labels from different splits add up."""
    names = tuple(reference_columns) if reference_columns is not None else stored_reference_columns(ds.features)
    ids, table = read_composite(ds, names)
    counts = np.bincount(ids[ids >= 0], minlength=table.shape[0])  # (c,)
    labels = composite_labels(table, composite_resolutions(ds, names))
    return {labels[k]: int(counts[k]) for k in np.argsort(-counts, kind="stable").tolist() if counts[k]}


def composite_summary(ds: Any, reference_columns: Sequence[str] | None = None) -> str:
    """What ``hf-arb stats`` prints for an edit dataset: the rows (and share) per composite bucket, and the pixels
    the references take (under ``"own"``, what they save against fitting each to the target's bucket)."""
    names = tuple(reference_columns) if reference_columns is not None else stored_reference_columns(ds.features)
    ids, table = read_composite(ds, names)
    res = composite_resolutions(ds, names)
    text = composite_counts_text(ids, table, composite_labels(table, res), names)
    kept = ids >= 0
    if kept.any():
        rows = table[ids[kept]]  # (m, 1 + r)
        target_px = (res[0][rows[:, 0], 0] * res[0][rows[:, 0], 1]).astype(np.int64)  # (m,)
        ref_px = sum((res[j + 1][rows[:, j + 1], 0] * res[j + 1][rows[:, j + 1], 1]).astype(np.int64)
                     for j in range(len(names)))
        strict_px = target_px * len(names)
        saved = 1 - int(np.sum(ref_px)) / max(int(np.sum(strict_px)), 1)
        text += (f"\nreference pixels: {int(np.sum(ref_px)):,} ({len(names)} per row) vs {int(np.sum(strict_px)):,} "
                 f"at the target's bucket (strict): {100 * saved:.1f}% saved")
    return text
