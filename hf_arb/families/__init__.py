"""Model-family adapters for the flow-matching transformers: Stable Diffusion 3/3.5 and Flux.1.

The training script asks the adapter (:class:`~hf_arb.families.flow.FlowFamily`) for everything that differs
between families (loading, prompt encoding, the transformer call, LoRA targets, the pipeline class) and shares
the flow-matching step itself (:mod:`hf_arb.families.flow`). :func:`detect_flow_family` tells a checkpoint's family
from its ``model_index.json`` (or its ``transformer/config.json``), like the script detects SDXL from its UNet.

Example:
    ```py
    >>> from hf_arb.families import detect_flow_family, get_family
    >>> detect_flow_family("/models/tiny-flux")
    'flux'
    >>> get_family("flux").pipeline_class_name
    'FluxPipeline'
    ```
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the adapters import torch: loaded on first use, so detection stays instant
    from .flow import FlowFamily

__all__ = ["FLOW_FAMILIES", "detect_flow_family", "get_family"]

#: Family names the script trains with the flow-matching objective.
FLOW_FAMILIES: tuple[str, ...] = ("sd3", "flux")

_BY_CLASS = {"StableDiffusion3": "sd3", "SD3Transformer2DModel": "sd3", "Flux": "flux",
             "FluxTransformer2DModel": "flux"}


def _read_class(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("_class_name")
    except (OSError, ValueError):
        return None


def detect_flow_family(model: str) -> str | None:
    """``"sd3"`` or ``"flux"`` for a flow-matching checkpoint, else ``None`` (SD / SDXL / unknown).

    A local folder is judged by ``model_index.json``'s ``_class_name`` (``StableDiffusion3*Pipeline``,
    ``Flux*Pipeline``), else by ``transformer/config.json``'s; a Hub id by its name (``stable-diffusion-3``,
    ``sd3``, ``flux``).
    """
    root = Path(model)
    if root.is_dir():
        for config in (root / "model_index.json", root / "transformer" / "config.json"):
            name = _read_class(config) if config.is_file() else None
            if name:
                for prefix, family in _BY_CLASS.items():
                    if name.startswith(prefix):
                        return family
                return None
        return None
    lowered = root.name.lower()
    if "stable-diffusion-3" in lowered or "sd3" in lowered:
        return "sd3"
    return "flux" if "flux" in lowered else None


def get_family(name: str) -> FlowFamily:
    """The adapter for ``"sd3"`` or ``"flux"``."""
    if name == "sd3":
        from .sd3 import SD3Family

        return SD3Family()
    if name == "flux":
        from .flux import FluxFamily

        return FluxFamily()
    raise ValueError(f"Unknown flow family {name!r}; known: {', '.join(FLOW_FAMILIES)}.")
