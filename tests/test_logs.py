"""Console hygiene: the notes hf_arb.logs turns off are off, and real warnings still print."""

from __future__ import annotations

import importlib.util
import subprocess

import _zygote as zygote
import pytest

SNIPPET = """
import logging, sys
{setup}
from transformers import CLIPImageProcessor  # what diffusers' SD pipelines import; the torchvision note fires here
import transformers, diffusers
print("bars", transformers.utils.logging.is_progress_bar_enabled(), diffusers.utils.logging.is_progress_bar_enabled())
transformers.utils.logging.get_logger("transformers.modeling_utils").warning("a real warning")
"""


def _run(setup: str) -> subprocess.CompletedProcess[str]:
    """``python -c SNIPPET`` in a process of its own, forked from the pre-imported server (tests/_zygote.py): the
    note is printed where CLIPImageProcessor is first imported, which the server's preload does not do (the plain
    run's note, asserted below, would be missing otherwise); ~13 CPU-s of imports less than a fresh interpreter."""
    proc = zygote.run(["-c", SNIPPET.format(setup=setup)], env=zygote.script_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow  # two script processes (forked from the worker's pre-imported server)
@pytest.mark.xdist_group(zygote.GROUP)
@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="the note is printed only without "
                    "torchvision")
def test_torchvision_note_and_loading_bars_are_off_warnings_are_not() -> None:
    plain = _run("")
    assert "requires torchvision" in plain.stderr  # the note exists: otherwise this test proves nothing
    assert "bars True True" in plain.stdout
    quiet = _run("from hf_arb.logs import quiet_library_notes; quiet_library_notes()")
    assert "requires torchvision" not in quiet.stderr
    assert "bars False False" in quiet.stdout
    assert "a real warning" in quiet.stderr


def test_text_encoder_lora_note_is_dropped_only_while_loading_a_unet_only_adapter():
    """diffusers' "No LoRA keys associated to CLIPTextModel" (once per encoder) says nothing a user can act on when
    the adapter is UNet-only by design (issue 24, item 10); other records, and the note outside the block, pass."""
    import logging

    from hf_arb.logs import no_text_encoder_lora_note

    lg = logging.getLogger("diffusers.loaders.lora_base")

    def record(msg):
        return logging.LogRecord(lg.name, logging.WARNING, __file__, 1, msg, None, None)

    note = "No LoRA keys associated to CLIPTextModel found with the prefix='text_encoder'. This is safe to ignore"
    with no_text_encoder_lora_note():
        assert not lg.filter(record(note))
        assert lg.filter(record("Loading adapter weights failed"))
    assert lg.filter(record(note))
