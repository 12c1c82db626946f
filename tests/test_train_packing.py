"""``--packing --max_tokens N`` in train_text_to_image_arb.py (SD3 / Flux): flag checks (fast); (slow) a one-process
Flux LoRA run whose steps are packs of images at their own sizes, validated and resumed, and a two-process SD3 full
fine-tune checkpointed mid-epoch and resumed across an epoch boundary to bit-identical weights. Runs are shared
through ``shared_artifact``."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import test_train
import torch
from _train_fixtures import FLOW, GROUP, batch_result
from test_train import read_trace, run_script
from test_train_flow import _jsonable, transformer_weights

import train_text_to_image_arb as script
from hf_arb.train.schedule import pack_schedule

_clean_accelerate_state = test_train._clean_accelerate_state


@pytest.mark.parametrize(("model", "flags", "message"), [
    ("some/sd-model", ["--packing"], "UNet with no token sequence.*--max_pixels_per_batch"),
    ("flux", ["--max_tokens", "64"], "add --packing or drop --max_tokens"),
    ("flux", ["--packing", "--cache_latents"], "--cache_latents is not supported with --packing"),
    ("flux", ["--packing", "--max_tokens", "0"], "--max_tokens must be >= 1"),
    ("flux", ["--packing", "--max_pixels_per_batch", "65536"], "--max_pixels_per_batch sizes bucketed batches"),
])
def test_packing_flags_are_checked(flow_assets, model, flags, message):
    path = flow_assets.get(model, model)
    with pytest.raises(script.UsageError, match=message):
        script.parse_args(["--pretrained_model_name_or_path", path, "--train_data_dir", "d", "--full_finetune",
                           *flags])
    args = script.parse_args(["--pretrained_model_name_or_path", flow_assets["flux"], "--train_data_dir", "d",
                              "--full_finetune", "--packing", "--resolution", "512"])
    assert args.max_tokens == 32 * 32  # one --resolution^2 image


@pytest.mark.parametrize(("epochs", "max_steps", "accum"), [(3, None, 1), (3, None, 2), (None, 30, 2)])
def test_the_pack_schedule_follows_each_epochs_own_length(epochs, max_steps, accum):
    """Steps per epoch vary with the packing: the schedule sums the real epochs (diffusers' ceil per epoch), and a
    step budget gets just enough epochs."""
    import argparse

    import numpy as np

    from hf_arb import PackBatchSampler

    r = np.random.default_rng(0)
    sampler = PackBatchSampler((r.integers(50, 700, 40), r.integers(50, 700, 40)), 1024, num_replicas=1,
                               window=16, log_report=False)
    lengths = [sampler.steps_in(e) for e in range(6)]
    assert len(set(lengths)) > 1  # the epochs really differ
    args = argparse.Namespace(gradient_accumulation_steps=accum, num_train_epochs=epochs or 100,
                              max_train_steps=max_steps, lr_warmup_steps=0)
    sched = pack_schedule(args, sampler, num_processes=1)
    updates = [math.ceil(n / accum) for n in lengths]
    if max_steps is None:
        assert (sched.num_train_epochs, sched.max_train_steps) == (epochs, sum(updates[:epochs]))
    else:
        assert sched.max_train_steps == max_steps
        assert sum(updates[:sched.num_train_epochs - 1]) < max_steps <= sum(updates[:sched.num_train_epochs])


# ------------------------------------------------------------------------------------ one process (Flux LoRA)
@pytest.fixture(scope="module")
def flux_run(flow_assets, shared_artifact) -> dict[str, Any]:
    """LoRA, 3 steps with validation, checkpoint at 2; then checkpoint-2 resumed to step 3 in a new folder."""
    def build(root: Path) -> dict[str, Any]:
        base = ["--pretrained_model_name_or_path", flow_assets["flux"], "--train_data_dir", flow_assets["images"],
                *FLOW, "--packing", "--max_tokens", "40", "--rank", "4", "--learning_rate", "2e-2",
                "--max_train_steps", "3", "--checkpointing_steps", "2"]
        out, resumed = root / "out", root / "resumed"
        stats = run_script(base + ["--output_dir", str(out), "--validation_prompts", "a cat",
                                   "--num_validation_images", "1", "--num_validation_inference_steps", "1"])
        shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
        again = run_script(base + ["--output_dir", str(resumed), "--resume_from_checkpoint", "latest"])
        return {"dir": str(out), "resumed": str(resumed), "stats": _jsonable(stats), "again": _jsonable(again)}

    return shared_artifact("pack-flux-1proc", build)


@pytest.mark.slow
def test_one_process_trains_packs_of_images_at_their_own_size(flux_run):
    from safetensors.torch import load_file

    out, stats = Path(flux_run["dir"]), flux_run["stats"]
    assert stats["global_step"] == 3 and stats["lora"] and all(map(math.isfinite, stats["losses"]))
    trace = read_trace(out, 0)
    rows = [r for t in trace for r in t["rows"]]
    assert len(rows) == len(set(rows))  # every image at most once in the epoch
    for t in trace:
        tokens = sum((h // 16) * (w // 16) for _, h, w in t["shape"])
        assert tokens <= 40 and all(h % 16 == 0 and w % 16 == 0 for _, h, w in t["shape"])
    assert max(len(t["rows"]) for t in trace) > 1  # several images in one sequence
    assert len({tuple(s) for t in trace for s in t["shape"]}) > 2  # and at several sizes
    log = stats["log"]
    assert "packing: 20/20 rows in" in log and "padding" in log and "packed) *****" in log
    weights = load_file(str(out / "pytorch_lora_weights.safetensors"))
    assert weights and all(k.startswith("transformer.") and ".lora_" in k for k in weights)
    assert (out / "validation" / "final-000003.png").is_file()
    # the LoRA checkpoint resumes through the packing wrapper to the same adapters and the same last loss
    again = load_file(str(Path(flux_run["resumed"]) / "pytorch_lora_weights.safetensors"))
    assert again.keys() == weights.keys() and all(torch.equal(again[k], weights[k]) for k in weights)
    assert flux_run["again"]["losses"] == stats["losses"][2:]


# ----------------------------------------------------------------------- two processes + resume (SD3)
@pytest.fixture(scope="module")
def sd3_runs(ddp_batch) -> dict[str, Any]:
    """2 processes, 6 steps (4 per epoch: the run crosses an epoch), checkpoint at 3; resume checkpoint-3
    (tests/_train_fixtures.py, in the suite's one 2-process launch)."""
    full, resumed = batch_result(ddp_batch, "pack-sd3-full"), batch_result(ddp_batch, "pack-sd3-resumed")
    return {"full": full["out"], "resumed": resumed["out"], "stats": full["stats"], "resumed_stats": resumed["stats"]}


@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
def test_two_processes_train_their_own_packs_and_resume_bit_exactly(sd3_runs):
    full, resumed = Path(sd3_runs["full"]), Path(sd3_runs["resumed"])
    assert sd3_runs["stats"]["num_processes"] == 2 and sd3_runs["stats"]["global_step"] == 6
    r0, r1 = read_trace(full, 0), read_trace(full, 1)
    assert [t["step"] for t in r0] == [t["step"] for t in r1] == list(range(6))
    assert {t["epoch"] for t in r0} == {0, 1}  # the run crosses an epoch boundary
    reports = sd3_runs["stats"]["pack_reports"]  # the padding of every epoch trained, in the log and the stats
    assert set(reports) == {"0", "1"} and all(0 <= r["padding_fraction"] < 0.5 for r in reports.values())
    assert f"epoch 1 packing: {reports['1']['rows_packed']}/20 rows" in sd3_runs["stats"]["log"]
    for a, b in zip(r0, r1):
        assert not set(a["rows"]) & set(b["rows"])  # each rank its own pack
    for rank in (0, 1):
        tail = [t for t in read_trace(full, rank) if t["step"] >= 3]
        again = read_trace(resumed, rank)
        assert [(t["step"], t["rows"], t["shape"], t["loss"]) for t in again] == \
            [(t["step"], t["rows"], t["shape"], t["loss"]) for t in tail]
    a, b = transformer_weights(full), transformer_weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ckpt = transformer_weights(full / "checkpoint-3")
    assert any(not torch.equal(ckpt[k], a[k]) for k in a)  # steps 4-6 did change the weights
