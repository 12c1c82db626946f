"""Z-Image in train_text_to_image_arb.py: detection, prompt encoding and the transformer convention (time
``1 - sigma``, negated output) equal to ``ZImagePipeline``'s, the per-bucket ``mu`` bit-identical to the pipeline's,
the bucket step refused by name, and (slow) tiny runs: full fine-tune and LoRA, cached prompt embeddings, an exact
resume on one and two processes, and every output loaded by stock diffusers without hf_arb at a non-square bucket.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import test_train
import torch
from _family_runs import (
    check_cached_lora,
    check_ddp_resume,
    check_full_resume,
    check_lora_targets_and_validation,
    check_stock_outputs,
    family_ddp_result,
    family_runs,
)
from _train_fixtures import FLOW

import train_text_to_image_arb as script
from hf_arb.families import detect_family, detect_flow_family, get_family
from hf_arb.families.flow import batch_sigmas
from hf_arb.families.flow_family import training_shift_config
from hf_arb.families.shift import bucket_shift_table

_clean_accelerate_state = test_train._clean_accelerate_state
CAPTIONS = ["a red fox in the snow", "two cats, 3 dogs!", "", "a very long caption " * 6]


@pytest.fixture(scope="session")
def zimage_assets(family_assets) -> dict[str, str]:
    """The tiny Z-Image pipeline of tests/conftest.py ``family_assets`` (shared with the 2-process batch)."""
    return {"zimage": family_assets["zimage"], "images": family_assets["images"]}


@pytest.fixture(scope="module")
def pipe(zimage_assets):
    from diffusers import ZImagePipeline

    return ZImagePipeline.from_pretrained(zimage_assets["zimage"])


# ------------------------------------------------------------------------------------------ fast: parts
def test_detected_from_the_checkpoint_and_the_hub_name_with_its_defaults(zimage_assets):
    assert detect_family(zimage_assets["zimage"]) == detect_flow_family(zimage_assets["zimage"]) == "zimage"
    assert detect_family("Tongyi-MAI/Z-Image-Turbo") == "zimage"
    args = script.parse_args(["--pretrained_model_name_or_path", zimage_assets["zimage"], "--train_data_dir", "d",
                              "--rank", "4"])
    assert args.family == "zimage" and args.output_dir == "zimage-model-finetuned-lora"
    assert args.shift_by_resolution is None  # the scheduler decides: Z-Image's shifts statically


@pytest.mark.parametrize("flag, message", [
    (["--train_text_encoder"], "--train_text_encoder: Z-Image trains the transformer only"),
    (["--snr_gamma", "5"], "--snr_gamma applies to SD 1.x/2.x/SDXL UNets"),
    (["--packing"], "--packing"),
])
def test_flags_that_do_not_apply_are_refused_by_name(zimage_assets, flag, message):
    with pytest.raises(script.UsageError, match=message):
        script.parse_args(["--pretrained_model_name_or_path", zimage_assets["zimage"], "--train_data_dir", "d",
                           "--rank", "4", *flag])


def test_prompt_encoding_equals_the_pipelines_and_each_caption_is_cacheable_alone(pipe):
    family = get_family("zimage")
    embeds, mask = family.encode_prompts([pipe.tokenizer], [pipe.text_encoder], CAPTIONS, "cpu", 24)
    assert embeds.shape == (4, 24, 16) and mask.shape == (4, 24)
    ref, _ = pipe.encode_prompt(list(CAPTIONS), device="cpu", do_classifier_free_guidance=False,
                                max_sequence_length=24)
    for i in range(len(CAPTIONS)):
        assert torch.equal(embeds[i][mask[i].bool()], ref[i])
    assert mask[3].all() and (embeds[mask == 0] == 0).all()  # the long caption is cut at 24 tokens
    for i, caption in enumerate(CAPTIONS):  # what --cache_text_embeddings memoises: one caption at a time
        alone, alone_mask = family.encode_prompts([pipe.tokenizer], [pipe.text_encoder], [caption], "cpu", 24)
        assert torch.equal(alone_mask[0], mask[i])
        torch.testing.assert_close(alone[0], embeds[i], rtol=1e-5, atol=1e-6)


def test_predict_is_the_velocity_the_pipelines_scheduler_steps_with(pipe):
    """One Euler step from sigma 1 to 0 moves the latents by -velocity: predict() must give exactly that velocity."""
    family = get_family("zimage")
    x = pipe.prepare_latents(1, 16, 48, 80, torch.float32, "cpu", torch.Generator().manual_seed(1))
    stepped = pipe("a wide photo", height=48, width=80, sigmas=[1.0], guidance_scale=0.0, output_type="latent",
                   generator=torch.Generator().manual_seed(1), max_sequence_length=24).images
    embeds, mask = family.encode_prompts([pipe.tokenizer], [pipe.text_encoder], ["a wide photo"], "cpu", 24)
    options = family.options(pipe.scheduler.config, pipe.transformer)
    with torch.no_grad():
        velocity = family.predict(pipe.transformer, x, torch.tensor([1.0]), embeds, mask, options)
    torch.testing.assert_close(velocity, x - stepped, rtol=1e-4, atol=1e-5)


SIZES = [(80, 48), (48, 96), (1024, 1024), (1344, 768), (768, 1344), (1536, 640)]  # (width, height)


def test_mu_per_bucket_is_bit_identical_to_the_pipelines(pipe):
    """hf_arb's mu for a bucket == ZImagePipeline's calculate_shift on the same image_seq_len; training sigmas equal
    the scheduler's: its static shift by default, each bucket's mu with --shift_by_resolution."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift

    c = pipe.scheduler.config
    table = bucket_shift_table(np.array(SIZES), training_shift_config(c, True), pipe.vae_scale_factor, 2)
    t = np.linspace(1.0, 1 / 8, 8)
    static = training_shift_config(c, by_resolution=None)
    assert not static.use_dynamic_shifting and static.shift == 3.0
    dynamic = FlowMatchEulerDiscreteScheduler.from_config(c, use_dynamic_shifting=True)
    for (w, h), seq, mu in zip(SIZES, table["image_seq_len"], table["mu"]):
        latents = pipe.prepare_latents(1, 16, h, w, torch.float32, "cpu", torch.Generator().manual_seed(0))
        image_seq_len = (latents.shape[2] // 2) * (latents.shape[3] // 2)  # as the pipeline counts
        assert int(seq) == image_seq_len
        expect = calculate_shift(image_seq_len, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                                 c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        assert float(mu) == expect, (w, h)
        pipe.scheduler.set_timesteps(sigmas=t, mu=expect)
        torch.testing.assert_close(batch_sigmas(torch.tensor(t, dtype=torch.float32), (h // 8, w // 8), 2, static),
                                   pipe.scheduler.sigmas[:-1], rtol=1e-6, atol=1e-7)
        dynamic.set_timesteps(sigmas=t, mu=expect)
        torch.testing.assert_close(batch_sigmas(torch.tensor(t, dtype=torch.float32), (h // 8, w // 8), 2,
                                                training_shift_config(c, True)), dynamic.sigmas[:-1], rtol=1e-6,
                                   atol=1e-7)


def test_a_bucket_step_off_the_packing_is_refused_naming_bucket_step(zimage_assets, tmp_path):
    argv = ["--pretrained_model_name_or_path", zimage_assets["zimage"], "--train_data_dir", zimage_assets["images"],
            "--output_dir", str(tmp_path), *FLOW, "--full_finetune", "--max_train_steps", "1"]
    argv[argv.index("--bucket_step") + 1] = "8"
    with pytest.raises(script.UsageError, match=r"not divisible by 16 .*For this Z-Image model: --bucket_step 16"):
        script.main(argv)


# ------------------------------------------------------------------------------------------ slow: training
@pytest.fixture(scope="module")
def zimage_runs(zimage_assets, shared_artifact) -> dict[str, Any]:
    return shared_artifact("zimage-runs", lambda root: family_runs(zimage_assets["zimage"], zimage_assets["images"],
                                                                   root))


@pytest.mark.slow
def test_full_fine_tune_trains_non_square_buckets_and_resumes_exactly(zimage_runs):
    check_full_resume(zimage_runs, "zimage", "ZImagePipeline", "Resolution shift: off, one static shift 3")


@pytest.mark.slow
def test_cached_prompt_embeddings_and_latents_match_the_on_the_fly_lora_run(zimage_runs):
    check_cached_lora(zimage_runs)


@pytest.mark.slow
def test_lora_adapts_the_attention_projections_and_validates_at_three_shapes(zimage_runs):
    check_lora_targets_and_validation(zimage_runs)


@pytest.mark.slow
def test_outputs_load_in_stock_diffusers_without_hf_arb_and_generate_at_a_trained_bucket(zimage_runs):
    check_stock_outputs(zimage_runs, "ZImagePipeline")


@pytest.fixture(scope="module")
def zimage_ddp(ddp_batch) -> dict[str, Any]:
    """The 2-process full run and its resume, from the shared 2-process batch (tests/_train_fixtures.py)."""
    return family_ddp_result(ddp_batch, "family-zimage")


@pytest.mark.slow
def test_two_processes_train_the_same_bucket_per_step_and_resume_exactly(zimage_ddp):
    check_ddp_resume(zimage_ddp)
