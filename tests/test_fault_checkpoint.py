"""hf_arb.train.checkpointing: damaged files are named, `latest` falls back, publishing never leaves zero
checkpoints."""

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
    assert any(
        "pytorch_lora_weights.safetensors: missing" in p for p in checkpoint_problems(ckpt, "state.json", (), files)
    )
    (ckpt / files[0]).write_bytes(b"\0" * 8)
    problems = checkpoint_problems(ckpt, "state.json", (), files)
    assert not any("unet" in p or "lora_weights.safetensors: missing" in p for p in problems)


# ------------------------------------------------------------------------ issue 34: the flags a checkpoint records
def _args(root: Path, *extra: str):
    """Parsed script arguments for a tiny-model folder (only its unet/config.json is read) and an image folder."""
    from test_train_cli import fake_model

    import train_text_to_image_arb as script

    (root / "images").mkdir(parents=True, exist_ok=True)
    return script.parse_args(["--pretrained_model_name_or_path", fake_model(root, "sd"), "--train_data_dir",
                              str(root / "images"), "--output_dir", str(root / "out"), "--report_to", "none",
                              "--bucket_step", "16", *extra])


class _Accelerator:
    """One process; save_state writes what accelerate would, in real formats (torch Zip, safetensors)."""
    is_main_process, num_processes = True, 1

    def __init__(self, lora: bool) -> None:
        self.lora = lora

    def wait_for_everyone(self) -> None:
        pass

    def save_state(self, folder: str) -> None:
        path = Path(folder)
        path.mkdir(parents=True)
        for name in ("optimizer.bin", "scheduler.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl"):
            torch.save({"step": 2}, path / name)
        if self.lora:  # the adapter of rank 4 (down: rank x in)
            save_file({"unet.down.attn.to_q.lora_A.weight": torch.zeros(4, 8),
                       "unet.down.attn.to_q.lora_B.weight": torch.zeros(8, 4)},
                      str(path / "pytorch_lora_weights.safetensors"))
        else:
            (path / "unet").mkdir()
            (path / "unet" / "config.json").write_text("{}")
            save_file({"w": torch.zeros(2)}, str(path / "unet" / "diffusion_pytorch_model.safetensors"))


def _save_run(root: Path, *flags: str, steps=(2, 4)) -> None:
    """Checkpoints of a run with ``flags``, written by the script's own save_checkpoint."""
    from hf_arb.train.progress import Progress, save_checkpoint

    args = _args(root, *flags)
    for step in steps:
        save_checkpoint(args, _Accelerator(args.lora), Progress(global_step=step, seed=0, micro_step=step))


def _refusal(root: Path, *flags: str) -> str:
    from hf_arb.checks import UsageError
    from hf_arb.train.environment import check_environment

    with pytest.raises(UsageError) as err:
        check_environment(_args(root, *flags))
    return str(err.value)


@pytest.mark.parametrize("legacy", [False, True], ids=["recorded", "saved-before-the-record"])
def test_a_lora_run_resumed_without_rank_names_the_mode_not_damage(tmp_path, legacy):
    """Issue 34, item 1: every healthy LoRA checkpoint was called "incomplete or damaged … unet/config.json: missing",
    then "no checkpoint can be resumed". Now one line names the mode and the flag, from what the state file records
    (a checkpoint saved before the record: from its adapter file's header)."""
    _save_run(tmp_path, "--rank", "4", "--learning_rate", "1e-4")
    if legacy:
        for ckpt in list_checkpoints(tmp_path / "out"):
            state = json.loads((ckpt / STATE).read_text())
            (ckpt / STATE).write_text(json.dumps({k: v for k, v in state.items() if k != "flags"}))
    message = _refusal(tmp_path, "--learning_rate", "1e-5", "--resume_from_checkpoint", "latest")
    assert "\n" not in message and "damaged" not in message and "unet" not in message, message
    assert "checkpoint-4: it trained LoRA adapters (--rank 4), and this run is a full fine-tune: pass --rank 4 to " \
           "resume it" in message
    # and the other way round, a full fine-tune's checkpoint resumed as LoRA
    _save_run(tmp_path / "full", "--full_finetune")
    message = _refusal(tmp_path / "full", "--rank", "4", "--resume_from_checkpoint", "checkpoint-2")
    assert "\n" not in message and "it is a full fine-tune, and this run trains LoRA (--rank 4): drop --rank" in message


def test_each_flag_that_shapes_the_checkpoint_is_checked_before_any_model(tmp_path):
    """Issue 34, item 2: --rank 8 on a rank-4 checkpoint printed ~100 lines of `size mismatch` after the models
    loaded. Now one line per recorded flag that differs, naming both values and the flag to pass; the same flags (or a
    state file saved before the record) resume."""
    from hf_arb.train.environment import check_environment
    from hf_arb.train.flags.resume_flags import SHAPING_FLAGS

    _save_run(tmp_path, "--rank", "4", "--learning_rate", "1e-4")
    state = json.loads((tmp_path / "out" / "checkpoint-4" / STATE).read_text())
    assert set(state["flags"]) == set(SHAPING_FLAGS) and state["flags"]["rank"] == 4  # recorded, from one list
    lines = _refusal(tmp_path, "--rank", "8", "--use_dora", "--lora_alpha", "16", "--resume_from_checkpoint",
                     "latest").splitlines()
    ckpt = tmp_path / "out" / "checkpoint-4"
    assert lines == [f"Checkpoint {ckpt}: it was saved with --rank 4, this run has --rank 8: pass --rank 4 to resume "
                     "it (or start a new run in another --output_dir).",
                     f"Checkpoint {ckpt}: it was saved with --lora_alpha 4, this run has --lora_alpha 16: pass "
                     "--lora_alpha 4 to resume it (or start a new run in another --output_dir).",
                     f"Checkpoint {ckpt}: it was saved with no --use_dora, this run has --use_dora: drop --use_dora to "
                     "resume it (or start a new run in another --output_dir)."]
    args = _args(tmp_path, "--rank", "4", "--resume_from_checkpoint", "latest")
    check_environment(args)  # the same flags pass (alpha: the rank's default, said or not)
    check_environment(_args(tmp_path, "--rank", "4", "--lora_alpha", "4", "--resume_from_checkpoint", "latest"))
    state.pop("flags")  # a checkpoint saved before the record still resumes
    (ckpt / STATE).write_text(json.dumps(state))
    check_environment(_args(tmp_path, "--rank", "4", "--resume_from_checkpoint", "checkpoint-4"))


def test_another_resolution_schedule_is_refused_before_any_model_with_the_checkpoints_own(tmp_path):
    """Issue 34, item 3: another --resolution_schedule was a sampler ValueError traceback after the models loaded."""
    _save_run(tmp_path, "--full_finetune", "--resolution", "32,64", "--resolution_schedule", "mix:32:1,64:3")
    message = _refusal(tmp_path, "--full_finetune", "--resolution", "32,64", "--resume_from_checkpoint", "latest")
    assert "\n" not in message and ("it was saved with --resolution_schedule mix:32:1,64:3, this run has "
                                    "--resolution_schedule random: pass --resolution_schedule mix:32:1,64:3") in message
    message = _refusal(tmp_path, "--full_finetune", "--resolution", "32,48", "--resolution_schedule", "mix:32:1,48:3",
                       "--resume_from_checkpoint", "latest")
    assert "pass --resolution 32,64" in message
