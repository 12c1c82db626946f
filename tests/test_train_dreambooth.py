"""The flags of diffusers' dreambooth LoRA scripts, LoRA strength in stock diffusers, a missing tracker, and a resume
at or past ``--max_train_steps`` (issue 22; tests/upstream/ runs diffusers' own tests of these scripts).

``tests/fixtures/upstream_dreambooth_flags.json`` holds the argparse flags of every diffusers dreambooth script of
the families we claim (``scripts/extract_upstream_flags.py``'s ``DREAMBOOTH_SCRIPTS``: SD, SDXL, SD3, Flux.1, Kontext,
Flux.2 dev / klein and their img2img, Qwen-Image, Z-Image; huggingface/diffusers @ 58eb52c0), written by
``python scripts/extract_upstream_flags.py --git_dir <diffusers.git> --dreambooth``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from pathlib import Path

import pytest
import test_train
import torch
from test_train import ROOT, run_script

import train_text_to_image_arb as script
from hf_arb.families import Models, get_family  # noqa: E402
from hf_arb.train.flags import arg_checks as train_arg_checks  # noqa: E402
from hf_arb.train.flags import args as train_args  # noqa: E402
from hf_arb.train.sources import dataset as train_data  # noqa: E402

UPSTREAM = json.loads((ROOT / "tests" / "fixtures" / "upstream_dreambooth_flags.json").read_text())
#: upstream script → (our family, the pipeline class its model_index.json names, LoRA)
FAMILY = {"train_dreambooth.py": ("sd", "StableDiffusionPipeline", False),
          "train_dreambooth_lora.py": ("sd", "StableDiffusionPipeline", True),
          "train_dreambooth_lora_sdxl.py": ("sdxl", "StableDiffusionXLPipeline", True),
          "train_dreambooth_sd3.py": ("sd3", "StableDiffusion3Pipeline", False),
          "train_dreambooth_lora_sd3.py": ("sd3", "StableDiffusion3Pipeline", True),
          "train_dreambooth_flux.py": ("flux", "FluxPipeline", False),
          "train_dreambooth_lora_flux.py": ("flux", "FluxPipeline", True),
          "train_dreambooth_lora_flux_kontext.py": ("flux-kontext", "FluxKontextPipeline", True),
          "train_dreambooth_lora_flux2.py": ("flux2", "Flux2Pipeline", True),
          "train_dreambooth_lora_flux2_klein.py": ("flux2_klein", "Flux2KleinPipeline", True),
          "train_dreambooth_lora_flux2_img2img.py": ("flux2", "Flux2Pipeline", True),
          "train_dreambooth_lora_flux2_klein_img2img.py": ("flux2_klein", "Flux2KleinPipeline", True),
          "train_dreambooth_lora_qwen_image.py": ("qwenimage", "QwenImagePipeline", True),
          "train_dreambooth_lora_z_image.py": ("zimage", "ZImagePipeline", True)}

assets = test_train.assets  # the session's tiny SD / SDXL and photo folder
_clean_accelerate_state = test_train._clean_accelerate_state


@contextlib.contextmanager
def _threads(n: int):
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models train fastest on one thread per xdist worker (two workers with two threads each on two cores
    spend most of their time waiting for each other)."""
    with _threads(1):
        yield


def fake_model(root: Path, family: str, pipeline: str) -> str:
    """A folder whose configs say the family (all parse_args reads)."""
    folder = root / family
    (folder / "unet").mkdir(parents=True, exist_ok=True)
    (folder / "unet" / "config.json").write_text(json.dumps({"addition_embed_type": "text_time"} if family == "sdxl"
                                                            else {}))
    (folder / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    return str(folder)


# ------------------------------------------------------------------------------------ fast: the flags
def test_the_fixture_is_every_script_the_extractor_names():
    """The fixture holds every dreambooth script of scripts/extract_upstream_flags.py, and this test maps each one."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import extract_upstream_flags

    assert list(UPSTREAM["scripts"]) == list(extract_upstream_flags.DREAMBOOTH_SCRIPTS)
    assert set(FAMILY) == set(UPSTREAM["scripts"])


@pytest.mark.parametrize("upstream", list(FAMILY))
def test_every_dreambooth_flag_is_accepted_at_upstream_default(upstream, tmp_path, monkeypatch):
    """Every flag of the upstream script exists here, and a command passing each one at upstream's default parses
    in that script's family and mode (the refused ones are refused only when they would change something: below)."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    family, pipeline, lora = FAMILY[upstream]
    flags = UPSTREAM["scripts"][upstream]
    ours = {s[2:] for a in train_args.build_parser()._actions for s in a.option_strings if s.startswith("--")}
    assert len(flags) > 55 and not sorted(set(flags) - ours)
    te = lora and "train_text_encoder" in flags and family not in ("flux2", "flux2_klein")
    argv = ["--pretrained_model_name_or_path", fake_model(tmp_path, family, pipeline), "--instance_data_dir",
            str(tmp_path), "--instance_prompt", "photo of sks dog", *(["--rank", "4"] if lora else ["--full_finetune"]),
            *(["--train_text_encoder"] if te else [])]
    given = {"pretrained_model_name_or_path", "instance_data_dir", "instance_prompt", "rank", "train_text_encoder"}
    for name, spec in flags.items():
        if name in given or spec["default"] is None or spec["action"] == "store_true" or isinstance(
                spec["default"], dict):
            continue
        values = spec["default"] if isinstance(spec["default"], list) else [spec["default"]]
        argv += [f"--{name}", *(str(v) for v in values)]
    args = script.parse_args(argv)
    assert args.lora == lora and args.family == family and args.instance_prompt == "photo of sks dog"
    assert args.learning_rate == flags["learning_rate"]["default"]
    if te and "text_encoder_lr" in flags:
        assert args.text_encoder_lr == flags["text_encoder_lr"]["default"]


def _changed(flag: str, default: object) -> list[str]:
    """The flag with a value other than its default."""
    if default is False:
        return [f"--{flag}"]
    if default is True:  # upstream's type=bool flags: only an empty string is False
        return [f"--{flag}", ""]
    return [f"--{flag}", "0.5" if flag == "prodigy_beta3" else "x" if default is None else "2"]


@pytest.mark.parametrize("flag", sorted(train_arg_checks.UNSUPPORTED_DREAMBOOTH_FLAGS))
def test_unsupported_dreambooth_flags_are_refused_in_one_line_saying_why(flag):
    default = train_arg_checks.UNSUPPORTED_DREAMBOOTH_FLAGS[flag][0]
    with pytest.raises(script.UsageError) as err:
        script.parse_args(["--pretrained_model_name_or_path", "m", "--instance_data_dir", "d", "--instance_prompt",
                           "p", "--rank", "4", *_changed(flag, default)])
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"--{flag}") and "not supported" in message
    assert message.endswith(f"Drop --{flag}.")


@pytest.mark.parametrize("extra, message", [
    (["--optimizer", "sgd"], "--optimizer sgd: the optimizers are AdamW and prodigy"),
    (["--dataset_name", "x"], "--instance_data_dir d and --dataset_name both name the training data"),
    (["--lora_blocks", "0,a"], "--lora_blocks '0,a': expected comma-separated block indices"),
    (["--text_encoder_lr", "1e-5"], "--text_encoder_lr configures the text encoders' LoRA: add --train_text_encoder"),
])
def test_dreambooth_flag_mistakes(extra, message):
    with pytest.raises(script.UsageError, match=message):  # (an SD3 Hub id: --lora_blocks is SD3 / Flux only)
        script.parse_args(["--pretrained_model_name_or_path", "org/stable-diffusion-3-medium", "--instance_data_dir",
                           "d", "--instance_prompt", "p", "--rank", "4", *extra])
    with pytest.raises(script.UsageError, match="needs --instance_prompt .* or --caption_column"):
        script.parse_args(["--pretrained_model_name_or_path", "m", "--instance_data_dir", "d", "--rank", "4"])


def test_instance_folder_takes_one_prompt_or_its_caption_column_and_repeats(assets):
    """A folder of images + --instance_prompt: every caption is the prompt (the folder's own captions are not used,
    as upstream); --caption_column over the folder: its captions; --repeats N: every row N times."""
    base = ["--pretrained_model_name_or_path", "m", "--instance_data_dir", assets["images"], "--rank", "4"]
    ds = train_data.load_raw_dataset(script.parse_args([*base, "--instance_prompt", "photo of sks", "--repeats", "2"]))
    assert len(ds) == 40 and set(ds["text"]) == {"photo of sks"}
    own = train_data.load_raw_dataset(script.parse_args([*base, "--caption_column", "text"]))
    assert len(own) == 20 and len(set(own["text"])) > 1 and "photo of sks" not in own["text"]


def test_zero_validation_images_turn_validation_off():
    args = script.parse_args(["--pretrained_model_name_or_path", "m", "--train_data_dir", "d", "--rank", "4",
                              "--validation_prompt", "a cat", "--num_validation_images", "0"])
    assert args.validation_prompts is None
    with pytest.raises(script.UsageError, match="--num_validation_images must be >= 0, got -1"):
        script.parse_args(["--pretrained_model_name_or_path", "m", "--train_data_dir", "d", "--rank", "4",
                           "--num_validation_images", "-1"])


def test_use_dora_trains_dora_adapters(assets):
    """--use_dora (train_dreambooth_lora_sdxl.py): DoRA adapters, a trained magnitude vector per layer."""
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(assets["sd"], subfolder="unet")
    models = Models(get_family("sd"), None, [], [], None, unet)
    args = script.parse_args(["--pretrained_model_name_or_path", "m", "--train_data_dir", "d", "--rank", "2",
                              "--use_dora"])
    script.setup_lora(args, models, torch.float32)
    assert any("lora_magnitude_vector" in n and p.requires_grad for n, p in unet.named_parameters())
    assert unet.peft_config["default"].use_dora


def test_text_encoder_lr_and_weight_decay_are_the_encoders_parameter_group(assets):
    """--text_encoder_lr / --adam_weight_decay_text_encoder set the encoders' optimizer group, as upstream; without
    them the encoders train with --learning_rate and --adam_weight_decay (train_text_to_image_lora_sdxl.py)."""
    from diffusers import StableDiffusionPipeline

    base = ["--pretrained_model_name_or_path", "m", "--train_data_dir", "d", "--rank", "2", "--train_text_encoder"]
    for extra, group in (([], {}), (["--text_encoder_lr", "5e-6", "--adam_weight_decay_text_encoder", "1e-3"],
                                    {"lr": 5e-6, "weight_decay": 1e-3})):
        pipe = StableDiffusionPipeline.from_pretrained(assets["sd"])
        models = Models(get_family("sd"), None, [pipe.tokenizer], [pipe.text_encoder], None, pipe.unet)
        args = script.parse_args([*base, *extra])
        groups = script.setup_lora(args, models, torch.float32)
        optimizer = script.make_optimizer(args, groups)
        unet_group, te_group = optimizer.param_groups
        assert unet_group["lr"] == args.learning_rate and unet_group["weight_decay"] == args.adam_weight_decay
        assert te_group["lr"] == group.get("lr", args.learning_rate)
        assert te_group["weight_decay"] == group.get("weight_decay", args.adam_weight_decay)
        assert te_group["params"] and all(p.requires_grad for p in te_group["params"])


def test_a_missing_tracker_warns_once_and_training_goes_on(monkeypatch, caplog, tmp_path):
    """The default --report_to tensorboard, not installed: one warning, then no tracker (accelerate's behaviour)."""
    monkeypatch.setitem(train_arg_checks.TRACKERS, "tensorboard", ("no_such_module_for_issue_22",))
    model = tmp_path / "model"  # a local model folder: a Hub id is looked up (and refused offline) by this check
    model.mkdir()
    (model / "model_index.json").write_text("{}")
    args = script.parse_args(["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(tmp_path),
                              "--learning_rate", "1e-5", "--output_dir", str(tmp_path / "out")])
    with caplog.at_level(logging.WARNING, logger=script.logger.name):
        script.check_environment(args)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "--report_to tensorboard" in warnings[0] and "pip install" in warnings[0]
    assert args.report_to == "none"


# ------------------------------------------------------------------- runs: strength in stock diffusers
@pytest.fixture(scope="session")
def sd_lora_alpha(assets, shared_artifact) -> Path:
    """An SD LoRA trained with --rank 4 --lora_alpha 8 (one step). Shared: test_portable_outputs.py loads it in a
    process where ``import hf_arb`` fails and checks its strength there (2.0)."""
    def build(root: Path) -> str:
        out = root / "out"
        with _threads(1):
            run_script(["--pretrained_model_name_or_path", assets["sd"], "--train_data_dir", assets["images"],
                        "--resolution", "64", "--bucket_step", "16", "--train_batch_size", "4", "--max_train_steps",
                        "1", "--rank", "4", "--lora_alpha", "8", "--report_to", "none", "--seed", "0",
                        "--output_dir", str(out)])
        return str(out)

    return Path(shared_artifact("train-sd-lora-alpha", build))


def _lora_module(model: torch.nn.Module) -> tuple[str, torch.nn.Module]:
    return next((n, m) for n, m in model.named_modules() if hasattr(m, "lora_A") and len(m.lora_A))


def assert_strength(model: torch.nn.Module, expected: float) -> None:
    """A loaded adapter's layer adds exactly ``expected * B(A(x))`` to its base layer's output."""
    name, module = _lora_module(model)
    adapter = next(iter(module.lora_A))
    x = torch.randn(3, module.base_layer.in_features)
    with torch.no_grad():
        delta = module(x) - module.base_layer(x)
        manual = module.lora_B[adapter](module.lora_A[adapter](x))
    assert float(manual.abs().max()) > 0, name
    torch.testing.assert_close(delta, expected * manual, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", ["sd", "sd3", "flux"])
def test_lora_alpha_and_text_encoder_adapters_load_at_trained_strength_in_stock_diffusers(family, assets, tmp_path,
                                                                                           request):
    """--rank 4 --lora_alpha 8 --train_text_encoder: a plain ``load_lora_weights`` of the saved file (no hf_arb code
    involved) rebuilds every adapter at scale alpha / r = 2, the transformer's and the CLIP encoders' (SD3 both, Flux
    its one; T5 none), as diffusers' own scripts' files load. SD3 / Flux: a run resumed from its step-1 checkpoint
    (text-encoder adapters saved in peft's key names, as upstream) ends with the same weights."""
    import shutil

    import diffusers
    from safetensors.torch import load_file

    model = assets["sd"] if family == "sd" else request.getfixturevalue("flow_assets")[family]
    out = tmp_path / "out"
    argv = ["--pretrained_model_name_or_path", model, "--train_data_dir", assets["images"], "--resolution", "64",
            "--bucket_step", "16", "--train_batch_size", "4", "--rank", "4", "--lora_alpha", "8",
            "--train_text_encoder", "--report_to", "none", "--seed", "0", "--checkpointing_steps", "1",
            *(["--max_sequence_length", "16"] if family != "sd" else [])]
    steps = "1" if family == "sd" else "2"
    run_script([*argv, "--max_train_steps", steps, "--output_dir", str(out)])
    if family != "sd":
        resumed = tmp_path / "resumed"
        shutil.copytree(out / "checkpoint-1", resumed / "checkpoint-1")
        run_script([*argv, "--max_train_steps", steps, "--output_dir", str(resumed), "--resume_from_checkpoint",
                    "latest"])
        a, b = (load_file(str(o / "pytorch_lora_weights.safetensors")) for o in (out, resumed))
        assert a.keys() == b.keys() and any(k.startswith("text_encoder") for k in a)
        assert all(torch.equal(a[k], b[k]) for k in a)
    cls = {"sd": diffusers.StableDiffusionPipeline, "sd3": diffusers.StableDiffusion3Pipeline,
           "flux": diffusers.FluxPipeline}[family]
    pipe = cls.from_pretrained(model)
    pipe.load_lora_weights(str(out))
    assert_strength(pipe.unet if family == "sd" else pipe.transformer, 2.0)
    trained = {"sd": ["text_encoder"], "sd3": ["text_encoder", "text_encoder_2"], "flux": ["text_encoder"]}[family]
    for name in trained:
        assert_strength(getattr(pipe, name), 2.0)
    frozen = {"sd3": "text_encoder_3", "flux": "text_encoder_2"}.get(family)
    if frozen:
        assert not any(hasattr(m, "lora_A") for m in getattr(pipe, frozen).modules())


def test_resume_at_max_train_steps_trains_nothing_more(assets, tmp_path, caplog, monkeypatch):
    """Upstream trains one step past --max_train_steps when resumed beyond it (a checkpoint-5 after resuming
    checkpoint-4 with --max_train_steps 2); here the run stops, says so once, and the output is the checkpoint's.
    (The run also passes the dreambooth scripts' --lr_num_cycles / --lr_power: diffusers' get_scheduler gets them.)"""
    import diffusers.optimization
    from safetensors.torch import load_file

    calls: list[dict] = []
    real = diffusers.optimization.get_scheduler
    monkeypatch.setattr(diffusers.optimization, "get_scheduler", lambda *a, **kw: calls.append(kw) or real(*a, **kw))

    out = tmp_path / "out"
    argv = ["--pretrained_model_name_or_path", assets["sd"], "--train_data_dir", assets["images"], "--resolution", "64",
            "--bucket_step", "16", "--train_batch_size", "4", "--rank", "4", "--report_to", "none", "--seed", "0",
            "--checkpointing_steps", "2", "--output_dir", str(out), "--lr_scheduler", "cosine_with_restarts",
            "--lr_num_cycles", "3", "--lr_power", "2.0"]
    run_script([*argv, "--max_train_steps", "2"])
    assert calls and calls[0]["num_cycles"] == 3 and calls[0]["power"] == 2.0
    with caplog.at_level(logging.WARNING, logger=script.logger.name):
        stats = run_script([*argv, "--max_train_steps", "1", "--resume_from_checkpoint", "checkpoint-2"])
    assert stats["global_step"] == 2 and stats["losses"] == []
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert any("at or past --max_train_steps 1" in r.getMessage() for r in caplog.records)
    final, saved = load_file(str(out / "pytorch_lora_weights.safetensors")), load_file(
        str(out / "checkpoint-2" / "pytorch_lora_weights.safetensors"))
    assert final.keys() == saved.keys() and all(torch.equal(final[k], saved[k]) for k in final)
