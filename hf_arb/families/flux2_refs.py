"""Flux.2 with reference images: the conditioning tokens ``Flux2Pipeline`` / ``Flux2KleinPipeline`` append for
``image=[...]`` (multi-reference editing), built from a training batch's reference columns.

At inference each input image is encoded by the VAE (the posterior's mode), patchified 2×2, normalised by the VAE's
batch norm and packed; the ``j``-th image's tokens get position ids ``(10 + 10 j, row, column, 0)`` (the target's
are ``(0, row, column, 0)``), all references follow the noisy target's tokens, and the prediction keeps the target's
tokens. ``mu`` comes from the target's token count. :func:`reference_tokens` builds exactly those tokens and ids for
a batch (one ``(B, 3, H_j, W_j)`` tensor per reference column); :func:`pack_references` does the same from the
posterior modes (``--cache_latents``' cached means).

Example:
    ```py
    >>> tokens, ids = reference_tokens(vae, [before], "cpu", torch.float32)   # (B, N, 4C), (B, N, 4)
    ```
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hf_arb.lazy import LazyModule

torch: Any = LazyModule("torch")  # family detection must not import torch

__all__ = ["REFERENCE_TIME_SCALE", "batch_references", "pack_references", "reference_ids", "reference_tokens"]

#: ``Flux2Pipeline._prepare_image_ids``' ``scale``: the ``j``-th reference's time coordinate is ``scale * (1 + j)``
REFERENCE_TIME_SCALE = 10


def reference_ids(j: int, height: int, width: int, device: Any = "cpu") -> Any:
    """Position ids ``(10 + 10 j, row, column, 0)`` of the ``j``-th reference's ``height`` × ``width`` patchified
    latents: ``(H*W, 4)`` int64, as ``_prepare_image_ids``."""
    rows = torch.arange(height, device=device).repeat_interleave(width)
    cols = torch.arange(width, device=device).repeat(height)
    zeros = torch.zeros_like(rows)
    return torch.stack([zeros + REFERENCE_TIME_SCALE * (1 + j), rows, cols, zeros], dim=1)


def pack_references(vae: Any, modes: Sequence[Any], device: Any, dtype: Any) -> tuple[Any, Any]:
    """The references' posterior modes ``(B, C, h_j, w_j)`` → ``(tokens (B, N, 4C), ids (B, N, 4))``, ``N`` the
    sum of the references' ``(h_j/2)(w_j/2)``: patchified, batch-norm normalised, packed, in column order."""
    from .flux2 import normalize_latents, pack, patchify

    tokens, ids = [], []
    for j, mode in enumerate(modes):
        latents = normalize_latents(patchify(mode.to(device, torch.float32)), vae)  # (B, 4C, h/2, w/2)
        tokens.append(pack(latents).to(dtype))
        ids.append(reference_ids(j, latents.shape[-2], latents.shape[-1], device))
    b = tokens[0].shape[0]
    return torch.cat(tokens, dim=1), torch.cat(ids, dim=0).unsqueeze(0).expand(b, -1, -1)


def reference_tokens(vae: Any, references: Sequence[Any], device: Any, dtype: Any) -> tuple[Any, Any]:
    """:func:`pack_references` of the VAE posterior modes of ``references`` (``(B, 3, H_j, W_j)`` in ``[-1, 1]``)."""
    with torch.no_grad():
        modes = [vae.encode(p.to(device, vae.dtype)).latent_dist.mode() for p in references]
    return pack_references(vae, modes, device, dtype)


def batch_references(vae: Any, batch: dict[str, Any], device: Any, dtype: Any) -> tuple[Any, Any] | None:
    """A training batch's reference tokens and ids: from ``--cache_latents``' ``reference_latent_stats`` (the
    posteriors' means, their modes) or by encoding ``reference_pixel_values``; None without references."""
    if batch.get("reference_latent_stats"):
        return pack_references(vae, [s[:, 0] for s in batch["reference_latent_stats"]], device, dtype)
    refs = batch.get("reference_pixel_values")
    return reference_tokens(vae, refs, device, dtype) if refs else None
