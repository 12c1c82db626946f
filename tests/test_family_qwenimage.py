"""Qwen-Image in train_text_to_image_arb.py: detection, prompt encoding / packing / the VAE's frame axis equal to
``QwenImagePipeline``'s, the per-bucket ``mu`` bit-identical to the pipeline's, the bucket step refused by name, and
(slow) tiny runs: full fine-tune and LoRA, cached prompt embeddings, an exact resume, two processes, and every
output loaded by stock diffusers without hf_arb, generating at a non-square trained bucket.
"""

from __future__ import annotations

import json
from pathlib import Path
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
from hf_arb.families.flux import pack_latents
from hf_arb.families.qwenimage import FramelessVAE
from hf_arb.families.shift import ShiftConfig, bucket_shift_table

_clean_accelerate_state = test_train._clean_accelerate_state
CAPTIONS = ["a red fox in the snow", "two cats, 3 dogs!", "", "a very long caption " * 6]


@pytest.fixture(scope="session")
def qwen_assets(family_assets) -> dict[str, str]:
    """The tiny Qwen-Image pipeline of tests/conftest.py ``family_assets`` (shared with the 2-process batch)."""
    return {"qwen": family_assets["qwen"], "images": family_assets["images"]}


@pytest.fixture(scope="module")
def pipe(qwen_assets):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(qwen_assets["qwen"])


# ------------------------------------------------------------------------------------------ fast: parts
def test_detected_from_the_checkpoint_and_the_hub_name_with_its_defaults(qwen_assets):
    assert detect_family(qwen_assets["qwen"]) == detect_flow_family(qwen_assets["qwen"]) == "qwenimage"
    assert detect_family("Qwen/Qwen-Image") == "qwenimage"
    assert detect_family("Qwen/Qwen-Image-Edit-2509") != "qwenimage"  # an edit model is not text-to-image
    args = script.parse_args(["--pretrained_model_name_or_path", qwen_assets["qwen"], "--train_data_dir", "d",
                              "--rank", "4"])
    assert args.family == "qwenimage" and args.output_dir == "qwenimage-model-finetuned-lora"


@pytest.mark.parametrize("flag, message", [
    (["--train_text_encoder"], "--train_text_encoder: Qwen-Image trains the transformer only"),
    (["--max_sequence_length", "2000"], "--max_sequence_length 2000 is above Qwen-Image's 1024"),
    (["--snr_gamma", "5"], "--snr_gamma applies to SD 1.x/2.x/SDXL UNets"),
    (["--packing"], "--packing"),
])
def test_flags_that_do_not_apply_are_refused_by_name(qwen_assets, flag, message):
    with pytest.raises(script.UsageError, match=message):
        script.parse_args(["--pretrained_model_name_or_path", qwen_assets["qwen"], "--train_data_dir", "d",
                           "--rank", "4", *flag])


def test_prompt_encoding_equals_the_pipelines_and_each_caption_is_cacheable_alone(pipe):
    family = get_family("qwenimage")
    embeds, mask = family.encode_prompts([pipe.tokenizer], [pipe.text_encoder], CAPTIONS, "cpu", 16)
    assert embeds.shape == (4, 16, 16) and mask.shape == (4, 16)
    ref, ref_mask = pipe.encode_prompt(CAPTIONS, device="cpu", max_sequence_length=16)
    n = int(mask.sum(1).max())
    assert torch.equal(embeds[:, :n], ref) and torch.equal(mask[:, :n], ref_mask)
    assert mask[3].all() and mask[2].sum() < mask[0].sum()  # the long caption is cut at 16 tokens
    assert (embeds[mask == 0] == 0).all()
    for i, caption in enumerate(CAPTIONS):  # what --cache_text_embeddings memoises: one caption at a time
        alone, alone_mask = family.encode_prompts([pipe.tokenizer], [pipe.text_encoder], [caption], "cpu", 16)
        assert torch.equal(alone_mask[0], mask[i])
        torch.testing.assert_close(alone[0], embeds[i], rtol=1e-5, atol=1e-6)


def test_packing_and_the_frameless_vae_equal_the_pipelines(pipe):
    packed = pipe.prepare_latents(2, 16, 48, 80, torch.float32, "cpu", torch.Generator().manual_seed(3))
    x = torch.randn(2, 1, 16, 6, 10, generator=torch.Generator().manual_seed(3))  # the pipeline's (B, 1, C, h, w)
    assert torch.equal(pack_latents(x[:, 0]), packed)
    pixels = torch.rand(2, 3, 48, 80) * 2 - 1
    flat = FramelessVAE(pipe.vae).encode(pixels).latent_dist
    video = pipe.vae.encode(pixels.unsqueeze(2)).latent_dist
    assert flat.mean.shape == (2, 16, 6, 10)
    assert torch.equal(flat.mean, video.mean[:, :, 0]) and torch.equal(flat.std, video.std[:, :, 0])
    assert get_family("qwenimage").vae_scale_factor(pipe.vae) == pipe.vae_scale_factor == 8


def test_only_the_frozen_text_outputs_of_the_last_block_get_no_gradient(pipe):
    """What QwenImageFamily.load_models freezes (for DDP) is exactly what the loss never reaches."""
    family = get_family("qwenimage")
    embeds, mask = family.encode_prompts([pipe.tokenizer], [pipe.text_encoder], CAPTIONS[:2], "cpu", 16)
    options = family.options(pipe.scheduler.config, pipe.transformer)
    pipe.transformer.zero_grad(set_to_none=True)
    family.predict(pipe.transformer, torch.randn(2, 16, 6, 10), torch.tensor([0.3, 0.8]), embeds, mask,
                   options).square().mean().backward()
    last = len(pipe.transformer.transformer_blocks) - 1
    no_grad = {n for n, p in pipe.transformer.named_parameters() if p.grad is None}
    pipe.transformer.zero_grad(set_to_none=True)
    assert no_grad == {f"transformer_blocks.{last}.{m}.{w}" for m in ("attn.to_add_out", "txt_mlp.net.0.proj",
                                                                       "txt_mlp.net.2") for w in ("weight", "bias")}


SIZES = [(80, 48), (48, 96), (1328, 1328), (1664, 928), (928, 1664), (1472, 1140 // 16 * 16)]  # (width, height)


def test_mu_per_bucket_is_bit_identical_to_the_pipelines(pipe):
    """hf_arb's mu for a bucket == QwenImagePipeline's calculate_shift on the same image_seq_len."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    c = pipe.scheduler.config
    cfg = training_shift_config(c, by_resolution=None)  # the script's default: the scheduler shifts dynamically
    assert cfg.use_dynamic_shifting and cfg == ShiftConfig.from_scheduler_config(c)
    table = bucket_shift_table(np.array(SIZES), cfg, get_family("qwenimage").vae_scale_factor(pipe.vae), 2)
    for (w, h), seq, mu in zip(SIZES, table["image_seq_len"], table["mu"]):
        latents = pipe.prepare_latents(1, 16, h, w, torch.float32, "cpu", torch.Generator().manual_seed(0))
        assert int(seq) == latents.shape[1]  # the pipeline's image_seq_len
        expect = calculate_shift(latents.shape[1], c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                                 c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        assert float(mu) == expect, (w, h)
    # training sigmas = the scheduler's at that mu (Qwen-Image's shift_terminal stretches a whole inference
    # schedule, which has no per-sample training counterpart: compared without it)
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler.from_config(c, shift_terminal=None)
    t = np.linspace(1.0, 1 / 8, 8)
    for w, h in SIZES:
        mu = calculate_shift((h // 16) * (w // 16), c.base_image_seq_len, c.max_image_seq_len, c.base_shift,
                             c.max_shift)
        sched.set_timesteps(sigmas=t, mu=mu)
        ours = batch_sigmas(torch.tensor(t, dtype=torch.float32), (h // 8, w // 8), 2, cfg)
        torch.testing.assert_close(ours, sched.sigmas[:-1], rtol=1e-6, atol=1e-7)


def test_a_bucket_step_off_the_packing_is_refused_naming_bucket_step(qwen_assets, tmp_path):
    argv = ["--pretrained_model_name_or_path", qwen_assets["qwen"], "--train_data_dir", qwen_assets["images"],
            "--output_dir", str(tmp_path), *FLOW, "--full_finetune", "--max_train_steps", "1"]
    argv[argv.index("--bucket_step") + 1] = "8"
    with pytest.raises(script.UsageError, match=r"not divisible by 16 .*For this Qwen-Image model: --bucket_step 16"):
        script.main(argv)


# ------------------------------------------------------------------------------------------ slow: training
@pytest.fixture(scope="module")
def qwen_runs(qwen_assets, shared_artifact) -> dict[str, Any]:
    return shared_artifact("qwen-runs", lambda root: family_runs(qwen_assets["qwen"], qwen_assets["images"], root))


@pytest.mark.slow
def test_full_fine_tune_trains_non_square_buckets_and_resumes_exactly(qwen_runs):
    check_full_resume(qwen_runs, "qwenimage", "QwenImagePipeline", "Resolution shift: per bucket")


@pytest.mark.slow
def test_cached_prompt_embeddings_and_latents_match_the_on_the_fly_lora_run(qwen_runs):
    check_cached_lora(qwen_runs)


@pytest.mark.slow
def test_lora_adapts_the_attention_projections_and_validates_at_three_shapes(qwen_runs):
    check_lora_targets_and_validation(qwen_runs)


@pytest.mark.slow
def test_outputs_load_in_stock_diffusers_without_hf_arb_and_generate_at_a_trained_bucket(qwen_runs):
    check_stock_outputs(qwen_runs, "QwenImagePipeline")


@pytest.fixture(scope="module")
def qwen_ddp(ddp_batch) -> dict[str, Any]:
    """The 2-process full run and its resume, from the shared 2-process batch (tests/_train_fixtures.py)."""
    return family_ddp_result(ddp_batch, "family-qwen")


@pytest.mark.slow
def test_two_processes_train_the_same_bucket_per_step_and_resume_exactly(qwen_ddp):
    check_ddp_resume(qwen_ddp)


def test_qwen_image_page_numbers_are_real(tmp_path, capsys) -> None:
    """docs/qwen_image.md: the folder it describes (the bundled photos, captions in metadata.jsonl) annotated with its
    command prints every line of the page's ``hf-arb stats`` output (the bucket lines with rows), and the stats it
    quotes in prose hold."""
    import shutil

    from _photos import PHOTOS, SKIMAGE_DATA

    from hf_arb.cli.app import main

    folder = tmp_path / "photos"
    folder.mkdir()
    with open(folder / "metadata.jsonl", "w") as f:
        for name in PHOTOS:
            shutil.copy(SKIMAGE_DATA / name, folder / name)
            f.write(json.dumps({"file_name": name, "text": "a photo of " + name.split(".")[0]}) + "\n")
    page = (Path(__file__).resolve().parents[1] / "docs" / "qwen_image.md").read_text()
    assert "hf-arb annotate photos --output-dir photos-arb --resolution 512 --step 16" in page
    assert main(["annotate", str(folder), "--output-dir", str(tmp_path / "photos-arb"), "--resolution", "512",
                 "--step", "16"]) == 0
    capsys.readouterr()
    assert main(["stats", str(tmp_path / "photos-arb")]) == 0
    out = capsys.readouterr().out
    block = page.split("Its output on the eight photos", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    lines = [line for line in block.splitlines() if line.strip()]
    assert len(lines) == 7 and all(line in out for line in lines), out
    for name, (w, h) in PHOTOS.items():  # the folder listing's sizes are the files'
        assert f"{name} " in page and f"{w} x {h}" in page
