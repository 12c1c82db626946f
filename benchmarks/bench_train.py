"""Training throughput: ``--cache_latents`` vs on-the-fly VAE, and bucketed vs the stock square pipeline.

Everything runs in one process on CPU with the tiny offline models of :mod:`hf_arb.testing.tiny` (SD 1.x architecture at
toy width: UNet ~1 M parameters, 4-block VAE ~67 k): no GPU was lent to this benchmark's task, so the real SD 1.5 /
SDXL architectures were not measured. With tiny models the UNet step is cheap, so the figures mostly measure the
data path (decode, resize, crop, VAE encode) — the part bucketing and caching change.

* **ours, on the fly**: ``train_text_to_image_arb.py`` (called in-process through ``main``), bucketed, centre crops,
  the VAE encodes every batch.
* **ours, cached**: the same command with ``--cache_latents``, timed on a second run that reuses the cache (the
  first run's cache build time is reported separately).
* **baseline, square**: a faithful re-implementation of diffusers' ``train_text_to_image.py`` loop (shuffled
  ``DataLoader``, resize shorter side + centre crop to ``resolution²``, VAE encode, DDPM noise, UNet, AdamW) at the
  same pixel budget, with the same models. torchvision is not installed here, so the transforms are Pillow's
  (bilinear resize, as upstream).

Images/s counts training images through the whole loop (data + VAE + UNet forward/backward + optimizer), from the
first batch to the last, same batch size and steps on every side.

Usage: ``python benchmarks/bench_train.py [--quick] [--steps N]``
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from _util import row, save_result  # noqa: E402

import train_text_to_image_arb as script  # noqa: E402

#: Source image sizes (w, h): five aspect ratios at a few hundred pixels, like small web images.
SIZES = ((400, 388), (488, 288), (280, 472), (600, 196), (188, 584))


def _quiet(fn, *a, **kw):
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        return fn(*a, **kw)


def ours(model: str, data: str, out: Path, *, steps: int, batch: int, resolution: int, cache: bool) -> dict:
    argv = ["--pretrained_model_name_or_path", model, "--train_data_dir", data, "--output_dir", str(out),
            "--resolution", str(resolution), "--bucket_step", "32", "--train_batch_size", str(batch),
            "--max_train_steps", str(steps), "--center_crop", "--report_to", "none", "--seed", "0",
            "--lr_warmup_steps", "0", "--checkpointing_steps", "100000", "--bucket_leftover", "fill",
            "--full_finetune"]  # the default --learning_rate 1e-4 needs the mode spelt out
    if cache:
        argv.append("--cache_latents")
    t0 = time.perf_counter()
    stats = _quiet(script.main, argv)
    stats["wall_seconds"] = time.perf_counter() - t0
    return stats


def square_baseline(model: str, data: str, *, steps: int, batch: int, resolution: int) -> dict:
    """diffusers' train_text_to_image.py loop at resolution x resolution (Pillow transforms, no torchvision)."""
    import datasets
    import torch.nn.functional as F
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from PIL import Image
    from transformers import CLIPTextModel, CLIPTokenizer

    tok = CLIPTokenizer.from_pretrained(model, subfolder="tokenizer")
    te = CLIPTextModel.from_pretrained(model, subfolder="text_encoder").requires_grad_(False)
    vae = AutoencoderKL.from_pretrained(model, subfolder="vae").requires_grad_(False)
    unet = UNet2DConditionModel.from_pretrained(model, subfolder="unet").train()
    sched = DDPMScheduler.from_pretrained(model, subfolder="scheduler")
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    ds = datasets.load_dataset("imagefolder", data_dir=data, split="train")

    def transform(im: Image.Image) -> torch.Tensor:
        im = im.convert("RGB")
        w, h = im.size
        s = resolution / min(w, h)
        im = im.resize((max(resolution, round(w * s)), max(resolution, round(h * s))), Image.Resampling.BILINEAR)
        left, top = (im.width - resolution) // 2, (im.height - resolution) // 2
        im = im.crop((left, top, left + resolution, top + resolution))
        x = torch.from_numpy(np.asarray(im, dtype=np.float32) / 127.5 - 1.0)
        return x.permute(2, 0, 1)

    def preprocess(examples: dict) -> dict:
        examples["pixel_values"] = [transform(im) for im in examples["image"]]
        examples["input_ids"] = tok(examples["text"], max_length=tok.model_max_length, padding="max_length",
                                    truncation=True, return_tensors="pt").input_ids
        return examples

    train = ds.with_transform(preprocess)

    def collate(examples: list) -> dict:
        return {"pixel_values": torch.stack([e["pixel_values"] for e in examples]),
                "input_ids": torch.stack([e["input_ids"] for e in examples])}

    g = torch.Generator().manual_seed(0)
    loader = torch.utils.data.DataLoader(train, batch_size=batch, shuffle=True, collate_fn=collate, drop_last=True,
                                         generator=g)
    done, images, t0 = 0, 0, time.perf_counter()
    while done < steps:
        for b in loader:
            latents = vae.encode(b["pixel_values"]).latent_dist.sample(generator=g) * vae.config.scaling_factor
            noise = torch.randn(latents.shape, generator=g)
            t = torch.randint(0, sched.config.num_train_timesteps, (latents.shape[0],), generator=g)
            noisy = sched.add_noise(latents, noise, t)
            hidden = te(b["input_ids"])[0]
            loss = F.mse_loss(unet(noisy, t, hidden).sample.float(), noise.float())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            done += 1
            images += latents.shape[0]
            if done >= steps:
                break
    seconds = time.perf_counter() - t0
    return {"images_per_second": images / seconds, "train_seconds": seconds, "train_images": images}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="few steps (seconds); figures are not the documented ones")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--resolution", type=int, default=None, help="pixel budget side (default 128; quick 64)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 4; quick 2)")
    p.add_argument("--repeat", type=int, default=None, help="timed runs per side (best kept)")
    args = p.parse_args()
    steps = args.steps or (2 if args.quick else 20)
    repeat = args.repeat or (1 if args.quick else 2)
    args.resolution = args.resolution or (64 if args.quick else 128)
    args.batch = args.batch or (2 if args.quick else 4)
    # One intra-op thread on every side: on a shared machine, multi-threaded CPU kernels slow down erratically when
    # another job takes a core (spin-waiting workers), which would swamp the differences measured here.
    torch.set_num_threads(1)

    from hf_arb import BucketSet
    from hf_arb.testing.tiny import save_tiny_imagefolder, save_tiny_sd

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model = _quiet(save_tiny_sd, tmp_path / "tiny-sd")
        data = save_tiny_imagefolder(tmp_path / "images", per_size=2 if args.quick else 8, sizes=SIZES,
                                     image_format="jpg")
        n_images = len(list(Path(data).glob("*.jpg")))

        # Cache build (first --cache_latents run) and its reuse.
        cache_out = tmp_path / "cached"
        first = ours(model, data, cache_out, steps=steps, batch=args.batch, resolution=args.resolution, cache=True)
        results: dict[str, list[dict]] = {"fly": [], "cached": [], "square": []}
        for i in range(repeat):  # interleaved, so machine load affects every side alike
            results["fly"].append(ours(model, data, tmp_path / f"fly{i}", steps=steps, batch=args.batch,
                                       resolution=args.resolution, cache=False))
            results["cached"].append(ours(model, data, cache_out, steps=steps, batch=args.batch,
                                          resolution=args.resolution, cache=True))
            results["square"].append(_quiet(square_baseline, model, data, steps=steps, batch=args.batch,
                                            resolution=args.resolution))
        # The machine is shared: its load changes between rounds far more than between the sides of one round.
        # Report the quietest round (largest total throughput), where all three sides ran under the same load,
        # and give every round's ratios in the notes.
        totals = [sum(results[k][i]["images_per_second"] for k in results) for i in range(repeat)]
        quiet = int(np.argmax(totals))
        best = {k: v[quiet] for k, v in results.items()}
        ratios = {
            "cached/fly": [
                c["images_per_second"] / f["images_per_second"] for c, f in zip(results["cached"], results["fly"])
            ],
            "fly/square": [
                f["images_per_second"] / q["images_per_second"] for f, q in zip(results["fly"], results["square"])
            ],
        }
        assert all(r["latents_encoded"] == 0 for r in results["cached"]), "the cache was not reused"

    buckets = BucketSet.from_budget(args.resolution, step=32)
    budget = args.resolution**2
    mean_area = float(np.mean(buckets.areas))
    fly, cached, square = (best[k]["images_per_second"] for k in ("fly", "cached", "square"))
    rows = [
        row("train images/s: --cache_latents vs on-the-fly VAE (bucketed)", cached, fly, "images/s",
            higher_is_better=True,
            note=f"tiny SD on CPU, batch {args.batch}, {steps} steps; quietest of {repeat} interleaved rounds; "
                 f"ratio per round: {', '.join(f'{r:.2f}' for r in ratios['cached/fly'])}"),
        row("train images/s: bucketed (ours, on the fly) vs stock square pipeline", fly, square, "images/s",
            higher_is_better=True, target="no slower at the same pixel budget",
            note=f"buckets about {args.resolution}² px (mean bucket area {mean_area:.0f} vs {budget}); square = "
                 "diffusers-style resize + centre crop; ratio per round: "
                 + ", ".join(f"{r:.2f}" for r in ratios["fly/square"])),
        row("train images/s: bucketed + cached vs stock square pipeline", cached, square, "images/s",
            higher_is_better=True),
        row("latent cache build (first run, VAE encodes every image once)", first["latents_encoded"]
            / max(1e-9, first["wall_seconds"]), None, "entries/s (whole first run)",
            note=f"{first['latents_encoded']} entries for {n_images} images; a second run encoded "
                 f"{results['cached'][-1]['latents_encoded']}"),
    ]
    save_result(
        "train", "Training throughput (train_text_to_image_arb.py, tiny models, CPU)", rows,
        command="python benchmarks/bench_train.py",
        baseline="on-the-fly VAE encoding (same script); diffusers-style square pipeline at the same pixel budget",
        details=(
            "Tiny SD 1.x architecture built offline (hf_arb.testing.tiny), CPU only: **no GPU was lent to this task**, "
            "so the "
            "real SD 1.5 / SDXL UNet and VAE were not measured. Source images are JPEGs of 0.1 MP with five aspect "
            f"ratios; training at resolution {args.resolution} (bucket step 32). With models this small the step is "
            "dominated by the data path, which is what caching removes; with real models the VAE encode is a larger "
            "share and the UNet step dominates both sides of the bucketed-vs-square comparison. One torch thread on "
            "every side. The machine is shared "
            "with other jobs (load changed up to 20x between rounds), so the sides run interleaved in rounds and the "
            "table shows the quietest round."
        ),
        extra={"quiet_round": quiet, "ratios": ratios, "images": n_images, "steps": steps, "batch": args.batch,
               "resolution": args.resolution,
               "runs": {k: [r["images_per_second"] for r in v] for k, v in results.items()}},
    )


if __name__ == "__main__":
    main()
