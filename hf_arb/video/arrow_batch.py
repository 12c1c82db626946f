"""Clip metadata columns of one Arrow batch: the pure function the annotation engines will map over clips.

:func:`clip_columns` reads the header of every clip in one column (``datasets.Video`` storage ``struct<bytes, path>``,
binary bytes, or string paths; an image in the same column is a 1-frame clip with fps 0) and appends
:data:`CLIP_COLUMNS`. It mirrors :func:`hf_arb.annotate.arrow_batch.bucket_columns`: Arrow in, Arrow out, one row per
input row in order, a bad clip never raises but gets a ``skip_reason`` (``"missing"`` for a null value,
``"unreadable: <reason>"`` otherwise) and nulls, and :func:`skip_counts` counts them by reason. Encoded bytes are read
from the Arrow buffer of one row at a time; nothing allocates O(rows x bytes).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hf_arb.images.values import arrow_values

from .metadata import ClipMetadataError, clip_metadata, metadata_of_open

#: the columns :func:`clip_columns` appends, with their Arrow types
CLIP_SCHEMA = pa.schema([
    ("original_width", pa.int32()), ("original_height", pa.int32()), ("original_frames", pa.int32()),
    ("original_fps", pa.float32()), ("frames_exact", pa.bool_()), ("skip_reason", pa.string()),
])
CLIP_COLUMNS = tuple(CLIP_SCHEMA.names)


def _values(column: pa.ChunkedArray | pa.Array) -> list[Any]:
    """One clip value per row: ``(buffer, path)`` for bytes (zero-copy), a path string, or None (null)."""
    return arrow_values(column, wrap=lambda buffer, path: (buffer, path), path_value=lambda path: path,
                        only="A clip column holds datasets.Video storage (struct<bytes, path>), binary bytes or "
                             "string paths")


def _read(value: Any) -> Any:
    if isinstance(value, tuple):
        buffer, path = value
        source = f"<bytes: {buffer.size}>" + (f" ({path!r})" if path else "")
        if buffer.size == 0:
            raise ClipMetadataError(source, "empty (0 bytes)")
        return metadata_of_open(io.BytesIO(buffer), source)
    if value == "":
        raise ClipMetadataError("''", "no bytes and no path", "the value is empty")
    return clip_metadata(value)


def clip_columns(batch: pa.RecordBatch | pa.Table, column: str = "video") -> pa.RecordBatch | pa.Table:
    """``batch`` with the clip metadata columns of ``column`` appended (existing ones replaced), same type as ``batch``.

    Args:
        batch: rows (a ``RecordBatch`` or ``Table``).
        column: the clip column: ``datasets.Video``/``Image`` storage (``struct<bytes, path>``), binary bytes, or
            string paths. Images are 1-frame clips with fps 0.

    Returns:
        The input columns (minus old clip columns) followed by :data:`CLIP_COLUMNS`: ``original_width``,
        ``original_height`` (the displayed size, rotation applied), ``original_frames``, ``original_fps`` (0 for an
        image), ``frames_exact`` (False where the container stores no count and it is ``round(duration * fps)``), and
        ``skip_reason`` (null when read; ``"missing"`` or ``"unreadable: <reason>"`` with nulls elsewhere).

    Raises:
        ValueError: ``column`` is not in the batch. TypeError: it is not a type that holds clips.
    """
    if isinstance(batch, pa.RecordBatch):
        table = pa.Table.from_batches([batch])
    elif isinstance(batch, pa.Table):
        table = batch
    else:
        raise TypeError(f"Expected a pyarrow.RecordBatch or pyarrow.Table, got {type(batch).__name__}.")
    if column not in table.column_names:
        raise ValueError(f"Column {column!r} is not in the batch; its columns are {table.column_names}. "
                         "Pass the clip column's name with column=...")
    values = _values(table.column(column))
    n = len(values)
    ints = np.zeros((3, n), np.int32)  # width, height, frames
    fps = np.zeros(n, np.float32)
    exact = np.zeros(n, bool)
    reasons: list[str | None] = [None] * n
    for i, v in enumerate(values):
        if v is None:
            reasons[i] = "missing"
            continue
        try:
            m = _read(v)
        except ClipMetadataError as e:
            reasons[i] = f"unreadable: {e.reason}"
            continue
        except ImportError:
            raise  # PyAV missing: one clear error, not every row skipped
        except Exception as e:  # noqa: BLE001 - nothing may raise mid-map; record the reason instead
            reasons[i] = f"unreadable: {type(e).__name__}: {e}"[:200]
            continue
        ints[:, i] = m.width, m.height, m.frames
        fps[i], exact[i] = m.fps, m.frames_exact
    bad = np.array([r is not None for r in reasons], bool)
    new = [pa.array(ints[0], pa.int32(), mask=bad), pa.array(ints[1], pa.int32(), mask=bad),
           pa.array(ints[2], pa.int32(), mask=bad), pa.array(fps, pa.float32(), mask=bad),
           pa.array(exact, pa.bool_(), mask=bad), pa.array(reasons, pa.string())]
    keep = [c for c in table.column_names if c not in CLIP_COLUMNS]
    schema = pa.schema([table.schema.field(c) for c in keep] + list(CLIP_SCHEMA), metadata=table.schema.metadata)
    if isinstance(batch, pa.RecordBatch):
        return pa.RecordBatch.from_arrays([table.column(c).combine_chunks() for c in keep] + new, schema=schema)
    return pa.Table.from_arrays([table.column(c) for c in keep] + new, schema=schema)


def skip_counts(batch: pa.RecordBatch | pa.Table) -> dict[str, int]:
    """Rows per ``skip_reason`` of a batch :func:`clip_columns` returned (kept rows are not counted)."""
    counts = pc.value_counts(pc.drop_null(batch.column("skip_reason")))
    return {str(d["values"]): int(d["counts"]) for d in counts.to_pylist()}
