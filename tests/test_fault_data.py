"""Images that break after annotation (header intact, body cut): replaced deterministically or a clear error."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from _photos import save_photo

from hf_arb import BucketBatchSampler, BucketedImageDataset, BucketSet, add_bucket_columns
from hf_arb.images.bad_images import read_bad_rows, replacement_order
from hf_arb.images.collate import collate_buckets
from hf_arb.images.dataset import ImageDecodeError

BUCKETS = BucketSet([(64, 64), (96, 64), (64, 96)])
SIZES = [(120, 120), (180, 120), (120, 180)] * 4  # 12 rows, 4 per bucket
BAD = (4, 8)  # rows whose body is cut after annotation: bucket 1 and bucket 2


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory) -> tuple[datasets.Dataset, Path]:
    root = tmp_path_factory.mktemp("later_broken")
    names = ["coffee.png", "chelsea.png", "rocket.jpg"]
    paths = [str(save_photo(root / f"{i:02d}.jpg", names[i % 3], "JPEG", size=s, quality=90))
             for i, s in enumerate(SIZES)]
    ds = datasets.Dataset.from_dict({"image": paths, "text": [f"photo {i}" for i in range(len(paths))]})
    ds = add_bucket_columns(ds.cast_column("image", datasets.Image()), BUCKETS, show_summary=False)
    assert ds["skip_reason"] == [None] * len(paths)
    for r in BAD:  # an interrupted download: the header survives, the body does not
        Path(paths[r]).write_bytes(Path(paths[r]).read_bytes()[:700])
    return ds, root


def test_error_mode_names_row_and_gives_advice_that_works(broken: tuple[datasets.Dataset, Path]) -> None:
    ds, _ = broken
    data = BucketedImageDataset(ds, BUCKETS, on_bad_image="error")
    with pytest.raises(ImageDecodeError, match=r"Row 4: .*04\.jpg.*truncated.*--verify.*--on_bad_image replace"):
        data[(4, 1, 0)]
    # the advice: re-annotate with verify=True -> the rows are skipped, the sampler never yields them
    again = add_bucket_columns(ds, BUCKETS, verify=True, show_summary=False)
    assert [again["skip_reason"][r].split(":")[0] for r in BAD] == ["truncated", "truncated"]
    sampler = BucketBatchSampler(again, 1, seed=0, return_keys=True)
    data = BucketedImageDataset(again, BUCKETS, on_bad_image="error")
    rows = [data[k]["row"] for batch in sampler for k in batch]
    assert sorted(rows) == [r for r in range(12) if r not in BAD]


def test_a_users_own_loop_survives_a_truncated_image_by_default(broken: tuple[datasets.Dataset, Path]) -> None:
    """Issue 24 item 12: the library default is the script's: substitute a row of the same bucket and count it."""
    ds, _ = broken
    sampler = BucketBatchSampler(ds, 2, seed=0, return_keys=True)
    data = BucketedImageDataset(ds, BUCKETS)  # no on_bad_image: a plain user's loop
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, collate_fn=collate_buckets)
    batches = list(loader)  # the epoch completes
    assert len(batches) == len(sampler) and all(b["pixel_values"].shape[0] == 2 for b in batches)
    rows = [int(r) for b in batches for r in b["rows"]]
    assert not set(rows) & set(BAD) and len(rows) == len(ds)  # each bad row served as a row of its bucket
    assert data.bad_images.count == len(BAD) and sorted(data.bad_images.rows) == sorted(BAD)


def test_replacement_is_deterministic_same_bucket_and_logged_once(broken: tuple[datasets.Dataset, Path],
                                                                  tmp_path: Path) -> None:
    ds, _ = broken
    log = tmp_path / "skipped_rows.jsonl"
    data = BucketedImageDataset(ds, BUCKETS, on_bad_image="replace", bad_image_log=log, seed=3)
    a = data[(4, 1, 0)]
    twin = BucketedImageDataset(ds, BUCKETS, on_bad_image="replace", bad_image_log=tmp_path / "other.jsonl", seed=3)
    b = twin[(4, 1, 0)]
    assert torch.equal(a["pixel_values"], b["pixel_values"]) and a["row"] == b["row"]  # same substitute
    assert a["row"] != 4 and int(data.bucket_ids[a["row"]]) == 1 and a["pixel_values"].shape == (3, 64, 96)
    assert a["caption"] == f"photo {a['row']}"  # image and caption stay a pair
    for epoch in range(3):
        data[(4, 1, epoch)]
        data[(8, 2, epoch)]
    entries = read_bad_rows(log)
    assert [e["row"] for e in entries] == [4, 8] and len(log.read_text().splitlines()) == 2  # once per row
    assert "truncated" in entries[0]["reason"] and entries[0]["replaced_by"] == a["row"]
    assert data.bad_images.count == 7


def test_full_epoch_with_workers_keeps_batches_full(broken: tuple[datasets.Dataset, Path], tmp_path: Path) -> None:
    ds, _ = broken
    log = tmp_path / "skipped_rows.jsonl"
    data = BucketedImageDataset(ds, BUCKETS, on_bad_image="replace", bad_image_log=log)
    sampler = BucketBatchSampler(ds, 2, seed=0, return_keys=True)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, collate_fn=data.collate, num_workers=2)
    batches = list(loader)
    assert len(batches) == 6 and all(b["pixel_values"].shape[0] == 2 for b in batches)
    assert all(len(set(b["buckets"].tolist())) == 1 for b in batches)
    trained = sorted(r for b in batches for r in b["rows"].tolist())
    assert not set(BAD) & set(trained) and len(trained) == 12  # rows in = kept + replaced
    assert sorted(e["row"] for e in read_bad_rows(log)) == list(BAD)
    # the same epoch again (new worker processes) neither duplicates lines nor changes the substitutes
    sampler.set_epoch(0)
    again = sorted(r for b in loader for r in b["rows"].tolist())
    assert again == trained and len(log.read_text().splitlines()) == 2


def test_replacement_order_prefers_same_bucket() -> None:
    own = np.array([0, 1, 1, 2, 1, -1])
    order = replacement_order(np.random.default_rng(0), 1, 1, own)
    assert sorted(order[:2].tolist()) == [2, 4] and sorted(order[2:].tolist()) == [0, 3]  # same bucket first
    assert sorted(replacement_order(np.random.default_rng(0), 3, 2, own).tolist()) == [0, 1, 2, 4]  # catch-all
    with pytest.raises(ValueError, match="on_bad_image"):
        BucketedImageDataset(datasets.Dataset.from_dict({"image": ["x"], "bucket": [0], "text": ["t"]}),
                             BUCKETS, on_bad_image="skip")
    json.dumps(read_bad_rows(None))


def test_whole_bucket_broken_falls_back_to_other_rows_fitted_to_it(broken: tuple[datasets.Dataset, Path],
                                                                    tmp_path: Path) -> None:
    ds, _ = broken
    cut = ds.cast_column("image", datasets.Image(decode=False)).map(
        lambda r, i: {"image": {"bytes": b"\xff\xd8\xff\xe0 cut", "path": None}} if i % 3 == 2 else {},
        with_indices=True)  # every row of bucket 2 (64x96) is broken
    data = BucketedImageDataset(cut, BUCKETS, on_bad_image="replace", bad_image_log=tmp_path / "s.jsonl")
    sample = data[(2, 2, 0)]
    assert sample["pixel_values"].shape == (3, 96, 64) and int(data.bucket_ids[sample["row"]]) != 2
    logged = {e["row"] for e in read_bad_rows(tmp_path / "s.jsonl")}
    assert 2 in logged and logged <= {2, 5, 8, 11} | set(BAD)  # bucket 2, or a cut file tried on the way


def test_stale_size_is_replaced_too(broken: tuple[datasets.Dataset, Path], tmp_path: Path) -> None:
    ds, _ = broken
    stale = ds.map(lambda r, i: {"original_width": r["original_width"] + 1} if i == 0 else {}, with_indices=True)
    with pytest.raises(ValueError, match="Row 0: .*annotation says"):
        BucketedImageDataset(stale, BUCKETS, on_bad_image="error")[(0, 0, 0)]
    data = BucketedImageDataset(stale, BUCKETS, on_bad_image="replace", bad_image_log=tmp_path / "s.jsonl")
    assert data[(0, 0, 0)]["row"] != 0
    (entry,) = read_bad_rows(tmp_path / "s.jsonl")
    assert entry["row"] == 0 and "annotation says" in entry["reason"]
