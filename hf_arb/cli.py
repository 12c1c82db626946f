"""The ``hf-arb`` command line.

Each concern's module owns its sub-commands and their options, in a ``COMMANDS`` dict of
``name -> (help, add_arguments, run)``: ``buckets`` in :mod:`hf_arb.cli_buckets`, ``annotate`` and ``stats`` in
:mod:`hf_arb.annotate_cli`. This module only assembles them (it imports them; they never import it).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

Command = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]


def commands() -> dict[str, Command]:
    """Every sub-command, in the order ``hf-arb --help`` lists them (imported here, not at module import)."""
    from . import annotate_cli, cli_buckets

    return {**cli_buckets.COMMANDS, **annotate_cli.COMMANDS}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-arb", description="Aspect-ratio bucketing for Hugging Face datasets.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_args, _) in commands().items():
        add_args(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run a sub-command. A bad option combination the parser cannot see (e.g. ``--step`` above
    ``--resolution``) exits like an argparse error, phrased in flags."""
    from .cli_buckets import in_flags

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return commands()[args.command][2](args)
    except ValueError as e:
        if args.command != "buckets":  # the other commands report their own errors; a bug keeps its traceback
            raise
        parser.error(f"{args.command}: {in_flags(str(e))}")


if __name__ == "__main__":
    sys.exit(main())
