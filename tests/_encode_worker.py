"""Worker for the shared 2-process batch (tests/_train_fixtures.py): ``hf-arb encode`` on both ranks of the launch,
each writing its share of the shards (the main process then writes the fingerprint), before the runs that train
from the encoded dataset. ``main(argv)``: the ``hf-arb encode`` arguments."""

from __future__ import annotations


def main(argv: list[str]) -> None:
    from hf_arb.cli import main as cli

    code = cli(["encode", *argv])
    if code:
        raise SystemExit(f"hf-arb encode exited with {code}")
