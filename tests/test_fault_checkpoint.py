"""hf_arb.train.checkpointing: damaged files are named, `latest` falls back, publishing never leaves zero checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hf_arb.train.checkpointing import (
    checkpoint_problems,
    expected_global_step,
    find_resumable,
    list_checkpoints,
    publish_checkpoint,
    tmp_checkpoint_dir,
)

STATE = "hf_arb_state.json"


def _write_checkpoint(path: Path, step: int) -> Path:
    """A checkpoint with every file the training script writes, in the real formats (torch Zip, safetensors)."""
    path.mkdir(parents=True)
    torch.save({"state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(64, 64)}}, "param_groups": []},
               path / "optimizer.bin")
    torch.save({"last_epoch": step}, path / "scheduler.bin")
    torch.save({"random_state": list(range(100))}, path / "random_states_0.pkl")
    torch.save({"epoch": 0, "batches_consumed": step}, path / "custom_checkpoint_0.pkl")
    (path / "unet").mkdir()
    (path / "unet" / "config.json").write_text(json.dumps({"sample_size": 8}))
    save_file({"w": torch.randn(128, 128)}, str(path / "unet" / "diffusion_pytorch_model.safetensors"))
    (path / STATE).write_text(json.dumps({"global_step": step, "seed": 0}))
    return path


def _cut(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _flip(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


DAMAGE = {
    "optimizer truncated": ("optimizer.bin", _cut, "truncated"),
    "optimizer bit flip": ("optimizer.bin", _flip, "CRC mismatch"),
    "optimizer empty": ("optimizer.bin", lambda f: f.write_bytes(b""), "empty"),
    "unet weights truncated": ("unet/diffusion_pytorch_model.safetensors", _cut, "unreadable"),
    "unet weights deleted": ("unet/diffusion_pytorch_model.safetensors", Path.unlink, "no weights file"),
    "sampler state deleted": ("custom_checkpoint_0.pkl", Path.unlink, "missing"),
    "rng state truncated": ("random_states_0.pkl", _cut, "truncated"),
    "state file garbage": (STATE, lambda f: f.write_text("{oops"), "unreadable"),
    "state file no step": (STATE, lambda f: f.write_text('{"seed": 0}'), "no integer global_step"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damage_is_named_in_one_line_and_latest_falls_back(case: str, tmp_path: Path) -> None:
    good = _write_checkpoint(tmp_path / "checkpoint-2", 2)
    bad = _write_checkpoint(tmp_path / "checkpoint-4", 4)
    assert checkpoint_problems(good, STATE) == []
    name, damage, words = DAMAGE[case]
    damage(bad / name)
    problems = checkpoint_problems(bad, STATE)
    # the first line names the damaged file (or, for deleted weights, the model folder that lacks them)
    named = bad / name if case != "unet weights deleted" else bad / "unet"
    assert problems[0].startswith(f"{named}: ")
    assert words in " ".join(problems) and all("\n" not in p for p in problems)
    path, skipped = find_resumable(tmp_path, STATE)
    assert path == good and len(skipped) == 1 and skipped[0].startswith("checkpoint-4 (")


def test_no_resumable_checkpoint(tmp_path: Path) -> None:
    assert find_resumable(tmp_path, STATE) == (None, [])
    (tmp_path / "checkpoint-3").mkdir()  # an empty folder from a killed old-style save
    path, skipped = find_resumable(tmp_path, STATE)
    assert path is None and "checkpoint-3" in skipped[0] and "missing" in skipped[0]


def test_publish_renames_then_prunes_and_cleans_stale_temporaries(tmp_path: Path) -> None:
    for step in (2, 4):
        _write_checkpoint(tmp_path / f"checkpoint-{step}", step)
    _write_checkpoint(tmp_checkpoint_dir(tmp_path, 5), 5)  # a killed run's partial write
    tmp = _write_checkpoint(tmp_checkpoint_dir(tmp_path, 6), 6)
    # until publish, the old checkpoints stay: a kill before this line loses nothing
    assert [d.name for d in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-4"]
    final = publish_checkpoint(tmp, keep=1)
    assert final == tmp_path / "checkpoint-6" and not tmp.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-6"]
    # the same step again (a resumed run re-saving it) replaces it
    again = _write_checkpoint(tmp_checkpoint_dir(tmp_path, 6), 6)
    (again / "marker").write_text("new")
    publish_checkpoint(again, keep=None)
    assert (tmp_path / "checkpoint-6" / "marker").is_file()


@pytest.mark.parametrize("spe,accum,epoch,consumed,want", [
    (10, 1, 0, 4, 4), (10, 1, 2, 0, 20), (5, 2, 0, 4, 2), (5, 2, 0, 5, 3), (5, 2, 1, 2, 4), (5, 2, 1, 5, 6)])
def test_expected_global_step(spe: int, accum: int, epoch: int, consumed: int, want: int) -> None:
    state = {"steps_per_epoch": spe, "epoch": epoch, "batches_consumed": consumed}
    assert expected_global_step(state, accum) == want


def test_lora_checkpoint_is_checked_by_its_adapter_file(tmp_path) -> None:
    """A LoRA checkpoint holds pytorch_lora_weights.safetensors instead of a unet/ folder: complete without it
    being a problem, damaged when the adapter file is missing."""
    from hf_arb.train.checkpointing import REQUIRED, checkpoint_problems

    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    (ckpt / "state.json").write_text('{"global_step": 2, "seed": 0}')
    for name in REQUIRED:
        (ckpt / name).write_bytes(b"\0" * 8)
    files = ("pytorch_lora_weights.safetensors",)
    assert any("pytorch_lora_weights.safetensors: missing" in p for p in checkpoint_problems(ckpt, "state.json", (), files))
    (ckpt / files[0]).write_bytes(b"\0" * 8)
    problems = checkpoint_problems(ckpt, "state.json", (), files)
    assert not any("unet" in p or "lora_weights.safetensors: missing" in p for p in problems)
