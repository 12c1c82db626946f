#!/usr/bin/env python
"""LoRA entry point: ``train_text_to_image_arb.py`` with LoRA as the training mode.

diffusers ships LoRA training as separate scripts (``train_text_to_image_lora.py``,
``train_text_to_image_lora_sdxl.py``) whose README commands pass no ``--rank``. Swap the script name for this one
and those commands run unchanged, training LoRA adapters (rank 4 unless ``--rank`` says otherwise). With
``train_text_to_image_arb.py`` itself, pass ``--rank`` or ``--lora`` (see docs/training.md, "LoRA").
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

if __name__ == "__main__":
    import runpy

    sys.argv = [str(Path(__file__).with_name("train_text_to_image_arb.py")), "--lora", *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
