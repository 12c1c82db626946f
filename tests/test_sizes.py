"""read_image_size: header-only, EXIF-aware, every input kind, every bad input with its reason."""

from __future__ import annotations

import io
from pathlib import Path

import datasets
import numpy as np
import pytest
from _photos import encode, photo, save_photo
from PIL import Image, ImageFile, ImageOps

from hf_arb import BucketSet, ImageSizeError, read_image_size


def decoded_size(data: bytes) -> tuple[int, int]:
    """The size training sees: what datasets' Image feature decodes (it applies exif_transpose)."""
    return datasets.Image().decode_example({"bytes": data, "path": None}).size


def forbid_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any pixel decode fail from now on, to prove that only headers are read."""

    def refuse(self: ImageFile.ImageFile) -> None:
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", refuse)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientations_give_displayed_size_and_bucket(tmp_path: Path, orientation: int) -> None:
    path = save_photo(tmp_path / f"o{orientation}.jpg", "coffee.png", "JPEG", orientation, quality=85)
    stored = Image.open(path).size
    assert stored == (600, 400)
    with Image.open(path) as im:
        transposed = ImageOps.exif_transpose(im).size
    got = read_image_size(path)
    assert got == transposed == decoded_size(path.read_bytes())
    assert got == ((400, 600) if orientation >= 5 else (600, 400))
    bs = BucketSet.sdxl()
    ids, _ = bs.assign([got[0], transposed[0]], [got[1], transposed[1]])
    assert ids[0] == ids[1]
    # landscape and portrait really land in different buckets, so a missed swap would be caught
    assert (bs[int(ids[0])][0] > bs[int(ids[0])][1]) == (orientation < 5)


def test_header_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = encode(photo("rocket.jpg"), "JPEG", orientation=6)
    path = tmp_path / "r.jpg"
    path.write_bytes(data)
    png = encode(photo("chelsea.png"), "PNG", orientation=6)
    webp = encode(photo("chelsea.png"), "WEBP", orientation=6)
    forbid_decoding(monkeypatch)
    with pytest.raises(AssertionError):  # the guard works
        Image.open(io.BytesIO(png)).load()
    assert read_image_size(path) == (427, 640)
    assert read_image_size(data) == (427, 640)
    assert read_image_size(png) == (300, 451)
    assert read_image_size(webp) == (300, 451)


@pytest.mark.parametrize(
    ("name", "fmt", "kwargs"),
    [
        ("coffee.png", "PNG", {}),
        ("horse.png", "PNG", {}),  # RGBA
        ("chelsea.png", "WEBP", {"quality": 80}),
        ("astronaut.png", "GIF", {}),  # palette
        ("cell.png", "TIFF", {}),
        ("motorcycle_left.png", "BMP", {}),
        ("hubble_deep_field.jpg", "JPEG", {"quality": 85, "progressive": True}),
    ],
)
def test_formats_match_decoded_size(name: str, fmt: str, kwargs: dict) -> None:
    img = photo(name)
    if fmt == "GIF":
        img = img.convert("P", palette=Image.Palette.ADAPTIVE)
    data = encode(img, fmt, **kwargs)
    assert read_image_size(data) == decoded_size(data) == img.size


def test_palette_png_and_animated_gif() -> None:
    pal = photo("coffee.png").convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
    data = encode(pal, "PNG")
    assert Image.open(io.BytesIO(data)).mode == "P"
    assert read_image_size(data) == (600, 400)
    frames = [photo("chelsea.png", (120, 80)).convert("P"), photo("coffee.png", (120, 80)).convert("P")]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=50)
    assert read_image_size(buf.getvalue()) == (120, 80) == decoded_size(buf.getvalue())


@pytest.mark.parametrize("fmt", ["WEBP", "PNG", "TIFF"])
def test_exif_orientation_in_other_containers(fmt: str) -> None:
    data = encode(photo("coffee.png"), fmt, orientation=8)
    assert read_image_size(data) == decoded_size(data) == (400, 600)


def test_every_input_kind(tmp_path: Path) -> None:
    data = encode(photo("chelsea.png"), "JPEG", orientation=5)
    path = tmp_path / "c.jpg"
    path.write_bytes(data)
    want = (300, 451)
    assert read_image_size(str(path)) == want
    assert read_image_size(path) == want
    assert read_image_size(data) == want
    assert read_image_size(bytearray(data)) == want
    assert read_image_size(memoryview(data)) == want
    f = io.BytesIO(b"xx" + data)
    f.seek(2)
    assert read_image_size(f) == want
    assert f.tell() == 2, "the caller's file position must be restored"
    with open(path, "rb") as fh:
        assert read_image_size(fh) == want
        assert not fh.closed
    assert read_image_size({"bytes": data, "path": "ignored.jpg"}) == want
    assert read_image_size({"bytes": None, "path": str(path)}) == want
    # a decoded datasets image is already transposed (the tag removed): reading it again must not swap back
    decoded = datasets.Image().decode_example({"bytes": data, "path": None})
    assert read_image_size(decoded) == want
    with Image.open(path) as raw:  # an opened, not transposed image
        assert read_image_size(raw) == want


def _bad_inputs(tmp_path: Path) -> list[tuple[object, str, str]]:
    """(input, expected reason fragment, fragment the message must contain to name the source)."""
    jpeg = encode(photo("coffee.png"), "JPEG")
    png = encode(photo("coffee.png"), "PNG")
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    text = tmp_path / "notes.jpg"
    text.write_text("this is not an image\n" * 10)
    cut = tmp_path / "cut.jpg"
    cut.write_bytes(jpeg[:120])
    return [
        (tmp_path / "missing.jpg", "file not found", "missing.jpg"),
        (str(empty), "empty (0 bytes)", "empty.jpg"),
        (b"", "empty (0 bytes)", "<bytes: 0>"),
        (text, "not an image", "notes.jpg"),
        (b"GIF89a", "truncated or corrupt GIF header", "<bytes: 6>"),
        (cut, "truncated or corrupt JPEG header", "cut.jpg"),
        (png[:20], "truncated or corrupt PNG header", "<bytes: 20>"),
        ({"bytes": None, "path": None}, "no bytes and no path", "dict"),
        (12345, "unsupported input type", "int"),
        (tmp_path, "is a directory", str(tmp_path.name)),
    ]


def test_bad_inputs_raise_with_source_and_reason(tmp_path: Path) -> None:
    for src, reason, named in _bad_inputs(tmp_path):
        with pytest.raises(ImageSizeError) as info:
            read_image_size(src)  # type: ignore[arg-type]
        assert info.value.reason == reason, (src, info.value)
        assert reason in str(info.value)
        assert named in str(info.value)
        assert isinstance(info.value, ValueError)


def test_decompression_bomb(monkeypatch: pytest.MonkeyPatch) -> None:
    data = encode(photo("coffee.png"), "JPEG")  # 240,000 pixels
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100_000)  # Pillow raises over 2x this
    with pytest.raises(ImageSizeError) as info:
        read_image_size(data)
    assert info.value.reason == "decompression bomb"
    assert "MAX_IMAGE_PIXELS" in str(info.value)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 200_000)  # over 1x only: Pillow warns, the size is read
    assert read_image_size(data) == (600, 400)


def test_truncated_pixels_but_complete_header_still_reads(tmp_path: Path) -> None:
    data = encode(photo("hubble_deep_field.jpg"), "JPEG", quality=90)
    assert read_image_size(data[: len(data) // 2]) == (1000, 872)


def test_sizes_random_resizes_match_decoding() -> None:
    rng = np.random.default_rng(0)
    for w, h in rng.integers(16, 900, size=(6, 2)).tolist():
        o = int(rng.integers(1, 9))
        data = encode(photo("coffee.png", (w, h)), "JPEG", orientation=o, quality=70)
        assert read_image_size(data) == decoded_size(data)
