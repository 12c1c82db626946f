"""A run of train_text_to_image_arb.py in which one process receives a real signal during one update (issue 34,
item 4: Ctrl-C / SIGTERM mid-run).

``python tests/_signal_worker.py --send_signal SIGTERM --at_update 3 [--on_rank R] <the script's arguments>`` (the
script run through its ``__main__`` block): the process of rank ``R`` (default 0) sends itself ``--send_signal``
(``os.kill``, a real signal, handled by whatever handler the script installed) from inside the optimizer step of
update ``--at_update`` (torch's public global step hook), then the script goes on as it would; the other ranks get no
signal. Also a ``"worker"`` of the 2-process batch (tests/_train_batch_worker.py calls ``main(argv)``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import train_text_to_image_arb as script  # noqa: E402


def main(argv: list[str], as_script: bool = False) -> dict:
    """Run the script with the signal armed; ``as_script``: through its ``__main__`` block (exit status, the command
    line it prints), as ``python train_text_to_image_arb.py ...`` would."""
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--send_signal", required=True, choices=["SIGINT", "SIGTERM"])
    p.add_argument("--at_update", type=int, required=True)
    p.add_argument("--on_rank", type=int, default=0)
    ours, rest = p.parse_known_args(argv)
    from torch.optim.optimizer import register_optimizer_step_post_hook

    updates = [0]

    def hook(*_: object) -> None:  # after every optimizer step: one per update (accelerate skips the others)
        updates[0] += 1
        if updates[0] == ours.at_update:
            os.kill(os.getpid(), getattr(signal, ours.send_signal))

    handle = register_optimizer_step_post_hook(hook) if int(os.environ.get("RANK", "0")) == ours.on_rank else None
    try:
        if as_script:
            import runpy

            sys.argv = [str(ROOT / "train_text_to_image_arb.py"), *rest]
            runpy.run_path(sys.argv[0], run_name="__main__")  # exits with the script's status if it stops
            return {}
        return script.main(rest)
    finally:
        if handle is not None:
            handle.remove()


if __name__ == "__main__":
    main(sys.argv[1:], as_script=True)
