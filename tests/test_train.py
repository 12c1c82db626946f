"""End-to-end tests of train_text_to_image_arb.py with tiny offline models (hf_arb.testing.tiny).

The slow tests launch the real script: one process (``python``) or two (``torchrun --nproc_per_node 2`` with
``ACCELERATE_USE_CPU=1``, i.e. real gloo DDP). Each run writes ``batches/rank<r>.jsonl`` (``--log_batches``) and
``hf_arb_run.json``; the tests read those and the saved weights.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "train_text_to_image_arb.py"
sys.path.insert(0, str(ROOT))

from _train_fixtures import GROUP, SD_BASE, SDXL_OWN_BUCKETS, batch_result  # noqa: E402

import train_text_to_image_arb as script  # noqa: E402
from hf_arb.families import get_family  # noqa: E402
from hf_arb.train import files as train_files  # noqa: E402
from hf_arb.train import outputs as train_outputs  # noqa: E402
from hf_arb.train.environment import make_accelerator  # noqa: E402
from hf_arb.train.schedule import compute_schedule  # noqa: E402

COMMON = [*SD_BASE, "--full_finetune"]


# ------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def assets(train_assets: dict[str, str]) -> dict[str, str]:
    """Tiny SD / SDXL pipelines and a photo imagefolder (tests/conftest.py ``train_assets``)."""
    return train_assets


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def warns_in_log(pattern: str):
    """The script's logger says a warning matching ``pattern`` (the sampler's advice is a log line in flags, once,
    from the main process, not a UserWarning)."""
    import logging
    import re

    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    script.logger.addHandler(handler)
    try:
        yield said
    finally:
        script.logger.removeHandler(handler)
    assert sum(bool(re.search(pattern, m)) for m in said) == 1, said


def reset_accelerate() -> None:
    """Forget accelerate's process-wide state after an in-process run, so other tests start clean."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


#: the launcher of the suite's multi-process runs: tests/_fork_launch.py, torchrun's worker environment with the
#: imports paid once before the ranks fork (about 10 CPU-s less per rank); real torchrun where the launcher is the
#: subject (``real=True``, the signal tests, the docs' commands)
FORK_LAUNCH = Path(__file__).with_name("_fork_launch.py")


def torchrun(script_path: Path, args: list[str], nproc: int, timeout: int = 300,
             cwd: Path = ROOT, real: bool = False) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node nproc script_path *args`` on CPU (gloo), through :data:`FORK_LAUNCH` unless
    ``real``; retried on a fresh port if another process took the chosen one meanwhile; fails the test with the log
    tail."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    for _attempt in range(3):
        launcher = ["-m", "torch.distributed.run"] if real else [str(FORK_LAUNCH)]
        cmd = [sys.executable, *launcher, "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script_path), *args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
        if proc.returncode == 0 or "address already in use" not in (proc.stdout + proc.stderr).lower():
            break
    if proc.returncode != 0:
        pytest.fail(f"torchrun failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def run_script(args: list[str], nproc: int = 1, timeout: int = 300) -> dict[str, Any]:
    """Run the script (torchrun for nproc > 1); return hf_arb_run.json. Fails the test with the log tail."""
    out = Path(args[args.index("--output_dir") + 1])
    if nproc == 1:  # in this process: the imports (most of a tiny run's time) are already paid for
        buf = io.StringIO()
        reset_accelerate()  # a fresh process's state, whatever an earlier test in this worker left behind
        try:
            with contextlib.redirect_stdout(buf):
                stats = script.main(args)
        finally:
            reset_accelerate()
        assert json.loads((out / script.STATS_FILE).read_text())["global_step"] == stats["global_step"]
        return {**stats, "log": buf.getvalue()}
    proc = torchrun(SCRIPT, args, nproc, timeout)
    stats = json.loads((out / script.STATS_FILE).read_text())
    stats["log"] = proc.stdout + proc.stderr
    return stats


def read_trace(out: Path, rank: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "batches" / f"rank{rank}.jsonl").read_text().splitlines()]


def unet_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "unet" / "diffusion_pytorch_model.safetensors"))


def max_weight_diff(a: Path, b: Path) -> float:
    wa, wb = unet_weights(a), unet_weights(b)
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


# ------------------------------------------------------------------------------------ fast: arguments
#: Upstream (diffusers examples/text_to_image/train_text_to_image.py) flags and their defaults.
DIFFUSERS_DEFAULTS: dict[str, Any] = {
    "input_perturbation": 0, "revision": None, "variant": None, "dataset_name": None, "dataset_config_name": None,
    "train_data_dir": None, "image_column": "image", "caption_column": "text", "max_train_samples": None,
    "validation_prompts": None, "output_dir": "sd-model-finetuned", "cache_dir": None, "seed": None,
    "resolution": 512, "center_crop": False, "random_flip": False, "train_batch_size": 16, "num_train_epochs": 100,
    "max_train_steps": None, "gradient_accumulation_steps": 1, "gradient_checkpointing": False,
    "learning_rate": 1e-4, "scale_lr": False, "lr_scheduler": "constant", "lr_warmup_steps": 500, "snr_gamma": None,
    "use_8bit_adam": False, "allow_tf32": False, "use_ema": False, "non_ema_revision": None,
    "dataloader_num_workers": 0, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_weight_decay": 1e-2,
    "adam_epsilon": 1e-08, "max_grad_norm": 1.0, "push_to_hub": False, "hub_token": None, "prediction_type": None,
    "hub_model_id": None, "logging_dir": "logs", "mixed_precision": None, "report_to": "tensorboard",
    "local_rank": -1, "checkpointing_steps": 500, "checkpoints_total_limit": None, "resume_from_checkpoint": None,
    "enable_xformers_memory_efficient_attention": False, "noise_offset": 0, "validation_epochs": 5,
    "tracker_project_name": "text2image-fine-tune",
}


def test_cli_has_every_diffusers_flag_with_its_default(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    args = script.parse_args(["--pretrained_model_name_or_path", "x", "--train_data_dir", "d", "--full_finetune"])
    parsed = vars(args)
    for name, default in DIFFUSERS_DEFAULTS.items():
        if name in ("train_data_dir",):
            continue
        assert name in parsed, f"missing upstream flag --{name}"
        assert parsed[name] == default, f"--{name}: default {parsed[name]!r}, upstream {default!r}"
    # Bucket flags and their documented defaults.
    assert (args.bucket_preset, args.bucket_step, args.bucket_leftover,
            args.no_bucket_sync) == ("budget", 64, "drop", False)
    assert args.ddp_comm_hook == "no"


def test_cli_rejects_missing_data_source_and_bad_choices():
    with pytest.raises(ValueError, match="--dataset_name or --train_data_dir"):
        script.parse_args(["--pretrained_model_name_or_path", "x"])
    with pytest.raises(SystemExit):
        script.parse_args(["--pretrained_model_name_or_path", "x", "--train_data_dir", "d", "--bucket_leftover", "x"])
    with pytest.raises(ValueError, match="--train_batch_size must be >= 1, got 0"):
        script.parse_args(["--pretrained_model_name_or_path", "x", "--train_data_dir", "d", "--train_batch_size", "0",
                           "--full_finetune"])


def _diffusers_steps(len_dl: int, accum: int, epochs: int, max_steps: int | None) -> tuple[int, int]:
    """Upstream's arithmetic, written out independently: (max_train_steps, num_train_epochs)."""
    per_epoch = -(-len_dl // accum)
    steps = epochs * per_epoch if max_steps is None else max_steps
    return steps, -(-steps // per_epoch)


@pytest.mark.parametrize("len_dl, accum, epochs, max_steps, procs",
                         [(10, 1, 3, None, 1), (10, 3, 5, None, 2), (7, 4, 100, 5, 8), (1, 1, 1, 50, 2)])
def test_schedule_matches_diffusers(len_dl, accum, epochs, max_steps, procs):
    s = compute_schedule(len_dl, gradient_accumulation_steps=accum, num_train_epochs=epochs,
                         max_train_steps=max_steps, lr_warmup_steps=17, num_processes=procs)
    assert (s.max_train_steps, s.num_train_epochs) == _diffusers_steps(len_dl, accum, epochs, max_steps)
    # get_scheduler sees warmup and total steps x num_processes, as upstream (the prepared scheduler steps once
    # per process at each optimisation step).
    assert (s.scheduler_warmup_steps, s.scheduler_training_steps) == (17 * procs, s.max_train_steps * procs)


def test_schedule_error_when_no_batch():
    with pytest.raises(ValueError, match="no full batch"):
        compute_schedule(0, gradient_accumulation_steps=1, num_train_epochs=1, max_train_steps=None,
                         lr_warmup_steps=0, num_processes=1)


def test_micro_step_generator_is_pure_and_distinct():
    a = torch.randn(4, generator=script.micro_step_generator(0, 5, 1))
    b = torch.randn(4, generator=script.micro_step_generator(0, 5, 1))
    c = torch.randn(4, generator=script.micro_step_generator(0, 5, 0))
    d = torch.randn(4, generator=script.micro_step_generator(0, 6, 1))
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, d)
    # a CPU generator on every device: a GPU run draws what the CPU run draws (the losses move the draws)
    assert script.micro_step_generator(0, 5, 1).device.type == "cpu"


def test_validation_shapes_are_portrait_square_landscape():
    from hf_arb import BucketSet

    shapes = train_outputs.validation_shapes(BucketSet.from_budget(64, step=16))
    aspects = [w / h for w, h in shapes]
    assert aspects[0] < 1 and aspects[1] == 1 and aspects[2] > 1


def test_validation_shapes_choose_only_among_buckets_with_rows():
    """With the run's rows per bucket, the portrait / square / landscape picks are those of the buckets with rows
    (a clip table's most-frames bucket without rows gives way to the next with rows); no rows anywhere, or no counts,
    choose from the whole table as before."""
    from types import SimpleNamespace

    from hf_arb import BucketSet

    buckets = BucketSet.from_budget(64, step=16)
    res = [tuple(int(v) for v in r) for r in buckets.resolutions]
    whole = train_outputs.validation_shapes(buckets)
    assert train_outputs.validation_shapes(buckets, None) == whole
    assert train_outputs.validation_shapes(buckets, np.zeros(len(res), np.int64)) == whole
    rng = np.random.default_rng(0)
    for _ in range(50):
        rows = rng.integers(0, 3, len(res)) * (rng.random(len(res)) < 0.3)
        rows = rows[: rng.integers(1, len(res) + 1)]  # ids past its end: no rows
        shapes = train_outputs.validation_shapes(buckets, rows)
        kept = [r for i, r in enumerate(res) if i < len(rows) and rows[i] > 0]
        if not kept:
            assert shapes == whole
            continue
        assert set(shapes) <= set(kept)  # never a bucket without rows
        assert shapes == train_outputs.validation_shapes(SimpleNamespace(resolutions=kept))  # the same choice rule
    clips = SimpleNamespace(resolutions=[(64, 64, 1), (64, 64, 9), (64, 64, 17), (48, 80, 17), (80, 48, 9)])
    assert train_outputs.validation_shapes(clips) == [(48, 80, 17), (64, 64, 17), (80, 48, 9)]
    assert train_outputs.validation_shapes(clips, [3, 2, 0, 0, 1]) == [(64, 64, 9), (80, 48, 9)]
    # a still bucket nearer every target than the one clip bucket with rows: a video run still validates a clip
    assert train_outputs.validation_shapes(clips, [3, 0, 0, 0, 1]) == [(80, 48, 9)]
    assert train_outputs.validation_shapes(clips, [3]) == [(64, 64, 1)]  # stills only: a still


def test_a_map_style_source_counts_the_rows_of_each_bucket():
    from types import SimpleNamespace

    from hf_arb.train.sources import bucketed

    ds = datasets.Dataset.from_dict({"bucket": [0, 2, -1, 2, 2]})
    assert bucketed.BucketedSource.bucket_rows(SimpleNamespace(ds=ds)).tolist() == [1, 0, 3]


def test_image_grid_pastes_mixed_sizes():
    from PIL import Image

    rows = [[Image.new("RGB", (32, 96), "red"), Image.new("RGB", (64, 64), "blue")],
            [Image.new("RGB", (32, 96), "green"), Image.new("RGB", (64, 64), "black")]]
    grid = train_outputs.image_grid(rows)
    assert grid.size == (96, 192)
    assert grid.getpixel((10, 10)) == (255, 0, 0) and grid.getpixel((40, 100)) == (0, 0, 0)


@pytest.mark.parametrize("with_validation", [False, True])
def test_model_card_with_and_without_validation(tmp_path, with_validation):
    from hf_arb import BucketSet

    args = script.parse_args(["--pretrained_model_name_or_path", "base/model", "--train_data_dir", "d",
                              "--output_dir", str(tmp_path), "--report_to", "none", "--full_finetune"]
                             + (["--validation_prompts", "a cat", "a dog"] if with_validation else []))
    images = [str(tmp_path / "validation" / "step-000004.png")] if with_validation else []
    path = train_outputs.save_model_card(args, "me/arb-model", BucketSet.from_budget(64, step=16), get_family("sd"),
                                  images=images, stats={"global_step": 4})
    text = path.read_text()
    assert text.startswith("---\n") and "base_model: base/model" in text and "StableDiffusionPipeline" in text
    assert ("![validation](validation/step-000004.png)" in text) == with_validation
    assert ("`a cat`" in text) == with_validation and "logged to" not in text


def test_model_card_generates_at_a_bucket_with_rows(tmp_path):
    """The card's "Use" code asks for the shape validation picks among the run's buckets with rows: not the table's
    closest-to-2:3 bucket when it has none, and a clip run's multi-frame bucket, not a 1-frame one (the old card
    chose from the whole table)."""
    import re

    from hf_arb import BucketSet

    def card_shape(buckets, family, rows, *extra):
        args = script.parse_args(["--pretrained_model_name_or_path", "base/model", "--train_data_dir", "d",
                                  "--output_dir", str(tmp_path), "--report_to", "none", "--full_finetune", *extra])
        text = train_outputs.save_model_card(args, "me/arb-model", buckets, get_family(family), rows=rows).read_text()
        call = re.search(r"^(?:image|frames) = pipe\((.*)\)", text, re.M).group(1)
        kw = dict(re.findall(r"\b(width|height|num_frames)=(\d+)", call))
        return tuple(int(kw[k]) for k in ("width", "height", "num_frames") if k in kw)

    buckets = BucketSet.from_budget(64, step=16)
    res = [tuple(int(v) for v in r) for r in buckets.resolutions]
    portrait = train_outputs.validation_shapes(buckets)[0]
    assert card_shape(buckets, "sd", None) == portrait  # no counts: the whole table, as before
    rows = np.ones(len(res), np.int64)
    rows[res.index(portrait)] = 0
    shape = card_shape(buckets, "sd", rows)  # 48x80 untrained: 64x64 is nearer 2:3 in log aspect than 32x96
    assert shape != portrait and rows[res.index(shape)] > 0 and shape == train_outputs.validation_shapes(buckets,
                                                                                                        rows)[0]
    only = np.zeros(len(res), np.int64)
    only[res.index((128, 32))] = 5  # one trained bucket: the card's, however far from 2:3
    assert card_shape(buckets, "sd", only) == (128, 32)
    # a clip table whose exact 2:3 bucket is a still: the whole table's pick is 1 frame; clips trained elsewhere
    clips = BucketSet([(64, 96, 1), (80, 80, 1), (64, 64, 5), (96, 64, 5), (48, 80, 9), (64, 64, 9)])
    assert card_shape(clips, "wan", None) == (64, 96, 1)
    assert card_shape(clips, "wan", [0, 0, 3, 2, 1]) == (48, 80, 9)  # rows only in clip buckets: a clip
    assert card_shape(clips, "wan", [7, 7, 3]) == (64, 64, 5)  # stills and one clip bucket: the clip
    assert card_shape(clips, "wan", [0, 7]) == (80, 80, 1)  # stills only: a still with rows


# ------------------------------------------------------------------------------- fast: argument errors
@pytest.fixture(autouse=True)
def _clean_accelerate_state():
    yield
    reset_accelerate()


def test_missing_checkpoint_is_an_error(assets, tmp_path):
    argv = ["--pretrained_model_name_or_path", assets["sd"], "--train_data_dir", assets["images"],
            "--output_dir", str(tmp_path), *COMMON]
    with pytest.raises(FileNotFoundError, match="no checkpoint-\\* folder"):
        script.main(argv + ["--resume_from_checkpoint", "latest"])
    with pytest.raises(FileNotFoundError, match="is not a checkpoint"):
        script.main(argv + ["--resume_from_checkpoint", "checkpoint-7"])


def test_resume_with_another_seed_is_an_error(assets, tmp_path):
    ckpt = tmp_path / "checkpoint-3"
    ckpt.mkdir()
    (ckpt / train_files.STATE_FILE).write_text(json.dumps({"global_step": 3, "seed": 5}))
    for name in ("optimizer.bin", "scheduler.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl"):
        torch.save({}, ckpt / name)  # readable files: `latest` does not skip this checkpoint as damaged
    (ckpt / "unet").mkdir()
    (ckpt / "unet" / "config.json").write_text("{}")
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(1)}, str(ckpt / "unet" / "diffusion_pytorch_model.safetensors"))
    argv = ["--pretrained_model_name_or_path", assets["sd"], "--train_data_dir", assets["images"],
            "--output_dir", str(tmp_path), *COMMON, "--resume_from_checkpoint", "latest"]
    with pytest.raises(ValueError, match="--seed 0 differs from the seed of the checkpoint being resumed \\(5\\)"):
        script.main(argv)


def test_unknown_column_is_an_error(assets, tmp_path):
    argv = ["--pretrained_model_name_or_path", assets["sd"], "--train_data_dir", assets["images"],
            "--output_dir", str(tmp_path), *COMMON, "--caption_column", "caption"]
    with pytest.raises(ValueError, match="--caption_column value 'caption' needs to be one of: image, text"):
        script.main(argv)


def test_empty_dataset_after_filtering_is_an_error(assets, tmp_path):
    # No tiny image has exactly a bucket's aspect ratio, so a near-zero tolerance skips every row.
    argv = ["--pretrained_model_name_or_path", assets["sd"], "--train_data_dir", assets["images"],
            "--output_dir", str(tmp_path), *COMMON, "--max_aspect_error", "1e-6"]
    with pytest.raises(ValueError, match="No trainable images: 20 rows, 0 assigned"):
        script.main(argv)


# -------------------------------------------------------------------------------- slow: SD, 1 process
@pytest.fixture(scope="module")
def sd_run(assets, tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    import huggingface_hub

    out = tmp_path_factory.mktemp("sd_run")
    pushed: list[dict[str, Any]] = []

    def create_repo(repo_id: str, **kw: Any) -> Any:
        return argparse.Namespace(repo_id=f"user/{repo_id}")

    def upload_folder(**kw: Any) -> None:  # the Hub boundary: record what would be uploaded
        folder = Path(kw["folder_path"])
        pushed.append({**kw, "card": (folder / "README.md").read_text()})

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(huggingface_hub, "create_repo", create_repo)
        mp.setattr(huggingface_hub, "upload_folder", upload_folder)
        stats = run_script(["--pretrained_model_name_or_path", assets["sd"], "--train_data_dir", assets["images"],
                            "--output_dir", str(out), *COMMON, "--center_crop", "--max_train_steps", "4",
                            "--checkpointing_steps", "2", "--checkpoints_total_limit", "1",
                            "--validation_prompts", "a cat", "--num_validation_inference_steps", "2",
                            "--push_to_hub", "--hub_model_id", "tiny-arb"])
    stats["pushed"] = pushed
    return out, stats


@pytest.mark.slow
@pytest.mark.xdist_group("train_sd")
def test_batches_have_bucket_shapes(sd_run):
    out, stats = sd_run
    trace = read_trace(out, 0)
    assert [t["step"] for t in trace] == [0, 1, 2, 3] and stats["global_step"] == 4
    buckets = json.loads((out / train_files.BUCKETS_FILE).read_text())["resolutions"]
    for t in trace:
        w, h = buckets[t["bucket"]]
        assert t["shape"] == [2, 3, h, w]  # pixel batch (B, 3, H, W) of exactly the bucket
        assert t["time_ids_first"][4:] == [h, w]
    assert any(s[2] != s[3] for s in (t["shape"] for t in trace)), "expected a non-square bucket in 4 steps"
    # the startup table: every bucket with its rows (4 photos per aspect ratio), the sampler report, upstream's block
    log = stats["log"]
    for label in ("32 x 96 ", "48 x 80 ", "64 x 64 ", "80 x 48 ", "96 x 32 "):
        assert any(line.strip().startswith(label.strip()) and line.rstrip().endswith(" 4")
                   for line in log.splitlines()), label
    assert "skipped: 0 of 20 rows" in log and "10 steps/rank" in log and "Total optimization steps = 4" in log
    assert stats["vae_encode_calls"] == 4 and stats["latents_encoded"] is None


@pytest.mark.slow
@pytest.mark.xdist_group("train_sd")
def test_push_to_hub_uploads_folder_with_card(sd_run, assets):
    out, stats = sd_run
    (push,) = stats["pushed"]
    assert push["repo_id"] == "user/tiny-arb" and Path(push["folder_path"]) == out
    assert "checkpoint-*" in push["ignore_patterns"] and "latent_cache/*" in push["ignore_patterns"]
    card = push["card"]
    assert f"base_model: {assets['sd']}" in card and "# user/tiny-arb" in card
    assert "![validation](validation/step-000004.png)" in card and "`a cat`" in card
    assert "buckets: 9 (32x128" in card  # the run's bucket table (budget 64 px, step 16)
    assert "steps: 4," in card


@pytest.mark.slow
@pytest.mark.xdist_group("train_sd")
def test_checkpoint_limit_and_validation_grid(sd_run):
    from PIL import Image

    out, stats = sd_run
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4"]  # limit 1: checkpoint-2 pruned
    grid = Image.open(out / "validation" / "step-000004.png")
    from hf_arb import BucketSet

    shapes = train_outputs.validation_shapes(
        BucketSet.from_dict(json.loads((out / train_files.BUCKETS_FILE).read_text()))
    )
    assert shapes == [(48, 80), (64, 64), (80, 48)]  # the 2:3, 1:1 and 3:2 buckets of the 64-px budget
    # one row (one prompt), one column per shape
    assert grid.size == (sum(w for w, _ in shapes), max(h for _, h in shapes))
    assert stats["validation_images"] == [str(out / "validation" / "step-000004.png")]


@pytest.mark.slow
@pytest.mark.xdist_group("train_sd")
def test_saved_pipeline_loads_with_stock_class_and_samples_non_square(sd_run, assets):
    from diffusers import StableDiffusionPipeline

    out, _ = sd_run
    pipe = StableDiffusionPipeline.from_pretrained(out)
    assert type(pipe) is StableDiffusionPipeline
    image = pipe("a portrait photo", height=80, width=48, num_inference_steps=2, output_type="np",
                 generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, 80, 48, 3) and np.isfinite(image).all()
    assert max_weight_diff(out, Path(assets["sd"])) > 0  # training moved the weights
    assert "class_embed_type" not in pipe.unet.config or pipe.unet.config.class_embed_type is None


@pytest.mark.slow
@pytest.mark.xdist_group("train_sd")
def test_cache_latents_same_losses_and_reused(sd_run, assets, tmp_path_factory):
    ref_out, ref = sd_run
    out = tmp_path_factory.mktemp("cached")
    argv = ["--pretrained_model_name_or_path", assets["sd"], "--train_data_dir", assets["images"],
            "--output_dir", str(out), *COMMON, "--center_crop", "--max_train_steps", "4",
            "--checkpointing_steps", "100", "--cache_latents"]
    first = run_script(argv)
    assert first["latents_encoded"] == 20 and first["latents_reused"] == 0
    # Same trajectory as on-the-fly encoding (float16 storage of the posterior -> small differences).
    np.testing.assert_allclose(first["losses"], ref["losses"], rtol=1e-3)
    assert [t["rows"] for t in read_trace(out, 0)] == [t["rows"] for t in read_trace(ref_out, 0)]
    second = run_script(argv)
    assert second["latents_encoded"] == 0 and second["latents_reused"] == 20
    assert second["vae_encode_calls"] == 0  # the VAE encoder never ran in the second run
    np.testing.assert_allclose(second["losses"], first["losses"], rtol=1e-6)


# ------------------------------------------------------------------- slow: two processes, exact resume
@pytest.fixture(scope="session")
def ddp_runs(ddp_batch) -> dict[str, Any]:
    """2 processes, resolution-conditioned v-prediction SD (checkpoint at step 2), and a run resumed from it in new
    processes (a real restart): both in the shared 2-process batch (tests/_train_fixtures.py), the resume in its
    restart stage. Shared (tests/conftest.py): test_portable_outputs.py loads ``full`` as its resolution-conditioned
    output."""
    from _train_fixtures import batch_result

    full, resumed = batch_result(ddp_batch, "sd-conditioned"), batch_result(ddp_batch, "sd-conditioned-resumed")
    return {"full": full["out"], "stats_full": full["stats"], "resumed": resumed["out"],
            "stats_resumed": resumed["stats"]}


@pytest.mark.slow
@pytest.mark.xdist_group("train_ddp")
def test_two_ranks_take_the_same_steps_in_the_same_bucket(ddp_runs):
    r0, r1 = read_trace(ddp_runs["full"], 0), read_trace(ddp_runs["full"], 1)
    # 5 batches per rank and epoch, 2 per update: the epoch's last update has one batch (accelerate syncs at the
    # end of the loader), so 4 updates span 7 micro-batches and two epochs
    assert [t["step"] for t in r0] == [t["step"] for t in r1] == [0, 0, 1, 1, 2, 3, 3]
    assert [t["epoch"] for t in r0] == [0, 0, 0, 0, 0, 1, 1]
    assert [t["bucket"] for t in r0] == [t["bucket"] for t in r1]
    assert [t["shape"] for t in r0] == [t["shape"] for t in r1]
    for a, b in zip(r0, r1):  # each rank its own rows of the global batch
        assert not set(a["rows"]) & set(b["rows"])
    assert ddp_runs["stats_full"]["num_processes"] == 2
    assert any(t["shape"][2] != t["shape"][3] for t in r0)


@pytest.mark.slow
@pytest.mark.xdist_group("train_ddp")
def test_resume_reaches_the_same_weights(ddp_runs):
    full, resumed = ddp_runs["full"], ddp_runs["resumed"]
    for rank in (0, 1):
        tail = [t for t in read_trace(full, rank) if t["step"] >= 2]
        again = read_trace(resumed, rank)
        assert [(t["step"], t["rows"], t["time_ids_first"]) for t in again] == \
               [(t["step"], t["rows"], t["time_ids_first"]) for t in tail]
        np.testing.assert_allclose([t["loss"] for t in again], [t["loss"] for t in tail], rtol=1e-5)
    assert max_weight_diff(full, resumed) < 1e-6


@pytest.mark.slow
@pytest.mark.xdist_group("train_ddp")
def test_resolution_conditioned_pipeline_generates(ddp_runs):
    from hf_arb.families.conditioning import (
        StableDiffusionResolutionPipeline,
        has_resolution_conditioning,
    )

    pipe = StableDiffusionResolutionPipeline.from_pretrained(ddp_runs["full"])
    assert has_resolution_conditioning(pipe.unet)
    assert pipe.scheduler.config.prediction_type == "v_prediction"  # trained objective saved with the pipeline
    # Training moved the zero-initialised output layer: the embedding now matters.
    assert float(pipe.unet.class_embedding.linear_2.weight.detach().abs().max()) > 0
    image = pipe("a wide photo", height=48, width=80, num_inference_steps=2, output_type="np",
                 generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, 48, 80, 3) and np.isfinite(image).all()


# ------------------------------------------------------------------------------------ slow: SDXL
@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
def test_sdxl_trains_with_pipeline_time_ids_and_saves_stock_pipeline(assets, ddp_batch):
    """SDXL on 2 processes, on a dataset annotated beforehand (save_to_disk) with its own bucket set, used as is
    (tests/_train_fixtures.py, in the suite's one 2-process launch)."""
    from diffusers import StableDiffusionXLPipeline

    from hf_arb import BucketSet
    from hf_arb.families.conditioning import sdxl_time_ids

    run = batch_result(ddp_batch, "sdxl-annotated")
    stats, out = run["stats"], run["out"]
    assert stats["family"] == "sdxl" and stats["global_step"] == 3 and stats["num_processes"] == 2
    # both ranks encoded a share of the cache: together every image once per variant (3 steps -> 1 epoch -> 1)
    assert stats["latents_encoded"] == 20 and stats["latents_reused"] == 0
    own = BucketSet(SDXL_OWN_BUCKETS)
    # the dataset's bucket set (the run passes no bucket-table flag; with one, the rows are re-assigned to it)
    assert BucketSet.from_dict(json.loads((out / train_files.BUCKETS_FILE).read_text())).fingerprint == own.fingerprint
    pipe = StableDiffusionXLPipeline.from_pretrained(out)
    proj = pipe.text_encoder_2.config.projection_dim
    images = datasets.load_dataset("imagefolder", data_dir=assets["images"], split="train")
    buckets = json.loads((out / train_files.BUCKETS_FILE).read_text())["resolutions"]
    r0, r1 = read_trace(out, 0), read_trace(out, 1)
    assert [t["bucket"] for t in r0] == [t["bucket"] for t in r1]
    for t in r0 + r1:
        ids = t["time_ids_first"]
        w0, h0 = images[t["rows"][0]]["image"].size
        bw, bh = buckets[t["bucket"]]
        assert ids[:2] == [h0, w0] and ids[4:] == [bh, bw]  # (orig h, orig w, ..., bucket h, bucket w)
        assert 0 <= ids[2] <= max(0, round(h0 * max(bw / w0, bh / h0)) - bh + 1)  # crop inside the scaled image
        expected = pipe._get_add_time_ids(tuple(ids[:2]), tuple(ids[2:4]), tuple(ids[4:]), dtype=torch.float32,
                                          text_encoder_projection_dim=proj)
        torch.testing.assert_close(sdxl_time_ids([ids[:2]], [ids[2:4]], [ids[4:]]), expected)
        assert t["shape"][-2:] == [bh // 8, bw // 8]  # cached latents of the bucket
    image = pipe("a photo", height=48, width=80, num_inference_steps=2, output_type="np",
                 generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, 48, 80, 3)


def test_parse_args_namespace_roundtrip():
    ns = script.parse_args(["--pretrained_model_name_or_path", "x", "--dataset_name", "d", "--validation_prompt", "p",
                            "--full_finetune"])
    assert isinstance(ns, argparse.Namespace) and ns.validation_prompts == ["p"]


@pytest.mark.parametrize("hook", ["fp16", "power_sgd"])
def test_ddp_comm_hook_reaches_accelerate(hook, tmp_path):
    args = script.parse_args(["--pretrained_model_name_or_path", "x", "--train_data_dir", "d", "--report_to", "none",
                              "--output_dir", str(tmp_path), "--ddp_comm_hook", hook, "--power_sgd_rank", "2",
                              "--full_finetune"])
    handler = make_accelerator(args).ddp_handler
    assert handler.comm_hook.value == hook
    assert handler.comm_state_option == ({"matrix_approximation_rank": 2} if hook == "power_sgd" else {})


@pytest.mark.slow  # its own run: no group, so it can go to either worker
def test_cache_latents_covers_catch_all_batches(assets, tmp_path):
    """Leftover rows trained in catch-all batches at another bucket are cached for that bucket too."""
    stats = run_script(["--pretrained_model_name_or_path", assets["sd"], "--train_data_dir", assets["images"],
                        "--output_dir", str(tmp_path), *COMMON, "--train_batch_size", "3", "--num_train_epochs", "1",
                        "--bucket_leftover", "catch_all", "--cache_latents", "--center_crop"])
    trace = read_trace(tmp_path, 0)
    from hf_arb import BucketSet

    buckets = BucketSet.from_dict(json.loads((tmp_path / train_files.BUCKETS_FILE).read_text()))
    sizes = [im.size for im in datasets.load_dataset("imagefolder", data_dir=assets["images"], split="train")["image"]]
    own, _ = buckets.assign([w for w, _ in sizes], [h for _, h in sizes])
    trained = {(r, t["bucket"]) for t in trace for r in t["rows"]}
    moved = {(r, b) for r, b in trained if b != own[r]}
    assert moved, "catch_all should train some leftover rows at the catch-all bucket"
    # one entry per row at its own bucket, plus one per (row, catch-all bucket) pair the plan uses
    assert stats["latents_encoded"] == 20 + len(moved)
    assert all(t["shape"][0] == 3 for t in trace) and stats["global_step"] == len(trace)
