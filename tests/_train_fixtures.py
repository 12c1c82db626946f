"""The training fixtures several test files share: tiny models, photo folders, and one 2-process batch of runs.

Asset builders (``build_*``) make the tiny pipelines and datasets; tests/conftest.py turns them into session fixtures
through ``shared_artifact`` (built once per test run, whichever xdist worker asks first).

The 2-process batch
-------------------
Every 2-process training run that a test file only reads (:func:`batch_runs` lists them: SD3 / Flux full fine-tune,
SD3 packing, SDXL LoRA with both text encoders, SDXL on a pre-annotated dataset, streaming, broken images under DDP,
runs on resolution tiers, the families' 2-process resumes, ...) runs in **one** ``torchrun --nproc_per_node 2``
launch (tests/_train_batch_worker.py): the imports cost each process about 7 s of CPU and a tiny run about 1 s, so
``n`` runs in one launch cost about ``7 + n`` seconds per process instead of ``8 n``. A "resumed" run is a new
``main()`` call in the same processes that loads the full run's checkpoint from disk. That a checkpoint also resumes in
a *new* process is tested once on 2 processes (``ddp_runs`` in tests/test_train.py: its resume is a ``"restart"`` run,
which :func:`run_batch` runs in a second stage of the launch, on new processes) and once on 1
(tests/test_fault_train.py kills a run with SIGKILL and resumes it). Tests that read the batch share the ``xdist_group``
:data:`GROUP`, so one worker runs them while the other goes on with the rest of the suite.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

GROUP = "ddp_batch"

#: the arguments every tiny run shares (SD/SDXL; test_train.COMMON adds ``--full_finetune``)
SD_BASE = ["--resolution", "64", "--bucket_step", "16", "--train_batch_size", "2", "--report_to", "none",
           "--seed", "0", "--lr_warmup_steps", "0", "--log_batches", "--learning_rate", "1e-3"]
#: the same for SD3 / Flux
FLOW = ["--resolution", "64", "--bucket_step", "16", "--train_batch_size", "2", "--report_to", "none", "--seed", "0",
        "--lr_warmup_steps", "0", "--log_batches", "--max_sequence_length", "16"]
#: a clip run (hf_arb.train.sources.clips): Wan's preset at 1, 5 and 9 frames, captions from --instance_prompt
CLIP = ["--video_column", "video", "--bucket_preset", "wan", "--frames", "1,5,9", "--resolution", "64",
        "--train_batch_size", "2", "--report_to", "none", "--seed", "0", "--lr_warmup_steps", "0", "--log_batches",
        "--max_sequence_length", "16", "--instance_prompt", "a slow pan"]
#: SD3 / Flux packing, full fine-tune
PACK = [*FLOW, "--packing", "--max_tokens", "40", "--full_finetune", "--learning_rate", "1e-3"]
#: the bucket set the SDXL run's dataset was annotated with beforehand (not what its --resolution would build)
SDXL_OWN_BUCKETS = [(64, 64), (96, 48), (48, 96), (128, 32), (32, 128)]
#: streaming: the sizes of the annotated parquet shards (20 tiny photos x REPEAT rows, in SHARDS files)
STREAM_REPEAT, STREAM_SHARDS = 3, 4


# ------------------------------------------------------------------------------------------- assets
def build_train_assets(root: Path) -> dict[str, str]:
    """Tiny SD / SDXL pipelines and a photo imagefolder (5 aspect ratios x 4 photos)."""
    from hf_arb.testing.tiny import save_tiny_imagefolder, save_tiny_sd, save_tiny_sdxl

    return {"sd": save_tiny_sd(root / "tiny-sd"), "sdxl": save_tiny_sdxl(root / "tiny-sdxl"),
            "images": save_tiny_imagefolder(root / "images")}


def build_family_assets(root: Path) -> dict[str, str]:
    """Tiny Qwen-Image, Z-Image, Flux.2 dev and klein, Flux.1 Kontext pipelines, Kontext's before/after pairs and the
    photo imagefolder (issue #26's families), and a tiny Wan (issue #38)."""
    from hf_arb.testing.tiny import save_tiny_imagefolder
    from hf_arb.testing.tiny_flow import save_tiny_flux_kontext
    from hf_arb.testing.tiny_flux2 import save_tiny_flux2
    from hf_arb.testing.tiny_hunyuan_video import save_tiny_hunyuan_video
    from hf_arb.testing.tiny_ltx import save_tiny_ltx
    from hf_arb.testing.tiny_qwen import save_tiny_qwenimage, save_tiny_qwenimage_edit
    from hf_arb.testing.tiny_wan import save_tiny_wan
    from hf_arb.testing.tiny_zimage import save_tiny_zimage

    return {"qwen": save_tiny_qwenimage(root / "tiny-qwenimage"), "zimage": save_tiny_zimage(root / "tiny-zimage"),
            "flux2": save_tiny_flux2(root / "tiny-flux2"),
            "flux2_klein": save_tiny_flux2(root / "tiny-flux2-klein", klein=True),
            "kontext": save_tiny_flux_kontext(root / "tiny-kontext"), "pairs": edit_pairs(root),
            "qwen_edit": save_tiny_qwenimage_edit(root / "tiny-qwen-edit"),
            "qwen_edit_plus": save_tiny_qwenimage_edit(root / "tiny-qwen-edit-plus", plus=True),
            "pairs2": two_reference_pairs(root), "images": save_tiny_imagefolder(root / "images"),
            "wan": save_tiny_wan(root / "tiny-wan"), "ltx": save_tiny_ltx(root / "tiny-ltx"),
            "hyv": save_tiny_hunyuan_video(root / "tiny-hyv")}


def build_flow_assets(root: Path) -> dict[str, str]:
    """Tiny SD3 / Flux pipelines and the photo imagefolder."""
    from hf_arb.testing.tiny import save_tiny_flux, save_tiny_imagefolder, save_tiny_sd3

    return {"sd3": save_tiny_sd3(root / "tiny-sd3"), "flux": save_tiny_flux(root / "tiny-flux"),
            "images": save_tiny_imagefolder(root / "images")}


def build_stream_assets(root: Path) -> dict[str, Any]:
    """Annotated parquet shards (``bucket*`` columns + an integer ``id``), rows shuffled, and a tiny SD."""
    import datasets
    import numpy as np

    from hf_arb import BucketSet, add_bucket_columns
    from hf_arb.testing.tiny import save_tiny_imagefolder, save_tiny_sd

    images = save_tiny_imagefolder(root / "images")
    ds = datasets.load_dataset("imagefolder", data_files={"train": str(Path(images) / "**")}, split="train")
    ds = add_bucket_columns(ds, BucketSet.preset("budget", resolution=64, step=16), image_column="image")
    ds = datasets.concatenate_datasets([ds] * STREAM_REPEAT)
    ds = ds.select(np.random.default_rng(0).permutation(len(ds)))
    ds = ds.add_column("id", list(range(len(ds))))
    shards = root / "shards"
    shards.mkdir()
    for i in range(STREAM_SHARDS):
        ds.shard(STREAM_SHARDS, i, contiguous=True).to_parquet(str(shards / f"train-{i:05d}.parquet"))
    ids = np.asarray(ds["bucket"])
    return {"shards": str(shards), "sd": save_tiny_sd(root / "tiny-sd"), "rows": len(ds),
            "counts": np.bincount(ids[ids >= 0]).tolist()}


def tier_argv(train: dict[str, str]) -> list[str]:
    """The 2-process tiered run: --resolution 32,64, curriculum 0-3:32, 3-:64, 6 steps, checkpoint at 2."""
    return ["--pretrained_model_name_or_path", train["sd"], "--train_data_dir", train["images"], *SD_BASE,
            "--full_finetune", "--resolution", "32,64", "--resolution_schedule", "curriculum:0-3:32,3-:64",
            "--max_train_steps", "6", "--checkpointing_steps", "2"]


def flux_tier_argv(flow: dict[str, str]) -> list[str]:
    """The 2-process tiered Flux run: --resolution 32,64, curriculum 0-3:32, 3-:64, 6 steps, checkpoint at 2."""
    return ["--pretrained_model_name_or_path", flow["flux"], "--train_data_dir", flow["images"], *FLOW,
            "--full_finetune", "--learning_rate", "1e-3", "--resolution", "32,64", "--resolution_schedule",
            "curriculum:0-3:32,3-:64", "--max_train_steps", "6", "--checkpointing_steps", "2"]


def conditioned_argv(train: dict[str, str]) -> list[str]:
    """test_train.py ``ddp_runs``: resolution-conditioned v-prediction SD, 4 steps, checkpoint at 2."""
    return ["--pretrained_model_name_or_path", train["sd"], "--train_data_dir", train["images"], *SD_BASE,
            "--full_finetune", "--random_flip", "--resolution_conditioning", "--resolution_embed_dim", "16",
            "--prediction_type", "v_prediction", "--snr_gamma", "5", "--gradient_accumulation_steps", "2",
            "--max_train_steps", "4", "--checkpointing_steps", "2"]


def stream_argv(assets: dict[str, Any], *extra: str) -> list[str]:
    return ["--pretrained_model_name_or_path", assets["sd"], "--train_data_dir", assets["shards"], *SD_BASE,
            "--full_finetune", "--streaming", "--stream_key_column", "id", *extra]


def write_stream_shards(folder: Path, n: int, shards: int) -> list[int]:
    """``n`` rows (``key``, ``bucket`` in -1..4, ``bucket_width``, ``bucket_height``) in ``shards`` parquet files and
    ``counts.json`` (rows per bucket); returns the rows' bucket ids (tests/_stream_worker.py reads them)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(5)
    ids = rng.choice([-1, 0, 1, 2, 3, 4], size=n, p=[.04, .4, .3, .15, .1, .01]).astype(np.int32)
    size = np.maximum(ids + 1, 1) * 4
    table = pa.table({"key": np.arange(n), "bucket": ids, "bucket_width": size, "bucket_height": 8 + 0 * size})
    for i, part in enumerate(np.array_split(np.arange(n), shards)):
        pq.write_table(table.take(part), folder / f"part-{i:03d}.parquet")
    (folder / "counts.json").write_text(json.dumps(np.bincount(ids[ids >= 0], minlength=5).tolist()))
    return ids.tolist()


#: tests/test_stream_distributed.py: rows, batch size; 2 ranks read STREAM_DIST_SHARDS[2] files (in the batch)
STREAM_DIST_ROWS, STREAM_DIST_BATCH, STREAM_DIST_SHARDS = 600, 3, {2: 5, 3: 6}


def broken_imagefolder(root: Path) -> tuple[str, list[str]]:
    """20 tiny photos (one global batch of 4 per bucket) with 3 cut after their header (interrupted downloads)."""
    from hf_arb.testing.tiny import save_tiny_imagefolder

    images = Path(save_tiny_imagefolder(root, per_size=4))
    files = sorted(p for p in images.iterdir() if p.suffix == ".png")
    damaged = [files[0], files[9], files[17]]
    cut_after_header(damaged)
    return str(images), [f.name for f in damaged]


def cut_after_header(files: list[Path]) -> None:
    """Keep the first 60 % of each file: the header reads, the pixels do not (an interrupted download)."""
    for f in files:
        f.write_bytes(f.read_bytes()[: int(f.stat().st_size * 0.6)])


# ------------------------------------------------------------------------------------------- the batch
def _pair(root: Path, name: str, base: list[str], ckpt: str) -> list[dict[str, Any]]:
    """A full run and a run resumed from its ``ckpt`` checkpoint (copied into a new output folder)."""
    full, resumed = root / name / "full", root / name / "resumed"
    return [{"name": f"{name}-full", "out": str(full), "argv": [*base, "--output_dir", str(full)]},
            {"name": f"{name}-resumed", "out": str(resumed), "copy": [str(full / ckpt), str(resumed / ckpt)],
             "argv": [*base, "--output_dir", str(resumed), "--resume_from_checkpoint", "latest"]}]


def batch_runs(root: Path, train: dict[str, str], flow: dict[str, str], stream: dict[str, Any],
               families: dict[str, str]) -> list[dict]:
    """Every run of the batch: ``{"name", "out", "argv"[, "copy"]}``; the comment names the test file reading it."""
    runs: list[dict[str, Any]] = []
    # test_pack_distributed.py: PackBatchSampler and PackedFlowModel under DDP (tests/_pack_worker.py); first, while
    # no earlier run has started any thread pool (its "workers" mode forks DataLoader workers)
    pack = root / "pack-dist"
    pack.mkdir()
    runs.append({"name": "pack-dist", "out": str(pack), "worker": "_pack_worker", "argv": ["--out", str(pack)]})
    for family in ("qwen", "zimage"):  # test_family_qwenimage.py / test_family_zimage.py: 4 steps, checkpoint at 2
        runs += _pair(root, f"family-{family}", [
            "--pretrained_model_name_or_path", families[family], "--train_data_dir", families["images"], *FLOW,
            "--random_flip", "--full_finetune", "--learning_rate", "1e-3", "--max_train_steps", "4",
            "--checkpointing_steps", "2"], "checkpoint-2")
    kontext = root / "family-kontext"  # test_train_kontext.py: LoRA on before/after pairs, 3 steps
    runs.append({"name": "family-kontext", "out": str(kontext), "argv": [
        "--pretrained_model_name_or_path", families["kontext"], "--dataset_name", families["pairs"],
        "--reference_image_column", "before", *FLOW, "--rank", "4", "--max_train_steps", "3", "--checkpointing_steps",
        "100", "--bucket_leftover", "fill", "--output_dir", str(kontext)]})
    cached = [  # test_train_kontext.py: two runs on one latent cache, the second reusing every entry
        "--pretrained_model_name_or_path", families["kontext"], "--dataset_name", families["pairs"],
        "--reference_image_column", "before", *FLOW, "--rank", "4", "--max_train_steps", "3", "--checkpointing_steps",
        "100", "--bucket_leftover", "fill", "--cache_latents", "--latent_cache_dir", str(root / "kontext-cache")]
    for name in ("family-kontext-cached", "family-kontext-cached-again"):
        runs.append({"name": name, "out": str(root / name), "argv": [*cached, "--output_dir", str(root / name)]})
    qwen_edit = root / "family-qwen-edit"  # test_train_qwen_edit.py: LoRA on before/after pairs, 3 steps
    runs.append({"name": "family-qwen-edit", "out": str(qwen_edit), "argv": [
        "--pretrained_model_name_or_path", families["qwen_edit"], "--dataset_name", families["pairs"], *FLOW,
        "--rank", "4", "--learning_rate", "2e-2", "--max_train_steps", "3", "--checkpointing_steps", "100",
        "--bucket_leftover", "fill", "--reference_image_column", "before", "--output_dir", str(qwen_edit)]})
    # test_train_qwen_edit_plus.py / test_train_flux2_refs.py: full fine-tunes on two reference columns, 4 steps,
    # checkpoint at 2 (the 12 rows fill one global batch of 4 per shape: 4 steps per epoch)
    refs = ["--dataset_name", families["pairs2"], "--reference_image_column", "before", "--reference_image_column",
            "style", "--bucket_leftover", "fill", "--full_finetune", "--learning_rate", "1e-3", "--max_train_steps",
            "4", "--checkpointing_steps", "2"]
    runs += _pair(root, "family-qwen-edit-plus", ["--pretrained_model_name_or_path", families["qwen_edit_plus"],
                                                  *FLOW, *refs], "checkpoint-2")
    runs += _pair(root, "family-flux2-refs", [
        "--pretrained_model_name_or_path", families["flux2_klein"], *FLOW[:FLOW.index("--max_sequence_length")],
        "--max_sequence_length", "48", *FLOW[FLOW.index("--max_sequence_length") + 2:], *refs], "checkpoint-2")
    klein = root / "family-flux2-klein"  # test_family_flux2.py: 3 steps, max_sequence_length 48
    runs.append({"name": "family-flux2-klein", "out": str(klein), "argv": [
        "--pretrained_model_name_or_path", families["flux2_klein"], "--train_data_dir", families["images"],
        *FLOW[:FLOW.index("--max_sequence_length")], "--max_sequence_length", "48",
        *FLOW[FLOW.index("--max_sequence_length") + 2:], "--full_finetune", "--learning_rate", "1e-3",
        "--max_train_steps", "3", "--checkpointing_steps", "100", "--output_dir", str(klein)]})
    for family in ("sd3", "flux"):  # test_train_flow.py: full fine-tune, 4 steps, checkpoint at 2
        runs += _pair(root, f"flow-{family}", [
            "--pretrained_model_name_or_path", flow[family], "--train_data_dir", flow["images"], *FLOW,
            "--random_flip", "--full_finetune", "--learning_rate", "1e-3", "--max_train_steps", "4",
            "--checkpointing_steps", "2", "--weighting_scheme", "logit_normal"], "checkpoint-2")
    # test_train_packing.py: 6 steps (4 per epoch: the run crosses an epoch), checkpoint at 3
    runs += _pair(root, "pack-sd3", ["--pretrained_model_name_or_path", flow["sd3"], "--train_data_dir",
                                     flow["images"], *PACK, "--max_train_steps", "6", "--checkpointing_steps", "3",
                                     "--random_flip"], "checkpoint-3")
    # test_train_lora.py: SDXL, adapters on the UNet and both text encoders, gradient accumulation 2
    runs += _pair(root, "sdxl-te-lora", [
        "--pretrained_model_name_or_path", train["sdxl"], "--train_data_dir", train["images"], *SD_BASE, "--rank",
        "4", "--train_text_encoder", "--max_train_steps", "4", "--checkpointing_steps", "2",
        "--gradient_accumulation_steps", "2"], "checkpoint-2")
    # test_train_stream.py: 5 steps over the parquet shards, checkpoint at 2
    runs += _pair(root, "stream", stream_argv(stream, "--random_flip", "--max_train_steps", "5",
                                              "--checkpointing_steps", "2"), "checkpoint-2")
    # test_train_tiers.py: SD on 2 resolution tiers, curriculum switching at step 3, across an epoch (5 steps)
    runs += _pair(root, "tiers-sd", tier_argv(train), "checkpoint-2")
    runs += _pair(root, "tiers-flux", flux_tier_argv(flow), "checkpoint-2")  # the same on a tiny Flux
    runs += _pair(root, "tiers-stream", stream_argv(stream, "--resolution", "32,64", "--resolution_schedule",
                                                    "curriculum:0-3:32,3-:64", "--max_train_steps", "6",
                                                    "--checkpointing_steps", "2"), "checkpoint-2")  # and streamed
    runs += _pair(root, "tiers-stream-random", stream_argv(stream, "--resolution", "32,64", "--max_train_steps", "3",
                                                           "--checkpointing_steps", "2"), "checkpoint-2")  # random
    # test_stream_distributed.py: BucketedStream through accelerator.prepare on 2 ranks (tests/_stream_worker.py)
    data = root / "stream-dist"
    data.mkdir()
    ids = write_stream_shards(data, STREAM_DIST_ROWS, STREAM_DIST_SHARDS[2])
    runs.append({"name": "stream-dist", "out": str(data / "out"), "worker": "_stream_worker", "ids": ids, "argv": [
        "--data", str(data), "--out", str(data / "out"), "--batch", str(STREAM_DIST_BATCH)]})
    # test_train.py: SDXL on a dataset annotated beforehand (save_to_disk) with its own buckets; cached latents.
    # No bucket-table flag (--resolution 64 --bucket_step 16 would re-assign the rows to that table: issue 24, 3)
    import datasets

    from hf_arb import BucketSet, add_bucket_columns

    raw = datasets.load_dataset("imagefolder", data_dir=train["images"], split="train")
    add_bucket_columns(raw, BucketSet(SDXL_OWN_BUCKETS), show_summary=False).save_to_disk(str(root / "annotated"))
    out = root / "sdxl-annotated"
    runs.append({"name": "sdxl-annotated", "out": str(out), "argv": [
        "--pretrained_model_name_or_path", train["sdxl"], "--dataset_name", str(root / "annotated"), "--output_dir",
        str(out), *SD_BASE[4:], "--full_finetune", "--max_train_steps", "3", "--checkpointing_steps", "100",
        "--cache_latents", "--random_flip", "--cache_text_embeddings"]})
    # test_train.py ddp_runs (and test_portable_outputs.py): its full run, and its resume from checkpoint-2 in new
    # processes (the batch's restart stage: a real restart)
    out, resumed = root / "sd-conditioned", root / "sd-conditioned-resumed"
    runs.append({"name": "sd-conditioned", "out": str(out), "argv": [*conditioned_argv(train), "--output_dir",
                                                                     str(out)]})
    runs.append({"name": "sd-conditioned-resumed", "out": str(resumed), "restart": True,
                 "copy": [str(out / "checkpoint-2"), str(resumed / "checkpoint-2")],
                 "argv": [*conditioned_argv(train), "--output_dir", str(resumed), "--resume_from_checkpoint",
                          "latest"]})
    # test_fault_train.py: broken images replaced under DDP, one epoch
    images, damaged = broken_imagefolder(root / "broken-images")
    out = root / "broken-ddp"
    runs.append({"name": "broken-ddp", "out": str(out), "damaged": damaged, "argv": [
        "--pretrained_model_name_or_path", train["sd"], "--train_data_dir", images, "--output_dir", str(out),
        *SD_BASE, "--full_finetune", "--num_train_epochs", "1", "--checkpointing_steps", "100"]})
    # test_prior.py: prior preservation on 2 ranks, each generating its share of the 4 class images; 4 steps,
    # checkpoint at 2; the resumed run finds the 4 images (kept, none generated)
    runs += _pair(root, "prior-sd", [
        "--pretrained_model_name_or_path", train["sd"], "--instance_data_dir", train["images"], "--instance_prompt",
        "sks dog", "--with_prior_preservation", "--class_data_dir", str(root / "prior-class"), "--class_prompt",
        "a dog", "--num_class_images", "4", "--sample_batch_size", "2", *SD_BASE, "--rank", "4",
        "--max_train_steps", "4", "--checkpointing_steps", "2"], "checkpoint-2")
    runs += encoded_runs(root, train)
    runs += clip_runs(root, families)  # test_clip_source.py: clips and stills on 2 ranks, and the resume
    runs += ltx_clip_runs(root, families)  # test_family_ltx.py: an LTX-Video full fine-tune on them, and the resume
    runs += clip_budget_runs(root, families)  # test_video_validation.py: a batch size per (W, H, F) bucket, 2 ranks
    runs.append(hyv_clip_run(root, families))  # test_family_hunyuan_video.py: a LoRA on clips and stills, 2 ranks
    # test_fault_train.py: SIGTERM reaches rank 1 only, during update 2 (tests/_signal_worker.py; issue 34, item 4)
    out = root / "signal-one-rank"
    runs.append({"name": "signal-one-rank", "out": str(out), "worker": "_signal_worker", "argv": [
        "--send_signal", "SIGTERM", "--at_update", "2", "--on_rank", "1", "--pretrained_model_name_or_path",
        train["sd"], "--train_data_dir", train["images"], "--output_dir", str(out), *SD_BASE, "--full_finetune",
        "--max_train_steps", "4", "--checkpointing_steps", "100"]})
    return runs


def encoded_argv(train: dict[str, str]) -> list[str]:
    """test_encoded.py: SD full fine-tune on 2 processes, 4 steps, checkpoint at 2 (encoded, cached, trained)."""
    return ["--pretrained_model_name_or_path", train["sd"], "--train_data_dir", train["images"], *SD_BASE,
            "--full_finetune", "--random_flip", "--max_train_steps", "4", "--checkpointing_steps", "2"]


def encoded_runs(root: Path, train: dict[str, str]) -> list[dict[str, Any]]:
    """test_encoded.py: ``hf-arb encode`` on the batch's 2 ranks, then a 2-process run from the encoded dataset and a
    resume of its checkpoint-2, the same streamed (``--streaming``, each rank its split of the shards; checkpoint-2 is
    mid-epoch) and resumed, and the same run with ``--cache_latents --cache_text_embeddings``."""
    flags, data = encoded_argv(train), root / "encoded-sd-data"
    cached = root / "encoded-sd-cached"
    return [{"name": "encoded-sd-encode", "out": str(data), "worker": "_encode_worker",
             "argv": [str(data), "--shard-size", "8", "--", *flags]},
            *_pair(root, "encoded-sd", [*flags, "--encoded_dataset", str(data)], "checkpoint-2"),
            *_pair(root, "encoded-sd-stream", [*flags, "--encoded_dataset", str(data), "--streaming"],
                   "checkpoint-2"),
            {"name": "encoded-sd-cached", "out": str(cached), "argv": [*flags, "--cache_latents",
                                                                       "--cache_text_embeddings", "--output_dir",
                                                                       str(cached)]}]


def run_batch(root: Path, runs: list[dict[str, Any]], nproc: int = 2, timeout: int = 300) -> dict[str, Any]:
    """Launch the runs in one launcher; return ``name -> {"out", "stats", "error", ...}`` (JSON only; the run's
    other keys, e.g. ``damaged``, are passed through).

    The runs marked ``"restart": true`` run after the others in a second stage of the launch (tests/_fork_launch.py):
    new processes, so a resume there is a real restart, without a launch of its own.

    ``stats`` is the run's ``hf_arb_run.json`` plus ``log`` (every rank's output); ``error`` is "" or the first
    failing rank's traceback.
    """
    worker = Path(__file__).with_name("_train_batch_worker.py")
    stages = []
    for stage, part in (("runs", [r for r in runs if not r.get("restart")]),
                        ("runs-restart", [r for r in runs if r.get("restart")])):
        if part:
            (root / f"{stage}.json").write_text(json.dumps(part, indent=1))
            stages.append({"name": stage, "script": worker, "nproc": nproc, "args": [str(root / f"{stage}.json"),
                                                                                     str(root)]})
    launch_stages(root, stages, timeout=timeout)
    status = [json.loads((root / f"status.{st['name']}.rank{r}.json").read_text()) for st in stages
              for r in range(nproc)]
    results: dict[str, Any] = {}
    for run in runs:
        name, out = run["name"], Path(run["out"])
        log = "".join((root / "logs" / f"{name}.rank{r}.log").read_text() for r in range(nproc))
        error = next((s[name] for s in status if s.get(name)), "")
        stats = json.loads((out / "hf_arb_run.json").read_text()) if (out / "hf_arb_run.json").exists() else {}
        extra = {k: v for k, v in run.items() if k not in ("argv", "copy", "worker", "restart")}
        results[name] = {**extra, "stats": {**stats, "log": log}, "error": error}
    return results


#: what the ranks of a launch of the suite's non-training workers (sampler, stream) import: preloaded once by the
#: launcher instead of the training stack's tests/_fork_launch.py PRELOAD (~5 CPU-s instead of ~16 per launch)
LIGHT_PRELOAD = ("torch", "torch.distributed", "numpy", "pyarrow", "accelerate", "datasets", "hf_arb")


def launch_stages(root: Path, stages: list[dict[str, Any]], preload: tuple[str, ...] | None = None,
                  timeout: int = 600) -> None:
    """Several launches in one launcher (tests/_fork_launch.py's stage list): each stage ``{"name", "script",
    "args", "nproc"[, "cwd", "log"]}`` on fresh forked ranks, in turn, after one import of ``preload`` (default: the
    launcher's whole training stack). A stage reading the previous stage's checkpoint is a real restart."""
    from test_train import torchrun

    spec = {"stages": [{**st, "script": str(st["script"])} for st in stages]}
    if preload is not None:
        spec["preload"] = list(preload)
    (root / "stages.json").write_text(json.dumps(spec, indent=1))
    torchrun(root / "stages.json", [], stages[0]["nproc"], timeout)


def batch_result(batch: dict[str, Any], name: str) -> dict[str, Any]:
    """One run of the batch, failing the test with that run's traceback and log tail if it failed."""
    import pytest

    run = batch[name]
    if run["error"]:
        pytest.fail(f"{name} failed in the 2-process batch:\n{run['error']}\n--- log tail ---\n"
                    f"{run['stats']['log'][-4000:]}")
    return {**run, "out": Path(run["out"])}


def build_batch(root: Path, train: dict[str, str], flow: dict[str, str], stream: dict[str, Any],
                families: dict[str, str]) -> dict[str, Any]:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    return run_batch(root, batch_runs(root, train, flow, stream, families))


#: the two-reference pairs' target shapes (test_train_flux2_refs.py, test_train_qwen_edit_plus.py)
REF2_SIZES = [(96, 64), (64, 96), (64, 64), (80, 48)]


def mixed_clip_folder(folder: Path) -> str:
    """4 MP4 clips of 13 frames, 4 WebM clips of 9 frames (64x48, a window panning across a photo), 4 PNG stills
    (:func:`hf_arb.testing.clips.save_mixed_clip_folder`) and a cut MP4 (its header unreadable: skipped at
    annotation)."""
    import numpy as np
    from _photos import photo

    from hf_arb.testing.clips import save_mixed_clip_folder

    save_mixed_clip_folder(folder, np.asarray(photo("astronaut.png")))
    (folder / "cut.mp4").write_bytes((folder / "pan0.mp4").read_bytes()[:700])
    return str(folder)


def clip_runs(root: Path, families: dict[str, str]) -> list[dict[str, Any]]:
    """test_clip_source.py: a Wan LoRA on a mixed folder of clips and stills on 2 ranks, 4 steps (an epoch is 3:
    two 9-frame steps, one of stills), checkpoint at 2, and its resume."""
    folder = mixed_clip_folder(root / "clip-folder")
    return _pair(root, "clips-wan", ["--pretrained_model_name_or_path", families["wan"], "--train_data_dir", folder,
                                     *CLIP, "--rank", "4", "--learning_rate", "2e-2", "--max_train_steps", "4",
                                     "--checkpointing_steps", "2", "--random_flip", "--frame_sampling", "random"],
                 "checkpoint-2")


#: an LTX-Video clip run: sides of 32 (LTXPipeline's), stills and 9-frame clips (8k+1) in 96x64-sized buckets
LTX_CLIP = ["--video_column", "video", "--bucket_preset", "budget", "--resolution", "80", "--bucket_step", "32",
            "--frames", "1,9", "--train_batch_size", "2", "--report_to", "none", "--seed", "0", "--lr_warmup_steps",
            "0", "--log_batches", "--max_sequence_length", "16", "--instance_prompt", "a slow pan"]


def ltx_clip_runs(root: Path, families: dict[str, str]) -> list[dict[str, Any]]:
    """test_family_ltx.py: an LTX-Video full fine-tune on the mixed folder of clips and stills on 2 ranks, 4 steps (an
    epoch is 3: two 9-frame steps, one of stills), checkpoint at 2, and its resume."""
    folder = mixed_clip_folder(root / "clip-folder-ltx")
    return _pair(root, "clips-ltx", ["--pretrained_model_name_or_path", families["ltx"], "--train_data_dir", folder,
                                     *LTX_CLIP, "--full_finetune", "--learning_rate", "1e-3", "--max_train_steps",
                                     "4", "--checkpointing_steps", "2", "--random_flip"], "checkpoint-2")


def clip_budget_runs(root: Path, families: dict[str, str]) -> list[dict[str, Any]]:
    """test_video_validation.py: a Wan LoRA on the mixed folder on 2 ranks for one epoch (5 steps) with
    ``--video_token_budget 64 --image_train_batch_size 2``: the 9-frame clips 1 row per rank, the stills 2."""
    folder = root / "clip-folder"
    out = root / "clips-wan-budget"
    return [{"name": "clips-wan-budget", "out": str(out), "argv": [
        "--pretrained_model_name_or_path", families["wan"], "--train_data_dir",
        str(folder) if folder.exists() else mixed_clip_folder(folder), *CLIP, "--rank", "4", "--learning_rate",
        "2e-2", "--max_train_steps", "5", "--checkpointing_steps", "100", "--video_token_budget", "64",
        "--image_train_batch_size", "2", "--output_dir", str(out)]}]


def hyv_clip_run(root: Path, families: dict[str, str]) -> dict[str, Any]:
    """test_family_hunyuan_video.py: a HunyuanVideo 1.5 LoRA on clip_runs' mixed folder on 2 ranks, 3 steps (clips and
    stills, its own preset)."""
    out, preset = root / "clips-hyv", CLIP.index("--bucket_preset") + 1
    return {"name": "clips-hyv", "out": str(out), "argv": [
        "--pretrained_model_name_or_path", families["hyv"], "--train_data_dir", str(root / "clip-folder"),
        *CLIP[:preset], "hunyuan_video", *CLIP[preset + 1:], "--rank", "4", "--learning_rate", "2e-2",
        "--max_train_steps", "3", "--checkpointing_steps", "100", "--output_dir", str(out)]}


def two_reference_pairs(root: Path, n: int = 12) -> str:
    """Targets with two reference columns: ``before`` (the grey mirror, at the target's shape) and ``style`` (a
    narrower grey crop): a multi-reference edit dataset saved with ``save_to_disk``."""
    import datasets
    from _photos import PHOTOS, photo
    from PIL import ImageOps

    rows: dict[str, list[Any]] = {"image": [], "before": [], "style": [], "text": []}
    names = list(PHOTOS)
    for i in range(n):
        w, h = REF2_SIZES[i % len(REF2_SIZES)]
        im = photo(names[i % len(names)], (w, h)).convert("RGB")
        grey = ImageOps.grayscale(im).convert("RGB")
        rows["image"].append(im)
        rows["before"].append(ImageOps.mirror(grey))
        rows["style"].append(grey.resize((w // 2, h)))
        rows["text"].append("make it colourful in this style")
    ds = datasets.Dataset.from_dict(rows, features=datasets.Features(
        {"image": datasets.Image(), "before": datasets.Image(), "style": datasets.Image(),
         "text": datasets.Value("string")}))
    ds.save_to_disk(str(root / "pairs2"))
    return str(root / "pairs2")


#: the before/after pairs' target shapes (test_train_kontext.py)
EDIT_SIZES = [(96, 64), (64, 96), (64, 64), (80, 48)]


def edit_pairs(root: Path, n: int = 16) -> str:
    """Before/after pairs saved with ``save_to_disk``: the target is the photo, the reference its mirror in grey
    ("make it colourful and turn it around"), at four shapes; every second reference is half as wide."""
    import datasets
    from _photos import PHOTOS, photo
    from PIL import ImageOps

    rows: dict[str, list[Any]] = {"image": [], "before": [], "text": []}
    names = list(PHOTOS)
    for i in range(n):
        w, h = EDIT_SIZES[i % len(EDIT_SIZES)]
        im = photo(names[i % len(names)], (w, h)).convert("RGB")
        before = ImageOps.mirror(ImageOps.grayscale(im).convert("RGB"))
        if i % 2:
            before = before.resize((w // 2, h))
        rows["image"].append(im)
        rows["before"].append(before)
        rows["text"].append("make it colourful and turn it around")
    ds = datasets.Dataset.from_dict(rows, features=datasets.Features(
        {"image": datasets.Image(), "before": datasets.Image(), "text": datasets.Value("string")}))
    ds.save_to_disk(str(root / "pairs"))
    return str(root / "pairs")
