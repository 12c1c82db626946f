"""Floor 5, ``families/``: one adapter per model family — everything that differs between SD 1.x/2.x, SDXL,
SD3/3.5, Flux.1 and Flux.2, behind one interface the training script asks (:class:`~hf_arb.families.base.Family`).

- :mod:`~hf_arb.families.base` — :class:`Family`, :class:`Models` and the registry (:func:`detect_family`,
  :func:`get_family`, :func:`register_family`);
- :mod:`~hf_arb.families.sd`, :mod:`~hf_arb.families.sdxl` — the UNet families, on
  :mod:`~hf_arb.families.unet` (shared loading, hooks, pipeline) and :mod:`~hf_arb.families.unet_loss` (the
  epsilon / v-prediction objective); :mod:`~hf_arb.families.conditioning` (SDXL time ids, SD resolution
  conditioning) and :mod:`~hf_arb.families.sd_pipeline` (its pipeline);
- :mod:`~hf_arb.families.sd3`, :mod:`~hf_arb.families.flux`, :mod:`~hf_arb.families.flux2` (dev and klein; + ``flux2_text``) — the
  flow-matching families, on
  :mod:`~hf_arb.families.flow_family` (the adapter) and :mod:`~hf_arb.families.flow` (the shared step);
  :mod:`~hf_arb.families.shift` (each bucket's resolution shift ``mu``, as the pipelines compute it);
  :mod:`~hf_arb.families.flux_kontext` — Flux.1 Kontext, Flux with reference-image tokens (edit models).

Detection and the adapters' flag checks do not import torch.

May import: the ground floor only (families do not depend on how data is bucketed or sampled).

Example:
    ```py
    >>> from hf_arb.families import detect_family, get_family
    >>> detect_family("/models/tiny-flux")
    'flux'
    >>> get_family("flux").pipeline_class_name
    'FluxPipeline'
    ```
"""

from __future__ import annotations

from .base import (
    BUILTIN_MODULES,
    Family,
    Models,
    detect_family,
    family_names,
    get_family,
    register_family,
    unregister_family,
)

__all__ = ["BUILTIN_MODULES", "FLOW_FAMILIES", "Family", "Models", "detect_family", "detect_flow_family",
           "family_names", "get_family", "register_family", "unregister_family"]

#: The built-in families trained with the flow-matching objective.
FLOW_FAMILIES: tuple[str, ...] = ("sd3", "flux", "flux2", "flux2_klein", "qwenimage", "zimage", "flux-kontext")


def detect_flow_family(model: str) -> str | None:
    """The family of a flow-matching checkpoint (one of :data:`FLOW_FAMILIES`), else ``None`` (:func:`detect_family`
    for any family)."""
    family = detect_family(model)
    return family if family in FLOW_FAMILIES else None
