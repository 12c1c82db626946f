"""`make demo`: the whole hf_arb pipeline, offline, on a 2-core CPU machine in about 6 minutes from a fresh clone.

(About 3 minutes of that is ``make demo``'s own light install: torch, the package and its ``demo`` extra; the run
itself took 153 s on a quiet 2-core machine. README.md gives the measurements.)

1. builds a small imagefolder of real photos (scikit-image's samples) cropped to six aspect ratios, with captions;
2. annotates it with ``hf-arb annotate`` (header-only sizes → bucket columns), draws the bucket chart with
   ``hf-arb stats --plot`` and writes the dataset report (``hf-arb report``: plan, crops, outliers) to
   ``report.html``;
3. draws what a centre square keeps of each photo next to what its bucket keeps;
4. builds tiny Stable Diffusion and Flux.1 pipelines locally (no Hub here) whose VAEs have seen the photos
   (``scripts/demo_models.py``), or uses ``MODEL=...`` for the SD run if you have a real one;
5. trains SD with LoRA and Flux (full fine-tune, per-bucket resolution shift) with two processes each through the
   real launcher (``torchrun``, gloo on CPU; NCCL on GPUs when present), cached latents, checkpoints, TensorBoard;
6. draws the loss of every bucket shape and samples at every bucket shape before and after training, and prints
   where everything is and the ``tensorboard`` command.

Environment overrides: ``MODEL`` (a diffusers SD model folder or Hub id), ``RESOLUTION`` (pixel budget side,
default 96 for the tiny models), ``STEPS`` (optimizer steps per model, default 300), ``FLOW=0`` (skip Flux),
``DEMO_OUTPUT`` (default ``demo_output``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_figures import bucket_loss_figure, crop_figure, sample_figure
from demo_models import save_demo_model

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SIZES = ((240, 160), (160, 240), (200, 200), (288, 128), (128, 288), (256, 192))  # 3:2 2:3 1:1 9:4 4:9 4:3
PROMPTS = 3  # sample prompts: captions of the training set, one per photo subject


def step(title: str) -> float:
    print(f"\n=== {title}", flush=True)
    return time.perf_counter()


def run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, **(env or {})})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_dataset(out: Path) -> Path:
    from hf_arb.testing.tiny import save_tiny_imagefolder

    images = out / "images"
    shutil.rmtree(images, ignore_errors=True)
    save_tiny_imagefolder(images, per_size=8, sizes=SIZES, image_format="jpg")
    print(f"{len(list(images.glob('*.jpg')))} photos in {len(SIZES)} aspect ratios → {images}")
    return images


def annotate(out: Path, images: Path, resolution: int, step_px: int) -> Path:
    annotated = out / "annotated"
    shutil.rmtree(annotated, ignore_errors=True)
    bucket_args = ["--preset", "budget", "--resolution", str(resolution), "--step", str(step_px)]
    run([str(BIN / "hf-arb"), "annotate", str(images), *bucket_args, "--output-dir", str(annotated)])
    run([str(BIN / "hf-arb"), "stats", str(annotated), "--plot", str(out / "buckets.png")])
    # what training will do to these photos (the plan of step 5: batch 4 on 2 processes), before training
    run([str(BIN / "hf-arb"), "report", str(annotated), "--out", str(out / "report.html"),
         "--train_batch_size", "4", "--num_processes", "2", "--seed", "0"])
    return annotated


def photos_by_shape(images: Path) -> list[tuple[str, Any]]:
    """The first demo photo of each aspect ratio, with its caption."""
    from PIL import Image

    meta = [json.loads(line) for line in (images / "metadata.jsonl").read_text().splitlines() if line.strip()]
    seen: dict[str, tuple[str, Image.Image]] = {}
    for m in meta:
        shape = m["file_name"].split("_")[1].split(".")[0]
        if shape not in seen:
            seen[shape] = (m["text"], Image.open(images / m["file_name"]).convert("RGB"))
    return list(seen.values())


def models(out: Path, images: Path, flow: bool) -> dict[str, str]:
    """Tiny SD (or ``MODEL``) and tiny Flux pipelines whose VAEs were fitted to the demo photos."""
    from PIL import Image

    photos = [Image.open(p).convert("RGB") for p in sorted(images.glob("*.jpg"))]
    paths: dict[str, str] = {}
    families = (["sd"] if not os.environ.get("MODEL") else []) + (["flux"] if flow else [])
    for family in families:
        path = out / f"tiny-{family}"
        fig = save_demo_model(family, path, photos, vae_steps=int(os.environ.get("VAE_STEPS", "300")))
        print(f"tiny {family} pipeline (random {'UNet' if family == 'sd' else 'transformer'}, VAE fitted to the "
              f"photos in {fig['seconds']:.0f} s, reconstruction MSE {fig['mse']:.3f}) → {path}")
        paths[family] = str(path)
    if os.environ.get("MODEL"):
        paths["sd"] = os.environ["MODEL"]
    return paths


def launcher() -> tuple[list[str], dict[str, str]]:
    """torchrun with 2 processes: on GPUs when there are any (NCCL), else CPU/gloo."""
    import torch

    gpus = torch.cuda.device_count()
    nproc = min(2, gpus) if gpus else 2
    env = {} if gpus else {"ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    print(f"launching {nproc} processes on {'GPU' if gpus else 'CPU'}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    return cmd, env


def train(name: str, annotated: Path, out: Path, model: str, resolution: int, step_px: int, steps: int,
          extra: list[str]) -> Path:
    """One 2-process training run of ``train_text_to_image_arb.py``; returns its output folder."""
    model_dir = out / name
    shutil.rmtree(model_dir, ignore_errors=True)
    cmd, env = launcher()
    run([*cmd, "train_text_to_image_arb.py",
         "--pretrained_model_name_or_path", model, "--dataset_name", str(annotated),
         "--caption_column", "text", "--resolution", str(resolution), "--bucket_step", str(step_px),
         "--train_batch_size", "4", "--max_train_steps", str(steps), "--lr_scheduler", "constant",
         "--cache_latents", "--checkpointing_steps", str(max(1, steps // 2)), "--checkpoints_total_limit", "1",
         "--seed", "0", "--report_to", "tensorboard", "--log_batches", "--output_dir", str(model_dir), *extra], env)
    return model_dir


def prompts(images: Path) -> list[str]:
    """``PROMPTS`` training captions about different photos (the tiny models can only learn what they saw)."""
    meta = [json.loads(line)["text"] for line in (images / "metadata.jsonl").read_text().splitlines() if line]
    picked: dict[str, str] = {}
    for text in meta:
        picked.setdefault(text.split(" of ")[1].split(" number")[0], text)
    return list(picked.values())[:PROMPTS]


def samples(base: str, model_dir: Path, shapes: list[tuple[int, int]], texts: list[str],
            steps: int) -> list[tuple[str, list]]:
    """Images at every bucket shape for every prompt, from the base model and from the trained one."""
    import torch
    from diffusers import DiffusionPipeline

    def generate(pipe: object, label: str) -> list[tuple[str, list]]:
        pipe.set_progress_bar_config(disable=True)
        rows = []
        for i, text in enumerate(texts):
            cells = []
            for w, h in shapes:
                g = torch.Generator().manual_seed(i)
                cells.append((f"{w}x{h}", pipe(text, height=h, width=w, num_inference_steps=10, generator=g).images[0]))
            rows.append((f"{label}\n{text}", cells))
        return rows

    pipe = DiffusionPipeline.from_pretrained(base)
    before = generate(pipe, "step 0 (base)")
    if (model_dir / "pytorch_lora_weights.safetensors").exists():
        pipe.load_lora_weights(str(model_dir))
        after = generate(pipe, f"step {steps} + LoRA")
    else:
        after = generate(DiffusionPipeline.from_pretrained(str(model_dir)), f"step {steps}")
    return [r for pair in zip(before, after) for r in pair]


def main() -> None:
    from hf_arb import BucketSet
    from hf_arb.logs import quiet_library_notes

    quiet_library_notes()

    t_start = time.perf_counter()
    out = (ROOT / os.environ.get("DEMO_OUTPUT", "demo_output")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    resolution = int(os.environ.get("RESOLUTION", "512" if os.environ.get("MODEL") else "96"))
    step_px = 64 if resolution >= 256 else 16
    steps = int(os.environ.get("STEPS", "300"))
    flow = os.environ.get("FLOW", "1") != "0"
    pictures: dict[str, Path] = {}

    step("1. embedded dataset (real photos in six aspect ratios, with captions)")
    images = build_dataset(out)
    step("2. annotate (header-only sizes → bucket columns) and chart")
    annotated = annotate(out, images, resolution, step_px)
    pictures["bucket chart"] = out / "buckets.png"
    pictures["report"] = out / "report.html"
    step("3. what a centre square keeps, and what a bucket keeps")
    buckets = BucketSet.preset("budget", resolution=resolution, step=step_px)
    pictures["crops"] = crop_figure(photos_by_shape(images), buckets, resolution, out / "crops.png")
    step("4. tiny models")
    paths = models(out, images, flow)
    runs: dict[str, Path] = {}
    t = step(f"5a. SD + LoRA: {steps} steps on two processes, cached latents, checkpoints")
    runs["SD + LoRA"] = train("sd-lora", annotated, out, paths["sd"], resolution, step_px, steps,
                              ["--rank", "16", "--learning_rate", "1e-3"])
    print(f"SD + LoRA trained in {time.perf_counter() - t:.0f} s")
    if flow:
        t = step(f"5b. Flux: {steps} steps on two processes, per-bucket resolution shift, cached latents")
        runs["Flux"] = train("flux", annotated, out, paths["flux"], resolution, step_px, steps,
                             ["--full_finetune", "--learning_rate", "1e-3"])
        print(f"Flux trained in {time.perf_counter() - t:.0f} s")
    step("6. pictures: loss per bucket, samples at every bucket shape before and after training")
    pictures["loss per bucket"] = bucket_loss_figure(runs, out / "loss_per_bucket.png")
    trained = sorted({tuple(int(x) for x in label.split("x")) for label in _trained_labels(runs)},
                     key=lambda wh: wh[0] / wh[1])  # the bucket shapes the runs trained, portrait → landscape
    texts = prompts(images)
    for name, model_dir in runs.items():
        family = "flux" if name == "Flux" else "sd"
        rows = samples(paths[family], model_dir, trained, texts, steps)
        path = out / f"samples_{family}.png"
        sample_figure(rows, f"{name}: each prompt at every trained bucket shape, before and after {steps} steps "
                      "(a tiny random model learns the photos' colours and contrast here, not their content)", path)
        pictures[f"samples {name}"] = path

    print(f"\nDone in {time.perf_counter() - t_start:.0f} s. Look at:")
    for label, path in pictures.items():
        print(f"  {label:<18} {path}")
    for name, model_dir in runs.items():
        print(f"  {name + ' output':<18} {model_dir}  (loads in plain diffusers; see its README.md)")
    print(f"\nTraining curves (loss, loss per bucket, learning rate):\n  tensorboard --logdir {out}")


def _trained_labels(runs: dict[str, Path]) -> set[str]:
    from demo_figures import read_trace

    return {r["label"] for d in runs.values() for r in read_trace(d)}


if __name__ == "__main__":
    main()
