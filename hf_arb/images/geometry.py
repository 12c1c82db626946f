"""The geometry of fitting an image to a bucket, as pure integer arithmetic: the cover size and the crop
(:func:`plan_fit` → :class:`FitPlan`). :mod:`hf_arb.images.fitting` renders a plan into pixels; see its docstring for
the resize semantics both follow."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

CropMode = Literal["random", "center"]


def positive_int(value: Any, name: str) -> int:
    try:
        iv = int(value)
    except (TypeError, ValueError):
        iv = 0
    if iv != value or iv <= 0:
        raise ValueError(f"`{name}` must be a positive whole number of pixels, got {value!r}.")
    return iv


def cover_size(width: int, height: int, bucket_width: int, bucket_height: int) -> tuple[int, int]:
    """The ``(width, height)`` an image is scaled to so that it covers the bucket, aspect preserved.

    ``scale = max(bucket_width / width, bucket_height / height)``; the fitted side equals the bucket side
    exactly and the other side is ``round_half_up(side * scale)``, computed with integers (no float
    error), which is never smaller than the bucket side.

    Example:
        ```py
        >>> cover_size(4000, 3000, 1024, 1024)   # height is fitted: 4000 * 1024 / 3000 = 1365.33
        (1365, 1024)
        >>> cover_size(300, 451, 512, 768)      # 451 * 512 / 300 = 769.7 → 770 (width fitted)
        (512, 770)
        ```
    """
    w = positive_int(width, "width")
    h = positive_int(height, "height")
    bw = positive_int(bucket_width, "bucket_width")
    bh = positive_int(bucket_height, "bucket_height")
    if bw * h >= bh * w:  # bw / w >= bh / h: width is fitted, scale = bw / w
        return bw, max(bh, (2 * h * bw + w) // (2 * w))
    return max(bw, (2 * w * bh + h) // (2 * h)), bh


@dataclass(frozen=True)
class FitPlan:
    """Where an image of a given displayed size lands in a bucket; pure geometry, no pixels.

    Attributes:
        size: displayed image size ``(width, height)`` (EXIF orientation applied).
        bucket: bucket size ``(width, height)``.
        scaled_size: size ``(width, height)`` the whole image is scaled to (see :func:`cover_size`).
        crop_top_left: ``(y, x)`` of the crop in the scaled image, SDXL convention; when ``flipped`` it is
            the crop of the *mirrored* scaled image.
        flipped: whether the output is mirrored horizontally.
        render: the rendering options that also decide the pixels (filter, decoder downscale, background), as
            text; empty when unknown. :meth:`BucketedImageDataset.fit_row` fills it in so :meth:`key` is a
            complete cache key together with the image content.
    """

    size: tuple[int, int]
    bucket: tuple[int, int]
    scaled_size: tuple[int, int]
    crop_top_left: tuple[int, int]
    flipped: bool
    render: str = ""

    @property
    def original_size(self) -> tuple[int, int]:
        """``(h, w)`` of the displayed image, SDXL's ``original_size``."""
        return (self.size[1], self.size[0])

    @property
    def target_size(self) -> tuple[int, int]:
        """``(h, w)`` of the bucket, SDXL's ``target_size``."""
        return (self.bucket[1], self.bucket[0])

    @property
    def crop_left(self) -> int:
        """x offset of the crop in the *unmirrored* scaled image."""
        x = self.crop_top_left[1]
        return self.scaled_size[0] - self.bucket[0] - x if self.flipped else x

    @property
    def source_box(self) -> tuple[float, float, float, float]:
        """The crop as a ``(left, top, right, bottom)`` box in displayed source pixels (floats)."""
        (w, h), (sw, sh), (bw, bh) = self.size, self.scaled_size, self.bucket
        x, y = self.crop_left, self.crop_top_left[0]
        return (x * w / sw, y * h / sh, (x + bw) * w / sw, (y + bh) * h / sh)

    def key(self) -> tuple[int | str, ...]:
        """A hashable summary for cache keys: bucket (w, h), scaled size (w, h), crop (y, x), flipped (0/1), render.

        Together with the image content (which fixes ``size``) it determines the output pixels.
        """
        return (*self.bucket, *self.scaled_size, *self.crop_top_left, int(self.flipped), self.render)


def plan_fit(
    size: Sequence[int],
    bucket: Sequence[int],
    crop: CropMode = "random",
    rng: np.random.Generator | None = None,
    flip: bool = False,
) -> FitPlan:
    """Compute where an image of displayed ``size`` lands in ``bucket``, without touching pixels.

    Args:
        size: displayed image size ``(width, height)``.
        bucket: bucket size ``(width, height)``.
        crop: ``"center"`` (offset ``excess // 2``) or ``"random"`` (uniform over every whole-pixel offset,
            x drawn before y).
        rng: the generator for ``crop="random"``. ``None`` uses a fresh, OS-seeded
            ``numpy.random.default_rng()`` (never the global RNG), which is not reproducible.
        flip: mirror horizontally; ``crop_top_left`` then describes the crop of the mirrored image.

    Returns:
        A :class:`FitPlan`. :func:`fit_to_bucket` renders exactly this plan.
    """
    if len(size) != 2 or len(bucket) != 2:
        raise ValueError(f"`size` and `bucket` must be (width, height) pairs, got size={size!r}, bucket={bucket!r}.")
    w, h = positive_int(size[0], "width"), positive_int(size[1], "height")
    bw, bh = positive_int(bucket[0], "bucket width"), positive_int(bucket[1], "bucket height")
    return crop_plan((w, h), cover_size(w, h, bw, bh), (bw, bh), crop=crop, rng=rng, flip=flip)


def crop_plan(
    size: Sequence[int],
    scaled_size: Sequence[int],
    bucket: Sequence[int],
    crop: CropMode = "random",
    rng: np.random.Generator | None = None,
    flip: bool = False,
) -> FitPlan:
    """The crop step of :func:`plan_fit` for a given scaled size: where ``bucket`` is cut from the image scaled
    to ``scaled_size`` (e.g. :func:`hf_arb.packing.layout.fit_sizes`' ``resize_width/height``, which may leave a
    remainder on both sides). Same crop and flip rules and random draws as :func:`plan_fit`.

    Raises:
        ValueError: a size that is not positive, or a scaled size that does not cover the bucket.
    """
    w, h = positive_int(size[0], "width"), positive_int(size[1], "height")
    sw, sh = positive_int(scaled_size[0], "scaled width"), positive_int(scaled_size[1], "scaled height")
    bw, bh = positive_int(bucket[0], "bucket width"), positive_int(bucket[1], "bucket height")
    ex, ey = sw - bw, sh - bh
    if ex < 0 or ey < 0:
        raise ValueError(f"The scaled size {sw}x{sh} does not cover the bucket {bw}x{bh}; scale to cover it "
                         "(`cover_size`).")
    if crop == "center":
        x, y = ex // 2, ey // 2
    elif crop == "random":
        gen = rng if rng is not None else np.random.default_rng()
        if not isinstance(gen, np.random.Generator):
            raise TypeError(
                f"`rng` must be a numpy.random.Generator, got {type(rng).__name__}. "
                "Use numpy.random.default_rng(seed)."
            )
        x = int(gen.integers(0, ex + 1))
        y = int(gen.integers(0, ey + 1))
    else:
        raise ValueError(f"`crop` must be 'random' or 'center', got {crop!r}.")
    if flip:
        x = ex - x
    return FitPlan(size=(w, h), bucket=(bw, bh), scaled_size=(sw, sh), crop_top_left=(y, x), flipped=bool(flip))


def display_box_to_stored(box: tuple[float, float, float, float], orientation: int,
                          stored: tuple[int, int]) -> tuple[float, float, float, float]:
    """Map a ``(left, top, right, bottom)`` box in displayed coordinates to stored coordinates.

    ``stored`` is the stored ``(W, H)``. Displayed pixel ``(u, v)`` comes from stored ``(s, t)`` with the
    continuous maps below (Pillow's transposes, as used by ``exif_transpose``).
    """
    W, H = stored
    u0, v0, u1, v1 = box

    def to_stored(u: float, v: float) -> tuple[float, float]:
        if orientation == 2:
            return W - u, v
        if orientation == 3:
            return W - u, H - v
        if orientation == 4:
            return u, H - v
        if orientation == 5:
            return v, u
        if orientation == 6:
            return v, H - u
        if orientation == 7:
            return W - v, H - u
        if orientation == 8:
            return W - v, u
        return u, v

    (s0, t0), (s1, t1) = to_stored(u0, v0), to_stored(u1, v1)
    return (min(s0, s1), min(t0, t1), max(s0, s1), max(t0, t1))
