"""Named bucket tables: ours and every model family's own, exactly.

Each preset is a pure function of its parameters that returns the table as ``(width, height)`` rows in the
source's own order (bucket ids follow it, so tie rules that depend on order reproduce), plus the source's own
matching rule (``native_rule``), which :meth:`hf_arb.BucketSet.preset` applies with ``metric="native"``.

Sources (the numbers are the contract; the code is ours):

- ``pixart`` / ``sana``: diffusers ``pipelines/pixart_alpha/pipeline_pixart_alpha.py``
  (``ASPECT_RATIO_256/512/1024_BIN``), ``pipeline_pixart_sigma.py`` (``ASPECT_RATIO_2048_BIN``),
  ``pipelines/sana/pipeline_sana.py`` (``ASPECT_RATIO_4096_BIN``); keys are height/width, values ``[h, w]``.
  Matching (``PixArtImageProcessor.classify_height_width_bin``): the key nearest to the image's h/w.
- ``hunyuan_dit``: diffusers ``pipelines/hunyuandit/pipeline_hunyuandit.py`` (``SUPPORTED_SHAPE``, ``(w, h)``);
  matching (``map_to_standard_shapes``): nearest standard ratio w/h, then nearest area.
- ``flux_kontext``: diffusers ``pipelines/flux/pipeline_flux_kontext.py`` (``PREFERRED_KONTEXT_RESOLUTIONS``,
  ``(w, h)``); matching: nearest w/h, ties to the smaller width.
- ``diffusers``: ``diffusers.training_utils.generate_aspect_ratio_buckets`` (default aspect ladder) and
  ``find_nearest_bucket`` (minimal ``|h*bw - w*bh|``, ties to the last bucket).
- ``onetrainer``: Nerogar/mgds ``src/mgds/pipelineModules/AspectBucketing.py`` (commit 3a6994ad): each aspect
  scaled to ``resolution²`` pixels, both sides rounded to the *nearest* multiple of ``step`` (so a bucket may exceed
  the budget); matching: nearest h/w.
- ``kohya``: kohya-ss/sd-scripts ``library/model_util.py`` ``make_bucket_resolutions`` (commit 48d368fa);
  matching (``BucketManager.select_bucket``): nearest w/h, ties to the first in sorted order.

Video presets (:data:`VIDEO_PRESETS`: ``wan``, ``ltx``, ``hunyuan_video``) are ``(k, 3)`` tables of
``(width, height, frames)`` built by :func:`frame_budget_table` from each family's pipeline defaults in diffusers 0.42
(:data:`VIDEO_PRESET_INFO`; ``tests/test_video_buckets.py`` reads them from the pipelines): a budget in pixels ×
frames (the pipeline's default clip), a ladder of frame counts that follow the family's VAE rule
(:data:`hf_arb.buckets.frames.FRAME_RULES`), sides that are multiples of what the pipeline's ``check_inputs`` demands.
A bucket of ``F`` frames gets about ``budget / F`` pixels per frame (at most ``max_pixels``), so a long clip at a low
resolution and a short one at a high resolution cost the same.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hf_arb.checks import UsageError, check_resolution

from .family_tables import (
    ONETRAINER_ASPECTS,
    diffusers_table,
    kohya_table,
    onetrainer_table,
    sdxl_table,
    sorted_unique,
)
from .frames import FRAME_RULES

PIXART_1024: tuple[tuple[str, int, int], ...] = (
    ("0.25", 512, 2048), ("0.28", 512, 1856), ("0.32", 576, 1792), ("0.33", 576, 1728), ("0.35", 576, 1664),
    ("0.4", 640, 1600), ("0.42", 640, 1536), ("0.48", 704, 1472), ("0.5", 704, 1408), ("0.52", 704, 1344),
    ("0.57", 768, 1344), ("0.6", 768, 1280), ("0.68", 832, 1216), ("0.72", 832, 1152), ("0.78", 896, 1152),
    ("0.82", 896, 1088), ("0.88", 960, 1088), ("0.94", 960, 1024), ("1.0", 1024, 1024), ("1.07", 1024, 960),
    ("1.13", 1088, 960), ("1.21", 1088, 896), ("1.29", 1152, 896), ("1.38", 1152, 832), ("1.46", 1216, 832),
    ("1.67", 1280, 768), ("1.75", 1344, 768), ("2.0", 1408, 704), ("2.09", 1472, 704), ("2.4", 1536, 640),
    ("2.5", 1600, 640), ("3.0", 1728, 576), ("4.0", 2048, 512),
)

#: Sana's 4096 table as (key h/w, height, width); PixArt-Σ's 2048 table is it divided by 2.
SANA_4096: tuple[tuple[str, int, int], ...] = (
    ("0.25", 2048, 8192), ("0.26", 2048, 7936), ("0.27", 2048, 7680), ("0.28", 2048, 7424),
    ("0.32", 2304, 7168), ("0.33", 2304, 6912), ("0.35", 2304, 6656), ("0.4", 2560, 6400), ("0.42", 2560, 6144),
    ("0.48", 2816, 5888), ("0.5", 2816, 5632), ("0.52", 2816, 5376), ("0.57", 3072, 5376), ("0.6", 3072, 5120),
    ("0.68", 3328, 4864), ("0.72", 3328, 4608), ("0.78", 3584, 4608), ("0.82", 3584, 4352), ("0.88", 3840, 4352),
    ("0.94", 3840, 4096), ("1.0", 4096, 4096), ("1.07", 4096, 3840), ("1.13", 4352, 3840), ("1.21", 4352, 3584),
    ("1.29", 4608, 3584), ("1.38", 4608, 3328), ("1.46", 4864, 3328), ("1.67", 5120, 3072), ("1.75", 5376, 3072),
    ("2.0", 5632, 2816), ("2.09", 5888, 2816), ("2.4", 6144, 2560), ("2.5", 6400, 2560), ("2.89", 6656, 2304),
    ("3.0", 6912, 2304), ("3.11", 7168, 2304), ("3.62", 7424, 2048), ("3.75", 7680, 2048), ("3.88", 7936, 2048),
    ("4.0", 8192, 2048),
)

#: HunyuanDiT's standard ratios (w/h) and their (width, height) shapes, in ``SUPPORTED_SHAPE`` order.
HUNYUAN_DIT_SHAPES: tuple[tuple[float, tuple[tuple[int, int], ...]], ...] = (
    (1.0, ((1024, 1024), (1280, 1280))),
    (4.0 / 3.0, ((1024, 768), (1152, 864), (1280, 960))),
    (3.0 / 4.0, ((768, 1024), (864, 1152), (960, 1280))),
    (16.0 / 9.0, ((1280, 768),)),
    (9.0 / 16.0, ((768, 1280),)),
)

#: Flux Kontext's preferred resolutions, (width, height).
FLUX_KONTEXT_RESOLUTIONS: tuple[tuple[int, int], ...] = (
    (672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248), (880, 1184), (944, 1104),
    (1024, 1024), (1104, 944), (1184, 880), (1248, 832), (1328, 800), (1392, 752), (1456, 720), (1504, 688),
    (1568, 672),
)


@dataclass(frozen=True)
class PresetInfo:
    """What a preset is and which parameters it reads.

    Attributes:
        name: the preset's name (``BucketSet.preset(name)``, ``--preset``, ``--bucket_preset``).
        summary: one line for help texts and docs.
        source: where the table comes from.
        resolutions: the resolutions it has a table for (``None``: any); ``()`` when it ignores ``resolution``.
        default_resolution: used when ``resolution`` is not given (``None``: it ignores ``resolution``).
        default_step: used when ``step`` is not given (``None``: it ignores ``step``).
        native: the source's own matching rule, keyword arguments for :class:`~hf_arb.BucketSet`.
    """

    name: str
    summary: str
    source: str
    resolutions: tuple[int, ...] | None
    default_resolution: int | None
    default_step: int | None
    native: dict[str, Any] = field(default_factory=dict)


PRESET_INFO: dict[str, PresetInfo] = {p.name: p for p in (
    PresetInfo("budget", "each OneTrainer aspect at the step-aligned shape nearest in log aspect within resolution²",
               "hf_arb", None, 1024, 64, {"metric": "log"}),
    PresetInfo("novelai", "NovelAI's 19 buckets (max area 512x768, sides 256-1024, step 64, plus 512x512)",
               "NovelAI blog post 'NovelAI Improvements on Stable Diffusion'", (), None, None, {"metric": "linear"}),
    PresetInfo("sdxl", "the SDXL report's multi-aspect table, both orientations", "SDXL report (Podell et al. 2023)",
               (), None, None, {"metric": "log"}),
    PresetInfo("pixart", "PixArt-α/Σ ASPECT_RATIO_<resolution>_BIN", "diffusers pipelines/pixart_alpha",
               (256, 512, 1024, 2048), 1024, None, {"metric": "linear_hw"}),
    PresetInfo("sana", "Sana's bins: ASPECT_RATIO_4096_BIN and the PixArt bins it imports",
               "diffusers pipelines/sana/pipeline_sana.py", (512, 1024, 2048, 4096), 1024, None,
               {"metric": "linear_hw"}),
    PresetInfo("hunyuan_dit", "HunyuanDiT's SUPPORTED_SHAPE", "diffusers pipelines/hunyuandit", (), None, None,
               {"metric": "linear", "nearest_area": True}),
    PresetInfo("flux_kontext", "Flux Kontext's PREFERRED_KONTEXT_RESOLUTIONS",
               "diffusers pipelines/flux/pipeline_flux_kontext.py", (), None, None, {"metric": "linear"}),
    PresetInfo("diffusers", "diffusers.training_utils.generate_aspect_ratio_buckets(resolution, divisibility=step)",
               "diffusers training_utils.py", None, 1024, 16, {"metric": "cross"}),
    PresetInfo("onetrainer", "OneTrainer's aspects at resolution², both sides rounded to the nearest step",
               "Nerogar/mgds AspectBucketing.py @3a6994ad", None, 1024, 64, {"metric": "linear_hw"}),
    PresetInfo("kohya", "sd-scripts make_bucket_resolutions((resolution, resolution), min_side, max_side, step)",
               "kohya-ss/sd-scripts library/model_util.py @48d368fa", None, 1024, 64, {"metric": "linear"}),
)}

#: Every preset name, in the order help texts list them.
PRESETS: tuple[str, ...] = tuple(PRESET_INFO)

#: Extra table parameters a preset reads (the rest of ``BucketSet.preset``'s keywords go to the constructor).
TABLE_PARAMS: dict[str, tuple[str, ...]] = {
    "novelai": ("max_area", "max_side", "min_side", "extra"),
    "budget": ("aspects", "min_area_ratio"),
    "kohya": ("min_side", "max_side"),
}


@dataclass(frozen=True)
class VideoPresetInfo:
    """A video family's preset: its pipelines' default clip, the side step they check and a frame ladder.

    Attributes:
        name: the family (``BucketSet.preset(name)``); its frame rule is ``FRAME_RULES[name]``.
        summary: one line for help texts and docs.
        pipelines: the diffusers pipelines whose defaults these are.
        default: ``(width, height, frames)`` of the pipeline's default clip; the budget is its pixels × frames.
        step: bucket sides are multiples of it (the pipeline's ``check_inputs``: ``height % step == 0``).
        frames: the default frame ladder (each valid for the family's rule, the default's frames the longest).
        max_pixels: pixels of one frame at most (short clips and images): the largest frame the sources show.
        aspects: width / height of the buckets at every frame count: the defaults', their inverses, 4:3, 3:4, 1:1.
        source: where ``default``, ``step`` and ``max_pixels`` come from, in words.
    """

    name: str
    summary: str
    pipelines: tuple[str, ...]
    default: tuple[int, int, int]
    step: int
    frames: tuple[int, ...]
    max_pixels: int
    aspects: tuple[float, ...]
    source: str


VIDEO_PRESET_INFO: dict[str, VideoPresetInfo] = {p.name: p for p in (
    VideoPresetInfo("wan", "Wan 2.1/2.2: 832x480x81 budget, frames 1-81 (4k+1), sides of 16, frames up to 1280x720",
                    ("WanPipeline",), (832, 480, 81), 16, (1, 17, 33, 49, 65, 81), 1280 * 720,
                    (832 / 480, 480 / 832, 4 / 3, 3 / 4, 1.0),
                    "diffusers `pipelines/wan/pipeline_wan.py`: `__call__` defaults height=480, width=832, "
                    "num_frames=81; `check_inputs` height/width % 16; the docstring example's 720P (1280x720)"),
    VideoPresetInfo("ltx", "LTX-Video: 704x512x161 budget, frames 1-161 (8k+1), sides of 32, frames up to 768x512",
                    ("LTXPipeline", "LTX2Pipeline"), (704, 512, 161), 32, (1, 41, 81, 121, 161), 768 * 512,
                    (704 / 512, 512 / 704, 768 / 512, 512 / 768, 1.0),
                    "diffusers `pipelines/ltx/pipeline_ltx.py`: `__call__` defaults height=512, width=704, "
                    "num_frames=161; `check_inputs` height/width % 32; `pipelines/ltx2/pipeline_ltx2.py`'s 768x512 "
                    "at 121 frames"),
    VideoPresetInfo("hunyuan_video", "HunyuanVideo: 1280x720x129 budget, frames 1-129 (4k+1), sides of 16",
                    ("HunyuanVideoPipeline", "HunyuanVideo15Pipeline"), (1280, 720, 129), 16,
                    (1, 33, 65, 97, 129), 1280 * 720, (1280 / 720, 720 / 1280, 4 / 3, 3 / 4, 1.0),
                    "diffusers `pipelines/hunyuan_video/pipeline_hunyuan_video.py`: `__call__` defaults height=720, "
                    "width=1280, num_frames=129; `check_inputs` height/width % 16"),
)}

#: Every video preset name: (width, height, frames) tables, one per video family.
VIDEO_PRESETS: tuple[str, ...] = tuple(VIDEO_PRESET_INFO)

TABLE_PARAMS.update({name: ("frames", "max_pixels", "aspects", "min_area_ratio") for name in VIDEO_PRESETS})


def _unknown(name: str) -> ValueError:
    return ValueError(f"Unknown bucket preset {name!r}. Use one of {', '.join(map(repr, PRESETS + VIDEO_PRESETS))}.")


def preset_notes(name: str, resolution: int | None = None) -> list[str]:
    """Sentences saying that the preset ignores ``resolution`` (empty when it reads it or none was given).

    :meth:`hf_arb.BucketSet.preset` also issues them as ``UserWarning``; the CLI and the training script print
    them at start-up.

    Example:
        ```py
        >>> preset_notes("sdxl", resolution=768)
        ["preset 'sdxl' ignores resolution=768: its table is fixed (the SDXL report's multi-aspect table, both
        orientations)."]
        ```
    """
    info = PRESET_INFO.get(name)
    if info is None and name in VIDEO_PRESET_INFO:
        return []
    if info is None:
        raise _unknown(name)
    if resolution is not None and info.default_resolution is None:
        return [f"preset {name!r} ignores resolution={resolution}: its table is fixed ({info.summary})."]
    return []


def _scaled(table: Sequence[tuple[str, int, int]], div: int) -> tuple[np.ndarray, np.ndarray]:
    """(key, h, w) rows → ((k, 2) (width, height) table, (k,) matching aspects w/h from the keys)."""
    hw = np.asarray([(h, w) for _, h, w in table], dtype=np.int64) // div  # (k, 2) every value divides exactly
    return hw[:, ::-1].copy(), 1.0 / np.asarray([float(k) for k, _, _ in table])


def preset_table(
    name: str, resolution: int | None = None, step: int | None = None, **params: Any
) -> tuple[np.ndarray, dict[str, Any]]:
    """The preset's table as ``(k, 2)`` ``(width, height)`` rows (``(k, 3)`` ``(width, height, frames)`` for the
    :data:`VIDEO_PRESETS`: :func:`video_preset_table`) and its native matching rule.

    Args:
        name: one of :data:`PRESETS`.
        resolution: pixel budget side (or the model resolution for ``pixart`` / ``sana``); default per preset.
        step: side multiple (``divisibility`` for ``diffusers``, ``quantization`` for ``onetrainer``).
        params: the preset's :data:`TABLE_PARAMS`: ``min_side`` / ``max_side`` for ``kohya`` (default 256 / 1024),
            NovelAI's ``max_area`` / ``max_side`` / ``min_side`` / ``extra``, the budget's ``aspects`` /
            ``min_area_ratio``.

    Returns:
        ``(resolutions, native)``: ``native`` holds ``metric`` and, where the source matches on other values
        than the buckets' own aspects, ``match_aspects`` (PixArt's rounded keys, HunyuanDiT's standard ratios)
        and ``nearest_area``.
    """
    if name in VIDEO_PRESET_INFO:
        return video_preset_table(name, resolution, step, **params), {"metric": "log"}
    info = PRESET_INFO.get(name)
    if info is None:
        raise _unknown(name)
    check_resolution(resolution)
    for note in preset_notes(name, resolution):
        warnings.warn(note, UserWarning, stacklevel=3)
    res = info.default_resolution if resolution is None else int(resolution)
    step = info.default_step if step is None else int(step)
    if info.resolutions and res not in info.resolutions:
        raise ValueError(f"Preset {name!r} has tables for resolution {list(info.resolutions)}, got {res}. "
                         f"Pass one of those as `resolution` (--resolution).")
    if (res is not None and res <= 0) or (step is not None and step <= 0):
        raise ValueError(f"`resolution` and `step` must be positive, got resolution={res!r}, step={step!r}.")
    native = dict(info.native)
    unknown = set(params) - set(TABLE_PARAMS.get(name, ()))
    if unknown:
        raise ValueError(f"Preset {name!r} takes no {sorted(unknown)}; its table parameters are "
                         f"{list(TABLE_PARAMS.get(name, ())) or 'resolution and step only'}.")
    if name == "novelai":
        table = novelai_table(**params)
    elif name == "sdxl":
        table = sdxl_table()
    elif name == "budget":
        table = budget_table(res, step=step, **params)
    elif name in ("pixart", "sana"):
        table, native["match_aspects"] = _scaled(PIXART_1024, 1024 // res) if res <= 1024 else _scaled(
            SANA_4096, 4096 // res)
    elif name == "hunyuan_dit":
        table = np.asarray([s for _, shapes in HUNYUAN_DIT_SHAPES for s in shapes], dtype=np.int64)
        native["match_aspects"] = np.asarray([r for r, shapes in HUNYUAN_DIT_SHAPES for _ in shapes])
    elif name == "flux_kontext":
        table = np.asarray(FLUX_KONTEXT_RESOLUTIONS, dtype=np.int64)
    elif name == "diffusers":
        table = diffusers_table(res, step)
    elif name == "onetrainer":
        table = onetrainer_table(res, step)
    else:
        table = kohya_table(res, step=step, **params)
    if "match_aspects" in native:
        native["match_aspects"] = [float(x) for x in native["match_aspects"]]
    return np.asarray(table, dtype=np.int64).reshape(-1, 2), native


# --------------------------------------------------------------------------------------------- tables


def novelai_table(max_area: int = 512 * 768, max_side: int = 1024, step: int = 64, min_side: int = 256,
                  extra: Iterable[Sequence[int]] = ((512, 512),)) -> np.ndarray:
    """NovelAI's bucket algorithm; see :meth:`hf_arb.BucketSet.novelai`."""
    for name, v in (("max_area", max_area), ("max_side", max_side), ("step", step), ("min_side", min_side)):
        if int(v) <= 0:
            raise ValueError(f"`{name}` must be a positive integer, got {v!r}.")
    sides = np.arange(min_side, max_side + 1, step, dtype=np.int64)  # (m,)
    other = np.minimum(max_side, (max_area // sides) // step * step)  # (m,) largest fitting side
    keep = other >= min_side
    pairs = np.concatenate([np.stack([sides[keep], other[keep]], 1), np.stack([other[keep], sides[keep]], 1),
                            np.asarray(list(extra), dtype=np.int64).reshape(-1, 2)])  # (n, 2) with duplicates
    return sorted_unique(pairs)


def budget_table(resolution: int = 1024, aspects: Iterable[float] | None = None, step: int = 64,
                 min_area_ratio: float = 0.75) -> np.ndarray:
    """The pixel-budget ladder; see :meth:`hf_arb.BucketSet.from_budget`.

    Cost O(len(aspects) × w), not O(resolution² / step): along the step grid the candidates' aspect is monotonic in the
    grid side, so each aspect's nearest candidates (within the area rule) lie in a window around the side
    ``sqrt(budget × aspect)``, widened until it holds a kept candidate on each side of the target (or the grid's end).
    """
    if int(resolution) <= 0 or int(step) <= 0:
        raise ValueError(f"`resolution` and `step` must be positive, got resolution={resolution!r}, step={step!r}.")
    if step > resolution:
        raise ValueError(
            f"`step` ({step}) must not exceed `resolution` ({resolution}): no bucket would fit the budget."
        )
    check_resolution(resolution)
    return area_table(int(resolution) ** 2, aspects, step, min_area_ratio)


def area_table(max_pixels: int, aspects: Iterable[float] | None = None, step: int = 64,
               min_area_ratio: float = 0.75) -> np.ndarray:
    """:func:`budget_table` for a budget of ``max_pixels`` pixels (any count, not only a square's): per aspect, the
    ``step``-aligned shape nearest in log aspect among those within ``max_pixels`` using at least ``min_area_ratio``
    of it. ``(k, 2)`` ``(width, height)``, sorted by aspect."""
    budget, step = int(max_pixels), int(step)
    if step <= 0 or step * step > budget:
        raise ValueError(f"`step` ({step}) must be positive and a {step}x{step} square must fit in {budget:,} pixels.")
    if aspects is None:
        aspects = sorted({*ONETRAINER_ASPECTS, *(1 / a for a in ONETRAINER_ASPECTS)})
    targets = np.asarray(list(aspects), dtype=np.float64)  # (t,)
    if targets.size == 0 or not np.all(np.isfinite(targets) & (targets > 0)):
        raise ValueError(f"`aspects` must be positive finite width/height ratios, got {targets.tolist()}.")
    m = budget // step // step  # grid sides step, 2 step, ..., m step
    if m <= 256:  # small grids: every candidate (the area rule may exclude all of them, then all count)
        return sorted_unique(_nearest_shapes(_grid_shapes(np.arange(1, m + 1), budget, step), targets, budget,
                                             min_area_ratio))
    # Larger grids: side k = 1 gives area >= budget - step² >= 0.75 budget here, so a kept candidate exists.
    best = [_nearest_shapes(_grid_shapes(_window(float(a), m, budget, step, min_area_ratio), budget, step),
                            np.array([a]), budget, min_area_ratio)[0] for a in targets]
    return sorted_unique(np.asarray(best, dtype=np.int64).reshape(-1, 2))


def _grid_shapes(ks: np.ndarray, budget: int, step: int) -> np.ndarray:
    """Both orientations of (k step, largest step multiple within budget), shape (c, 2), c <= 2 len(ks)."""
    sides = ks.astype(np.int64) * step  # (k,)
    other = (budget // sides) // step * step  # (k,)
    ok = other >= step
    return np.concatenate([np.stack([sides[ok], other[ok]], 1), np.stack([other[ok], sides[ok]], 1)])


def _nearest_shapes(cand: np.ndarray, targets: np.ndarray, budget: int, min_area_ratio: float) -> np.ndarray:
    """Per target the candidate nearest in log aspect among those using >= min_area_ratio of the budget (all, if none
    does); ties: the larger area. Shape (t, 2)."""
    area = cand[:, 0] * cand[:, 1]  # (c,)
    if (area >= min_area_ratio * budget).any():
        cand, area = cand[area >= min_area_ratio * budget], area[area >= min_area_ratio * budget]
    log_err = np.abs(np.log(cand[:, 0] / cand[:, 1])[None, :] - np.log(targets)[:, None])  # (t, c)
    # lexsort: primary key rounded error, secondary key larger area.
    return cand[[int(np.lexsort((-area, np.round(row, 12)))[0]) for row in log_err]]


def _window(aspect: float, m: int, budget: int, step: int, min_area_ratio: float) -> np.ndarray:
    """Grid indices k (1..m) that hold the kept candidates nearest to ``aspect`` in both orientations, shape (w,).

    Orientation (k step, other): the aspect rises with k; orientation (other, k step): it falls. Each window is centred
    where the aspect crosses the target and doubled until it holds a kept candidate on both sides of the target (or
    reaches the grid's end on that side), so the nearest kept candidates of the whole grid are inside it.
    """
    out = []
    for centre, sign in ((np.sqrt(budget * aspect) / step, 1.0), (np.sqrt(budget / aspect) / step, -1.0)):
        half = 4
        while True:
            lo, hi = max(1, int(centre) - half), min(m, int(centre) + half + 1)
            ks = np.arange(lo, hi + 1, dtype=np.int64)  # (w,)
            sides = ks * step
            other = (budget // sides) // step * step  # (w,)
            kept = (other >= step) & (sides * other >= min_area_ratio * budget)
            rel = sign * np.log(sides / np.maximum(other, 1)) - np.log(aspect)  # (w,) this orientation's log error
            # where lower / higher aspects end
            low_end, high_end = (lo == 1, hi == m) if sign > 0 else (hi == m, lo == 1)
            if (low_end or (kept & (rel <= 0)).any()) and (high_end or (kept & (rel >= 0)).any()):
                out.append(ks)
                break
            half *= 2
    return np.unique(np.concatenate(out))




def frame_list(frames: Any) -> list[Any]:
    """``frames`` as a list of frame counts; one number is refused in one line (a habit from ``num_frames=81``)."""
    if isinstance(frames, (int, float, np.integer, np.floating)) or not isinstance(frames, Iterable):
        raise UsageError(f"`frames` is the list of frame counts of the buckets, e.g. [1, 17, 33, 49, 65, 81] "
                         f"(diffusion-pipe's frame_buckets, musubi-tuner's target_frames), got {frames!r}; for one "
                         f"frame count pass [{frames!r}].")
    return list(frames)


def frame_budget_table(budget: int, frames: Iterable[int], aspects: Iterable[float] | None = None, step: int = 16,
                       max_pixels: int | None = None, min_area_ratio: float = 0.75) -> np.ndarray:
    """A clip table under a budget in pixels × frames: ``(k, 3)`` ``(width, height, frames)``, frames ascending.

    Each frame count ``F`` gets :func:`area_table` at ``min(max_pixels, budget // F)`` pixels per frame, so every
    bucket costs at most ``budget`` pixels × frames, and a long low-resolution bucket costs about what a short
    high-resolution one does.

    Args:
        budget: pixels × frames of one clip (e.g. ``832 * 480 * 81``, Wan's default clip).
        frames: the frame counts (positive, distinct).
        aspects: width / height ratios at every frame count (default: OneTrainer's ladder).
        step: every side is a multiple of this.
        max_pixels: pixels of one frame at most (short clips and images); ``None``: no cap.
        min_area_ratio: as for :func:`area_table`.

    Example:
        ```py
        >>> frame_budget_table(832 * 480 * 81, [1, 81], [16 / 9], max_pixels=1280 * 720).tolist()
        [[1280, 720, 1], [832, 480, 81]]
        ```
    """
    counts = np.asarray(frame_list(frames))
    if counts.ndim != 1 or counts.size == 0 or counts.dtype.kind not in "iu" or (counts < 1).any() or \
            np.unique(counts).size != counts.size:
        raise ValueError(f"`frames` must be distinct positive frame counts, e.g. [1, 17, 33], got {counts.tolist()}.")
    if int(budget) <= 0 or (max_pixels is not None and int(max_pixels) <= 0):
        raise ValueError(f"`budget` and `max_pixels` must be positive, got budget={budget!r}, "
                         f"max_pixels={max_pixels!r}.")
    out = []
    for f in np.sort(counts).tolist():
        area = int(budget) // f if max_pixels is None else min(int(max_pixels), int(budget) // f)
        if step * step > area:
            raise ValueError(f"A budget of {int(budget):,} pixels x frames leaves {area:,} pixels per frame at {f} "
                             f"frames: less than one {step}x{step} square. Raise the budget or drop the longest frame "
                             f"counts.")
        shapes = area_table(area, aspects, step, min_area_ratio)  # (s, 2)
        out.append(np.concatenate([shapes, np.full((len(shapes), 1), f, np.int64)], 1))
    return np.concatenate(out)


def video_preset_table(name: str, resolution: int | None = None, step: int | None = None, *,
                       frames: Iterable[int] | None = None, max_pixels: int | None = None,
                       aspects: Iterable[float] | None = None, min_area_ratio: float = 0.75) -> np.ndarray:
    """A video family's ``(k, 3)`` table (:data:`VIDEO_PRESET_INFO`): :func:`frame_budget_table` at its defaults.

    Args:
        name: one of :data:`VIDEO_PRESETS`.
        resolution: the side of one frame at the longest frame count (the budget is ``resolution² × max(frames)``);
            ``None``: the budget is the pipeline's default clip (``832 * 480 * 81`` for Wan), whatever ``frames``
            asks. A larger frame also raises the ``max_pixels`` cap to it.
        step: side multiple, a multiple of the family's own (the pipeline's ``check_inputs``).
        frames: frame counts, each valid for the family's rule (``4k+1``, ``8k+1``); default: the preset's ladder.
        max_pixels: pixels of one frame at most; default: the preset's.
        aspects: width / height ratios; default: the preset's.
        min_area_ratio: as for :func:`area_table`.

    Raises:
        UsageError: a frame count the family's rule forbids (naming the nearest valid ones), or a step that is not a
            multiple of the family's.
    """
    info = VIDEO_PRESET_INFO.get(name)
    if info is None:
        raise _unknown(name)
    rule = FRAME_RULES[name]
    check_resolution(resolution)
    step = info.step if step is None else int(step)
    if step <= 0 or step % info.step:
        raise UsageError(f"preset {name!r}: bucket sides must be multiples of {info.step} (the pipeline's "
                         f"check_inputs), so the step must be one too; got step={step}.")
    counts = list(info.frames) if frames is None else frame_list(frames)
    bad = [f for f in counts if not (isinstance(f, (int, np.integer)) and rule.is_valid(int(f)))]
    if bad:
        f = bad[0]
        below = rule.floor(int(f)) if isinstance(f, (int, np.integer)) and f >= 1 else 1
        raise UsageError(f"preset {name!r}: {f!r} frames do not fit the {name} VAE rule ({rule.step}k+1 frames): use "
                         f"{below} or {below + rule.step}.")
    w, h, f0 = info.default
    if resolution is None:
        budget = w * h * f0  # the pipeline's default clip, whatever the ladder: longer clips get smaller frames
        cap = info.max_pixels if max_pixels is None else int(max_pixels)
    else:
        budget = int(resolution) ** 2 * max(counts)
        cap = max(info.max_pixels, int(resolution) ** 2) if max_pixels is None else int(max_pixels)
    return frame_budget_table(budget, counts, info.aspects if aspects is None else aspects, step, cap, min_area_ratio)
