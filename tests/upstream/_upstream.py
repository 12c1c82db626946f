"""What diffusers' example tests import from ``examples/test_examples_utils.py``, re-done offline and in-process.

diffusers' tests run ``accelerate launch <config> examples/.../train_*.py <flags>`` in a subprocess, with Hub ids for
the models and the data. Here (substitutions, listed again in each ported file's header):

* ``run_command(launch_args + [script, *flags])`` runs OUR script (:data:`SCRIPTS`) in this process, as
  ``python script flags`` would (``runpy``, ``__name__ == "__main__"``; a fresh python costs ~7 s of imports per run,
  and one-process ``accelerate launch`` on a CPU machine is ``python script``), then resets accelerate's process-wide
  state (what a new process would start with). The run uses one torch thread (``torch.set_num_threads(1)``, as
  torchrun sets ``OMP_NUM_THREADS=1`` per process): two xdist workers with two threads each on two cores made these
  tiny runs five times slower;
* every Hub id and upstream repository path (:func:`local`) becomes a tiny local pipeline (hf_arb.testing.tiny /
  hf_arb.testing.tiny_flow) or a local image folder, built once per test run (tests/conftest.py ``shared_artifact``).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: upstream script (its file name) -> ours. The LoRA scripts map to the LoRA entry point (LoRA mode by default).
SCRIPTS = {
    "train_text_to_image.py": ROOT / "train_text_to_image_arb.py",
    "train_text_to_image_sdxl.py": ROOT / "train_text_to_image_arb.py",
    "train_text_to_image_lora.py": ROOT / "train_text_to_image_lora_arb.py",
    "train_text_to_image_lora_sdxl.py": ROOT / "train_text_to_image_lora_arb.py",
    "train_dreambooth_lora_sd3.py": ROOT / "train_text_to_image_lora_arb.py",
    "train_dreambooth_lora_flux.py": ROOT / "train_text_to_image_lora_arb.py",
    "train_dreambooth_lora_flux2.py": ROOT / "train_text_to_image_lora_arb.py",
    "train_dreambooth_lora_flux2_klein.py": ROOT / "train_text_to_image_lora_arb.py",
}

#: Hub id / upstream path -> local path; filled by the ``upstream_hub`` fixture (conftest.py) before each test.
HUB: dict[str, str] = {}


def local(name: str) -> str:
    """The local stand-in of a Hub id or upstream repository path (the name itself if it has none)."""
    return HUB.get(name, name)


def _substitute(token: str) -> str:
    if token.startswith("--") and "=" in token:
        flag, value = token.split("=", 1)
        return f"{flag}={local(value)}"
    return local(token)


class ExamplesTestsAccelerate:
    """diffusers' base class writes an accelerate config and launches with it; one CPU process needs neither."""

    _launch_args = ["accelerate", "launch"]


def run_command(command: list[str], return_stdout: bool = False) -> None:
    """Run ``accelerate launch <upstream script> <flags>`` as our script, in this process (see the module doc)."""
    import torch
    from accelerate.state import AcceleratorState, GradientState

    assert command[:2] == ["accelerate", "launch"], command
    script = SCRIPTS[Path(command[2]).name]
    argv = [str(script), *(_substitute(t) for t in command[3:])]
    saved, path, threads = sys.argv, list(sys.path), torch.get_num_threads()
    sys.argv = argv
    torch.set_num_threads(1)  # tiny models: one thread per xdist worker instead of every worker using every core
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise RuntimeError(f"{' '.join(argv)} exited with status {e.code}") from e
    finally:
        sys.argv, sys.path[:] = saved, path  # (the LoRA entry point puts the repository on sys.path)
        torch.set_num_threads(threads)
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
