"""EXIF orientation is applied exactly once, for every orientation and every format that carries it.

The reference is what ``datasets`` hands to training: a full decode followed by ``ImageOps.exif_transpose``.
Pillow's TIFF plugin rotates while it loads (and reports the rotated size before), the JPEG, PNG and WebP
plugins do not: header sizes (:func:`read_image_size`) and fitted pixels (:func:`fit_to_bucket`) must agree
with the reference either way.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from _photos import encode, photo
from PIL import Image, ImageOps, features

from hf_arb import fit_to_bucket, read_image_size
from hf_arb.images.fitting import EXIF_TRANSPOSE

# inverse of each EXIF transpose: stored = displayed.transpose(EXIF_TRANSPOSE[_INVERSE[o]])
_INVERSE = {2: 2, 3: 3, 4: 4, 5: 5, 6: 8, 7: 7, 8: 6}
DISPLAYED = photo("chelsea.png", (150, 100))  # not square, not symmetric


def _encoded(fmt: str, orientation: int) -> bytes:
    stored = DISPLAYED if orientation == 1 else DISPLAYED.transpose(EXIF_TRANSPOSE[_INVERSE[orientation]])
    kw = {"quality": 95} if fmt in ("JPEG", "WEBP", "AVIF") else {}
    return encode(stored, fmt, orientation, **kw)


def _reference(data: bytes) -> Image.Image:
    im = Image.open(io.BytesIO(data))
    im.load()  # full decode, then the transpose datasets applies
    return ImageOps.exif_transpose(im).convert("RGB")


def _psnr(a: Image.Image, b: Image.Image) -> float:
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    return float(10 * np.log10(255**2 / max(np.mean(d**2), 1e-12)))


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "TIFF"] + (["AVIF"] if features.check("avif") else []))
def test_orientation_applied_once(fmt: str, orientation: int) -> None:
    data = _encoded(fmt, orientation)
    assert Image.open(io.BytesIO(data)).getexif().get(0x0112, 1) == orientation  # AVIF omits orientation 1
    ref = _reference(data)
    assert ref.size == DISPLAYED.size and _psnr(ref, DISPLAYED) > 30  # the reference itself is upright
    # sizes: header only, from bytes and from an opened (not loaded) image
    assert read_image_size(data) == ref.size
    assert read_image_size(Image.open(io.BytesIO(data))) == ref.size
    # imaging: fit the encoded file vs fit the reference decode (no tag left), same plan
    for bucket in [(96, 64), (64, 96)]:
        got = fit_to_bucket(data, bucket, crop="center", draft=False)
        want = fit_to_bucket(ref, bucket, crop="center")
        assert got.original_size == want.original_size == (100, 150)
        assert got.scaled_size == want.scaled_size and got.crop_top_left == want.crop_top_left
        diff = np.abs(np.asarray(got.image, np.int16) - np.asarray(want.image, np.int16))
        # resize runs in stored orientation then transposes: Pillow's two 8-bit passes swap order for 5-8,
        # and LANCZOS' negative lobes can carry a rounding step over: a few levels there, none elsewhere on average.
        # (A double rotation differs by ~100 levels on average, or in size.)
        assert diff.max() <= (1 if orientation <= 4 else 3) and diff.mean() < 0.3, (diff.max(), diff.mean())


def test_tiff_rotated_dataset_passes_size_check(tmp_path) -> None:  # noqa: ANN001
    """BucketedImageDataset's size check (header annotation vs opened image) holds for rotated TIFFs."""
    import datasets

    from hf_arb import BucketedImageDataset, BucketSet, add_bucket_columns

    values = [{"bytes": _encoded("TIFF", o), "path": f"o{o}.tif"} for o in range(1, 9)]
    ds = datasets.Dataset.from_dict({"image": values, "text": ["x"] * 8},
                                    features=datasets.Features({"image": datasets.Image(),
                                                                "text": datasets.Value("string")}))
    ds = add_bucket_columns(ds, BucketSet.from_budget(128, step=32), show_summary=False)
    assert ds["skip_reason"] == [None] * 8
    data = BucketedImageDataset(ds, center_crop=True, seed=0)
    ref = data[0]["pixel_values"]
    for row in range(1, 8):
        assert float((data[row]["pixel_values"] - ref).abs().max()) <= 2 / 127.5 + 1e-6
