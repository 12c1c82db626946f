"""Stopping a run cleanly on Ctrl-C (SIGINT) or SIGTERM: at an update boundary that every rank agrees on, with an
optional checkpoint, and one line that names the last checkpoint and the command that resumes from it.

The signal handler only records the signal. At the end of every optimizer update the training loop calls
:meth:`StopOnSignal.agree`: one gather of a small integer over the ranks, so that a signal that reached
one rank only (``kill`` of one process), or every rank at slightly different moments (a terminal's Ctrl-C, a
scheduler's SIGTERM), stops every rank after the same update. The step in flight is always finished, never
abandoned half-way (no rank leaves a collective that the others are in). A second Ctrl-C stops at once, the usual
way (``KeyboardInterrupt``).

``--checkpoint_on_signal`` (:data:`CHECKPOINT_CHOICES`) says which signals save a checkpoint first. The default,
``sigterm``, saves on SIGTERM only: that is what schedulers send before they kill a job (SLURM, Kubernetes,
preemptible and spot instances), where the work since the last checkpoint would otherwise be lost; the checkpoint
is written atomically, so a save cut short by the grace period leaves the previous checkpoint intact. Ctrl-C is a
person at the terminal, who usually wants the prompt back now: no checkpoint, and the line names the last one.

The pure parts (:func:`wants_checkpoint`, :func:`resume_command`, :func:`stop_line`) are unit-tested; the handler and
the collective are exercised by a real run stopped with SIGINT and SIGTERM.
"""

from __future__ import annotations

import os
import shlex
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: ``--checkpoint_on_signal`` values: the signals that save a checkpoint before the run stops
CHECKPOINT_CHOICES = {"sigterm": (signal.SIGTERM,), "any": (signal.SIGINT, signal.SIGTERM), "none": ()}
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass(frozen=True)
class Stop:
    """The ranks agreed to stop after this update: the signal (the highest number any rank received) and whether
    to save a checkpoint first."""

    signum: int
    checkpoint: bool


class TrainingStopped(Exception):
    """Raised by the loop after the agreed update (and its checkpoint, if any); ``main`` turns it into one line."""

    def __init__(self, stop: Stop, global_step: int) -> None:
        super().__init__(f"stopped by {signal_name(stop.signum)} after update {global_step}")
        self.stop, self.global_step = stop, global_step


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def wants_checkpoint(choice: str, signum: int) -> bool:
    """Whether ``--checkpoint_on_signal choice`` saves a checkpoint when the run stops on ``signum``."""
    return signum in CHECKPOINT_CHOICES[choice]


class StopOnSignal:
    """SIGINT / SIGTERM handlers for the length of training (a context manager; the previous handlers come back at
    exit), and the per-update agreement between ranks.

    Outside the main thread (where Python cannot install handlers) it installs nothing and never stops a run.
    """

    def __init__(self, checkpoint_on_signal: str = "sigterm") -> None:
        self.choice = checkpoint_on_signal
        self.received = 0  # the first signal this process received (0: none)
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def restore(self) -> None:
        """Put the handlers back as they were before ``__enter__``."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.received and signum == signal.SIGINT:  # a second Ctrl-C: stop now, the usual way
            self.restore()
            raise KeyboardInterrupt
        self.received = self.received or signum

    def agree(self, accelerator: Any) -> Stop | None:
        """Every rank calls this once at the end of every update: the stop all ranks agree on, or None.

        One gather of this rank's signal number (0: none) when there are several processes, a few bytes per update;
        the highest number wins (SIGTERM over SIGINT).
        """
        signum = self.received
        if accelerator.num_processes > 1:
            import torch

            flag = torch.tensor([signum], device=accelerator.device, dtype=torch.int64)
            signum = int(accelerator.gather(flag).max().item())
        if not signum:
            return None
        return Stop(signum, wants_checkpoint(self.choice, signum))


def ignore_stop_signals_in_worker(_worker_id: int) -> None:
    """A DataLoader ``worker_init_fn``: the loader's worker processes ignore SIGINT and SIGTERM (a terminal's Ctrl-C
    and a scheduler's SIGTERM reach the whole process group), so that the main process decides when to stop and
    shuts them down itself; without it, a worker dies on the signal and the next batch fails with a traceback."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def launcher_prefix(env: dict[str, str]) -> str:
    """The launcher of this process, read from what the launchers put in its environment: ``accelerate launch``
    (its options are not visible to the script: ``[same options]``), ``torchrun``, or ``python``."""
    procs = env.get("LOCAL_WORLD_SIZE") or env.get("WORLD_SIZE") or "1"
    multinode = env.get("WORLD_SIZE", procs) != procs
    if "ACCELERATE_DYNAMO_BACKEND" in env:  # set by `accelerate launch`, whichever launcher it runs
        return "accelerate launch [same options]"
    if "TORCHELASTIC_RUN_ID" in env:
        return f"torchrun --nproc_per_node {procs}" + (" [same options]" if multinode else "")
    return "python"


def resume_command(script: str, argv: list[str], checkpoint: str | Path, env: dict[str, str]) -> str:
    """The command that resumes from ``checkpoint``: the launcher, the script and its arguments, with
    ``--resume_from_checkpoint`` set to ``checkpoint`` (replacing one given)."""
    args, skip = [], False
    for tok in argv:
        if skip:
            skip = False
        elif tok == "--resume_from_checkpoint":
            skip = True
        elif not tok.startswith("--resume_from_checkpoint="):
            args.append(tok)
    return f"{launcher_prefix(env)} {shlex.join([script, *args, '--resume_from_checkpoint', str(checkpoint)])}"


def stop_line(stopped: TrainingStopped, last: Path | None, command: str | None) -> str:
    """The one line printed when a run stops on a signal; ``last``: the newest checkpoint (saved on the signal when
    its step is the stopped update)."""
    name = signal_name(stopped.stop.signum)
    head = f"Stopped by {name} after update {stopped.global_step}"
    if last is not None and last.name == f"checkpoint-{stopped.global_step}":
        head += f"; saved {last}"
    elif last is not None:
        head += f" (no checkpoint on {name}: see --checkpoint_on_signal); last checkpoint {last}"
    if command is None:
        return head + "; no checkpoint was saved: start the run again to train."
    return f"{head}. Resume with: {command}"


def finish_stopped(args: Any, accelerator: Any, stopped: TrainingStopped, argv: list[str] | None = None) -> str:
    """Print (main process) and return the stop line. ``argv``: the script's arguments when ``main`` was called with
    a list (default: this process's command line)."""
    import sys

    from .checkpointing import list_checkpoints

    ckpts = list_checkpoints(args.output_dir)
    last = ckpts[-1] if ckpts else None
    script = sys.argv[0] if argv is None else "train_text_to_image_arb.py"
    command = None if last is None else resume_command(script, sys.argv[1:] if argv is None else argv, last,
                                                       dict(os.environ))
    line = stop_line(stopped, last, command)
    if accelerator.is_main_process:  # on a line of its own: the progress bar above it was left without a newline
        print(f"\n{line}", flush=True)
    return line


__all__ = ["CHECKPOINT_CHOICES", "Stop", "StopOnSignal", "TrainingStopped", "finish_stopped",
           "ignore_stop_signals_in_worker", "resume_command", "stop_line", "wants_checkpoint"]
