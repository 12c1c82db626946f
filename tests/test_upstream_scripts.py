"""The flags of diffusers' other dreambooth scripts (issue 35; hf_arb/train/flags/upstream_flags.py): every one is
accepted with upstream's meaning (tested here), accepted because it changes nothing here (tested: the parsed run is
the same), or refused in one line saying why and what to do. tests/test_train_dreambooth.py parses every flag of
every script at upstream's defaults; docs/training.md's audit has a row for each (tests/test_flag_audit.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import test_train
import torch
from test_train import run_script

import train_text_to_image_arb as script
from hf_arb.train.flags import upstream_flags

SD, SD3, FLUX, KONTEXT = "m", "org/stable-diffusion-3-medium", "black-forest-labs/FLUX.1-dev", \
    "black-forest-labs/FLUX.1-Kontext-dev"
FLUX2, KLEIN = "black-forest-labs/FLUX.2-dev", "black-forest-labs/FLUX.2-klein-4B"

assets = test_train.assets
_clean_accelerate_state = test_train._clean_accelerate_state


def parse(model: str, *extra: str):
    mode = [] if any(f in extra for f in ("--rank", "--full_finetune")) else ["--rank", "4"]
    return script.parse_args(["--pretrained_model_name_or_path", model, "--train_data_dir", "d", "--report_to", "none",
                              *mode, *extra])


# ------------------------------------------------------------------------------------------ refused, in one line
def _given(flag: str) -> list[str]:
    default = upstream_flags.REFUSED[flag][0]
    if default is False:
        return [f"--{flag}"]
    return [f"--{flag}", "12" if flag == "tokenizer_max_length" else "x"]


@pytest.mark.parametrize("flag", sorted(upstream_flags.REFUSED))
def test_a_refused_flag_says_why_in_one_line_and_its_default_passes(flag):
    with pytest.raises(script.UsageError) as err:
        parse(SD, *_given(flag))
    message = str(err.value)
    assert message.startswith(f"--{flag}") and "is not supported: " in message and "\n" not in message
    assert "Drop it" in message
    default = upstream_flags.REFUSED[flag][0]
    if default not in (None, False):  # upstream's default value (e.g. Qwen-Image's unused 4th encoder) changes nothing
        parse(SD, f"--{flag}", str(default))


# --do_fp8_training and --bnb_quantization_config_path work where their libraries run: tests/test_quantization.py


# ------------------------------------------------------------------------------------------ aliases and no-ops
def test_upstream_names_of_our_flags_are_the_same_setting():
    assert parse(KLEIN, "--caption_dropout", "0.1").proportion_empty_prompts == 0.1
    assert parse(KLEIN, "--caption_dropout", "0.1", "--proportion_empty_prompts", "0.1").proportion_empty_prompts == 0.1
    assert parse(KONTEXT, "--cond_image_column", "before").reference_image_column == ["before"]
    assert parse(SD, "--full_finetune", "--learning_rate", "1e-5", "--offset_noise").noise_offset == 0.1
    assert parse(SD, "--pre_compute_text_embeddings").cache_text_embeddings
    with pytest.raises(script.UsageError, match="--caption_dropout 0.1 and --proportion_empty_prompts 0.2 are the "
                                                "same setting: pass one"):
        parse(KLEIN, "--caption_dropout", "0.1", "--proportion_empty_prompts", "0.2")
    with pytest.raises(script.UsageError, match="both name the edit pair's reference image"):
        parse(KONTEXT, "--cond_image_column", "before", "--reference_image_column", "source")
    with pytest.raises(script.UsageError, match="takes no reference image"):  # our column's rule applies
        parse(FLUX, "--cond_image_column", "before")
    with pytest.raises(script.UsageError, match="--offset_noise is --noise_offset 0.1, but --noise_offset is 0.3"):
        parse(SD, "--offset_noise", "--noise_offset", "0.3")
    with pytest.raises(script.UsageError, match="--snr_gamma, --prediction_type, --noise_offset|noise_offset"):
        parse(FLUX, "--offset_noise")  # as --noise_offset: SD / SDXL only
    with pytest.raises(script.UsageError, match="--cache_text_embeddings keeps frozen text-encoder outputs"):
        parse(SD, "--pre_compute_text_embeddings", "--train_text_encoder")


@pytest.mark.parametrize("flag", ["--use_aspect_ratio_buckets", "--set_grads_to_none"])
def test_flags_that_change_nothing_here_parse_to_the_same_run(flag):
    plain, given = vars(parse(KLEIN)), vars(parse(KLEIN, flag))
    assert {k: v for k, v in given.items() if k != flag[2:]} == {k: v for k, v in plain.items() if k != flag[2:]}


@pytest.mark.parametrize("model, extra, message", [
    (SD, ["--text_encoder_out_layers", "1", "2"], "picks the hidden layers of Flux.2's text encoder"),
    (KLEIN, ["--text_encoder_out_layers", "-1"], "layer indices are >= 0"),
    (FLUX2, ["--vae_encode_mode", "mode"], "--vae_encode_mode applies to SD3 / Flux.1 / Kontext / Z-Image; Flux.2"),
    (SD, ["--vae_encode_mode", "mode"], "--vae_encode_mode applies to"),
    (FLUX, ["--vae_encode_mode", "mode", "--packing"], "--vae_encode_mode has no effect with --packing"),
    (SD, ["--skip_final_inference", "--final_validation_prompt", "a"], "which --skip_final_inference skips"),
    (SD, ["--validation_steps", "0"], "--validation_steps must be >= 1, got 0"),
])
def test_flags_of_some_families_or_modes_are_refused_elsewhere(model, extra, message):
    with pytest.raises(script.UsageError, match=message):
        parse(model, *extra)


def test_validation_flags_without_a_prompt_warn_once(caplog, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with caplog.at_level(logging.WARNING, logger=script.logger.name):
        parse(SD, "--validation_steps", "100", "--validation_scheduler", "DPMSolverMultistepScheduler")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("--validation_steps 100, --validation_scheduler "
                                                 "DPMSolverMultistepScheduler: no effect, there is no "
                                                 "--validation_prompt"), said


# ------------------------------------------------------------------------------------------ meanings
def test_text_encoder_out_layers_are_the_layers_the_pipeline_stacks(family_assets):
    """--text_encoder_out_layers: the prompt embeddings training sees equal Flux2KleinPipeline.encode_prompt's
    with the same text_encoder_out_layers (and, without the flag, the pipeline's default); a layer past the
    encoder: error naming the flag; validation and the model card pass the layers on."""
    from diffusers import Flux2KleinPipeline

    from hf_arb.families import get_family

    model = family_assets["flux2_klein"]
    pipe = Flux2KleinPipeline.from_pretrained(model)
    captions, cpu = ["a red fox", "a cat on a sofa"], torch.device("cpu")
    family = get_family("flux2_klein")
    args = parse(model, "--max_sequence_length", "16", "--text_encoder_out_layers", "3", "6", "27")
    models = family.load_models(args)
    assert models.options.text_layers == (3, 6, 27)
    ours, _ = family.encode_text(models, models.text_encoders, captions, cpu)
    theirs, _ = pipe.encode_prompt(captions, device=cpu, max_sequence_length=16, text_encoder_out_layers=(3, 6, 27))
    torch.testing.assert_close(ours, theirs)
    default, _ = family.encode_prompts(models.tokenizers, models.text_encoders, captions, cpu, 16)
    torch.testing.assert_close(default, pipe.encode_prompt(captions, device=cpu, max_sequence_length=16)[0])
    assert not torch.allclose(default, ours)
    assert upstream_flags.pipeline_call_kwargs(args) == {"text_encoder_out_layers": (3, 6, 27)}  # validation's call
    assert "`text_encoder_out_layers=(3, 6, 27)`" in " ".join(family.card_lines(args))  # the model card says so
    assert not any("text_encoder_out_layers" in line for line in family.card_lines(parse(model)))
    with pytest.raises(script.UsageError, match="--text_encoder_out_layers 3 28: .*has 27 layers"):
        family.out_layers(parse(model, "--text_encoder_out_layers", "3", "28"), models.text_encoders[0])


def test_vae_encode_mode_mode_trains_the_posterior_mean(tmp_path):
    """--vae_encode_mode mode (the Kontext script's default): the loss does not depend on the posterior's spread;
    sample (ours and the SD3 / Flux scripts') does. The later draws (noise, u) are the same in both modes."""
    from diffusers import FluxPipeline

    from hf_arb.families import get_family
    from hf_arb.families.flow import flow_loss
    from hf_arb.testing.tiny_flow import save_tiny_flux

    pipe = FluxPipeline.from_pretrained(save_tiny_flux(tmp_path / "flux"))
    family = get_family("flux")
    options = family.options(pipe.scheduler.config, pipe.transformer, max_sequence_length=8)
    embeds = (torch.randn(2, 8, pipe.transformer.config.joint_attention_dim),
              torch.randn(2, pipe.transformer.config.pooled_projection_dim))
    mean = torch.randn(2, 1, pipe.vae.config.latent_channels, 4, 4)

    def loss(mode, spread):
        stats = torch.cat([mean, torch.full_like(mean, spread)], dim=1)
        batch = {"latent_stats": stats, "captions": ["a", "b"]}
        with torch.no_grad():
            return float(flow_loss(family, options, pipe.transformer, batch, pipe.vae, lambda c: embeds,
                                   torch.Generator().manual_seed(0), torch.float32, 0.0, mode))

    assert loss("mode", 0.1) == loss("mode", 2.0) == loss("sample", 0.0)
    assert loss("sample", 0.1) != loss("sample", 2.0) and loss(None, 0.1) == loss("sample", 0.1)


def test_validation_scheduler_replaces_the_pipelines_from_its_config(assets):
    from diffusers import DDPMScheduler, StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(assets["sd"])
    before = pipe.scheduler.config
    upstream_flags.use_validation_scheduler(parse(SD, "--validation_scheduler", "DDPMScheduler"), pipe)
    assert type(pipe.scheduler) is DDPMScheduler and pipe.scheduler.config.beta_end == before.beta_end
    kept = pipe.scheduler
    upstream_flags.use_validation_scheduler(parse(SD), pipe)
    assert pipe.scheduler is kept  # no flag: the model's own


def test_offload_keeps_frozen_weights_off_the_modules_and_gives_the_same_outputs(assets):
    """--offload (accelerate.cpu_offload): while training, the frozen text encoder and VAE hold no weights of their
    own (meta tensors; the hooks bring them in when a layer runs) and compute the same; restore_frozen puts them
    back."""
    from diffusers import StableDiffusionPipeline

    from hf_arb.families import Models, get_family

    pipe = StableDiffusionPipeline.from_pretrained(assets["sd"])
    models = Models(get_family("sd"), None, [pipe.tokenizer], [pipe.text_encoder], pipe.vae, pipe.unet)
    ids = pipe.tokenizer(["a photo"], padding="max_length", max_length=77, return_tensors="pt").input_ids
    pixels = torch.rand(1, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        text_before, latents_before = pipe.text_encoder(ids)[0], pipe.vae.encode(pixels).latent_dist.mean
    weights = {k: v.clone() for k, v in pipe.text_encoder.state_dict().items()}
    args = parse(SD, "--offload")
    upstream_flags.offload_frozen(args, models, torch.device("cpu"))
    assert {p.device.type for p in pipe.text_encoder.parameters()} == {"meta"}
    assert {p.device.type for p in pipe.vae.parameters()} == {"meta"}
    with torch.no_grad():
        torch.testing.assert_close(pipe.text_encoder(ids)[0], text_before)
        torch.testing.assert_close(pipe.vae.encode(pixels).latent_dist.mean, latents_before)
    upstream_flags.restore_frozen(args, models)
    assert {p.device.type for p in pipe.text_encoder.parameters()} == {"cpu"}
    for k, v in pipe.text_encoder.state_dict().items():
        assert torch.equal(v, weights[k]), k


@pytest.mark.slow
def test_validation_steps_skip_final_inference_final_prompt_and_offload_runs(assets, tmp_path):
    """Two tiny SD full fine-tunes of 2 steps, the same seed. A: --validation_prompt, --validation_steps 1,
    --validation_scheduler DDPMScheduler, --skip_final_inference: a grid after steps 1 and 2, no final one. B:
    --offload, --final_validation_prompt and no --validation_prompt: the same losses as A, one final grid only, and
    the saved text encoder holds the base weights (restored from the offload hooks)."""
    from safetensors.torch import load_file

    base = ["--pretrained_model_name_or_path", assets["sd"], "--train_data_dir", assets["images"],
            *test_train.COMMON, "--max_train_steps", "2", "--num_validation_inference_steps", "1",
            "--num_validation_images", "1"]
    a = run_script([*base, "--output_dir", str(tmp_path / "a"), "--validation_prompt", "a cat",
                    "--validation_steps", "1", "--validation_epochs", "1000", "--validation_scheduler",
                    "DDPMScheduler", "--skip_final_inference"])
    grids = sorted(p.name for p in (tmp_path / "a" / "validation").iterdir())
    assert grids == ["step-000001.png", "step-000002.png"], grids
    b = run_script([*base, "--output_dir", str(tmp_path / "b"), "--offload", "--final_validation_prompt", "a dog"])
    assert b["losses"] == a["losses"] and len(b["losses"]) == 2
    assert [Path(p).name for p in b["validation_images"]] == ["step-000002.png"]
    assert sorted(p.name for p in (tmp_path / "b" / "validation").iterdir()) == ["step-000002.png"]
    assert "a dog" in (tmp_path / "b" / "README.md").read_text()
    saved = load_file(str(next((tmp_path / "b" / "text_encoder").glob("*.safetensors"))))
    base_te = load_file(str(next((Path(assets["sd"]) / "text_encoder").glob("*.safetensors"))))
    assert saved.keys() == base_te.keys() and all(torch.equal(saved[k], base_te[k]) for k in saved)
