"""Issue 24 item 9: the annotation summary names the files it skipped (row and path), and they can be listed
without decoding a single image."""

from __future__ import annotations

from pathlib import Path

import datasets
from _photos import save_photo

from hf_arb import BucketSet, add_bucket_columns
from hf_arb.annotate.summary import SKIPPED_SHOWN, skipped_files, summarize_annotation

BUCKETS = BucketSet([(64, 64), (96, 64), (64, 96)])


def _dataset(root: Path, n: int, broken: set[int]) -> datasets.Dataset:
    paths = []
    for i in range(n):
        p = save_photo(root / f"{i:02d}.jpg", "coffee.png", "JPEG", size=(120, 120), quality=90)
        if i in broken:  # not an image at all: the header read fails, annotation records and skips the row
            Path(p).write_bytes(b"this is not a JPEG")
        paths.append(str(p))
    ds = datasets.Dataset.from_dict({"image": paths}).cast_column("image", datasets.Image())
    return add_bucket_columns(ds, BUCKETS, show_summary=False)


def test_summary_names_each_skipped_row_and_file(tmp_path: Path) -> None:
    ds = _dataset(tmp_path, 6, broken={1, 4})
    text = str(summarize_annotation(ds))
    for r in (1, 4):
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(f"row {r} "))
        assert f"{r:02d}.jpg" in line and "unreadable" in line, line
    assert "more:" not in text  # all shown: no "and N more"


def test_skipped_files_lists_all_without_decoding_and_the_summary_caps_the_list(tmp_path: Path) -> None:
    broken = set(range(0, 2 * SKIPPED_SHOWN + 2, 2))
    ds = _dataset(tmp_path, 2 * SKIPPED_SHOWN + 3, broken=broken)
    listed = skipped_files(ds)  # ds decodes images: a decode of any broken row would raise here
    assert [r for r, _, _ in listed] == sorted(broken)
    assert all(Path(p).name == f"{r:02d}.jpg" and reason.startswith("unreadable") for r, p, reason in listed)
    summary = summarize_annotation(ds)
    assert len(summary.skipped_files) == SKIPPED_SHOWN
    assert f"... and {len(broken) - SKIPPED_SHOWN} more" in str(summary)
    assert skipped_files(ds.select(range(1, len(ds), 2))) == []  # the kept rows only: nothing skipped
