"""hf_arb.train.signals' pure parts (issue 34, item 4): the resume command, the stop line, which signals save, and the
agreement of the ranks. The real runs stopped by SIGINT and SIGTERM are in tests/test_fault_train.py (one process) and
the 2-process batch (a signal that reaches one rank only)."""

from __future__ import annotations

import shlex
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from hf_arb.train.signals import Stop, StopOnSignal, TrainingStopped, resume_command, stop_line, wants_checkpoint


def test_the_resume_command_replaces_any_resume_flag_and_names_the_launcher() -> None:
    argv = ["--output_dir", "out dir", "--resume_from_checkpoint", "latest", "--seed", "0"]
    cmd = resume_command("train.py", argv, Path("out dir/checkpoint-3"), {})
    assert cmd == "python train.py --output_dir 'out dir' --seed 0 --resume_from_checkpoint 'out dir/checkpoint-3'"
    assert shlex.split(cmd)[2:] == ["--output_dir", "out dir", "--seed", "0", "--resume_from_checkpoint",
                                    "out dir/checkpoint-3"]
    eq = resume_command("t.py", ["--resume_from_checkpoint=checkpoint-2", "--x"], "c", {})
    assert eq == "python t.py --x --resume_from_checkpoint c"
    torchrun = {"TORCHELASTIC_RUN_ID": "1", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}
    assert resume_command("t.py", [], "c", torchrun).startswith("torchrun --nproc_per_node 2 t.py")
    assert resume_command("t.py", [], "c", {**torchrun, "WORLD_SIZE": "4"}).startswith(
        "torchrun --nproc_per_node 2 [same options] t.py")
    assert resume_command("t.py", [], "c", {**torchrun, "ACCELERATE_DYNAMO_BACKEND": "no"}).startswith(
        "accelerate launch [same options] t.py")


def test_sigterm_saves_by_default_and_ctrl_c_does_not() -> None:
    assert wants_checkpoint("sigterm", signal.SIGTERM) and not wants_checkpoint("sigterm", signal.SIGINT)
    assert wants_checkpoint("any", signal.SIGINT) and wants_checkpoint("any", signal.SIGTERM)
    assert not wants_checkpoint("none", signal.SIGTERM)


def test_the_stop_line_says_what_was_saved_or_the_last_checkpoint() -> None:
    term = TrainingStopped(Stop(signal.SIGTERM, True), 3)
    assert stop_line(term, Path("o/checkpoint-3"), "CMD") == (
        "Stopped by SIGTERM after update 3; saved o/checkpoint-3. Resume with: CMD")
    ctrl_c = TrainingStopped(Stop(signal.SIGINT, False), 3)
    assert stop_line(ctrl_c, Path("o/checkpoint-2"), "CMD") == (
        "Stopped by SIGINT after update 3 (no checkpoint on SIGINT: see --checkpoint_on_signal); last checkpoint "
        "o/checkpoint-2. Resume with: CMD")
    assert stop_line(ctrl_c, None, None).endswith("no checkpoint was saved: start the run again to train.")


def test_a_signal_is_recorded_and_a_second_ctrl_c_stops_at_once() -> None:
    """The handler records the first signal (the loop stops at the next update boundary); a second Ctrl-C raises
    KeyboardInterrupt at once; the previous handlers come back at exit."""
    one = SimpleNamespace(num_processes=1)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with StopOnSignal("sigterm") as stop:
        assert stop.agree(one) is None
        signal.raise_signal(signal.SIGTERM)
        assert stop.agree(one) == Stop(signal.SIGTERM, True)
        signal.raise_signal(signal.SIGTERM)  # a second SIGTERM changes nothing
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    with StopOnSignal("sigterm") as stop:
        signal.raise_signal(signal.SIGINT)
        assert stop.agree(one) == Stop(signal.SIGINT, False)
