"""Fault injection through the training script: broken images, damaged latent caches, damaged or half-written
checkpoints. No case crashes a run or loses a row silently, and wherever no trained data was damaged a resumed run
ends with the weights of an uninterrupted one."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import _zygote as zygote
import numpy as np
import pytest
from _train_fixtures import GROUP, batch_result, cut_after_header
from test_train import (
    COMMON,
    ROOT,
    max_weight_diff,
    read_trace,
    reset_accelerate,
    run_script,
    script,
    warns_in_log,
)

from hf_arb.train.files import STATE_FILE

# No xdist group: the runs several tests read are shared artifacts (tests/conftest.py), built once per test run
# by whichever worker needs them first, so the tests spread over both workers.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def fault_assets(shared_artifact) -> dict[str, str]:
    """Tiny SD and 10 photos (named apart from test_train's ``assets``: other files import fixtures of both)."""
    def build(root: Path) -> dict[str, str]:
        from hf_arb.testing.tiny import save_tiny_imagefolder, save_tiny_sd

        # 5 shapes x 2 photos: 10 rows, one batch of 2 per bucket
        return {"sd": save_tiny_sd(root / "tiny-sd"), "images": save_tiny_imagefolder(root / "images", per_size=2)}

    return shared_artifact("fault-assets", build)


@pytest.fixture(scope="session")
def assets(fault_assets: dict[str, str]) -> dict[str, str]:
    return fault_assets


def _argv(assets: dict[str, str], out: Path, *extra: str, images: str | None = None) -> list[str]:
    return ["--pretrained_model_name_or_path", assets["sd"], "--train_data_dir", images or assets["images"],
            "--output_dir", str(out), *COMMON, *extra]


# ----------------------------------------------------------------------------------- broken images
@pytest.fixture(scope="session")
def broken_images(fault_assets: dict[str, str], shared_artifact) -> tuple[str, list[str]]:
    """The tiny imagefolder with 2 images cut after their header (an interrupted download): annotation keeps them."""
    def build(root: Path) -> list:
        folder = root / "images"
        shutil.copytree(fault_assets["images"], folder)
        files = sorted(p for p in folder.iterdir() if p.suffix == ".png")
        damaged = [files[1], files[6]]
        cut_after_header(damaged)
        return [str(folder), [f.name for f in damaged]]

    folder, damaged = shared_artifact("fault-broken-images", build)
    return folder, damaged


@pytest.fixture(scope="session")
def replaced_runs(fault_assets, broken_images, shared_artifact) -> dict[str, Any]:
    """One epoch on the broken images (checkpoint at step 2), and a run resumed from that checkpoint."""
    def build(root: Path) -> dict[str, Any]:
        images, _ = broken_images
        full, resumed = root / "full", root / "resumed"
        extra = ("--num_train_epochs", "1", "--checkpointing_steps", "2")  # 5 steps: every row of the epoch is drawn
        stats = run_script(_argv(fault_assets, full, *extra, images=images))
        shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
        stats_resumed = run_script(_argv(fault_assets, resumed, *extra, "--resume_from_checkpoint", "latest",
                                         images=images))
        return {"full": str(full), "resumed": str(resumed), "stats": stats, "stats_resumed": stats_resumed}

    runs = shared_artifact("fault-replaced-runs", build)
    return {**runs, "full": Path(runs["full"]), "resumed": Path(runs["resumed"])}


@pytest.mark.xdist_group("fault_replaced")  # one worker builds the run, the other is not left waiting for it
def test_broken_images_are_replaced_and_recorded(replaced_runs, broken_images) -> None:
    _, damaged = broken_images
    full, stats = replaced_runs["full"], replaced_runs["stats"]
    assert stats["global_step"] == 5
    entries = [json.loads(line) for line in (full / "skipped_rows.jsonl").read_text().splitlines()]
    assert sorted(Path(e["source"].strip("'")).name for e in entries) == sorted(damaged)  # each once
    assert stats["bad_images"] == 2 and all("truncated" in e["reason"] for e in entries)
    trace = read_trace(full, 0)
    assert all(len(t["rows"]) == 2 for t in trace)  # batches stay full
    trained = [r for t in trace for r in t["rows"]]
    bad_rows = {e["row"] for e in entries}
    assert not bad_rows & set(trained)
    # rows in = rows out: the epoch's 10 slots hold the 8 good rows plus, in the bad rows' slots, replacements
    assert len(trained) == 10 and set(trained) == set(range(10)) - bad_rows
    assert {e["replaced_by"] for e in entries} <= set(trained)


@pytest.mark.xdist_group("fault_replaced")
def test_resume_with_replacements_is_exact(replaced_runs) -> None:
    full, resumed = replaced_runs["full"], replaced_runs["resumed"]
    assert [t["rows"] for t in read_trace(resumed, 0)] == [t["rows"] for t in read_trace(full, 0)][2:]
    assert max_weight_diff(full, resumed) < 1e-6


def test_on_bad_image_error_fails_fast_with_working_advice(assets, broken_images, tmp_path) -> None:
    from hf_arb.images.dataset import ImageDecodeError

    images, _ = broken_images
    with pytest.raises(ImageDecodeError, match=r"truncated.*hf-arb annotate SOURCE --verify"):
        try:
            script.main(_argv(assets, tmp_path / "err", "--num_train_epochs", "1", "--on_bad_image", "error",
                              images=images))
        finally:
            reset_accelerate()
    # the advice: annotate with --verify, train on the result; nothing to replace any more
    from hf_arb.cli.app import main as cli

    annotated = tmp_path / "annotated"
    assert cli(["annotate", images, "--output-dir", str(annotated), "--preset", "budget", "--resolution", "64",
                "--step", "16", "--verify"]) == 0
    argv = _argv(assets, tmp_path / "ok", "--max_train_steps", "3", "--on_bad_image", "error")
    argv[argv.index("--train_data_dir"):argv.index("--train_data_dir") + 2] = ["--dataset_name", str(annotated)]
    with warns_in_log("The epoch plan drops 2 of 8 assigned rows"):  # 8 good rows in 5 buckets, batch 2
        stats = run_script(argv)
    assert stats["global_step"] == 3 and stats["bad_images"] == 0


# ----------------------------------------------------------------------------------- latent cache
def test_damaged_latent_cache_entries_are_reencoded(assets, tmp_path) -> None:
    out = tmp_path / "cached"
    argv = _argv(assets, out, "--center_crop", "--max_train_steps", "2", "--checkpointing_steps", "100",
                 "--cache_latents")
    first = run_script(argv)
    assert first["latents_encoded"] == 10 and first["latents_repaired"] == 0
    entries = sorted((out / "latent_cache").glob("*/*.npy"))
    entries[0].write_bytes(entries[0].read_bytes()[:100])  # truncated
    entries[1].write_bytes(b"")  # empty
    buf = __import__("io").BytesIO()
    np.save(buf, np.full(np.load(entries[2]).shape, np.nan, np.float16))
    entries[2].write_bytes(buf.getvalue())  # NaN-filled
    np.save(entries[3], np.zeros((2, 4, 3, 3), np.float16))  # wrong shape
    entries[4].with_suffix(".json").unlink()  # metadata lost
    second = run_script(argv)
    assert (second["latents_encoded"], second["latents_repaired"], second["latents_reused"]) == (5, 5, 5)
    np.testing.assert_allclose(second["losses"], first["losses"], rtol=1e-6)


def test_latent_entry_damaged_during_training_is_reencoded_in_place(assets, tmp_path, monkeypatch) -> None:
    """Entries that break after the start-up check (here: all of them, right after it) are re-encoded on read."""
    from hf_arb.train.cache import latents as lat

    out = tmp_path / "cached"
    argv = _argv(assets, out, "--center_crop", "--max_train_steps", "2", "--checkpointing_steps", "100",
                 "--cache_latents")
    first = run_script(argv)
    fill = lat.fill_cache

    def fill_then_damage(cache, index, **kw):
        done = fill(cache, index, **kw)
        for npy in Path(cache.root).glob("*/*.npy"):
            npy.write_bytes(npy.read_bytes()[:64])
        return done

    monkeypatch.setattr(lat, "fill_cache", fill_then_damage)
    second = run_script(argv)
    # 2 steps x batch 2 read, plus the batch accelerate's loader fetches ahead: each repaired on read
    assert second["latents_reused"] == 10 and second["latents_repaired"] == 6
    np.testing.assert_allclose(second["losses"], first["losses"], rtol=1e-6)


# ----------------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="session")
def ckpt_run(fault_assets, shared_artifact) -> Path:
    """4 steps, a checkpoint every 2: read-only for the tests (they copy checkpoints out before damaging them).
    test_portable_outputs.py loads its final pipeline as the stock SD output."""
    def build(out: Path) -> str:
        run_script(_argv(fault_assets, out, "--max_train_steps", "4", "--checkpointing_steps", "2"))
        return str(out)

    out = Path(shared_artifact("fault-ckpt-run", build))
    assert [d.name for d in sorted(out.glob("checkpoint-*"))] == ["checkpoint-2", "checkpoint-4"]
    return out


def _copy_checkpoints(src: Path, dst: Path, *names: str) -> Path:
    for n in names:
        shutil.copytree(src / n, dst / n)
    return dst


@pytest.mark.xdist_group("fault_ckpt")
def test_latest_skips_damaged_checkpoint_and_resumes_exactly(ckpt_run, assets, tmp_path, caplog) -> None:
    """Every kind of damage is named by checkpoint_problems (test_fault_checkpoint.py); here one, end to end."""
    out = _copy_checkpoints(ckpt_run, tmp_path / "run", "checkpoint-2", "checkpoint-4")
    (out / "checkpoint-4" / "unet" / "diffusion_pytorch_model.safetensors").unlink()
    opt = out / "checkpoint-4" / "optimizer.bin"
    opt.write_bytes(opt.read_bytes()[:1000])
    with caplog.at_level("WARNING"):
        stats = run_script(_argv(assets, out, "--max_train_steps", "4", "--checkpointing_steps", "2",
                                 "--resume_from_checkpoint", "latest"))
    assert "skipping incomplete or damaged checkpoint(s): checkpoint-4 (" in caplog.text and "+1 more" in caplog.text
    assert stats["global_step"] == 4 and read_trace(out, 0)[0]["step"] == 2  # resumed from checkpoint-2
    assert max_weight_diff(ckpt_run, out) < 1e-6


@pytest.mark.xdist_group("fault_ckpt")
def test_named_damaged_checkpoint_is_a_one_line_error(ckpt_run, assets, tmp_path) -> None:
    out = _copy_checkpoints(ckpt_run, tmp_path / "run", "checkpoint-4")
    opt = out / "checkpoint-4" / "optimizer.bin"
    opt.write_bytes(opt.read_bytes()[:-50])
    with pytest.raises(ValueError, match=rf"Checkpoint .*checkpoint-4 is damaged: {opt}: truncated") as err:
        script.main(_argv(assets, out, "--max_train_steps", "4", "--resume_from_checkpoint", "checkpoint-4"))
    reset_accelerate()
    assert "\n" not in str(err.value)


@pytest.mark.xdist_group("fault_ckpt")
def test_tampered_global_step_is_refused(ckpt_run, assets, tmp_path) -> None:
    """A step edited in a checkpoint renamed to match it: caught after loading, where the optimizer's step tells."""
    out = tmp_path / "run"
    shutil.copytree(ckpt_run / "checkpoint-4", out / "checkpoint-3")
    state = out / "checkpoint-3" / STATE_FILE
    state.write_text(json.dumps({**json.loads(state.read_text()), "global_step": 3}))
    try:
        with pytest.raises(ValueError, match=r"inconsistent: hf_arb_state.json says global_step 3, but its "
                                             r"micro_step 4 is at update 4 .* optimizer at step 4"):
            script.main(_argv(assets, out, "--max_train_steps", "4", "--resume_from_checkpoint", "latest"))
    finally:
        reset_accelerate()


def _no_data(*_: object) -> None:
    raise AssertionError("the dataset was read before the resume flags were checked")


def _forbid_data(monkeypatch) -> None:
    """Make every data source's dataset read fail (the sources read it through ``dataset_with_buckets``)."""
    import importlib
    import pkgutil

    import hf_arb.train.sources as sources

    for info in pkgutil.iter_modules(sources.__path__):
        module = importlib.import_module(f"hf_arb.train.sources.{info.name}")
        if hasattr(module, "dataset_with_buckets"):
            monkeypatch.setattr(module, "dataset_with_buckets", _no_data)


@pytest.mark.xdist_group("fault_ckpt")
@pytest.mark.parametrize("world, extra, message", [
    ("1", ["--train_batch_size", "1"], "was trained with --train_batch_size 2 on 1 process "
                                       "(--gradient_accumulation_steps 1); this run has --train_batch_size 1 on 1 "
                                       "process (--gradient_accumulation_steps 1). Pass --train_batch_size 2 to "
                                       "resume"),
    ("1", ["--gradient_accumulation_steps", "2"], "Pass --gradient_accumulation_steps 1 to resume it."),
    # elastic: 2 processes may continue a 1-process run at the same global batch
    ("2", [], "this run has --train_batch_size 2 on 2 processes (--gradient_accumulation_steps 1). Pass "
              "--train_batch_size 1 to resume it."),
])
def test_resume_with_other_batch_flags_is_one_line_in_flags_before_the_data(ckpt_run, assets, tmp_path, monkeypatch,
                                                                             world, extra, message) -> None:
    """Issue 24 item 6: was a 40-line traceback ending in the sampler's `global_batch_size` after models and cache."""
    out = _copy_checkpoints(ckpt_run, tmp_path / "run", "checkpoint-4")
    monkeypatch.setenv("WORLD_SIZE", world)
    _forbid_data(monkeypatch)
    with pytest.raises(script.UsageError) as err:
        script.main(_argv(assets, out, "--max_train_steps", "6", *extra, "--resume_from_checkpoint", "latest"))
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.xdist_group("fault_ckpt")
def test_a_step_that_is_not_the_folders_is_one_line_before_the_data(ckpt_run, assets, tmp_path, monkeypatch) -> None:
    out = _copy_checkpoints(ckpt_run, tmp_path / "run", "checkpoint-4")
    state = out / "checkpoint-4" / STATE_FILE
    state.write_text(json.dumps({**json.loads(state.read_text()), "global_step": 3}))
    _forbid_data(monkeypatch)
    with pytest.raises(script.UsageError, match=r"checkpoint-4: hf_arb_state.json says global_step 3, but the folder "
                                                r"is checkpoint-4; the file was edited"):
        script.main(_argv(assets, out, "--max_train_steps", "4", "--resume_from_checkpoint", "checkpoint-4"))


@pytest.mark.xdist_group("fault_ckpt")
def test_an_explicit_checkpoint_path_is_used_and_named_as_given(ckpt_run, assets, tmp_path) -> None:
    """A path that does not exist is an error naming it, even where --output_dir has a folder of that name."""
    out = _copy_checkpoints(ckpt_run, tmp_path / "run", "checkpoint-4")
    given = str(tmp_path / "elsewhere" / "checkpoint-4")
    with pytest.raises(FileNotFoundError, match=f"--resume_from_checkpoint '{re.escape(given)}': {re.escape(given)} "
                                                "is not a checkpoint"):
        script.main(_argv(assets, out, "--max_train_steps", "4", "--resume_from_checkpoint", given))


_KILLER = """
import io, os, signal, sys, torch
sys.path.insert(0, {root!r})
import train_text_to_image_arb as script
orig = torch.save
def save(obj, f, *a, **k):
    if ".tmp-checkpoint-4" in str(f) and str(f).endswith("optimizer.bin"):
        buf = io.BytesIO(); orig(obj, buf, *a, **k)
        with open(f, "wb") as fh:
            fh.write(buf.getvalue()[: len(buf.getvalue()) // 2]); fh.flush()
        os.kill(os.getpid(), signal.SIGKILL)  # kill -9 in the middle of writing checkpoint-4
    return orig(obj, f, *a, **k)
torch.save = save
script.main(sys.argv[1:])
"""


@pytest.mark.xdist_group("fault_ckpt")
def test_kill_during_checkpoint_write_with_limit_1_then_resume(ckpt_run, assets, tmp_path) -> None:
    out = tmp_path / "killed"
    argv = _argv(assets, out, "--max_train_steps", "4", "--checkpointing_steps", "2", "--checkpoints_total_limit", "1")
    # a process of its own that dies by SIGKILL: forked from the worker's pre-imported server (tests/_zygote.py)
    proc = zygote.run(["-c", _KILLER.format(root=str(ROOT)), *argv], env=zygote.script_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert sorted(p.name for p in out.glob("*checkpoint-*")) == [".tmp-checkpoint-4", "checkpoint-2"]
    stats = run_script(argv + ["--resume_from_checkpoint", "latest"])
    assert stats["global_step"] == 4
    assert sorted(p.name for p in out.glob("*checkpoint-*")) == ["checkpoint-4"]  # partial write cleaned up
    assert max_weight_diff(ckpt_run, out) < 1e-6


@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
def test_two_ranks_replace_broken_images_and_stay_in_step(ddp_batch) -> None:
    """DDP (2 processes, gloo): replacements keep every batch full and both ranks in the same bucket at each step;
    both ranks append to one skipped_rows.jsonl, each bad row once. 20 rows (one global batch of 4 per bucket),
    3 cut after their header (tests/_train_fixtures.py, in the suite's one 2-process launch)."""
    run = batch_result(ddp_batch, "broken-ddp")
    out, stats, damaged = run["out"], run["stats"], set(run["damaged"])
    r0, r1 = read_trace(out, 0), read_trace(out, 1)
    assert stats["global_step"] == 5 and len(r0) == len(r1) == 5 and stats["bad_images"] == 3
    assert [t["bucket"] for t in r0] == [t["bucket"] for t in r1]  # same bucket on both ranks at every step
    assert all(len(t["rows"]) == 2 for t in r0 + r1)
    entries = [json.loads(line) for line in (out / "skipped_rows.jsonl").read_text().splitlines()]
    assert sorted(Path(e["source"].strip("'")).name for e in entries) == sorted(damaged)
    trained = [r for t in r0 + r1 for r in t["rows"]]
    assert len(trained) == 20 and set(trained) == set(range(20)) - {e["row"] for e in entries}


@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
def test_two_ranks_print_each_block_once(ddp_batch) -> None:
    """A quiet console (issue 24, item 10): both ranks' output together holds the annotation summary, the bucket
    table, the start-up report and the final line once each (the main process says them), no UserWarning source
    line, and no accelerate process-count error (item 4) on a correct 2-process CPU launch."""
    run = batch_result(ddp_batch, "broken-ddp")
    log = run["stats"]["log"]
    for block in ("rows: 20  kept:", "rows per bucket", "     bucket  aspect", "***** Running training",
                  "epoch 0: ", f"Saved to {run['out']}: load it with"):
        assert log.count(block) <= 1, (block, log[-3000:])
    for block in ("rows: 20  kept:", "***** Running training", f"Saved to {run['out']}"):
        assert log.count(block) == 1, (block, log[-3000:])
    assert "UserWarning" not in log and "accelerate sees" not in log


# ----------------------------------------------------------------------------- Ctrl-C and SIGTERM (issue 34, item 4)
def _signalled(assets: dict[str, str], out: Path, sig: str, *extra: str) -> subprocess.CompletedProcess:
    """``python train_text_to_image_arb.py`` (4 updates, a checkpoint every 2) in a process of its own that receives
    ``sig`` during update 3 (tests/_signal_worker.py: a real signal, from inside the optimizer step). The process is
    forked from the worker's pre-imported server (tests/_zygote.py: the interpreter's own signal handlers and exit,
    compared with a fresh interpreter in tests/test_zygote.py), not started afresh: ~16 CPU-s of imports less."""
    argv = _argv(assets, out, "--max_train_steps", "4", "--checkpointing_steps", "2", *extra)
    return zygote.run([str(ROOT / "tests" / "_signal_worker.py"), "--send_signal", sig, "--at_update", "3", *argv],
                      env=zygote.script_env(), cwd=ROOT, timeout=300)


def _stop_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("Stopped by")]
    assert len(lines) == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


@pytest.mark.xdist_group("fault_ckpt")
def test_sigterm_mid_run_saves_and_the_printed_command_resumes_exactly(ckpt_run, assets, tmp_path) -> None:
    """SIGTERM during update 3 (the default --checkpoint_on_signal sigterm): the update finishes, checkpoint-3 is
    saved, the exit status is 128 + 15, and one line (no traceback) names it and the command that resumes; that
    command, run as printed, reaches the uninterrupted run's weights."""
    out = tmp_path / "term"
    proc = _signalled(assets, out, "SIGTERM")
    assert proc.returncode == 143, proc.stderr[-3000:]
    line = _stop_line(proc)
    ckpt = out / "checkpoint-3"
    assert line.startswith(f"Stopped by SIGTERM after update 3; saved {ckpt}. Resume with: python "), line
    assert sorted(p.name for p in out.glob("*checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert json.loads((ckpt / STATE_FILE).read_text())["global_step"] == 3
    cmd = shlex.split(line.split("Resume with: ", 1)[1])
    assert cmd[:2] == ["python", str(ROOT / "train_text_to_image_arb.py")]
    assert cmd[2:] == [*_argv(assets, out, "--max_train_steps", "4", "--checkpointing_steps", "2"),
                       "--resume_from_checkpoint", str(ckpt)]
    stats = run_script(cmd[2:])  # in this process (its imports are paid): the same arguments
    assert stats["global_step"] == 4 and read_trace(out, 0)[-1]["step"] == 3  # trained update 4 only
    assert max_weight_diff(ckpt_run, out) < 1e-6


@pytest.mark.xdist_group("fault_ckpt")
def test_ctrl_c_mid_run_stops_after_the_update_and_names_the_last_checkpoint(assets, tmp_path) -> None:
    """Ctrl-C (SIGINT) during update 3: the update finishes, no checkpoint is written for it (the default), the exit
    status is 128 + 2, and one line, without a KeyboardInterrupt traceback, names checkpoint-2 and the command."""
    out = tmp_path / "int"
    proc = _signalled(assets, out, "SIGINT")
    assert proc.returncode == 130, proc.stderr[-3000:]
    line = _stop_line(proc)
    ckpt = out / "checkpoint-2"
    assert line.startswith(f"Stopped by SIGINT after update 3 (no checkpoint on SIGINT: see --checkpoint_on_signal); "
                           f"last checkpoint {ckpt}. Resume with: python "), line
    assert line.endswith(f"--resume_from_checkpoint {ckpt}"), line
    assert sorted(p.name for p in out.glob("*checkpoint-*")) == ["checkpoint-2"]
    assert [t["step"] for t in read_trace(out, 0)] == [0, 1, 2]  # update 3 finished, update 4 never began


@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
def test_sigterm_on_one_rank_stops_both_after_the_same_update(ddp_batch) -> None:
    """Under DDP (2 processes, in the suite's 2-process batch) SIGTERM reaches rank 1 only, during update 2: both
    ranks finish update 2 and stop there (the per-update agreement), checkpoint-2 is saved by both, and the main
    process prints the one line with the torchrun command that resumes."""
    run = batch_result(ddp_batch, "signal-one-rank")
    out, log = Path(run["out"]), run["stats"]["log"]
    assert not run["error"], run["error"]
    assert [t["step"] for t in read_trace(out, 0)] == [t["step"] for t in read_trace(out, 1)] == [0, 1]
    assert sorted(p.name for p in out.glob("*checkpoint-*")) == ["checkpoint-2"]
    lines = [line for line in log.splitlines() if line.startswith("Stopped by")]
    assert lines == [f"Stopped by SIGTERM after update 2; saved {out / 'checkpoint-2'}. Resume with: torchrun "
                     f"--nproc_per_node 2 train_text_to_image_arb.py {lines[0].split('.py ', 1)[1]}"], log[-3000:]
    assert lines[0].endswith(f"--resume_from_checkpoint {out / 'checkpoint-2'}") and "Traceback" not in log
