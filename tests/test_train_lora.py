"""LoRA mode of train_text_to_image_arb.py: mode rule, fp32 adapters, upstream README commands, exact resume.

The README commands are diffusers' own (examples/text_to_image/README.md and README_sdxl.md) with only the model,
dataset, output paths, the step count and the checkpoint cadence shrunk for the tiny offline models; and, on the
CPU, without fp16 (the SDXL command's ``--mixed_precision="fp16"`` needs a GPU).
"""

from __future__ import annotations

import json
import runpy
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import test_train
import torch
from _train_fixtures import GROUP, batch_result
from test_train import COMMON, ROOT, read_trace, run_script

import train_text_to_image_arb as script
from hf_arb.families import Models, get_family  # noqa: E402

LORA_WRAPPER = ROOT / "train_text_to_image_lora_arb.py"
BASE = [a for a in COMMON if a != "--full_finetune"]

assets = test_train.assets  # the session's tiny models and images
_clean_accelerate_state = test_train._clean_accelerate_state


def base_args(*extra: str) -> list[str]:
    return ["--pretrained_model_name_or_path", "m", "--train_data_dir", "d", *extra]


# ------------------------------------------------------------------------------------------ fast: mode
def test_rank_or_lora_selects_lora_with_upstream_defaults():
    args = script.parse_args(base_args("--rank", "8"))
    assert args.lora and args.rank == 8 and args.output_dir == "sd-model-finetuned-lora"
    args = script.parse_args(base_args("--lora"))
    assert args.lora and args.rank == 4 and args.lora_alpha is None  # alpha = rank, as upstream
    assert (args.validation_epochs, args.num_validation_images) == (1, 4)  # train_text_to_image_lora.py's


def test_upstream_learning_rates_without_a_mode_are_a_full_fine_tune_with_one_warning(caplog):
    """train_text_to_image.py's default (1e-4) and its tests' 5e-4 train every weight, as upstream; one warning
    names --rank for those who meant LoRA. A full fine-tune rate, or --full_finetune, warns nothing."""
    for extra, rate in (((), "0.0001"), (("--learning_rate", "5e-4"), "0.0005")):
        caplog.clear()
        with caplog.at_level("WARNING", logger=script.logger.name):
            args = script.parse_args(base_args(*extra))
        assert not args.lora
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and f"--learning_rate {rate}" in warnings[0] and "--rank 4" in warnings[0]
    for extra in (("--learning_rate", "1e-5"), ("--full_finetune",)):
        caplog.clear()
        with caplog.at_level("WARNING", logger=script.logger.name):
            assert not script.parse_args(base_args(*extra)).lora
        assert not [r for r in caplog.records if r.levelname == "WARNING"]


@pytest.mark.parametrize("extra, message", [
    (["--full_finetune", "--rank", "4"], "--full_finetune contradicts --lora/--rank"),
    (["--learning_rate", "1e-5", "--train_text_encoder"], "--train_text_encoder configures LoRA training"),
    (["--learning_rate", "1e-5", "--lora_dropout", "0.1"], "--lora_dropout configures LoRA training"),
    (["--lora", "--use_ema"], "--use_ema is for full fine-tunes"),
    (["--lora", "--resolution_conditioning"], "--resolution_conditioning is for full fine-tunes"),
    (["--lora", "--train_text_encoder", "--cache_text_embeddings"], "--cache_text_embeddings keeps frozen"),
    (["--rank", "0"], "--rank must be >= 1, got 0"),
])
def test_lora_flag_conflicts(extra, message):
    with pytest.raises(script.UsageError, match=message):
        script.parse_args(base_args(*extra))


def test_lora_adapters_are_fp32_on_a_bf16_base(assets):
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(assets["sdxl"])
    models = Models(get_family("sdxl"), pipe.scheduler, [pipe.tokenizer, pipe.tokenizer_2],
                    [pipe.text_encoder, pipe.text_encoder_2], pipe.vae, pipe.unet)
    args = script.parse_args(base_args("--rank", "2", "--train_text_encoder"))
    groups = script.setup_lora(args, models, torch.bfloat16)  # --train_text_encoder: UNet group + one per encoder
    assert len(groups) == 3
    params = [p for g in groups for p in g["params"]]
    assert params and all(p.dtype == torch.float32 and p.requires_grad for p in params)
    for model in (pipe.unet, pipe.text_encoder, pipe.text_encoder_2):
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        frozen = [p for p in model.parameters() if not p.requires_grad]
        assert trainable and all("lora_" in n for n in trainable)  # only adapters train, on every model
        assert all(p.dtype == torch.bfloat16 for p in frozen)
    assert len(params) == sum(p.requires_grad for m in (pipe.unet, pipe.text_encoder, pipe.text_encoder_2)
                              for p in m.parameters())


# ------------------------------------------------------------------------ slow: SD README command, resume
def sd_readme_command(assets: dict[str, str], out: Path) -> list[str]:
    """examples/text_to_image/README.md's train_text_to_image_lora.py command (paths and length shrunk)."""
    return ["--pretrained_model_name_or_path", assets["sd"], "--dataset_name", assets["images"],
            "--caption_column", "text", "--resolution", "64", "--random_flip", "--train_batch_size", "1",
            "--max_train_steps", "4", "--checkpointing_steps", "2", "--learning_rate", "1e-04", "--lr_scheduler",
            "constant", "--lr_warmup_steps", "0", "--seed", "42", "--output_dir", str(out),
            "--validation_prompt", "cute dragon creature", "--report_to", "none",
            # hf_arb: the tiny bucket grid, a 2-step validation pipeline, the batch trace
            "--bucket_step", "16", "--num_validation_inference_steps", "2", "--num_validation_images", "1",
            "--log_batches"]


@pytest.fixture(scope="session")
def sd_lora(assets, shared_artifact) -> dict[str, Any]:
    """The SD README LoRA command (checkpoint at step 2), and a run resumed from that checkpoint. Shared
    (tests/conftest.py): test_portable_outputs.py loads ``out`` as its LoRA output."""
    def build(root: Path) -> dict[str, Any]:
        out, resumed = root / "sd_lora", root / "sd_lora_resumed"
        stats = run_script(["--lora", *sd_readme_command(assets, out)])
        shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
        again = run_script(["--lora", *sd_readme_command(assets, resumed), "--resume_from_checkpoint", "latest"])
        return {"out": str(out), "stats": stats, "resumed": str(resumed), "again": again}

    runs = shared_artifact("train-sd-lora", build)
    return {**runs, "out": Path(runs["out"]), "resumed": Path(runs["resumed"])}


def lora_file(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "pytorch_lora_weights.safetensors"))


@pytest.mark.slow
@pytest.mark.xdist_group("train_lora")
def test_sd_readme_lora_command_writes_only_lora_weights(sd_lora):
    out, stats = sd_lora["out"], sd_lora["stats"]
    assert stats["lora"] is True and stats["global_step"] == 4
    assert not (out / "unet").exists() and not (out / "model_index.json").exists()  # no full pipeline
    weights = lora_file(out)
    assert weights and all(k.startswith("unet.") for k in weights)
    assert all(v.dtype == torch.float32 for v in weights.values())
    assert stats["trainable_parameters"] == sum(v.numel() for v in weights.values())
    # validation ran with the adapter: during training, and on the saved file loaded into the base model
    assert [Path(p).name for p in stats["validation_images"]] == ["step-000004.png", "final-000004.png"]
    card = (out / "README.md").read_text()
    assert f'pipe.load_lora_weights("{out}")' in card and "LoRA adapters (rank 4" in card


@pytest.mark.slow
@pytest.mark.xdist_group("train_lora")
def test_sd_lora_loads_in_plain_diffusers_and_changes_output(sd_lora, assets):
    from diffusers import StableDiffusionPipeline

    def generate(pipe: Any) -> Any:
        return pipe("cute dragon creature", height=48, width=80, num_inference_steps=2, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images

    pipe = StableDiffusionPipeline.from_pretrained(assets["sd"])
    before = generate(pipe)
    pipe.load_lora_weights(str(sd_lora["out"]))
    after = generate(pipe)
    assert after.shape == (1, 48, 80, 3) and abs(after - before).max() > 1e-4


@pytest.mark.slow
@pytest.mark.xdist_group("train_lora")
def test_sd_lora_resume_is_bit_identical(sd_lora):
    out, resumed = sd_lora["out"], sd_lora["resumed"]
    a, b, mid = lora_file(out), lora_file(resumed), lora_file(out / "checkpoint-2")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], mid[k]) for k in a)  # the resumed run did train steps 3 and 4
    tail = [t for t in read_trace(out, 0) if t["step"] >= 2]
    assert [(t["rows"], t["loss"]) for t in read_trace(resumed, 0)] == [(t["rows"], t["loss"]) for t in tail]
    # the checkpoint holds the adapters only (plus optimizer, scheduler, sampler, RNG), not the UNet
    ckpt = out / "checkpoint-4"
    assert (ckpt / "pytorch_lora_weights.safetensors").exists() and not list(ckpt.glob("model*.safetensors"))


@pytest.mark.slow
@pytest.mark.xdist_group("train_lora")
def test_sd_lora_checkpoint_records_its_flags_and_a_resume_without_rank_is_one_line(sd_lora, assets, tmp_path):
    """Issue 34, items 1-2, on a real checkpoint: its state file records the LoRA flags; resumed without --rank (a
    full fine-tune) or with another rank, one line says so before anything loads, even for a checkpoint saved before
    the record (the rank is then read from the adapter file's header)."""
    from hf_arb.checks import UsageError
    from hf_arb.train.environment import check_environment

    out = tmp_path / "out"
    shutil.copytree(sd_lora["out"] / "checkpoint-2", out / "checkpoint-2")
    state_file = out / "checkpoint-2" / "hf_arb_state.json"
    state = json.loads(state_file.read_text())
    assert state["flags"]["rank"] == 4 and state["flags"]["lora_alpha"] == 4 and state["flags"]["resolution"] == "64"
    command = [*sd_readme_command(assets, out), "--resume_from_checkpoint", "latest"]
    for legacy in (False, True):
        if legacy:
            state_file.write_text(json.dumps({k: v for k, v in state.items() if k != "flags"}))
        for mode, fix in (([], "this run is a full fine-tune: pass --rank 4"), (["--rank", "8"], "pass --rank 4")):
            with pytest.raises(UsageError) as err:
                check_environment(script.parse_args([*command, *mode]))
            assert fix in str(err.value) and "\n" not in str(err.value) and "damaged" not in str(err.value)
        check_environment(script.parse_args(["--lora", *command]))  # the run's own flags resume


@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
def test_sdxl_text_encoder_lora_resume_two_processes_is_bit_identical(ddp_batch):
    """2 processes (gloo DDP), SDXL, adapters on the UNet and both text encoders, gradient accumulation 2
    (tests/_train_fixtures.py, in the suite's one 2-process launch)."""
    full = batch_result(ddp_batch, "sdxl-te-lora-full")["out"]
    resumed = batch_result(ddp_batch, "sdxl-te-lora-resumed")["out"]
    a, b, mid = lora_file(full), lora_file(resumed), lora_file(full / "checkpoint-2")
    assert {k.split(".")[0] for k in a} == {"unet", "text_encoder", "text_encoder_2"}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for prefix in ("unet.", "text_encoder.", "text_encoder_2."):  # every model's adapter trained after the resume
        assert any(not torch.equal(a[k], mid[k]) for k in a if k.startswith(prefix)), prefix
    for rank in (0, 1):
        tail = [t for t in read_trace(full, rank) if t["step"] >= 2]
        assert [(t["rows"], t["loss"]) for t in read_trace(resumed, rank)] == [(t["rows"], t["loss"]) for t in tail]


# --------------------------------------------------------------- slow: SDXL README text-encoder command
@pytest.mark.slow
@pytest.mark.xdist_group("train_lora_sdxl")
# peft, saving text-encoder adapters of a local model folder: it cannot tell whether the vocabulary changed
@pytest.mark.filterwarnings("ignore:Could not find a config file")
def test_sdxl_readme_text_encoder_command_trains_both_encoders(assets, tmp_path, monkeypatch):
    """README_sdxl.md's --train_text_encoder command, unchanged but for sizes, through the LoRA entry point (run as
    ``python <entry point> ...`` would, in this process)."""
    from diffusers import StableDiffusionXLPipeline

    out = tmp_path / "sd-naruto-model-lora-sdxl-txt"
    cmd = [sys.executable, str(LORA_WRAPPER), "--pretrained_model_name_or_path", assets["sdxl"],
           "--dataset_name", assets["images"], "--caption_column", "text", "--resolution", "64", "--random_flip",
           "--train_batch_size", "1", "--max_train_steps", "3", "--checkpointing_steps", "500",
           "--learning_rate", "1e-04", "--lr_scheduler", "constant", "--lr_warmup_steps", "0", "--seed", "42",
           "--output_dir", str(out), "--train_text_encoder", "--report_to", "none", "--bucket_step", "16"]
    # run as `python <wrapper> ...` would, in this process (the imports are paid already)
    monkeypatch.setattr(sys, "argv", cmd[1:])
    try:
        runpy.run_path(str(LORA_WRAPPER), run_name="__main__")
    except SystemExit as e:
        assert e.code in (0, None), f"the LoRA entry point exited with {e.code}"
    finally:
        test_train.reset_accelerate()
    weights = lora_file(out)
    for prefix in ("unet.", "text_encoder.", "text_encoder_2."):
        ups = [v for k, v in weights.items() if k.startswith(prefix) and (".up." in k or "lora_B" in k)]
        assert ups and any(float(v.abs().max()) > 0 for v in ups), prefix  # B starts at zero: it trained
    stats = json.loads((out / script.STATS_FILE).read_text())
    assert stats["family"] == "sdxl" and stats["lora"] and stats["global_step"] == 3
    pipe = StableDiffusionXLPipeline.from_pretrained(assets["sdxl"])
    pipe.load_lora_weights(str(out))
    image = pipe("a photo", height=48, width=80, num_inference_steps=2, output_type="np").images
    assert image.shape == (1, 48, 80, 3)


@pytest.mark.slow  # its own run: no group, so it can go to either worker
def test_lora_under_bf16_mixed_precision_trains_fp32_adapters(assets, tmp_path):
    stats = run_script(["--pretrained_model_name_or_path", assets["sd"], "--train_data_dir", assets["images"],
                        "--output_dir", str(tmp_path), *BASE, "--rank", "4", "--mixed_precision", "bf16",
                        "--max_train_steps", "2", "--checkpointing_steps", "100"])
    weights = lora_file(tmp_path)
    assert stats["global_step"] == 2 and all(v.dtype == torch.float32 for v in weights.values())
    ups = [v for k, v in weights.items() if ".up." in k or "lora_B" in k]
    assert ups and any(float(v.abs().max()) > 0 for v in ups)  # B starts at zero: the fp32 adapters were updated
