"""See before you train: one self-contained HTML page of what bucketing will do to a dataset.

:func:`build_report` gathers the numbers (one metadata pass, vectorised; the plan figures come from
:meth:`hf_arb.BucketBatchSampler.report`, not recomputed), :func:`render_html` turns them into a page that works
offline from disk (thumbnails inlined as ``data:`` URIs, charts as inline SVG, no script, no external asset) and
:func:`write_report` does both. ``hf-arb report DATASET --out report.html`` is the command line.

Per bucket: rows, share of the kept rows, planned steps per epoch for the batch size and process count, rows the
leftover policy drops or repeats (and the flag that changes it), and ``k`` sample thumbnails with the crop box the
training script will use drawn on the whole image (:func:`training_crop`: the geometry and per-row random draw of
:meth:`hf_arb.BucketedImageDataset.fit_row`). Then the outliers with their file names and the flag that handles each,
the skipped rows with their reasons, histograms of crop fraction and aspect error, and the bucket chart.

Cost: the metadata pass (the bucket columns; a raw dataset is annotated first, reading image headers only) plus
``k × buckets`` image decodes, each shrunk while decoding (JPEG draft) to a thumbnail. docs/benchmarks.md has the
figure at 10⁶ rows (benchmarks/bench_report.py).

Clips (a set with a frame axis, ``video_column``): rows and batches per (width, height, frames) bucket, histograms of
the clips' frame counts and frame rates, and per sample clip a *strip* of the frames it trains on in epoch 0 (the
window of :func:`hf_arb.video.frames.frame_plan` for the row, at its ``frame_stride``; up to :data:`STRIP_FRAMES` of
them, evenly spread), each with the clip's one crop drawn. The strip's few frames are decoded here with a small PyAV
seek (:func:`strip_frames`: seek to the keyframe before the window, decode forward to its last shown frame); this is
the report's own reader, kept apart from the training decoder.
"""

from __future__ import annotations

import base64
import io
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hf_arb.buckets.schema import BUCKET_COLUMNS
from hf_arb.buckets.sets import BucketSet
from hf_arb.wording import percent

from .report_html import render_html

_OUTLIERS = 5
#: long side of the thumbnails, pixels
THUMBNAIL_SIZE = 192
#: most frames a sample clip's strip shows (evenly spread over its training window)
STRIP_FRAMES = 6
#: long side of each frame of a strip, pixels
STRIP_SIZE = 112


@dataclass(frozen=True)
class Sample:
    """One thumbnail: the row, its file name, sizes, crop box and the JPEG data URI."""

    row: int
    name: str
    size: tuple[int, int]
    crop_box: tuple[float, float, float, float]
    crop_fraction: float
    uri: str
    frames: tuple[int, ...] = ()  # a clip: the frame indices the strip shows (of the window start, stride, count)
    window: tuple[int, int, int] | None = None  # a clip: (start, stride, count) of its epoch-0 training window


@dataclass
class DatasetReport:
    """Everything the page shows. ``plan`` is the sampler's own :class:`~hf_arb.sampling.planning.report.PlanReport`, or
    None when the sampler refuses the configuration (``plan_error`` says why, e.g. no bucket holds one global batch)."""

    title: str
    buckets: BucketSet
    rows: int
    counts: np.ndarray  # (k,) kept rows per bucket
    steps: np.ndarray  # (k,) global batches (steps) per target bucket, from the plan report
    dropped: np.ndarray  # (k,) rows per bucket not trained this epoch
    repeated: np.ndarray  # (k,) extra samples per bucket ("fill")
    plan: Any
    batch_size: int
    num_processes: int
    center_crop: bool
    seed: int = 0
    leftover: str = "drop"
    plan_error: str = ""
    max_pixels_per_batch: int | None = None
    samples: dict[int, list[Sample]] = field(default_factory=dict)
    outliers: dict[str, list[tuple[str, str, str]]] = field(default_factory=dict)  # kind -> (file, sizes, value)
    skipped: dict[str, int] = field(default_factory=dict)
    skipped_examples: list[tuple[str, str]] = field(default_factory=list)
    crop_hist: tuple[np.ndarray, np.ndarray] | None = None
    error_hist: tuple[np.ndarray, np.ndarray] | None = None
    mean_crop: float = math.nan
    decoded: int = 0
    failed_thumbnails: list[tuple[str, str]] = field(default_factory=list)
    frames_hist: tuple[tuple[str, int], ...] = ()  # a clip set: rows per frame count (value_histogram)
    fps_hist: tuple[tuple[str, int], ...] = ()  # a clip set: rows per frame rate


# ----------------------------------------------------------------------------------- numbers
def cover_crop(w: np.ndarray, h: np.ndarray, bw: np.ndarray, bh: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(crop fraction, cover scale)`` of images ``(w, h)`` in buckets ``(bw, bh)``, float64 ``(n,)`` each: the
    share of the scaled image's area cut off (never below 0: an exact fit's rounding, ``-2e-16``, is 0) and
    ``max(bw / w, bh / h)`` (above 1: upscaled)."""
    w, h = np.asarray(w, np.float64), np.asarray(h, np.float64)
    bw, bh = np.asarray(bw, np.float64), np.asarray(bh, np.float64)
    scale = np.maximum(bw / w, bh / h)
    return np.maximum(1.0 - (bw * bh) / (scale * scale * w * h), 0.0), scale


def _annotated(ds: Any, buckets: BucketSet | None, image_column: str | None, annotate_kwargs: dict[str, Any]
               ) -> tuple[Any, BucketSet]:
    """The dataset with bucket columns (annotated here, header-only, when it has none) and its BucketSet."""
    from .map import add_bucket_columns

    has = all(c in ds.column_names for c in BUCKET_COLUMNS)
    if has and buckets is None:
        given = {k: v for k, v in annotate_kwargs.items() if v is not None and k != "num_proc"}
        if given:
            raise ValueError(f"The dataset is annotated already, so {sorted(given)} would change nothing: its "
                             "skip_reason column holds the decisions made at annotation. Pass buckets=... (--preset) "
                             "to annotate it again here with them, or re-run hf-arb annotate.")
        return ds, BucketSet.from_dataset(ds)
    bs = buckets if buckets is not None else BucketSet.preset("budget")
    kw = dict(annotate_kwargs)
    if image_column is None and "width_column" not in kw and "video_column" not in kw:
        raise ValueError("The dataset has no bucket columns: pass image_column=... (or width_column/height_column) "
                         "to annotate it first.")
    return add_bucket_columns(ds, bs, image_column=image_column, show_summary=False, **kw), bs


def _raw_cells(ds: Any, column: str, rows: list[int]) -> list[Any]:
    """The undecoded values of ``rows`` of an image or clip column: ``{"bytes", "path"}`` dicts, paths or bytes."""
    import datasets

    col = ds.select_columns([column])
    feature = col.features[column]
    if isinstance(feature, (datasets.Image, datasets.Video)):
        col = col.cast_column(column, type(feature)(decode=False))
    return col.select(rows)[column] if rows else []


def _file_names(cells: list[Any], rows: list[int]) -> list[str]:
    out = []
    for cell, row in zip(cells, rows):
        path = cell.get("path") if isinstance(cell, dict) else cell if isinstance(cell, str) else None
        out.append(os.path.basename(path) if path else f"row {row}")
    return out


def build_report(ds: Any, buckets: BucketSet | None = None, *, k: int = 4, batch_size: int = 1,
                 num_processes: int = 1, leftover: str = "drop", image_column: str | None = "image",
                 center_crop: bool = False, seed: int = 0, title: str | None = None,
                 max_pixels_per_batch: int | None = None, video_column: str | None = None,
                 **annotate_kwargs: Any) -> DatasetReport:
    """The numbers and thumbnails of a report on one split.

    Args:
        ds: a ``datasets.Dataset``, annotated (:func:`hf_arb.add_bucket_columns`) or raw (annotated here, reading
            image headers only, with ``buckets`` or the ``budget`` preset).
        buckets: the BucketSet; ``None``: the dataset's own (annotated) or ``BucketSet.preset("budget")``.
        k: thumbnails per bucket (the only images decoded).
        batch_size, num_processes: ``--train_batch_size`` and the number of training processes; the plan figures
            are those of ``BucketBatchSampler(ids, batch_size, num_replicas=num_processes, leftover=leftover)``.
        leftover: ``"drop"``, ``"fill"`` or ``"catch_all"`` (``--bucket_leftover``).
        image_column: the image column (thumbnails; annotation of a raw dataset). ``None``: no thumbnails.
        center_crop, seed: as the training script's ``--center_crop`` and ``--seed``: the crop box drawn is
            :meth:`~hf_arb.BucketedImageDataset.fit_row` of epoch 0.
        title: page title (default: rows and buckets).
        max_pixels_per_batch: the training script's ``--max_pixels_per_batch`` (a batch size per bucket, capped at
            ``batch_size``), passed to the sampler.
        video_column: a clip column (with a clip set): sample clips are drawn as strips of the frames they train
            on; annotation of a raw dataset reads its container headers. Default: detected (a ``Video`` column or one
            named ``video``) when ``image_column`` is not a column and the set has a frame axis.
        annotate_kwargs: for a raw dataset, to :func:`~hf_arb.add_bucket_columns` (``max_upscale``, ``min_size``,
            ``num_proc``, ``width_column``/``height_column``, ``target_fps``).
    """
    import datasets

    from hf_arb.sampling import BucketBatchSampler

    if not isinstance(ds, datasets.Dataset):
        raise TypeError(f"build_report reads one split: pass a datasets.Dataset, got {type(ds).__name__} "
                        "(for a DatasetDict, pick a split: ds['train']).")
    if k < 0:
        raise ValueError(f"`k` (thumbnails per bucket) must be >= 0, got {k}.")
    if video_column is not None:
        if video_column not in ds.column_names:
            raise ValueError(f"video_column={video_column!r} is not a column of the dataset; its columns are "
                             f"{ds.column_names}.")
        if buckets is not None or not all(c in ds.column_names for c in BUCKET_COLUMNS):  # annotated here
            annotate_kwargs["video_column"] = video_column
        image_column = None
    if image_column is not None and image_column not in ds.column_names:
        raise ValueError(f"image_column={image_column!r} is not a column of the dataset; its columns are "
                         f"{ds.column_names}. Pass image_column=... (or None for a report without thumbnails).")
    ds, bs = _annotated(ds, buckets, image_column, annotate_kwargs)
    if video_column is None and image_column is None and bs.has_frames:
        from .clips import detect_video_column

        video_column = detect_video_column(ds.features, ds.column_names, None)
    media = video_column or image_column  # the column thumbnails, strips and file names come from
    t = ds.select_columns(list(BUCKET_COLUMNS)).with_format("arrow")[:]
    ids = pc.fill_null(t.column("bucket"), -1).to_numpy().astype(np.int64)  # (n,)
    w = pc.fill_null(t.column("original_width"), 0).to_numpy().astype(np.int64)  # (n,)
    h = pc.fill_null(t.column("original_height"), 0).to_numpy().astype(np.int64)
    err = pc.cast(t.column("aspect_error"), pa.float64()).to_numpy(zero_copy_only=False)  # (n,)
    n, nb = int(ids.size), len(bs)
    kept = ids >= 0
    counts = np.bincount(ids[kept], minlength=nb)  # (k,)

    # the plan: the sampler's own report (or its error: a plan without a step is worth seeing before training)
    plan, plan_error = None, ""
    steps = np.zeros(nb, np.int64)
    dropped, repeated = np.full(nb, -1, np.int64), np.zeros(nb, np.int64)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "drops N rows": the page shows them, with the flag
            sampler = BucketBatchSampler(ids, batch_size, num_replicas=num_processes, rank=0, leftover=leftover,
                                         buckets=bs, seed=seed, log_report=False,
                                         max_pixels_per_batch=max_pixels_per_batch)
    except ValueError as e:
        plan_error = str(e)
    else:
        plan = sampler.report()
        for b, c in plan.batches_per_bucket.items():
            steps[int(b)] = int(c)
        per_rank = np.full(nb, plan.batch_size, np.int64)  # (k,) rows per process of each bucket's batches
        for b, size in plan.batch_size_per_bucket.items():
            per_rank[int(b)] = int(size)
        served = steps * per_rank * plan.num_replicas  # (k,) samples served in each target bucket
        if leftover != "catch_all":  # catch-all pools leftovers across buckets: no per-bucket split of its batches
            dropped = np.maximum(counts - served, 0)
            repeated = np.maximum(served - counts, 0)

    rep = DatasetReport(title=title or f"{n:,} rows in {nb} buckets", buckets=bs, rows=n, counts=counts,
                        steps=steps, dropped=dropped, repeated=repeated, plan=plan, batch_size=batch_size,
                        num_processes=num_processes, center_crop=center_crop, seed=seed, leftover=leftover,
                        plan_error=plan_error, max_pixels_per_batch=max_pixels_per_batch)

    if bs.has_frames and "original_frames" in ds.column_names:
        from .summary import value_histogram

        c = ds.select_columns(["original_frames", "original_fps"]).with_format("arrow")[:]
        rep.frames_hist = value_histogram(c.column(0), integer=True)
        rep.fps_hist = value_histogram(c.column(1), integer=False)

    # per-row crop and upscale of the kept rows (vectorised)
    res = bs.resolutions
    kr = np.flatnonzero(kept)  # (m,)
    crop, scale = cover_crop(w[kr], h[kr], res[ids[kr], 0], res[ids[kr], 1]) if kr.size else (np.zeros(0),) * 2
    if kr.size:
        rep.mean_crop = float(crop.mean())
        rep.crop_hist = np.histogram(crop, bins=20, range=(0.0, max(0.05, float(crop.max()))))
        e = err[kr][np.isfinite(err[kr])]
        rep.error_hist = np.histogram(e, bins=20, range=(0.0, max(0.05, float(e.max()) if e.size else 0.05)))

    # outliers (kept rows) and skipped rows: names read for a handful of rows only
    names_needed: dict[int, str] = {}
    picks: dict[str, tuple[np.ndarray, list[str]]] = {}
    if kr.size:
        logw = np.abs(np.log(w[kr] / h[kr]))
        for kind, values, fmt in (("largest upscale", scale, "{:.2f}x"), ("most extreme aspect", logw, None),
                                  ("most cropped", crop, None)):
            m = min(_OUTLIERS, values.size)
            part = np.argpartition(-values, m - 1)[:m]  # the m largest, O(n)
            part = part[np.lexsort((part, -values[part]))]  # largest first, ties by row
            top, vals = kr[part], values[part]
            shown = [fmt.format(v) if fmt else percent(v) if kind == "most cropped"
                     else f"{w[r]}:{h[r]} ({w[r] / h[r]:.2f} w/h)" for r, v in zip(top, vals)]
            picks[kind] = (top, shown)
            names_needed.update({int(r): "" for r in top})
    reasons = t.column("skip_reason")
    if int(reasons.null_count) < n:
        cats = pc.split_pattern(pc.fill_null(reasons, ""), ":", max_splits=1)
        first = pc.list_element(cats, 0)
        vc = pc.value_counts(pc.drop_null(pc.if_else(pc.equal(first, ""), pa.scalar(None, pa.string()), first)))
        rep.skipped = {d["values"]: int(d["counts"]) for d in vc.to_pylist()}
        skipped_rows = np.flatnonzero(~kept)[:20]
        names_needed.update({int(r): "" for r in skipped_rows})
    names = _names(ds, media, sorted(names_needed))
    for kind, (top, shown) in picks.items():
        rep.outliers[kind] = [(names[int(r)], f"{w[r]}x{h[r]} → {res[ids[r], 0]}x{res[ids[r], 1]}", s)
                              for r, s in zip(top.tolist(), shown)]
    if rep.skipped:
        rows_s = skipped_rows.tolist()
        why = reasons.take(pa.array(skipped_rows)).to_pylist()  # (<= 20,) reason strings
        rep.skipped_examples = [(names[r], str(reason)) for r, reason in zip(rows_s, why)]

    # thumbnails: k evenly spread rows per bucket, the crop of epoch 0 as training draws it
    if k and media is not None and kr.size:
        crop_all = np.full(n, math.nan)
        crop_all[kr] = crop
        _thumbnails(rep, ds, bs, ids, (w, h), k, media, center_crop, seed, crop_all)
    return rep


def _names(ds: Any, image_column: str | None, rows: list[int]) -> dict[int, str]:
    if not rows:
        return {}
    if image_column is None:
        return {r: f"row {r}" for r in rows}
    return dict(zip(rows, _file_names(_raw_cells(ds, image_column, rows), rows)))


def training_crop(size: tuple[int, int], bucket: tuple[int, int], row: int, *, seed: int, center_crop: bool,
                  epoch: int = 0) -> Any:
    """The :class:`~hf_arb.images.geometry.FitPlan` training uses for ``row``
    (:meth:`hf_arb.BucketedImageDataset.fit_row`:
    the same geometry and per-row draw), without building the dataset wrapper (which reads every row's columns).
    A flip mirrors the crop's pixels, not where it sits in the image (``source_box`` is unmirrored), so it is left
    out."""
    from hf_arb.images.geometry import plan_fit
    from hf_arb.rng import ROW_CROP, row_rng

    if center_crop:
        return plan_fit(size, bucket, crop="center")
    return plan_fit(size, bucket, crop="random", rng=row_rng(seed, epoch, row, ROW_CROP))


def _thumbnails(rep: DatasetReport, ds: Any, bs: BucketSet, ids: np.ndarray, sizes: tuple[np.ndarray, np.ndarray],
                k: int, image_column: str, center_crop: bool, seed: int, crop: np.ndarray) -> None:
    order = np.argsort(ids, kind="stable")  # rows grouped by bucket, ascending inside
    starts = np.searchsorted(ids[order], np.arange(len(bs)))
    ends = np.searchsorted(ids[order], np.arange(len(bs)), side="right")
    chosen: dict[int, list[int]] = {}
    for b in range(len(bs)):
        m = int(ends[b] - starts[b])
        if m:
            pos = np.unique(np.linspace(0, m - 1, min(k, m)).round().astype(np.int64))
            chosen[b] = order[starts[b] + pos].tolist()
    rows = sorted(r for rs in chosen.values() for r in rs)
    cells = dict(zip(rows, _raw_cells(ds, image_column, rows)))
    names = dict(zip(rows, _file_names([cells[r] for r in rows], rows)))
    clip_info: dict[int, tuple[int, float, float, int | None]] = {}  # row -> (frames, fps, frame_stride, frame_start)
    if bs.has_frames and rows and "original_frames" in ds.column_names:
        cols = [c for c in ("original_frames", "original_fps", "frame_stride", "frame_start") if c in ds.column_names]
        c = ds.select_columns(cols).select(rows).to_dict()
        c.setdefault("frame_start", [None] * len(rows))
        clip_info = {r: (int(f or 1), float(fps or 0.0), float(st or 1.0), s) for r, f, fps, st, s in
                     zip(rows, c["original_frames"], c["original_fps"], c["frame_stride"], c["frame_start"])}
    for b, rs in chosen.items():
        out = []
        for r in rs:
            plan = training_crop((int(sizes[0][r]), int(sizes[1][r])), bs[b][:2], r, seed=seed,
                                 center_crop=center_crop)
            frames, fps, stride, start = clip_info.get(r, (1, 0.0, 1.0, None))
            try:
                if frames > 1 and fps > 0:  # a clip: the strip of the frames it trains on
                    window = clip_window(frames, fps, int(bs[b][2]), stride, seed=seed, row=r, start=start)
                    shown = strip_indices(window)
                    uri = _strip_uri(cells[r], shown, plan.source_box, plan.size, fps)
                    rep.decoded += len(shown)
                    out.append(Sample(r, names[r], plan.size, plan.source_box, float(crop[r]), uri,
                                      tuple(shown), tuple(window)))
                    continue
                uri = _thumbnail_uri(cells[r], plan.source_box, plan.size)
            except Exception as e:  # noqa: BLE001 - a broken file is reported on the page, not fatal
                rep.failed_thumbnails.append((names[r], f"{type(e).__name__}: {e}"))
                continue
            rep.decoded += 1
            out.append(Sample(r, names[r], plan.size, plan.source_box, float(crop[r]), uri))
        rep.samples[b] = out


def clip_window(frames: int, fps: float, bucket_frames: int, stride: float, *, seed: int, row: int,
                epoch: int = 0, start: int | None = None) -> Any:
    """The :class:`~hf_arb.video.temporal.FramePlan` a clip trains on in ``epoch``: a ``slide`` row's annotated window
    (``start``, its ``frame_start``), else a random window at the row's ``frame_stride`` (the one rule,
    :func:`~hf_arb.video.temporal.plan_frames`; the bucket's frame count was matched to what the clip holds at it)."""
    from hf_arb.video.frames import FrameRule, frame_plan
    from hf_arb.video.temporal import plan_frames

    target_fps = fps / stride if stride != 1 else None
    if start is not None:
        return plan_frames(frames, fps, bucket_frames, target_fps=target_fps, mode="slide", start=int(start))
    return frame_plan(frames, fps, bucket_frames, FrameRule("bucket", 1), seed=seed, epoch=epoch, row=row,
                      target_fps=target_fps)


def strip_indices(window: Any, most: int = STRIP_FRAMES) -> list[int]:
    """Up to ``most`` frame indices of a window, evenly spread, first and last included, ascending."""
    idx = window.indices()
    pick = np.unique(np.linspace(0, idx.size - 1, min(most, idx.size)).round().astype(np.int64))
    return idx[pick].tolist()


def strip_frames(cell: Any, indices: list[int], fps: float) -> list[Any]:
    """Decode the frames ``indices`` (ascending) of a clip, displayed (rotation applied), as PIL images: one PyAV seek
    to the keyframe at or before the first, then forward to the last. A frame's index is its presentation time
    times ``fps`` (from the stream's start). Raises when the clip ends before the last index."""
    import io as _io

    import av

    src = cell.get("bytes") or cell.get("path") if isinstance(cell, dict) else cell
    fp = _io.BytesIO(src) if isinstance(src, (bytes, bytearray)) else src
    wanted, out = set(indices), {}
    with av.open(fp) as container:
        stream = container.streams.video[0]
        tb, start = stream.time_base, stream.start_time or 0
        if indices[0] > 0:
            container.seek(start + int(indices[0] / fps / tb), stream=stream, backward=True)
        for frame in container.decode(stream):
            i = round(float((frame.pts - start) * tb) * fps) if frame.pts is not None else -1
            if i in wanted and i not in out:
                im = frame.to_image()
                rotation = getattr(frame, "rotation", 0) or 0
                out[i] = im.rotate(rotation, expand=True) if rotation % 360 else im
            if i >= indices[-1]:
                break
    missing = [i for i in indices if i not in out]
    if missing:
        raise ValueError(f"the clip ended before frame {missing[0]} of its training window")
    return [out[i] for i in indices]


def _strip_uri(cell: Any, indices: list[int], box: tuple[float, float, float, float], size: tuple[int, int],
               fps: float) -> str:
    """The strip: the frames ``indices`` side by side, each shaded outside the clip's crop; a JPEG ``data:`` URI."""
    from PIL import Image

    frames = [_shade(im, box, size, STRIP_SIZE) for im in strip_frames(cell, indices, fps)]
    strip = Image.new("RGB", (sum(f.width for f in frames) + 2 * (len(frames) - 1), max(f.height for f in frames)),
                      (255, 255, 255))
    x = 0
    for f in frames:
        strip.paste(f, (x, 0))
        x += f.width + 2
    buf = io.BytesIO()
    strip.save(buf, "JPEG", quality=80)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _shade(im: Any, box: tuple[float, float, float, float], size: tuple[int, int], side: int) -> Any:
    """``im`` (the displayed image) shrunk to ``side``, shaded outside the crop ``box`` (in ``size`` coordinates),
    the crop outlined in red."""
    from PIL import Image, ImageDraw

    im = im.convert("RGB")
    im.thumbnail((side, side))
    sx, sy = im.width / size[0], im.height / size[1]
    left, top, right, bottom = box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy
    shade = Image.new("L", im.size, 0)
    d = ImageDraw.Draw(shade)
    d.rectangle([0, 0, im.width, im.height], fill=140)
    d.rectangle([left, top, right - 1, bottom - 1], fill=0)
    im = Image.composite(Image.new("RGB", im.size, (0, 0, 0)), im, shade)
    ImageDraw.Draw(im).rectangle([left, top, right - 1, bottom - 1], outline=(255, 64, 64), width=2)
    return im


def _thumbnail_uri(cell: Any, box: tuple[float, float, float, float], size: tuple[int, int]) -> str:
    """Decode one image small (JPEG draft), orient it as displayed, shade what the crop cuts off, outline the crop;
    a JPEG ``data:`` URI."""
    from PIL import ImageOps

    from hf_arb.images.fitting import open_image

    with open_image(cell) as im:
        im.draft("RGB", (THUMBNAIL_SIZE, THUMBNAIL_SIZE))
        im = ImageOps.exif_transpose(im)
        im = _shade(im, box, size, THUMBNAIL_SIZE)
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=80)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def write_report(ds: Any, path: str | os.PathLike[str], buckets: BucketSet | None = None, **kwargs: Any) -> Path:
    """:func:`build_report` + :func:`render_html`, written to ``path`` (UTF-8). Returns the path."""
    rep = build_report(ds, buckets, **kwargs)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(rep), encoding="utf-8")
    return out


__all__ = ["STRIP_FRAMES", "THUMBNAIL_SIZE", "DatasetReport", "Sample", "build_report", "clip_window", "cover_crop",
           "render_html", "strip_frames", "strip_indices", "training_crop", "write_report"]
