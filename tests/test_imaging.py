"""fit_to_bucket / plan_fit / to_tensor: geometry, pixels, EXIF, colour modes, flip, determinism, fast path.

Real photographs come from scikit-image's bundled data (astronaut, chelsea, coffee, rocket, retina, ...),
written to real JPEG / PNG / WebP files with EXIF orientation tags.
"""

from __future__ import annotations

import io
import os
import random
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps

from hf_arb.images.fitting import (
    EXIF_TRANSPOSE,
    FitPlan,
    fit_to_bucket,
    plan_fit,
    to_rgb,
    to_tensor,
)
from hf_arb.images.geometry import cover_size

skimage = pytest.importorskip("skimage")
DATA = Path(os.path.dirname(skimage.__file__)) / "data"
PHOTOS = ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png", "hubble_deep_field.jpg",
          "retina.jpg"]


def photo(name: str) -> Image.Image:
    return Image.open(DATA / name).convert("RGB")


def psnr(a: Image.Image | np.ndarray, b: Image.Image | np.ndarray) -> float:
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    mse = float(((a64 - b64) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def mosaic(width: int, height: int, names: list[str], seed: int = 0) -> Image.Image:
    """A large real-photo canvas: photos pasted at native resolution (keeps their real detail)."""
    rng = np.random.default_rng(seed)
    canvas, y = Image.new("RGB", (width, height)), 0
    while y < height:
        x, row_h = 0, 0
        while x < width:
            p = photo(names[int(rng.integers(len(names)))])
            canvas.paste(p, (x, y))
            x, row_h = x + p.width, max(row_h, p.height)
        y += row_h
    return canvas


def jpeg_bytes(im: Image.Image, quality: int = 90, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=quality, **kw)
    return buf.getvalue()


# --------------------------------------------------------------------------------------- geometry
sizes = st.integers(1, 6000)
bucket_sides = st.integers(8, 2048)


@settings(max_examples=400, deadline=None)
@given(w=sizes, h=sizes, bw=bucket_sides, bh=bucket_sides, seed=st.integers(0, 2**32 - 1), flip=st.booleans())
def test_geometry_grid(w: int, h: int, bw: int, bh: int, seed: int, flip: bool) -> None:
    sw, sh = cover_size(w, h, bw, bh)
    scale = max(Fraction(bw, w), Fraction(bh, h))  # exact cover scale
    # Covers the bucket, never one pixel short.
    assert sw >= bw and sh >= bh
    # The fitted dimension maps exactly to the bucket side; the other is the exact product rounded.
    if Fraction(bw, w) >= Fraction(bh, h):
        assert sw == bw and abs(sh - h * scale) <= Fraction(1, 2)
    else:
        assert sh == bh and abs(sw - w * scale) <= Fraction(1, 2)
    # The crop removes less than one pixel plus rounding beyond the exact cover.
    assert sw - w * scale <= Fraction(1, 2) and sh - h * scale <= Fraction(1, 2)

    for crop in ("random", "center"):
        plan = plan_fit((w, h), (bw, bh), crop=crop, rng=np.random.default_rng(seed), flip=flip)
        y, x = plan.crop_top_left
        assert plan.scaled_size == (sw, sh)
        assert plan.original_size == (h, w) and plan.target_size == (bh, bw)
        assert 0 <= x <= sw - bw and 0 <= y <= sh - bh  # crop inside the scaled image
        assert 0 <= plan.crop_left <= sw - bw
        left, top, right, bottom = plan.source_box
        assert -1e-9 <= left < right <= w + 1e-9 and -1e-9 <= top < bottom <= h + 1e-9
        if crop == "center":
            # centred within one pixel: offsets on both sides differ by at most 1
            assert abs((sw - bw - x) - x) <= 1 and abs((sh - bh - y) - y) <= 1


def test_cover_size_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="positive whole number"):
        cover_size(0, 10, 64, 64)
    with pytest.raises(ValueError, match="positive whole number"):
        cover_size(10.5, 10, 64, 64)  # type: ignore[arg-type]


def test_random_crop_reaches_every_offset() -> None:
    rng = np.random.default_rng(0)
    xs = {plan_fit((300, 100), (64, 64), crop="random", rng=rng).crop_top_left[1] for _ in range(3000)}
    assert xs == set(range(192 - 64 + 1))  # scaled to 192x64: every offset 0..128 is drawn


@settings(max_examples=25, deadline=None)
@given(w=st.integers(3, 400), h=st.integers(3, 400), bw=st.integers(8, 300), bh=st.integers(8, 300),
       seed=st.integers(0, 1000))
def test_fit_output_size_on_pixels(w: int, h: int, bw: int, bh: int, seed: int) -> None:
    im = Image.new("RGB", (w, h), (10, 20, 30))
    res = fit_to_bucket(im, (bw, bh), rng=np.random.default_rng(seed))
    assert res.image.size == (bw, bh) and res.image.mode == "RGB"
    assert res.original_size == (h, w)
    assert res.target_size == (bh, bw)


@pytest.mark.parametrize("resample", ["lanczos", "bicubic", "bilinear", "box"])
def test_one_box_resize_equals_full_resize_then_crop(resample: str) -> None:
    im = photo("chelsea.png")  # 451 x 300
    filt = {"lanczos": Image.LANCZOS, "bicubic": Image.BICUBIC, "bilinear": Image.BILINEAR, "box": Image.BOX}[resample]
    rng = np.random.default_rng(1)
    buckets = [(256, 256), (192, 320), (640, 384), (333, 129)]  # downscales, upscale, odd sizes
    if resample == "box":
        # Box upscaling is nearest-neighbour: a float ulp in the box offset can move a tie to the next pixel.
        buckets.remove((640, 384))
    for bucket in buckets:
        res = fit_to_bucket(im, bucket, rng=rng, resample=resample)
        (sw, sh), (y, x) = res.scaled_size, res.crop_top_left
        ref = im.resize((sw, sh), filt).crop((x, y, x + bucket[0], y + bucket[1]))
        diff = np.abs(np.asarray(res.image, dtype=np.int16) - np.asarray(ref, dtype=np.int16))
        assert diff.max() <= 1, (bucket, diff.max())  # float box coordinates: at most one 8-bit step


def test_content_stays_in_place() -> None:
    im = Image.new("RGB", (600, 300), (0, 0, 255))
    im.paste((255, 0, 0), (0, 0, 300, 300))  # red left half, blue right half
    for bucket, crop in [((512, 256), "center"), ((256, 256), "center"), ((320, 512), "random"), ((64, 256), "center")]:
        res = fit_to_bucket(im, bucket, crop=crop, rng=np.random.default_rng(0))  # type: ignore[arg-type]
        a = np.asarray(res.image)
        sw = res.scaled_size[0]
        split = sw / 2 - res.crop_top_left[1]  # where the colour boundary lands in the output
        if split > 3:
            assert (a[:, : int(split) - 3, 0] > 240).all() and (a[:, : int(split) - 3, 2] < 15).all()
        if split < bucket[0] - 3:
            assert (a[:, int(np.ceil(split)) + 3 :, 2] > 240).all() and (a[:, int(np.ceil(split)) + 3 :, 0] < 15).all()
    # a tall image keeps top on top
    tall = Image.new("RGB", (200, 500), (0, 255, 0))
    tall.paste((255, 255, 0), (0, 0, 200, 250))
    a = np.asarray(fit_to_bucket(tall, (128, 256), crop="center").image)
    assert (a[:100, :, 2] < 15).all() and (a[:100, :, 0] > 240).all() and (a[-100:, :, 0] < 15).all()


def test_flip_mirrors_pixels_and_crop_x() -> None:
    im = photo("motorcycle_left.png")  # 741 x 500
    for bucket in [(256, 256), (512, 256), (200, 400)]:
        a = fit_to_bucket(im, bucket, rng=np.random.default_rng(7))
        b = fit_to_bucket(im, bucket, rng=np.random.default_rng(7), flip=True)
        assert b.flipped and not a.flipped
        np.testing.assert_array_equal(np.asarray(b.image), np.asarray(a.image)[:, ::-1])
        assert b.crop_top_left[0] == a.crop_top_left[0]
        assert b.crop_top_left[1] == a.scaled_size[0] - bucket[0] - a.crop_top_left[1]
        # The flipped crop is literally the crop of the mirrored scaled image at the reported offset.
        y, x = b.crop_top_left
        mirrored = im.resize(a.scaled_size, Image.LANCZOS).transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        ref = mirrored.crop((x, y, x + bucket[0], y + bucket[1]))
        assert np.abs(np.asarray(b.image, dtype=np.int16) - np.asarray(ref, dtype=np.int16)).max() <= 1


def test_determinism_and_no_global_rng() -> None:
    im = photo("coffee.png")
    py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    runs = [fit_to_bucket(im, (256, 320), rng=np.random.default_rng(42)) for _ in range(2)]
    assert runs[0].crop_top_left == runs[1].crop_top_left
    np.testing.assert_array_equal(np.asarray(runs[0].image), np.asarray(runs[1].image))
    crops = {fit_to_bucket(im, (256, 320), rng=np.random.default_rng(s)).crop_top_left for s in range(20)}
    assert len(crops) > 5  # the rng really drives the crop
    assert random.getstate() == py_state
    assert all(
        np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(np.random.get_state(), np_state)
    )
    assert torch.equal(torch.random.get_rng_state(), torch_state)


def test_bad_arguments() -> None:
    im = Image.new("RGB", (10, 10))
    with pytest.raises(ValueError, match="'random' or 'center'"):
        fit_to_bucket(im, (8, 8), crop="middle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="resample"):
        fit_to_bucket(im, (8, 8), resample="sinc")
    with pytest.raises(ValueError, match="NEAREST"):
        fit_to_bucket(im, (8, 8), resample=Image.Resampling.NEAREST)
    with pytest.raises(TypeError, match="numpy.random.Generator"):
        fit_to_bucket(im, (8, 8), rng=42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="draft_gap"):
        fit_to_bucket(im, (8, 8), draft_gap=0.5)


# --------------------------------------------------------------------------------------- EXIF
def _stored_for(displayed: Image.Image, orientation: int) -> Image.Image:
    """The stored pixels whose EXIF `orientation` displays as `displayed` (inverse transpose)."""
    inverse = {2: 2, 3: 3, 4: 4, 5: 5, 6: 8, 7: 7, 8: 6}
    return displayed if orientation == 1 else displayed.transpose(EXIF_TRANSPOSE[inverse[orientation]])


def _save_with_orientation(im: Image.Image, path: Path, orientation: int, fmt: str) -> None:
    exif = Image.Exif()
    exif[0x0112] = orientation
    kw = {"quality": 95} if fmt in ("JPEG", "WEBP") else {}
    im.save(path, fmt, exif=exif.tobytes(), **kw)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_jpeg(tmp_path: Path, orientation: int) -> None:
    displayed = photo("chelsea.png")  # 451 x 300, not square, not symmetric
    path = tmp_path / f"o{orientation}.jpg"
    _save_with_orientation(_stored_for(displayed, orientation), path, orientation, "JPEG")
    assert Image.open(path).getexif()[0x0112] == orientation
    ref_img = ImageOps.exif_transpose(Image.open(path)).convert("RGB")  # what datasets would decode
    assert ref_img.size == displayed.size
    for bucket in [(256, 256), (320, 192), (128, 256)]:
        res = fit_to_bucket(path, bucket, rng=np.random.default_rng(orientation))
        assert res.original_size == (300, 451)
        (sw, sh), (y, x) = res.scaled_size, res.crop_top_left
        ref = ref_img.resize((sw, sh), Image.LANCZOS).crop((x, y, x + bucket[0], y + bucket[1]))
        diff = np.abs(np.asarray(res.image, dtype=np.int16) - np.asarray(ref, dtype=np.int16))
        # Orientations 5-8 swap axes: Pillow's two passes (horizontal, then vertical, each rounded to
        # 8 bits) run in the other order relative to the content, so allow two 8-bit steps there.
        assert diff.max() <= (1 if orientation <= 4 else 2) and diff.mean() < 0.3
        # and the content is the upright photo
        upright = displayed.resize((sw, sh), Image.LANCZOS).crop((x, y, x + bucket[0], y + bucket[1]))
        assert psnr(res.image, upright) > 30


@pytest.mark.parametrize("fmt,orientation", [("PNG", 6), ("PNG", 3), ("WEBP", 8), ("WEBP", 5)])
def test_exif_orientation_png_webp(tmp_path: Path, fmt: str, orientation: int) -> None:
    displayed = photo("rocket.jpg")  # 640 x 427
    path = tmp_path / f"o{orientation}.{fmt.lower()}"
    _save_with_orientation(_stored_for(displayed, orientation), path, orientation, fmt)
    res = fit_to_bucket(path, (256, 256), crop="center")
    assert res.original_size == (427, 640)
    ref = ImageOps.exif_transpose(Image.open(path)).convert("RGB")
    (sw, sh), (y, x) = res.scaled_size, res.crop_top_left
    ref = ref.resize((sw, sh), Image.LANCZOS).crop((x, y, x + 256, y + 256))
    diff = np.abs(np.asarray(res.image, dtype=np.int16) - np.asarray(ref, dtype=np.int16))
    assert diff.max() <= (1 if orientation <= 4 else 2) and diff.mean() < 0.3


def test_already_transposed_pil_image_is_used_as_is() -> None:
    buf = io.BytesIO()
    _save_with_orientation(photo("chelsea.png"), buf, 6, "JPEG")  # type: ignore[arg-type]
    decoded = ImageOps.exif_transpose(Image.open(io.BytesIO(buf.getvalue())))  # what datasets hands over
    res = fit_to_bucket(decoded, (128, 128), crop="center")
    assert res.original_size == (451, 300)  # rotated once, not twice


@pytest.mark.parametrize("orientation", [5, 6, 7, 8])
def test_exif_orientation_with_jpeg_draft(orientation: int) -> None:
    displayed = mosaic(1800, 1200, PHOTOS, seed=orientation)
    buf = io.BytesIO()
    _save_with_orientation(_stored_for(displayed, orientation), buf, orientation, "JPEG")  # type: ignore[arg-type]
    data = buf.getvalue()
    fast = fit_to_bucket(data, (384, 256), crop="center")
    exact = fit_to_bucket(data, (384, 256), crop="center", draft=False)
    assert fast.draft_scale >= 2 and exact.draft_scale == 1
    assert fast.original_size == exact.original_size == (1200, 1800)
    assert psnr(fast.image, exact.image) >= 38


# --------------------------------------------------------------------------------------- colour modes
def _rgba_photo() -> Image.Image:
    """A real photo with a fully transparent left third and a half-transparent band."""
    rgba = photo("astronaut.png").resize((300, 200)).convert("RGBA")
    alpha = np.full((200, 300), 255, np.uint8)
    alpha[:, :100] = 0
    alpha[:, 150:160] = 128
    rgba.putalpha(Image.fromarray(alpha))
    return rgba


@pytest.mark.parametrize("mode", ["1", "L", "LA", "La", "P", "PA", "P+transparency", "RGBA", "RGBa", "CMYK", "I;16",
                                  "I", "F", "YCbCr", "RGB"])
def test_every_colour_mode_becomes_rgb(mode: str) -> None:
    base = photo("astronaut.png").resize((300, 200))
    bg = (0, 255, 0)
    if mode == "P+transparency":
        im = base.convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
        im.paste(0, (0, 0, 100, 200))  # left third uses palette index 0 ...
        im.info["transparency"] = 0  # ... which is transparent
    elif mode == "La":  # premultiplied grey + alpha; Pillow cannot convert RGBA → La itself
        la = np.asarray(_rgba_photo().convert("LA"), dtype=np.uint16)  # (200, 300, 2)
        la[..., 0] = (la[..., 0] * la[..., 1] + 127) // 255
        im = Image.frombytes("La", (300, 200), la.astype(np.uint8).tobytes())
    elif mode in ("LA", "PA", "RGBA", "RGBa"):
        im = _rgba_photo().convert(mode)
    elif mode == "I;16":
        im = Image.fromarray((np.asarray(base.convert("L"), dtype=np.uint16) * 257))
    elif mode == "I":
        im = Image.fromarray((np.asarray(base.convert("L"), dtype=np.int32) * 257))
    elif mode == "F":
        im = Image.fromarray(np.asarray(base.convert("L"), dtype=np.float32) / 255.0)
    else:
        im = base.convert(mode)
    assert im.mode == ("P" if mode == "P+transparency" else mode)
    res = fit_to_bucket(im, (150, 100), crop="center", background=bg)
    out = np.asarray(res.image, dtype=np.int16)  # (100, 150, 3)
    assert res.image.mode == "RGB" and res.image.size == (150, 100)
    transparent = mode in ("LA", "La", "PA", "RGBA", "RGBa", "P+transparency")
    if transparent:
        # background, not black
        np.testing.assert_array_equal(out[:, :45], np.broadcast_to(np.array(bg), out[:, :45].shape))
        assert out[:, 60:].std() > 10  # the photo is still there
    elif mode in ("I;16", "I", "F"):
        # 16-bit ranges [0, 65535] and float [0, 1] land on the same 8-bit grey as the L image
        ref = np.asarray(fit_to_bucket(base.convert("L"), (150, 100), crop="center").image, dtype=np.int16)
        assert np.abs(out - ref).max() <= 1
    elif mode != "1":
        ref = np.asarray(fit_to_bucket(base.convert(mode).convert("RGB"), (150, 100), crop="center").image,
                         dtype=np.int16)
        np.testing.assert_array_equal(out, ref)


def test_to_rgb_sixteen_bit_and_float_scaling() -> None:
    arr16 = np.array([[0, 257, 32896, 65535]], dtype=np.uint16)
    assert np.asarray(to_rgb(Image.fromarray(arr16)))[0, :, 0].tolist() == [0, 1, 128, 255]
    arrf = np.array([[0.0, 0.5, 1.0, 2.0, -1.0]], dtype=np.float32)
    assert np.asarray(to_rgb(Image.fromarray(arrf)))[0, :, 1].tolist() == [0, 128, 255, 255, 0]
    with pytest.raises(ValueError, match="background"):
        to_rgb(_rgba_photo(), background=(300, 0, 0))


def test_cmyk_jpeg_file_decodes_to_rgb() -> None:
    base = photo("coffee.png")
    data = jpeg_bytes(base.convert("CMYK"), quality=95)
    assert Image.open(io.BytesIO(data)).mode == "CMYK"
    res = fit_to_bucket(data, (300, 200), crop="center")
    assert psnr(res.image, fit_to_bucket(base, (300, 200), crop="center").image) > 30


# --------------------------------------------------------------------------------------- fast path
def test_jpeg_draft_fast_path_is_faithful_on_real_photos() -> None:
    """Decoder downscale + exact filter vs the exact path: PSNR >= 38 dB over a sweep of downscales."""
    canvas = mosaic(3000, 2000, PHOTOS, seed=3)
    data = jpeg_bytes(canvas, quality=90)
    worst, used = float("inf"), set()
    for bw in list(range(460, 1300, 70)) + [1490, 1500]:  # downscales 6.5x .. 2x: every remaining factor
        bucket = (bw, bw * 2 // 3)
        fast = fit_to_bucket(data, bucket, crop="center")
        exact = fit_to_bucket(data, bucket, crop="center", draft=False)
        assert fast.image.size == exact.image.size == bucket
        used.add(fast.draft_scale)
        worst = min(worst, psnr(fast.image, exact.image))
    assert {2, 4} <= used  # the fast path really ran at both decoder scales
    assert worst >= 38.0, worst


def test_pil_image_passed_in_is_not_drafted_or_modified() -> None:
    data = jpeg_bytes(mosaic(1200, 800, PHOTOS, seed=5))
    im = Image.open(io.BytesIO(data))  # lazily opened JPEG, not loaded yet
    res = fit_to_bucket(im, (240, 160), crop="center")
    assert res.draft_scale == 1 and im.size == (1200, 800)
    assert psnr(res.image, fit_to_bucket(data, (240, 160), crop="center", draft=False).image) == float("inf")


def test_draft_not_used_below_threshold_or_for_png() -> None:
    canvas = mosaic(1200, 800, PHOTOS, seed=4)
    data = jpeg_bytes(canvas)
    assert fit_to_bucket(data, (640, 427), crop="center").draft_scale == 1  # 1.87x: below 2x
    assert fit_to_bucket(data, (600, 400), crop="center").draft_scale == 2  # exactly 2x
    assert fit_to_bucket(data, (260, 174), crop="center").draft_scale == 2  # 4.6x: 1/4 would leave < 1.25x
    assert fit_to_bucket(data, (240, 160), crop="center").draft_scale == 4  # 5x
    assert fit_to_bucket(data, (600, 400), crop="center", draft_gap=1.5).draft_scale == 1
    buf = io.BytesIO()
    canvas.save(buf, "PNG")
    assert fit_to_bucket(buf.getvalue(), (200, 128), crop="center").draft_scale == 1


# --------------------------------------------------------------------------------------- torch vs Pillow
def test_torch_antialiased_bicubic_vs_pillow_bicubic() -> None:
    """The figure docs/imaging.md quotes for users moving the resize to the GPU.

    torch's ``interpolate(mode="bicubic", antialias=True)`` uses Pillow's kernel (a = -0.5) and
    half-pixel centres. On float input it differs from Pillow by rounding and by Pillow clipping the
    intermediate (horizontal-pass) result to 8 bits; on uint8 input (CPU) it matches within one step.
    Without antialiasing the downscale is a different image altogether.
    """
    im = photo("astronaut.png")  # 512 x 512, real photo
    x = torch.from_numpy(np.array(im)).permute(2, 0, 1)[None]  # (1, 3, 512, 512) uint8
    size = (170, 170)  # ~3x downscale
    ref = np.asarray(im.resize(size, Image.BICUBIC), dtype=np.float64)  # (170, 170, 3)

    def as_img(t: torch.Tensor) -> np.ndarray:
        return t.round().clamp(0, 255)[0].permute(1, 2, 0).numpy().astype(np.float64)

    f_aa = as_img(torch.nn.functional.interpolate(x.float(), size=size, mode="bicubic", antialias=True))
    u8_aa = as_img(torch.nn.functional.interpolate(x, size=size, mode="bicubic", antialias=True).float())
    f_no = as_img(torch.nn.functional.interpolate(x.float(), size=size, mode="bicubic", antialias=False))
    assert psnr(f_aa, ref) >= 50  # measured 57.6 dB, max |diff| 7 (mean 0.11)
    assert np.abs(f_aa - ref).mean() < 0.5
    assert np.abs(u8_aa - ref).max() <= 1  # uint8 CPU kernel: Pillow's fixed-point arithmetic
    assert psnr(f_no, ref) < 35  # measured 29.2 dB: no antialias is not the same resize


# --------------------------------------------------------------------------------------- to_tensor
def test_to_tensor_matches_diffusers_normalisation() -> None:
    im = photo("coffee.png")
    t = to_tensor(im)
    arr = np.asarray(im)
    assert t.shape == (3, im.height, im.width) and t.dtype == torch.float32
    # ToTensor() + Normalize([0.5], [0.5]) as in diffusers' scripts: (v / 255 - 0.5) / 0.5
    expected = (torch.from_numpy(arr.copy()).permute(2, 0, 1).float() / 255.0 - 0.5) / 0.5
    torch.testing.assert_close(t, expected, atol=1e-6, rtol=0)
    edge = to_tensor(np.array([[[0, 255, 128]]], dtype=np.uint8))
    assert edge[:, 0, 0].tolist()[:2] == [-1.0, 1.0]
    assert to_tensor(Image.new("L", (4, 2), 255)).shape == (3, 2, 4)
    with pytest.raises(ValueError, match="uint8"):
        to_tensor(np.zeros((2, 2, 3), dtype=np.float32))


def test_fitplan_key_and_box_are_consistent() -> None:
    plan = plan_fit((4000, 3000), (1024, 1024), crop="center", flip=True)
    assert isinstance(plan, FitPlan)
    assert plan.key() == (1024, 1024, 1365, 1024, 0, plan.crop_top_left[1], 1, "")
    left, top, right, bottom = plan.source_box
    assert top == 0 and bottom == 3000 and right - left == pytest.approx(1024 * 4000 / plan.scaled_size[0])
