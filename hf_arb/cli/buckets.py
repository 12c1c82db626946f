"""``hf-arb buckets`` and the options that choose a BucketSet, shared by every sub-command that builds one."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from hf_arb.buckets.matching import METRICS
from hf_arb.buckets.presets import PRESETS
from hf_arb.buckets.resolve import resolve_buckets
from hf_arb.buckets.sets import BucketSet
from hf_arb.checks import check_resolution


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (the error names the value; argparse adds the flag)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


class UsageError(ValueError):
    """A bad option value or combination, already phrased in flags: ``hf-arb`` reports it like argparse does
    (``hf-arb SUBCOMMAND: error: ...``, exit status 2) instead of a traceback."""




def resolution_side(text: str) -> int:
    """argparse type for ``--resolution``: a positive side, not a pixel count
    (:func:`hf_arb.buckets.presets.check_resolution`)."""
    value = positive_int(text)
    try:
        check_resolution(value, "--resolution")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def add_bucket_arguments(p: argparse.ArgumentParser) -> None:
    """Options that choose a BucketSet; shared by every sub-command that builds one."""
    p.add_argument("--preset", choices=PRESETS, default="budget",
                   help="bucket table (see docs/buckets.md): 'budget' (pixel budget --resolution², OneTrainer "
                        "aspects), 'novelai', 'sdxl', the model families' own 'pixart', 'sana', 'hunyuan_dit', "
                        "'flux_kontext', or the trainers' 'diffusers', 'onetrainer', 'kohya'. Default: budget.")
    p.add_argument("--aspect-ratio-buckets", default=None, metavar="H,W;H,W",
                   help="explicit buckets in diffusers' format, height first (replaces --preset).")
    p.add_argument("--resolution", type=resolution_side, default=None,
                   help="pixel budget side (budget, diffusers, onetrainer, kohya; default 1024) or model resolution "
                        "(pixart 256-2048, sana 512-4096; default 1024). Fixed tables ignore it and say so.")
    p.add_argument("--step", type=positive_int, default=None,
                   help="side multiple (budget, onetrainer, kohya: default 64; diffusers: its divisibility, 16).")
    p.add_argument("--min-side", type=positive_int, default=None, help="kohya's min_bucket_reso (default 256).")
    p.add_argument("--max-side", type=positive_int, default=None, help="kohya's max_bucket_reso (default 1024).")
    p.add_argument("--metric", choices=(*METRICS, "native"), default="log",
                   help="aspect distance: 'log' (default, symmetric), NovelAI's 'linear' (w/h), 'linear_hw' (h/w), "
                        "diffusers' 'cross', or 'native': the preset's own source's matching rule.")
    p.add_argument("--max-aspect-error", type=non_negative_float, default=None,
                   help="skip images farther than this from every bucket (in --metric units).")


def buckets_from_args(args: argparse.Namespace) -> BucketSet:
    """Build the BucketSet the options describe; notes about ignored options are printed, not raised."""
    params = {k: v for k in ("min_side", "max_side") if (v := getattr(args, k, None)) is not None}
    bs, notes = resolve_buckets(args.preset, getattr(args, "aspect_ratio_buckets", None), resolution=args.resolution,
                                step=args.step, metric=args.metric, max_aspect_error=args.max_aspect_error, **params)
    for note in notes:
        print(f"note: {note}")
    return bs


def _add_buckets_arguments(p: argparse.ArgumentParser) -> None:
    add_bucket_arguments(p)
    p.add_argument("--scheduler", default=None, metavar="PATH",
                   help="a flow-matching model folder, its scheduler/ folder or scheduler_config.json: also print each "
                        "bucket's latent token count and resolution shift mu (SD3, Flux).")
    p.add_argument("--vae-scale-factor", type=positive_int, default=8,
                   help="VAE downsampling for --scheduler (default 8).")
    p.add_argument("--patch-size", type=positive_int, default=2,
                   help="transformer patch size for --scheduler (default 2).")


def _scheduler_config(path: str) -> dict:
    import json
    from pathlib import Path

    p = Path(path)
    for cand in (p, p / "scheduler_config.json", p / "scheduler" / "scheduler_config.json"):
        if cand.is_file():
            return json.loads(cand.read_text())
    raise UsageError(f"--scheduler {path}: no scheduler_config.json there (tried the file, PATH/scheduler_config.json "
                     "and PATH/scheduler/scheduler_config.json). Pass a model folder, its scheduler/ folder or the "
                     "JSON file.")


def _run_buckets(args: argparse.Namespace) -> int:
    bs = buckets_from_args(args)
    print(f"{bs!r}\nfingerprint {bs.fingerprint}")
    print(bs.table())
    if args.scheduler:
        from hf_arb.families.shift import ShiftConfig, shift_table_text

        cfg = ShiftConfig.from_scheduler_config(_scheduler_config(args.scheduler))
        print(f"\nresolution shift ({'dynamic' if cfg.use_dynamic_shifting else f'static shift={cfg.shift}'}, "
              f"VAE factor {args.vae_scale_factor}, patch {args.patch_size}):")
        try:
            text = shift_table_text(bs, cfg, args.vae_scale_factor, args.patch_size)
        except ValueError as e:  # the library's advice names Python and script spellings: say it in this CLI's flags
            step = args.vae_scale_factor * args.patch_size
            raise UsageError(f"--scheduler: {str(e).partition(' Use bucket sides')[0]} Pass --step {step} (or a "
                             f"multiple of {step}), or a --preset whose table is.") from None
        print(text)
    return 0


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "buckets": ("print a bucket table", _add_buckets_arguments, _run_buckets),
}
