"""Every format Pillow reads gives the same bucket columns from a file path and from embedded bytes.

Hub Parquet, ``save_to_disk`` and ``push_to_hub`` store encoded bytes in the ``Image`` struct; imagefolder stores
paths. Map-style annotation reads the bytes zero-copy from Arrow, streaming gets Python bytes: all four routes
(and ``num_proc=2``) must agree with each other and with what ``datasets`` decodes.
"""

from __future__ import annotations

import io
from pathlib import Path

import datasets
import pytest
from _photos import encode, photo
from PIL import Image, features

from hf_arb import BucketSet, add_bucket_columns, read_image_size
from hf_arb.annotate.map import BUCKET_COLUMNS


def _multi(fmt: str, img: Image.Image, **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, save_all=True, append_images=[img.resize((img.width // 2, img.height // 2)).resize(img.size)],
             **kw)
    return buf.getvalue()


def _zoo() -> dict[str, bytes]:
    """name -> encoded bytes: one or more files per format, still and multi-frame, some with EXIF orientation."""
    img = photo("chelsea.png", (150, 100))
    rgba = photo("horse.png", (120, 98))
    zoo = {
        "jpeg.jpg": encode(img, "JPEG", quality=85),
        "jpeg_o6.jpg": encode(img, "JPEG", 6),
        "png.png": encode(img, "PNG"),
        "png_rgba_o8.png": encode(rgba, "PNG", 8),
        "webp_lossy.webp": encode(img, "WEBP"),
        "webp_lossless_o5.webp": encode(rgba, "WEBP", 5, lossless=True),
        "webp_anim.webp": _multi("WEBP", img),
        "gif.gif": encode(img.convert("P"), "GIF"),
        "gif_anim.gif": _multi("GIF", img),
        "apng.png": _multi("PNG", img),
        "tiff.tif": encode(img, "TIFF"),
        "tiff_lzw_o7.tif": encode(img, "TIFF", 7, compression="tiff_lzw"),
        "tiff_multi.tif": _multi("TIFF", img),
        "bmp.bmp": encode(img, "BMP"),
        "tga.tga": encode(img, "TGA"),
        "ppm.ppm": encode(img, "PPM"),
        "ico.ico": encode(img, "ICO", sizes=[(48, 32)]),
    }
    if features.check("avif"):
        zoo["avif.avif"] = encode(img, "AVIF")
    if features.check("jpg_2000"):
        zoo["jp2.jp2"] = encode(img, "JPEG2000")
    return zoo


ZOO = _zoo()


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("zoo")
    for name, data in ZOO.items():
        (d / name).write_bytes(data)
    return d


def _expected(data: bytes) -> tuple[int, int]:
    """What training sees: datasets' decode (Pillow full decode + exif_transpose)."""
    return datasets.Image().decode_example({"bytes": data, "path": None}).size


def _rows(ds: datasets.Dataset | datasets.IterableDataset) -> dict[str, list]:
    if isinstance(ds, datasets.IterableDataset):
        rows = list(ds.select_columns(list(BUCKET_COLUMNS)))
        return {c: [r[c] for r in rows] for c in BUCKET_COLUMNS}
    return ds.select_columns(list(BUCKET_COLUMNS)).to_dict()


@pytest.mark.parametrize("name", sorted(ZOO))
def test_header_size_is_what_datasets_decodes(name: str, zoo_dir: Path) -> None:
    data = ZOO[name]
    assert read_image_size(data) == read_image_size(zoo_dir / name) == _expected(data)


@pytest.mark.parametrize("route", ["map", "map_num_proc_2", "streaming", "saved_to_disk"])
def test_bytes_and_paths_agree_for_every_format(route: str, zoo_dir: Path, tmp_path: Path) -> None:
    names = sorted(ZOO)
    feats = datasets.Features({"image": datasets.Image(), "name": datasets.Value("string")})
    by_path = datasets.Dataset.from_dict({"image": [str(zoo_dir / n) for n in names], "name": names}, features=feats)
    by_bytes = datasets.Dataset.from_dict(
        {"image": [{"bytes": ZOO[n], "path": n} for n in names], "name": names}, features=feats)
    if route == "saved_to_disk":  # what load_from_disk / Hub Parquet hand back: bytes in an Arrow struct
        by_bytes.save_to_disk(str(tmp_path / "saved"))
        by_bytes = datasets.load_from_disk(str(tmp_path / "saved"))
    bs = BucketSet.from_budget(256, step=32)
    out = {}
    for kind, ds in (("path", by_path), ("bytes", by_bytes)):
        if route == "streaming":
            ds = ds.to_iterable_dataset()
        out[kind] = _rows(add_bucket_columns(ds, bs, batch_size=5, num_proc=2 if route == "map_num_proc_2" else None,
                                             show_summary=False))
    assert out["bytes"] == out["path"]
    cols = out["bytes"]
    assert cols["skip_reason"] == [None] * len(names), dict(zip(names, cols["skip_reason"]))  # rows in = rows kept
    got = dict(zip(names, zip(cols["original_width"], cols["original_height"])))
    assert got == {n: _expected(ZOO[n]) for n in names}
    assert got["jpeg_o6.jpg"] == (100, 150) and got["tiff_lzw_o7.tif"] == (100, 150)  # orientation honoured once
