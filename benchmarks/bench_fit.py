"""``BucketSet.fit`` against every preset on three size distributions, and its speed on 10⁷ sizes.

Distributions (documented mixtures; no real size list ships with the repo):

- *photos*: :func:`bench_preset_crop.photo_sizes` (camera and phone formats in both orientations, 30 % re-cropped);
- *phone*: portrait-heavy phone camera rolls, :data:`PHONE` (3:4 and 9:16 portraits, screenshots, some landscape);
- *mixed*: a third each of photos, phone and NovelAI-like illustrations (:func:`bench_preset_crop.novelai_like_sizes`).

For each: mean crop (share of area cut off after covering the bucket), worst crop, share of rows upscaled (cover
scale above 1) and number of buckets, for ``BucketSet.fit`` (8, 16 and 32 buckets at 1024², step 64) and every
preset at its defaults with the log assignment. Speed: ``BucketSet.fit`` on 10⁷ sizes next to one assignment pass
of the same sizes to the SDXL table (the pass any annotation makes anyway).

Usage: ``python benchmarks/bench_fit.py [--quick]``
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import peak_rss_mb, row, save_result, timeit  # noqa: E402
from bench_preset_crop import _sizes, novelai_like_sizes, photo_sizes  # noqa: E402

from hf_arb import BucketSet  # noqa: E402
from hf_arb.annotate.report import cover_crop  # noqa: E402
from hf_arb.buckets.presets import PRESET_INFO  # noqa: E402

#: (label, width/height, share): a phone camera roll, mostly upright
PHONE: tuple[tuple[str, float, float], ...] = (
    ("3:4 portrait (main camera upright)", 3 / 4, 0.50), ("9:16 portrait (video, stories)", 9 / 16, 0.15),
    ("9:19.5 portrait screenshot", 9 / 19.5, 0.10), ("4:3 landscape", 4 / 3, 0.12), ("16:9 landscape", 16 / 9, 0.05),
    ("1:1 square", 1.0, 0.08),
)


def phone_sizes(n: int, seed: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """``n`` phone sizes from :data:`PHONE`, 15 % re-cropped (log aspect × N(0, 0.1)); shapes ``(n,)``."""
    rng = np.random.default_rng(seed)
    shares = np.asarray([s for *_, s in PHONE])
    aspect = np.asarray([a for _, a, _ in PHONE])[rng.choice(len(PHONE), size=n, p=shares / shares.sum())]
    recrop = rng.random(n) < 0.15
    aspect[recrop] *= np.exp(rng.normal(0.0, 0.1, int(recrop.sum())))
    return _sizes(aspect, rng)


def mixed_sizes(n: int) -> tuple[np.ndarray, np.ndarray]:
    parts = [photo_sizes(n // 3, seed=10), phone_sizes(n // 3, seed=11), novelai_like_sizes(n - 2 * (n // 3), seed=12)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def metrics(bs: BucketSet, w: np.ndarray, h: np.ndarray) -> dict[str, float]:
    ids, _ = bs.assign(w, h)
    crop, scale = cover_crop(w, h, bs.resolutions[ids, 0], bs.resolutions[ids, 1])
    return {"buckets": len(bs), "mean_crop": float(crop.mean()), "worst_crop": float(crop.max()),
            "upscaled": float((scale > 1).mean())}


def main() -> None:
    quick = "--quick" in sys.argv
    n = 100_000 if quick else 1_000_000
    n_speed = 1_000_000 if quick else 10_000_000
    dists = {"photos": photo_sizes(n, seed=0), "phone": phone_sizes(n), "mixed": mixed_sizes(n)}
    tables: dict[str, dict[str, dict[str, float]]] = {}
    for dist, (w, h) in dists.items():
        res: dict[str, dict[str, float]] = {}
        for k in (8, 16, 32):
            res[f"fit {k}"] = metrics(BucketSet.fit((w, h), k), w, h)
        res["fit 16, max_crop 0.15"] = metrics(BucketSet.fit((w, h), 16, max_crop=0.15, max_side=4096,
                                                             min_side=256), w, h)
        for name in PRESET_INFO:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                res[name] = metrics(BucketSet.preset(name), w, h)
        tables[dist] = res

    # speed on 10^7 sizes: fit next to one assignment pass
    w, h = photo_sizes(n_speed, seed=3)
    rss0 = peak_rss_mb()
    t_fit, fitted = timeit(lambda: BucketSet.fit((w, h), 16), repeat=2 if quick else 3)
    rss_fit = peak_rss_mb()
    sdxl = BucketSet.sdxl()
    t_assign, _ = timeit(lambda: sdxl.assign(w, h), repeat=2 if quick else 3)
    t_fit_bound, _ = timeit(lambda: BucketSet.fit((w, h), 32, max_crop=0.2, max_side=4096, min_side=256), repeat=1)

    lines = ["| distribution | bucket set | buckets | mean crop | worst crop | rows upscaled |",
             "|---|---|---|---|---|---|"]
    for dist, res in tables.items():
        for name, m in res.items():
            label = f"**{name}**" if name.startswith("fit") else name
            lines.append(f"| {dist} | {label} | {m['buckets']} | {100 * m['mean_crop']:.2f}% | "
                         f"{100 * m['worst_crop']:.1f}% | {100 * m['upscaled']:.1f}% |")
    rows = [row(f"BucketSet.fit, {n_speed:,} sizes, 16 buckets", t_fit, t_assign, "s",
                note=f"baseline: one assignment pass of the same sizes to the SDXL table; with max_crop=0.2, 32 "
                     f"buckets, sides 256-4096: {t_fit_bound:.2f} s; peak RSS {rss_fit:.0f} MB (before {rss0:.0f} MB)")]
    for dist, res in tables.items():
        best = min((m["mean_crop"], name) for name, m in res.items() if not name.startswith("fit"))
        rows.append(row(f"mean crop, {dist}: fit 16 vs the 'budget' preset ({res['budget']['buckets']} buckets)",
                        100 * res["fit 16"]["mean_crop"], 100 * res["budget"]["mean_crop"], "% of area",
                        note=f"best preset: {best[1]} {100 * best[0]:.2f}% with {res[best[1]]['buckets']} buckets"))
    save_result(
        "fit", f"Fitted bucket sets vs every preset ({n:,} sizes per distribution; fit speed at {n_speed:,})", rows,
        command="python benchmarks/bench_fit.py",
        baseline="every preset at its defaults (log assignment); speed: one assignment pass of the same sizes",
        details=("`BucketSet.fit(sizes, K)` at 1024² pixels, step 64, sides 512-2048 (the SDXL table's range) unless "
                 "stated; *max_crop 0.15* also widens the sides to 256-4096. Distributions: *photos* as in the preset "
                 "crop benchmark; *phone* a portrait-heavy camera roll (" + "; ".join(f"{lab} {s:.0%}" for lab, _, s
                                                                                    in PHONE)
                 + "; 15 % re-cropped); *mixed* a third each of photos, phone and NovelAI-like illustrations. Long "
                 "sides 1024-6000 px, so 'rows upscaled' counts the small images.\n\n" + "\n".join(lines) + "\n"),
        extra={"tables": tables, "fit_seconds": t_fit, "assign_seconds": t_assign, "fitted": fitted.labels()},
    )


if __name__ == "__main__":
    main()
