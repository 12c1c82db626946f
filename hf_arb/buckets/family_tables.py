"""The tables model families and trainers publish themselves, exactly: SDXL's, diffusers', OneTrainer's and
kohya's, and diffusers' ``--aspect_ratio_buckets`` string. :mod:`hf_arb.buckets.presets` names them (with ours).

Sources are listed in :mod:`hf_arb.buckets.presets`; the numbers are the contract, the code is ours.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

#: OneTrainer's aspect list (width:height), landscape side; the inverses are added.
ONETRAINER_ASPECTS: tuple[float, ...] = (4.0, 3.5, 3.0, 2.5, 2.0, 1.75, 1.5, 1.25, 1.0)

#: The SDXL report's multi-aspect table as (short, long) pairs at about 1024² pixels.
SDXL_TABLE: tuple[tuple[int, int], ...] = (
    (512, 2048), (512, 1984), (512, 1920), (512, 1856), (576, 1792), (576, 1728), (576, 1664),
    (640, 1600), (640, 1536), (704, 1472), (704, 1408), (704, 1344), (768, 1344), (768, 1280),
    (832, 1216), (832, 1152), (896, 1152), (896, 1088), (960, 1088), (960, 1024), (1024, 1024),
)

#: PixArt-α's 1024 table as (key h/w, height, width); the 256 and 512 tables are it divided by 4 and 2.

#: diffusers' default aspect ladder for ``generate_aspect_ratio_buckets``, (width, height) ratios.
DIFFUSERS_ASPECTS: tuple[tuple[int, int], ...] = (
    (1, 1), (4, 5), (5, 4), (2, 3), (3, 2), (3, 4), (4, 3), (9, 16), (16, 9), (1, 2), (2, 1),
)


def sorted_unique(pairs: Any) -> np.ndarray:
    """Unique (width, height) pairs sorted portrait → landscape (aspect ascending, then area), shape (u, 2)."""
    uniq = np.unique(np.asarray(pairs, dtype=np.int64).reshape(-1, 2), axis=0)  # (u, 2)
    return uniq[np.lexsort((uniq[:, 0] * uniq[:, 1], uniq[:, 0] / uniq[:, 1]))]


def sdxl_table() -> np.ndarray:
    """The SDXL report's table in both orientations, portrait → landscape, shape (41, 2)."""
    table = np.asarray(SDXL_TABLE, dtype=np.int64)
    return sorted_unique(np.concatenate([table, table[:, ::-1]]))


def diffusers_table(resolution: int = 1024, divisibility: int = 16) -> np.ndarray:
    """``generate_aspect_ratio_buckets(resolution, divisibility)`` as (width, height), upstream order.

    Each aspect's exact ``resolution²``-pixel shape, both sides rounded half-to-even to a multiple of
    ``divisibility`` (at least one), first occurrence kept.
    """
    ratio = np.asarray(DIFFUSERS_ASPECTS, dtype=np.float64)  # (a, 2) (w, h)
    aspect = ratio[:, 0] / ratio[:, 1]
    h = (float(resolution * resolution) / aspect) ** 0.5
    w = h * aspect
    h = np.maximum(divisibility, np.rint(h / divisibility).astype(np.int64) * divisibility)
    w = np.maximum(divisibility, np.rint(w / divisibility).astype(np.int64) * divisibility)
    pairs = np.stack([w, h], 1)
    _, first = np.unique(pairs, axis=0, return_index=True)
    return pairs[np.sort(first)]


def onetrainer_table(resolution: int = 1024, quantization: int = 64) -> np.ndarray:
    """OneTrainer's automatic buckets, (width, height), portrait → landscape.

    For each aspect ``(h, w) = (1, a)``: ``h / sqrt(h*w) * resolution`` and ``w / sqrt(h*w) * resolution``, both
    orientations, each side rounded half-to-even to the nearest multiple of ``quantization`` (may exceed
    ``resolution²``); duplicates removed.
    """
    a = np.asarray(sorted(ONETRAINER_ASPECTS), dtype=np.float64)  # (9,) w / h with h = 1
    one = np.ones_like(a)
    hs = one / np.sqrt(one * a) * resolution
    ws = a / np.sqrt(one * a) * resolution
    hq = np.rint(hs / quantization).astype(np.int64) * quantization
    wq = np.rint(ws / quantization).astype(np.int64) * quantization
    pairs = np.concatenate([np.stack([wq, hq], 1), np.stack([hq, wq], 1)])
    pairs = pairs[(pairs > 0).all(axis=1)]
    if pairs.size == 0:
        raise ValueError(f"`step` ({quantization}) is too coarse for resolution {resolution}: every side rounds to 0.")
    return sorted_unique(pairs)


def kohya_table(resolution: int = 1024, min_side: int = 256, max_side: int = 1024, step: int = 64) -> np.ndarray:
    """sd-scripts' ``make_bucket_resolutions((resolution, resolution), min_side, max_side, step)``, sorted (w, h).

    The square ``floor(resolution / step) * step`` plus, for every width from ``min_side`` to ``max_side``, the
    largest step-aligned height within ``resolution²`` (at most ``max_side``), both orientations.
    """
    if max_side < resolution:
        raise ValueError(f"kohya needs max_side >= resolution (sd-scripts asserts it), got max_side={max_side}, "
                         f"resolution={resolution}. Pass max_side={resolution} or more.")
    area = resolution * resolution
    sq = int(math.sqrt(area) // step) * step
    widths = np.arange(min_side, max_side + 1, step, dtype=np.int64)  # (m,)
    heights = np.minimum(max_side, (area // widths) // step * step)  # (m,)
    ok = heights >= min_side
    pairs = np.concatenate([[[sq, sq]], np.stack([widths[ok], heights[ok]], 1), np.stack([heights[ok], widths[ok]], 1)])
    uniq = np.unique(pairs.astype(np.int64), axis=0)  # lexicographic (w, h), like sorted(set(...))
    return uniq


# --------------------------------------------------------------------------------------------- strings


_PAIR = re.compile(r"^\s*(\d+)\s*,\s*(\d+)\s*$")


def parse_buckets_string(text: str) -> list[tuple[int, int]]:
    """Parse diffusers' ``"h1,w1;h2,w2"`` bucket string into ``(width, height)`` pairs (note the swap).

    Raises:
        ValueError: empty text, or a pair that is not two positive integers; the message names the pair.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError("The bucket string is empty. Pass 'height,width;height,width', e.g. '1024,1024;768,1360'.")
    out = []
    for i, part in enumerate(text.strip().strip(";").split(";")):
        m = _PAIR.match(part)
        if not m or int(m.group(1)) <= 0 or int(m.group(2)) <= 0:
            raise ValueError(f"Bucket {i} of {text!r} is {part!r}; each bucket must be 'height,width' with two "
                             "positive integers, buckets separated by ';' (diffusers' --aspect_ratio_buckets format).")
        out.append((int(m.group(2)), int(m.group(1))))
    return out
