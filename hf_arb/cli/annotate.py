"""``hf-arb annotate`` and ``hf-arb stats`` (listed in this module's :data:`COMMANDS`, assembled by :mod:`hf_arb.cli`).

``annotate SOURCE`` loads a Hub dataset id, a local imagefolder, a Parquet/CSV/JSON file or a dataset saved with
``save_to_disk``, adds the bucket columns and saves (``--output-dir``) or pushes (``--push-to-hub``) the result.
``stats DATASET`` prints the summary of an annotated dataset and can draw the bucket chart; with
``--resolution 512,1024`` it prints rows per (tier, bucket) instead (:mod:`hf_arb.cli.tier_stats`).

Clips: ``annotate --frames 1,9,17`` gives every bucket of the table those frame counts ((width, height, frames)
buckets; 1 for the images of the dataset) and reads a clip column's container headers (``--video-column``, detected
when the dataset has a ``Video`` column and no image column); ``stats`` then prints rows and batches per (W, H, F) and
the histograms of frames and fps.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hf_arb.buckets.sets import BucketSet
from hf_arb.flag_parser import in_flags
from hf_arb.train.flags.video_flags import frame_counts

from .buckets import UsageError, add_bucket_arguments, buckets_from_args, positive_int
from .tier_stats import add_tier_arguments, run_tier_stats, tiers_from_stats_args

_FILE_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json",
                  ".arrow": "arrow"}


def load_source(source: str, split: str | None = None, streaming: bool = False) -> Any:
    """Load what ``SOURCE`` names: a saved dataset dir, a data file, a local folder, or a Hub dataset id.

    Returns a ``Dataset``/``IterableDataset`` when ``split`` is given, else a ``DatasetDict``/``IterableDatasetDict``.
    """
    import datasets

    path = Path(source)
    if path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict) and split is not None:
            if split not in ds:
                raise ValueError(f"Split {split!r} is not in {source}; its splits are {list(ds)}.")
            ds = ds[split]
        elif isinstance(ds, datasets.Dataset) and split is None:
            ds = datasets.DatasetDict({str(ds.split or "train"): ds})
        return ds.to_iterable_dataset() if streaming and isinstance(ds, datasets.Dataset) else ds
    if path.is_file():
        builder = _FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(f"Cannot tell the format of {source}: expected one of {sorted(_FILE_BUILDERS)}, "
                             f"a folder of images, a saved dataset or a Hub dataset id.")
        return datasets.load_dataset(builder, data_files=str(path), split=split, streaming=streaming)
    if path.is_dir():
        return datasets.load_dataset(str(path), split=split, streaming=streaming)  # imagefolder, parquet folder, …
    from hf_arb.annotate.hub import hub_dataset_problem

    if problem := hub_dataset_problem(source):  # a mistyped path: said now, not after load_dataset's retries
        raise FileNotFoundError(f"{source}: {problem}")
    return datasets.load_dataset(source, split=split, streaming=streaming)  # a Hub dataset id


def _splits(ds: Any) -> list[tuple[str, Any]]:
    import datasets

    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        return list(ds.items())
    return [(str(ds.split) if ds.split is not None else "train", ds)]


def _positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _pixels(text: str) -> int:
    """argparse type: a whole number of pixels >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of pixels, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 pixels, got {value}")
    return value


def _buckets(args: argparse.Namespace) -> BucketSet:
    bs = buckets_from_args(args)
    if args.aspect_range is not None:
        bs = bs.replace(aspect_range=tuple(args.aspect_range))
    frames = getattr(args, "frames", None)
    if frames:
        bs = with_frames(bs, frames, getattr(args, "short_clips", "skip"))
    elif getattr(args, "short_clips", "skip") != "skip":
        raise UsageError(f"--short-clips {args.short_clips} applies to clip buckets: pass --frames too")
    return bs


def with_frames(bs: BucketSet, frames: list[int], short_clips: str = "skip") -> BucketSet:
    """``bs`` with a frame axis: every (width, height) bucket at each of ``frames`` (bucket ids frame-major)."""
    if bs.has_frames:
        raise UsageError(f"--frames {','.join(map(str, frames))}: this bucket table has a frame axis already "
                         f"({len(bs.frame_counts)} frame counts); drop --frames")
    return bs.replace(resolutions=[(w, h, f) for f in frames for (w, h) in bs], short_clips=short_clips)


def _reference_buckets(args: argparse.Namespace) -> BucketSet | None:
    """The references' BucketSet for ``--reference-policy own --reference-resolution PX`` (else None)."""
    if args.reference_resolution is None:
        return None
    if args.reference_policy != "own" or not args.reference_columns:
        raise UsageError(f"--reference-resolution {args.reference_resolution} needs --reference-policy own and a "
                         "--reference-column: under strict every reference takes the target's bucket.")
    return _buckets(argparse.Namespace(**{**vars(args), "resolution": args.reference_resolution}))


def _chart(ds: Any, buckets: BucketSet, path: str | Path, title: str) -> Path | None:
    """Draw the chart over all splits of an annotated dataset; None (with a message) without matplotlib."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    ids, errs = [], []
    for _, part in _splits(ds):
        t = part.select_columns(["bucket", "aspect_error"]).with_format("arrow")[:]
        ids.append(t.column(0).to_numpy())
        errs.append(pc.cast(t.column(1), pa.float64()).to_numpy(zero_copy_only=False))
    try:
        from hf_arb.annotate.plot import plot_bucket_chart

        return plot_bucket_chart(buckets, np.concatenate(ids), np.concatenate(errs), path, title=title)
    except ImportError as e:
        print(f"no chart: {e}", file=sys.stderr)
        return None


# ----------------------------------------------------------------------------------- annotate
def _add_annotate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="Hub dataset id, local imagefolder, .parquet/.csv/.json file, or a save_to_disk dir")
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--output-dir",
                     help="save the annotated dataset here (datasets.save_to_disk) with bucket_chart.png")
    out.add_argument("--push-to-hub", metavar="REPO", help="push to this Hub dataset repo (with the bucket card)")
    add_bucket_arguments(p)
    p.add_argument("--aspect-range", type=float, nargs=2, metavar=("MIN", "MAX"), default=None,
                   help="skip images whose width/height is outside [MIN, MAX] (DALL-E kept 0.5 2.0)")
    p.add_argument("--image-column", default="image", help="image column (default: image)")
    p.add_argument("--video-column", "--video_column", dest="video_column", default=None,
                   help="clip column (datasets.Video, paths or bytes; images in it are 1-frame clips): container "
                        "headers only. Default: detected with --frames when there is no image column")
    p.add_argument("--frames", type=frame_counts, default=None, metavar="F1,F2,...",
                   help="give every bucket these frame counts: (width, height, frames) buckets, 1 for images (e.g. "
                        "1,17,33,49 for Wan's 4k+1 rule)")
    p.add_argument("--target-fps", "--target_fps", dest="target_fps", type=_positive_float, default=None,
                   metavar="FPS", help="the model's frame rate (Wan 16): clips are planned at FPS, fps / FPS source "
                                       "frames per trained frame")
    p.add_argument("--frame-sampling", "--frame_sampling", dest="frame_sampling", default=None,
                   choices=("head", "random", "uniform", "slide"),
                   help="the temporal mode the clips will train with: 'slide' cuts each clip into one row per window "
                        "of its bucket's frames (each row's frame_start); 'uniform' matches a clip's own frame count; "
                        "default: one row per clip, matched at --target-fps")
    p.add_argument("--slide-stride", "--slide_stride", dest="slide_stride", type=positive_int, default=None,
                   metavar="F", help="with --frame-sampling slide: target frames between window starts (default: the "
                                     "bucket's frame count, windows that do not overlap)")
    p.add_argument("--short-clips", choices=("skip", "loop"), default="skip",
                   help="a clip shorter than the smallest frame count: skip it (default, skip_reason "
                        "'too_few_frames') or loop it into that count")
    p.add_argument("--width-column", default=None, help="width column: use metadata sizes, open no image")
    p.add_argument("--height-column", default=None, help="height column (with --width-column)")
    p.add_argument("--split", default=None, help="only this split (default: all splits)")
    p.add_argument("--num-proc", type=positive_int, default=None, help="processes reading image headers")
    p.add_argument("--batch-size", type=positive_int, default=1000, help="rows per map batch (default 1000)")
    p.add_argument("--streaming", action="store_true", help="stream the source instead of downloading it first")
    p.add_argument("--max-upscale", type=_positive_float, default=None, metavar="F",
                   help="skip images that must be upscaled more than F times to cover their bucket (skip_reason "
                        "'upscale'); without it the summary warns about rows above 2x")
    p.add_argument("--min-size", type=_pixels, default=None, metavar="PX",
                   help="skip images whose shorter side is below PX pixels (skip_reason 'too_small')")
    p.add_argument("--verify", action="store_true",
                   help="also decode every image (parallel with --num-proc) and skip truncated or undecodable ones")
    p.add_argument("--reference-column", action="append", default=None, metavar="NAME", dest="reference_columns",
                   help="a reference image column of an edit dataset (repeatable): adds NAME_width, NAME_height, "
                        "NAME_bucket, NAME_bucket_width, NAME_bucket_height; a broken reference skips its row")
    p.add_argument("--reference-policy", choices=("strict", "own"), default="strict",
                   help="strict (default): each reference takes the target's bucket and crop (Flux Kontext); own: its "
                        "own bucket under --reference-resolution")
    p.add_argument("--reference-resolution", type=int, default=None, metavar="PX",
                   help="with --reference-policy own: the references' bucket side (their pixel budget, PX^2); default "
                        "the target's")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="also write the bucket chart here")
    p.add_argument("--private", action="store_true", help="with --push-to-hub: create a private repo")
    p.add_argument("--engine", choices=("datasets", "ray", "spark"), default="datasets",
                   help="where to run: datasets (default), or Ray Data / Spark for Parquet sources (writes Parquet to "
                        "--output-dir; needs hf_arb[ray] / hf_arb[spark])")


def _run_annotate(args: argparse.Namespace) -> int:
    import datasets

    from hf_arb.annotate.map import add_bucket_columns, decoding_images, summarize_annotation

    if (args.width_column is None) != (args.height_column is None):
        raise UsageError(f"pass both --width-column and --height-column, or neither (got --width-column "
                         f"{args.width_column!r}, --height-column {args.height_column!r})")
    buckets = _buckets(args)
    print(f"{buckets!r}  fingerprint {buckets.fingerprint}")
    reference_buckets = _reference_buckets(args)
    if args.engine != "datasets":
        from .engines import run_engine

        return run_engine(args, buckets, reference_buckets)
    if args.video_column is not None and not buckets.has_frames:
        raise UsageError(f"--video-column {args.video_column} needs clip buckets: pass --frames (e.g. --frames "
                         "1,17,33) to give the bucket table a frame axis")
    if args.slide_stride is not None and args.frame_sampling != "slide":
        raise UsageError(f"--slide-stride {args.slide_stride} applies to --frame-sampling slide (one row per window): "
                         "add --frame-sampling slide or drop --slide-stride")
    ds = load_source(args.source, split=args.split, streaming=args.streaming)
    image_column = None if args.width_column else args.image_column
    clips = {} if args.video_column is None and args.target_fps is None and args.frame_sampling is None else dict(
        video_column=args.video_column, target_fps=args.target_fps, frame_sampling=args.frame_sampling,
        slide_stride=args.slide_stride)
    annotated = add_bucket_columns(ds, buckets, image_column=image_column, width_column=args.width_column,
                                   **clips,
                                   height_column=args.height_column, num_proc=args.num_proc,
                                   batch_size=args.batch_size, max_upscale=args.max_upscale, min_size=args.min_size,
                                   show_summary=False, verify=args.verify,
                                   reference_columns=args.reference_columns, reference_policy=args.reference_policy,
                                   reference_buckets=reference_buckets)
    if args.streaming and args.output_dir:
        # Materialise the stream once (sizes are read as it flows), then save like a map-style dataset.
        def materialise(d: Any) -> Any:
            # Image columns pass through undecoded ({"bytes", "path"}): no pixel decode, no re-encode, and a
            # broken file stays a row with its skip_reason instead of failing the copy.
            images = {k: v for k, v in (d.features or {}).items() if isinstance(v, datasets.Image)}
            raw = d
            for k in images:
                raw = raw.cast_column(k, datasets.Image(decode=False))
            out = datasets.Dataset.from_generator(lambda: (yield from raw), features=raw.features)
            return decoding_images(out)  # whoever loads the saved dataset gets PIL images

        annotated = (datasets.DatasetDict({s: materialise(d) for s, d in annotated.items()})
                     if isinstance(annotated, datasets.IterableDatasetDict) else materialise(annotated))
    streaming_push = isinstance(annotated, (datasets.IterableDataset, datasets.IterableDatasetDict))
    if not streaming_push:
        # the outlier warnings name the flags that skip them; a flag given is the user's choice: no warning for it
        warn = {} if args.max_upscale is None else {"warn_upscale": None}
        for split, part in _splits(annotated):
            print(f"== {split} ==")
            print(summarize_annotation(part, buckets, image_column=_file_column(part, args), **warn))
    if args.output_dir:
        annotated.save_to_disk(args.output_dir)
        print(f"saved to {args.output_dir}")
        chart = _chart(annotated, buckets, args.plot or Path(args.output_dir) / "bucket_chart.png",
                       f"{args.source}: rows per bucket")
        if chart:
            print(f"chart: {chart}")
    else:
        from hf_arb.annotate.hub import push_to_hub

        commit = push_to_hub(annotated, args.push_to_hub, buckets, private=args.private or None)
        print(f"pushed to {args.push_to_hub} ({getattr(commit, 'commit_url', commit)})")
        if args.plot and not streaming_push:
            chart = _chart(annotated, buckets, args.plot, f"{args.push_to_hub}: rows per bucket")
            if chart:
                print(f"chart: {chart}")
    return 0


def _file_column(ds: Any, args: argparse.Namespace) -> str:
    """Where the summary reads the skipped rows' file names: the clip column of a clip dataset, else the images'."""
    from hf_arb.annotate.clips import detect_video_column

    if getattr(args, "video_column", None):
        return args.video_column
    image_column = getattr(args, "image_column", "image")
    return detect_video_column(ds.features, ds.column_names, image_column) or image_column


# ----------------------------------------------------------------------------------- stats
def _add_stats_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dataset", help="annotated dataset: save_to_disk dir, .parquet file, local folder or Hub id")
    p.add_argument("--split", default=None, help="only this split (default: all)")
    p.add_argument("--plot", "--chart", default=None, metavar="FILE.png",
                   help="draw the bucket chart to this PNG (with --resolution: rows per tier and bucket; with "
                        "reference columns also rows per composite bucket to FILE_composite.png)")
    p.add_argument("--train-batch-size", "--train_batch_size", dest="train_batch_size", type=positive_int,
                   default=None, help="also print the batches per epoch of each bucket at this per-process batch "
                                      "(a clip dataset: 1 by default)")
    p.add_argument("--num-processes", "--num_processes", dest="num_processes", type=positive_int, default=1,
                   help="training processes, for the batches per bucket (default 1)")
    add_tier_arguments(p)


def batches_text(ds: Any, buckets: BucketSet, batch_size: int, num_processes: int) -> str:
    """The epoch plan's batches (steps) per bucket, one line, as the sampler would make them (``leftover="drop"``)."""
    import warnings

    from hf_arb.buckets.schema import read_bucket_ids
    from hf_arb.sampling import BucketBatchSampler

    ids = read_bucket_ids(ds)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            plan = BucketBatchSampler(ids, batch_size, num_replicas=num_processes, rank=0, buckets=buckets,
                                      log_report=False).report()
    except ValueError as e:
        return f"batches per bucket: no plan ({e})"
    labels = buckets.labels()
    per = ", ".join(f"{labels[int(b)]}: {int(c):,}" for b, c in sorted(plan.batches_per_bucket.items()) if c)
    return (f"batches per epoch (--train-batch-size {batch_size} x {num_processes} process"
            f"{'es' if num_processes > 1 else ''}: {plan.steps:,} steps): {per or 'none'}")


def _run_stats(args: argparse.Namespace) -> int:
    from hf_arb.annotate.map import summarize_annotation

    tiers = tiers_from_stats_args(args)
    ds = load_source(args.dataset, split=args.split)
    if tiers is not None:
        return run_tier_stats(args, _splits(ds), tiers)
    names = ds.column_names
    for cols in names.values() if isinstance(names, dict) else [names]:
        if "bucket" not in (cols or []):  # said in commands, not in Python arguments
            raise UsageError(f"{args.dataset} has no bucket columns (its columns: {', '.join(cols or [])}): annotate "
                             f"it first, e.g. hf-arb annotate {args.dataset} --output-dir {args.dataset}-arb, then "
                             f"run hf-arb stats {args.dataset}-arb.")
    buckets = BucketSet.from_dataset(ds)
    print(f"{buckets!r}  fingerprint {buckets.fingerprint}")
    from hf_arb.buckets.references import composite_label_counts, composite_summary, stored_reference_columns

    composite: dict[str, int] = {}
    names: tuple[str, ...] = ()
    for split, part in _splits(ds):
        print(f"== {split} ==")
        print(summarize_annotation(part, buckets, image_column=_file_column(part, args)))
        if args.train_batch_size is not None or buckets.has_frames:
            print(batches_text(part, buckets, args.train_batch_size or 1, args.num_processes))
        names = stored_reference_columns(part.features)
        if names:
            print(composite_summary(part))
            for label, n in composite_label_counts(part).items():
                composite[label] = composite.get(label, 0) + n
    if args.plot:
        chart = _chart(ds, buckets, args.plot, f"{args.dataset}: rows per bucket")
        if chart is None:
            return 1
        print(f"chart: {chart}")
        if composite:  # an edit dataset: rows per composite (target + references) bucket, next to the bucket chart
            from hf_arb.annotate.plot import plot_composite_chart

            path = Path(args.plot).with_name(Path(args.plot).stem + "_composite.png")
            title = f"{args.dataset}: rows per composite bucket"
            print(f"composite chart: {plot_composite_chart(composite, path, names=names, title=title)}")
    return 0


def _guard(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn the errors a user can fix (bad path, wrong column, unknown split, …) into a :class:`UsageError` phrased
    in flags (``image_column=...`` → ``--image-column``), which ``hf-arb`` reports like argparse: one line, status 2."""

    def wrapped(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except UsageError:
            raise
        except (ValueError, FileNotFoundError, TypeError, ConnectionError) as e:
            message = in_flags(str(e))
            split = getattr(args, "split", None)
            if split is not None and "split" in message.lower() and "--split" not in message:
                message = f"--split {split!r}: {message}"
            raise UsageError(message) from e

    return wrapped


#: the sub-commands of this module: ``name -> (help, add_arguments, run)``
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "annotate": ("add bucket columns to an image or clip dataset; save it or push it to the Hub",
                 _add_annotate_arguments, _guard(_run_annotate)),
    "stats": ("print the bucket summary of an annotated dataset (or rows per tier and bucket); draw the chart",
              _add_stats_arguments, _guard(_run_stats)),
}
