"""Real photographs for tests: scikit-image ships a few (astronaut, coffee, chelsea, rocket, …).

``save_photo`` writes one of them in a given format, optionally with an EXIF orientation tag (0x0112) written
through Pillow's ``Exif``, so tests read real encoders' headers rather than hand-made bytes.
"""

from __future__ import annotations

import io
from pathlib import Path

import skimage
from PIL import Image

SKIMAGE_DATA = Path(skimage.__file__).parent / "data"
#: name -> (width, height) as stored in the file
PHOTOS = {
    "coffee.png": (600, 400),
    "chelsea.png": (451, 300),
    "astronaut.png": (512, 512),
    "motorcycle_left.png": (741, 500),
    "rocket.jpg": (640, 427),
    "hubble_deep_field.jpg": (1000, 872),
    "horse.png": (400, 328),  # RGBA
    "cell.png": (550, 660),  # grayscale, portrait
}


def photo(name: str = "coffee.png", size: tuple[int, int] | None = None) -> Image.Image:
    """Open a bundled photo (decoded, stored orientation), optionally resized to ``size`` (width, height)."""
    with Image.open(SKIMAGE_DATA / name) as im:
        im.load()
        img = im.copy()
    if size is not None:
        img = img.resize(size, Image.Resampling.BILINEAR)
    return img


def encode(img: Image.Image, fmt: str = "JPEG", orientation: int | None = None, **save_kwargs: object) -> bytes:
    """Encode ``img`` as ``fmt``; with ``orientation``, write EXIF tag 0x0112 = orientation."""
    buf = io.BytesIO()
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        save_kwargs["exif"] = exif.tobytes()
    if fmt == "JPEG" and img.mode not in ("RGB", "L"):
        img = img.convert("RGB")
    img.save(buf, fmt, **save_kwargs)
    return buf.getvalue()


def save_photo(path: Path, name: str = "coffee.png", fmt: str = "JPEG", orientation: int | None = None,
               size: tuple[int, int] | None = None, **save_kwargs: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode(photo(name, size), fmt, orientation, **save_kwargs))
    return path
