"""Wan 2.1 / 2.2 text-to-video (issue #38's first slice, the model side): detection, prompt encoding and the
transformer convention (timestep ``sigma * 1000``, velocity output) equal to ``WanPipeline``'s, the scheduler's fixed
``flow_shift`` in training, the frame rule and the spatial multiple equal to what the pipeline accepts, the loss on
clip batches ``(B, C, F, H, W)`` (stills as 1-frame clips; cached latents equal to on-the-fly), LoRA and full
fine-tune steps through the adapter, and (slow) runs of the unchanged script on a folder of stills: a 3-step LoRA, a
4-step full fine-tune and its exact resume; the LoRAs and the full fine-tunes load in stock diffusers without hf_arb
and generate 48x32 clips of 9 frames.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import test_train
import torch
from _family_runs import check_full_resume
from _stock import job_result
from _train_fixtures import CLIP, FLOW, mixed_clip_folder

import train_text_to_image_arb as script
from hf_arb.families import detect_family, detect_flow_family, get_family
from hf_arb.families.flow import unshifted_times
from hf_arb.families.wan import clip_pixels, normalize_latents
from hf_arb.video.frames import FRAME_RULES

_clean_accelerate_state = test_train._clean_accelerate_state
CAPTIONS = ["a red fox in the snow", "two cats, 3 dogs!", "", "a very long caption " * 6]


@pytest.fixture(scope="session")
def wan_assets(family_assets) -> dict[str, str]:
    """The tiny Wan pipeline of tests/conftest.py ``family_assets`` and its photo folder."""
    return {"wan": family_assets["wan"], "images": family_assets["images"]}


@pytest.fixture(scope="module")
def pipe(wan_assets):
    from diffusers import WanPipeline

    return WanPipeline.from_pretrained(wan_assets["wan"])


def wan_args(path: str, *extra: str) -> Any:
    return script.parse_args(["--pretrained_model_name_or_path", path, "--train_data_dir", "d",
                              "--max_sequence_length", "16", *extra])


def clip_batch(frames: int = 5, seed: int = 0) -> dict[str, Any]:
    """Two synthetic clips (B, C, F, H, W) in [-1, 1] at 48x32: a bright square moving right, over noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(2, 3, frames, 32, 48, generator=g) * 0.4 - 0.2
    for f in range(frames):
        x[:, :, f, 8:24, 2 + 4 * f:18 + 4 * f] = 0.9
    return {"pixel_values": x, "captions": ["a square moving right", "a white box"]}


def loss_of(family, args, models, batch, seed=0, denoiser=None):
    text = lambda caps: family.encode_text(models, models.text_encoders, caps, "cpu")  # noqa: E731
    return family.training_loss(args, models, denoiser or models.unet, batch, text,
                                torch.Generator().manual_seed(seed), torch.float32)


# ------------------------------------------------------------------------------------------ fast: parts
def test_detected_from_the_checkpoint_and_the_hub_names_with_its_defaults(wan_assets, tmp_path):
    assert detect_family(wan_assets["wan"]) == detect_flow_family(wan_assets["wan"]) == "wan"
    for hub_id in ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "Wan-AI/Wan2.1-T2V-14B-Diffusers",
                   "Wan-AI/Wan2.2-TI2V-5B-Diffusers"):
        assert detect_family(hub_id) == "wan", hub_id
    for other in ("WanImageToVideoPipeline", "WanVACEPipeline", "WanAnimatePipeline"):  # not text-to-video
        (tmp_path / other).mkdir()
        (tmp_path / other / "model_index.json").write_text(json.dumps({"_class_name": other}))
        assert detect_family(str(tmp_path / other)) != "wan", other
    args = wan_args(wan_assets["wan"], "--rank", "4")
    assert args.family == "wan" and args.output_dir == "wan-model-finetuned-lora" and args.resolution == 480


@pytest.mark.parametrize("flag, message", [
    (["--train_text_encoder"], "--train_text_encoder: Wan trains the transformer only"),
    (["--shift_by_resolution"], "--shift_by_resolution: WanPipeline samples every size and length with its"),
    (["--pretrained_vae_model_name_or_path", "x"], "Wan's VAE is its own video VAE"),
    (["--snr_gamma", "5"], "--snr_gamma applies to SD 1.x/2.x/SDXL UNets"),
    (["--packing"], "--packing"),
    (["--vae_encode_mode", "mode"], "--vae_encode_mode applies to"),
    (["--with_prior_preservation", "--class_data_dir", "c", "--class_prompt", "a photo"],
     "--with_prior_preservation: generating class images with WanPipeline"),
])
def test_flags_that_do_not_apply_are_refused_by_name(wan_assets, flag, message):
    with pytest.raises(script.UsageError, match=message):
        wan_args(wan_assets["wan"], "--rank", "4", *flag)


def test_a_two_expert_checkpoint_is_refused_before_any_weight_loads(tmp_path):
    """Wan 2.2 A14B (transformer + transformer_2, boundary_ratio): refused from model_index.json alone (the folder
    holds no weights, so any load would fail otherwise)."""
    (tmp_path / "model_index.json").write_text(json.dumps({
        "_class_name": "WanPipeline", "boundary_ratio": 0.875, "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": ["diffusers", "WanTransformer3DModel"]}))
    args = wan_args(str(tmp_path), "--rank", "4")
    with pytest.raises(script.UsageError, match=r"two experts .*boundary_ratio 0.875.*Wan 2.1 T2V, Wan 2.2 TI2V-5B"):
        get_family("wan").load_models(args)


def test_prompt_encoding_is_the_pipelines_zero_padded_and_each_caption_is_cacheable_alone(pipe):
    """The embeddings WanPipeline conditions on: (B, L, D), each caption's tokens then zeros (no mask); the long
    caption is cut at L tokens; a caption encoded alone equals its row (what --cache_text_embeddings memoises)."""
    family = get_family("wan")
    embeds, pooled = family.encode_prompts([pipe.tokenizer], [pipe.text_encoder], CAPTIONS, "cpu", 24)
    assert embeds.shape == (4, 24, 32) and pooled is None
    ref, _ = pipe.encode_prompt(list(CAPTIONS), do_classifier_free_guidance=False, max_sequence_length=24,
                                device="cpu")
    assert torch.equal(embeds, ref)
    tokens = pipe.tokenizer(CAPTIONS, padding="max_length", max_length=24, truncation=True).attention_mask
    for i, n in enumerate(np.sum(tokens, axis=1)):
        assert (embeds[i, :n].abs().sum(-1) > 0).all() and (embeds[i, n:] == 0).all()
    assert np.sum(tokens[3]) == 24  # cut
    for i, caption in enumerate(CAPTIONS):
        alone, _ = family.encode_prompts([pipe.tokenizer], [pipe.text_encoder], [caption], "cpu", 24)
        torch.testing.assert_close(alone[0], embeds[i], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("expand", [False, True], ids=["wan2.1", "ti2v-expand_timesteps"])
def test_predict_is_the_velocity_the_pipelines_scheduler_steps_with(pipe, expand):
    """One Euler step from sigma 1 to 0 moves the latents by -velocity at timestep 1000: predict() gives exactly that
    velocity, with Wan 2.2 TI2V's per-token timesteps too (``expand_timesteps``)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    family = get_family("wan")
    euler = WanPipeline(**{**pipe.components, "scheduler": FlowMatchEulerDiscreteScheduler(shift=1.0)},
                        expand_timesteps=expand)
    x = torch.randn(1, 16, 2, 4, 6, generator=torch.Generator().manual_seed(1))  # 5 frames at 48x32
    stepped = euler("a wide clip", height=32, width=48, num_frames=5, num_inference_steps=1, guidance_scale=1.0,
                    latents=x.clone(), output_type="latent", max_sequence_length=24).frames
    embeds, _ = family.encode_prompts([pipe.tokenizer], [pipe.text_encoder], ["a wide clip"], "cpu", 24)
    options = family.options(pipe.scheduler.config, pipe.transformer)
    with torch.no_grad():
        velocity = family.predict(pipe.transformer, x, torch.tensor([1.0]), embeds, None, options, expand)
        at_one = family.predict(pipe.transformer, x, torch.tensor([0.001]), embeds, None, options, expand)
    torch.testing.assert_close(velocity, x - stepped, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(velocity, at_one)  # the timestep reaches the transformer (1000, not 1)


@pytest.mark.parametrize("flow_shift", [3.0, 5.0])
def test_training_sigmas_are_the_schedulers_fixed_flow_shift_at_every_size(pipe, flow_shift):
    """Training shifts its times with the scheduler's own flow_shift (UniPC's flow sigmas: 3.0 for 480p, 5.0 for
    720p), the same at every bucket size and frame count: equal to what set_timesteps gives at inference."""
    from diffusers import UniPCMultistepScheduler

    family = get_family("wan")
    scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config, flow_shift=flow_shift)
    options = family.options(scheduler.config, pipe.transformer)
    assert options.shift.shift == flow_shift and not options.by_resolution
    t = unshifted_times(torch.linspace(0.02, 0.98, 12), 1000)
    scheduler.set_timesteps(sigmas=t.numpy())
    torch.testing.assert_close(family.sigmas(options, t), scheduler.sigmas[:-1], rtol=1e-6, atol=1e-7)
    assert not torch.allclose(family.sigmas(options, t), t)  # shifted


def test_frame_rule_and_spatial_multiple_are_what_the_pipeline_accepts(pipe, wan_assets):
    """The frame rule (4k+1, from the VAE) keeps exactly the frame counts WanPipeline does not round; the spatial
    multiple (VAE factor x patch) rejects exactly the sizes WanPipeline.check_inputs rejects; check_buckets refuses a
    bucket of either kind by name."""
    family = get_family("wan")
    models = family.load_models(wan_args(wan_assets["wan"], "--rank", "4"))
    rule = family.frame_rule(models)
    assert rule == FRAME_RULES["wan"] == family.frame_rule() and rule.step == pipe.vae_scale_factor_temporal
    assert get_family("flux").frame_rule() is None and get_family("sdxl").frame_rule() is None  # image families
    for n in range(1, 14):
        out = pipe("a", height=16, width=16, num_frames=n, num_inference_steps=1, guidance_scale=1.0,
                   output_type="np", max_sequence_length=8).frames
        assert (out.shape[1] == n) == rule.is_valid(n), n
    step = family.spatial_multiple(models)
    assert step == pipe.vae_scale_factor_spatial * pipe.transformer.config.patch_size[1] == 16
    for w, h in [(48, 32), (32, 48), (40, 32), (48, 24), (64, 64), (56, 56), (80, 48)]:
        try:
            pipe.check_inputs("a", None, h, w)
            accepted = True
        except ValueError:
            accepted = False
        try:
            family.check_buckets(models, SimpleNamespace(resolutions=np.array([[w, h]])))
            ours = True
        except script.UsageError as err:
            assert "--bucket_step 16" in str(err)
            ours = False
        assert ours == accepted, (w, h)
    family.check_buckets(models, SimpleNamespace(resolutions=np.array([[48, 32, 9], [32, 48, 1]])))  # (W, H, F)
    with pytest.raises(script.UsageError, match=r"frame counts \[6\] do not fit Wan's 4k\+1 frames: use 5"):
        family.check_buckets(models, SimpleNamespace(resolutions=np.array([[48, 32, 9], [48, 32, 6]])))


def test_the_latent_patch_of_the_token_budget_is_the_pipelines_read_before_any_weight(pipe, wan_assets):
    """Family.latent_patch (--video_token_budget's token count, read from the configs): the pipeline's
    vae_scale_factor_spatial x the transformer's spatial patch, its vae_scale_factor_temporal and the temporal patch;
    so a bucket's tokens are the transformer's sequence length at that (W, H, F)."""
    from hf_arb.sampling.planning.batch_sizes import tokens_per_sample

    spatial, frame_step, patch_t = get_family("wan").latent_patch(wan_args(wan_assets["wan"]))
    pt, ph, _ = pipe.transformer.config.patch_size
    assert (spatial, frame_step, patch_t) == (pipe.vae_scale_factor_spatial * ph, pipe.vae_scale_factor_temporal, pt)
    w, h, f = 80, 48, 9
    latents = torch.zeros(1, pipe.transformer.config.in_channels, (f - 1) // frame_step + 1,
                          h // pipe.vae_scale_factor_spatial, w // pipe.vae_scale_factor_spatial)
    tokens = pipe.transformer.patch_embedding(latents).flatten(2).shape[2]
    assert tokens == int(tokens_per_sample([(w, h, f)], spatial=spatial, frame_step=frame_step, patch_t=patch_t)[0])


def test_validation_generates_the_buckets_frames_as_a_video_and_draws_them_side_by_side(pipe):
    """Family.generate (validation): the pipeline's ``.frames`` at the bucket's (W, H, F), 1 frame for a bucket of
    stills; hf_arb.train.videos reads them as (F, H, W, 3) uint8 and draws them in one strip."""
    from hf_arb.train.videos import frame_strip, is_video, video_array

    family = get_family("wan")
    kw = {"prompt": "a", "num_inference_steps": 1, "guidance_scale": 1.0, "max_sequence_length": 8}
    clip, still = family.generate(pipe, (48, 32, 5), **kw), family.generate(pipe, (32, 48), **kw)
    assert is_video(clip) and is_video(still)
    assert video_array(clip).shape == (5, 32, 48, 3) and video_array(still).shape == (1, 48, 32, 3)
    assert frame_strip(video_array(clip)).size == (5 * 48, 32)


# ------------------------------------------------------------------------------------------ fast: the loss
def test_clip_loss_is_finite_backprops_and_takes_stills_as_one_frame_clips(wan_assets):
    """On a fixed clip batch (B, C, F, H, W) the loss is finite and reaches every trained block; stills (B, C, H, W)
    train exactly as 1-frame clips; the (B, F, C, H, W) layout is refused naming the permute; cached latent_stats
    train exactly as the pixels they encode (on-the-fly == cached)."""
    from hf_arb.train.cache.caches import posterior_stats

    family = get_family("wan")
    args = wan_args(wan_assets["wan"], "--full_finetune")
    models = family.load_models(args)
    batch = clip_batch()
    loss = loss_of(family, args, models, batch)
    assert torch.isfinite(loss) and loss.item() > 0
    loss.backward()
    grads = {n: p.grad for n, p in models.unet.named_parameters() if p.grad is not None}
    assert all(any(n.startswith(f"blocks.{i}.") and g.abs().sum() > 0 for n, g in grads.items()) for i in range(2))
    models.unet.zero_grad()
    with torch.no_grad():
        still = {"pixel_values": batch["pixel_values"][:, :, 0], "captions": batch["captions"]}
        one_frame = {"pixel_values": batch["pixel_values"][:, :, :1], "captions": batch["captions"]}
        assert loss_of(family, args, models, still).item() == loss_of(family, args, models, one_frame).item()
        with pytest.raises(ValueError, match=r"not \(B, F, C, H, W\): permute\(0, 2, 1, 3, 4\)"):
            loss_of(family, args, models, {**batch, "pixel_values": batch["pixel_values"].transpose(1, 2)})
        # --masked_loss on stills: the (B, 1, h, w) mask weighs the one latent frame; all ones changes nothing
        ones, half = torch.ones(2, 1, 4, 6), torch.ones(2, 1, 4, 6)
        half[:, :, :, 3:] = 0.0
        plain = loss_of(family, args, models, still).item()
        assert loss_of(family, args, models, {**still, "loss_mask": ones}).item() == plain
        assert loss_of(family, args, models, {**still, "loss_mask": half}).item() < plain
        for pixels in (batch["pixel_values"], still["pixel_values"]):  # clips (B,2,C,F',h,w), stills (B,2,C,h,w)
            cached = {"latent_stats": posterior_stats(models.vae, pixels), "captions": batch["captions"]}
            assert cached["latent_stats"].ndim == pixels.ndim + 1
            torch.testing.assert_close(loss_of(family, args, models, cached),
                                       loss_of(family, args, models, {**batch, "pixel_values": pixels}),
                                       rtol=1e-5, atol=1e-6)


def test_gradient_checkpointing_gives_the_same_gradients_and_bf16_trains(wan_assets):
    """--gradient_checkpointing (what 81-frame clips need at full size) recomputes the blocks: the same loss and
    gradients; a bf16 transformer (--mixed_precision bf16 with LoRA's frozen base) gives a finite loss that
    backprops."""
    family = get_family("wan")
    grads = []
    for flags in ([], ["--gradient_checkpointing"]):
        args = wan_args(wan_assets["wan"], "--full_finetune", *flags)
        models = family.load_models(args)
        assert models.unet.is_gradient_checkpointing == bool(flags)
        loss = loss_of(family, args, models, clip_batch())
        loss.backward()
        grads.append((loss.item(), {n: p.grad.clone() for n, p in models.unet.named_parameters()
                                    if p.grad is not None}))
    assert grads[0][0] == grads[1][0] and grads[0][1].keys() == grads[1][1].keys()
    for name, g in grads[0][1].items():
        torch.testing.assert_close(grads[1][1][name], g, rtol=1e-5, atol=1e-7)
    models.unet.to(torch.bfloat16)
    text = lambda caps: family.encode_text(models, models.text_encoders, caps, "cpu")  # noqa: E731
    loss = family.training_loss(args, models, models.unet, clip_batch(), text, torch.Generator().manual_seed(0),
                                torch.bfloat16)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()


def test_latent_normalisation_is_the_inverse_of_the_pipelines_decode_step(pipe):
    """normalize_latents(z), then WanPipeline's own step before decoding (``latents / (1 / std) + mean``), gives z."""
    cfg = pipe.vae.config
    z = torch.randn(2, 16, 3, 4, 6)
    mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1)
    torch.testing.assert_close(normalize_latents(z, cfg) / inv_std + mean, z, rtol=1e-5, atol=1e-6)
    assert clip_pixels(torch.zeros(2, 3, 8, 8)).shape == (2, 3, 1, 8, 8)


# ------------------------------------------------------------------------------------------ training + stock diffusers
def adapter_steps(family, args, models, params, steps=3) -> list[float]:
    """``steps`` AdamW steps on the fixed clip batch (same draws each step); the losses before each step."""
    opt = torch.optim.AdamW(params, lr=args.learning_rate)
    losses = []
    for _ in range(steps):
        loss = loss_of(family, args, models, clip_batch())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def adapter_outputs(wan_assets, tmp_path_factory) -> dict[str, Any]:
    """A LoRA (rank 4) and a full fine-tune, 3 steps each on the clip batch straight through the adapter, saved the
    way the script saves them (the pipeline class's save_lora_weights; the final stock pipeline)."""
    from hf_arb.train.lora import add_lora, save_lora

    family, root = get_family("wan"), tmp_path_factory.mktemp("wan-adapter")
    args = wan_args(wan_assets["wan"], "--rank", "4", "--learning_rate", "5e-2")
    models = family.load_models(args)
    models.unet.requires_grad_(False)
    params = add_lora(models.unet, target_modules=family.lora_targets(args), rank=4, dtype=torch.float32)
    lora_losses = adapter_steps(family, args, models, params)
    save_lora(family.pipeline_class(args), root / "lora", models.unet, denoiser="transformer")
    args = wan_args(wan_assets["wan"], "--full_finetune", "--learning_rate", "1e-3")
    models = family.load_models(args)
    full_losses = adapter_steps(family, args, models, list(models.unet.parameters()))
    family.save_pipeline(args, family.build_pipeline(args, models, models.unet, torch.float32, final=True),
                         str(root / "full"))
    return {"lora": str(root / "lora"), "full": str(root / "full"), "lora_losses": lora_losses,
            "full_losses": full_losses}


def test_lora_and_full_fine_tune_steps_through_the_adapter_lower_the_clip_loss(adapter_outputs):
    from safetensors.torch import load_file

    for kind in ("lora_losses", "full_losses"):
        losses = adapter_outputs[kind]
        assert all(np.isfinite(losses)) and losses[-1] < losses[0], (kind, losses)
    weights = load_file(str(Path(adapter_outputs["lora"]) / "pytorch_lora_weights.safetensors"))
    modules = {k.split(".lora_")[0].split(".", 3)[-1] for k in weights}
    assert all(k.startswith("transformer.blocks.") for k in weights)
    assert modules == {"attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k",
                       "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2"}


@pytest.fixture(scope="module")
def wan_runs(wan_assets, shared_artifact) -> dict[str, Any]:
    """The unchanged script on the photo folder (stills trained as 1-frame clips), one process each: a 3-step LoRA;
    a 4-step full fine-tune (checkpoint at 2) and its resume from checkpoint-2 in a new folder."""
    def build(root: Path) -> dict[str, Any]:
        base = ["--pretrained_model_name_or_path", wan_assets["wan"], "--train_data_dir", wan_assets["images"], *FLOW]
        full = [*base, "--full_finetune", "--learning_rate", "1e-3", "--max_train_steps", "4",
                "--checkpointing_steps", "2", "--random_flip"]
        argvs = {"lora": [*base, "--rank", "4", "--learning_rate", "2e-2", "--max_train_steps", "3",
                          "--cache_text_embeddings", "--cache_latents", "--output_dir", str(root / "lora")],
                 "full": [*full, "--output_dir", str(root / "full")],
                 "resumed": [*full, "--output_dir", str(root / "resumed"), "--resume_from_checkpoint", "latest"]}
        out = {}
        for name, argv in argvs.items():
            if name == "resumed":
                shutil.copytree(root / "full" / "checkpoint-2", root / "resumed" / "checkpoint-2")
            stats = test_train.run_script(argv)
            out[name] = {"dir": str(root / name), "log": stats["log"],
                         "stats": json.loads(json.dumps(stats, default=str))}
        return out

    return shared_artifact("wan-runs", build)


@pytest.mark.slow
def test_the_unchanged_script_trains_a_wan_lora_on_stills_from_cached_latents_and_prompts(wan_runs):
    from test_train import read_trace

    run = wan_runs["lora"]
    trace = read_trace(Path(run["dir"]), 0)
    assert [t["step"] for t in trace] == [0, 1, 2] and all(np.isfinite(t["loss"]) for t in trace)
    assert run["stats"]["family"] == "wan" and run["stats"]["latents_encoded"] == 20  # each still, as image latents
    assert "Timestep shift: fixed flow_shift 3 from the scheduler" in run["log"]
    card = (Path(run["dir"]) / "README.md").read_text()
    assert "num_frames=1" in card and 'export_to_video(frames, "video.mp4", fps=16)' in card


@pytest.mark.slow
def test_a_full_fine_tune_on_stills_resumes_exactly(wan_runs):
    """Steps 3-4 resumed from checkpoint-2 replay the rows and losses to the same transformer weights (max abs diff
    < 1e-6), which steps 3-4 changed; the saved pipeline is a WanPipeline."""
    check_full_resume(wan_runs, "wan", "WanPipeline", "Timestep shift: fixed flow_shift 3 from the scheduler")


#: the clip runs' shared flags: a full fine-tune on the mixed folder of clips and stills, each 9-frame clip bucket
#: one row per batch under the token budget (80x48x9: 45 latent tokens, 64 // 45 = 1) and the still bucket two rows
#: (--image_train_batch_size); seed 2's plan trains a still batch first, then clips
CLIP_FULL = [*CLIP, "--seed", "2", "--full_finetune", "--learning_rate", "1e-3", "--max_train_steps", "4",
             "--checkpointing_steps", "2", "--gradient_checkpointing", "--mixed_precision", "bf16",
             "--video_token_budget", "64", "--image_train_batch_size", "2"]


@pytest.fixture(scope="module")
def wan_clip_runs(wan_assets, shared_artifact) -> dict[str, Any]:
    """The unchanged script on the mixed folder of MP4 / WebM clips and PNG stills: a 4-step full fine-tune with the
    token budget, --gradient_checkpointing and --mixed_precision bf16, checkpoint at 2, validating one prompt into
    TensorBoard at the end; its resume from checkpoint-2 (same flags, no validation); the resume with another budget
    (refused before anything loads: its message)."""
    def build(root: Path) -> dict[str, Any]:
        folder = mixed_clip_folder(root / "clips")
        base = ["--pretrained_model_name_or_path", wan_assets["wan"], "--train_data_dir", folder, *CLIP_FULL]
        out = {"folder": folder}
        for name, extra in (("full", ["--validation_prompt", "a slow pan", "--num_validation_inference_steps", "2"]),
                            ("resumed", ["--resume_from_checkpoint", "latest"])):
            if name == "resumed":
                shutil.copytree(root / "full" / "checkpoint-2", root / "resumed" / "checkpoint-2")
            argv = [*base, *extra, "--output_dir", str(root / name)]
            if name == "full":
                argv[argv.index("--report_to") + 1] = "tensorboard"
            stats = test_train.run_script(argv)
            out[name] = {"dir": str(root / name), "log": stats["log"], "global_step": stats["global_step"]}
        changed = [*base, "--video_token_budget", "128", "--resume_from_checkpoint", "latest", "--output_dir",
                   str(root / "resumed")]
        with pytest.raises(script.UsageError) as refused:
            script.main(changed)
        out["refused"] = str(refused.value)
        return out

    return shared_artifact("wan-clip-runs", build)


@pytest.mark.slow
def test_a_full_fine_tune_on_clips_and_stills_trains_each_bucket_at_its_token_budget_batch(wan_clip_runs):
    """--video_token_budget 64 --image_train_batch_size 2: the 9-frame clip bucket trains 1 row per batch, the still
    bucket 2 (the start-up table's batch column says so); both kinds trained, never in one batch, with gradient
    checkpointing in bf16, to finite losses."""
    from test_train import read_trace

    run = wan_clip_runs["full"]
    trace = read_trace(Path(run["dir"]), 0)
    assert [t["step"] for t in trace] == [0, 1, 2, 3] and all(np.isfinite(t["loss"]) for t in trace)
    sizes = {int(t["label"].split("x")[2]): t["shape"][0] for t in trace}
    assert sizes == {1: 2, 9: 1}, trace  # a still batch of 2, clip batches of 1
    assert {len(t["shape"]) for t in trace} == {4, 5}
    assert "batch per bucket {3: 2, 12: 1}" in run["log"]
    assert "(at most; per bucket with --video_token_budget 64 and --image_train_batch_size 2:" in run["log"]
    assert "mixed precision: bf16" in (Path(run["dir"]) / "README.md").read_text()


@pytest.mark.slow
def test_validation_writes_a_playable_mp4_per_prompt_and_bucket_and_a_tensorboard_strip(wan_clip_runs):
    """--validation_prompt on a video family: one H.264 MP4 per prompt and validation bucket whose frame count and
    size are the bucket's (read back with PyAV), linked from the model card, the grid PNG with each video's frames
    side by side, and TensorBoard images of the grid and of each video's strip (moviepy is not installed: no
    add_video)."""
    import av
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hf_arb.train.outputs import validation_shapes

    out = Path(wan_clip_runs["full"]["dir"])
    buckets = SimpleNamespace(resolutions=np.asarray(json.loads((out / "hf_arb_buckets.json").read_text())
                                                     ["resolutions"]))
    rows = np.bincount([3, 12], minlength=len(buckets.resolutions))  # the buckets with rows (the start-up table)
    shapes = validation_shapes(buckets, rows)
    assert all(len(s) == 3 and s[2] > 1 for s in shapes)  # clip buckets: the most frames at each aspect
    assert shapes == [tuple(int(v) for v in buckets.resolutions[12])]  # the one clip bucket with rows
    videos = sorted((out / "validation" / "step-000004").glob("*.mp4"))
    assert [v.name for v in videos] == sorted(f"prompt-0-{w}x{h}x{f}.mp4" for w, h, f in shapes)
    for path in videos:
        w, h, f = (int(v) for v in path.stem.split("-")[-1].split("x"))
        with av.open(str(path)) as container:
            assert container.streams.video[0].codec_context.name == "h264"
            frames = [fr.to_ndarray(format="rgb24") for fr in container.decode(video=0)]
        assert len(frames) == f and all(fr.shape == (h, w, 3) for fr in frames), path.name
    card = (out / "README.md").read_text()
    assert all(f"[{v.name}](validation/step-000004/{v.name})" in card for v in videos)
    grid = Image.open(out / "validation" / "step-000004.png")
    assert grid.size == (sum(w * f for w, h, f in shapes), max(h for w, h, f in shapes))
    events = EventAccumulator(str(next((out / "logs").rglob("events.out.tfevents.*"))), size_guidance={"images": 0})
    events.Reload()
    tags = {t: events.Images(t)[-1] for t in events.Tags()["images"]}
    assert set(tags) == {"validation", *(f"validation_video/{v.stem}" for v in videos)}
    for v in videos:
        w, h, f = (int(x) for x in v.stem.split("-")[-1].split("x"))
        assert (tags[f"validation_video/{v.stem}"].width, tags[f"validation_video/{v.stem}"].height) == (w * f, h)


@pytest.mark.slow
def test_the_clip_run_resumes_exactly_and_refuses_another_token_budget_in_one_line(wan_clip_runs):
    """From checkpoint-2 the resume replays steps 2-3 (rows, batch sizes, losses) to the same transformer (max abs
    diff 0.0); the same resume with --video_token_budget 128 fails before anything loads, one line naming the flag,
    both values and the fix."""
    from _family_runs import transformer_weights
    from test_train import read_trace

    full, resumed = (Path(wan_clip_runs[k]["dir"]) for k in ("full", "resumed"))
    trace, again = read_trace(full, 0), read_trace(resumed, 0)
    assert [(t["step"], t["rows"], t["shape"], t["loss"]) for t in again] == [
        (t["step"], t["rows"], t["shape"], t["loss"]) for t in trace[2:]]
    a, b = transformer_weights(full), transformer_weights(resumed)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0
    refused = wan_clip_runs["refused"]
    assert "\n" not in refused and "--video_token_budget 64, this run has --video_token_budget 128: pass " \
        "--video_token_budget 64" in refused, refused


STOCK = r"""
import json, sys
import numpy as np, torch
from diffusers import WanPipeline
results = {}
for name, job in json.loads(sys.argv[1]).items():
    pipe = WanPipeline.from_pretrained(job["model"])
    if job["lora"]:
        pipe.load_lora_weights(job["lora"])
    out = pipe("a wide clip", height=32, width=48, num_frames=9, num_inference_steps=2, output_type="np",
               generator=torch.Generator().manual_seed(0)).frames
    results[name] = {"cls": type(pipe).__name__, "shape": list(out.shape), "finite": bool(np.isfinite(out).all()),
                     "adapters": list(pipe.get_active_adapters()), "frames": out.tolist()}
    del pipe
print("RESULT" + json.dumps(results))
"""


@pytest.mark.slow
def test_every_output_loads_in_stock_diffusers_and_generates_a_non_square_9_frame_clip(wan_assets, adapter_outputs,
                                                                                         wan_runs, wan_clip_runs):
    """Where hf_arb cannot be imported: WanPipeline.from_pretrained(tiny) + load_lora_weights for both LoRAs (the
    script's, trained on stills; the adapter's, on clips), WanPipeline.from_pretrained for the three full fine-tunes
    (the script's on stills and on clips and stills, the adapter's); each generates 9 frames at 48x32 (not the
    default 81 at 832x480), other than the base model's."""
    jobs = {"script-lora": {"model": wan_assets["wan"], "lora": wan_runs["lora"]["dir"]},
            "script-full": {"model": wan_runs["full"]["dir"], "lora": None},
            "clips-full": {"model": wan_clip_runs["full"]["dir"], "lora": None},
            "adapter-lora": {"model": wan_assets["wan"], "lora": adapter_outputs["lora"]},
            "adapter-full": {"model": adapter_outputs["full"], "lora": None},
            "base": {"model": wan_assets["wan"], "lora": None}}
    results = job_result(STOCK, [json.dumps(jobs)])
    base = np.asarray(results["base"]["frames"])
    for name in ("script-lora", "script-full", "clips-full", "adapter-lora", "adapter-full"):
        r = results[name]
        assert r["cls"] == "WanPipeline" and r["shape"] == [1, 9, 32, 48, 3] and r["finite"], (name, r["shape"])
        assert bool(r["adapters"]) == (jobs[name]["lora"] is not None), name
        assert np.abs(np.asarray(r["frames"]) - base).max() > 0, name  # the training changes the clip
