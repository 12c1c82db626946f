"""The ``hf-arb`` command line.

Each concern's module owns its sub-commands and their options, in a ``COMMANDS`` dict of
``name -> (help, add_arguments, run)``: ``buckets`` in :mod:`hf_arb.cli.buckets`, ``annotate`` and ``stats`` in
:mod:`hf_arb.cli.annotate`. This module only assembles them (it imports them; they never import it).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

Command = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]


def commands() -> dict[str, Command]:
    """Every sub-command, in the order ``hf-arb --help`` lists them (imported here, not at module import)."""
    from hf_arb.cli import annotate as annotate_cli
    from hf_arb.cli import buckets as cli_buckets
    from hf_arb.cli import encode as cli_encode
    from hf_arb.cli import report as cli_report

    return {**cli_buckets.COMMANDS, **annotate_cli.COMMANDS, **cli_report.COMMANDS, **cli_encode.COMMANDS}


def build_parser() -> argparse.ArgumentParser:
    return _build_parsers()[0]


def _build_parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    from hf_arb.flag_parser import FlagParser  # an unknown script spelling (--bucket_preset) names hf-arb's twin

    parser = FlagParser(prog="hf-arb", description="Aspect-ratio bucketing for Hugging Face datasets.")
    sub = parser.add_subparsers(dest="command", required=True)
    subparsers = {}
    for name, (help_text, add_args, _) in commands().items():
        subparsers[name] = sub.add_parser(name, help=help_text, description=help_text)
        add_args(subparsers[name])
    return parser, subparsers


def main(argv: Sequence[str] | None = None) -> int:
    """Run a sub-command. A bad option value or combination the parser cannot see (``--step`` above
    ``--resolution``, a ``--image-column`` the dataset lacks) exits like an argparse error, phrased in flags:
    ``hf-arb annotate: error: ...`` and exit status 2."""
    from hf_arb.flag_parser import in_flags

    from .buckets import UsageError

    parser, subparsers = _build_parsers()
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # what follows "--": another program's flags (encode)
    args, unknown = parser.parse_known_args(argv[:cut])
    if cut < len(argv):
        if "train_args" not in vars(args):
            unknown += argv[cut:]
        args.train_args = argv[cut + 1:]
    if unknown:  # said by the sub-command's parser: it knows the twins of its own flags
        subparsers[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return commands()[args.command][2](args)
    except UsageError as e:
        subparsers[args.command].error(str(e))
    except ValueError as e:
        if args.command != "buckets":  # the other commands raise UsageError for bad input; a bug keeps its traceback
            raise
        subparsers[args.command].error(in_flags(str(e)))


if __name__ == "__main__":
    sys.exit(main())
