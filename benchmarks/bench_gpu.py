"""The GPU benchmark and CUDA smoke run: one prepared command, no network, no Hub weights (issue 40).

Usage::

    python benchmarks/bench_gpu.py                       # on a CUDA machine: everything, <= 8 minutes on an H100
    python benchmarks/bench_gpu.py --device cpu --tiny   # the same code paths with tiny configs (the test suite)
    make bench-gpu

Three sections, each written to the JSON as soon as it ends (a run stopped by its time limit keeps what it measured):

1. ``models`` — random-initialised full-size denoisers built from their published configs
   (``benchmarks/gpu_configs/*.json``: SD 1.5 UNet, SDXL UNet, Flux.1-dev and Qwen-Image transformers), LoRA rank
   16, bf16, gradient checkpointing: the step time and peak memory through hf_arb's family adapter at the largest
   and the median bucket of the family's default preset and at the square of the same pixel budget, the same
   square step through a faithful minimal copy of diffusers' own training step (diffusers' scripts load weights
   from the Hub, so they cannot be driven here), and the peak memory at batch 1 and 2 of the largest bucket, from
   which the table of the largest ``--train_batch_size`` per card follows.
2. ``smoke`` — every family's tiny model (:mod:`hf_arb.testing`) trains 3 steps through the real script on the
   device: LoRA with ``--cache_latents``, ``--gradient_checkpointing``, ``--allow_tf32`` and 2 DataLoader workers
   (pinned batches, non-blocking copies) in bf16, the same in fp16 (accelerate's GradScaler), a resume from the bf16
   run's checkpoint-2, and for SD ``--use_8bit_adam`` (bitsandbytes) and for Flux ``--packing`` (flex attention,
   ``torch.compile``). Each is compared with the same run on the CPU in float32: every loss finite, each step's
   loss and the final LoRA weights equal within the dtype's tolerance (the noise is drawn on the CPU, so both
   runs draw the same numbers), the resumed run's last step equal to the uninterrupted one's (with ``--device
   cpu`` the fp32 case is that float32 run itself: one command on one device runs once, ``same_as``). For Flux.2
   klein, upstream's quantized training where its library is installed: ``--do_fp8_training`` (torchao, compute
   capability 8.9+) and ``--bnb_quantization_config_path`` (NF4 QLoRA, bitsandbytes), gated on finite losses and a
   finite LoRA of the same keys; their distance to the float32 run is reported, not yet held to a tolerance (no GPU
   measurement has set one).
3. ``loader`` — data-loader throughput at 1024² from real JPEGs (decode + fit, and from the latent cache) on this
   machine's CPUs, against what the GPU consumes per second (section 1's step times): the share of a step the
   GPU would wait for data.

Writes ``benchmarks/results/gpu/<card>.json`` (``--out``); ``--markdown FILE`` prints the docs table of such a
file, and ``benchmarks/report.py`` puts it into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # hf_arb from this checkout, installed or not (a bare GPU machine)
    sys.path.insert(0, str(ROOT))
CONFIGS = Path(__file__).resolve().parent / "gpu_configs"
SCRIPT = ROOT / "train_text_to_image_arb.py"
#: where the GPU results go, one file per card (docs/benchmarks.md's GPU section renders them: benchmarks/report.py)
RESULTS = Path(__file__).resolve().parent / "results" / "gpu"
GIB = 2 ** 30
#: cards a user picks ``--train_batch_size`` for (GiB of GPU memory)
CARDS_GIB = (24, 48, 80, 141)
#: per-step loss tolerance against the CPU float32 run, relative to max(1, |loss|)
TOLERANCE = {"bf16": 5e-2, "bf16_cudnn": 5e-2, "fp16": 2e-2, "8bit": 5e-2, "pack": 5e-2, "fp32": 1e-5,
             "fp8": float("inf"), "qlora": float("inf")}  # quantized: reported, not yet measured against a bound
#: the flags of the quantized cases, dropped from their CPU float32 reference (with the flag's value, if any)
QUANT_FLAGS = {"--do_fp8_training": 0, "--bnb_quantization_config_path": 1}

# ---------------------------------------------------------------------------------------------------- configs


def load_specs(tiny: bool) -> list[dict[str, Any]]:
    """Every ``gpu_configs/*.json``; ``tiny``: its ``tiny`` overrides applied (the same architecture, small)."""
    specs = []
    for path in sorted(CONFIGS.glob("*.json")):
        spec = json.loads(path.read_text())
        if tiny:
            spec = {**spec, "config": {**spec["config"], **spec["tiny"]},
                    "text": {**spec["text"], **spec.get("tiny_text", {})}}
        specs.append(spec)
    return specs


def build_model(spec: dict[str, Any], device: str, dtype: Any) -> Any:
    """The denoiser of ``spec``, random-initialised directly on ``device`` in ``dtype`` (no float32 copy)."""
    import diffusers
    import torch

    cls = getattr(diffusers, spec["model_class"])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return cls.from_config(spec["config"])
    finally:
        torch.set_default_dtype(previous)


def count_parameters(spec: dict[str, Any]) -> int:
    """Parameters of ``spec``'s denoiser, built on the meta device (no memory)."""
    import torch

    return sum(p.numel() for p in build_model(spec, "meta", torch.float32).parameters())


def text_dims(spec: dict[str, Any]) -> tuple[int, int, int | None]:
    """``(tokens, hidden dim, pooled dim or None)`` of the cached prompt embeddings ``spec``'s denoiser takes."""
    cfg, text = spec["config"], spec["text"]
    pooled = text.get("pooled")
    if "pooled_key" in text:
        pooled = cfg[text["pooled_key"]]
    if spec["family"] == "sdxl":  # SDXL's add embedding: pooled + 6 time ids x addition_time_embed_dim
        pooled = cfg["projection_class_embeddings_input_dim"] - 6 * cfg["addition_time_embed_dim"]
    return int(text["tokens"]), int(cfg[text["dim_key"]]), pooled


def preset_shapes(spec: dict[str, Any], tiny: bool) -> dict[str, tuple[int, int]]:
    """The largest and the median bucket (by area, then by the long side) of the family's default preset at its
    default resolution, and the square of the same budget: ``{"largest": (w, h), "median": ..., "square": ...}``."""
    import numpy as np

    from hf_arb import BucketSet
    from hf_arb.families import get_family

    resolution = 64 if tiny else get_family(spec["family"]).lora_defaults[0]
    res = np.asarray(BucketSet.preset("budget", resolution, step=16 if tiny else 64).resolutions)
    order = np.lexsort((res.max(axis=1), res[:, 0] * res[:, 1]))  # by area, then by the long side
    largest, median = res[order[-1]], res[order[len(order) // 2]]
    return {"largest": (int(largest[0]), int(largest[1])), "median": (int(median[0]), int(median[1])),
            "square": (resolution, resolution)}


def model_folder(spec: dict[str, Any], root: Path) -> Path:
    """A folder the family detector recognises (``model_index.json``), for the script's argument parser."""
    folder = root / spec["name"]
    (folder / "transformer").mkdir(parents=True, exist_ok=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": spec["pipeline_class"]}))
    if spec["model_class"] != "UNet2DConditionModel":
        (folder / "transformer" / "config.json").write_text(json.dumps({"_class_name": spec["model_class"]}))
    return folder


# ---------------------------------------------------------------------------------------------------- models


class StepBench:
    """One full-size denoiser with a rank-16 LoRA, gradient checkpointing and AdamW, behind accelerate.

    ``step(impl, shape, batch)`` runs one training step on cached-latent-like inputs (the VAE posterior's mean and
    std, random prompt embeddings of the family's shapes) through ``"hf_arb"`` (the family adapter's
    ``training_loss``, as the training loop calls it) or ``"diffusers"`` (the step of diffusers' training scripts,
    written out: noise, timesteps, the denoiser call, the MSE).
    """

    def __init__(self, spec: dict[str, Any], accelerator: Any, tmp: Path, tiny: bool) -> None:
        import diffusers
        import torch
        from diffusers.configuration_utils import FrozenDict

        from hf_arb.families import Models, get_family
        from hf_arb.train.environment import cuda_settings
        from hf_arb.train.flags.args import parse_args
        from hf_arb.train.lora import add_lora

        self.spec, self.accelerator = spec, accelerator
        self.device = accelerator.device
        self.dtype = torch.bfloat16 if accelerator.mixed_precision == "bf16" else torch.float32
        self.args = parse_args(["--pretrained_model_name_or_path", str(model_folder(spec, tmp)), "--train_data_dir",
                                str(tmp), "--rank", "16", "--gradient_checkpointing", "--report_to", "none"])
        cuda_settings(self.args, accelerator)  # the script's CUDA defaults (cuDNN attention off)
        self.family = get_family(spec["family"])
        model = build_model(spec, str(self.device), self.dtype)
        self.parameters = sum(p.numel() for p in model.parameters())
        sched_cfg = dict(spec["scheduler"])
        scheduler = getattr(diffusers, sched_cfg.pop("_class_name"))
        if spec["model_class"] == "UNet2DConditionModel":
            scheduler = diffusers.DDPMScheduler  # the training scheduler of diffusers' UNet scripts
        self.scheduler = scheduler.from_config(sched_cfg)
        options = None
        if self.family.objective == "flow":
            options = self.family.options(self.scheduler.config, model)
        self.vae = type("VaeConfig", (), {"config": FrozenDict(spec["vae"])})()
        self.models = Models(self.family, self.scheduler, [], [], self.vae, model, options=options)
        self.params = add_lora(model, rank=16, target_modules=self.family.lora_targets(self.args), dtype=self.dtype)
        model.enable_gradient_checkpointing()
        model.train()
        optimizer = torch.optim.AdamW(self.params, lr=1e-5)
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        self.family.prepare_denoiser(self.args, self.models, accelerator.unwrap_model(self.model))
        self.tokens, self.dim, self.pooled = text_dims(spec)
        self.latent_channels = spec["vae"]["latent_channels"]

    def batch(self, shape: tuple[int, int], size: int) -> dict[str, Any]:
        import torch

        w, h = shape
        g = torch.Generator().manual_seed(0)
        stats = torch.stack([torch.randn(size, self.latent_channels, h // 8, w // 8, generator=g),
                             torch.rand(size, self.latent_channels, h // 8, w // 8, generator=g) * 0.1], dim=1)
        sizes = torch.tensor([[h, w]] * size)
        return {"latent_stats": stats.to(self.device), "captions": ["a photo"] * size, "rows": list(range(size)),
                "original_sizes": sizes, "crop_top_lefts": torch.zeros_like(sizes), "target_sizes": sizes}

    def text(self, captions: list[str]) -> tuple[Any, Any]:
        import torch

        g = torch.Generator().manual_seed(1)
        n = len(captions)
        hidden = torch.randn(n, self.tokens, self.dim, generator=g).to(self.device, self.dtype)
        if self.spec["text"].get("mask"):
            return hidden, torch.ones(n, self.tokens, device=self.device)
        pooled = None if self.pooled is None else torch.randn(n, self.pooled, generator=g).to(self.device, self.dtype)
        return hidden, pooled

    def loss(self, impl: str, batch: dict[str, Any], generator: Any) -> Any:
        if impl == "hf_arb":
            return self.family.training_loss(self.args, self.models, self.model, batch, self.text, generator,
                                             self.dtype)
        return diffusers_step(self, batch, generator)

    def step(self, impl: str, shape: tuple[int, int], size: int, repeats: int) -> dict[str, Any]:
        """``repeats`` timed steps after one warm-up: seconds per step, peak memory, the last loss."""
        import torch

        from hf_arb.train.schedule import micro_step_generator

        cuda = self.device.type == "cuda"
        batch = self.batch(shape, size)
        times, loss = [], None
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        for i in range(repeats + 1):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = self.loss(impl, batch, micro_step_generator(0, i, 0))
            self.accelerator.backward(loss)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
        value = float(loss.detach().float())
        return {"impl": impl, "shape": list(shape), "batch": size, "step_s": sum(times) / len(times),
                "images_per_s": size * len(times) / sum(times), "loss": value, "finite": value == value,
                "peak_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None}


def pack2x2(x: Any) -> Any:
    """``(B, C, h, w)`` → ``(B, h/2 * w/2, 4C)``: the 2×2 patch tokens of Flux and Qwen-Image."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack2x2(x: Any, h: int, w: int) -> Any:
    b, _, d = x.shape
    c = d // 4
    return x.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


def diffusers_step(bench: StepBench, batch: dict[str, Any], generator: Any) -> Any:
    """The loss of diffusers' training scripts for the same inputs, written out as they write it
    (train_text_to_image_lora(_sdxl).py for UNets; train_dreambooth_lora_flux.py / _qwen_image.py for transformers:
    uniform ``u`` on the scheduler's timestep grid, no resolution shift, the plain MSE against ``noise - x``)."""
    import torch
    import torch.nn.functional as F

    device, dtype, cfg = bench.device, bench.dtype, bench.vae.config
    stats = batch["latent_stats"].float()
    sample = stats[:, 0] + stats[:, 1] * torch.randn(stats[:, 0].shape, generator=generator).to(device)
    b, _, h, w = sample.shape
    hidden, pooled = bench.text(batch["captions"])
    if bench.spec["model_class"] == "UNet2DConditionModel":
        latents = sample * cfg["scaling_factor"]
        noise = torch.randn(latents.shape, generator=generator).to(device)
        timesteps = torch.randint(0, 1000, (b,), generator=generator).to(device)
        noisy = bench.scheduler.add_noise(latents, noise, timesteps)
        added = None
        if pooled is not None:
            time_ids = torch.tensor([[h * 8, w * 8, 0, 0, h * 8, w * 8]] * b, device=device, dtype=dtype)
            added = {"text_embeds": pooled, "time_ids": time_ids}
        pred = bench.model(noisy.to(dtype), timesteps, hidden, added_cond_kwargs=added).sample
        return F.mse_loss(pred.float(), noise.float())
    if "latents_mean" in cfg:  # Qwen-Image: per-channel normalised latents
        mean = torch.tensor(cfg["latents_mean"], device=device).view(1, -1, 1, 1)
        std = torch.tensor(cfg["latents_std"], device=device).view(1, -1, 1, 1)
        x = (sample - mean) / std
    else:
        x = (sample - cfg.get("shift_factor", 0.0)) * cfg["scaling_factor"]
    noise = torch.randn(x.shape, generator=generator).to(device)
    u = torch.rand(b, generator=generator)
    indices = (u * bench.scheduler.config.num_train_timesteps).long()
    sigmas = bench.scheduler.sigmas[indices].to(device).view(-1, 1, 1, 1)
    timesteps = bench.scheduler.timesteps[indices].to(device)
    noisy = (1.0 - sigmas) * x + sigmas * noise
    if "latents_mean" in cfg:
        out = bench.model(hidden_states=pack2x2(noisy).to(dtype), encoder_hidden_states=hidden,
                          timestep=(timesteps / 1000).to(dtype), img_shapes=[[(1, h // 2, w // 2)]] * b,
                          return_dict=False)[0]
    else:
        ids = torch.zeros(h // 2, w // 2, 3, device=device)
        ids[..., 1] += torch.arange(h // 2, device=device)[:, None]
        ids[..., 2] += torch.arange(w // 2, device=device)[None, :]
        guidance = torch.full((b,), 3.5, device=device) if bench.spec["config"].get("guidance_embeds") else None
        out = bench.model(hidden_states=pack2x2(noisy).to(dtype), timestep=timesteps / 1000, guidance=guidance,
                          pooled_projections=pooled, encoder_hidden_states=hidden,
                          txt_ids=torch.zeros(hidden.shape[1], 3, device=device),
                          img_ids=ids.reshape(-1, 3), return_dict=False)[0]
    pred = unpack2x2(out, h, w)
    return torch.mean((pred.float() - (noise - x).float()) ** 2)


def batch_table(peak1: float, peak2: float) -> dict[str, int]:
    """The largest batch that fits each card, from the peaks at batch 1 and 2 (linear in the batch; 10% headroom
    for the allocator's fragmentation): ``{"24": n, ...}`` (0: not even batch 1)."""
    per = max(peak2 - peak1, 1e-6)
    return {str(card): max(0, int((0.9 * card - peak1) // per) + 1) if 0.9 * card >= peak1 else 0
            for card in CARDS_GIB}


#: retries of a model whose process died with a CUDA error: the environment each retry adds, and why
RETRIES = (({}, "as is"), ({"HF_ARB_BENCH_SDPA": "no_cudnn"}, "cuDNN attention off"),
           ({"HF_ARB_BENCH_SDPA": "math"}, "math attention only"),
           ({"CUDA_LAUNCH_BLOCKING": "1"}, "as is, CUDA_LAUNCH_BLOCKING=1 (where the fault is; timings not usable)"))


def run_models_isolated(opts: argparse.Namespace, deadline: float, tmp: Path) -> dict[str, Any]:
    """:func:`run_models` for each model in its own process: a CUDA fault (an illegal memory access poisons the
    process's context) costs that model, not the rest of the run. A model whose process fails with a CUDA error is
    retried with cuDNN attention off, then with the math attention kernel alone; every attempt is recorded. With
    ``--device cpu`` (no CUDA context to poison) the models share one process, which pays the imports once."""
    out: dict[str, Any] = {}
    wanted = [s for s in load_specs(opts.tiny) if not opts.models or s["name"] in opts.models.split(",")]
    groups = [[spec] for spec in wanted] if opts.device == "cuda" else [wanted] if wanted else []
    for group in groups:
        names = ",".join(spec["name"] for spec in group)
        attempts: list[dict[str, Any]] = []
        entries: dict[str, Any] = {}
        for extra_env, why in RETRIES:
            left = deadline - time.monotonic()
            if left <= 0:
                attempts.append({"attempt": why, "skipped": "out of time (--budget_s)"})
                break
            part = tmp / f"model-{names.replace(',', '+')}-{len(attempts)}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--sections", "models", "--models", names,
                   "--device", opts.device, "--budget_s", str(left), "--out", str(part), "--worker"]
            proc = subprocess.run([*cmd, *(["--tiny"] if opts.tiny else [])], capture_output=True, text=True,
                                  env={**os.environ, **extra_env}, cwd=ROOT)
            got = json.loads(part.read_text()).get("models", {}) if part.exists() else {}
            entries = {spec["name"]: got.get(spec["name"]) for spec in group}
            bad = [e for e in entries.values() if e is None or "error" in e or any(
                "error" in s for s in e.get("steps", []) if "OOM" not in s.get("error", "OOM"))]
            failed = proc.returncode != 0 or bool(bad)
            entry = bad[0] if bad else None
            attempts.append({"attempt": why, "returncode": proc.returncode, "ok": not failed,
                             **({"error": (entry or {}).get("error"), "traceback": (entry or {}).get("traceback"),
                                 "log_tail": (proc.stdout + proc.stderr)[-1500:]} if failed else {})})
            if not failed or "CUDA" not in proc.stdout + proc.stderr + json.dumps(entries):
                break
        for spec in group:
            entry = entries.get(spec["name"])
            out[spec["name"]] = {**(entry or {"title": spec["title"],
                                              "error": "the model's process failed: see attempts"}),
                                 "attempts": attempts}
    return out


def run_models(opts: argparse.Namespace, deadline: float, tmp: Path) -> dict[str, Any]:
    import torch
    from accelerate import Accelerator

    sdpa = os.environ.get("HF_ARB_BENCH_SDPA")  # a retry of run_models_isolated
    if sdpa in ("no_cudnn", "math"):
        torch.backends.cuda.enable_cudnn_sdp(False)
    if sdpa == "math":
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
    out: dict[str, Any] = {}
    accelerator = Accelerator(mixed_precision="bf16" if opts.device == "cuda" else "no",
                              cpu=opts.device == "cpu")
    repeats = 1 if opts.tiny else 2
    for spec in load_specs(opts.tiny):
        if opts.models and spec["name"] not in opts.models.split(","):
            continue
        entry: dict[str, Any] = {"title": spec["title"], "source": spec["source"],
                                 "published_parameters": spec["published_parameters"]}
        out[spec["name"]] = entry
        if time.monotonic() > deadline:
            entry["skipped"] = "out of time (--budget_s)"
            continue
        bench = None
        try:
            t0 = time.perf_counter()
            bench = StepBench(spec, accelerator, tmp, opts.tiny)
            shapes = preset_shapes(spec, opts.tiny)
            entry.update(parameters=bench.parameters, build_s=time.perf_counter() - t0,
                         lora_parameters=sum(p.numel() for p in bench.params),
                         shapes={k: list(v) for k, v in shapes.items()}, steps=[])
            plan = [("hf_arb", "largest", 1), ("hf_arb", "median", 1), ("hf_arb", "square", 1),
                    ("diffusers", "square", 1), ("hf_arb", "largest", 2)]
            for impl, name, size in plan:
                if time.monotonic() > deadline:
                    entry["steps"].append({"impl": impl, "bucket": name, "batch": size, "skipped": "out of time"})
                    continue
                try:
                    entry["steps"].append({"bucket": name, **bench.step(impl, shapes[name], size, repeats)})
                except torch.OutOfMemoryError as e:
                    entry["steps"].append({"impl": impl, "bucket": name, "batch": size, "error": f"OOM: {e}"[:300]})
                    torch.cuda.empty_cache()
            peaks = {(s["bucket"], s["batch"]): s.get("peak_gib") for s in entry["steps"] if s.get("impl") == "hf_arb"}
            if peaks.get(("largest", 1)) and peaks.get(("largest", 2)):
                entry["max_batch_per_card_gib"] = batch_table(peaks[("largest", 1)], peaks[("largest", 2)])
        except Exception as e:  # noqa: BLE001 - recorded, the next model still runs
            import traceback

            entry["error"] = f"{type(e).__name__}: {e}"[:500]
            entry["traceback"] = traceback.format_exc()[-2500:]
        finally:
            del bench
            with contextlib.suppress(Exception):  # after a CUDA fault these raise too: the entry holds the error
                accelerator.free_memory()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------------------- loader


def write_jpegs(folder: Path, n: int, tiny: bool) -> int:
    """``n`` real photos (scikit-image's) as JPEGs of 1–4 MP at several aspects, with ``metadata.jsonl``."""
    import numpy as np
    import skimage
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    data = Path(skimage.__file__).parent / "data"
    photos = [Image.open(p).convert("RGB") for p in sorted(data.glob("*.png")) + sorted(data.glob("*.jpg"))
              if p.stat().st_size > 50_000][:8]
    aspects = (1.0, 0.75, 1.333, 0.5625, 1.778, 0.667, 1.5)
    areas = np.random.default_rng(0).uniform(1.0, 4.0, n) * 2 ** 20

    def write(i: int) -> str:
        area = (96 * 96) if tiny else float(areas[i])
        a = aspects[i % len(aspects)]
        w, h = int((area * a) ** 0.5), int((area / a) ** 0.5)
        photos[i % len(photos)].resize((w, h), Image.BICUBIC).save(folder / f"{i:04d}.jpg", quality=92)
        return json.dumps({"file_name": f"{i:04d}.jpg", "text": f"photo {i}"})

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # Pillow releases the GIL while it resizes and encodes
        lines = list(pool.map(write, range(n)))
    (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return n


def run_loader(opts: argparse.Namespace, tmp: Path, gpu_rates: dict[str, float]) -> dict[str, Any]:
    """Images per second through hf_arb's loader (decode + fit, and cached latents) with the machine's workers."""
    import datasets
    import numpy as np
    import torch

    from hf_arb import BucketBatchSampler, BucketedImageDataset, BucketSet, add_bucket_columns
    from hf_arb.train.cache.latent_dataset import CachedLatentDataset
    from hf_arb.train.cache.latents import CacheIndex, LatentCache

    n = 16 if opts.tiny else 96
    resolution = 64 if opts.tiny else 1024
    folder = tmp / "jpegs"
    write_jpegs(folder, n, opts.tiny)
    ds = datasets.load_dataset("imagefolder", data_dir=str(folder), split="train")
    buckets = BucketSet.preset("budget", resolution, step=16 if opts.tiny else 64)
    ds = add_bucket_columns(ds, buckets)
    workers = 2 if opts.tiny else min(8, os.cpu_count() or 1)
    batch = 4
    out: dict[str, Any] = {"images": n, "resolution": resolution, "workers": workers, "batch": batch,
                           "cpus": os.cpu_count()}

    def measure(dataset: Any, collate: Any) -> dict[str, float]:
        sampler = BucketBatchSampler(ds, batch, seed=0, return_keys=True, drop_last=False)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate,
                                             num_workers=workers, pin_memory=opts.device == "cuda",
                                             persistent_workers=False)
        it = iter(loader)
        first = next(it)  # worker start-up, not throughput
        images, t0 = 0, time.perf_counter()
        for b in it:
            images += len(b["captions"])
        seconds = time.perf_counter() - t0
        del first
        return {"images_per_s": images / seconds if seconds else float("nan"), "images": images}

    data = BucketedImageDataset(ds, buckets, image_column="image", caption_column="text", seed=0)
    out["decode_fit"] = measure(data, data.collate)
    cache = LatentCache(tmp / "cache")
    keys: dict[tuple[int, int], list[str]] = {}
    rng = np.random.default_rng(0)
    for row, bucket in enumerate(ds["bucket"]):
        w, h = buckets[int(bucket)]
        key = f"{row:032x}"
        stats = rng.standard_normal((2, 16, h // 8, w // 8)).astype(np.float32)
        cache.write(key, stats, {"original_size": [h, w], "crop_top_left": [0, 0], "target_size": [h, w]})
        keys[(row, int(bucket))] = [key]
    cached = CachedLatentDataset(cache, CacheIndex(keys=keys, variants=1), ds["text"], seed=0)
    out["cached_latents"] = measure(cached, CachedLatentDataset.collate)
    out["gpu_wait_share"] = {}
    for model, rate in gpu_rates.items():  # the GPU's images/s at the square bucket, batch 1
        out["gpu_wait_share"][model] = {
            kind: max(0.0, 1.0 - out[kind]["images_per_s"] / rate) for kind in ("decode_fit", "cached_latents")}
        out["gpu_wait_share"][model]["gpu_images_per_s"] = rate
    return out


# ---------------------------------------------------------------------------------------------------- smoke


#: each family's tiny pipeline builder in :mod:`hf_arb.testing` (``module.function``, keyword arguments);
#: tests/test_bench_gpu.py checks that it covers every family
TINY_BUILDERS: dict[str, tuple[str, dict[str, Any]]] = {
    "sd": ("tiny.save_tiny_sd", {}), "sdxl": ("tiny.save_tiny_sdxl", {}),
    "sd3": ("tiny_flow.save_tiny_sd3", {}), "flux": ("tiny_flow.save_tiny_flux", {}),
    "flux-kontext": ("tiny_flow.save_tiny_flux_kontext", {}), "flux2": ("tiny_flux2.save_tiny_flux2", {}),
    "flux2_klein": ("tiny_flux2.save_tiny_flux2", {"klein": True}),
    "qwenimage": ("tiny_qwen.save_tiny_qwenimage", {}),
    "qwenimage-edit": ("tiny_qwen.save_tiny_qwenimage_edit", {}),
    "qwenimage-edit-plus": ("tiny_qwen.save_tiny_qwenimage_edit", {"plus": True}),
    "zimage": ("tiny_zimage.save_tiny_zimage", {}), "wan": ("tiny_wan.save_tiny_wan", {}),
    "ltx": ("tiny_ltx.save_tiny_ltx", {}),
    "hunyuan_video15": ("tiny_hunyuan_video.save_tiny_hunyuan_video", {}),
}


def tiny_models(root: Path, families: list[str]) -> dict[str, str]:
    """Every wanted family's tiny pipeline, built offline."""
    import importlib

    out = {}
    for name in families:
        path, kwargs = TINY_BUILDERS[name]
        module, fn = path.split(".")
        out[name] = getattr(importlib.import_module(f"hf_arb.testing.{module}"), fn)(root / name, **kwargs)
    return out


def edit_pairs(images: str, root: Path) -> str:
    """A before/after dataset from the tiny image folder (the reference is the target mirrored in grey)."""
    import datasets
    from PIL import ImageOps

    ds = datasets.load_dataset("imagefolder", data_dir=images, split="train")
    rows = {"image": [], "before": [], "text": []}
    for row in ds:
        rows["image"].append(row["image"])
        rows["before"].append(ImageOps.mirror(ImageOps.grayscale(row["image"]).convert("RGB")))
        rows["text"].append(row["text"])
    out = root / "pairs"
    datasets.Dataset.from_dict(rows, features=datasets.Features(
        image=datasets.Image(), before=datasets.Image(), text=datasets.Value("string"))).save_to_disk(str(out))
    return str(out)


def clip_folder(images: str, root: Path) -> str:
    """A mixed folder of clips and stills (:func:`hf_arb.testing.clips.save_mixed_clip_folder`) panning across the
    tiny image folder's largest photo crop, enlarged to 160x120."""
    import numpy as np
    from PIL import Image

    from hf_arb.testing.clips import save_mixed_clip_folder

    pictures = [Image.open(p).convert("RGB") for p in sorted(Path(images).glob("*.png"))]
    source = max(pictures, key=lambda im: im.width * im.height).resize((160, 120), Image.Resampling.BICUBIC)
    return save_mixed_clip_folder(root / "clips", np.asarray(source))


def video_flags(family: Any) -> list[str]:
    """A video family's clip flags: (W, H, F) buckets at sides of 32 (every video family's spatial multiple divides
    it), stills and the clips' frame counts under the family's frame rule (``1, step + 1, 2 step + 1`` up to 9)."""
    step = family.frame_rule().step
    frames = sorted({f for f in (1, step + 1, 2 * step + 1) if f <= 9})
    return ["--video_column", "video", "--bucket_preset", "budget", "--resolution", "80", "--bucket_step", "32",
            "--frames", ",".join(map(str, frames)), "--instance_prompt", "a slow pan"]


def smoke_argv(family: str, model: str, images: str, pairs: str, clips: str | None = None) -> list[str]:
    """A 3-step LoRA run of one family (checkpoint at 2), the tests' tiny settings; a video family trains on
    ``clips`` (:func:`clip_folder`)."""
    from hf_arb.families import get_family
    from hf_arb.families.video_family import VideoFamily

    tokens = "48" if family.startswith("flux2") else "16"
    argv = ["--pretrained_model_name_or_path", model, "--resolution", "64", "--bucket_step", "16",
            "--train_batch_size", "2", "--report_to", "none", "--seed", "0", "--lr_warmup_steps", "0",
            "--rank", "4", "--learning_rate", "1e-2", "--max_train_steps", "3", "--checkpointing_steps", "2",
            "--gradient_checkpointing", "--allow_tf32", "--cache_latents", "--dataloader_num_workers", "2"]
    if get_family(family).objective == "flow":
        argv += ["--max_sequence_length", tokens]
    if isinstance(get_family(family), VideoFamily):  # clips and stills in (W, H, F) buckets
        resolution = argv.index("--resolution")
        argv = argv[:resolution] + argv[resolution + 4:]  # video_flags' own resolution and step
        return [*argv, "--train_data_dir", clips or "", *video_flags(get_family(family))]
    if get_family(family).image_argument:  # an edit model: before/after pairs
        return [*argv, "--dataset_name", pairs, "--reference_image_column", "before", "--bucket_leftover", "fill"]
    return [*argv, "--train_data_dir", images]


def launch(argv: list[str], out: Path, device: str, log: Path) -> dict[str, Any]:
    """One run of the script in its own process; its statistics (``hf_arb_run.json``) or the log's tail."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "2"}
    if device == "cpu":
        env.update(ACCELERATE_USE_CPU="1", CUDA_VISIBLE_DEVICES="")
    t0 = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.run([sys.executable, str(SCRIPT), *argv, "--output_dir", str(out)], stdout=fh,
                              stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=600)
    stats_file = out / "hf_arb_run.json"
    if proc.returncode or not stats_file.exists():
        return {"error": f"exit {proc.returncode}: " + log.read_text()[-1500:], "seconds": time.perf_counter() - t0}
    stats = json.loads(stats_file.read_text())
    return {"losses": stats.get("losses", []), "mixed_precision": stats.get("mixed_precision"),
            "seconds": time.perf_counter() - t0}


def lora_weights(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(folder / "pytorch_lora_weights.safetensors"))


def compare(run: dict[str, Any], ref: dict[str, Any], tol: float, a: Path | None, b: Path | None) -> dict[str, Any]:
    """Every loss finite, each step's loss within ``tol`` (relative to max(1, |ref|)) of the reference, the LoRA
    weights finite; their relative L2 distance (``||a - b|| / ||b||``) is reported, and held under ``tol`` only for
    the float32 case: Adam's first steps move each weight by about ``lr * sign(grad)``, so half-precision rounding
    flips the sign of the smallest gradients and the weights part by more than the losses do."""
    if "error" in run or "error" in ref:
        return {"ok": False, "error": run.get("error") or "reference: " + ref.get("error", "")}
    losses, expected = run["losses"], ref["losses"]
    finite = all(x == x and abs(x) != float("inf") for x in losses)
    diffs = [abs(x - y) / max(1.0, abs(y)) for x, y in zip(losses, expected)]
    res: dict[str, Any] = {"losses": losses, "reference": expected, "finite": finite,
                           "max_loss_diff": max(diffs) if diffs else None, "tolerance": tol}
    ok = finite and len(losses) == len(expected) and bool(diffs) and max(diffs) <= tol
    if a is not None and b is not None:
        import torch

        wa, wb = lora_weights(a), lora_weights(b)
        num = sum(float((wa[k].float() - wb[k].float()).norm() ** 2) for k in wb)
        den = sum(float(wb[k].float().norm() ** 2) for k in wb)
        res["lora_rel_diff"] = (num / max(den, 1e-30)) ** 0.5
        res["lora_finite"] = all(bool(torch.isfinite(t).all()) for t in wa.values())
        ok = ok and wa.keys() == wb.keys() and res["lora_finite"] and (tol > TOLERANCE["fp32"]
                                                                       or res["lora_rel_diff"] <= tol)
    res["ok"] = ok
    return res


def quant_cases(base: list[str], tmp: Path) -> list[tuple[str, list[str]]]:
    """Upstream's quantized training where its library is installed: FP8 (torchao; a GPU of compute capability
    8.9+) and NF4 QLoRA (bitsandbytes)."""
    import importlib.util

    import torch

    cases = []
    if importlib.util.find_spec("torchao") and torch.cuda.get_device_capability() >= (8, 9):
        cases.append(("fp8", [*base, "--do_fp8_training"]))
    if importlib.util.find_spec("bitsandbytes"):
        nf4 = tmp / "nf4.json"
        nf4.write_text('{"load_in_4bit": true, "bnb_4bit_quant_type": "nf4"}')
        cases.append(("qlora", [*base, "--bnb_quantization_config_path", str(nf4)]))
    return cases


def without_quant_flags(argv: list[str]) -> list[str]:
    """``argv`` without :data:`QUANT_FLAGS` (and their values)."""
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
        elif a in QUANT_FLAGS:
            skip = QUANT_FLAGS[a]
        else:
            out.append(a)
    return out


def run_smoke(opts: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The smoke cases of every family (see the module docstring), ``opts.jobs`` runs at a time."""
    from hf_arb.families import family_names, get_family
    from hf_arb.families.video_family import VideoFamily
    from hf_arb.testing.tiny import save_tiny_imagefolder

    families = opts.families.split(",") if opts.families else list(reversed(family_names()))
    models = tiny_models(tmp / "tiny", families)
    images = save_tiny_imagefolder(tmp / "images")
    pairs = edit_pairs(images, tmp)
    clips = clip_folder(images, tmp) if any(isinstance(get_family(f), VideoFamily) for f in families) else None
    device = opts.device
    cases: list[dict[str, Any]] = []
    for family in families:
        base = smoke_argv(family, models[family], images, pairs, clips)
        mixed = [("bf16", base)] if device == "cuda" else [("fp32", base)]  # (CPU bf16 autocast: minutes)
        if device == "cuda":
            mixed.append(("fp16", base))
            if family == "sd":
                mixed.append(("8bit", [*base, "--use_8bit_adam"]))
        if family == "flux" and device == "cuda":
            pack = [a for a in base if a != "--cache_latents"] + ["--packing", "--max_tokens", "40"]
            mixed.append(("pack", pack))
        if family == "flux-kontext" and device == "cuda":  # the default (cuDNN attention off) against it on
            mixed.append(("bf16_cudnn", [*base, "--cudnn_attention"]))
        if family == "flux2_klein" and device == "cuda":
            mixed += quant_cases(base, tmp)
        for kind, argv in mixed:
            cases.append({"family": family, "case": kind, "argv": argv})
    logs = tmp / "logs"
    logs.mkdir()
    runs = tmp / "runs"

    def job(name: str, argv: list[str], dev: str) -> dict[str, Any]:
        return launch(argv, runs / name, dev, logs / f"{name}.log")

    jobs: dict[str, tuple[list[str], str]] = {}
    same: dict[str, str] = {}  # case -> its reference, where both are one command on one device (the CPU's fp32)
    for case in cases:  # the CPU float32 reference of each distinct command, once
        name = f"{case['family']}-{case['case']}"
        ref_argv = without_quant_flags([a for a in case["argv"] if a not in ("--use_8bit_adam", "--cudnn_attention")])
        case["ref"] = f"{case['family']}-{'pack' if case['case'] == 'pack' else 'ref'}-cpu"
        jobs[case["ref"]] = ([*ref_argv, "--mixed_precision", "no"], "cpu")
        precision = {"fp16": "fp16", "fp32": "no"}.get(case["case"], "bf16")
        jobs[name] = ([*case["argv"], "--mixed_precision", precision], device)
        if jobs[name] == jobs[case["ref"]]:  # a second run of the same command would only repeat it
            same[name] = case["ref"]
    folder = {name: runs / same.get(name, name) for name in jobs}
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, opts.jobs)) as pool:
        futures = {name: pool.submit(job, name, argv, dev) for name, (argv, dev) in jobs.items() if name not in same}
        done = {name: futures[same.get(name, name)].result() for name in jobs}
        resumes = {}
        for case in cases:  # resume from the bf16 run's checkpoint-2: step 3 again, exactly
            name = f"{case['family']}-{case['case']}"
            if case["case"] in ("bf16", "fp32") and "error" not in done[name]:
                shutil.copytree(folder[name] / "checkpoint-2", runs / f"{name}-resumed" / "checkpoint-2")
                argv = [*jobs[name][0], "--resume_from_checkpoint", "latest"]
                resumes[name] = pool.submit(job, f"{name}-resumed", argv, device)
        resumed = {name: f.result() for name, f in resumes.items()}
    flat = []
    for case in cases:
        name = f"{case['family']}-{case['case']}"
        run, ref = done[name], done[case["ref"]]
        flat.append({"family": case["family"], "case": case["case"], "device": device,
                     "seconds": run.get("seconds", 0), **({"same_as": same[name]} if name in same else {}),
                     **compare(run, ref, TOLERANCE[case["case"]], None if "error" in run else folder[name],
                               None if "error" in ref else folder[case["ref"]])})
        if name not in resumed:
            continue
        again, res = resumed[name], {"family": case["family"], "case": "resume", "device": device}
        if "error" in again:
            res.update(ok=False, error=again["error"])
        else:
            tail, full = again["losses"], run["losses"][2:]
            diff = max((abs(x - y) for x, y in zip(tail, full)), default=float("inf"))
            wa, wb = lora_weights(runs / f"{name}-resumed"), lora_weights(folder[name])
            wdiff = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wb)
            # exact: the weights, optimizer, data and noise came back exactly, and the step's kernels are
            # deterministic (cuDNN attention's backward was not: a weight difference of ~lr on the H200)
            res.update(losses=tail, reference=full, max_loss_diff=diff, max_weight_diff=wdiff,
                       ok=len(tail) == len(full) == 1 and diff <= 1e-6 and wdiff <= 1e-6)
        flat.append(res)
    for r in flat:  # cuDNN attention on: the evidence for its default (off), not a gate
        r["diagnostic"] = r["case"].endswith("_cudnn")
    return {"families": families, "cases": flat,
            "passed": sum(1 for r in flat if r.get("ok") and not r["diagnostic"]),
            "failed": [f"{r['family']}/{r['case']}" for r in flat if not r.get("ok") and not r["diagnostic"]],
            "diagnostic": [f"{r['family']}/{r['case']}: {'passed' if r.get('ok') else 'failed'}" for r in flat
                           if r["diagnostic"]],
            "seconds": time.perf_counter() - t0,
            "skipped": [] if device == "cuda" else ["bf16 (on the CPU: fp32 against fp32, the code path only)",
                                                   "fp16 (accelerate's GradScaler needs a GPU)",
                                                   "8bit (bitsandbytes needs CUDA)", "pack (GPU-only case)",
                                                   "fp8, qlora (Flux.2 klein's quantized cases: GPU-only)"]}


# ---------------------------------------------------------------------------------------------------- report


def environment() -> dict[str, Any]:
    import importlib.metadata as md

    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine(),
                           "cpus": os.cpu_count(), "torch": torch.__version__}
    for pkg in ("diffusers", "transformers", "accelerate", "peft", "datasets", "bitsandbytes"):
        with contextlib.suppress(md.PackageNotFoundError):
            env[pkg] = md.version(pkg)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_gib=props.total_memory / GIB, cuda=torch.version.cuda,
                   sdpa={"flash": torch.backends.cuda.flash_sdp_enabled(),
                         "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                         "cudnn": torch.backends.cuda.cudnn_sdp_enabled()})
    return env


def markdown(result: dict[str, Any]) -> str:
    """The docs table of a result file: per model, step time and peak memory per bucket, and the batch table."""
    env = result["environment"]
    where = (f"{env['gpu']} ({env.get('gpu_memory_gib', 0):.0f} GiB)" if "gpu" in env
             else f"the CPU ({env.get('cpus')} cores)")
    lines = [f"Measured on {where}, torch {env['torch']}, diffusers {env.get('diffusers')}, "
             f"{result['seconds']:.0f} s in all. LoRA rank 16, " + ("bf16, " if result["device"] == "cuda" else "")
             + "gradient checkpointing, batch 1 unless stated; random weights from the "
             + ("tiny configs (the code paths, not the figures)." if result.get("tiny") else "published configs."), "",
             "| model | parameters | step | bucket (w×h) | batch | s/step | images/s | peak GiB |",
             "|---|---:|---|---|---:|---:|---:|---:|"]
    models = result.get("models", {})
    models = models if "error" not in models else {"all": {"title": "all models", "error": models["error"]}}
    for name, entry in models.items():
        if "steps" not in entry:
            lines.append(f"| {entry['title']} | | {entry.get('error') or entry.get('skipped')} | | | | | |")
            continue
        for s in entry["steps"]:
            if "step_s" not in s:
                lines.append(f"| {entry['title']} | | {s['impl']} | {s['bucket']} | {s['batch']} | "
                             f"{s.get('error') or s.get('skipped')} | | |")
                continue
            w, h = s["shape"]
            lines.append(f"| {entry['title']} | {entry['parameters'] / 1e9:.2f} B | {s['impl']} | {s['bucket']} "
                         f"{w}×{h} | {s['batch']} | {s['step_s']:.3f} | {s['images_per_s']:.2f} | "
                         f"{s['peak_gib'] or 0:.1f} |")
    lines += ["", "Largest `--train_batch_size` at the preset's largest bucket (LoRA rank 16, bf16, checkpointing; "
              "linear in the batch from batch 1 and 2, 10% headroom):", "",
              "| model | " + " | ".join(f"{c} GiB" for c in CARDS_GIB) + " |",
              "|---|" + "---:|" * len(CARDS_GIB)]
    for entry in models.values():
        table = entry.get("max_batch_per_card_gib")
        if table:
            lines.append(f"| {entry['title']} | " + " | ".join(str(table[str(c)]) for c in CARDS_GIB) + " |")
    loader = result.get("loader")
    if loader and "decode_fit" in loader:
        lines += ["", f"Loader at {loader['resolution']}² on {loader['cpus']} CPUs ({loader['workers']} workers, "
                      f"batch {loader['batch']}): decode + fit {loader['decode_fit']['images_per_s']:.1f} images/s, "
                      f"cached latents {loader['cached_latents']['images_per_s']:.1f} images/s.", "",
                  "| model | GPU images/s | GPU waits (decode + fit) | GPU waits (cached) |", "|---|---:|---:|---:|"]
        for model, w in loader["gpu_wait_share"].items():
            lines.append(f"| {model} | {w['gpu_images_per_s']:.2f} | {100 * w['decode_fit']:.0f}% | "
                         f"{100 * w['cached_latents']:.0f}% |")
    if result.get("notes"):
        lines += ["", "Findings:", "", *(f"- {n}" for n in result["notes"])]
    if result.get("runs"):
        lines += ["", "Runs: " + "; ".join(f"{r['run']}: commit {r['commit']}, {r['sections']}, {r['seconds']:.0f} s "
                                          f"(`{r['command']}`)" for r in result["runs"]) + "."]
    retried = [f"{e['title']} ran with {e['attempts'][-1]['attempt']} after: {e['attempts'][0].get('error')}"
               for e in models.values() if len(e.get("attempts", [])) > 1]
    if retried:
        lines += ["", *(f"- {r}" for r in retried)]
    smoke = result.get("smoke")
    if smoke and "cases" in smoke:
        gated = [c for c in smoke["cases"] if not c.get("diagnostic")]
        lines += ["", f"Smoke run on {result['device']}: {smoke['passed']} of {len(gated)} cases passed"
                      + (f"; failed: {', '.join(smoke['failed'])}" if smoke["failed"] else "") + ". Each case: "
                      "the largest loss difference from the CPU float32 run (relative), the LoRA weights' relative "
                      "distance; resume: the resumed step's loss and final weights against the uninterrupted run.",
                  "", "| family | case | ok | loss diff | LoRA diff | run |", "|---|---|---|---:|---:|---|"]
        for c in smoke["cases"]:
            weights = c.get("lora_rel_diff", c.get("max_weight_diff"))
            ok = ("yes" if c.get("ok") else "NO") + (" (diagnostic, not counted)" if c.get("diagnostic") else "")
            lines.append(f"| {c['family']} | {c['case']} | {ok} | "
                         f"{_num(c.get('max_loss_diff'))} | {_num(weights)} | {c.get('run', '')} |")
    return "\n".join(lines)


def _num(x: Any) -> str:
    return "" if x is None else f"{x:.2g}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny configs and data (the code paths, not the figures)")
    p.add_argument("--out", default="", help="result file (default: benchmarks/results/gpu/<card>.json)")
    p.add_argument("--sections", default="smoke,loader,models", help="comma-separated: smoke, loader, models")
    p.add_argument("--models", default="", help="comma-separated model names (gpu_configs/*.json 'name')")
    p.add_argument("--families", default="", help="smoke: comma-separated family names (default: all)")
    p.add_argument("--jobs", type=int, default=8, help="smoke runs at a time")
    p.add_argument("--budget_s", type=float, default=240.0,
                   help="the models section starts no new measurement after this many seconds (the smoke run and the "
                        "loader take about 3 more minutes on an H100 machine)")
    p.add_argument("--markdown", metavar="RESULT_JSON", help="print the docs table of a result file and exit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one model's process (models section)
    opts = p.parse_args(argv)
    if opts.markdown:
        print(markdown(json.loads(Path(opts.markdown).read_text())))
        return 0
    import torch

    if opts.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; run it on a GPU machine, or with --device cpu --tiny.", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    deadline = t_start + opts.budget_s
    result: dict[str, Any] = {"tiny": opts.tiny, "device": opts.device, "environment": environment(),
                              "seconds": 0.0, "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    card = result["environment"].get("gpu", "cpu").replace("NVIDIA ", "")
    out = Path(opts.out or RESULTS / (("".join(c if c.isalnum() else "-" for c in card)).strip("-").lower() + ".json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    sections = opts.sections.split(",")

    def save() -> None:
        result["seconds"] = time.monotonic() - t_start
        out.write_text(json.dumps(result, indent=1, default=str))

    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as tmp_name:
        tmp = Path(tmp_name)
        for section in ("models", "smoke", "loader"):  # the loader compares with the models' rates
            if section not in sections:
                continue
            print(f"bench_gpu: {section} ({time.monotonic() - t_start:.0f} s in)", flush=True)
            try:
                if section == "smoke":
                    result["smoke"] = run_smoke(opts, tmp)
                elif section == "models":
                    run = run_models if opts.worker else run_models_isolated
                    result["models"] = run(opts, deadline, tmp)
                else:
                    rates = {e["title"]: s["images_per_s"] for e in result.get("models", {}).values()
                             if isinstance(e, dict) for s in e.get("steps", [])
                             if (s.get("impl"), s.get("bucket"), s.get("batch")) == ("hf_arb", "square", 1)
                             and "images_per_s" in s}
                    result["loader"] = run_loader(opts, tmp, rates)
            except Exception as e:  # noqa: BLE001 - recorded; the other sections still run
                import traceback

                result[section] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            save()
    print(markdown(result))
    smoke = result.get("smoke", {})
    return 1 if smoke.get("failed") or "error" in smoke else 0


if __name__ == "__main__":
    sys.exit(main())
