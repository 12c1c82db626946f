"""Width/height metadata columns: out-of-range sizes are skipped with a reason, non-numbers named in the error."""

from __future__ import annotations

import datasets
import numpy as np
import pyarrow as pa
import pytest

from hf_arb import BucketSet, add_bucket_columns
from hf_arb.annotate.map import annotate_sizes


def _ds(w: list, h: list) -> datasets.Dataset:
    return datasets.Dataset(pa.table({"W": w, "H": h}))


@pytest.mark.parametrize("streaming", [False, True])
def test_sizes_outside_int32_are_invalid_not_wrapped(streaming: bool) -> None:
    w = pa.array([1024, 2**31, 2**40, 2**31 - 1, -3, 0, None], pa.int64())
    h = pa.array([768, 1024, 1024, 1, 768, 768, 768], pa.int64())
    ds = _ds(w, h)
    if streaming:
        ds = ds.to_iterable_dataset()
    out = add_bucket_columns(ds, BucketSet.from_budget(1024), width_column="W", height_column="H",
                             show_summary=False)
    rows = list(out) if streaming else out.to_list()
    assert len(rows) == 7  # rows in = rows out
    reasons = [r["skip_reason"] for r in rows]
    assert reasons == [None, "invalid_size", "invalid_size", None, "invalid_size", "invalid_size", "missing"]
    assert [r["original_width"] for r in rows] == [1024, None, None, 2**31 - 1, None, None, None]
    assert [r["bucket"] == -1 for r in rows] == [False, True, True, False, True, True, True]


def test_float_columns_inf_and_nan() -> None:
    t = annotate_sizes(np.array([np.inf, np.nan, 3e9, 512.4, 0.4]), np.array([512.0, 512, 512, 512, 512]),
                       BucketSet.from_budget(512))
    assert t.column("skip_reason").to_pylist() == ["invalid_size", "missing", "invalid_size", None, "invalid_size"]
    assert t.column("original_width").to_pylist() == [None, None, None, 512, None]


@pytest.mark.parametrize("streaming", [False, True])
def test_numeric_strings_are_parsed(streaming: bool) -> None:
    ds = _ds(pa.array(["1024", " 640", None], pa.string()), pa.array([1024, 640, 640]))
    if streaming:
        ds = ds.to_iterable_dataset()
    out = add_bucket_columns(ds, BucketSet.from_budget(1024), width_column="W", height_column="H", show_summary=False)
    rows = list(out) if streaming else out.to_list()
    assert [r["original_width"] for r in rows] == [1024, 640, None]
    assert [r["skip_reason"] for r in rows] == [None, None, "missing"]


@pytest.mark.parametrize("streaming", [False, True])
def test_non_numeric_column_error_names_column_and_value(streaming: bool) -> None:
    ds = _ds(pa.array(["1024", "512", "n/a", "oops"], pa.string()), pa.array([1024, 512, 512, 512]))
    if streaming:
        ds = ds.to_iterable_dataset()
    with pytest.raises(ValueError, match=r"'W'.*row 2 holds 'n/a'"):
        out = add_bucket_columns(ds, BucketSet.from_budget(1024), width_column="W", height_column="H",
                                 show_summary=False)
        list(out)  # streaming: raised on iteration


def test_nested_column_is_rejected_by_name() -> None:
    ds = _ds(pa.array([[1], [2]]), pa.array([1, 2]))
    with pytest.raises(ValueError, match=r"'W'.*row 0 holds \[1\]"):
        add_bucket_columns(ds, BucketSet.from_budget(1024), width_column="W", height_column="H", show_summary=False)
