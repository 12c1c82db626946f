"""Per-image sizes and per-pack metadata for packing (see :mod:`hf_arb.packing` for the plan).

* :func:`fit_sizes` — each image's own training size: scaled down (never up, unless asked) so its token count fits,
  then fitted to the latent patch grid; the only crop is the remainder below one patch (< 16 px on one side).
* :func:`pack_meta` — what a model needs for one pack (:class:`PackMeta`): ``seq_lens``, ``cu_seqlens``,
  ``document_id``, latent grids and positions, per-image ``mu`` and shifted sigmas (:mod:`hf_arb.families.shift`), the
  text layout and the loss mask. Both are also importable from :mod:`hf_arb.packing`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hf_arb.checks import check_nonneg, check_positive
from hf_arb.families.shift import ShiftConfig, calculate_mu, shift_sigmas

__all__ = ["FittedSizes", "PackMeta", "fit_sizes", "pack_meta"]




# ------------------------------------------------------------------------------------------------- sizes
@dataclass(frozen=True)
class FittedSizes:
    """Each image's own training size (all arrays shape ``(n,)``, int64 unless noted).

    Attributes:
        resize_width, resize_height: the size the image is resized to (aspect kept up to pixel rounding).
        width, height: the final size, ``resize_*`` floored to a multiple of ``vae_scale_factor × patch_size``
            (the image is centre- or randomly cropped by the remainder, less than one patch a side).
        tokens: latent tokens after patching, ``(height / step) * (width / step)``; ``<= max_tokens``.
        crop_fraction: float64, share of the resized image's area removed by flooring to the grid.
    """

    resize_width: np.ndarray
    resize_height: np.ndarray
    width: np.ndarray
    height: np.ndarray
    tokens: np.ndarray
    crop_fraction: np.ndarray


def fit_sizes(widths: Any, heights: Any, max_tokens: int, *, vae_scale_factor: int = 8, patch_size: int = 2,
              upscale: bool = False) -> FittedSizes:
    """Pick every image's own training size: its aspect ratio, at most ``max_tokens`` latent tokens, vectorised.

    The token grid is ``floor(side * s / step)`` a side with ``s = sqrt(max_tokens * step² / (w * h))`` when the
    image has more tokens than that (``s = 1`` otherwise, unless ``upscale``) and ``step = vae_scale_factor *
    patch_size``; the image is then resized (aspect kept) to the smallest size covering that grid and the
    remainder, less than one patch on one side, cropped. The only exception is an aspect ratio so extreme that one
    side would fall under one patch: that side is kept at one patch and the other cut to the budget (visible in
    ``crop_fraction``).

    Args:
        widths, heights: original sizes, shape ``(n,)``, positive.
        max_tokens: token cap per image (e.g. 4096 = 1 MP for SD3/Flux); ``>= 1``.
        vae_scale_factor, patch_size: the model's latent step (8 and 2 for SD3 and Flux).
        upscale: also enlarge images with fewer tokens than ``max_tokens`` to it.

    Returns:
        :class:`FittedSizes`.

    Raises:
        ValueError: sizes of different shapes or not positive, or a non-positive ``max_tokens``.
    """
    w = np.atleast_1d(np.asarray(widths, dtype=np.float64))
    h = np.atleast_1d(np.asarray(heights, dtype=np.float64))
    if w.shape != h.shape or w.ndim != 1:
        raise ValueError(f"`widths` and `heights` must both have shape (n,), got {w.shape} and {h.shape}.")
    if w.size and (min(w.min(), h.min()) < 1):
        i = int(np.argmin(np.minimum(w, h)))
        raise ValueError(f"Image sizes must be >= 1 pixel, got {w[i]:g}x{h[i]:g} at row {i}; drop or fix that row.")
    max_tokens = check_positive("max_tokens", max_tokens)
    step = check_positive("vae_scale_factor", vae_scale_factor) * check_positive("patch_size", patch_size)
    scale = np.sqrt(max_tokens * step * step / (w * h))
    if not upscale:
        scale = np.minimum(scale, 1.0)
    rw = np.maximum(np.floor(w * scale + 1e-9), 1).astype(np.int64)
    rh = np.maximum(np.floor(h * scale + 1e-9), 1).astype(np.int64)
    tw, th = np.maximum(rw // step, 1), np.maximum(rh // step, 1)
    # extreme aspect ratios: one side kept at >= one patch, the other cut to the budget
    tw = np.minimum(tw, max_tokens // th)  # th >= 1, so tw <= max_tokens and tw >= 1 after this
    th = np.minimum(th, max_tokens // np.maximum(tw, 1))
    tw = np.maximum(tw, 1)
    fw, fh = tw * step, th * step
    cover = np.maximum(fw / w, fh / h)  # <= scale: the smallest resize that covers the grid (aspect kept)
    # ceil keeps the grid covered; the clamp (< 1 px of aspect) keeps the crop under one patch
    rw = np.clip(np.ceil(w * cover - 1e-6).astype(np.int64), fw, np.maximum(fw + step - 1, np.floor(w * cover)))
    rh = np.clip(np.ceil(h * cover - 1e-6).astype(np.int64), fh, np.maximum(fh + step - 1, np.floor(h * cover)))
    crop = 1.0 - (fw * fh) / (rw * rh).astype(np.float64)
    return FittedSizes(rw, rh, fw, fh, tw * th, crop)


# ------------------------------------------------------------------------------------------------- metadata
@dataclass(frozen=True)
class PackMeta:
    """What a model needs to run one pack (numpy; :func:`hf_arb.packing.model.to_torch` moves it to tensors).

    ``m`` images, ``L = max_tokens`` image-token slots, ``Lt`` text-token slots. Image tokens of image ``i`` are
    ``[cu_seqlens[i], cu_seqlens[i + 1])`` in row-major order of its latent grid; slots after ``cu_seqlens[-1]``
    are padding.

    Attributes:
        grids: int64 ``(m, 2)``, each image's latent token grid ``(h, w)`` (after patching) for position ids.
        seq_lens: int32 ``(m,)``, ``h * w``.
        cu_seqlens: int32 ``(m + 1,)``, cumulative ``seq_lens`` starting at 0 (varlen attention layout).
        max_seqlen: largest ``seq_lens`` (0 for an empty pack).
        document_id: int32 ``(L,)``, the image of each token slot, ``-1`` for padding.
        positions: int64 ``(L, 2)``, each token's ``(row, col)`` inside its own image (0 for padding).
        text_lens, text_cu_seqlens, text_document_id: the same for the text tokens (``(m,)``, ``(m + 1,)``,
            ``(Lt,)``); image ``i``'s text is ``[text_cu_seqlens[i], text_cu_seqlens[i + 1])``.
        mu: float64 ``(m,)``, each image's resolution shift (:func:`hf_arb.families.shift.calculate_mu` of its tokens).
        sigmas: float64 ``(m,)``, each image's shifted sigma from its sampled ``t`` (``None`` if no ``t``).
        loss_mask: bool ``(L,)``, ``document_id >= 0``.
    """

    grids: np.ndarray
    seq_lens: np.ndarray
    cu_seqlens: np.ndarray
    max_seqlen: int
    document_id: np.ndarray
    positions: np.ndarray
    text_lens: np.ndarray
    text_cu_seqlens: np.ndarray
    text_document_id: np.ndarray
    mu: np.ndarray
    sigmas: np.ndarray | None
    loss_mask: np.ndarray

    @property
    def num_images(self) -> int:
        """Images in the pack."""
        return int(self.seq_lens.size)

    @property
    def padding_fraction(self) -> float:
        """Share of the ``L`` image-token slots that are padding."""
        n = self.document_id.size
        return float(1 - self.seq_lens.sum() / n) if n else 0.0


def _ragged_ids(lens: np.ndarray, total: int) -> tuple[np.ndarray, np.ndarray]:
    cu = np.zeros(lens.size + 1, dtype=np.int32)
    np.cumsum(lens, out=cu[1:])
    doc = np.full(total, -1, dtype=np.int32)
    doc[:cu[-1]] = np.repeat(np.arange(lens.size, dtype=np.int32), lens)
    return cu, doc


def pack_meta(grids: Any, max_tokens: int, *, text_lens: Any = None, max_text_tokens: int | None = None,
              t: Any = None, shift_config: ShiftConfig | None = None) -> PackMeta:
    """Build one pack's :class:`PackMeta` from its images' latent token grids.

    Args:
        grids: ``(m, 2)`` latent token grids ``(h, w)`` after patching (``height / (vae × patch)``, ...).
        max_tokens: image-token slots of the pack (the planner's budget); must hold all images.
        text_lens: text tokens of each image, ``(m,)`` (0 if ``None``).
        max_text_tokens: text-token slots (default: ``sum(text_lens)``, no text padding).
        t: each image's sampled time in ``(0, 1]`` (``(m,)``); with it, ``sigmas = shift_sigmas(t, mu, cfg)``.
        shift_config: the scheduler's shift (default :class:`~hf_arb.families.shift.ShiftConfig` with its defaults).

    Raises:
        ValueError: grids of the wrong shape or not positive, or images / texts over their slots.
    """
    g = np.asarray(grids, dtype=np.int64).reshape(-1, 2)
    if g.size and g.min() < 1:
        raise ValueError(f"Latent grids must be >= 1 token a side, got {g[np.argmin(g.min(1))].tolist()}.")
    max_tokens = check_nonneg("max_tokens", max_tokens)
    lens = (g[:, 0] * g[:, 1]).astype(np.int32)
    if int(lens.sum()) > max_tokens:
        raise ValueError(f"The pack's images have {int(lens.sum())} tokens, more than `max_tokens`={max_tokens}; "
                         "plan packs with `plan_packs` using the same budget.")
    cu, doc = _ragged_ids(lens, max_tokens)
    pos = np.zeros((max_tokens, 2), dtype=np.int64)
    if lens.size:
        local = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1].astype(np.int64), lens)
        width = np.repeat(g[:, 1], lens)
        pos[:cu[-1], 0], pos[:cu[-1], 1] = local // width, local % width
    tl = np.zeros(lens.size, dtype=np.int32) if text_lens is None else np.asarray(text_lens, dtype=np.int32)
    if tl.shape != lens.shape or (tl.size and tl.min() < 0):
        raise ValueError(f"`text_lens` must be non-negative with shape {lens.shape} (one per image), got {tl}.")
    lt = int(tl.sum()) if max_text_tokens is None else check_nonneg("max_text_tokens", max_text_tokens)
    if int(tl.sum()) > lt:
        raise ValueError(f"The pack's texts have {int(tl.sum())} tokens, more than `max_text_tokens`={lt}.")
    tcu, tdoc = _ragged_ids(tl, lt)
    cfg = shift_config or ShiftConfig()
    mu = np.atleast_1d(calculate_mu(lens.astype(np.int64), cfg))
    sig = None
    if t is not None:
        tt = np.asarray(t, dtype=np.float64).reshape(-1)
        if tt.shape != lens.shape or (tt.size and (tt.min() <= 0 or tt.max() > 1)):
            raise ValueError(f"`t` must be in (0, 1] with shape {lens.shape} (one per image), got {tt}.")
        sig = np.asarray(shift_sigmas(tt, mu, cfg), dtype=np.float64)
    return PackMeta(g, lens, cu, int(lens.max()) if lens.size else 0, doc, pos, tl, tcu, tdoc, mu, sig, doc >= 0)
