"""Floor 5, ``families/``: one adapter per model family — everything that differs between SD 1.x/2.x, SDXL,
SD3/3.5, Flux.1, Flux.2, Qwen-Image, Z-Image, Wan, HunyuanVideo 1.5 and the edit models, behind one interface the
training script asks (:class:`~hf_arb.families.base.Family`).

- :mod:`~hf_arb.families.base` — :class:`Family`, :class:`Models` and the registry (:func:`detect_family`,
  :func:`get_family`, :func:`register_family`);
- :mod:`~hf_arb.families.sd`, :mod:`~hf_arb.families.sdxl` — the UNet families, on
  :mod:`~hf_arb.families.unet` (shared loading, hooks, pipeline) and :mod:`~hf_arb.families.unet_loss` (the
  epsilon / v-prediction objective); :mod:`~hf_arb.families.conditioning` (SDXL time ids, SD resolution
  conditioning) and :mod:`~hf_arb.families.sd_pipeline` (its pipeline);
- :mod:`~hf_arb.families.sd3`, :mod:`~hf_arb.families.flux`, :mod:`~hf_arb.families.flux2` (dev and klein; +
``flux2_text``) — the
  flow-matching families, on
  :mod:`~hf_arb.families.flow_family` (the adapter) and :mod:`~hf_arb.families.flow` (the shared step);
  :mod:`~hf_arb.families.shift` (each bucket's resolution shift ``mu``, as the pipelines compute it);
  :mod:`~hf_arb.families.flux_kontext` — Flux.1 Kontext, Flux with reference-image tokens (edit models);
  :mod:`~hf_arb.families.flux2_refs` — Flux.2's reference-image tokens;
- :mod:`~hf_arb.families.qwenimage` — Qwen-Image; :mod:`~hf_arb.families.qwenimage_edit` — Qwen-Image-Edit (one
  reference image) and :mod:`~hf_arb.families.qwenimage_edit_plus` — Qwen-Image-Edit-2509/2511 (several), with
  :mod:`~hf_arb.families.qwen_processor` (their Qwen2-VL processor, images only);
- :mod:`~hf_arb.families.zimage` — Z-Image;
- :mod:`~hf_arb.families.video_family` — what every video family shares: (W, H, F) bucket checks against its frame
  rule and spatial multiple, and the card's MP4 of a trained bucket;
- :mod:`~hf_arb.families.wan` — Wan 2.1 / 2.2 text-to-video: clips ``(B, C, F, H, W)`` (stills as 1-frame clips), its
  video VAE's frame rule (:meth:`~hf_arb.families.base.Family.frame_rule`) and fixed shift;
- :mod:`~hf_arb.families.ltx` — LTX-Video text-to-video: Wan's clips, T5 prompts with their mask, packed latents and
  the per-bucket shift over the video sequence length;
- :mod:`~hf_arb.families.hunyuan_video15` — HunyuanVideo 1.5 text-to-video: Qwen2.5-VL + ByT5 prompts, 4k+1 frames,
  fixed shift, LoRA loaded with the transformer's ``load_lora_adapter``;
- :mod:`~hf_arb.families.loss_mask` — the masked loss (``--masked_loss``): every family's per-element error weighted
  by the batch's ``loss_mask``, in one place.
- :mod:`~hf_arb.families.sample_weights` — per-sample loss weights, one reduction for every
  family (prior preservation's instance + weight x class loss, several datasets' loss weights).

The flow-matching families are :data:`FLOW_FAMILIES` (:func:`flow_families`): the registered adapters whose
``objective`` is ``"flow"``.

Detection and the adapters' flag checks do not import torch.

May import: the ground floor, and :mod:`hf_arb.video.frames` (a video family's frame rule, the VAE's
``4k+1`` / ``8k+1``); families do not depend on how data is bucketed or sampled.

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

from typing import Any

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
           "family_names", "flow_families", "get_family", "register_family", "unregister_family"]


def flow_families() -> tuple[str, ...]:
    """The families trained with the flow-matching objective: every registered adapter (built-in or plugin) whose
    :attr:`~hf_arb.families.base.Family.objective` is ``"flow"``, in :func:`family_names` order."""
    return tuple(name for name in family_names() if get_family(name).objective == "flow")


def __getattr__(name: str) -> Any:
    """``FLOW_FAMILIES``: :func:`flow_families`, asked of the registry on each read (the 0.1 name of a list once kept
    by hand)."""
    if name == "FLOW_FAMILIES":
        return flow_families()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def detect_flow_family(model: str) -> str | None:
    """The family of a flow-matching checkpoint (one of :func:`flow_families`), else ``None`` (:func:`detect_family`
    for any family)."""
    family = detect_family(model)
    return family if get_family(family).objective == "flow" else None
