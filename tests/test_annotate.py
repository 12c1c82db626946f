"""add_bucket_columns: header path, metadata path, streaming, num_proc, skip reasons, summary."""

from __future__ import annotations

from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pytest
from _photos import save_photo
from PIL import Image

from hf_arb import BucketSet, add_bucket_columns
from hf_arb.annotate.map import BUCKET_COLUMNS, annotate_sizes, summarize_annotation, summarize_columns

BAD = {"zz_empty.jpg": "unreadable: empty (0 bytes)", "zz_text.jpg": "unreadable: not an image",
       "zz_cut.jpg": "unreadable: truncated or corrupt JPEG header"}


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An imagefolder of real photos: JPEGs with EXIF orientations, PNG/RGBA/palette/WebP/GIF, and broken files."""
    d = tmp_path_factory.mktemp("imgs")
    names = ["coffee.png", "chelsea.png", "rocket.jpg", "motorcycle_left.png", "hubble_deep_field.jpg", "cell.png"]
    for o in range(1, 9):
        save_photo(d / f"a{o}_orient.jpg", names[o % len(names)], "JPEG", o, quality=85)
    save_photo(d / "b_plain.png", "coffee.png", "PNG")
    save_photo(d / "b_rgba.png", "horse.png", "PNG")
    save_photo(d / "b_wide.webp", "coffee.png", "WEBP", size=(1000, 150))
    save_photo(d / "b_tall.png", "chelsea.png", "PNG", size=(150, 700))
    save_photo(d / "b_tiny.jpg", "chelsea.png", "JPEG", size=(60, 40))
    img = Image.open(d / "b_plain.png").convert("P", palette=Image.Palette.ADAPTIVE)
    img.save(d / "b_palette.gif")
    (d / "zz_empty.jpg").write_bytes(b"")
    (d / "zz_text.jpg").write_text("not an image at all\n" * 5)
    (d / "zz_cut.jpg").write_bytes((d / "a1_orient.jpg").read_bytes()[:150])
    return d


@pytest.fixture(scope="module")
def image_ds(image_dir: Path) -> datasets.Dataset:
    ds = datasets.load_dataset("imagefolder", data_dir=str(image_dir), split="train")
    # keep the file name to identify rows (imagefolder has no such column)
    paths = [Path(p["path"]).name for p in ds.cast_column("image", datasets.Image(decode=False))["image"]]
    return ds.add_column("name", paths)


def _cols(ds: datasets.Dataset) -> dict[str, list]:
    return ds.select_columns(list(BUCKET_COLUMNS)).to_dict()


def test_header_path_matches_decoded_images(image_ds: datasets.Dataset) -> None:
    bs = BucketSet.novelai()
    out = add_bucket_columns(image_ds, bs, batch_size=4, show_summary=False)
    assert out.num_rows == image_ds.num_rows
    assert out.column_names == image_ds.column_names + list(BUCKET_COLUMNS)
    feats = out.features
    assert [feats[c].dtype for c in BUCKET_COLUMNS] == ["int32"] * 5 + ["float32", "string"]
    assert isinstance(feats["image"], datasets.Image) and feats["image"].decode
    cols = _cols(out)
    names = out["name"]
    good = [i for i, n in enumerate(names) if n not in BAD]
    assert len(good) == out.num_rows - len(BAD)
    # the rest of the batch is annotated: sizes equal what datasets decodes (exif_transpose applied)
    sub = out.select(good)
    decoded = [im.size for im in sub["image"]]
    assert all(isinstance(im, Image.Image) for im in sub.select(range(2))["image"])
    got = [(cols["original_width"][i], cols["original_height"][i]) for i in good]
    assert got == decoded
    ids, err = bs.assign(*np.asarray(decoded, dtype=np.float64).T)
    assert [cols["bucket"][i] for i in good] == ids.tolist()
    np.testing.assert_allclose([cols["aspect_error"][i] for i in good], err, rtol=1e-6, atol=1e-7)
    assert [(cols["bucket_width"][i], cols["bucket_height"][i]) for i in good] == [bs[i] for i in ids.tolist()]
    # EXIF 5-8 files: the stored (header) size was swapped
    raw = out.cast_column("image", datasets.Image(decode=False))["image"]
    for i, n in enumerate(names):
        if n.startswith("a"):
            stored = Image.open(raw[i]["path"]).size
            want = stored[::-1] if int(n[1]) >= 5 else stored
            assert (cols["original_width"][i], cols["original_height"][i]) == want, n
            assert stored[0] != stored[1]  # non-square, so a missed swap would show
    # bad files: recorded with their reason, never raised
    for i, n in enumerate(names):
        if n in BAD:
            assert cols["bucket"][i] == -1 and cols["skip_reason"][i] == BAD[n]
            assert cols["bucket_width"][i] is None and cols["original_width"][i] is None
            assert cols["aspect_error"][i] is None
        else:
            assert cols["skip_reason"][i] is None


def test_streaming_and_map_style_identical(image_dir: Path, image_ds: datasets.Dataset) -> None:
    bs = BucketSet.sdxl(max_aspect_error=0.1)
    plain = image_ds.remove_columns("name")
    ref = _cols(add_bucket_columns(plain, bs, batch_size=5, show_summary=False))
    it = add_bucket_columns(plain.to_iterable_dataset(), bs, batch_size=3)
    assert isinstance(it, datasets.IterableDataset)
    # images stay encoded in the annotated stream: a broken one cannot end the iteration (test_fault_stream.py)
    assert it.features["bucket"].dtype == "int32" and not it.features["image"].decode
    assert BucketSet.from_dataset(it) == bs  # the configuration rides along with the stream's features
    rows = list(it.select_columns(list(BUCKET_COLUMNS)))
    assert {c: [r[c] for r in rows] for c in BUCKET_COLUMNS} == ref
    first = next(iter(it))  # {"bytes", "path"}: the loader (or datasets.Image().decode_example) decodes it
    assert datasets.Image().decode_example(first["image"]).size == (first["original_width"], first["original_height"])
    # a real streaming imagefolder load gives the same columns too
    stream = datasets.load_dataset("imagefolder", data_dir=str(image_dir), split="train", streaming=True)
    rows = list(add_bucket_columns(stream, bs, batch_size=7).select_columns(list(BUCKET_COLUMNS)))
    assert {c: [r[c] for r in rows] for c in BUCKET_COLUMNS} == ref
    assert "aspect" in ref["skip_reason"], "the 1000x150 and 150x700 images exceed max_aspect_error 0.1"


def test_num_proc_2_identical_to_1(image_ds: datasets.Dataset) -> None:
    bs = BucketSet.from_budget(512)
    one = add_bucket_columns(image_ds, bs, num_proc=None, batch_size=3, show_summary=False)
    two = add_bucket_columns(image_ds, bs, num_proc=2, batch_size=3, show_summary=False)
    assert _cols(one) == _cols(two)
    assert one["name"] == two["name"]


def test_metadata_path_agrees_with_assign_and_opens_no_image() -> None:
    rng = np.random.default_rng(7)
    n = 5000
    w = rng.integers(32, 4000, n).astype(np.float64)
    h = rng.integers(32, 4000, n).astype(np.float64)
    w[:3] = [np.nan, 0, -5]  # missing, invalid, invalid
    table = pa.table({
        "WIDTH": pa.array(w, mask=np.isnan(w)),
        "HEIGHT": pa.array(h),
        # an image column of paths that do not exist: touching it would give "unreadable" rows
        "image": pa.array([f"/nonexistent/{i}.jpg" for i in range(n)]),
    })
    ds = datasets.Dataset(table)
    bs = BucketSet.novelai(metric="linear", aspect_range=(0.25, 4.0))
    out = add_bucket_columns(ds, bs, image_column=None, width_column="WIDTH", height_column="HEIGHT",
                             show_summary=False)
    cols = _cols(out)
    ids, err = bs.assign(w[3:], h[3:])
    assert cols["bucket"][3:] == ids.tolist()
    np.testing.assert_allclose(np.asarray(cols["aspect_error"][3:], dtype=np.float64), err, rtol=1e-6)
    assert cols["skip_reason"][:3] == ["missing", "invalid_size", "invalid_size"]
    assert cols["bucket"][:3] == [-1, -1, -1]
    reasons = np.asarray(cols["skip_reason"][3:], dtype=object)
    assert set(reasons[ids < 0]) == {"aspect"} and ids.min() == -1
    assert all(r is None for r in reasons[ids >= 0])
    assert not any(r and r.startswith("unreadable") for r in cols["skip_reason"])
    # deterministic: same inputs, same fingerprint and columns
    again = add_bucket_columns(ds, bs, image_column=None, width_column="WIDTH", height_column="HEIGHT",
                               show_summary=False)
    assert again._fingerprint == out._fingerprint and _cols(again) == cols


def test_metadata_streaming_equals_map_style() -> None:
    rng = np.random.default_rng(3)
    w = rng.integers(50, 3000, 300).tolist()
    h = rng.integers(50, 3000, 300).tolist()
    w[5] = None
    ds = datasets.Dataset.from_dict({"w": w, "h": h})
    bs = BucketSet.sdxl()
    ref = _cols(add_bucket_columns(ds, bs, image_column=None, width_column="w", height_column="h",
                                   show_summary=False, max_upscale=1.5, min_size=256))
    it = add_bucket_columns(ds.to_iterable_dataset(), bs, image_column=None, width_column="w", height_column="h",
                            batch_size=64, max_upscale=1.5, min_size=256)
    rows = list(it)
    assert {c: [r[c] for r in rows] for c in BUCKET_COLUMNS} == ref


def test_max_upscale_and_min_size() -> None:
    rng = np.random.default_rng(11)
    w = rng.integers(100, 2500, 2000)
    h = rng.integers(100, 2500, 2000)
    bs = BucketSet.sdxl()
    t = annotate_sizes(w, h, bs, max_upscale=2.0, min_size=300)
    d = t.to_pydict()
    ids, _ = bs.assign(w, h)
    res = bs.resolutions[ids]
    scale = np.maximum(res[:, 0] / w, res[:, 1] / h)
    reason = np.asarray(d["skip_reason"], dtype=object)
    small = np.minimum(w, h) < 300
    assert np.array_equal(reason == "too_small", small)
    assert np.array_equal(reason == "upscale", ~small & (scale > 2.0))
    kept = np.asarray(d["bucket"]) >= 0
    assert np.array_equal(kept, ~small & (scale <= 2.0))
    assert (scale[kept] <= 2.0).all() and kept.any() and (~kept).any()
    assert np.array_equal(np.asarray(d["bucket"])[kept], ids[kept])
    with pytest.raises(ValueError, match="max_upscale"):
        annotate_sizes(w, h, bs, max_upscale=0)


def test_summary_matches_columns(image_ds: datasets.Dataset, capsys: pytest.CaptureFixture[str]) -> None:
    bs = BucketSet.novelai(max_aspect_error=0.2)
    out = add_bucket_columns(image_ds, bs, show_summary=True)
    printed = capsys.readouterr().out
    s = summarize_annotation(out)  # BucketSet restored from the dataset
    assert str(s) in printed
    cols = _cols(out)
    assert s.rows == out.num_rows
    assert s.kept == sum(b >= 0 for b in cols["bucket"]) == int(s.assignment.counts.sum())
    cats: dict[str, int] = {}
    for r in cols["skip_reason"]:
        if r:
            cats[r.split(":")[0]] = cats.get(r.split(":")[0], 0) + 1
    assert s.skipped_by_reason == cats and cats["unreadable"] == len(BAD)
    kept_err = [e for b, e in zip(cols["bucket"], cols["aspect_error"]) if b >= 0]
    assert s.assignment.error_max == pytest.approx(max(kept_err), rel=1e-6)
    assert "skipped by reason" in printed and "unreadable" in printed
    d = s.to_dict()
    assert sum(d["counts"].values()) == s.kept


def test_summary_outliers_vectorised() -> None:
    """Kept rows past the warning thresholds are counted, the worst shown first; a threshold set by the user
    (``max_aspect_error`` in the BucketSet, ``warn_upscale=None``) silences its warning."""
    w = np.array([1000, 2000, 32, 640, 40, 3000, 0])
    h = np.array([1000, 100, 48, 427, 40, 200, 10])  # last row: invalid size (skipped, no bucket)
    bs = BucketSet.novelai()
    t = annotate_sizes(w, h, bs)
    cols = [t.column(c) for c in ("bucket", "aspect_error", "skip_reason")]
    sizes = (t.column("original_width"), t.column("original_height"))
    s = summarize_columns(*cols, bs, sizes=sizes)
    aspect, up = s.outliers
    err = t.column("aspect_error").to_numpy(zero_copy_only=False)
    assert aspect.kind == "aspect_error" and aspect.count == 2  # the 20:1 banner and the 15:1 strip
    assert [e[0] for e in aspect.examples] == [1, 5] and aspect.worst == pytest.approx(float(err[1]))
    assert aspect.examples[0][1:5] == (2000, 100, 1024, 256) and aspect.worst > 1.6
    res = bs.resolutions[t.column("bucket").to_numpy()[:6]]
    scale = np.maximum(res[:, 0] / w[:6], res[:, 1] / h[:6])
    assert up.count == int((scale > 2).sum()) == 3 and up.examples[0][:5] == (2, 32, 48, 512, 768)
    assert up.worst == pytest.approx(16.0)
    text = str(s)
    assert "2 kept rows have an aspect error above 0.25" in text and "--max-aspect-error 0.25" in text
    assert "e.g. row 2: 32x48 -> bucket 512x768 (16.0x)" in text and "--max-upscale 2" in text
    assert "--min-size" in text
    quiet = summarize_columns(*cols, bs, sizes=sizes, warn_aspect_error=None, warn_upscale=None)
    assert quiet.outliers == () and "warning" not in str(quiet)
    pruned = BucketSet.novelai(max_aspect_error=0.5)
    tp = annotate_sizes(w, h, pruned)
    sp = summarize_columns(*(tp.column(c) for c in ("bucket", "aspect_error", "skip_reason")), pruned,
                           sizes=(tp.column("original_width"), tp.column("original_height")))
    assert [o.kind for o in sp.outliers] == ["upscale"] and sp.skipped_by_reason == {"aspect": 2, "invalid_size": 1}


def test_reannotation_replaces_columns_and_image_still_decodes(image_ds: datasets.Dataset) -> None:
    once = add_bucket_columns(image_ds, BucketSet.novelai(), show_summary=False)
    twice = add_bucket_columns(once, BucketSet.sdxl(), show_summary=False)
    assert twice.column_names == once.column_names
    assert BucketSet.from_dataset(twice) == BucketSet.sdxl()
    assert twice.select([0])["bucket_width"][0] in {w for w, _ in BucketSet.sdxl()}
    assert isinstance(twice[0]["image"], Image.Image)


def test_dataset_dict_and_shuffled(image_ds: datasets.Dataset) -> None:
    dd = datasets.DatasetDict({"train": image_ds, "test": image_ds.select(range(4))})
    out = add_bucket_columns(dd, BucketSet.novelai(), show_summary=False)
    assert isinstance(out, datasets.DatasetDict) and set(out) == {"train", "test"}
    assert _cols(out["test"]) == _cols(out["train"].select(range(4)))
    shuffled = image_ds.shuffle(seed=1)  # an indices mapping: rows must stay aligned with their images
    s = add_bucket_columns(shuffled, BucketSet.novelai(), show_summary=False)
    by_name = dict(zip(out["train"]["name"], out["train"]["original_width"]))
    assert all(by_name[n] == w for n, w in zip(s["name"], s["original_width"]))


def test_errors_name_the_fix(image_ds: datasets.Dataset) -> None:
    bs = BucketSet.novelai()
    with pytest.raises(ValueError, match=r"image_column='img': the dataset has no such column; its columns are \["):
        add_bucket_columns(image_ds, bs, image_column="img")
    with pytest.raises(ValueError, match="both"):
        add_bucket_columns(image_ds, bs, width_column="w")
    with pytest.raises(TypeError, match="BucketSet"):
        add_bucket_columns(image_ds, [(512, 512)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Nothing to read"):
        add_bucket_columns(image_ds, bs, image_column=None)


def test_null_images_are_missing() -> None:
    ds = datasets.Dataset.from_dict({"image": [None, None]}, features=datasets.Features({"image": datasets.Image()}))
    out = add_bucket_columns(ds, BucketSet.novelai(), show_summary=False)
    assert out["skip_reason"] == ["missing", "missing"] and out["bucket"] == [-1, -1]


def test_embedded_bytes_like_hub_parquet(image_dir: Path) -> None:
    """Hub datasets store encoded bytes in the Image struct: read zero-copy from Arrow, same as streaming."""
    files = sorted(image_dir.iterdir())
    values = [{"bytes": f.read_bytes(), "path": f.name} for f in files]
    values += [{"bytes": None, "path": str(image_dir / "gone.jpg")}, None, {"bytes": b"", "path": "empty.png"}]
    ds = datasets.Dataset.from_dict({"image": values}, features=datasets.Features({"image": datasets.Image()}))
    bs = BucketSet.novelai()
    out = add_bucket_columns(ds, bs, batch_size=6, show_summary=False)
    cols = _cols(out)
    streamed = list(add_bucket_columns(ds.to_iterable_dataset(), bs, batch_size=4).select_columns(list(BUCKET_COLUMNS)))
    assert {c: [r[c] for r in streamed] for c in BUCKET_COLUMNS} == cols
    by_file = {f.name: (w, h) for f, w, h in zip(files, cols["original_width"], cols["original_height"])}
    for f in files:
        if f.name not in BAD:
            assert by_file[f.name] == datasets.Image().decode_example({"bytes": f.read_bytes(), "path": None}).size
    assert cols["skip_reason"][-3:] == ["unreadable: file not found", "missing", "unreadable: empty (0 bytes)"]
    assert [cols["skip_reason"][i] for i, f in enumerate(files) if f.name in BAD] == [BAD[f.name] for f in files
                                                                                     if f.name in BAD]
