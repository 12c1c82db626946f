"""Where every bucket preset comes from, and the generated table of all presets in docs/buckets.md.

:func:`preset_source` names the upstream file and constant (or call) each table equals; :data:`NATIVE_RULES` says
in words which upstream function each native matching rule reproduces. :func:`presets_markdown` renders both with
every preset's bucket count and extremes (``python docs/gen_reference.py`` writes it; a test checks it is current).
"""

from __future__ import annotations

import warnings

from .presets import PRESET_INFO, PRESETS, VIDEO_PRESET_INFO, VIDEO_PRESETS

#: Each preset's native matching rule (``metric="native"``) in words, with the upstream function it reproduces.
NATIVE_RULES: dict[str, str] = {
    "budget": "nearest log aspect (hf_arb's default)",
    "novelai": "nearest w/h (NovelAI's loop)",
    "sdxl": "nearest log aspect (the report states no rule)",
    "pixart": "nearest h/w key (`PixArtImageProcessor.classify_height_width_bin`)",
    "sana": "nearest h/w key (`PixArtImageProcessor.classify_height_width_bin`)",
    "hunyuan_dit": "nearest standard w/h, then nearest area (`map_to_standard_shapes`)",
    "flux_kontext": "nearest w/h, ties to the smaller width (`FluxKontextPipeline`)",
    "diffusers": "min \\|h·bw − w·bh\\|, ties to the last (`training_utils.find_nearest_bucket`)",
    "onetrainer": "nearest h/w (mgds `AspectBucketing`)",
    "kohya": "nearest w/h (`BucketManager.select_bucket`)",
}
#: Resolutions shown in the table for presets that scale to any ``resolution`` (SD 1.x/2.x and SDXL's).
SCALED_RESOLUTIONS: tuple[int, ...] = (512, 1024)
_D = "diffusers `pipelines/"


def preset_source(name: str, resolution: int | None = None, step: int | None = None) -> str:
    """The upstream file and constant (or call) that the preset's table equals at ``resolution`` / ``step``.

    Example:
        ```py
        >>> preset_source("pixart", 2048)
        'diffusers `pipelines/pixart_alpha/pipeline_pixart_sigma.py` `ASPECT_RATIO_2048_BIN`'
        ```
    """
    if name in VIDEO_PRESET_INFO:
        return VIDEO_PRESET_INFO[name].source
    info = PRESET_INFO.get(name)
    if info is None:
        raise ValueError(f"Unknown bucket preset {name!r}. Use one of {', '.join(map(repr, PRESETS + VIDEO_PRESETS))}.")
    res = info.default_resolution if resolution is None else resolution
    step = info.default_step if step is None else step
    if name == "pixart":
        module = "pipeline_pixart_sigma" if res == 2048 else "pipeline_pixart_alpha"
        return f"{_D}pixart_alpha/{module}.py` `ASPECT_RATIO_{res}_BIN`"
    return {
        "budget": "hf_arb `budget_table` (OneTrainer's aspect list; no upstream table)",
        "novelai": "NovelAI blog post 'NovelAI Improvements on Stable Diffusion' (their bucket algorithm)",
        "sdxl": "SDXL report (Podell et al. 2023, arXiv:2307.01952), multi-aspect training table",
        "sana": f"{_D}sana/pipeline_sana.py` `ASPECT_RATIO_{res}_BIN`" + ("" if res == 4096 else " (PixArt's)"),
        "hunyuan_dit": f"{_D}hunyuandit/pipeline_hunyuandit.py` `SUPPORTED_SHAPE`",
        "flux_kontext": f"{_D}flux/pipeline_flux_kontext.py` `PREFERRED_KONTEXT_RESOLUTIONS`",
        "diffusers": f"diffusers `training_utils.py` `generate_aspect_ratio_buckets({res}, divisibility={step})`",
        "onetrainer": f"Nerogar/mgds `AspectBucketing.py` @3a6994ad (resolution {res}, quantization {step})",
        "kohya": f"kohya-ss/sd-scripts `library/model_util.py` `make_bucket_resolutions(({res}, {res}), 256, 1024, "
                 f"{step})` @48d368fa",
    }[name]


def presets_markdown() -> str:
    """A Markdown table of every preset: each PixArt/Sana resolution, scaled presets at :data:`SCALED_RESOLUTIONS`.

    Columns: the call, bucket count, smallest and largest bucket (by area, ``width×height``), aspect and pixel
    ranges, the native matching rule and the upstream source.
    """
    from .sets import BucketSet

    lines = ["| preset | call | buckets | smallest | largest | aspects w/h | pixels | native matching rule | source |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, info in PRESET_INFO.items():
        resolutions = info.resolutions or (SCALED_RESOLUTIONS if info.resolutions is None else (None,))
        for res in resolutions:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                bs = BucketSet.preset(name, resolution=res, metric="native")
            area = bs.areas
            lo, hi = bs.resolutions[area.argmin()], bs.resolutions[area.argmax()]
            call = f"`BucketSet.preset({name!r}" + (f", resolution={res}" if res else "") + ")`"
            lines.append(f"| {name} | {call} | {len(bs)} | {lo[0]}×{lo[1]} | {hi[0]}×{hi[1]} | "
                         f"{bs.aspects.min():.3f}–{bs.aspects.max():.3f} | "
                         f"{area.min() / 1e6:.2f}–{area.max() / 1e6:.2f} MP | {NATIVE_RULES[name]} | "
                         f"{preset_source(name, res)} |")
    return "\n".join(lines)


def video_presets_markdown() -> str:
    """A Markdown table of the video presets (:data:`~hf_arb.buckets.presets.VIDEO_PRESETS`): the call, the frame rule,
    the budget (the pipeline's default clip), the frame ladder, bucket count, the largest frame and the source."""
    from .frames import FRAME_RULES
    from .sets import BucketSet

    lines = ["| preset | frame rule | budget (pixels × frames) | frames | buckets | largest frame | sides | source |",
             "|---|---|---|---|---|---|---|---|"]
    for name, info in VIDEO_PRESET_INFO.items():
        bs = BucketSet.preset(name)
        w, h, f = info.default
        big = bs.resolutions[bs.areas.argmax()]
        lines.append(f"| `BucketSet.preset({name!r})` | {FRAME_RULES[name].step}k+1 | {w}×{h}×{f} = {w * h * f:,} | "
                     f"{', '.join(map(str, info.frames))} | {len(bs)} | {big[0]}×{big[1]} | multiples of {info.step} | "
                     f"{info.source} |")
    return "\n".join(lines)
