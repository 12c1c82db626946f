"""Header-only image sizes, EXIF-orientation aware.

:func:`read_image_size` opens an image with Pillow, which parses the file header (and, for JPEG,
the APPn segments that hold EXIF) but never decodes pixels. The size it returns is the
*displayed* size: width and height are swapped for EXIF orientations 5–8, because
``datasets.Image`` applies ``ImageOps.exif_transpose`` when it decodes, so that is the size
training sees.

Anything that is not a readable image header raises :class:`ImageSizeError`, whose message names
the source and the reason; :func:`hf_arb.add_bucket_columns` records that reason per row instead
of raising.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO, TypeVar, Union

from PIL import Image

#: EXIF tag id of "Orientation".
ORIENTATION_TAG = 0x0112
#: Orientations that rotate by 90° (transpose, rotate 270, transverse, rotate 90): width and height swap.
_SWAPPING_ORIENTATIONS = frozenset((5, 6, 7, 8))

# Leading bytes of formats we recognise, to tell "truncated or corrupt header" from "not an image".
_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xd8\xff", "JPEG"),
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
)

T = TypeVar("T")

ImageSource = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, BinaryIO, Mapping[str, Any], Image.Image]


class ImageSizeError(ValueError):
    """An image's size could not be read from its header.

    Attributes:
        source: a short description of the input (a path, ``"<bytes: 123>"``, ``"<file object>"``).
        reason: a short, stable reason such as ``"file not found"``, ``"empty (0 bytes)"``,
            ``"not an image"``, ``"truncated or corrupt JPEG header"`` or ``"decompression bomb: …"``;
            :func:`hf_arb.add_bucket_columns` writes it to ``skip_reason`` as ``"unreadable: <reason>"``.
    """

    def __init__(self, source: str, reason: str, detail: str = "") -> None:
        self.source = source
        self.reason = reason
        self.detail = detail
        msg = f"Cannot read the image size of {source}: {reason}"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg + ".")


def _sniff_format(head: bytes) -> str | None:
    """Name of the format whose signature starts ``head``, or None."""
    for sig, name in _SIGNATURES:
        if head.startswith(sig):
            return name
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WebP"
    if head[4:8] == b"ftyp" and head[8:12] in (b"avif", b"avis"):
        return "AVIF"
    if head[4:8] == b"ftyp" and head[8:12] in (b"heic", b"heix", b"mif1"):
        return "HEIF"
    return None


def displayed_size(width: int, height: int, orientation: int | None) -> tuple[int, int]:
    """``(width, height)`` after applying EXIF ``orientation`` (swapped for 5–8)."""
    if orientation in _SWAPPING_ORIENTATIONS:
        return height, width
    return width, height


def _orientation(img: Image.Image) -> int:
    """EXIF orientation of an opened (not decoded) image; 1 when absent or unparsable.

    Uses the base ``Image.getexif``: it reads what the header parse already put in ``img.info``
    (or, for TIFF, the first IFD). ``PngImageFile.getexif`` would decode the whole image to look for an
    ``eXIf`` chunk after the pixel data; we accept missing that rare layout to stay header-only.
    """
    try:
        value = Image.Image.getexif(img).get(ORIENTATION_TAG, 1)
    except Exception:  # noqa: BLE001 - a corrupt EXIF block: Pillow's decode would ignore it too
        return 1
    try:
        return int(value)
    except (TypeError, ValueError):
        return 1


def _plugin_applied_orientation(img: Image.Image) -> bool:
    """True when Pillow's plugin already reports the displayed size (the TIFF plugin does, e.g. Pillow 13).

    A TIFF's stored size is in its IMAGEWIDTH/IMAGELENGTH tags (256, 257); if ``img.size`` differs from them, the
    plugin swapped it for the orientation already and it must not be swapped twice.
    """
    tags = getattr(img, "tag_v2", None)
    if tags is None:
        return False
    stored = (tags.get(256), tags.get(257))
    return None not in stored and tuple(img.size) != stored


def size_of_open(fp: BinaryIO, source: str) -> tuple[int, int]:
    """Open ``fp`` with Pillow (header only) and return the displayed size."""
    caller_fp = fp
    pos = fp.tell() if fp.seekable() else None
    head = fp.read(16)
    if not head:
        raise ImageSizeError(source, "empty (0 bytes)")
    if pos == 0:
        fp.seek(0)
    else:
        # Pillow reads from offset 0; an image starting mid-stream, or a stream that cannot seek, is buffered.
        fp = io.BytesIO(head + fp.read())
    try:
        with warnings.catch_warnings():
            # Over Image.MAX_IMAGE_PIXELS Pillow only warns; over twice that it raises (handled below).
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(fp)
        try:
            width, height = img.size
            orientation = _orientation(img)
            already_oriented = _plugin_applied_orientation(img)
        finally:
            # Close Pillow's view without closing a caller's file object.
            if img.fp is not fp:
                img.close()
    except Image.DecompressionBombError as e:
        raise ImageSizeError(source, "decompression bomb",
                             f"{e} Raise PIL.Image.MAX_IMAGE_PIXELS if the image is trusted") from e
    except (Image.UnidentifiedImageError, SyntaxError, OSError, EOFError, ValueError, IndexError, KeyError) as e:
        fmt = _sniff_format(head)
        if fmt is None:
            raise ImageSizeError(source, "not an image", f"first bytes {head[:8]!r}") from e
        detail = "" if isinstance(e, Image.UnidentifiedImageError) else str(e)
        raise ImageSizeError(source, f"truncated or corrupt {fmt} header", detail) from e
    finally:
        if pos is not None:
            try:
                caller_fp.seek(pos)
            except (OSError, ValueError):
                pass
    if width <= 0 or height <= 0:
        raise ImageSizeError(source, "zero-sized image", f"header says {width}x{height}")
    if already_oriented:
        return width, height
    return displayed_size(width, height, orientation)


def _describe(src: Any) -> str:
    if isinstance(src, (bytes, bytearray, memoryview)):
        return f"<bytes: {len(src)}>"
    if isinstance(src, (str, os.PathLike)):
        return repr(os.fspath(src))
    return f"<{type(src).__name__}>"


def open_and_read(path: str, source: str, read: Callable[[BinaryIO, str], T], error: Callable[..., Exception]) -> T:
    """``read(file, source)`` of ``path``, a local file or a remote or archive path as ``datasets`` writes them for
    streaming (``hf://…``, ``zip://…::…``); a missing file, a folder or an unreadable one raise ``error(source,
    reason[, detail])`` (:class:`ImageSizeError`, the clips' ``ClipMetadataError``)."""
    if "://" in path and not os.path.exists(path):
        from datasets.utils.file_utils import xopen

        try:
            with xopen(path, "rb") as f:
                return read(f, source)
        except FileNotFoundError as e:
            raise error(source, "file not found") from e
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError as e:
        raise error(source, "file not found") from e
    except IsADirectoryError as e:
        raise error(source, "is a directory") from e
    except OSError as e:
        raise error(source, "cannot open", str(e)) from e
    with f:
        return read(f, source)


def _size_of_path(path: str, source: str | None = None) -> tuple[int, int]:
    return open_and_read(path, source or repr(path), size_of_open, ImageSizeError)


def read_image_size(src: ImageSource) -> tuple[int, int]:
    """Read an image's displayed ``(width, height)`` from its header, without decoding pixels.

    Args:
        src: a path (``str`` or ``os.PathLike``; ``hf://`` and other fsspec URLs work too), the encoded bytes,
            a binary file object (its position is restored), a ``datasets.Image(decode=False)`` value
            ``{"bytes": ..., "path": ...}`` (bytes win when both are set), or an already opened
            ``PIL.Image.Image``.

    Returns:
        ``(width, height)`` as ints, with width and height swapped for EXIF orientations 5–8, i.e. the size
        of ``ImageOps.exif_transpose(image)`` — what ``datasets`` hands to training.

    Raises:
        ImageSizeError: missing file, zero bytes, not an image, a truncated or corrupt header, or an image
            over Pillow's decompression-bomb limit (``2 * PIL.Image.MAX_IMAGE_PIXELS``). The message names the
            source and the reason.

    Example:
        ```py
        >>> from hf_arb import read_image_size
        >>> read_image_size("photo_rotated.jpg")  # 4000x3000 sensor, EXIF orientation 6
        (3000, 4000)
        ```
    """
    if isinstance(src, Image.Image):
        w, h = src.size
        if _plugin_applied_orientation(src):
            return w, h
        return displayed_size(w, h, _orientation(src))
    if isinstance(src, Mapping):
        data, path = src.get("bytes"), src.get("path")
        if data is not None:
            source = f"<bytes: {len(data)}>" + (f" ({path!r})" if path else "")
            return read_image_size_from_bytes(data, source)
        if path:
            return _size_of_path(os.fspath(path))
        raise ImageSizeError(f"<{type(src).__name__}>", "no bytes and no path", "the image value is empty")
    if isinstance(src, (bytes, bytearray, memoryview)):
        return read_image_size_from_bytes(src, _describe(src))
    if isinstance(src, (str, os.PathLike)):
        return _size_of_path(os.fspath(src))
    if hasattr(src, "read"):
        return size_of_open(src, getattr(src, "name", None) and repr(src.name) or "<file object>")  # type: ignore[arg-type]
    raise ImageSizeError(
        _describe(src), "unsupported input type",
        "pass a path, bytes, a binary file object, a {'bytes', 'path'} dict or a PIL image",
    )


def read_image_size_from_bytes(data: bytes | bytearray | memoryview, source: str | None = None) -> tuple[int, int]:
    """:func:`read_image_size` for encoded bytes; ``source`` names them in error messages."""
    if len(data) == 0:
        raise ImageSizeError(source or "<bytes: 0>", "empty (0 bytes)")
    return size_of_open(io.BytesIO(data), source or f"<bytes: {len(data)}>")


def decode_fully(fp: BinaryIO, source: str) -> None:
    """Decode the (first frame's) pixels of ``fp``; raise :class:`ImageSizeError` with reason ``truncated`` or
    ``undecodable`` when the body is broken. JPEGs decode at 1/8 scale (DCT scaling still reads every byte)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(fp) as img:
                if img.format == "JPEG":
                    img.draft(img.mode, (max(1, img.width // 8), max(1, img.height // 8)))
                img.load()
    except Image.DecompressionBombError as e:
        raise ImageSizeError(source, "decompression bomb", str(e)) from e
    except Exception as e:  # noqa: BLE001 - every decoder failure is a reason, never a crash
        detail = f"{type(e).__name__}: {e}"[:160]
        truncated = isinstance(e, EOFError) or "truncated" in str(e).lower()
        raise ImageSizeError(source, "truncated" if truncated else "undecodable", detail) from e


def verify_image(src: ImageSource) -> None:
    """Fully decode an image (its first frame) and raise if its body is broken; the check ``--verify`` adds.

    Header-only sizing (:func:`read_image_size`) cannot see a body cut short by an interrupted download. This
    decodes the pixels (JPEG at 1/8 scale, which still reads every byte of the scan) and discards them.

    Args:
        src: what :func:`read_image_size` accepts (a path, bytes, a file object or a ``{"bytes", "path"}`` dict).

    Raises:
        ImageSizeError: ``reason`` is ``"truncated"`` (the data ends early) or ``"undecodable"`` (anything else the
            decoder refuses), besides the header reasons of :func:`read_image_size`.
    """
    if isinstance(src, Image.Image):
        src.load()
        return
    if isinstance(src, Mapping):
        data, path = src.get("bytes"), src.get("path")
        if data is not None:
            decode_fully(io.BytesIO(data), f"<bytes: {len(data)}>" + (f" ({path!r})" if path else ""))
            return
        src = path
        if src is None:
            raise ImageSizeError("<dict>", "no bytes and no path", "the image value is empty")
    if isinstance(src, (bytes, bytearray, memoryview)):
        decode_fully(io.BytesIO(src), _describe(src))
    elif isinstance(src, (str, os.PathLike)):
        path = os.fspath(src)
        if "://" in path and not os.path.exists(path):
            from datasets.utils.file_utils import xopen

            with xopen(path, "rb") as f:
                decode_fully(io.BytesIO(f.read()), repr(path))
        else:
            try:
                with open(path, "rb") as f:
                    decode_fully(f, repr(path))
            except OSError as e:
                raise ImageSizeError(repr(path), "cannot open", str(e)) from e
    elif hasattr(src, "read"):
        decode_fully(src, "<file object>")  # type: ignore[arg-type]
    else:
        raise ImageSizeError(_describe(src), "unsupported input type")
