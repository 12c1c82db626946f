"""Mean crop fraction of every bucket preset on a realistic aspect distribution.

An image fitted to a bucket is scaled to cover it and the excess cropped; the fraction of the scaled image's area
cropped away is ``1 - exp(-|log(w/h) - log(bw/bh)|)`` (exact up to pixel rounding). For each preset, ours is the
default log-aspect assignment, the baseline the source's own (native) matching rule on the same table. The log
metric minimises the cropped area on any table, so ratios are >= 1 by construction; the figures say how much.

Usage: ``python benchmarks/bench_presets.py [--quick]``
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import row, save_result, timeit  # noqa: E402
from bench_assign import synthetic_sizes  # noqa: E402

from hf_arb import BucketSet  # noqa: E402
from hf_arb.buckets.presets import PRESET_INFO  # noqa: E402


def crop_fraction(bs: BucketSet, ids: np.ndarray, w: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Fraction of the scaled image's area removed by the crop, shape (n,)."""
    return 1 - np.exp(-np.abs(np.log(w / h) - np.log(bs.aspects[ids])))


def main() -> None:
    n = 100_000 if "--quick" in sys.argv else 1_000_000
    w, h = synthetic_sizes(n, seed=1)
    rows, extra = [], {}
    for name in PRESET_INFO:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours_bs = BucketSet.preset(name)
            native_bs = BucketSet.preset(name, metric="native")
        t_ours, (ids, _) = timeit(lambda: ours_bs.assign(w, h), repeat=1)
        t_nat, (nids, _) = timeit(lambda: native_bs.assign(w, h), repeat=1)
        c_ours, c_nat = crop_fraction(ours_bs, ids, w, h), crop_fraction(native_bs, nids, w, h)
        differ = float((ids != nids).mean())
        rows.append(row(f"mean crop, {name} ({len(ours_bs)} buckets)", 100 * c_ours.mean(), 100 * c_nat.mean(),
                        "% of area",
                        note=f"p95 {100 * np.quantile(c_ours, 0.95):.1f}% vs {100 * np.quantile(c_nat, 0.95):.1f}%; "
                             f"{100 * differ:.2f}% of images get another bucket; native metric {native_bs.metric}; "
                             f"assign {t_ours * 1e9 / n:.0f} vs {t_nat * 1e9 / n:.0f} ns/image"))
        extra[name] = {"buckets": len(ours_bs), "mean_crop_log": float(c_ours.mean()),
                       "mean_crop_native": float(c_nat.mean()), "share_reassigned": differ}
    save_result(
        "presets", f"Crop fraction of every bucket preset ({n:,} photo-like sizes)", rows,
        command="python benchmarks/bench_presets.py",
        baseline="the preset's own (native) matching rule on the same table",
        details=("Sizes: the photo-like distribution of the assignment benchmark (common aspect ratios 1:2 … 2:1 with "
                 "5 % log jitter, long side 256–4096 px). Crop fraction = area removed after scaling to cover the "
                 "bucket. Presets at their defaults (resolution 1024 where it applies)."),
        extra=extra,
    )


if __name__ == "__main__":
    main()
