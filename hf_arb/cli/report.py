"""``hf-arb report`` (the HTML report of :mod:`hf_arb.annotate.report`) and ``hf-arb buckets --fit``
(:meth:`BucketSet.fit`).

``buckets --fit`` is added here, around :mod:`hf_arb.cli.buckets`' own ``buckets`` command (its options plus the
fit's; without ``--fit`` it runs unchanged), so that module keeps no dependency on dataset loading."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np

from hf_arb.flag_parser import in_flags
from hf_arb.wording import count, percent

from .buckets import UsageError, add_bucket_arguments, buckets_from_args, positive_int


def add_source_arguments(p: argparse.ArgumentParser) -> None:
    """Where a command reads a dataset's images or sizes from."""
    p.add_argument("--split", default=None, help="the split (default: train, or the only one)")
    p.add_argument("--image-column", default="image", help="image column (default: image)")
    p.add_argument("--width-column", default=None, help="width column: use metadata sizes, open no image")
    p.add_argument("--height-column", default=None, help="height column (with --width-column)")
    p.add_argument("--num-proc", type=positive_int, default=None, help="processes reading image headers")


def load_split(source: str, split: str | None) -> Any:
    """One split of a Hub id, local folder, save_to_disk dir or data file (``train`` or the only one by default)."""
    import datasets

    from .annotate import load_source

    ds = load_source(source, split=split)
    if isinstance(ds, datasets.DatasetDict):
        if "train" in ds:
            return ds["train"]
        if len(ds) != 1:
            raise UsageError(f"{source} has the splits {list(ds)}: pick one with --split")
        return next(iter(ds.values()))
    return ds


def _size_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    if (args.width_column is None) != (args.height_column is None):
        raise UsageError(f"pass both --width-column and --height-column, or neither (got --width-column "
                         f"{args.width_column!r}, --height-column {args.height_column!r})")
    kw: dict[str, Any] = {"num_proc": args.num_proc}
    if args.width_column:
        kw.update(width_column=args.width_column, height_column=args.height_column)
    return kw


def dataset_sizes(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray, int]:
    """Displayed ``(widths, heights)`` of the readable rows of ``args.fit`` (annotated: its columns; raw: image
    headers or the size columns) and how many rows had no size."""
    from hf_arb.annotate.map import add_bucket_columns
    from hf_arb.buckets.schema import BUCKET_COLUMNS, read_original_sizes
    from hf_arb.buckets.sets import BucketSet

    ds = load_split(args.fit, args.split)
    if not all(c in ds.column_names for c in BUCKET_COLUMNS):
        kw = _size_kwargs(args)
        image_column = None if args.width_column else args.image_column
        # any table gives the sizes; the widest aspect range keeps every readable row
        ds = add_bucket_columns(ds, BucketSet([(1, 1)]), image_column=image_column, show_summary=False, **kw)
    w, h = read_original_sizes(ds)
    ok = (w > 0) & (h > 0)
    return w[ok], h[ok], int((~ok).sum())


# ----------------------------------------------------------------------------------- buckets --fit
def add_fit_arguments(p: argparse.ArgumentParser) -> None:
    """``hf-arb buckets --fit DATASET`` and its options (the bucket options give --resolution, --step, sides)."""
    p.add_argument("--fit", default=None, metavar="DATASET",
                   help="fit the bucket table to this dataset's sizes (BucketSet.fit): the --n-buckets shapes at "
                        "--resolution² pixels (default 1024), sides multiples of --step (default 64) within "
                        "--min-side/--max-side (default half and twice --resolution), that crop its images least")
    p.add_argument("--n-buckets", type=positive_int, default=16, help="--fit: most buckets (default 16)")
    p.add_argument("--max-crop", type=float, default=None, metavar="SHARE",
                   help="--fit: largest share of any image's area that may be cut off (e.g. 0.2)")
    p.add_argument("--save", default=None, metavar="FILE.json", help="--fit: write the BucketSet as JSON here")
    add_source_arguments(p)


def fit_from_args(args: argparse.Namespace) -> Any:
    """The fitted BucketSet of ``hf-arb buckets --fit``; prints how to use it."""
    from pathlib import Path

    from hf_arb.buckets.sets import BucketSet

    if args.preset not in (None, "budget") or args.aspect_ratio_buckets:
        raise UsageError("--fit makes its own table: drop --preset / --aspect-ratio-buckets (use --resolution, "
                         "--step, --min-side, --max-side to shape it)")
    if args.metric != "log":
        raise UsageError(f"--fit minimises the crop of the 'log' assignment (the nearest bucket in log aspect is the "
                         f"one that crops least); got --metric {args.metric}. Drop --metric.")
    if args.scheduler:
        raise UsageError("--scheduler prints the shift of a given table: fit first, then run hf-arb buckets "
                         "--aspect-ratio-buckets \"<the printed string>\" --scheduler PATH")
    w, h, missing = dataset_sizes(args)
    if w.size == 0:
        raise UsageError(f"--fit {args.fit}: no row has a readable size ({count(missing, 'row')} without one)")
    resolution, step = args.resolution or 1024, args.step or 64
    try:
        bs = BucketSet.fit((w, h), args.n_buckets, step=step, max_pixels=resolution * resolution,
                           max_crop=args.max_crop, min_side=args.min_side, max_side=args.max_side,
                           max_aspect_error=args.max_aspect_error)
    except ValueError as e:
        raise UsageError(in_flags(str(e), {"n_buckets=": "--n-buckets ", "`max_crop`": "--max-crop",
                                           "max_crop=": "--max-crop ", "`step`": "--step",
                                           "`min_side`/`max_side`": "--min-side/--max-side",
                                           "`aspect_range`": "--aspect-range at annotation"})) from e
    from hf_arb.annotate.report import cover_crop

    ids, _ = bs.assign(w, h)
    crop, scale = cover_crop(w, h, bs.resolutions[ids, 0], bs.resolutions[ids, 1])
    left_out = f" ({count(missing, 'row')} skipped or without a size left out)" if missing else ""
    print(f"fitted to {w.size:,} sizes from {args.fit}{left_out}: {count(len(bs), 'bucket')}, mean crop "
          f"{percent(crop.mean(), 2)}, worst {percent(crop.max())}, {percent((scale > 1).mean())} of rows upscaled")
    if len(bs) < args.n_buckets:  # say why (the fit again, for its reason: cheap next to reading the sizes)
        from hf_arb.buckets.fit import fit_table

        print(fit_table(w, h, args.n_buckets, step=step, max_pixels=resolution * resolution, max_crop=args.max_crop,
                        min_side=args.min_side, max_side=args.max_side).fewer)
    spec = ";".join(f"{bh},{bw}" for bw, bh in bs)
    print(f"use it: --aspect_ratio_buckets \"{spec}\" (training; --bucket_metric log) or hf-arb annotate "
          f"--aspect-ratio-buckets \"{spec}\"")
    if args.save:
        Path(args.save).write_text(bs.to_json() + "\n", encoding="utf-8")
        print(f"saved: {args.save} (BucketSet.from_json)")
    return bs


# ----------------------------------------------------------------------------------- report
def _add_report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dataset", help="Hub dataset id, local imagefolder, .parquet file or save_to_disk dir; annotated "
                                   "or raw (annotated on the fly from image headers)")
    p.add_argument("--out", required=True, metavar="FILE.html", help="where to write the report")
    add_source_arguments(p)
    add_bucket_arguments(p)
    p.set_defaults(preset=None)  # none given: an annotated dataset's own BucketSet, else 'budget'
    p.add_argument("--train-batch-size", "--train_batch_size", dest="train_batch_size", type=positive_int, default=1,
                   help="the training script's --train_batch_size (rows per batch per process; default 1)")
    p.add_argument("--num-processes", "--num_processes", dest="num_processes", type=positive_int, default=1,
                   help="training processes (accelerate launch --num_processes; default 1)")
    p.add_argument("--max-pixels-per-batch", "--max_pixels_per_batch", dest="max_pixels_per_batch",
                   type=positive_int, default=None,
                   help="the training script's --max_pixels_per_batch: a batch size per bucket (pixel budget)")
    p.add_argument("--bucket-leftover", "--bucket_leftover", dest="bucket_leftover", default="drop",
                   choices=("drop", "fill", "catch_all"), help="the training script's --bucket_leftover")
    p.add_argument("--center-crop", "--center_crop", dest="center_crop", action="store_true",
                   help="draw the training script's --center_crop crops (default: its random crops of epoch 0)")
    p.add_argument("--seed", type=int, default=0, help="the training script's --seed (random crops; default 0)")
    p.add_argument("-k", "--samples", type=int, default=4, help="thumbnails per bucket (default 4)")
    p.add_argument("--video-column", "--video_column", dest="video_column", default=None,
                   help="clip column: each sample clip is drawn as a strip of the frames it trains on (default: the "
                        "Video column of a dataset annotated with frame buckets)")
    p.add_argument("--max-upscale", type=float, default=None,
                   help="annotating here (a raw dataset, or --preset given): annotate's --max-upscale")
    p.add_argument("--min-size", type=int, default=None,
                   help="annotating here (a raw dataset, or --preset given): annotate's --min-size")


def _run_report(args: argparse.Namespace) -> int:
    from hf_arb.annotate.report import build_report, render_html
    from hf_arb.annotate.report_html import decode_problems

    ds = load_split(args.dataset, args.split)
    explicit = args.preset is not None or args.aspect_ratio_buckets
    if not explicit:
        args.preset = "budget"
    buckets = buckets_from_args(args) if explicit or "bucket" not in ds.column_names else None
    kw = _size_kwargs(args)
    if args.max_upscale is not None:
        kw["max_upscale"] = args.max_upscale
    if args.min_size is not None:
        kw["min_size"] = args.min_size
    image_column = args.image_column if args.image_column in ds.column_names else None
    if args.video_column is not None:
        kw["video_column"] = args.video_column
    rep = build_report(ds, buckets, k=args.samples, batch_size=args.train_batch_size,
                       num_processes=args.num_processes, leftover=args.bucket_leftover, image_column=image_column,
                       center_crop=args.center_crop, seed=args.seed, title=f"{args.dataset}: what bucketing does",
                       max_pixels_per_batch=args.max_pixels_per_batch,
                       **kw)
    from pathlib import Path

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(rep), encoding="utf-8")
    print(rep.plan if rep.plan is not None else f"no training plan: {rep.plan_error}")
    print(f"report: {out} ({count(len(rep.buckets), 'bucket')}, {count(rep.decoded, 'thumbnail')}, mean crop "
          f"{percent(rep.mean_crop, 2)})")
    if (problems := decode_problems(rep)) is not None:
        print(problems)
    return 0


def _guarded(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Errors a user can fix (bad path, column, split) → one line phrased in flags (``hf-arb report: error: ...``)."""

    def wrapped(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except UsageError:
            raise
        except (ValueError, FileNotFoundError, TypeError, ConnectionError) as e:
            raise UsageError(in_flags(str(e))) from e

    return wrapped


def _buckets_command() -> tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]:
    from .buckets import COMMANDS as BUCKETS_COMMANDS

    help_text, add_args, run = BUCKETS_COMMANDS["buckets"]

    def add(p: argparse.ArgumentParser) -> None:
        add_args(p)
        add_fit_arguments(p)

    def run_fit(args: argparse.Namespace) -> int:
        if not args.fit:
            return run(args)
        bs = fit_from_args(args)
        print(f"{bs!r}\nfingerprint {bs.fingerprint}")
        print(bs.table())
        return 0

    return help_text + " (--fit DATASET: fit one to a dataset's sizes)", add, run_fit


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "buckets": _buckets_command(),
    "report": ("write one offline HTML page of what bucketing does to a dataset (counts, plan, crops, outliers)",
               _add_report_arguments, _guarded(_run_report)),
}
