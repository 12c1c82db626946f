"""An annotated stream can be iterated past broken images: they are skipped rows, not the end of the stream."""

from __future__ import annotations

import datasets
import pytest
from _photos import encode, photo

from hf_arb import BucketSet, add_bucket_columns, fit_to_bucket

GOOD = encode(photo("coffee.png", (120, 80)), "JPEG")
VALUES = [{"bytes": GOOD, "path": "a.jpg"}, {"bytes": b"garbage!" * 10, "path": "b.jpg"},
          {"bytes": GOOD[: len(GOOD) // 2], "path": "c.jpg"}, None, {"bytes": encode(photo("chelsea.png"), "PNG"),
                                                                     "path": "d.png"}]


@pytest.mark.parametrize("verify", [False, True])
def test_stream_iterates_past_broken_images(verify: bool) -> None:
    ds = datasets.Dataset.from_dict({"image": VALUES, "i": list(range(len(VALUES)))},
                                    features=datasets.Features({"image": datasets.Image(),
                                                                "i": datasets.Value("int32")}))
    it = add_bucket_columns(ds.to_iterable_dataset(num_shards=2), BucketSet.from_budget(128, step=32), verify=verify,
                            batch_size=2)
    rows = list(it)  # would raise UnidentifiedImageError at row 1 if the stream decoded its images
    assert [r["i"] for r in rows] == [0, 1, 2, 3, 4]  # rows in = rows out
    reasons = [(r["skip_reason"] or "").split(":")[0] for r in rows]
    assert reasons == ["", "unreadable", "truncated" if verify else "", "missing", ""]
    kept = list(it.filter(lambda r: r["bucket"] >= 0))
    assert [r["i"] for r in kept] == ([0, 4] if verify else [0, 2, 4])
    fitted = fit_to_bucket(kept[0]["image"], (kept[0]["bucket_width"], kept[0]["bucket_height"]), crop="center")
    assert fitted.image.size == (kept[0]["bucket_width"], kept[0]["bucket_height"])


def test_saved_or_pushed_stream_decodes_again() -> None:
    from hf_arb.annotate.map import decoding_images

    ds = datasets.Dataset.from_dict({"image": VALUES[:1]}, features=datasets.Features({"image": datasets.Image()}))
    it = add_bucket_columns(ds.to_iterable_dataset(), BucketSet.from_budget(128, step=32))
    assert not it.features["image"].decode
    back = decoding_images(it)
    assert back.features["image"].decode and next(iter(back))["image"].size == (120, 80)
