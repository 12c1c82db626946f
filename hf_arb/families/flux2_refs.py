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
    >>> to_model = lambda mode: normalize_latents(patchify(mode), vae)
    >>> tokens, ids = reference_tokens(vae, [before], to_model, "cpu", torch.float32)   # (B, N, 4C), (B, N, 4)
    ```
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


def pack_references(modes: Sequence[Any], to_model: Callable[[Any], Any], device: Any,
                    dtype: Any) -> tuple[Any, Any]:
    """The references' posterior modes ``(B, C, h_j, w_j)`` → ``(tokens (B, N, 4C), ids (B, N, 4))``, ``N`` the
    sum of the references' ``(h_j/2)(w_j/2)``, in column order.

    ``to_model`` maps a mode to the model space ``(B, 4C, h/2, w/2)`` (patchified, batch-norm normalised: the
    family's own functions, ``normalize_latents(patchify(mode), vae)`` in :mod:`hf_arb.families.flux2`).
    """
    tokens, ids = [], []
    for j, mode in enumerate(modes):
        latents = to_model(mode.to(device, torch.float32))  # (B, 4C, H, W)
        b, c, h, w = latents.shape
        tokens.append(latents.reshape(b, c, h * w).permute(0, 2, 1).to(dtype))  # packed row-major: (B, H*W, 4C)
        ids.append(reference_ids(j, h, w, device))
    return torch.cat(tokens, dim=1), torch.cat(ids, dim=0).unsqueeze(0).expand(tokens[0].shape[0], -1, -1)


def reference_tokens(vae: Any, references: Sequence[Any], to_model: Callable[[Any], Any], device: Any,
                     dtype: Any) -> tuple[Any, Any]:
    """:func:`pack_references` of the VAE posterior modes of ``references`` (``(B, 3, H_j, W_j)`` in ``[-1, 1]``)."""
    with torch.no_grad():
        modes = [vae.encode(p.to(device, vae.dtype)).latent_dist.mode() for p in references]
    return pack_references(modes, to_model, device, dtype)


def batch_references(vae: Any, batch: dict[str, Any], to_model: Callable[[Any], Any], device: Any,
                     dtype: Any) -> tuple[Any, Any] | None:
    """A training batch's reference tokens and ids: from ``--cache_latents``' ``reference_latent_stats`` (the
    posteriors' means, their modes) or by encoding ``reference_pixel_values``; None without references."""
    if batch.get("reference_latent_stats"):
        return pack_references([s[:, 0] for s in batch["reference_latent_stats"]], to_model, device, dtype)
    refs = batch.get("reference_pixel_values")
    return reference_tokens(vae, refs, to_model, device, dtype) if refs else None
