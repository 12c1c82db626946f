"""Packing vs bucketing vs pad-to-largest at the same images: tokens, padding, crop and step time.

Sizes: native photos of 0.25–1 MP (area log-uniform, common aspect ratios 1:2 … 2:1 with 5 % log jitter), SD3/Flux
latent geometry (VAE 8 × patch 2 = 16 px a token side, so 1 MP ≈ 4,096 tokens).

* packing (ours): each image at its own aspect ratio (:func:`hf_arb.packing.fit_sizes`, crop only to the 16 px
  grid), packed by :func:`hf_arb.packing.plan_packs` into ``max_tokens`` sequences.
* bucketing: the SDXL bucket table (~1 MP, 64 px steps, log-aspect assignment); every image is scaled to cover its
  bucket and cropped; batches are all one shape, so no padding, but small images are trained at ~1 MP.
* pad-to-largest: random batches of the same number of images as a pack holds on average, every latent
  zero-padded to the batch's largest height and width (the rectangle an ``(B, C, H, W)`` model needs).

Token, padding and crop figures are exact counts over 20,000 sizes. Step time (forward + backward, CPU) runs the
tiny SD3 and Flux transformers (:mod:`hf_arb.testing.tiny_flow`) on 48 of those images with every side divided by 4
(so 64–256 tokens an image, packs of 1,024 tokens = 16,384 at full scale), the same images for all three.

Usage: ``python benchmarks/bench_packing.py [--quick]``
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import row, save_result, timeit  # noqa: E402

from hf_arb import BucketSet  # noqa: E402
from hf_arb.packing.plan import fit_sizes, plan_packs  # noqa: E402

STEP = 16  # VAE factor 8 x patch 2
BUDGETS = (8192, 16384, 32768)


def native_sizes(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Photo-like native sizes of 0.25–1 MP; shapes (n,), (n,)."""
    rng = np.random.default_rng(seed)
    ratios = np.array([1.0, 4 / 3, 3 / 2, 16 / 9, 3 / 4, 2 / 3, 9 / 16, 2.0, 0.5, 1.25, 0.8])
    probs = np.array([0.2, 0.15, 0.15, 0.1, 0.1, 0.1, 0.05, 0.05, 0.04, 0.03, 0.03])
    aspect = rng.choice(ratios, size=n, p=probs) * np.exp(rng.normal(0, 0.05, n))
    area = np.exp(rng.uniform(np.log(0.25e6), np.log(1.0e6), n))
    w = np.round(np.sqrt(area * aspect)).astype(np.int64)
    return w, np.round(area / w).astype(np.int64)


def pad_to_largest(th: np.ndarray, tw: np.ndarray, batch: int, seed: int = 0) -> tuple[float, int, int, float]:
    """Canvas padding of random batches: (padding fraction, tokens processed, real tokens, sequence padding)."""
    order = np.random.default_rng(seed).permutation(th.size)
    n = th.size // batch * batch
    bh, bw = th[order[:n]].reshape(-1, batch), tw[order[:n]].reshape(-1, batch)
    total = int((bh.max(1) * bw.max(1)).sum() * batch)
    real = int((bh * bw).sum())
    seq_total = int((bh * bw).max(1).sum() * batch)  # padding token sequences (not a rectangle) to the largest
    return 1 - real / total, total, real, 1 - real / seq_total


def bucket_fit(w: np.ndarray, h: np.ndarray, scale: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """SDXL buckets (sides / ``scale``): per-image bucket width, height (px) and crop fraction."""
    bs = BucketSet.preset("sdxl")
    ids, _ = bs.assign(w, h)
    res = np.asarray(bs.resolutions, dtype=np.int64)[ids] // scale
    crop = 1 - np.exp(-np.abs(np.log(w / h) - np.log(bs.aspects[ids])))
    return res[:, 0], res[:, 1], crop


def figures(n: int) -> tuple[list[dict], dict]:
    w, h = native_sizes(n, seed=1)
    fit = fit_sizes(w, h, 4096)
    th, tw = fit.height // STEP, fit.width // STEP
    bw, bh, bcrop = bucket_fit(w, h)
    bucket_tokens = (bw // STEP) * (bh // STEP)
    rows, extra = [], {"images": n, "native_tokens_mean": float(fit.tokens.mean())}
    rows.append(row("mean crop: packing (16 px grid) vs SDXL buckets", 100 * fit.crop_fraction.mean(),
                    100 * bcrop.mean(), "% of area",
                    note=f"p95 {100 * np.quantile(fit.crop_fraction, .95):.2f}% vs "
                         f"{100 * np.quantile(bcrop, .95):.1f}%"))
    rows.append(row("tokens per image: packing (native size) vs SDXL buckets (~1 MP)", float(fit.tokens.mean()),
                    float(bucket_tokens.mean()), "tokens",
                    note=f"buckets upscale {100 * (bucket_tokens > fit.tokens).mean():.0f}% of the images"))
    for budget in BUDGETS:
        t0 = time.perf_counter()
        plan = plan_packs(fit.tokens, budget, 1, seed=0, epoch=0)
        dt = time.perf_counter() - t0
        r = plan.report
        batch = max(1, int(round(r.mean_images_per_pack)))
        pad, total, _, seq_pad = pad_to_largest(th, tw, batch)
        pad_tokens = total / (th.size // batch * batch)
        rows.append(row(f"padding at {budget // 1024}k tokens: packing vs pad-to-largest (batch {batch})",
                        100 * r.padding_fraction, 100 * pad, "% of tokens",
                        note=f"{r.mean_images_per_pack:.2f} images/pack; padding token sequences (not the latent "
                             f"rectangle) to the batch's largest: {100 * seq_pad:.1f}%; tokens processed per image "
                             f"{r.tokens_total / r.rows_packed:,.0f} (packing) vs {pad_tokens:,.0f} (pad-to-largest) "
                             f"vs "
                             f"{bucket_tokens.mean():,.0f} (buckets); "
                             f"planned {n:,} rows in {dt * 1e3:.0f} ms"))
        extra[f"budget_{budget}"] = {"padding_packing": r.padding_fraction, "padding_pad_to_largest": pad,
                                     "padding_pad_sequences": seq_pad,
                                     "images_per_pack": r.mean_images_per_pack, "pad_batch": batch,
                                     "tokens_per_image_packing": r.tokens_total / r.rows_packed,
                                     "tokens_per_image_pad": pad_tokens}
    big = np.random.default_rng(0).integers(1024, 4097, 1_000_000 if n > 5000 else 100_000)
    t_plan, plan = timeit(lambda: plan_packs(big, 16384, 8, seed=0, epoch=0), repeat=1)
    rows.append(row(f"plan one epoch of {big.size:,} rows (16k budget, 8 ranks)", 1e6 * t_plan / big.size, None,
                    "µs/row", note=f"padding {100 * plan.report.padding_fraction:.2f}%"))
    return rows, extra


# ------------------------------------------------------------------------------------------------- step time
def step_times(n_images: int, repeat: int) -> tuple[list[dict], dict]:
    """Forward + backward of the tiny SD3 transformer over the same images, three ways; seconds per image."""
    import torch

    from hf_arb.packing.model import enable_packed_attention, pack_tokens, packed_sd3_forward, patchify
    from hf_arb.testing.tiny_flow import tiny_sd3_pipeline

    torch.set_num_threads(1)
    model = tiny_sd3_pipeline().transformer
    w, h = native_sizes(n_images, seed=2)
    fit = fit_sizes(w // 4, h // 4, 256)  # 1/4 scale: 1 MP -> 256 tokens
    lh, lw = fit.height // 8, fit.width // 8  # latent sides
    g = torch.Generator().manual_seed(0)
    lat = [torch.randn(16, int(a), int(b), generator=g) for a, b in zip(lh, lw)]
    txt = torch.randn(n_images, 8, 64, generator=g)
    pooled = torch.randn(n_images, 64, generator=g)
    t = torch.rand(n_images, generator=g) * 1000
    budget = 1024
    plan = plan_packs(fit.tokens, budget, 1, seed=0, epoch=0)
    batch = max(1, int(round(plan.report.mean_images_per_pack)))

    def packing() -> int:
        tokens = 0
        for rows in plan.iter_rank(0):
            rows = rows.tolist()
            out = packed_sd3_forward(model, [lat[i] for i in rows], [txt[i] for i in rows], pooled[rows], t[rows],
                                     max_tokens=budget)
            y = pack_tokens([patchify(lat[i], 2) for i in rows], budget)
            mask = torch.as_tensor(out.meta.loss_mask)[None, :, None]
            (((out.sample - y) ** 2) * mask).mean().backward()
            tokens += budget
        return tokens

    bw, bh, _ = bucket_fit(w, h, scale=4)

    def bucketing() -> int:
        tokens = 0
        keys = bw * 100_000 + bh
        for k in np.unique(keys):
            rows = np.flatnonzero(keys == k)
            for s in range(0, rows.size, batch):
                r = rows[s:s + batch].tolist()
                x = torch.randn(len(r), 16, int(bh[r[0]]) // 8, int(bw[r[0]]) // 8, generator=g)
                out = model(hidden_states=x, encoder_hidden_states=txt[r], pooled_projections=pooled[r],
                            timestep=t[r]).sample
                ((out - x) ** 2).mean().backward()
                tokens += x[0, 0].numel() // 4 * len(r)
        return tokens

    def pad_largest() -> int:
        tokens = 0
        order = np.random.default_rng(0).permutation(n_images)
        for s in range(0, n_images, batch):
            r = order[s:s + batch].tolist()
            hh, ww = max(lat[i].shape[1] for i in r), max(lat[i].shape[2] for i in r)
            x = torch.stack([torch.nn.functional.pad(lat[i], (0, ww - lat[i].shape[2], 0, hh - lat[i].shape[1]))
                             for i in r])
            out = model(hidden_states=x, encoder_hidden_states=txt[r], pooled_projections=pooled[r],
                        timestep=t[r]).sample
            ((out - x) ** 2).mean().backward()
            tokens += hh * ww // 4 * len(r)
        return tokens

    t_bucket, tok_bucket = timeit(bucketing, repeat)
    t_pad, tok_pad = timeit(pad_largest, repeat)
    enable_packed_attention(model)
    t_pack, tok_pack = timeit(packing, repeat)
    note = (f"{n_images} images, 1 thread; tokens processed {tok_pack:,} (packing, {plan.num_steps} packs of "
            f"{budget}) vs {tok_bucket:,} (buckets) vs {tok_pad:,} (pad-to-largest, batch {batch})")
    rows = [row("step time per image, tiny SD3 fwd+bwd: packing vs SDXL buckets", 1e3 * t_pack / n_images,
                1e3 * t_bucket / n_images, "ms", note=note),
            row("step time per image, tiny SD3 fwd+bwd: packing vs pad-to-largest", 1e3 * t_pack / n_images,
                1e3 * t_pad / n_images, "ms",
                note="same images; packing uses the varlen backend (one SDPA call per image and layer)")]
    return rows, {"tokens_packing": tok_pack, "tokens_buckets": tok_bucket, "tokens_pad": tok_pad}


def flux_step_times(n_images: int, repeat: int) -> tuple[list[dict], dict]:
    """The same comparison on the tiny Flux transformer (2×2-packed latent tokens, RoPE ids per image)."""
    import torch

    from hf_arb.packing.model import enable_packed_attention, pack_tokens, packed_flux_forward
    from hf_arb.testing.tiny_flow import tiny_flux_pipeline

    torch.set_num_threads(1)
    model = tiny_flux_pipeline().transformer
    w, h = native_sizes(n_images, seed=2)
    fit = fit_sizes(w // 4, h // 4, 256)
    grids = np.stack([fit.height // 16, fit.width // 16], 1)  # token grid (2x2-packed latents)
    g = torch.Generator().manual_seed(0)
    tok = [torch.randn(int(a) * int(b), 64, generator=g) for a, b in grids]
    txt = torch.randn(n_images, 8, 64, generator=g)
    pooled = torch.randn(n_images, 32, generator=g)
    t, guid = torch.rand(n_images, generator=g), torch.full((n_images,), 3.5)
    budget = 1024
    plan = plan_packs(fit.tokens, budget, 1, seed=0, epoch=0)
    batch = max(1, int(round(plan.report.mean_images_per_pack)))

    def ids(a: int, b: int) -> torch.Tensor:
        out = torch.zeros(a, b, 3)
        out[..., 1], out[..., 2] = torch.arange(a)[:, None], torch.arange(b)[None]
        return out.reshape(-1, 3)

    def stock(x: torch.Tensor, r: list[int], a: int, b: int) -> int:
        out = model(hidden_states=x, encoder_hidden_states=txt[r], pooled_projections=pooled[r], timestep=t[r],
                    img_ids=ids(a, b), txt_ids=torch.zeros(8, 3), guidance=guid[r]).sample
        ((out - x) ** 2).mean().backward()
        return a * b * len(r)

    def packing() -> int:
        for rows in plan.iter_rank(0):
            rows = rows.tolist()
            out = packed_flux_forward(model, [tok[i] for i in rows], grids[rows], [txt[i] for i in rows],
                                      pooled[rows], t[rows], guid[rows], max_tokens=budget)
            y = pack_tokens([tok[i] for i in rows], budget)
            mask = torch.as_tensor(out.meta.loss_mask)[None, :, None]
            (((out.sample - y) ** 2) * mask).mean().backward()
        return plan.num_steps * budget

    bw, bh, _ = bucket_fit(w, h, scale=4)

    def bucketing() -> int:
        tokens, keys = 0, bw * 100_000 + bh
        for k in np.unique(keys):
            rows = np.flatnonzero(keys == k)
            a, b = int(bh[rows[0]]) // 16, int(bw[rows[0]]) // 16
            for s0 in range(0, rows.size, batch):
                r = rows[s0:s0 + batch].tolist()
                tokens += stock(torch.randn(len(r), a * b, 64, generator=g), r, a, b)
        return tokens

    def pad_largest() -> int:
        tokens, order = 0, np.random.default_rng(0).permutation(n_images)
        for s0 in range(0, n_images, batch):
            r = order[s0:s0 + batch].tolist()
            a, b = int(grids[r, 0].max()), int(grids[r, 1].max())
            x = torch.stack([torch.nn.functional.pad(tok[i].reshape(*grids[i], 64),
                                                     (0, 0, 0, b - grids[i][1], 0, a - grids[i][0])).reshape(-1, 64)
                             for i in r])
            tokens += stock(x, r, a, b)
        return tokens

    t_bucket, tok_bucket = timeit(bucketing, repeat)
    t_pad, tok_pad = timeit(pad_largest, repeat)
    enable_packed_attention(model)
    t_pack, tok_pack = timeit(packing, repeat)
    note = (f"{n_images} images, 1 thread; tokens processed {tok_pack:,} (packing) vs {tok_bucket:,} (buckets) vs "
            f"{tok_pad:,} (pad-to-largest, batch {batch})")
    rows = [row("step time per image, tiny Flux fwd+bwd: packing vs SDXL buckets", 1e3 * t_pack / n_images,
                1e3 * t_bucket / n_images, "ms", note=note),
            row("step time per image, tiny Flux fwd+bwd: packing vs pad-to-largest", 1e3 * t_pack / n_images,
                1e3 * t_pad / n_images, "ms", note="same images; varlen backend")]
    return rows, {"flux_tokens_packing": tok_pack, "flux_tokens_buckets": tok_bucket, "flux_tokens_pad": tok_pad}


def main() -> None:
    quick = "--quick" in sys.argv
    rows, extra = figures(2_000 if quick else 20_000)
    trows, textra = step_times(16 if quick else 48, 1 if quick else 2)
    frows, fextra = flux_step_times(16 if quick else 48, 1 if quick else 2)
    trows, textra = trows + frows, textra | fextra
    save_result(
        "packing", "Packing vs bucketing vs pad-to-largest (SD3/Flux latent geometry)", rows + trows,
        command="python benchmarks/bench_packing.py",
        baseline="SDXL buckets (crop, ~1 MP) and pad-to-largest batches of the same images",
        details=__doc__.split("Usage:")[0].split("\n\n", 1)[1].strip(), extra=extra | textra,
    )


if __name__ == "__main__":
    main()
