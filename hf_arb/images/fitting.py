"""Fit an image to a bucket: open → EXIF orientation → RGB → resize to cover → crop → (flip).

Frameworks disagree on what "resize" means (pixel-centre convention, antialiasing, cubic coefficient,
how a non-integer output size is rounded), so the same image trains differently depending on the
library. This module fixes one definition and the tests hold it to it:

* **Cover scale.** An image of displayed size ``(w, h)`` and a bucket ``(bw, bh)`` use
  ``scale = max(bw / w, bh / h)``. The dimension that attains the maximum (the *fitted* one) maps to
  exactly the bucket side; the other one is rounded half up, ``round(h * bw / w)``, computed in exact
  integer arithmetic. Because that product is ``>= bh`` the scaled image always covers the bucket:
  never one pixel short, and the crop removes nothing in the fitted dimension.
* **Crop.** ``crop="center"`` takes the offset ``(scaled - bucket) // 2`` (within half a pixel of the
  centre, rounding towards top/left); ``crop="random"`` draws ``rng.integers(0, excess + 1)`` for x
  then for y (both draws always happen, so the stream is consumed the same way for every image).
* **One resize.** The crop is folded into the resize through Pillow's ``box`` argument: only the
  source region under the crop is filtered, with exactly the coefficients the full resize would use,
  so the result equals "resize the whole image to the scaled size, then crop" (tested) at a fraction
  of the cost. Pillow's filters are antialiased (the kernel is stretched by the downscale factor) and
  use half-pixel centres: output pixel ``i`` samples the source at ``(i + 0.5) * w / sw``.
  LANCZOS (a = 3) is the default, as in diffusers' training scripts; ``"bicubic"`` (Pillow's
  a = -0.5), ``"bilinear"``, ``"hamming"`` and ``"box"`` are selectable.
* **JPEG fast path.** For JPEG sources that shrink by 2× or more, the decoder downscales by 1/2, 1/4
  or 1/8 in the DCT domain first (Pillow's ``draft``), never below the scaled size (1/2), or 1.25 ×
  the scaled size (1/4, 1/8: their DCT filters are coarser), and the exact filter finishes the job
  from there (see ``docs/imaging.md`` for the measured PSNR against the exact path).
* **Orientation, colour, flip.** The EXIF orientation tag (0x0112), if the image still carries it, is
  honoured: geometry is computed on the displayed image; the resize runs in stored orientation and
  only the small output is transposed. Every mode becomes RGB (transparency is composited over
  ``background``, 16-bit and float modes are rescaled, see :func:`to_rgb`). ``flip=True`` mirrors the
  output horizontally and reports ``crop_top_left`` of the *flipped* scaled image
  (``x' = scaled_w - bucket_w - x``), so the SDXL conditioning describes what the model sees.

Randomness comes only from the ``rng`` argument (a :class:`numpy.random.Generator`); the global RNGs
are neither read nor written.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, Union

import numpy as np
from PIL import Image

from .geometry import CropMode, FitPlan, display_box_to_stored, plan_fit

if TYPE_CHECKING:  # pragma: no cover
    import torch

ImageSource = Union[str, os.PathLike, bytes, bytearray, BinaryIO, Image.Image, dict]

#: Resampling filters by name. All are antialiased when downscaling and use half-pixel centres.
RESAMPLE: dict[str, Image.Resampling] = {
    "lanczos": Image.Resampling.LANCZOS,
    "bicubic": Image.Resampling.BICUBIC,
    "bilinear": Image.Resampling.BILINEAR,
    "hamming": Image.Resampling.HAMMING,
    "box": Image.Resampling.BOX,
}

#: EXIF orientation (tag 0x0112) → the transpose that turns the stored image into the displayed one
#: (the same table as ``PIL.ImageOps.exif_transpose``).
EXIF_TRANSPOSE: dict[int, Image.Transpose] = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
#: Decoder downscale factor → the smallest remaining downscale the exact filter must still do after it.
#: Measured on real photos: the 1/2 DCT output finished by LANCZOS stays >= 40 dB PSNR against the
#: exact path even with nothing left to do (1.0); 1/4 and 1/8 need 1.25 for the same (see docs/imaging.md).
DRAFT_GAPS: dict[int, float] = {2: 1.0, 4: 1.25, 8: 1.25}
_ORIENTATION_TAG = 0x0112
_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")
_ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")


# ------------------------------------------------------------------------------------------ pixels
@dataclass(frozen=True)
class FitResult:
    """The output of :func:`fit_to_bucket`.

    Attributes:
        image: PIL ``RGB`` image of exactly the bucket size.
        original_size: ``(h, w)`` of the displayed source image (EXIF orientation applied).
        crop_top_left: ``(y, x)`` of the crop in the scaled (and, if ``flipped``, mirrored) image.
        flipped: whether the image was mirrored horizontally.
        scaled_size: ``(width, height)`` the whole image was scaled to before the crop.
        draft_scale: the JPEG decoder's downscale factor (1, 2, 4 or 8; 1 = exact path).
    """

    image: Image.Image
    original_size: tuple[int, int]
    crop_top_left: tuple[int, int]
    flipped: bool
    scaled_size: tuple[int, int]
    draft_scale: int = 1

    @property
    def target_size(self) -> tuple[int, int]:
        """``(h, w)`` of the output (the bucket)."""
        return (self.image.height, self.image.width)


def describe_source(source: Any) -> str:
    """A short human description of an image source for error messages."""
    if isinstance(source, dict):
        if source.get("path"):
            return repr(str(source["path"]))
        b = source.get("bytes")
        return f"<{len(b)} bytes>" if b is not None else "<empty image cell>"
    if isinstance(source, (str, os.PathLike)):
        return repr(os.fspath(source))
    if isinstance(source, (bytes, bytearray)):
        return f"<{len(source)} bytes>"
    if isinstance(source, Image.Image):
        name = getattr(source, "filename", "") or ""
        return repr(name) if name else f"<PIL {source.mode} {source.width}x{source.height}>"
    name = getattr(source, "name", None)
    return repr(name) if isinstance(name, str) else f"<{type(source).__name__}>"


def open_image(source: ImageSource) -> Image.Image:
    """Open an image lazily (header only) from a path, bytes, a file object, a PIL image or a datasets cell.

    ``datasets`` cells with ``Image(decode=False)`` are dicts ``{"bytes": ..., "path": ...}``; bytes win
    over the path when both are present (that is what ``datasets`` does).
    """
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, dict):
        if source.get("bytes") is not None:
            return Image.open(io.BytesIO(source["bytes"]))
        if source.get("path"):
            return Image.open(source["path"])
        raise ValueError(f"Image cell has neither bytes nor a path: {source!r}.")
    if isinstance(source, (bytes, bytearray)):
        return Image.open(io.BytesIO(source))
    if isinstance(source, (str, os.PathLike)):
        return Image.open(source)
    if hasattr(source, "read"):
        return Image.open(source)
    raise TypeError(
        f"Cannot open an image from {type(source).__name__}. Pass a path, bytes, a file object, a PIL image "
        "or a datasets image cell {'bytes': ..., 'path': ...}."
    )


def exif_orientation(im: Image.Image) -> int:
    """The EXIF orientation (1–8) still to apply to the image's pixels; 1 when absent, invalid or already applied.

    Pillow's TIFF plugin applies the orientation itself when it loads the pixels (and reports the displayed size
    before that), while the JPEG, PNG and WebP plugins leave it to ``ImageOps.exif_transpose``. A TIFF is therefore
    loaded here first and what orientation remains afterwards is returned (1 where the plugin applied it), so the
    orientation is applied exactly once whatever the Pillow version.
    """
    if getattr(im, "format", None) == "TIFF" and getattr(im, "tile", None):
        im.load()  # not loaded yet: let the plugin transpose now, then read what is left
    try:
        value = im.getexif().get(_ORIENTATION_TAG, 1)
    except Exception:  # noqa: BLE001 - a broken EXIF block must not break decoding
        return 1
    try:
        value = int(value)
    except (TypeError, ValueError):
        return 1
    return value if 1 <= value <= 8 else 1


def displayed_size(im: Image.Image, orientation: int | None = None) -> tuple[int, int]:
    """``(width, height)`` as displayed: the stored size, swapped for EXIF orientations 5–8."""
    o = exif_orientation(im) if orientation is None else orientation
    w, h = im.size
    return (h, w) if o >= 5 else (w, h)


def _sixteen_bit_to_l(im: Image.Image) -> Image.Image:
    arr = np.asarray(im).astype(np.float32)  # (H, W); I;16 variants are uint16, I is int32
    return Image.fromarray(np.clip(arr / 257.0 + 0.5, 0, 255).astype(np.uint8), "L")


def to_rgb(im: Image.Image, background: Sequence[int] = (255, 255, 255)) -> Image.Image:
    """Convert any Pillow mode to ``RGB``.

    Rules:
        * ``RGB`` without a transparency key is returned as is.
        * Transparency (``RGBA``, ``LA``, ``PA``, premultiplied ``RGBa``/``La``, and ``P``/``L``/``RGB``/``1``
          with a ``transparency`` key) is composited over ``background``: ``out = c·α + bg·(1 − α)``,
          so transparent pixels become the background colour instead of black.
        * 16-bit (``I;16``, ``I;16L``, ``I;16B``, ``I;16N``) and 32-bit integer ``I`` are read as the
          range [0, 65535] and mapped to [0, 255] by ``v / 257`` (rounded, clipped).
        * ``F`` (32-bit float) is read as the range [0, 1] and mapped to [0, 255] (rounded, clipped;
          NaN → 0).
        * Everything else (``1``, ``L``, ``P``, ``CMYK``, ``YCbCr``, ``LAB``, ``HSV``, ...) uses Pillow's
          ``convert("RGB")``.
    """
    mode = im.mode
    if mode == "RGB" and "transparency" not in im.info:
        return im
    if mode in _SIXTEEN_BIT_MODES:
        return _sixteen_bit_to_l(im).convert("RGB")
    if mode == "F":
        arr = np.nan_to_num(np.asarray(im, dtype=np.float32), nan=0.0)  # (H, W)
        return Image.fromarray(np.clip(arr * 255.0 + 0.5, 0, 255).astype(np.uint8), "L").convert("RGB")
    if mode in _ALPHA_MODES or "transparency" in im.info:
        rgba = (im.convert("LA") if mode == "La" else im).convert("RGBA")  # Pillow has no La → RGBA
        bg = tuple(int(c) for c in background)
        if len(bg) != 3 or not all(0 <= c <= 255 for c in bg):
            raise ValueError(f"`background` must be an (r, g, b) triple of 0–255 integers, got {background!r}.")
        base = Image.new("RGBA", rgba.size, (*bg, 255))
        return Image.alpha_composite(base, rgba).convert("RGB")
    return im.convert("RGB")


def resample_filter(resample: str | int | Image.Resampling) -> Image.Resampling:
    if isinstance(resample, str):
        try:
            return RESAMPLE[resample.lower()]
        except KeyError:
            raise ValueError(f"`resample` must be one of {sorted(RESAMPLE)}, got {resample!r}.") from None
    value = Image.Resampling(resample)
    if value == Image.Resampling.NEAREST:
        raise ValueError(
            "`resample` NEAREST is not antialiased; use 'lanczos', 'bicubic', 'bilinear', 'hamming' or 'box'."
        )
    return value


def render_plan(
    im: Image.Image,
    plan: FitPlan,
    orientation: int | None = None,
    *,
    resample: str | int | Image.Resampling = "lanczos",
    background: Sequence[int] = (255, 255, 255),
    draft: bool = True,
    draft_gap: float | None = None,
) -> tuple[Image.Image, int]:
    """Render a :class:`FitPlan` from an opened (ideally not yet loaded) image.

    Returns:
        ``(image, draft_scale)``: the RGB output of exactly ``plan.bucket`` and the JPEG decoder's
        downscale factor used (1 = none).
    """
    filt = resample_filter(resample)
    o = exif_orientation(im) if orientation is None else orientation
    if displayed_size(im, o) != plan.size:
        raise ValueError(
            f"The plan was made for a {plan.size[0]}x{plan.size[1]} image but this one displays as "
            f"{'x'.join(map(str, displayed_size(im, o)))}. Plan with the displayed size (EXIF orientation applied)."
        )
    stored = im.size  # (W, H)
    swap = o >= 5
    bw, bh = plan.bucket
    out_stored = (bh, bw) if swap else (bw, bh)
    box = display_box_to_stored(plan.source_box, o, stored)
    scale = 1
    if draft and getattr(im, "format", None) == "JPEG" and getattr(im, "tile", None) and len(im.tile) == 1:
        sw, sh = plan.scaled_size
        need = (sh, sw) if swap else (sw, sh)  # scaled size in stored orientation
        factor = min(stored[0] / need[0], stored[1] / need[1])  # total downscale (> 1: shrinking)
        want = next((s for s in (8, 4, 2) if factor >= s * (DRAFT_GAPS[s] if draft_gap is None else draft_gap)), 1)
        if want > 1:
            # Pillow picks the largest power of two <= min(W // w, H // h); this request yields exactly `want`.
            res = im.draft(None, (max(1, stored[0] // want), max(1, stored[1] // want)))
            if res is not None:
                scale = max(1, round(stored[0] / res[1][2]))
                box = tuple(c / scale for c in box)  # type: ignore[assignment]
    im = to_rgb(im, background)  # loads (decodes) the image, at the draft scale if any
    out = im.resize(out_stored, filt, box=box)
    if o in EXIF_TRANSPOSE:
        out = out.transpose(EXIF_TRANSPOSE[o])
    if plan.flipped:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return out, scale


def fit_to_bucket(
    image: ImageSource,
    size: Sequence[int],
    crop: CropMode = "random",
    rng: np.random.Generator | None = None,
    flip: bool = False,
    resample: str | int | Image.Resampling = "lanczos",
    background: Sequence[int] = (255, 255, 255),
    *,
    draft: bool = True,
    draft_gap: float | None = None,
) -> FitResult:
    """Fit an image to a bucket: EXIF orientation, RGB, resize to cover, crop, optional horizontal flip.

    Semantics (see the module docstring and ``docs/imaging.md`` for the full statement):
    ``scale = max(bw / w, bh / h)`` on the displayed size; the fitted side maps exactly to the bucket
    side and the other is rounded half up (never short); one antialiased Pillow resize with half-pixel
    centres of just the cropped source region; then the small output is transposed for EXIF orientation
    and mirrored if ``flip``.

    Args:
        image: a path, bytes, file object, PIL image or datasets cell ``{"bytes", "path"}``. PIL images that
            were already transposed (``datasets`` decodes with ``exif_transpose``) no longer carry the tag
            and are used as they are.
        size: bucket ``(width, height)``.
        crop: ``"random"`` or ``"center"``.
        rng: ``numpy.random.Generator`` for ``crop="random"``; the only source of randomness.
        flip: mirror the output horizontally; ``crop_top_left``'s x is mirrored with it.
        resample: ``"lanczos"`` (default), ``"bicubic"``, ``"bilinear"``, ``"hamming"``, ``"box"`` or a
            ``PIL.Image.Resampling`` value.
        background: ``(r, g, b)`` that transparent pixels are composited over.
        draft: allow the JPEG decoder to downscale by 1/2, 1/4 or 1/8 first (JPEG sources that this function
            opens; a PIL image passed in is used as it is and never modified).
        draft_gap: the smallest downscale left for the exact filter after the decoder's step. ``None``
            (default) uses :data:`DRAFT_GAPS`: 1.0 after 1/2 (so drafting starts at a 2× downscale), 1.25 after
            1/4 and 1/8; this keeps real photos above 38 dB PSNR against the exact path (tested; figures in
            ``docs/imaging.md``). A float applies to every level (1.5: fine high-contrast textures stay above
            38 dB too); ``draft=False`` is the exact path.

    Returns:
        :class:`FitResult` with ``.image`` (RGB, exactly ``size``), ``.original_size`` ``(h, w)``,
        ``.crop_top_left`` ``(y, x)`` and ``.flipped``.

    Example:
        ```py
        >>> import numpy as np
        >>> from PIL import Image
        >>> res = fit_to_bucket(Image.new("RGB", (4000, 3000)), (1024, 768), crop="center")
        >>> res.image.size, res.original_size, res.crop_top_left
        ((1024, 768), (3000, 4000), (0, 0))
        ```
    """
    if len(size) != 2:
        raise ValueError(f"`size` must be a bucket (width, height), got {size!r}.")
    if draft_gap is not None and not (draft_gap >= 1.0):
        raise ValueError(
            f"`draft_gap` must be >= 1 (the decoder must not go below the scaled size), got {draft_gap!r}."
        )
    im = open_image(image)
    o = exif_orientation(im)
    plan = plan_fit(displayed_size(im, o), size, crop=crop, rng=rng, flip=flip)
    # A PIL image handed in is never reconfigured (draft would change the caller's object): the fast path
    # applies to sources opened here (paths, bytes, file objects, datasets cells).
    owned = not isinstance(image, Image.Image)
    out, scale = render_plan(
        im, plan, o, resample=resample, background=background, draft=draft and owned, draft_gap=draft_gap
    )
    return FitResult(
        image=out,
        original_size=plan.original_size,
        crop_top_left=plan.crop_top_left,
        flipped=plan.flipped,
        scaled_size=plan.scaled_size,
        draft_scale=scale,
    )


def to_tensor(image: Image.Image | np.ndarray) -> torch.Tensor:
    """An RGB image as a ``(3, H, W)`` float32 tensor in [-1, 1]: ``v / 127.5 - 1``.

    This is what diffusers' training scripts feed the VAE (``ToTensor()`` then ``Normalize([0.5], [0.5])``),
    without torchvision. Accepts a PIL image (converted to RGB if needed) or a ``(H, W, 3)`` uint8 array.
    """
    import torch

    if isinstance(image, Image.Image):
        if image.mode != "RGB":
            image = to_rgb(image)
        arr = np.array(image)  # (H, W, 3) uint8, writable copy
    else:
        arr = np.asarray(image)
        if arr.ndim != 3 or arr.shape[2] != 3 or arr.dtype != np.uint8:
            raise ValueError(f"`to_tensor` expects an (H, W, 3) uint8 array, got shape {arr.shape} dtype {arr.dtype}.")
    if not arr.flags.writeable or not arr.flags.c_contiguous:
        arr = np.array(arr)
    t = torch.from_numpy(arr).permute(2, 0, 1)  # (3, H, W) uint8
    return t.to(torch.float32).div_(127.5).sub_(1.0)
