"""Image values of a dataset column, read for their size: paths, bytes, ``{"bytes", "path"}`` cells and Arrow
buffers (zero-copy), EXIF-aware and header-only unless asked to verify the whole image. The only per-row Python
loop of annotation lives here, because it opens files."""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from .sizes import ImageSizeError, decode_fully, read_image_size, size_of_open, verify_image


def sizes_of(values: Sequence[Any], verify: bool = False) -> tuple[np.ndarray, np.ndarray, list[str | None]]:
    """Read header sizes of a batch of image values; the only per-row Python loop (it opens files).

    With ``verify`` each readable image is also decoded; a broken body gives ``"truncated: …"`` or
    ``"undecodable: …"``.
    """
    n = len(values)
    w = np.full(n, np.nan)  # (n,)
    h = np.full(n, np.nan)  # (n,)
    reasons: list[str | None] = [None] * n
    for i, v in enumerate(values):
        if v is None:
            continue  # null image → "missing"
        try:
            w[i], h[i] = v.size() if isinstance(v, _ArrowImage) else read_image_size(v)
        except ImageSizeError as e:
            reasons[i] = f"unreadable: {e.reason}"
            continue
        except Exception as e:  # noqa: BLE001 - nothing may raise mid-map; record the reason instead
            reasons[i] = f"unreadable: {type(e).__name__}: {e}"[:200]
            continue
        if verify:
            try:
                v.verify() if isinstance(v, _ArrowImage) else verify_image(v)
            except ImageSizeError as e:
                reasons[i] = (
                    f"{e.reason}: {e.detail}" if e.reason in ("truncated", "undecodable") else f"unreadable: {e.reason}"
                )[:200]
            except Exception as e:  # noqa: BLE001
                reasons[i] = f"undecodable: {type(e).__name__}: {e}"[:200]
    return w, h, reasons


class _ArrowImage:
    """An encoded image held in an Arrow buffer (zero-copy), with the path it came from for error messages."""

    __slots__ = ("buffer", "path")

    def __init__(self, buffer: pa.Buffer, path: str | None) -> None:
        self.buffer = buffer
        self.path = path

    def size(self) -> tuple[int, int]:
        source = f"<bytes: {self.buffer.size}>" + (f" ({self.path!r})" if self.path else "")
        if self.buffer.size == 0:
            raise ImageSizeError(source, "empty (0 bytes)")
        # Pillow's plugins seek past the end and call readline (WebP, TIFF, …), which pyarrow's BufferReader
        # refuses; a BytesIO over the buffer behaves like a file on disk for every format.
        return size_of_open(io.BytesIO(self.buffer), source)

    def verify(self) -> None:
        decode_fully(io.BytesIO(self.buffer),
                     f"<bytes: {self.buffer.size}>" + (f" ({self.path!r})" if self.path else ""))


def arrow_values(column: pa.ChunkedArray | pa.Array, wrap: Callable[[pa.Buffer, str | None], Any] | None = None,
                 path_value: Callable[[str | None], Any] | None = None, only: str | None = None) -> list[Any]:
    """Image values of one Arrow column without copying encoded bytes into Python objects.

    ``Image`` storage (``struct<bytes, path>``) gives an :class:`_ArrowImage` where bytes are present, else the
    path; a string column gives paths; a binary column gives buffers; null gives None. Shape: one per row.

    Args:
        wrap: ``(buffer, path) -> value`` for encoded bytes (default :class:`_ArrowImage`; the clips' reader takes
            the pair).
        path_value: ``path -> value`` for a struct row without bytes (default ``{"bytes": None, "path": path}``).
        only: with it, a column of another type than struct, binary or string raises ``TypeError`` with this
            sentence (default: its values as they are).
    """
    wrap = wrap or _ArrowImage
    path_value = path_value or (lambda path: {"bytes": None, "path": path})
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    out: list[Any] = []
    for chunk in chunks:
        t = chunk.type
        if pa.types.is_struct(t):
            fields = dict(zip([f.name for f in t], chunk.flatten()))  # offsets and parent nulls applied
            data, paths = fields.get("bytes"), fields.get("path")
            path_list = paths.to_pylist() if paths is not None else [None] * len(chunk)
            has_bytes = (
                data.is_valid().to_numpy(zero_copy_only=False) if data is not None else np.zeros(len(chunk), bool)
            )
            valid = chunk.is_valid().to_numpy(zero_copy_only=False)
            for i in range(len(chunk)):
                if not valid[i]:
                    out.append(None)
                elif has_bytes[i]:
                    out.append(wrap(data[i].as_buffer(), path_list[i]))
                else:
                    out.append(path_value(path_list[i]))
        elif pa.types.is_binary(t) or pa.types.is_large_binary(t):
            valid = chunk.is_valid().to_numpy(zero_copy_only=False)
            out.extend(wrap(chunk[i].as_buffer(), None) if valid[i] else None for i in range(len(chunk)))
        elif only is not None and not (pa.types.is_string(t) or pa.types.is_large_string(t)):
            raise TypeError(f"{only}; got Arrow type {t}.")
        else:
            out.extend(chunk.to_pylist())  # paths (strings) or anything read_image_size accepts
    return out


def decoding_images(ds: Any) -> Any:
    """``ds`` with every ``Image(decode=False)`` column cast back to a decoding ``Image()``.

    Annotated streams keep their images encoded (so a broken one cannot end the iteration); use this before saving or
    pushing a stream so that whoever loads the result gets PIL images as usual.
    """
    import datasets

    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        return type(ds)({k: decoding_images(v) for k, v in ds.items()})
    for name, feature in (ds.features or {}).items():
        if isinstance(feature, datasets.Image) and not feature.decode:
            ds = ds.cast_column(name, datasets.Image(mode=feature.mode))
    return ds
