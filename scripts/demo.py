"""`make demo`: the whole hf_arb pipeline, offline, on a 2-core CPU machine in a few minutes.

1. builds a small imagefolder of real photos (scikit-image's samples) cropped to six aspect ratios, with captions;
2. annotates it with ``hf-arb annotate`` (header-only sizes → bucket columns) and prints the summary;
3. draws the bucket chart with ``hf-arb stats --plot``;
4. builds a tiny Stable Diffusion pipeline locally (no Hub here) — or uses ``MODEL=...`` if you have one;
5. trains it with two processes through the real launcher (``torchrun``, gloo on CPU; NCCL on GPUs when
   present) with cached latents and checkpoints, writing validation grids at portrait/square/landscape buckets;
6. plots the loss curve and prints where every picture and the saved pipeline are.

Environment overrides: ``MODEL`` (a diffusers model folder or Hub id), ``RESOLUTION`` (pixel budget side,
default 64 for the tiny model), ``STEPS`` (default 300), ``DEMO_OUTPUT`` (default ``demo_output``).
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

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SIZES = ((240, 160), (160, 240), (200, 200), (288, 128), (128, 288), (256, 192))  # 3:2 2:3 1:1 9:4 4:9 4:3


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
    from hf_arb.tiny import save_tiny_imagefolder

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
    return annotated


def model_path(out: Path) -> str:
    if os.environ.get("MODEL"):
        return os.environ["MODEL"]
    from hf_arb.tiny import save_tiny_sd

    path = out / "tiny-sd"
    shutil.rmtree(path, ignore_errors=True)
    save_tiny_sd(path)
    print(f"tiny SD pipeline (random weights, offline) → {path}")
    return str(path)


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


def train(out: Path, annotated: Path, model: str, resolution: int, step_px: int, steps: int) -> Path:
    model_dir = out / "model"
    shutil.rmtree(model_dir, ignore_errors=True)
    cmd, env = launcher()
    run([*cmd, "train_text_to_image_arb.py",
         "--pretrained_model_name_or_path", model, "--dataset_name", str(annotated),
         "--caption_column", "text", "--resolution", str(resolution), "--bucket_step", str(step_px),
         "--train_batch_size", "4", "--max_train_steps", str(steps), "--learning_rate", "1e-4",
         "--full_finetune",  # a tiny random model: a high rate on every weight is what the demo wants
         "--lr_scheduler", "constant", "--cache_latents", "--random_flip",
         "--checkpointing_steps", str(max(1, steps // 3)), "--checkpoints_total_limit", "2",
         "--validation_prompts", "a portrait photo of astronaut number 0", "a landscape photo of coffee number 1",
         "--validation_epochs", "25", "--num_validation_inference_steps", "10",
         "--seed", "0", "--report_to", "tensorboard", "--log_batches", "--output_dir", str(model_dir)], env)
    return model_dir


def loss_curve(model_dir: Path, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 4))
    for trace in sorted((model_dir / "batches").glob("rank*.jsonl")):
        recs = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
        steps = np.array([r["step"] for r in recs])
        loss = np.array([r["loss"] for r in recs])
        ax.plot(steps, loss, alpha=0.3, label=f"{trace.stem} per batch")
        k = max(1, len(loss) // 20)
        ax.plot(steps[k - 1:], np.convolve(loss, np.ones(k) / k, mode="valid"), label=f"{trace.stem} mean of {k}")
    ax.set_xlabel("step")
    ax.set_ylabel("diffusion loss (MSE)")
    ax.set_title("tiny SD, bucketed training, 2 processes")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    t_start = time.perf_counter()
    out = (ROOT / os.environ.get("DEMO_OUTPUT", "demo_output")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    resolution = int(os.environ.get("RESOLUTION", "512" if os.environ.get("MODEL") else "64"))
    step_px = 64 if resolution >= 256 else 16
    steps = int(os.environ.get("STEPS", "300"))

    step("1. embedded dataset (real photos in six aspect ratios, with captions)")
    images = build_dataset(out)
    step("2-3. annotate (header-only sizes → bucket columns) and chart")
    annotated = annotate(out, images, resolution, step_px)
    step("4. model")
    model = model_path(out)
    t = step(f"5. train {steps} steps on two processes, cached latents, checkpoints, validation grids")
    model_dir = train(out, annotated, model, resolution, step_px, steps)
    print(f"training took {time.perf_counter() - t:.0f} s")
    step("6. loss curve")
    loss_curve(model_dir, out / "loss.png")

    grids = sorted((model_dir / "validation").glob("*.png"))
    print(f"\nDone in {time.perf_counter() - t_start:.0f} s. Look at:")
    print(f"  bucket chart      {out / 'buckets.png'}")
    print(f"  loss curve        {out / 'loss.png'}")
    for g in grids:
        print(f"  validation grid   {g}")
    print(f"  saved pipeline    {model_dir}  (StableDiffusionPipeline.from_pretrained)")
    print(f"  checkpoints       {sorted(p.name for p in model_dir.glob('checkpoint-*'))}")


if __name__ == "__main__":
    main()
