"""Floor 8, ``cli/``: the ``hf-arb`` command line; the top floor, nothing in hf_arb imports it.

- :mod:`~hf_arb.cli.app` — assembles the sub-commands (``hf-arb`` = :func:`main`);
- :mod:`~hf_arb.cli.buckets` — ``hf-arb buckets``; :mod:`~hf_arb.cli.annotate` — ``annotate`` and ``stats``;
- :mod:`~hf_arb.cli.report` — ``hf-arb report``; :mod:`~hf_arb.cli.engines` — ``--engine ray|spark``;
- :mod:`~hf_arb.cli.tier_stats` — ``hf-arb stats --resolution 512,1024`` (rows per tier and bucket);
- :mod:`~hf_arb.cli.encode` — ``hf-arb encode``: latents and prompt embeddings as a sharded dataset.

May import every floor below.
"""

from .app import build_parser, commands, main

__all__ = ["build_parser", "commands", "main"]
