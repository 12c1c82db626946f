"""The ``hf-arb`` command line.

Sub-commands register themselves in :data:`COMMANDS` as ``name -> (add_arguments, run)``; each
concern's module owns its own options (``buckets`` here, ``annotate`` and ``stats`` in
:mod:`hf_arb.annotate_cli`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from .buckets import BucketSet


def add_bucket_arguments(p: argparse.ArgumentParser) -> None:
    """Options that choose a BucketSet; shared by every sub-command that builds one."""
    p.add_argument("--preset", choices=("budget", "novelai", "sdxl"), default="budget",
                   help="bucket table: 'budget' (pixel budget --resolution², OneTrainer aspects), "
                        "'novelai' (NovelAI's 19 buckets) or 'sdxl' (the SDXL report's table). Default: budget.")
    p.add_argument("--resolution", type=int, default=1024, help="pixel budget side for --preset budget (default 1024).")
    p.add_argument("--step", type=int, default=64, help="side multiple for --preset budget (default 64).")
    p.add_argument("--metric", choices=("log", "linear"), default="log",
                   help="aspect distance: 'log' (default, symmetric) or NovelAI's 'linear'.")
    p.add_argument("--max-aspect-error", type=float, default=None,
                   help="skip images farther than this from every bucket (in --metric units).")


def buckets_from_args(args: argparse.Namespace) -> BucketSet:
    return BucketSet.preset(args.preset, resolution=args.resolution, step=args.step,
                            metric=args.metric, max_aspect_error=args.max_aspect_error)


def _run_buckets(args: argparse.Namespace) -> int:
    bs = buckets_from_args(args)
    print(f"{bs!r}\nfingerprint {bs.fingerprint}")
    print(bs.table())
    return 0


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "buckets": ("print a bucket table", add_bucket_arguments, _run_buckets),
}


def _register_optional_commands() -> None:
    """Import the modules that add sub-commands (kept out of module import time)."""
    from . import annotate_cli  # noqa: F401  (registers 'annotate' and 'stats')


def build_parser() -> argparse.ArgumentParser:
    _register_optional_commands()
    parser = argparse.ArgumentParser(prog="hf-arb", description="Aspect-ratio bucketing for Hugging Face datasets.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_args, _) in COMMANDS.items():
        add_args(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command][2](args)


if __name__ == "__main__":
    # Run through the imported module so that sub-commands registered by other modules land in the same
    # COMMANDS dict (under `python -m hf_arb.cli` this file is `__main__`, a second copy of the module).
    from hf_arb.cli import main as _main

    sys.exit(_main())
