"""Loss masks fitted with their image (``--masked_loss``): the mask of a row is cropped and resized with the exact
plan of its target (:class:`~hf_arb.images.geometry.FitPlan`: the same scaled size, crop box, flip and EXIF
orientation), then area-averaged to the latent grid, so a soft mask stays soft and a mask drawn on some pixels lands
on the latent cells those pixels become.

Where a mask comes from (:class:`MaskSpec`, habits of sd-scripts and OneTrainer):

- ``"alpha"``: the image's own alpha channel (sd-scripts' ``--alpha_mask``); an image without one is read as opaque
  everywhere (all ones, as sd-scripts' ``convert("RGBA")`` does);
- ``"column"``: an image column of the dataset (a mask per row);
- ``"dir"``: a folder of mask images with the image's file name (``cat.png`` for ``cat.png``, or the same stem with
  another image extension: ``cat.png`` for ``cat.jpg``), as sd-scripts' ``conditioning_data_dir``.

A mask image is read as sd-scripts reads it: its R channel (a greyscale mask's grey value; transparent parts count as
black), 255 = trained, 0 = not, 127 ≈ half weight. It is resized with Pillow's ``box`` filter (an area average:
no ringing, soft edges stay in ``[0, 1]``), then each latent cell takes the mean of the ``factor × factor`` pixels it
covers (:func:`latent_weights`), floored at ``unmasked_weight`` (OneTrainer's ``clamp(mask, unmasked_weight, 1)``).

A row whose mask is missing, unreadable or of another size than its image raises :class:`MaskError` (an
:class:`~hf_arb.images.dataset.ImageDecodeError`): the dataset then replaces and counts the row like a broken image
(one line per row in ``skipped_rows.jsonl``, reason starting with ``"mask"``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from .dataset import BucketedImageDataset, ImageDecodeError
from .fitting import displayed_size, exif_orientation, open_image, render_plan, to_rgb
from .geometry import FitPlan

__all__ = ["MASK_SOURCES", "MaskError", "MaskSpec", "MaskedImageDataset", "MaskedImages", "alpha_channel",
           "find_mask_file", "latent_weights", "mask_channel", "mask_files", "render_mask"]

logger = logging.getLogger("hf_arb")

#: where a mask comes from
MASK_SOURCES = ("alpha", "column", "dir")
#: image file extensions a mask folder is searched for (same stem, another extension)
MASK_EXTENSIONS = (".png", ".webp", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".gif")


class MaskError(ImageDecodeError):
    """A row's loss mask is missing, unreadable or not the size of its image."""


@dataclass(frozen=True)
class MaskSpec:
    """How a run's loss masks are made.

    Attributes:
        source: one of :data:`MASK_SOURCES`.
        column: ``"column"``: the dataset's mask image column.
        folder: ``"dir"``: the folder of mask files named like the images.
        unmasked_weight: the smallest weight a latent cell gets (``0``: nothing outside the mask is trained).
        latent_factor: pixels per latent cell along each side (the VAE's downscale, 8).
    """

    source: str
    column: str | None = None
    folder: str | None = None
    unmasked_weight: float = 0.0
    latent_factor: int = 8

    def describe(self) -> str:
        """One line for the start-up report."""
        where = {"alpha": "the images' alpha channel", "column": f"column {self.column!r}",
                 "dir": f"the files of {self.folder} named like the images"}[self.source]
        return (f"masked loss: masks from {where}; weight outside the mask {self.unmasked_weight:g}; each latent cell "
                f"weighted by the mean of its {self.latent_factor}x{self.latent_factor} mask pixels; loss = mean over "
                "every element of mask x error (sd-scripts' normalisation)")


# ------------------------------------------------------------------------------------------- pure functions
def alpha_channel(im: Image.Image) -> Image.Image:
    """The alpha channel of ``im`` as an ``"L"`` image (255 everywhere for an image without one)."""
    return im.convert("RGBA").getchannel("A")


def mask_channel(im: Image.Image) -> Image.Image:
    """A mask image's weights as an ``"L"`` image: its R channel (its grey value for a greyscale mask; 16-bit and float
    modes rescaled as :func:`~hf_arb.images.fitting.to_rgb` does), transparent parts over black."""
    return to_rgb(im, background=(0, 0, 0)).getchannel("R")


def render_mask(gray: Image.Image, plan: FitPlan, orientation: int = 1) -> np.ndarray:
    """A mask in ``[0, 1]``, ``(H, W)`` float32 at the bucket size, cut with ``plan`` (its crop box, scaled size and
    flip; ``orientation``: the EXIF orientation of the file the mask was stored in) and resized with the ``box``
    filter (an area average)."""
    out, _ = render_plan(gray, plan, orientation, resample="box", background=(0, 0, 0), draft=False)
    return np.asarray(out, dtype=np.float32)[..., 0] / np.float32(255.0)


def latent_weights(mask: np.ndarray, factor: int, unmasked_weight: float = 0.0) -> np.ndarray:
    """Each latent cell's loss weight: the mean of the ``factor × factor`` mask pixels it covers, at least
    ``unmasked_weight``; ``(H, W)`` → ``(H // factor, W // factor)`` float32.

    Sides that are not multiples of ``factor`` are split into near-equal blocks (torch's adaptive average pool), as
    the VAE's own rounding does.
    """
    m = np.asarray(mask, dtype=np.float32)
    h, w = m.shape[0] // factor, m.shape[1] // factor
    if m.shape == (h * factor, w * factor):
        cells = m.reshape(h, factor, w, factor).mean(axis=(1, 3), dtype=np.float32)
    else:
        cells = torch.nn.functional.adaptive_avg_pool2d(torch.from_numpy(m)[None, None], (h, w))[0, 0].numpy()
    return np.clip(cells, np.float32(unmasked_weight), np.float32(1.0)).astype(np.float32)


def mask_files(folder: str | os.PathLike) -> dict[str, str]:
    """The image files directly or deeper in ``folder``: ``{file name: path}`` plus ``{stem: path}`` for every stem
    that only one file has (a lookup table for :func:`find_mask_file`)."""
    by_name: dict[str, str] = {}
    by_stem: dict[str, list[str]] = {}
    for root, _, files in os.walk(folder):
        for f in files:
            if Path(f).suffix.lower() in MASK_EXTENSIONS:
                path = os.path.join(root, f)
                by_name.setdefault(f, path)
                by_stem.setdefault(Path(f).stem, []).append(path)
    return {**{f"stem:{s}": p[0] for s, p in by_stem.items() if len(p) == 1}, **by_name}


def find_mask_file(image_path: str | None, files: dict[str, str]) -> str | None:
    """The mask of the image at ``image_path`` in a :func:`mask_files` table: the file of the same name, else the
    only file of the same stem; ``None`` when there is none."""
    if not image_path:
        return None
    name = os.path.basename(str(image_path))
    return files.get(name) or files.get(f"stem:{Path(name).stem}")


# ------------------------------------------------------------------------------------------- the datasets
class MaskedImages:
    """A mixin over :class:`~hf_arb.images.dataset.BucketedImageDataset` (or a subclass): every sample also carries
    ``loss_mask``, ``(1, h, w)`` float32 on the latent grid of its image (:func:`latent_weights`), and :meth:`collate`
    stacks them (``(B, 1, h, w)``; a list for a pack of images at their own sizes).

    Args:
        masks: the :class:`MaskSpec` (keyword); the rest as the dataset class it mixes into.
    """

    masks: MaskSpec

    def __init__(self, ds: Any, *args: Any, masks: MaskSpec, **kwargs: Any) -> None:
        import datasets

        super().__init__(ds, *args, **kwargs)  # type: ignore[call-arg]
        if masks.source not in MASK_SOURCES:
            raise ValueError(f"`masks.source` must be one of {MASK_SOURCES}, got {masks.source!r}.")
        self.masks = masks
        self._mask_cells = None
        if masks.source == "column":
            if masks.column not in ds.column_names:
                raise ValueError(f"Mask column {masks.column!r} is not a column of the dataset; columns are "
                                 f"{ds.column_names}.")
            cells = ds.select_columns([masks.column])
            if isinstance(cells.features[masks.column], datasets.Image) and cells.features[masks.column].decode:
                cells = cells.cast_column(masks.column, datasets.Image(decode=False))
            self._mask_cells = cells
        self._files: dict[str, str] | None = None  # "dir": the folder's table, read on first use (in each worker)
        self._told_opaque = False

    def _mask_source(self, row: int) -> Any:
        """The mask file or cell of ``row`` (``"column"`` / ``"dir"``); :class:`MaskError` when there is none."""
        if self.masks.source == "column":
            cell = self._mask_cells[row][self.masks.column]  # type: ignore[index]
            if cell is None or (isinstance(cell, dict) and cell.get("bytes") is None and not cell.get("path")):
                raise MaskError(f"Row {row}: mask missing (column {self.masks.column!r} is empty)")
            return cell
        if self._files is None:
            self._files = mask_files(self.masks.folder or ".")
        cell = self._view[row][self.image_column]  # type: ignore[attr-defined]
        path = cell.get("path") if isinstance(cell, dict) else cell if isinstance(cell, (str, os.PathLike)) else None
        found = find_mask_file(path, self._files)
        if found is None:
            name = os.path.basename(str(path)) if path else "(the image has no file name)"
            raise MaskError(f"Row {row}: mask missing (no {name} or same stem in {self.masks.folder})")
        return found

    def loss_mask(self, row: int, plan: FitPlan, im: Image.Image | None = None,
                  orientation: int | None = None) -> torch.Tensor:
        """``row``'s loss weights ``(1, h, w)`` for ``plan``; ``im``/``orientation``: the row's image when it is
        already open (``"alpha"``). Raises :class:`MaskError` for a missing, unreadable or wrong-size mask."""
        try:
            if self.masks.source == "alpha":
                if im is None:
                    im = open_image(self._view[row][self.image_column])  # type: ignore[attr-defined]
                    orientation = exif_orientation(im)
                if not {"A", "a"} & set(im.getbands()) and "transparency" not in im.info:  # opaque: all ones
                    if not self._told_opaque:
                        self._told_opaque = True
                        logger.warning("Row %d has no alpha channel: --alpha_mask trains it everywhere (as "
                                       "sd-scripts); images without transparency are not masked.", row)
                    bw, bh = plan.bucket
                    ones = np.ones((bh, bw), np.float32)
                    return torch.from_numpy(latent_weights(ones, self.masks.latent_factor))[None]
                gray, o = alpha_channel(im), orientation or 1
            else:
                source = self._mask_source(row)
                mim = open_image(source)
                o = exif_orientation(mim)
                size = displayed_size(mim, o)
                if tuple(size) != tuple(plan.size):
                    raise MaskError(f"Row {row}: mask size {size[0]}x{size[1]} is not the image's "
                                    f"{plan.size[0]}x{plan.size[1]}")
                gray = mask_channel(mim)
            pixels = render_mask(gray, plan, o)
        except MaskError:
            raise
        except Exception as e:  # noqa: BLE001 - a broken mask file is one counted row, not a crash
            why = f"{type(e).__name__} {e}".replace(": ", " - ")  # one ': ' only: the logged reason starts "mask"
            raise MaskError(f"Row {row}: mask unreadable ({why})") from e
        weights = latent_weights(pixels, self.masks.latent_factor, self.masks.unmasked_weight)
        return torch.from_numpy(weights)[None]  # (1, h, w)

    def render_extras(self, row: int, im: Any, orientation: int, plan: FitPlan) -> dict[str, Any]:
        return {"loss_mask": self.loss_mask(row, plan, im, orientation)}

    def mask_sample(self, key: Sequence[int]) -> torch.Tensor:
        """The loss weights of the key ``(row, bucket, epoch)`` alone, for the plan :meth:`fit_row` makes (from the
        annotated size; the image is opened only for ``"alpha"``): a run whose latents come from the cache."""
        row, bucket, epoch = (int(k) for k in key)
        return self.loss_mask(row, self.fit_row(row, bucket, epoch))  # type: ignore[attr-defined]

    def collate(self, samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The dataset's own collate plus ``loss_mask``: ``(B, 1, h, w)``, or a list of ``(1, h_i, w_i)`` when the
        pixels are a list (a pack)."""
        batch = super().collate(samples)  # type: ignore[misc]
        masks = [s["loss_mask"] for s in samples]
        batch["loss_mask"] = masks if isinstance(batch.get("pixel_values"), list) else torch.stack(masks)
        return batch


class MaskedImageDataset(MaskedImages, BucketedImageDataset):
    """:class:`~hf_arb.images.dataset.BucketedImageDataset` with each sample's ``loss_mask`` (:class:`MaskedImages`).

    Example:
        ```py
        >>> data = MaskedImageDataset(annotated, masks=MaskSpec("alpha"), seed=0)
        >>> data[0]["loss_mask"].shape   # (1, h, w): the latent grid of the row's bucket
        ```
    """
