"""Encoded dataset (``hf-arb encode``, Parquet shards) vs today's per-file latent cache (``.npy`` + ``.json`` per
entry): files on disk, the training loop's read throughput, and encode throughput per process, on CPU with the tiny
SD's VAE.

* entries: ``--entries`` (default 100,000, the issue's scale: about 14 min on a shared 2-core machine)
  posteriors of the tiny VAE (``(2, 4, 8, 8)`` float16, a 64x64 bucket),
  the same bytes written both ways: the per-file cache through ``LatentCache.write`` (what ``--cache_latents``
  writes), the encoded dataset as ``latents`` shards of 1,000 entries (the layout ``hf-arb encode`` writes);
* read: the loader's item and collate path, random keys in batches of 16: ``CachedLatentDataset`` (memory-mapped
  ``.npy`` read, CRC check, JSON metadata) against ``EncodedLatents`` (a row of the memory-mapped Arrow table);
  opening the encoded dataset (``datasets`` turns the Parquet shards into its Arrow cache once) is timed apart;
* encode throughput: ``encode_share`` of the tiny SD run over the 20-photo imagefolder (VAE + text encoder, one
  process), entries per second;
* peak RSS of a training run: ``--encoded_dataset`` (loads no VAE and no text encoder) against ``--cache_latents
  --cache_text_embeddings`` (loads both), each a fresh process (its own peak, ``VmHWM``), on an SD whose VAE and text
  encoder have SD 1.5's sizes (``AutoencoderKL`` 84 M and CLIP ViT-L/14's text encoder 123 M parameters, random
  weights) around a tiny UNet, so that the frozen parts weigh what they weigh in practice.

Usage: ``python benchmarks/bench_encode.py [--quick] [--entries N]``
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _util import row, save_result  # noqa: E402

SHARD, BATCH, READS = 1000, 16, 4000


def _posteriors(tmp: Path, sd: str, count: int) -> np.ndarray:
    """``count`` distinct posteriors of the tiny VAE: 20 encoded photos, each plus a small per-entry offset."""
    import torch
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(Path(sd) / "vae")
    torch.manual_seed(0)
    with torch.no_grad():
        dist = vae.encode(torch.rand(20, 3, 64, 64) * 2 - 1).latent_dist
    base = torch.stack([dist.mean, dist.std], dim=1).numpy()  # (20, 2, 4, 8, 8)
    rng = np.random.default_rng(0)
    return (base[np.arange(count) % 20] + rng.normal(0, 1e-3, (count, *base.shape[1:]))).astype(np.float16)


def write_both(root: Path, stats: np.ndarray) -> tuple[float, float]:
    """The per-file cache and the encoded latents shards of the same entries; returns the seconds each took."""
    import pyarrow as pa

    from hf_arb.train.cache.latents import LatentCache
    from hf_arb.train.encoded.encode import SHARD_META, latents_schema
    from hf_arb.train.encoded.shards import shard_path, shard_slices, write_shard

    n = len(stats)
    meta = {"original_size": [64, 64], "crop_top_left": [0, 0], "target_size": [64, 64]}
    t0 = time.perf_counter()
    cache = LatentCache(root / "cache")
    for i in range(n):
        cache.write(f"{i:032x}", stats[i], meta)
    t_cache = time.perf_counter() - t0
    t0 = time.perf_counter()
    slices = shard_slices(n, SHARD)
    for j, (a, b) in enumerate(slices):
        cols = {"row": np.arange(a, b), "bucket": np.zeros(b - a, np.int32), "variant": np.zeros(b - a, np.int32),
                "source_row": np.arange(a, b), "caption": [f"photo {i}" for i in range(a, b)],
                "latent_stats": [stats[i].tobytes() for i in range(a, b)],
                "latent_shape": [list(stats.shape[1:])] * (b - a), "original_size": [[64, 64]] * (b - a),
                "crop_top_left": [[0, 0]] * (b - a), "target_size": [[64, 64]] * (b - a)}
        tab = pa.table(cols, schema=latents_schema()).replace_schema_metadata(
            {SHARD_META: json.dumps({"start": a, "stop": b, "bad": []}).encode()})
        write_shard(tab, shard_path(root / "encoded", "latents", j, len(slices)))
    return t_cache, time.perf_counter() - t0


def read_rate(dataset, keys: np.ndarray, collate) -> tuple[float, float]:
    """(entries/s wall, CPU µs per entry) reading ``keys`` through ``dataset`` in batches, as the DataLoader does."""
    t0, c0 = time.perf_counter(), time.process_time()
    for s in range(0, len(keys), BATCH):
        collate([dataset[(int(r), 0, 0)] for r in keys[s:s + BATCH]])
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return len(keys) / wall, 1e6 * cpu / len(keys)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--entries", type=int, default=None)
    a = p.parse_args()
    n = a.entries or (2000 if a.quick else 100000)
    reads = min(READS, n)
    import datasets

    from hf_arb.testing.tiny import save_tiny_imagefolder, save_tiny_sd
    from hf_arb.train.cache.latent_dataset import CachedLatentDataset
    from hf_arb.train.cache.latents import CacheIndex, LatentCache
    from hf_arb.train.encoded.reader import EncodedLatents

    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        sd = save_tiny_sd(tmp / "tiny-sd")
        stats = _posteriors(tmp, sd, n)
        t_cache, t_enc = write_both(tmp, stats)
        files_cache = sum(1 for f in (tmp / "cache").rglob("*") if f.is_file())
        files_enc = sum(1 for f in (tmp / "encoded").rglob("*") if f.is_file())
        bytes_cache = sum(f.stat().st_size for f in (tmp / "cache").rglob("*") if f.is_file())
        bytes_enc = sum(f.stat().st_size for f in (tmp / "encoded").rglob("*") if f.is_file())

        index = CacheIndex(keys={(i, 0): [f"{i:032x}"] for i in range(n)}, variants=1)
        cached = CachedLatentDataset(LatentCache(tmp / "cache"), index, [f"photo {i}" for i in range(n)])
        t0 = time.perf_counter()
        files = sorted(str(f) for f in (tmp / "encoded").rglob("*.parquet"))
        table = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=str(tmp / "hf"))
        fp = {"variants": 1, "buckets": {"resolutions": [[64, 64]]}}
        data = type("Data", (), {"latents": table, "fingerprint": fp})()
        encoded = EncodedLatents(data, [f"photo {i}" for i in range(n)])
        t_open = time.perf_counter() - t0
        keys = np.random.default_rng(1).permutation(n)[:reads]
        runs = {"cache": [], "encoded": []}
        for _ in range(1 if a.quick else 3):  # alternated: the machine is shared
            runs["cache"].append(read_rate(cached, keys, CachedLatentDataset.collate))
            runs["encoded"].append(read_rate(encoded, keys, EncodedLatents.collate))
        med = {k: (float(np.median([r[0] for r in v])), float(np.median([r[1] for r in v]))) for k, v in runs.items()}
        assert all(np.array_equal(cached[(int(k), 0, 0)]["latent_stats"], encoded[(int(k), 0, 0)]["latent_stats"])
                   for k in keys[:50])

        images = save_tiny_imagefolder(tmp / "images")
        encode_rate, encoded_entries = _encode_rate(tmp, sd, images)
        rss = _peak_rss(tmp, sd, images)

    rows = [
        row("files on disk", files_enc, files_cache, "files",
            target="≤ 1 per 1,000 entries", note=f"{n:,} entries: {bytes_enc / 2**20:.1f} MiB of Parquet vs "
                                                f"{bytes_cache / 2**20:.1f} MiB of .npy + .json"),
        row("read throughput (the loader's item + collate path, random order)", med["encoded"][0], med["cache"][0],
            "entries/s", higher_is_better=True, target="≥ the per-file cache",
            note=f"batches of {BATCH}, {reads:,} random entries, median of {len(runs['cache'])} alternated runs; "
                 f"CPU µs/entry: encoded {med['encoded'][1]:.0f}, per-file {med['cache'][1]:.0f}"),
        row("CPU time per entry read", med["encoded"][1], med["cache"][1], "µs/entry", target="",
            note=f"opening the encoded dataset (Parquet → datasets' Arrow cache, once): {t_open:.2f} s"),
        row("write time (same entries)", t_enc, t_cache, "s",
            note="the write alone (no VAE): Parquet shards vs one .npy + .json pair per entry"),
        row("encode throughput per process (tiny SD, VAE + text encoder, CPU)", encode_rate, None, "entries/s",
            higher_is_better=True, note=f"encode_share of {encoded_entries} entries (20 photos x 2 flip variants), "
                                        "one process, including opening the images"),
        row("peak RSS of a training run (SD 1.5-sized VAE and text encoder, tiny UNet)", rss["encoded"],
            rss["cached"], "MiB", target="less than a run that loads them",
            note=f"--encoded_dataset (no VAE, no text encoder: {rss['encoded_built']}) vs --cache_latents "
                 f"--cache_text_embeddings ({rss['cached_built']}); one process each, 4 steps, VmHWM; the frozen "
                 f"parts' float32 weights: {rss['frozen_mib']:.0f} MiB"),
    ]
    save_result("encode", f"Encoded dataset vs per-file latent cache ({n:,} entries, tiny VAE, CPU)", rows,
                command="python benchmarks/bench_encode.py",
                baseline="today's per-file cache (LatentCache: one .npy + .json per entry, CachedLatentDataset)",
                details="Not measured here: the stream's cost (streaming an encoded dataset is another change).")


def _encode_rate(tmp: Path, sd: str, images: str) -> tuple[float, int]:
    from hf_arb.train.encoded.encode import encode_share, plan_encode
    from hf_arb.train.flags.args import parse_args

    args = parse_args(["--pretrained_model_name_or_path", sd, "--train_data_dir", images, "--resolution", "64",
                       "--bucket_step", "16", "--train_batch_size", "4", "--random_flip", "--max_train_steps", "10",
                       "--seed", "0", "--output_dir", str(tmp / "run"), "--full_finetune", "--learning_rate", "1e-4"])
    plan = plan_encode(args)
    t0 = time.perf_counter()
    counts = encode_share(args, tmp / "encoded_run", plan=plan, show_progress=False)
    return counts["entries_written"] / (time.perf_counter() - t0), counts["entries_written"]


#: a training run in a fresh process: its peak RSS and the frozen model classes it built, as JSON on the last line
RSS_CHILD = """
import json, resource, sys
from diffusers import ModelMixin
from transformers import PreTrainedModel
built = []
for base in (ModelMixin, PreTrainedModel):
    real = base.from_pretrained.__func__
    def counting(cls, *a, _real=real, **kw):
        built.append(cls.__name__)
        return _real(cls, *a, **kw)
    base.from_pretrained = classmethod(counting)
import train_text_to_image_arb as script
stats = script.main(sys.argv[1:])
# VmHWM: this process's own peak (ru_maxrss would keep the forking parent's RSS across the exec)
hwm = [line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")]
rss = int(hwm[0]) / 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"rss_mib": rss, "built": built, "losses": stats["losses"]}))
"""


def _sized_sd(tmp: Path, sd: str) -> str:
    """The tiny SD with SD 1.5's VAE and CLIP ViT-L/14 text encoder configs (random weights), its UNet's
    cross-attention widened to 768 to take their embeddings."""
    import shutil

    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    out = tmp / "sized-sd"
    shutil.copytree(sd, out)
    torch.manual_seed(0)
    AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512),
                  layers_per_block=2, down_block_types=("DownEncoderBlock2D",) * 4,
                  up_block_types=("UpDecoderBlock2D",) * 4, sample_size=512).save_pretrained(out / "vae")
    CLIPTextModel(CLIPTextConfig(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                 num_attention_heads=12, max_position_embeddings=77, projection_dim=768)
                  ).save_pretrained(out / "text_encoder")
    unet = UNet2DConditionModel.from_pretrained(out / "unet")
    UNet2DConditionModel.from_config({**unet.config, "cross_attention_dim": 768}).save_pretrained(out / "unet")
    return str(out)


def _peak_rss(tmp: Path, sd: str, images: str) -> dict[str, object]:
    """Peak RSS (MiB) of a 4-step run from an encoded dataset and of the same run with both caches, each in a fresh
    process; the model classes each built before its final save."""
    import os
    import subprocess

    model = _sized_sd(tmp, sd)
    flags = ["--pretrained_model_name_or_path", model, "--train_data_dir", images, "--resolution", "64",
             "--bucket_step", "16", "--train_batch_size", "2", "--max_train_steps", "4", "--seed", "0",
             "--report_to", "none", "--rank", "4", "--checkpointing_steps", "100", "--max_train_samples", "8"]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()  # encoded as the training runs compute: a process with the same threads
    subprocess.run([sys.executable, "-m", "hf_arb.cli", "encode", str(tmp / "rss-ds"), "--", *flags], env=env,
                   cwd=root, capture_output=True, text=True, check=True)
    print(f"encoded the RSS runs' dataset in {time.perf_counter() - t0:.0f} s", flush=True)
    found = {}
    for name, extra in (("encoded", ["--encoded_dataset", str(tmp / "rss-ds")]),
                        ("cached", ["--cache_latents", "--cache_text_embeddings"])):
        cmd = [sys.executable, "-c", RSS_CHILD, *flags, *extra, "--output_dir", str(tmp / f"rss-{name}")]
        proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, check=True)
        found[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{name} run: {found[name]['rss_mib']:.0f} MiB peak RSS", flush=True)
    assert found["encoded"]["losses"] == found["cached"]["losses"]  # the same training, bit for bit
    frozen = sum(f.stat().st_size for part in ("vae", "text_encoder")
                 for f in (Path(model) / part).glob("*.safetensors"))
    return {"encoded": found["encoded"]["rss_mib"], "cached": found["cached"]["rss_mib"],
            "encoded_built": ", ".join(found["encoded"]["built"]),
            "cached_built": ", ".join(found["cached"]["built"]),
            "frozen_mib": frozen / 2**20}


if __name__ == "__main__":
    main()
