"""Add bucket columns to any image or clip dataset: header-only sizes, vectorised assignment.

:func:`add_bucket_columns` works on ``datasets.Dataset`` (with ``num_proc``), ``IterableDataset``
(streaming, lazily) and their ``DatasetDict`` containers. It never decodes pixels: sizes come
from image headers (:func:`hf_arb.read_image_size`) or, with ``width_column``/``height_column``,
from metadata with no image IO at all. Every row is kept; rows that cannot be bucketed get
``bucket = -1`` and a ``skip_reason``.

The pure core is :func:`annotate_sizes` (numpy/pyarrow over whole arrays); the datasets glue
only feeds it batches. The BucketSet travels in the ``bucket`` column's feature metadata
(``Value("int32", id="hf_arb.buckets:{json}")``), which ``save_to_disk``, Parquet schema
metadata and the Hub card's ``dataset_info`` all keep; see :func:`hf_arb.buckets.schema.buckets_from_dataset`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from hf_arb.buckets.references import check_policy, check_reference_columns, reference_features
from hf_arb.buckets.schema import BUCKET_COLUMNS, CONFIG_ID_PREFIX, arrow_schema, bucket_features  # noqa: F401  (re-exported)
from hf_arb.buckets.sets import BucketSet
from hf_arb.images.values import arrow_values, decoding_images, sizes_of  # noqa: F401  (decoding_images re-exported)

from .arrow_batch import ANNOTATION_COLUMNS, BatchAnnotator, bucket_columns
from .clips import check_clip_set, check_frame_sampling, detect_video_column, image_clip_columns
from .core import annotate_sizes, size_column  # noqa: F401  (annotate_sizes re-exported)
from .summary import AnnotationSummary, summarize_annotation, summarize_columns  # noqa: F401  (re-exported)


# ----------------------------------------------------------------------------------- datasets glue
@functools.lru_cache(maxsize=16)
def _buckets_from_json(config: str) -> BucketSet:
    return BucketSet.from_json(config)


def _image_batch(values: Any, *, config: str, max_upscale: float | None, min_size: int | None,
                 as_dict: bool, verify: bool = False) -> Any:
    """``map`` function for the image path: header sizes → bucket columns for one batch.

    ``values`` is a Python list (streaming) or an Arrow column (map-style, read zero-copy).
    """
    if isinstance(values, (pa.ChunkedArray, pa.Array)):  # map-style: the Arrow-batch function every engine runs
        table = bucket_columns(pa.table({"image": values}), _buckets_from_json(config), image_column="image",
                               max_upscale=max_upscale, min_size=min_size, verify=verify)
        return table.to_pydict() if as_dict else table
    w, h, reasons = sizes_of(values, verify)
    buckets = _buckets_from_json(config)
    table = annotate_sizes(w, h, buckets, reasons=reasons, max_upscale=max_upscale, min_size=min_size)
    if buckets.has_frames:  # a clip set: images are 1-frame clips, with the clip columns
        table = image_clip_columns(table, buckets)
    return table.to_pydict() if as_dict else table


def _video_batch(values: Any, *, config: str, target_fps: float | None, max_upscale: float | None,
                 min_size: int | None, as_dict: bool, frame_sampling: str | None = None) -> Any:
    """``map`` function for the clip path: container headers → the bucket and clip columns for one batch, by the
    Arrow-batch function every engine runs. ``values``: an Arrow column (map-style) or a Python list (streaming)."""
    if not isinstance(values, (pa.ChunkedArray, pa.Array)):
        values = _clip_array(values)
    table = bucket_columns(pa.table({"video": values}), _buckets_from_json(config), video_column="video",
                           target_fps=target_fps, max_upscale=max_upscale, min_size=min_size,
                           frame_sampling=frame_sampling)
    return table.to_pydict() if as_dict else table


def _clip_array(values: list[Any]) -> pa.Array:
    """A streamed batch of clip values (``{"bytes", "path"}`` dicts, paths or bytes) as one Arrow column."""
    if any(isinstance(v, dict) for v in values):
        return pa.array([None if v is None else {"bytes": v.get("bytes"), "path": v.get("path")} if isinstance(v, dict)
                         else {"bytes": v, "path": None} if isinstance(v, (bytes, bytearray)) else
                         {"bytes": None, "path": str(v)} for v in values],
                        pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    return pa.array(values)


def _size_table(table: pa.Table, *, config: str, width_column: str, height_column: str, max_upscale: float | None,
                min_size: int | None) -> pa.Table:
    """``map`` function for the metadata path (map-style, the whole table at once): the bucket columns."""
    return bucket_columns(table, _buckets_from_json(config), width_column=width_column, height_column=height_column,
                          max_upscale=max_upscale, min_size=min_size)


def _size_batch(widths: list[Any], heights: list[Any], *, config: str, max_upscale: float | None,
                min_size: int | None, as_dict: bool, columns: tuple[str, str] = ("width", "height")) -> Any:
    """``map`` function for the metadata path (streaming): width/height values → bucket columns."""
    table = bucket_columns(pa.table({columns[0]: size_column(widths, columns[0]),
                                     columns[1]: size_column(heights, columns[1])}), _buckets_from_json(config),
                           width_column=columns[0], height_column=columns[1], max_upscale=max_upscale,
                           min_size=min_size)
    return table.to_pydict() if as_dict else table


def _reference_batch(batch: Any, *, config: str, reference_config: str | None, as_dict: bool,
                     **kwargs: Any) -> Any:
    """``map`` function with reference columns: the whole batch (an Arrow table, or a dict of lists when streaming)
    → the bucket columns and the reference columns, by the Arrow-batch function every engine runs."""
    table = batch if isinstance(batch, pa.Table) else pa.table(dict(batch))
    ref = None if reference_config is None else _buckets_from_json(reference_config)
    out = bucket_columns(table, _buckets_from_json(config), reference_buckets=ref, **kwargs)
    return out.to_pydict() if as_dict else out


def add_bucket_columns(
    ds: Any,
    buckets: BucketSet,
    image_column: str | None = "image",
    width_column: str | None = None,
    height_column: str | None = None,
    num_proc: int | None = None,
    batch_size: int = 1000,
    *,
    max_upscale: float | None = None,
    min_size: int | None = None,
    desc: str | None = None,
    show_summary: bool = True,
    load_from_cache_file: bool | None = None,
    verify: bool = False,
    reference_columns: Sequence[str] | None = None,
    reference_policy: str = "strict",
    reference_buckets: BucketSet | None = None,
    video_column: str | None = None,
    target_fps: float | None = None,
    frame_sampling: str | None = None,
    slide_stride: int | None = None,
) -> Any:
    """Add the bucket columns to an image or clip dataset, reading only headers (or no file at all).

    Args:
        ds: a ``datasets.Dataset``, ``IterableDataset``, ``DatasetDict`` or ``IterableDatasetDict``.
        buckets: the :class:`~hf_arb.BucketSet` to assign to (its metric and thresholds apply).
        image_column: the image column: an ``Image`` feature (read internally with ``Image(decode=False)``; the
            returned dataset still decodes it) or a column of file paths / encoded bytes. May be ``None`` when
            ``width_column`` and ``height_column`` are given.
        width_column, height_column: metadata columns with the *displayed* size (e.g. LAION's ``WIDTH``/``HEIGHT``).
            When given, no image is opened: the whole column is assigned in one vectorised pass.
        num_proc: worker processes for ``Dataset.map`` on the image path (ignored for streaming and for the
            metadata path, which is already vectorised). Results are identical for any ``num_proc``.
        batch_size: rows per ``map`` batch.
        max_upscale: skip (``skip_reason="upscale"``) images that need more than this upscale factor to cover
            their bucket, e.g. ``2.0``.
        min_size: skip (``"too_small"``) images whose shorter side is below this many pixels.
        desc: progress-bar text (default ``"Reading image sizes"``).
        show_summary: print a NovelAI-style summary when done (map-style datasets only; a streaming dataset is
            lazy — call :func:`summarize_annotation` after iterating if you want one). An annotated stream yields its
            ``Image`` columns undecoded (``{"bytes", "path"}``), so a broken image cannot end the iteration;
            :class:`~hf_arb.BucketedImageDataset` and :func:`~hf_arb.fit_to_bucket` take such values directly.
        load_from_cache_file: passed to ``Dataset.map``.
        verify: also decode every image whose header reads (in the same parallel ``map``; JPEGs at 1/8 scale), and
            skip those whose body is broken with ``skip_reason`` ``"truncated: …"`` (an interrupted download) or
            ``"undecodable: …"``. Costs a decode per image (see docs/benchmarks.md); without it such rows are kept
            and training replaces them (``--on_bad_image``). Ignored on the metadata path (no image is opened).
        reference_columns: reference image columns of an edit dataset (e.g. the "before" image of a before/after
            pair). Their headers are read like the target's and each gets ``<name>_width``, ``<name>_height``,
            ``<name>_bucket``, ``<name>_bucket_width``, ``<name>_bucket_height`` (:mod:`hf_arb.buckets.references`).
            A missing or unreadable reference skips its row (``skip_reason`` ``"reference <name>: ..."``).
        reference_policy: ``"strict"`` (default): each reference takes the target's bucket and crop, as Flux
            Kontext trains; ``"own"``: each reference gets its own bucket in ``reference_buckets``.
        reference_buckets: the references' BucketSet under ``"own"`` (their own pixel budget); default ``buckets``.
        video_column: a clip column: a ``datasets.Video`` feature (read with ``Video(decode=False)``; the returned
            dataset still decodes it), file paths or encoded bytes; an image in it is a 1-frame clip. Only container
            headers are read (:func:`hf_arb.video.clip_columns`: displayed size with rotation, frames, fps). Needs a
            clip set (``(width, height, frames)`` buckets). Default: detected when the dataset has no
            ``image_column`` but one ``Video`` column (or a column named ``video``) and ``buckets`` has a frame axis.
        target_fps: with clips, the model's frame rate (16 for Wan): ``fps / target_fps`` source frames per trained
            frame (``frame_stride``), and the bucket's frames are matched against the frames a clip holds at that rate
            by the rule training and decoding plan with (:func:`hf_arb.video.temporal.plan_frames`).
        frame_sampling: with clips, the temporal mode they will train with: ``"uniform"`` matches a clip's own frame
            count; ``"slide"`` turns each kept clip into one row per window of its bucket's frame count (every column
            repeated, ``frame_start`` the window's first source frame; map-style datasets only), counted in the
            summary; default (``"head"``/``"random"``): one row per clip, matched at ``target_fps``.
        slide_stride: with ``"slide"``, target frames between window starts (default: the bucket's frame count,
            windows that do not overlap).

    Returns:
        The same kind of object as ``ds`` with :data:`BUCKET_COLUMNS` appended (existing bucket columns are
        replaced): ``bucket`` (int32, ``-1`` = skipped), ``bucket_width``, ``bucket_height``, ``original_width``,
        ``original_height`` (int32; the displayed size), ``aspect_error`` (float32), ``skip_reason`` (string, null
        when kept; ``"unreadable: <reason>"``, ``"missing"``, ``"invalid_size"``, ``"aspect"``, ``"too_small"``,
        ``"upscale"``). No row is removed and nothing raises mid-map. The ``bucket`` feature carries the BucketSet,
        so ``BucketSet.from_dataset(result)`` restores it. A clip set (``buckets.has_frames``) also adds
        :data:`~hf_arb.buckets.schema.CLIP_BUCKET_COLUMNS`: ``bucket_frames`` (the bucket's frame count),
        ``original_frames``, ``original_fps`` (0 for an image), ``frames_exact``, ``frame_stride`` and ``frame_start``
        (null but for ``slide`` windows), for clips and images alike; a clip shorter than the smallest frame bucket
        is skipped (``"too_few_frames: ..."``) unless the set loops short clips, and a bad clip gets
        ``"unreadable: <reason>"``.

    Example:
        ```py
        >>> from datasets import load_dataset
        >>> from hf_arb import BucketSet, add_bucket_columns
        >>> ds = load_dataset("imagefolder", data_dir="my_images", split="train")
        >>> ds = add_bucket_columns(ds, BucketSet.sdxl(), num_proc=4)
        >>> ds[0]["bucket_width"], ds[0]["bucket_height"]
        (832, 1216)
        ```
    """
    import datasets

    if not isinstance(buckets, BucketSet):
        raise TypeError(f"`buckets` must be a hf_arb.BucketSet, got {type(buckets).__name__}. "
                        "Build one with BucketSet.sdxl(), BucketSet.novelai() or BucketSet.from_budget(...).")
    if (width_column is None) != (height_column is None):
        raise ValueError(f"Pass both `width_column` and `height_column` or neither, got width_column={width_column!r}, "
                         f"height_column={height_column!r}.")
    if video_column is None and width_column is None and buckets.has_frames:
        names = getattr(ds, "column_names", None)
        first = next(iter(ds.values())) if isinstance(names, dict) and ds else ds
        video_column = detect_video_column(getattr(first, "features", None), getattr(first, "column_names", None),
                                           image_column)
    elif video_column is None and width_column is None:  # clips annotated with an image set: say so, not "no column"
        names = getattr(ds, "column_names", None)
        first = next(iter(ds.values())) if isinstance(names, dict) and ds else ds
        clips = detect_video_column(getattr(first, "features", None), getattr(first, "column_names", None),
                                    image_column)
        if clips is not None and not isinstance(names, dict) and names is not None and image_column not in names:
            raise ValueError(f"image_column={image_column!r}: the dataset has no such column but a clip column "
                             f"{clips!r}: annotate clips with (width, height, frames) buckets, e.g. "
                             "BucketSet([(w, h, f), ...]) or hf-arb annotate --frames 1,17,33.")
    check_clip_set(buckets, video_column)
    check_frame_sampling(frame_sampling, slide_stride)
    if frame_sampling is not None and video_column is None:
        raise ValueError(f"frame_sampling={frame_sampling!r} applies to clips: pass video_column=... (a clip column, "
                         "with a (width, height, frames) BucketSet) or drop frame_sampling.")
    if target_fps is not None and not target_fps > 0:
        raise ValueError(f"`target_fps` must be > 0 frames per second (e.g. 16 for Wan), got {target_fps!r}.")
    if width_column is None and image_column is None and video_column is None:
        raise ValueError(
            "Nothing to read sizes from: `image_column` is None and no `width_column`/`height_column` given."
        )
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be >= 1, got {batch_size}.")
    refs = check_reference_columns(reference_columns, image_column)
    check_policy(reference_policy)
    if reference_buckets is not None and not isinstance(reference_buckets, BucketSet):
        raise TypeError(f"`reference_buckets` must be a hf_arb.BucketSet, got {type(reference_buckets).__name__}.")
    if reference_buckets is not None and reference_policy == "strict":
        raise ValueError("`reference_buckets` applies to reference_policy='own' only: under 'strict' every reference "
                         "takes the target's bucket. Pass reference_policy='own' or drop reference_buckets.")
    kwargs = dict(image_column=image_column, width_column=width_column, height_column=height_column, num_proc=num_proc,
                  batch_size=batch_size, max_upscale=max_upscale, min_size=min_size, desc=desc, verify=verify,
                  show_summary=show_summary, load_from_cache_file=load_from_cache_file)
    if refs:
        kwargs.update(reference_columns=refs, reference_policy=reference_policy, reference_buckets=reference_buckets)
    if video_column is not None:
        if refs:
            raise ValueError("reference_columns are images of an edit dataset; a clip dataset (video_column=...) takes "
                             "none. Drop reference_columns or annotate the images with image_column=...")
        kwargs.update(video_column=video_column, target_fps=target_fps, frame_sampling=frame_sampling,
                      slide_stride=slide_stride)
    if frame_sampling == "slide" and isinstance(ds, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        raise ValueError("frame_sampling='slide' turns one clip into several rows, planned over the whole dataset: "
                         "annotate a map-style Dataset (load_dataset(..., streaming=False)) or drop frame_sampling.")
    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        return type(ds)({split: add_bucket_columns(d, buckets, **kwargs) for split, d in ds.items()})  # type: ignore[arg-type]
    if isinstance(ds, datasets.IterableDataset):
        return _annotate_iterable(ds, buckets, **kwargs)
    if isinstance(ds, datasets.Dataset):
        return _annotate_dataset(ds, buckets, **kwargs)
    raise TypeError(f"`ds` must be a datasets Dataset, IterableDataset or their Dict, got {type(ds).__name__}.")


def _check_columns(names: Sequence[str] | None, wanted: dict[str, str | None]) -> None:
    """Raise naming the argument (``image_column='img'``) whose column the dataset lacks, and the columns it has."""
    if names is None:
        return  # streaming dataset with unknown features: checked on first batch by datasets
    for arg, c in wanted.items():
        if c is not None and c not in names:
            raise ValueError(f"{arg}={c!r}: the dataset has no such column; its columns are {list(names)}. "
                             f"Pass one of those as {arg}=...")


def _annotate_dataset(ds: Any, buckets: BucketSet, *, image_column: str | None, width_column: str | None,
                      height_column: str | None, num_proc: int | None, batch_size: int, max_upscale: float | None,
                      min_size: int | None, desc: str | None, show_summary: bool,
                      load_from_cache_file: bool | None, verify: bool = False, reference_columns: tuple[str, ...] = (),
                      reference_policy: str = "strict", reference_buckets: BucketSet | None = None,
                      video_column: str | None = None, target_fps: float | None = None,
                      frame_sampling: str | None = None, slide_stride: int | None = None) -> Any:
    import datasets

    added = _added_columns(buckets, reference_columns, reference_policy, reference_buckets)
    base = ds.remove_columns([c for c in dict.fromkeys((*ANNOTATION_COLUMNS, *added)) if c in ds.column_names])
    features = added
    if video_column is not None and frame_sampling == "slide":
        _check_columns(base.column_names, {"video_column": video_column})
        out = _annotate_slide(base, buckets, added, video_column=video_column, target_fps=target_fps,
                              slide_stride=slide_stride, max_upscale=max_upscale, min_size=min_size,
                              batch_size=batch_size, num_proc=num_proc, desc=desc,
                              load_from_cache_file=load_from_cache_file)
    elif video_column is not None:
        _check_columns(base.column_names, {"video_column": video_column})
        src = base.select_columns([video_column])
        if isinstance(src.features[video_column], (datasets.Video, datasets.Image)):
            src = src.cast_column(video_column, type(src.features[video_column])(decode=False))
        new = src.with_format("arrow").map(
            _video_batch, batched=True, batch_size=batch_size, num_proc=num_proc, input_columns=[video_column],
            remove_columns=[video_column], features=features, desc=desc or "Reading clip headers",
            fn_kwargs=dict(config=buckets.to_json(), target_fps=target_fps, max_upscale=max_upscale,
                           min_size=min_size, as_dict=False, frame_sampling=frame_sampling),
            load_from_cache_file=load_from_cache_file,
        ).with_format(None)
    elif reference_columns:
        read = [width_column, height_column] if width_column is not None else [image_column]
        _check_columns(base.column_names, {"image_column" if width_column is None else "width_column": read[0],
                                           **{f"reference_columns[{i}]": c for i, c in enumerate(reference_columns)}})
        src = base.select_columns([*read, *reference_columns])
        for c in [*read, *reference_columns]:
            if isinstance(src.features[c], datasets.Image):
                src = src.cast_column(c, datasets.Image(decode=False))
        new = src.with_format("arrow").map(
            _reference_batch, batched=True, batch_size=batch_size, num_proc=num_proc, remove_columns=src.column_names,
            features=features, desc=desc or "Reading image sizes", load_from_cache_file=load_from_cache_file,
            fn_kwargs=dict(config=buckets.to_json(), as_dict=False, image_column=image_column,
                           width_column=width_column, height_column=height_column, max_upscale=max_upscale,
                           min_size=min_size, verify=verify, reference_columns=reference_columns,
                           reference_policy=reference_policy,
                           reference_config=None if reference_buckets is None else reference_buckets.to_json()),
        ).with_format(None)
    elif width_column is not None:
        _check_columns(base.column_names, {"width_column": width_column, "height_column": height_column})
        # one vectorised call over the whole table (batch_size=None), in memory; datasets derives the fingerprint
        new = base.select_columns([width_column, height_column]).with_format("arrow").map(
            _size_table, batched=True, batch_size=None, keep_in_memory=True, features=features,
            remove_columns=[width_column, height_column], desc=desc or "Assigning buckets",
            fn_kwargs=dict(config=buckets.to_json(), width_column=width_column, height_column=height_column,
                           max_upscale=max_upscale, min_size=min_size),
        ).with_format(None)
    else:
        _check_columns(base.column_names, {"image_column": image_column})
        src = base.select_columns([image_column])
        if isinstance(src.features[image_column], datasets.Image):
            src = src.cast_column(image_column, datasets.Image(decode=False))
        new = src.with_format("arrow").map(
            _image_batch, batched=True, batch_size=batch_size, num_proc=num_proc, input_columns=[image_column],
            remove_columns=[image_column], features=features, desc=desc or "Reading image sizes",
            fn_kwargs=dict(config=buckets.to_json(), max_upscale=max_upscale, min_size=min_size, as_dict=False,
                           verify=verify),
            load_from_cache_file=load_from_cache_file,
        ).with_format(None)
    if not (video_column is not None and frame_sampling == "slide"):
        out = datasets.concatenate_datasets([base, new], axis=1)
    if show_summary:
        print(
            (f"== {out.split} ==\n" if out.split is not None else "")
            + str(summarize_annotation(out, buckets, image_column=video_column or image_column or "image"))
        )
    return out


def _annotate_slide(base: Any, buckets: BucketSet, added: Any, *, video_column: str, target_fps: float | None,
                    slide_stride: int | None, max_upscale: float | None, min_size: int | None, batch_size: int,
                    num_proc: int | None, desc: str | None, load_from_cache_file: bool | None) -> Any:
    """``frame_sampling="slide"`` on a map-style dataset: one batched ``map`` over every column, by the Arrow-batch
    function the engines map (:class:`~hf_arb.annotate.arrow_batch.BatchAnnotator`), each batch's clips expanded into
    their windows. The row count changes, so every input column is replaced by the function's output (the clip and
    image columns read undecoded, their features restored after)."""
    import datasets

    src = base
    decoded = {k: v for k, v in base.features.items() if isinstance(v, (datasets.Video, datasets.Image)) and v.decode}
    for k, v in decoded.items():
        src = src.cast_column(k, type(v)(decode=False))
    fn = BatchAnnotator.create(buckets, features=src.features, image_column=None, video_column=video_column,
                               target_fps=target_fps, frame_sampling="slide", slide_stride=slide_stride,
                               max_upscale=max_upscale, min_size=min_size)
    out = src.with_format("arrow").map(
        fn, batched=True, batch_size=batch_size, num_proc=num_proc, remove_columns=src.column_names,
        features=datasets.Features({**src.features, **added}), desc=desc or "Reading clip headers (slide windows)",
        load_from_cache_file=load_from_cache_file,
    ).with_format(None)
    for k, v in decoded.items():
        out = out.cast_column(k, v)
    return out


def _annotate_iterable(ds: Any, buckets: BucketSet, *, image_column: str | None, width_column: str | None,
                       height_column: str | None, num_proc: int | None, batch_size: int, max_upscale: float | None,
                       min_size: int | None, desc: str | None, show_summary: bool,
                       load_from_cache_file: bool | None, verify: bool = False,
                       reference_columns: tuple[str, ...] = (), reference_policy: str = "strict",
                       reference_buckets: BucketSet | None = None, video_column: str | None = None,
                       target_fps: float | None = None, frame_sampling: str | None = None,
                       slide_stride: int | None = None) -> Any:
    import datasets

    names = ds.column_names
    added = _added_columns(buckets, reference_columns, reference_policy, reference_buckets)
    existing = [c for c in dict.fromkeys((*ANNOTATION_COLUMNS, *added)) if names is not None and c in names]
    base = ds.remove_columns(existing) if existing else ds
    features = None
    if base.features is not None:
        # Image columns stay encoded ({"bytes", "path"}) in the annotated stream: a broken image (skipped with its
        # reason) must not end the iteration, which decoding on the fly would. The loader decodes what it trains on.
        kept = {k: type(v)(decode=False) if isinstance(v, (datasets.Image, datasets.Video)) else v
                for k, v in base.features.items()}
        features = datasets.Features({**kept, **added})
    if video_column is not None:
        _check_columns(names, {"video_column": video_column})
        src = base
        feature = (base.features or {}).get(video_column)
        if isinstance(feature, (datasets.Video, datasets.Image)):
            src = base.cast_column(video_column, type(feature)(decode=False))
        out = src.map(_video_batch, batched=True, batch_size=batch_size, input_columns=[video_column],
                      fn_kwargs=dict(config=buckets.to_json(), target_fps=target_fps, max_upscale=max_upscale,
                                     min_size=min_size, as_dict=True, frame_sampling=frame_sampling))
        return out.cast(features) if features is not None else out
    if reference_columns:
        _check_columns(names, {f"reference_columns[{i}]": c for i, c in enumerate(reference_columns)})
        src = base
        for k, v in (base.features or {}).items():
            if isinstance(v, datasets.Image):
                src = src.cast_column(k, datasets.Image(decode=False))
        out = src.map(_reference_batch, batched=True, batch_size=batch_size, fn_kwargs=dict(
            config=buckets.to_json(), as_dict=True, image_column=image_column, width_column=width_column,
            height_column=height_column, max_upscale=max_upscale, min_size=min_size, verify=verify,
            reference_columns=reference_columns, reference_policy=reference_policy,
            reference_config=None if reference_buckets is None else reference_buckets.to_json()))
        return out.cast(features) if features is not None else out
    fn_kwargs = dict(config=buckets.to_json(), max_upscale=max_upscale, min_size=min_size, as_dict=True)
    image_kwargs = {**fn_kwargs, "verify": verify}
    if width_column is not None:
        _check_columns(names, {"width_column": width_column, "height_column": height_column})
        out = base.map(_size_batch, batched=True, batch_size=batch_size, input_columns=[width_column, height_column],
                       fn_kwargs={**fn_kwargs, "columns": (width_column, height_column)})
    else:
        _check_columns(names, {"image_column": image_column})
        decoding_image = base.features is not None and isinstance(base.features.get(image_column), datasets.Image)
        src = base.cast_column(image_column, datasets.Image(decode=False)) if decoding_image else base
        # The final cast below types the new columns (and keeps the image column undecoded).
        out = src.map(_image_batch, batched=True, batch_size=batch_size, input_columns=[image_column],
                      fn_kwargs=image_kwargs)
    return out.cast(features) if features is not None else out


def _added_columns(buckets: BucketSet, reference_columns: Sequence[str], policy: str,
                   reference_buckets: BucketSet | None) -> Any:
    """``datasets.Features`` of every column annotation adds: the bucket columns, then the reference columns."""
    import datasets

    out = dict(bucket_features(buckets))
    if reference_columns:
        out.update(reference_features(reference_columns, policy, buckets, reference_buckets))
    return datasets.Features(out)
