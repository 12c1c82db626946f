"""SD3 and Flux in train_text_to_image_arb.py: family detection, prompt encoding and packing equal to the stock
pipelines', the per-bucket shift equal to the stock scheduler's, illegal bucket sizes refused, and (slow) tiny
models trained on two processes with synced buckets, resumed bit-exactly, cached latents, LoRA, and every output
loaded by stock diffusers without hf_arb.

The expensive parts are shared: the tiny models (tests/conftest.py) and one two-process run plus its resume per
family, both in the suite's one 2-process launch (``ddp_batch``, tests/_train_fixtures.py); most slow tests only
read their outputs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import test_train
import torch
from _family_runs import stock_generate
from _train_fixtures import FLOW, GROUP, batch_result
from test_train import read_trace, run_script

import train_text_to_image_arb as script
from hf_arb.families import FLOW_FAMILIES, detect_flow_family, family_names, get_family
from hf_arb.families.flow import batch_sigmas, unshifted_times
from hf_arb.families.flow_family import training_shift_config
from hf_arb.families.flux import latent_image_ids, pack_latents, unpack_latents

FAMILIES = ("sd3", "flux")
_clean_accelerate_state = test_train._clean_accelerate_state


def transformer_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "transformer" / "diffusion_pytorch_model.safetensors"))


def _jsonable(stats: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(stats, default=str))


# ------------------------------------------------------------------------------------------ fast: parts
def test_family_detected_from_the_checkpoint_with_its_defaults(flow_assets, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert set(FLOW_FAMILIES) <= set(family_names())
    assert detect_flow_family(flow_assets["sd3"]) == "sd3" and detect_flow_family(flow_assets["flux"]) == "flux"
    assert detect_flow_family("black-forest-labs/FLUX.1-dev") == "flux"
    assert detect_flow_family("stabilityai/stable-diffusion-3.5-large") == "sd3"
    assert detect_flow_family("stabilityai/stable-diffusion-xl-base-1.0") is None
    for family in FAMILIES:
        args = script.parse_args(["--pretrained_model_name_or_path", flow_assets[family], "--train_data_dir", "d",
                                  "--rank", "4"])
        assert args.family == family and args.output_dir == f"{family}-model-finetuned-lora"
        assert args.resolution == 1024 and args.shift_by_resolution is None  # None: the scheduler decides
    for flag, value in (("--shift_by_resolution", True), ("--no_shift_by_resolution", False)):
        args = script.parse_args(["--pretrained_model_name_or_path", flow_assets["flux"], "--train_data_dir", "d",
                                  "--rank", "4", flag])
        assert args.shift_by_resolution is value


@pytest.mark.parametrize("family, flag, message", [
    ("flux", ["--snr_gamma", "5"], "--snr_gamma applies to SD 1.x/2.x/SDXL UNets, but .* is FLUX"),
    ("sd3", ["--prediction_type", "v_prediction"], "--prediction_type applies to SD 1.x"),
    ("sd", ["--weighting_scheme", "logit_normal"], "--weighting_scheme applies to SD3 / Flux"),
    ("sd", ["--shift_by_resolution"], "--shift_by_resolution applies to SD3 / Flux"),
])
def test_flags_of_the_other_objective_are_errors(flow_assets, family, flag, message):
    model = flow_assets.get(family, "some/model")
    with pytest.raises(script.UsageError, match=message):
        script.parse_args(["--pretrained_model_name_or_path", model, "--train_data_dir", "d", "--full_finetune",
                           *flag])


def test_prompt_encoding_equals_the_stock_pipelines(flow_assets):
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    captions = ["a red fox in the snow", "two cats, 3 dogs!"]
    p = StableDiffusion3Pipeline.from_pretrained(flow_assets["sd3"])
    embeds, pooled = get_family("sd3").encode_prompts(
        [p.tokenizer, p.tokenizer_2, p.tokenizer_3], [p.text_encoder, p.text_encoder_2, p.text_encoder_3],
        captions, torch.device("cpu"), 77)
    ref = p.encode_prompt(captions, captions, captions, device="cpu", do_classifier_free_guidance=False,
                          max_sequence_length=77)
    assert embeds.shape == (2, 77 + 77, 64)
    assert torch.equal(embeds, ref[0]) and torch.equal(pooled, ref[2])
    f = FluxPipeline.from_pretrained(flow_assets["flux"])
    embeds, pooled = get_family("flux").encode_prompts([f.tokenizer, f.tokenizer_2], [f.text_encoder, f.text_encoder_2],
                                                       captions, torch.device("cpu"), 40)
    ref = f.encode_prompt(captions, captions, device="cpu", max_sequence_length=40)
    assert torch.equal(embeds, ref[0]) and torch.equal(pooled, ref[1])
    # Flux packing and position ids: the pipeline's public prepare_latents draws the same noise and packs it
    packed, ids = f.prepare_latents(2, 16, 48, 80, torch.float32, "cpu", torch.Generator().manual_seed(3))
    x = torch.randn(2, 16, 6, 10, generator=torch.Generator().manual_seed(3))
    assert torch.equal(pack_latents(x), packed) and torch.equal(latent_image_ids(6, 10), ids)
    assert torch.equal(unpack_latents(packed, 6, 10), x)


@pytest.mark.parametrize("scheme", ["none", "logit_normal", "sigma_sqrt", "cosmap"])
def test_the_exact_velocity_has_zero_loss_with_and_without_preconditioning(scheme):
    from hf_arb.families.flow import flow_matching_loss

    g = torch.Generator().manual_seed(0)
    x, noise = torch.randn(3, 16, 4, 6, generator=g), torch.randn(3, 16, 4, 6, generator=g)
    sigmas = torch.tensor([0.2, 0.5, 0.9])
    s = sigmas.view(-1, 1, 1, 1)
    noisy = (1 - s) * x + s * noise
    for precondition in (False, True):  # preconditioned: pred * -sigma + noisy = x exactly for the true velocity
        assert flow_matching_loss(noise - x, x, noise, noisy, sigmas, scheme, precondition) < 1e-10
        wrong = flow_matching_loss(noise, x, noise, noisy, sigmas, scheme, precondition)
        assert wrong > 0.1


SHIFT_SIZES = [(80, 48), (48, 96), (1024, 1024), (1344, 768), (512, 512)]  # (width, height)


@pytest.mark.parametrize("family", FAMILIES)
def test_training_shift_equals_the_stock_schedulers_for_each_bucket(flow_assets, family):
    """Training sigmas for a bucket = what the stock pipeline's scheduler computes for that height x width."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift as flux_shift
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
        calculate_shift as sd3_shift,
    )

    calculate_shift = flux_shift if family == "flux" else sd3_shift
    stock = FlowMatchEulerDiscreteScheduler.from_pretrained(flow_assets[family], subfolder="scheduler")
    cfg = training_shift_config(stock.config, by_resolution=None)  # the script's default
    assert cfg.use_dynamic_shifting == (family == "flux")
    # SD3 ships a static shift: --shift_by_resolution makes training (and the saved scheduler) shift dynamically
    cfg = training_shift_config(stock.config, by_resolution=True)
    sched = FlowMatchEulerDiscreteScheduler.from_config(stock.config, use_dynamic_shifting=True)
    t = np.linspace(1.0, 1 / 8, 8)  # the sigma grid FluxPipeline feeds set_timesteps
    c = sched.config
    for w, h in SHIFT_SIZES:
        seq = (h // 8 // 2) * (w // 8 // 2)  # the pipelines' image_seq_len
        mu = calculate_shift(seq, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
        sched.set_timesteps(sigmas=t, mu=mu)
        ours = batch_sigmas(torch.tensor(t, dtype=torch.float32), (h // 8, w // 8), 2, cfg)
        torch.testing.assert_close(ours, sched.sigmas[:-1], rtol=1e-6, atol=1e-7, msg=f"{family} {w}x{h}")
    # without the shift, training reads diffusers' scripts' table: the scheduler's own sigmas at (u * N)
    static = training_shift_config(stock.config, by_resolution=False)
    u = torch.rand(64, generator=torch.Generator().manual_seed(0))
    ours = batch_sigmas(unshifted_times(u, 1000), (6, 10), 2, static)
    torch.testing.assert_close(ours, stock.sigmas[(u * 1000).long()], rtol=1e-6, atol=1e-7)


def test_sd3_trained_with_the_per_bucket_shift_saves_a_dynamically_shifting_scheduler(flow_assets):
    from diffusers import SD3Transformer2DModel

    from hf_arb.families.flow import stock_pipeline

    family = get_family("sd3")
    transformer = SD3Transformer2DModel.from_pretrained(flow_assets["sd3"], subfolder="transformer")
    for by_resolution in (False, True):
        options = family.options({"shift": 3.0, "use_dynamic_shifting": False}, transformer,
                                 shift_by_resolution=by_resolution)
        assert (options.weighting_scheme, options.precondition_outputs, options.max_sequence_length) == \
            ("logit_normal", True, 77)  # diffusers' SD3 scripts' defaults
        pipe = stock_pipeline(family, options, flow_assets["sd3"], transformer)
        assert pipe.transformer is transformer
        assert bool(pipe.scheduler.config.use_dynamic_shifting) == by_resolution


def test_illegal_bucket_sizes_are_a_clear_error(flow_assets, tmp_path):
    argv = ["--pretrained_model_name_or_path", flow_assets["flux"], "--train_data_dir", flow_assets["images"],
            "--output_dir", str(tmp_path), *FLOW, "--full_finetune", "--max_train_steps", "1"]
    argv[argv.index("--bucket_step") + 1] = "8"  # budget buckets like 56x72: latents 7x9 cannot be patched
    with pytest.raises(script.UsageError, match=r"not divisible by 16 .*For this FLUX model: --bucket_step 16"):
        script.main(argv)


# ------------------------------------------------------------------------- slow: 2 processes + resume
def _flow_runs(batch: dict[str, Any], family: str) -> dict[str, Any]:
    """Full fine-tune on 2 processes (4 steps, checkpoint at 2), then a resume of checkpoint-2 to the end."""
    full, resumed = batch_result(batch, f"flow-{family}-full"), batch_result(batch, f"flow-{family}-resumed")
    return {"full": full["out"], "resumed": resumed["out"], "stats": full["stats"], "resumed_stats": resumed["stats"]}


@pytest.fixture(scope="module", params=FAMILIES)
def flow_run(request, ddp_batch) -> dict[str, Any]:
    return {"family": request.param, **_flow_runs(ddp_batch, request.param)}


@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
def test_two_ranks_train_the_same_bucket_at_every_step(flow_run):
    full = Path(flow_run["full"])
    r0, r1 = read_trace(full, 0), read_trace(full, 1)
    assert [t["step"] for t in r0] == [t["step"] for t in r1] == [0, 1, 2, 3]
    assert [t["bucket"] for t in r0] == [t["bucket"] for t in r1]
    assert [t["shape"] for t in r0] == [t["shape"] for t in r1]
    assert any(t["shape"][2] != t["shape"][3] for t in r0)  # a non-square bucket was trained
    for a, b in zip(r0, r1):
        assert not set(a["rows"]) & set(b["rows"])
    stats = flow_run["stats"]
    assert stats["num_processes"] == 2 and stats["family"] == flow_run["family"]
    assert json.loads((full / "model_index.json").read_text())["_class_name"] == get_family(
        flow_run["family"]).pipeline_class_name


@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
def test_resume_is_bit_exact(flow_run):
    full, resumed = Path(flow_run["full"]), Path(flow_run["resumed"])
    for rank in (0, 1):
        tail = [t for t in read_trace(full, rank) if t["step"] >= 2]
        again = read_trace(resumed, rank)
        assert [(t["step"], t["rows"], t["loss"]) for t in again] == [(t["step"], t["rows"], t["loss"]) for t in tail]
    a, b = transformer_weights(full), transformer_weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ckpt = transformer_weights(full / "checkpoint-2")
    assert any(not torch.equal(ckpt[k], a[k]) for k in a)  # steps 3-4 did change the weights


@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
def test_startup_report_shows_each_buckets_seq_len_and_the_pipelines_mu(flow_run):
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    log = flow_run["stats"]["log"]
    by_resolution = flow_run["family"] == "flux"  # Flux's scheduler shifts dynamically: on by default
    assert ("Resolution shift: per bucket" in log) == by_resolution
    assert ("Resolution shift: off, one static shift 3" in log) == (not by_resolution)
    rows = [line.split() for line in log.split("sigma(0.5)", 1)[1].splitlines()[1:10]]
    cfg = json.loads((Path(flow_run["full"]) / "scheduler" / "scheduler_config.json").read_text())
    for _, w, h, seq, mu, _ in rows:
        assert int(seq) == (int(h) // 16) * (int(w) // 16)
        expect = calculate_shift(int(seq), cfg["base_image_seq_len"], cfg["max_image_seq_len"], cfg["base_shift"],
                                 cfg["max_shift"])
        assert abs(float(mu) - expect) < 1e-4


# ----------------------------------------------------------------------- slow: LoRA and cached latents
def _lora_runs(flow_assets: dict[str, str], root: Path) -> dict[str, Any]:
    """One-process LoRA runs: SD3 (with validation at three bucket shapes), Flux on the fly and from cached latents."""
    out = {}
    for name, family, extra in (("sd3", "sd3", ["--validation_prompts", "a cat", "--num_validation_images", "1",
                                                "--num_validation_inference_steps", "1"]),
                                ("flux", "flux", []), ("flux_cached", "flux", ["--cache_latents"])):
        folder = root / name
        stats = run_script(["--pretrained_model_name_or_path", flow_assets[family], "--train_data_dir",
                            flow_assets["images"], *FLOW, "--rank", "4", "--learning_rate", "2e-2",
                            "--max_train_steps", "3", "--checkpointing_steps", "100", "--output_dir", str(folder),
                            *extra])
        out[name] = {"dir": str(folder), "stats": _jsonable(stats)}
    return out


@pytest.fixture(scope="module")
def lora_runs(flow_assets, shared_artifact) -> dict[str, Any]:
    return shared_artifact("flow-lora", lambda root: _lora_runs(flow_assets, root))


@pytest.mark.slow
def test_cached_latents_match_the_on_the_fly_run(lora_runs):
    fly, cached = lora_runs["flux"], lora_runs["flux_cached"]
    assert cached["stats"]["latents_encoded"] == 20 and fly["stats"]["latents_encoded"] is None
    assert [t["rows"] for t in read_trace(Path(cached["dir"]), 0)] == [t["rows"] for t in read_trace(Path(fly["dir"]),
                                                                                                      0)]
    np.testing.assert_allclose(cached["stats"]["losses"], fly["stats"]["losses"], rtol=2e-3)  # float16 cache


@pytest.mark.slow
def test_lora_writes_transformer_adapters_and_validates_at_three_shapes(lora_runs):
    from PIL import Image
    from safetensors.torch import load_file

    for name in ("sd3", "flux"):
        weights = load_file(str(Path(lora_runs[name]["dir"]) / "pytorch_lora_weights.safetensors"))
        assert weights and all(k.startswith("transformer.") and ".lora_" in k for k in weights), name
    assert any("ff_context" in k for k in weights)  # Flux: diffusers' dreambooth_lora_flux targets
    grid = Path(lora_runs["sd3"]["dir"]) / "validation" / "final-000003.png"
    assert Image.open(grid).size == (48 + 64 + 80, 80)  # portrait, square, landscape buckets side by side


# --------------------------------------------------------------------- slow: stock diffusers, no hf_arb
@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
def test_outputs_load_in_stock_diffusers_without_hf_arb(ddp_batch, lora_runs):
    runs = {f: _flow_runs(ddp_batch, f) for f in FAMILIES}
    folders = {"sd3": Path(runs["sd3"]["full"]), "flux": Path(runs["flux"]["full"]),
               "sd3_lora": Path(lora_runs["sd3"]["dir"]), "flux_lora": Path(lora_runs["flux"]["dir"]),
               # test_train_tiers.py's 2-process Flux run on 2 resolution tiers (curriculum), in the same interpreter
               "flux_tiers": Path(batch_result(ddp_batch, "tiers-flux-full")["out"])}
    results = stock_generate(folders)  # each card's snippet, in a process where `import hf_arb` fails
    for name, r in results.items():
        assert r["shape"] == [1, 48, 80, 3] and r["finite"], name
        assert r["cls"] == ("FluxPipeline" if name.startswith("flux") else "StableDiffusion3Pipeline"), name
    assert results["sd3_lora"]["lora_changes_output"] > 0 and results["flux_lora"]["lora_changes_output"] > 0
