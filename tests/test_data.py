"""BucketedImageDataset + collate_buckets, alone and driven by the real BucketBatchSampler."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from hf_arb import BucketBatchSampler, BucketedImageDataset, BucketSet, add_bucket_columns
from hf_arb.images.collate import collate_buckets
from hf_arb.images.dataset import ImageDecodeError
from hf_arb.images.fitting import EXIF_TRANSPOSE, fit_to_bucket

skimage = pytest.importorskip("skimage")
DATA = Path(os.path.dirname(skimage.__file__)) / "data"
PHOTOS = ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png", "hubble_deep_field.jpg",
          "retina.jpg"]
BUCKETS = BucketSet([(64, 64), (96, 64), (64, 96), (128, 64), (64, 128)])
# displayed (width, height) of the rows: squares, landscapes, portraits, panoramas
SIZES = [(200, 200), (180, 120), (120, 180), (240, 120), (120, 240), (150, 150), (210, 140), (140, 210),
         (260, 130), (130, 260), (160, 160), (195, 130), (130, 195), (250, 125), (125, 250), (170, 170),
         (300, 200), (200, 300), (280, 140), (140, 280)]


def _write(im: Image.Image, path: Path, i: int) -> None:
    """Rows cycle through JPEG, PNG, WebP; every fifth JPEG is stored rotated with EXIF orientation 6."""
    fmt = ("JPEG", "PNG", "WEBP")[i % 3]
    if fmt == "JPEG" and i % 5 == 0:
        exif = Image.Exif()
        exif[0x0112] = 6
        im.transpose(EXIF_TRANSPOSE[8]).save(path, fmt, quality=92, exif=exif.tobytes())  # displays as `im`
    else:
        im.save(path, fmt, **({"quality": 92} if fmt != "PNG" else {}))


@pytest.fixture(scope="module")
def annotated(tmp_path_factory: pytest.TempPathFactory) -> datasets.Dataset:
    root = tmp_path_factory.mktemp("arb_photos")
    paths, captions = [], []
    for i, (w, h) in enumerate(SIZES):
        src = Image.open(DATA / PHOTOS[i % len(PHOTOS)]).convert("RGB")
        ext = ("jpg", "png", "webp")[i % 3]
        path = root / f"img{i:02d}.{ext}"
        _write(src.resize((w, h), Image.LANCZOS), path, i)
        paths.append(str(path))
        captions.append(f"photo {i}" if i % 4 else [f"photo {i} a", f"photo {i} b", f"photo {i} c"])
    ds = datasets.Dataset.from_dict({"image": paths, "text": [c if isinstance(c, str) else c[0] for c in captions]})
    ds = ds.cast_column("image", datasets.Image())
    return add_bucket_columns(ds, BUCKETS, show_summary=False)


def _samples_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        torch.equal(a["pixel_values"], b["pixel_values"])
        and a["crop_top_left"] == b["crop_top_left"]
        and a["flipped"] == b["flipped"]
    )


# --------------------------------------------------------------------------------------- samples
def test_int_rows_fit_their_own_bucket(annotated: datasets.Dataset) -> None:
    data = BucketedImageDataset(annotated, seed=3)
    assert len(data) == len(SIZES)
    np.testing.assert_array_equal(data.resolutions, BUCKETS.resolutions)  # restored from the dataset
    for row in range(len(data)):
        s = data[row]
        bw, bh = BUCKETS[int(annotated[row]["bucket"])]
        assert s["pixel_values"].shape == (3, bh, bw) and s["pixel_values"].dtype == torch.float32
        assert -1.0 <= float(s["pixel_values"].min()) and float(s["pixel_values"].max()) <= 1.0
        w, h = SIZES[row]
        assert s["original_size"] == (h, w)  # displayed size, also for the EXIF-rotated JPEGs
        assert s["target_size"] == (bh, bw)
        assert s["row"] == row and s["bucket"] == annotated[row]["bucket"] and s["epoch"] == 0


def test_pixels_match_fit_to_bucket_on_the_upright_image(annotated: datasets.Dataset) -> None:
    data = BucketedImageDataset(annotated, center_crop=True, draft=False)
    raw = annotated.cast_column("image", datasets.Image(decode=False))
    for row in (3, 5, 10, 0, 15):  # JPEG, WebP, PNG, then the two EXIF-rotated JPEGs
        s = data[row]
        upright = annotated[row]["image"]  # datasets applies exif_transpose when decoding
        ref = fit_to_bucket(upright, BUCKETS[s["bucket"]], crop="center", draft=False)
        assert ref.crop_top_left == s["crop_top_left"]
        if row not in (0, 15):
            assert torch.equal(s["pixel_values"], _to_t(ref.image))
            continue
        # Rotated rows are resized in stored orientation and transposed afterwards: identical to doing that
        # by hand, and within Pillow's inter-pass 8-bit rounding/clipping of transposing first.
        stored = Image.open(raw[row]["image"]["path"]).convert("RGB")
        by_hand = stored.resize(ref.scaled_size[::-1], Image.LANCZOS).transpose(EXIF_TRANSPOSE[6])
        assert torch.equal(s["pixel_values"], _to_t(by_hand)), (
            row,
            (s["pixel_values"] - _to_t(by_hand)).abs().max() * 127.5,
            data.draft,
            stored.size,
        )
        mse = ((s["pixel_values"] - _to_t(ref.image)) * 127.5).pow(2).mean().item()
        assert 10 * np.log10(255**2 / max(mse, 1e-12)) > 40


def _to_t(im: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.array(im)).permute(2, 0, 1).float() / 127.5 - 1


def test_tuple_keys_target_bucket_and_per_row_randomness(annotated: datasets.Dataset) -> None:
    data = BucketedImageDataset(annotated, seed=11, random_flip=True)
    # A target bucket other than the row's own (catch-all / merged batches).
    s = data[(1, 4, 0)]
    assert s["pixel_values"].shape == (3, 128, 64) and s["bucket"] == 4
    # Same key → same sample, in another dataset object too (a restarted process).
    again = BucketedImageDataset(annotated, seed=11, random_flip=True)[(1, 4, 0)]
    assert _samples_equal(s, again)
    # Integer keys use set_epoch and agree with the tuple key of that epoch.
    data.set_epoch(3)
    for row in range(len(data)):
        assert _samples_equal(data[row], data[(row, int(data.bucket_ids[row]), 3)])
    # Epochs and seeds change the decisions.
    decisions = {
        (e, seed): tuple((p.crop_top_left, p.flipped) for p in (
            BucketedImageDataset(annotated, seed=seed, random_flip=True).fit_row(r, epoch=e) for r in range(len(data))))
        for e in range(3) for seed in (0, 1)
    }
    assert len(set(decisions.values())) == len(decisions)


def test_fit_row_predicts_getitem_without_pixels(annotated: datasets.Dataset) -> None:
    data = BucketedImageDataset(annotated, seed=5, random_flip=True)
    flips = []
    for epoch in range(2):
        for row in range(len(data)):
            for bucket in (int(data.bucket_ids[row]), 0):
                plan = data.fit_row(row, bucket, epoch)
                s = data[(row, bucket, epoch)]
                assert (plan.crop_top_left, plan.flipped,
                        plan.original_size) == (s["crop_top_left"], s["flipped"], s["original_size"])
                flips.append(plan.flipped)
    assert 0.25 < np.mean(flips) < 0.75  # random_flip is a coin, not a constant
    # The cache key covers everything that decides the pixels besides the image content.
    base = data.fit_row(0, epoch=0).key()
    for other in (BucketedImageDataset(annotated, seed=5, random_flip=True, resample="bicubic"),
                  BucketedImageDataset(annotated, seed=5, random_flip=True, draft=False),
                  BucketedImageDataset(annotated, seed=5, random_flip=True, background=(0, 0, 0))):
        key = other.fit_row(0, epoch=0).key()
        assert key != base and key[:-1] == base[:-1]
    # Flipping never changes where the crop is taken from (independent random streams).
    plain = BucketedImageDataset(annotated, seed=5)
    for row in range(len(data)):
        assert data.fit_row(row, epoch=1).crop_left == plain.fit_row(row, epoch=1).crop_left


def test_center_crop_is_centred(annotated: datasets.Dataset) -> None:
    data = BucketedImageDataset(annotated, center_crop=True)
    for row in range(len(data)):
        p = data.fit_row(row)
        (sw, sh), (bw, bh) = p.scaled_size, p.bucket
        assert p.crop_top_left == ((sh - bh) // 2, (sw - bw) // 2)


def test_captions_tokenizer_and_collate(annotated: datasets.Dataset) -> None:
    from hf_arb.testing.tiny import tiny_clip_tokenizer

    tok = tiny_clip_tokenizer(model_max_length=16)
    data = BucketedImageDataset(annotated, tokenizer=[tok, tok], seed=0)
    rows = [i for i in range(len(data)) if int(data.bucket_ids[i]) == 0][:3]
    batch = BucketedImageDataset.collate([data[r] for r in rows])
    b = len(rows)
    assert batch["pixel_values"].shape == (b, 3, 64, 64)
    for key in ("original_sizes", "crop_top_lefts", "target_sizes"):
        assert batch[key].shape == (b, 2) and batch[key].dtype == torch.long
    assert batch["rows"].tolist() == rows and batch["buckets"].tolist() == [0] * b
    assert batch["input_ids"].shape == (b, 16) and batch["input_ids_2"].shape == (b, 16)
    assert batch["captions"] == [annotated[r]["text"] for r in rows]
    expected = tok(batch["captions"], max_length=16, padding="max_length", truncation=True,
                   return_tensors="pt").input_ids
    assert torch.equal(batch["input_ids"], expected)
    assert batch["original_sizes"].tolist() == [[SIZES[r][1], SIZES[r][0]] for r in rows]
    with pytest.raises(ValueError, match="one bucket size"):
        collate_buckets([data[(0, 0, 0)], data[(0, 1, 0)]])


def test_caption_lists_and_nulls(annotated: datasets.Dataset) -> None:
    caps: list[Any] = [[f"a{i}", f"b{i}", f"c{i}"] for i in range(len(annotated))]
    caps[1] = None
    ds = annotated.remove_columns("text").add_column("text", caps)
    data = BucketedImageDataset(ds, seed=2)
    assert data[1]["caption"] == ""
    chosen = [data[(0, int(data.bucket_ids[0]), e)]["caption"] for e in range(12)]
    assert set(chosen) <= {"a0", "b0", "c0"} and len(set(chosen)) > 1
    assert chosen == [data[(0, int(data.bucket_ids[0]), e)]["caption"] for e in range(12)]
    assert BucketedImageDataset(annotated, caption_column=None)[0]["caption"] == ""


def test_path_and_bytes_columns(annotated: datasets.Dataset) -> None:
    raw = annotated.cast_column("image", datasets.Image(decode=False))
    paths = [cell["path"] for cell in raw["image"]]
    ref = BucketedImageDataset(annotated, seed=1)
    as_paths = BucketedImageDataset(raw.remove_columns("image").add_column("image", paths), seed=1)
    as_bytes = BucketedImageDataset(
        raw.remove_columns("image").add_column("image", [Path(p).read_bytes() for p in paths]), seed=1)
    for row in (0, 1, 2):  # EXIF JPEG, PNG, WebP
        assert _samples_equal(as_paths[row], ref[row]) and _samples_equal(as_bytes[row], ref[row])


# --------------------------------------------------------------------------------------- errors
def test_decode_failure_names_row_and_source(annotated: datasets.Dataset, tmp_path: Path) -> None:
    bad = tmp_path / "broken.jpg"
    good = Path(annotated.cast_column("image", datasets.Image(decode=False))[3]["image"]["path"])
    bad.write_bytes(good.read_bytes()[:300])  # truncated after annotation read the header
    ds = annotated.cast_column("image", datasets.Image(decode=False))
    ds = ds.map(lambda r, i: {"image": {"path": str(bad), "bytes": None}} if i == 3 else {}, with_indices=True)
    data = BucketedImageDataset(ds, buckets=BUCKETS, on_bad_image="error")
    with pytest.raises(ImageDecodeError, match=r"Row 3: .*broken\.jpg"):
        data[3]
    garbage = tmp_path / "garbage.png"
    garbage.write_bytes(b"not an image at all")
    ds2 = ds.map(lambda r, i: {"image": {"path": str(garbage), "bytes": None}} if i == 7 else {}, with_indices=True)
    with pytest.raises(ImageDecodeError, match=r"Row 7: .*garbage\.png"):
        BucketedImageDataset(ds2, buckets=BUCKETS, on_bad_image="error")[7]


def test_stale_annotation_skipped_rows_and_wrong_buckets(annotated: datasets.Dataset) -> None:
    stale = annotated.map(lambda r, i: {"original_width": r["original_width"] + 1} if i == 2 else {}, with_indices=True)
    with pytest.raises(ValueError, match="Row 2: .*annotation says"):
        BucketedImageDataset(stale, on_bad_image="error")[2]
    assert BucketedImageDataset(stale, check_sizes=False)[2]["original_size"][1] == SIZES[2][0]
    skipped = annotated.map(lambda r, i: {"bucket": -1, "skip_reason": "aspect"} if i == 4 else {}, with_indices=True)
    with pytest.raises(ValueError, match="Row 4 has bucket -1.*aspect"):
        BucketedImageDataset(skipped, buckets=BUCKETS)[4]
    with pytest.raises(ValueError, match="annotated with another"):
        BucketedImageDataset(annotated, buckets=BucketSet([(64, 64), (128, 128), (32, 96), (100, 50), (50, 100)]))
    with pytest.raises(ValueError, match="resample"):
        BucketedImageDataset(annotated, resample="sinc")
    with pytest.raises(ValueError, match="background"):
        BucketedImageDataset(annotated, background=(0, 0))
    with pytest.raises(ValueError, match="not a column"):
        BucketedImageDataset(annotated, caption_column="caption")
    with pytest.raises(IndexError):
        BucketedImageDataset(annotated)[len(annotated)]


def test_fallback_table_from_columns(annotated: datasets.Dataset) -> None:
    from hf_arb.buckets.schema import CONFIG_ID_PREFIX, read_resolutions

    plain = annotated.cast_column("bucket", datasets.Value("int32"))  # the stored BucketSet is lost (e.g. via CSV)
    assert not str(getattr(plain.features["bucket"], "id", "") or "").startswith(CONFIG_ID_PREFIX)
    table = read_resolutions(plain)
    used = np.unique(np.asarray(annotated["bucket"]))
    used = used[used >= 0]
    np.testing.assert_array_equal(table[used], BUCKETS.resolutions[used])


# --------------------------------------------------------------------------------------- with the sampler
def _run_epoch(data: BucketedImageDataset, sampler: BucketBatchSampler, workers: int) -> list[dict[str, Any]]:
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=data.collate, num_workers=workers)
    return list(loader)


def _check_batches(batches: list[dict[str, Any]], sampler: BucketBatchSampler) -> None:
    for batch in batches:
        bucket = batch["buckets"][0].item()
        assert (batch["buckets"] == bucket).all()  # one bucket per batch ...
        bw, bh = BUCKETS[bucket]
        assert batch["pixel_values"].shape[1:] == (3, bh, bw)  # ... and its size
        assert (batch["target_sizes"] == torch.tensor([bh, bw])).all()
        assert batch["pixel_values"].shape[0] == sampler.batch_size


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x["rows"], y["rows"]) and torch.equal(x["crop_top_lefts"], y["crop_top_lefts"])
        and torch.equal(x["flipped"], y["flipped"]) and torch.equal(x["pixel_values"], y["pixel_values"])
        for x, y in zip(a, b)
    )


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_with_bucket_batch_sampler_and_resume(annotated: datasets.Dataset, workers: int) -> None:
    def make() -> tuple[BucketedImageDataset, BucketBatchSampler]:
        data = BucketedImageDataset(annotated, seed=7, random_flip=True)
        sampler = BucketBatchSampler(annotated, 2, num_replicas=1, rank=0, seed=7, leftover="catch_all",
                                     return_keys=True, log_report=False)
        return data, sampler

    data, sampler = make()
    sampler.set_epoch(1)
    full = _run_epoch(data, sampler, workers)
    assert len(full) == len(sampler)
    _check_batches(full, sampler)

    # Simulated resume: a fresh process restores the sampler state after k batches, then finishes the epoch.
    k = len(full) // 2
    _, probe = make()
    probe.set_epoch(1)
    it = iter(probe)
    for _ in range(k):
        next(it)
    state = probe.state_dict()
    data2, resumed = make()
    resumed.load_state_dict(state)
    tail = _run_epoch(data2, resumed, workers)
    assert _same(tail, full[k:])  # same rows, same crops, same flips, same pixels

    # Integer-row batches (return_keys=False) are one bucket each too.
    plain = BucketBatchSampler(annotated, 2, num_replicas=1, rank=0, seed=7, log_report=False)
    _check_batches(_run_epoch(data, plain, workers), plain)


def test_catch_all_batches_use_the_target_bucket(annotated: datasets.Dataset) -> None:
    data = BucketedImageDataset(annotated, seed=1)
    sampler = BucketBatchSampler(annotated, 3, num_replicas=1, rank=0, seed=1, leftover="catch_all",
                                 return_keys=True, log_report=False)
    keys = [key for batch in sampler for key in batch]
    foreign = [(r, b, e) for r, b, e in keys if b != int(data.bucket_ids[r])]
    assert foreign, "this dataset's buckets do not divide by 3: the catch-all bucket must serve some rows"
    for key in foreign[:3]:
        s = data[key]
        assert s["pixel_values"].shape[1:] == BUCKETS[key[1]][::-1]


@pytest.mark.slow
def test_workers_reproduce_single_process(annotated: datasets.Dataset) -> None:
    data = BucketedImageDataset(annotated, seed=4, random_flip=True)
    a = _run_epoch(data, BucketBatchSampler(annotated, 2, num_replicas=1, rank=0, seed=4, return_keys=True,
                                            log_report=False), 0)
    b = _run_epoch(data, BucketBatchSampler(annotated, 2, num_replicas=1, rank=0, seed=4, return_keys=True,
                                            log_report=False), 2)
    assert _same(a, b)


def test_two_ranks_share_the_bucket_at_every_step(annotated: datasets.Dataset) -> None:
    data = BucketedImageDataset(annotated, seed=9)
    per_rank = [
        _run_epoch(data, BucketBatchSampler(annotated, 2, num_replicas=2, rank=r, seed=9, return_keys=True,
                                            log_report=False).shard(), 0)
        for r in range(2)
    ]
    assert len(per_rank[0]) == len(per_rank[1]) > 0
    for a, b in zip(*per_rank):
        assert a["pixel_values"].shape == b["pixel_values"].shape
        assert not set(a["rows"].tolist()) & set(b["rows"].tolist())
