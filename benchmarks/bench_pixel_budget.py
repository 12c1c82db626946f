"""A pixel budget per batch (``max_pixels_per_batch``) vs one fixed batch size, for UNets on a multi-resolution table.

Table: the 512², 768² and 1024² pixel-budget ladders (:func:`hf_arb.buckets.presets.budget_table`, 64 px steps)
together, the multi-resolution table of a run that trains every image at the largest tier it has the pixels for (no
upscaling, as kohya's ``bucket_no_upscale`` or Open-Sora's ``bucket_config``). Rows: 10⁶ photo-like native sizes,
0.2–1.6 MP log-uniform over common aspect ratios, each in the largest tier whose area it covers, at the nearest
log aspect.

* fixed batch (baseline): the batch that fits the largest bucket in the budget, for every bucket (what a single
  ``--train_batch_size`` must be so that 1024² steps fit in memory);
* pixel budget (ours): bucket ``b`` takes ``floor(budget / area_b)`` images.

Budget utilisation and steps per epoch are exact counts over the 10⁶ rows. Throughput runs the tiny SD UNet
(:mod:`hf_arb.testing.tiny`, forward + backward, CPU, one thread) on the same images both ways: the pixel-budget plan's
first 24 steps, and the same images cut into batches of the fixed size; every latent side is divided by 4 (so
1024² is a 32×32 latent); images/s and pixels/s count full-scale images. The two runs alternate five times and
each keeps its best time. Plan
time: :func:`~hf_arb.sampling.planning.plan.plan_epoch` vs :func:`~hf_arb.sampling.planning.ragged.plan_epoch_ragged`
for the whole epoch of 10⁶ rows on 8 ranks.

Usage: ``python benchmarks/bench_pixel_budget.py [--quick]``
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import row, save_result, timeit  # noqa: E402

from hf_arb.buckets.presets import budget_table  # noqa: E402
from hf_arb.sampling.planning.batch_sizes import batch_sizes_for_pixels  # noqa: E402
from hf_arb.sampling.planning.plan import plan_epoch  # noqa: E402
from hf_arb.sampling.planning.ragged import plan_epoch_ragged  # noqa: E402

TIERS = (512, 768, 1024)
BUDGET = 4 * 1024 * 1024  # pixels per batch and device: four 1024² images
WORLD = 8


def table() -> tuple[np.ndarray, np.ndarray]:
    """Resolutions ``(k, 2)`` (width, height) and the tier of each bucket ``(k,)``."""
    parts = [budget_table(t) for t in TIERS]
    return np.concatenate(parts), np.concatenate([np.full(len(p), t) for t, p in zip(TIERS, parts)])


def assign(n: int, res: np.ndarray, tier: np.ndarray, seed: int = 0) -> np.ndarray:
    """Bucket id of ``n`` native photo sizes: the largest tier covered, the nearest log aspect in it; ``(n,)``."""
    rng = np.random.default_rng(seed)
    ratios = np.array([1.0, 4 / 3, 3 / 2, 16 / 9, 3 / 4, 2 / 3, 9 / 16, 2.0, 0.5])
    aspect = rng.choice(ratios, size=n, p=[0.22, 0.16, 0.15, 0.1, 0.12, 0.12, 0.05, 0.04, 0.04])
    aspect = aspect * np.exp(rng.normal(0, 0.05, n))
    area = np.exp(rng.uniform(np.log(0.2e6), np.log(1.6e6), n))
    t = np.array(TIERS)[np.clip(np.searchsorted(np.array(TIERS) ** 2, area, side="right") - 1, 0, None)]  # (n,)
    ids = np.empty(n, np.int64)
    log_a = np.log(res[:, 0] / res[:, 1])
    for tt in TIERS:
        sel, cand = np.flatnonzero(t == tt), np.flatnonzero(tier == tt)
        ids[sel] = cand[np.argmin(np.abs(np.log(aspect[sel])[:, None] - log_a[cand][None]), axis=1)]
    return ids


def counts(ids: np.ndarray, res: np.ndarray, sizes: np.ndarray) -> dict[str, float]:
    """Exact epoch figures of a plan with ``sizes`` per bucket on WORLD ranks (leftovers dropped)."""
    n = np.bincount(ids, minlength=len(res))
    steps = n // (WORLD * sizes)  # (k,)
    area = res[:, 0] * res[:, 1]
    images = steps * WORLD * sizes
    return {"steps": int(steps.sum()), "images": int(images.sum()), "pixels": float((images * area).sum()),
            "utilisation": float((steps * sizes * area).sum() / (steps.sum() * BUDGET)),
            "dropped": float(1 - images.sum() / n.sum())}


def make_inputs(steps: list[tuple[int, int]], res: np.ndarray, dim: int) -> tuple[list, int, float]:
    """Random latents/timesteps/text of the given ``(bucket, images)`` steps (latent sides ÷ 4); images; full-scale
    pixels."""
    import torch

    area = res[:, 0] * res[:, 1]
    gen = torch.Generator().manual_seed(0)
    inputs = []
    for b, m in steps:
        w, h = (int(v) // 32 for v in res[b])  # latent (÷8) side ÷4
        inputs.append((torch.randn(m, 4, h, w, generator=gen), torch.randint(0, 1000, (m,), generator=gen),
                       torch.randn(m, 8, dim, generator=gen)))
    return inputs, sum(m for _, m in steps), float(sum(m * area[b] for b, m in steps))


def throughput(runs: dict[str, tuple[list, int, float]], unet, repeat: int) -> dict[str, tuple[float, float]]:
    """{name: (images/s, full-scale pixels/s)} of forward + backward over each run's steps; the runs alternate
    ``repeat`` times (best time of each kept), so a change in machine load hits both alike."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeat):
        for name, (inputs, _, _) in runs.items():
            t0 = time.perf_counter()
            for x, t, text in inputs:
                out = unet(x, t, text).sample
                ((out - x) ** 2).mean().backward()
                unet.zero_grad(set_to_none=True)
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: (runs[name][1] / best[name], runs[name][2] / best[name]) for name in runs}


def main() -> None:
    quick = "--quick" in sys.argv
    n = 100_000 if quick else 1_000_000
    res, tier = table()
    ids = assign(n, res, tier)
    area = res[:, 0] * res[:, 1]
    fixed_b = int(BUDGET // area.max())
    sizes = batch_sizes_for_pixels(res, BUDGET)
    fixed = np.full(len(res), fixed_b)
    c_fix, c_pix = counts(ids, res, fixed), counts(ids, res, sizes)

    # plan time, whole epoch on WORLD ranks
    t_fix, _ = timeit(lambda: plan_epoch(ids, fixed_b, WORLD, seed=0), repeat=3)
    t_pix, plan = timeit(lambda: plan_epoch_ragged(ids, sizes, WORLD, seed=0), repeat=3)
    assert plan.num_steps == c_pix["steps"]

    # throughput on the tiny UNet: the first steps of each plan (same seed)
    import torch

    from hf_arb.testing.tiny import tiny_sd_pipeline

    torch.manual_seed(0)
    torch.set_num_threads(1)
    unet = tiny_sd_pipeline().unet.train()
    steps = 8 if quick else 24
    pix_plan = plan_epoch_ragged(ids, sizes, 1, seed=0)
    # the same images both ways: the pixel plan's first steps, and those images in batches of the fixed size
    pix_steps = [(int(b), int(m)) for b, m in zip(pix_plan.buckets[:steps], pix_plan.batch[:steps])]
    fix_steps = [(b, min(fixed_b, m - i)) for b, m in pix_steps for i in range(0, m, fixed_b)]
    dim = unet.config.cross_attention_dim
    runs = {"fixed": make_inputs(fix_steps, res, dim), "pixel": make_inputs(pix_steps, res, dim)}
    t0 = time.perf_counter()
    speed = throughput(runs, unet, repeat=1 if quick else 5)
    bench_s = time.perf_counter() - t0
    (fix_ips, fix_pps), (pix_ips, pix_pps) = speed["fixed"], speed["pixel"]

    rows = [
        row("images per second (tiny UNet, fwd+bwd, CPU, best of 5 alternating runs)", pix_ips, fix_ips, "img/s",
            higher_is_better=True),
        row("full-scale pixels per second (tiny UNet)", pix_pps / 1e6, fix_pps / 1e6, "MP/s", higher_is_better=True),
        row("budget used per step (mean pixels / budget)", c_pix["utilisation"], c_fix["utilisation"], "fraction",
            higher_is_better=True),
        row("steps per epoch (8 ranks)", float(c_pix["steps"]), float(c_fix["steps"]), "steps",
            note="fewer steps for the same epoch"),
        row("rows dropped per epoch (leftover='drop')", c_pix["dropped"], c_fix["dropped"], "fraction"),
        row(f"plan build, whole epoch, {n:,} rows, 8 ranks", t_pix, t_fix, "s",
            note="ragged plan vs the dense fixed-batch plan"),
    ]
    save_result(
        "pixel_budget", "Pixel budget per batch vs one batch size (UNet, multi-resolution table)", rows,
        command="python benchmarks/bench_pixel_budget.py",
        baseline=f"one batch size for every bucket: {fixed_b}, the most images of the largest bucket "
                 f"({int(res[np.argmax(area)][0])}x{int(res[np.argmax(area)][1])}) that fit {BUDGET:,} pixels",
        details=__doc__.split("Usage:")[0].split("\n", 1)[1],
        extra={"buckets": len(res), "batch_sizes": sorted(set(sizes.tolist())), "rows": n,
               "fixed": c_fix, "pixel_budget": c_pix, "throughput_steps": [len(fix_steps), len(pix_steps)],
               "throughput_seconds": bench_s},
    )


if __name__ == "__main__":
    main()
