"""Mean crop fraction of every bucket preset on a realistic photo aspect distribution, vs a square centre crop.

An image fitted to its bucket is scaled to cover it (``s = max(bw / w, bh / h)``) and the excess cut off; the crop
fraction is the share of the scaled image's area removed, ``1 - bw * bh / (s² w h)``. The baseline is what
diffusers' ``train_text_to_image.py`` does without buckets: resize the short side and centre-crop a square
(``1 - short / long``). Each preset is measured with hf_arb's default assignment (log aspect distance, what
``--bucket_preset NAME`` trains with) and with the source's own rule (``--bucket_metric native``).

The sizes (no real width/height list ships with this repository or its dependencies; scikit-image's ~20 photos are
too few) are a documented mixture modelled on photo collections, see :data:`MIXTURE`: camera and phone formats in
both orientations, squares, phone screenshots and panoramas, 30 % of them re-cropped freely. A second distribution
(:func:`novelai_like_sizes`) rebuilds an illustration dataset from NovelAI's published rows per bucket (5.31 M
Danbooru images): each bucket's rows spread uniformly over the aspects that NovelAI's linear rule assigns to it.

Usage: ``python benchmarks/bench_preset_crop.py [--quick]``
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import row, save_result, timeit  # noqa: E402
from bench_sampler import NOVELAI_ENTRIES  # noqa: E402

from hf_arb import BucketSet  # noqa: E402
from hf_arb.buckets.presets import PRESET_INFO  # noqa: E402

#: (label, width/height, share of images). Shares are assumptions modelled on public photo collections: camera
#: 3:2 and phone 4:3 dominate, portraits are about a third, then video/screen 16:9, squares, social 4:5, phone
#: screenshots 19.5:9 and stitched panoramas (``None``: w/h log-uniform in 2–6).
MIXTURE: tuple[tuple[str, float | None, float], ...] = (
    ("3:2 landscape (DSLR, mirrorless)", 3 / 2, 0.20), ("2:3 portrait", 2 / 3, 0.10),
    ("4:3 landscape (phone, compact, MFT)", 4 / 3, 0.20), ("3:4 portrait (phone upright)", 3 / 4, 0.16),
    ("16:9 landscape (video frames, screens)", 16 / 9, 0.08), ("9:16 portrait (stories)", 9 / 16, 0.04),
    ("1:1 (square crops)", 1.0, 0.10), ("4:5 portrait (social)", 4 / 5, 0.04), ("5:4 landscape", 5 / 4, 0.02),
    ("9:19.5 phone screenshot", 9 / 19.5, 0.03), ("19.5:9 phone landscape", 19.5 / 9, 0.01),
    ("panorama 2:1-6:1", None, 0.02),
)
#: Share of images re-cropped by their owner, and the spread of that crop (log aspect, normal).
RECROP_SHARE, RECROP_SIGMA = 0.30, 0.15


def photo_sizes(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` sizes drawn from :data:`MIXTURE` (long side 1024–6000 px, integer sides), shapes ``(n,)``."""
    rng = np.random.default_rng(seed)
    shares = np.asarray([s for _, _, s in MIXTURE])
    cls = rng.choice(len(MIXTURE), size=n, p=shares / shares.sum())  # (n,)
    ratios = np.asarray([np.nan if r is None else r for _, r, _ in MIXTURE])
    aspect = ratios[cls]  # (n,) w/h, NaN for panoramas
    pano = np.isnan(aspect)
    aspect[pano] = np.exp(rng.uniform(np.log(2.0), np.log(6.0), int(pano.sum())))
    recrop = rng.random(n) < RECROP_SHARE
    aspect[recrop] *= np.exp(rng.normal(0.0, RECROP_SIGMA, int(recrop.sum())))
    return _sizes(aspect, rng)


def novelai_like_sizes(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Sizes with NovelAI's published rows per bucket; within a bucket, w/h uniform over the interval their linear
    rule assigns to it (outer buckets: mirrored half-intervals). Shapes ``(n,)``."""
    rng = np.random.default_rng(seed)
    wh = np.asarray(list(NOVELAI_ENTRIES), dtype=np.float64)  # (19, 2)
    counts = np.asarray(list(NOVELAI_ENTRIES.values()), dtype=np.float64)
    a = wh[:, 0] / wh[:, 1]
    order = np.argsort(a)
    a, counts = a[order], counts[order]
    mids = (a[:-1] + a[1:]) / 2  # (18,) NovelAI's linear-rule boundaries
    lo = np.concatenate([[a[0] - (mids[0] - a[0])], mids])  # (19,)
    hi = np.concatenate([mids, [a[-1] + (a[-1] - mids[-1])]])
    b = rng.choice(a.size, size=n, p=counts / counts.sum())
    return _sizes(rng.uniform(lo[b], hi[b]), rng)


def _sizes(aspect: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    long_side = rng.integers(1024, 6001, aspect.size).astype(np.float64)  # (n,)
    w = np.where(aspect >= 1, long_side, long_side * aspect)
    h = np.where(aspect >= 1, long_side / aspect, long_side)
    return np.maximum(np.rint(w), 1).astype(np.int64), np.maximum(np.rint(h), 1).astype(np.int64)


def crop_fraction(bucket_wh: np.ndarray, w: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Share of the scaled image's area cut off when it is resized to cover its bucket, shape ``(n,)``."""
    bw, bh = bucket_wh[:, 0].astype(np.float64), bucket_wh[:, 1].astype(np.float64)
    scale = np.maximum(bw / w, bh / h)  # (n,) resize-to-cover
    return 1.0 - bw * bh / (scale * scale * w * h)


def square_crop(w: np.ndarray, h: np.ndarray) -> np.ndarray:
    """diffusers' resize + centre square crop: share of the area cut off, shape ``(n,)``."""
    return 1.0 - np.minimum(w, h) / np.maximum(w, h)


def measure(bs: BucketSet, w: np.ndarray, h: np.ndarray) -> np.ndarray:
    ids, _ = bs.assign(w, h)
    return crop_fraction(bs.resolutions[ids], w, h)


def main() -> None:
    n = 100_000 if "--quick" in sys.argv else 1_000_000
    dists = {"photos": photo_sizes(n, seed=0), "novelai": novelai_like_sizes(n, seed=1)}
    tables = [(name, None) for name in PRESET_INFO] + [("sana", 4096)]
    rows, extra = [], {"n": n, "mixture": [list(m) for m in MIXTURE], "recrop": [RECROP_SHARE, RECROP_SIGMA],
                       "square_crop": {}, "presets": {}}
    for dist, (w, h) in dists.items():
        extra["square_crop"][dist] = float(square_crop(w, h).mean())
    w, h = dists["photos"]
    square = square_crop(w, h)
    t_all = 0.0
    for name, res in tables:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            log_bs = BucketSet.preset(name, resolution=res)
            native_bs = BucketSet.preset(name, resolution=res, metric="native")
        t, c_log = timeit(lambda bs=log_bs: measure(bs, w, h), repeat=1)
        t_all += t
        c_nat = measure(native_bs, w, h)
        nw, nh = dists["novelai"]
        c_nai_log, c_nai_nat = measure(log_bs, nw, nh), measure(native_bs, nw, nh)
        label = name if res is None else f"{name} {res}"
        rows.append(row(f"mean crop, {label} ({len(log_bs)} buckets)", 100 * c_log.mean(), 100 * square.mean(),
                        "% of area",
                        note=f"native rule ({native_bs.metric}) {100 * c_nat.mean():.2f}%; p95 "
                             f"{100 * np.quantile(c_log, 0.95):.1f}%; "
                             f"{100 * (c_log > 0.1).mean():.1f}% of images lose > 10%; NovelAI-like illustrations "
                             f"{100 * c_nai_log.mean():.2f}% (native {100 * c_nai_nat.mean():.2f}%, square crop "
                             f"{100 * extra['square_crop']['novelai']:.1f}%)"))
        extra["presets"][label] = {
            "buckets": len(log_bs), "photos_log": float(c_log.mean()), "photos_native": float(c_nat.mean()),
            "photos_p95_log": float(np.quantile(c_log, 0.95)), "novelai_log": float(c_nai_log.mean()),
            "novelai_native": float(c_nai_nat.mean())}
    mixture = "; ".join(f"{label} {share:.0%}" for label, _, share in MIXTURE)
    save_result(
        "preset_crop", f"Crop fraction of every preset on a photo aspect mixture ({n:,} sizes)", rows,
        command="python benchmarks/bench_preset_crop.py",
        baseline="square centre crop (diffusers' train_text_to_image.py without buckets)",
        details=(
            "Crop fraction = share of the image's area cut off after resizing it to cover its bucket (exact, float64). "
            "*ours*: the preset with hf_arb's default log-aspect assignment (`--bucket_preset NAME`); the note adds "
            "the source's own rule (`--bucket_metric native`). Presets at their default parameters (resolution "
            "1024 where it applies; crop depends on the aspects only). No real width/height list ships with the repo "
            f"or its dependencies, so the sizes are a stated mixture modelled on photo collections: {mixture}; "
            f"{RECROP_SHARE:.0%} of all images re-cropped by their owner (w/h × exp(N(0, {RECROP_SIGMA}))); long "
            "side 1024–6000 px. Note column, *NovelAI-like illustrations*: NovelAI's published rows per bucket "
            "(5.31 M Danbooru images), each bucket's rows spread uniformly over the w/h interval NovelAI's "
            f"linear rule gives it. Assigning and measuring {n:,} sizes with the log rule took {t_all:.2f} s for all "
            f"presets."),
        extra=extra,
    )


if __name__ == "__main__":
    main()
