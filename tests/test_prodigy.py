"""``--optimizer prodigy`` and ``--output_kohya_format`` (issue 36, item 5): diffusers' dreambooth LoRA scripts'
optimizer flags, read as upstream reads them; Prodigy built with upstream's arguments; a resumed run equal to the
uninterrupted one (Prodigy's step-size estimate is in the checkpoint); a resume with the other optimizer refused in
one line; the kohya-format LoRA file generating what the diffusers one does in stock diffusers."""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import train_text_to_image_arb as script  # noqa: E402
from hf_arb.checks import UsageError  # noqa: E402
from hf_arb.train.models import make_optimizer  # noqa: E402


def parse(*extra: str):
    return script.parse_args(["--pretrained_model_name_or_path", "m", "--instance_data_dir", "d", "--instance_prompt",
                              "p", "--rank", "4", "--report_to", "none", *extra])


# ------------------------------------------------------------------------------------- flags
def test_prodigy_flags_read_as_upstream_reads_them():
    args = parse("--optimizer", "prodigy", "--learning_rate", "1.0", "--prodigy_beta3", "0.9",
                 "--prodigy_decouple", "", "--prodigy_use_bias_correction", "True")
    assert (args.optimizer, args.prodigy_beta3, args.prodigy_decouple, args.prodigy_use_bias_correction,
            args.prodigy_safeguard_warmup) == ("prodigy", 0.9, False, True, True)
    assert parse("--optimizer", "Prodigy", "--learning_rate", "1.0").optimizer == "Prodigy"  # upstream's .lower()
    assert parse("--optimizer", "AdamW", "--prodigy_decouple", "True").prodigy_decouple is True  # at the default


@pytest.mark.parametrize("extra, message", [
    (["--optimizer", "sgd"], "--optimizer sgd: the optimizers are AdamW and prodigy"),
    (["--prodigy_beta3", "0.5"], "--prodigy_beta3 0.5 has no effect in this run: it configures --optimizer prodigy"),
    (["--prodigy_safeguard_warmup", ""], "--prodigy_safeguard_warmup '' has no effect in this run"),
    (["--optimizer", "prodigy", "--prodigy_decouple", "False"],
     "--prodigy_decouple False: diffusers' scripts declare it type=bool, which reads every non-empty value as True"),
    (["--optimizer", "prodigy", "--prodigy_use_bias_correction", "maybe"], "pass True, or '' for False"),
    (["--optimizer", "prodigy", "--use_8bit_adam"], "--use_8bit_adam is bitsandbytes' 8-bit AdamW"),
])
def test_optimizer_flag_mistakes_are_one_line(extra, message):
    with pytest.raises(UsageError) as err:
        parse(*extra)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_without_prodigyopt_one_line_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "prodigyopt", None)  # what an environment without the package answers
    with pytest.raises(UsageError) as err:
        parse("--optimizer", "prodigy")
    assert "--optimizer prodigy needs the prodigyopt package: pip install prodigyopt" in str(err.value)
    args = parse("--learning_rate", "1.0")
    args.optimizer = "prodigy"  # past the flag check: building the optimizer says the same
    with pytest.raises(UsageError, match="pip install prodigyopt"):
        make_optimizer(args, [torch.nn.Parameter(torch.zeros(2))])


@pytest.mark.parametrize("model, extra, message", [
    ("m", ["--full_finetune", "--learning_rate", "1e-5"], "this is a full fine-tune: add --rank N, or drop it"),
    ("black-forest-labs/FLUX.1-dev", ["--rank", "4"], "black-forest-labs/FLUX.1-dev is FLUX, or drop it"),
])
def test_kohya_format_is_a_sd_or_sdxl_lora(model, extra, message):
    with pytest.raises(UsageError) as err:
        script.parse_args(["--pretrained_model_name_or_path", model, "--train_data_dir", "d", "--report_to", "none",
                           "--output_kohya_format", *extra])
    assert message in str(err.value) and "--output_kohya_format converts a LoRA of SD / SDXL" in str(err.value)
    assert parse("--output_kohya_format").output_kohya_format


def test_upstream_warnings_low_learning_rate_and_text_encoder_lr(caplog):
    with caplog.at_level(logging.WARNING, logger="train_text_to_image_arb"):
        parse("--optimizer", "prodigy", "--learning_rate", "1e-4", "--train_text_encoder", "--text_encoder_lr", "5e-6")
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "--learning_rate 0.0001 with --optimizer prodigy" in said and "around 1.0" in said
    assert "--text_encoder_lr 5e-06 with --optimizer prodigy: Prodigy uses --learning_rate 0.0001" in said


def test_prodigy_is_built_with_upstreams_arguments():
    import prodigyopt

    args = parse("--optimizer", "prodigy", "--learning_rate", "1.0", "--prodigy_beta3", "0.8", "--prodigy_decouple",
                 "", "--adam_beta1", "0.8", "--adam_weight_decay", "0.01", "--adam_epsilon", "1e-7",
                 "--train_text_encoder", "--text_encoder_lr", "5e-6")
    unet, te = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    opt = make_optimizer(args, [{"params": [unet]}, {"params": [te], "lr": 5e-6, "weight_decay": 1e-3}])
    assert isinstance(opt, prodigyopt.Prodigy)
    g0, g1 = opt.param_groups
    assert (g0["lr"], g0["betas"], g0["beta3"], g0["eps"], g0["weight_decay"], g0["decouple"],
            g0["use_bias_correction"], g0["safeguard_warmup"]) == (1.0, (0.8, 0.999), 0.8, 1e-7, 0.01, False, True,
                                                                    True)
    assert g1["lr"] == 1.0 and g1["weight_decay"] == 1e-3  # upstream: the encoders at --learning_rate under prodigy


# ------------------------------------------------------------------------------------- resume
@pytest.mark.slow
def test_prodigy_resume_equals_the_uninterrupted_run_and_another_optimizer_is_refused(tmp_path, train_assets):
    """LoRA with Prodigy, 4 steps, a checkpoint at 2: resumed from it in a new folder, the run replays steps 3-4 with
    the same rows and losses and ends on bit-identical adapters and optimizer state. Resuming it with AdamW stops in
    one line before anything loads. The run's --output_kohya_format file (lora_alpha 8, rank 4) generates in stock
    diffusers what its diffusers-format file generates."""
    from safetensors.torch import load_file
    from test_train import read_trace, run_script

    from hf_arb.train.environment import check_environment

    def command(out: Path) -> list[str]:
        return ["--pretrained_model_name_or_path", train_assets["sd"], "--train_data_dir", train_assets["images"],
                "--resolution", "64", "--bucket_step", "16", "--train_batch_size", "2", "--report_to", "none",
                "--seed", "0", "--lr_warmup_steps", "0", "--log_batches", "--rank", "4", "--optimizer", "prodigy",
                "--learning_rate", "1.0", "--max_train_steps", "4", "--checkpointing_steps", "2", "--lora_alpha", "8",
                "--cache_dir", str(tmp_path / "cache"), "--output_dir", str(out)]

    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run_script([*command(full), "--output_kohya_format"])
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    run_script([*command(resumed), "--resume_from_checkpoint", "latest"])
    a, b = (load_file(str(f / "pytorch_lora_weights.safetensors")) for f in (full, resumed))
    mid = load_file(str(full / "checkpoint-2" / "pytorch_lora_weights.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], mid[k]) for k in a)  # steps 3 and 4 trained after the resume
    tail = [(t["rows"], t["loss"]) for t in read_trace(full, 0) if t["step"] >= 2]
    assert [(t["rows"], t["loss"]) for t in read_trace(resumed, 0)] == tail
    mid_state, end, end_resumed = (torch.load(f / "optimizer.bin", weights_only=False) for f in (
        full / "checkpoint-2", full / "checkpoint-4", resumed / "checkpoint-4"))
    group = mid_state["param_groups"][0]
    assert group["k"] == 2 and group["d_numerator"] != 0.0  # Prodigy's running sums, not AdamW's moments
    assert {"p0", "s", "exp_avg", "exp_avg_sq"} <= set(next(iter(mid_state["state"].values())))
    scalars = ("k", "d", "d_max", "d_numerator", "lr")
    assert [{k: g[k] for k in scalars} for g in end["param_groups"]] == [
        {k: g[k] for k in scalars} for g in end_resumed["param_groups"]]  # the step-size estimate, restored exactly
    same = [torch.equal(v, end_resumed["state"][i][k]) if torch.is_tensor(v) else v == end_resumed["state"][i][k]
            for i in end["state"] for k, v in end["state"][i].items()]
    assert same and all(same)
    with pytest.raises(UsageError) as err:
        check_environment(script.parse_args([f for f in command(resumed) if f not in ("--optimizer", "prodigy")]
                                            + ["--resume_from_checkpoint", "latest"]))
    assert "it was saved with --optimizer prodigy, this run has --optimizer AdamW: pass --optimizer prodigy" in str(
        err.value) and "\n" not in str(err.value)
    from diffusers import StableDiffusionPipeline

    from hf_arb.train.lora import KOHYA_WEIGHTS_NAME

    kohya = load_file(str(full / KOHYA_WEIGHTS_NAME))
    assert kohya and all(k.startswith("lora_unet_") for k in kohya)
    assert {float(v) for k, v in kohya.items() if k.endswith(".alpha")} == {8.0}  # the trained alpha, not the rank

    def generate(weights: str) -> torch.Tensor:
        pipe = StableDiffusionPipeline.from_pretrained(train_assets["sd"])
        pipe.load_lora_weights(str(full), weight_name=weights)
        return torch.from_numpy(pipe("a photo", height=48, width=80, num_inference_steps=2, output_type="np",
                                     generator=torch.Generator().manual_seed(0)).images)

    base = torch.from_numpy(StableDiffusionPipeline.from_pretrained(train_assets["sd"])(
        "a photo", height=48, width=80, num_inference_steps=2, output_type="np",
        generator=torch.Generator().manual_seed(0)).images)
    ours, theirs = generate("pytorch_lora_weights.safetensors"), generate(KOHYA_WEIGHTS_NAME)
    assert (ours - base).abs().max() > 1e-4 and torch.allclose(ours, theirs, atol=1e-5)
