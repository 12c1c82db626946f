"""Loading + fitting real-size JPEGs into buckets: ``fit_to_bucket`` vs the naive path.

Images: 2–12 MP JPEGs (quality 90) made of real photographs (scikit-image's bundled photos pasted at
native resolution, so the pixels carry real photographic detail), landscape and portrait. Buckets:
NovelAI's (512×768 class) and the SDXL table (1024² class); each image goes to its nearest bucket.

Naive baseline (what most training scripts do): ``Image.open`` → ``convert("RGB")`` → LANCZOS resize of
the full image to the cover size → crop. Ours: :func:`hf_arb.fit_to_bucket` (JPEG decoder downscale on
≥ 2.5× downscales, one box resize of just the cropped region). Both produce the same geometry (same
cover size, same centre crop), so the PSNR between them is the fast path's fidelity.

Also measured: the DataLoader throughput of :class:`hf_arb.BucketedImageDataset` driven by
``BucketBatchSampler`` with 0 and 2 workers, against the same loader doing the naive fit; and the
fast path's worst PSNR on real photos for the default and two uniform ``draft_gap`` values.

Usage: ``python benchmarks/bench_imaging.py [--quick]``
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import row, save_result  # noqa: E402

from hf_arb import BucketSet  # noqa: E402
from hf_arb.images.fitting import fit_to_bucket, plan_fit, to_tensor  # noqa: E402

PHOTOS = ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png",
          "hubble_deep_field.jpg", "retina.jpg", "ihc.png", "color.png"]
# (width, height): 2, 5, 8, 9, 12 MP, both orientations
SIZES_FULL = [(1632, 1224), (1224, 1632), (2592, 1944), (1944, 2592), (3264, 2448), (2448, 3264),
              (4000, 2250), (4032, 3024), (3024, 4032)]
SIZES_QUICK = [(1632, 1224), (2592, 1944), (1944, 2592)]


def _photo_dir() -> Path:
    import skimage

    return Path(os.path.dirname(skimage.__file__)) / "data"


def mosaic(width: int, height: int, seed: int) -> Image.Image:
    """A real-photo canvas: scikit-image photos pasted at native resolution, row by row."""
    rng = np.random.default_rng(seed)
    photos = [Image.open(_photo_dir() / n).convert("RGB") for n in PHOTOS]
    canvas, y = Image.new("RGB", (width, height)), 0
    while y < height:
        x, row_h = 0, 0
        while x < width:
            p = photos[int(rng.integers(len(photos)))]
            canvas.paste(p, (x, y))
            x, row_h = x + p.width, max(row_h, p.height)
        y += row_h
    return canvas


def jpeg(im: Image.Image, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def naive_fit(data: bytes, bucket: tuple[int, int]) -> Image.Image:
    """Baseline: open, convert, LANCZOS-resize the full image to the cover size, centre crop."""
    im = Image.open(io.BytesIO(data)).convert("RGB")
    plan = plan_fit(im.size, bucket, crop="center")
    (sw, sh), (y, x) = plan.scaled_size, plan.crop_top_left
    return im.resize((sw, sh), Image.LANCZOS).crop((x, y, x + bucket[0], y + bucket[1]))


def psnr(a: Image.Image, b: Image.Image) -> float:
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    mse = float(((a64 - b64) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def best_time(fn: Any, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def fit_benchmark(images: list[tuple[bytes, tuple[int, int]]], sets: dict[str, BucketSet],
                  repeat: int) -> dict[str, Any]:
    """Per (image, bucket set): seconds for naive, ours, ours exact (no draft); PSNR ours vs naive."""
    records = []
    for data, (w, h) in images:
        for set_name, bs in sets.items():
            ids, _ = bs.assign([w], [h])
            bucket = bs[int(ids[0])]
            sw, _ = plan_fit((w, h), bucket, crop="center").scaled_size
            fns = {
                "naive": lambda: naive_fit(data, bucket),
                "ours": lambda: fit_to_bucket(data, bucket, crop="center"),
                "exact": lambda: fit_to_bucket(data, bucket, crop="center", draft=False),
            }
            best = dict.fromkeys(fns, float("inf"))
            for _ in range(repeat):  # interleaved, so load changes on a shared machine hit all three alike
                for name, fn in fns.items():
                    best[name] = min(best[name], best_time(fn, 1))
            t_naive, t_ours, t_exact = best["naive"], best["ours"], best["exact"]
            ours = fit_to_bucket(data, bucket, crop="center")
            records.append({
                "size": [w, h], "set": set_name, "bucket": list(bucket), "downscale": w / sw,
                "naive_s": t_naive, "ours_s": t_ours, "exact_s": t_exact, "draft_scale": ours.draft_scale,
                "psnr": psnr(ours.image, naive_fit(data, bucket)),
            })
            print(
                f"{w}x{h} -> {bucket} ({set_name}, {w / sw:.2f}x, draft 1/{ours.draft_scale}): naive "
                f"{t_naive * 1e3:.0f} ms, "
                f"ours {t_ours * 1e3:.0f} ms, exact {t_exact * 1e3:.0f} ms, PSNR {records[-1]['psnr']:.1f} dB",
                flush=True,
            )
    return {"records": records}


def gap_sweep(quick: bool) -> dict[str, float]:
    """Worst PSNR (fast vs exact path) over a sweep of downscales on a real-photo JPEG, per draft_gap."""
    data = jpeg(mosaic(3000, 2000, seed=11))
    out: dict[str, float] = {}
    widths = list(range(460, 1300, 140 if quick else 35)) + [1500]  # 6.5x .. 2x
    exact = {bw: fit_to_bucket(data, (bw, bw * 2 // 3), crop="center", draft=False).image for bw in widths}
    for gap in (None, 1.0, 1.5):
        worst = float("inf")
        for bw in widths:
            fast = fit_to_bucket(data, (bw, bw * 2 // 3), crop="center", draft_gap=gap)
            if fast.draft_scale > 1:
                worst = min(worst, psnr(fast.image, exact[bw]))
        out["default" if gap is None else str(gap)] = worst
        print(f"draft_gap {gap}: worst PSNR {worst:.1f} dB", flush=True)
    return out


def torch_vs_pillow() -> dict[str, float]:
    """How far torch's antialiased bicubic is from Pillow's bicubic on real photos (3× and 1.7× downscales)."""
    import torch

    worst = {"float_psnr": float("inf"), "float_maxdiff": 0.0, "float_meandiff": 0.0, "uint8_maxdiff": 0.0,
             "noaa_psnr": float("inf")}
    for name in ("astronaut.png", "coffee.png", "retina.jpg"):
        im = Image.open(_photo_dir() / name).convert("RGB")
        x = torch.from_numpy(np.array(im)).permute(2, 0, 1)[None]  # (1, 3, H, W) uint8
        for f in (3.0, 1.7):
            size = (round(im.height / f), round(im.width / f))  # (h, w)
            ref = Image.fromarray(np.asarray(im.resize(size[::-1], Image.BICUBIC)))

            def img(t: torch.Tensor) -> Image.Image:
                return Image.fromarray(t.float().round().clamp(0, 255)[0].permute(1, 2, 0).to(torch.uint8).numpy())

            fa = img(torch.nn.functional.interpolate(x.float(), size=size, mode="bicubic", antialias=True))
            ua = img(torch.nn.functional.interpolate(x, size=size, mode="bicubic", antialias=True))
            na = img(torch.nn.functional.interpolate(x.float(), size=size, mode="bicubic", antialias=False))
            d = np.abs(np.asarray(fa, dtype=np.int16) - np.asarray(ref, dtype=np.int16))
            worst["float_psnr"] = min(worst["float_psnr"], psnr(fa, ref))
            worst["float_maxdiff"] = max(worst["float_maxdiff"], float(d.max()))
            worst["float_meandiff"] = max(worst["float_meandiff"], float(d.mean()))
            worst["uint8_maxdiff"] = max(
                worst["uint8_maxdiff"],
                float(np.abs(np.asarray(ua, dtype=np.int16) - np.asarray(ref, dtype=np.int16)).max()),
            )
            worst["noaa_psnr"] = min(worst["noaa_psnr"], psnr(na, ref))
    print(f"torch vs Pillow bicubic: {worst}", flush=True)
    return worst


class NaiveDataset:
    """Baseline loader dataset: datasets' decoded PIL image (full decode + exif_transpose), naive fit."""

    def __init__(self, ds: Any, buckets: BucketSet) -> None:
        self.ds, self.buckets = ds, buckets

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, key: Any) -> dict[str, Any]:
        row, bucket, _ = key
        im = self.ds[row]["image"].convert("RGB")
        bw, bh = self.buckets[bucket]
        plan = plan_fit(im.size, (bw, bh), crop="center")
        (sw, sh), (y, x) = plan.scaled_size, plan.crop_top_left
        out = im.resize((sw, sh), Image.LANCZOS).crop((x, y, x + bw, y + bh))
        return {"pixel_values": to_tensor(out), "original_size": plan.original_size,
                "crop_top_left": plan.crop_top_left,
                "target_size": plan.target_size, "caption": "", "row": row, "bucket": bucket, "flipped": False}


def loader_benchmark(files: list[str], buckets: BucketSet, workers: list[int],
                     quick: bool) -> dict[str, dict[int, float]]:
    """Images per second through a DataLoader + BucketBatchSampler, ours vs naive, per worker count."""
    import datasets
    from torch.utils.data import DataLoader

    from hf_arb import BucketBatchSampler, BucketedImageDataset, add_bucket_columns
    from hf_arb.images.dataset import collate_buckets

    ds = datasets.Dataset.from_dict({"image": files, "text": [f"photo {i}" for i in range(len(files))]})
    ds = add_bucket_columns(ds.cast_column("image", datasets.Image()), buckets, show_summary=False)
    out: dict[str, dict[int, float]] = {"ours": {}, "naive": {}}
    for name, data in (("ours", BucketedImageDataset(ds, buckets, center_crop=True)),
                       ("naive", NaiveDataset(ds, buckets))):
        for nw in workers:
            sampler = BucketBatchSampler(ds, 2, num_replicas=1, rank=0, seed=0, leftover="fill", return_keys=True,
                                         log_report=False)
            loader = DataLoader(data, batch_sampler=sampler, collate_fn=collate_buckets, num_workers=nw)
            t0, n = time.perf_counter(), 0
            for batch in loader:
                n += batch["pixel_values"].shape[0]
            out[name][nw] = n / (time.perf_counter() - t0)
            print(f"DataLoader {name}, {nw} workers: {out[name][nw]:.1f} img/s ({n} images)", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true",
                   help="3 images, 1 repeat (seconds); figures are not the documented ones")
    args = p.parse_args()
    sizes = SIZES_QUICK if args.quick else SIZES_FULL
    repeat = 1 if args.quick else 5
    images = [(jpeg(mosaic(w, h, seed=i)), (w, h)) for i, (w, h) in enumerate(sizes)]
    sets = {"novelai": BucketSet.novelai(), "sdxl": BucketSet.sdxl()}
    fit = fit_benchmark(images, sets, repeat)
    recs = fit["records"]

    def rate(sel: list[dict[str, Any]], key: str) -> float:
        return len(sel) / sum(r[key] for r in sel)  # images per second, one core

    big = [r for r in recs if r["downscale"] >= 2.0]
    small = [r for r in recs if r["downscale"] < 2.0]
    min_psnr = min(r["psnr"] for r in recs)
    rows = []
    for set_name in sets:
        sel = [r for r in big if r["set"] == set_name]
        if sel:
            rows.append(row(f"fit 2–12 MP JPEG → {set_name} buckets, ≥2× downscale ({len(sel)} images)",
                            rate(sel, "ours_s"), rate(sel, "naive_s"), "img/s/core", higher_is_better=True,
                            target="≥ 3×", note=f"downscale {min(r['downscale'] for r in sel):.1f}–"
                            f"{max(r['downscale'] for r in sel):.1f}×"))
    if big:
        rows.append(row(f"fit, all ≥2× downscales ({len(big)} images)", rate(big, "ours_s"), rate(big, "naive_s"),
                        "img/s/core", higher_is_better=True, target="≥ 3×"))
        rows.append(row("fit, ≥2× downscales, exact path (draft=False: one box resize only)", rate(big, "exact_s"),
                        rate(big, "naive_s"), "img/s/core", higher_is_better=True))
    if small:
        rows.append(row(f"fit, <2× downscales ({len(small)} images; no decoder downscale)", rate(small, "ours_s"),
                        rate(small, "naive_s"), "img/s/core", higher_is_better=True))
    rows.append(row("PSNR ours vs naive (worst image)", min_psnr, None, "dB", higher_is_better=True, target="≥ 38 dB"))

    sweep = gap_sweep(args.quick)
    for gap, worst in sweep.items():
        label = "default (1.0 after 1/2, 1.25 after 1/4, 1/8)" if gap == "default" else gap
        rows.append(row(f"fast path worst PSNR vs exact path, draft_gap={label}", worst, None, "dB",
                        higher_is_better=True, target="≥ 38 dB" if gap == "default" else "",
                        note="sweep of downscales 2–6.5× on a 3000×2000 real-photo JPEG"))

    tvp = torch_vs_pillow()
    rows.append(row("torch interpolate(bicubic, antialias=True), float input, vs Pillow BICUBIC: worst PSNR",
                    tvp["float_psnr"], None, "dB", higher_is_better=True,
                    note=f"max |diff| {tvp['float_maxdiff']:.0f}, worst mean |diff| {tvp['float_meandiff']:.2f} (8-bit "
                         f"steps); "
                    f"uint8 input (CPU kernel): max |diff| {tvp['uint8_maxdiff']:.0f}; antialias=False: worst PSNR "
                    f"{tvp['noaa_psnr']:.1f} dB. Photos: astronaut, coffee, retina at 3× and 1.7× downscales"))

    with tempfile.TemporaryDirectory() as tmp:
        loader_sizes = sizes if args.quick else sizes[:6]
        files = []
        for i, (w, h) in enumerate(loader_sizes * (1 if args.quick else 4)):
            path = Path(tmp) / f"img{i:03d}.jpg"
            path.write_bytes(jpeg(mosaic(w, h, seed=100 + i)))
            files.append(str(path))
        loader = loader_benchmark(files, sets["novelai"], [0, 2], args.quick)
    for nw in (0, 2):
        rows.append(row(f"DataLoader + BucketBatchSampler, {nw} workers ({len(files)} JPEGs 2–8 MP → NovelAI buckets)",
                        loader["ours"][nw], loader["naive"][nw], "img/s", higher_is_better=True,
                        note="naive: datasets-decoded PIL image, full LANCZOS resize, crop"))

    save_result(
        "imaging", "Fitting images to buckets (imaging.py, data.py)", rows,
        command="python benchmarks/bench_imaging.py",
        baseline="open → convert('RGB') → LANCZOS resize of the full image to the cover size → crop (same geometry)",
        details=(
            "Real-photo JPEGs (quality 90) of 2–12 MP, landscape and portrait; each image to its nearest bucket of "
            "BucketSet.novelai() and BucketSet.sdxl(). img/s/core = images / total best-of-5 seconds in one thread. "
            "Ours lets the JPEG decoder downscale by 1/2 from a 2× downscale on (1/4 from 5×, 1/8 from 10×) and "
            "resizes only the cropped region in one Pillow LANCZOS pass. The machine is shared (2 cores): loader "
            "figures are indicative."
        ),
        extra={"fit_records": recs, "draft_gap_sweep": sweep, "torch_vs_pillow": tvp,
               "loader": {k: {str(n): v for n, v in d.items()} for k, d in loader.items()}},
    )


if __name__ == "__main__":
    main()
