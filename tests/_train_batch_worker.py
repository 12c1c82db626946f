"""Worker for the shared 2-process batch (tests/_train_fixtures.py ``run_batch``): several runs of
train_text_to_image_arb.py in one ``torchrun`` launch.

Each rank imports the script once and calls ``main(argv)`` for every run of ``runs.json`` in order, so the
imports (about 7 s of CPU per process, most of a tiny run's cost) are paid once for all runs instead of once per run
and process. Between runs the script's ``end_training`` has destroyed the default process group; it is created again
with ``torch.distributed.init_process_group`` (public API; a file store per run, so no key of the previous group's
TCP store can pair the wrong ranks; accelerate's state keeps the same ranks). A run may copy
a checkpoint folder before it starts (rank 0 copies, every rank waits), which is how a "resumed" run gets the full
run's checkpoint. A run with ``"worker": "<module>"`` calls that module's ``main(argv)`` (a test worker of tests/, e.g.
``_stream_worker``) instead of the script's. Each rank's output of a run goes to ``logs/<name>.rank<r>.log`` (file
descriptors 1 and 2, so tqdm and logging land there too); a status file says which runs failed, with their
tracebacks (``status.<runs file's stem>.rank<r>.json``).

Usage: ``torchrun --nproc_per_node 2 tests/_train_batch_worker.py <root>/runs.json <root>``
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch.distributed as dist  # noqa: E402 (after the sys.path line)

import train_text_to_image_arb as script  # noqa: E402


def _redirect(path: Path) -> tuple[int, int]:
    """Point fds 1 and 2 at ``path``; return the saved originals."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return saved


def _restore(saved: tuple[int, int]) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    for target, fd in zip((1, 2), saved):
        os.dup2(fd, target)
        os.close(fd)


def main() -> None:
    runs = json.loads(Path(sys.argv[1]).read_text())
    root = Path(sys.argv[2])
    stage = Path(sys.argv[1]).stem  # runs.json, or runs-restart.json (run_batch's second stage)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    (root / "logs").mkdir(parents=True, exist_ok=True)
    status: dict[str, str] = {}
    for i, run in enumerate(runs):
        if not dist.is_initialized() and (i or run.get("copy")):  # the previous run's end_training destroyed it
            # a store of its own for each new group: keys left by the previous group (or stage) cannot mix ranks up
            dist.init_process_group("gloo", init_method=(root / f"pg-{stage}-{i}").as_uri(), rank=rank,
                                    world_size=world)
        if run.get("copy"):
            if rank == 0:
                shutil.copytree(*run["copy"])
            dist.barrier()
        saved = _redirect(root / "logs" / f"{run['name']}.rank{rank}.log")
        try:
            (importlib.import_module(run["worker"]) if run.get("worker") else script).main(run["argv"])
            status[run["name"]] = ""
        except Exception:  # noqa: BLE001 - recorded for the test reading this run; the next runs still go (an exception on one
            # rank only leaves the other waiting in a collective: the launcher's timeout then fails every test)
            traceback.print_exc()
            status[run["name"]] = traceback.format_exc()[-4000:]
        finally:
            _restore(saved)
    (root / f"status.{stage}.rank{rank}.json").write_text(json.dumps(status))
    if dist.is_initialized():
        dist.destroy_process_group()
    # Everything the tests read is written. Leave without the interpreter's shutdown: after all the batch's runs in
    # one process it once hung there (threads of the runs' readers still alive), and the launcher's timeout then
    # failed every test reading the batch.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
