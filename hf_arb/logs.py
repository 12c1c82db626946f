"""Console hygiene for the training script, the CLI and the demo: library notes that tell a user nothing.

Two kinds of output are turned off, through the libraries' public logging switches, and nothing else:

* transformers' note that an image processor "requires torchvision (not installed); falling back to ...Pil" —
  printed whenever diffusers' pipelines are imported on a machine without torchvision. hf_arb never uses those
  image processors (no safety checker features are computed in training), and the fallback is the working
  class, so the note has no action for the user. Only that one logger is raised to ERROR, and only when
  torchvision is really missing.
* the weight-loading and shard-writing progress bars of transformers and diffusers ("Loading weights",
  "Loading pipeline components", "Writing model shards"): each flashes by in milliseconds for every model load
  and drowns the training progress bar.

Warnings and errors of every library still print.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
from collections.abc import Iterator

__all__ = ["quiet_library_notes", "no_text_encoder_lora_note"]

_TORCHVISION_NOTE_LOGGER = "transformers.utils.import_utils"


def quiet_library_notes(libraries: tuple[str, ...] = ("transformers", "diffusers")) -> None:
    """Turn off the notes described in the module docstring for ``libraries`` (those not installed are skipped).

    Example:
        ```py
        >>> from hf_arb.logs import quiet_library_notes
        >>> quiet_library_notes()
        >>> import transformers
        >>> transformers.utils.logging.is_progress_bar_enabled()
        False
        ```
    """
    for name in libraries:
        if name not in ("transformers", "diffusers") or importlib.util.find_spec(name) is None:
            continue
        lib = importlib.import_module(name)
        lib.utils.logging.disable_progress_bar()
    if "transformers" in libraries and importlib.util.find_spec("torchvision") is None:
        logging.getLogger(_TORCHVISION_NOTE_LOGGER).setLevel(logging.ERROR)


#: diffusers' loggers that say a LoRA file has no text-encoder keys (per text encoder, so twice for SDXL)
_LORA_NOTE_LOGGERS = ("diffusers.loaders.lora_base", "diffusers.loaders.peft", "diffusers.loaders.lora_pipeline")


def _not_a_text_encoder_note(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("No LoRA keys associated to")


@contextlib.contextmanager
def no_text_encoder_lora_note() -> Iterator[None]:
    """While loading an adapter known to hold no text-encoder weights (LoRA on the UNet / transformer only), drop
    diffusers' "No LoRA keys associated to CLIPTextModel ..." note: it is expected, and has no action for the user.
    A standard ``logging`` filter on those loggers, removed on exit; every other record still prints."""
    loggers = [logging.getLogger(name) for name in _LORA_NOTE_LOGGERS]
    for lg in loggers:
        lg.addFilter(_not_a_text_encoder_note)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(_not_a_text_encoder_note)
