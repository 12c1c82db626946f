"""LTX-Video text-to-video (issue #38): detection, prompt encoding (embeddings and mask), packing, the latent
normalisation and the transformer call equal to ``LTXPipeline``'s; the per-bucket shift equal to the ``mu`` the
pipeline computes at that (W, H, F); the frame rule (8k+1) and the spatial multiple (32) equal to what the pipeline
keeps and accepts; the loss on clip batches (stills as 1-frame clips; cached latents and prompts equal to
on-the-fly), gradient checkpointing and bf16; every refused flag in one line. Slow: the unchanged script trains a
LoRA on a mixed folder of MP4/WebM clips and PNG stills, on the fly and from cached latents and prompts to the same
losses; a 2-process full fine-tune in the shared batch (tests/_train_fixtures.py ``ltx_clip_runs``) trains one
(W, H, F) bucket per step and resumes exactly; both load in stock diffusers without hf_arb and generate 64x96 clips of
9 frames (the pipeline's default is 704x512 at 161).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import test_train
import torch
from _stock import job_result
from _train_fixtures import GROUP, LTX_CLIP, batch_result, mixed_clip_folder
from test_card_code import trained_sizes

import train_text_to_image_arb as script
from hf_arb.families import detect_family, detect_flow_family, get_family
from hf_arb.families.flow import unshifted_times
from hf_arb.families.ltx import normalize_ltx_latents, pack_latents, unpack_latents
from hf_arb.train.videos import video_array
from hf_arb.video.frames import FRAME_RULES

_clean_accelerate_state = test_train._clean_accelerate_state
CAPTIONS = ["a red fox in the snow", "two cats, 3 dogs!", "", "a very long caption " * 6]


@pytest.fixture(scope="module")
def ltx_path(family_assets) -> str:
    return family_assets["ltx"]


@pytest.fixture(scope="module")
def pipe(ltx_path):
    from diffusers import LTXPipeline

    return LTXPipeline.from_pretrained(ltx_path)


@pytest.fixture(scope="module")
def models(ltx_path):
    family = get_family("ltx")
    return family.load_models(ltx_args(ltx_path, "--full_finetune"))


def ltx_args(path: str, *extra: str) -> Any:
    return script.parse_args(["--pretrained_model_name_or_path", path, "--train_data_dir", "d",
                              "--max_sequence_length", "16", *extra])


def clip_batch(frames: int = 9, seed: int = 0) -> dict[str, Any]:
    """Two synthetic clips (B, C, F, H, W) in [-1, 1] at 64x32: a bright square moving right, over noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(2, 3, frames, 32, 64, generator=g) * 0.4 - 0.2
    for f in range(frames):
        x[:, :, f, 8:24, 2 + 4 * f:18 + 4 * f] = 0.9
    return {"pixel_values": x, "captions": ["a square moving right", "a white box"]}


def loss_of(family, args, models, batch, seed=0, text=None):
    text = text or (lambda caps: family.encode_text(models, models.text_encoders, caps, "cpu"))
    return family.training_loss(args, models, models.unet, batch, text, torch.Generator().manual_seed(seed),
                                torch.float32)


# ------------------------------------------------------------------------------------------ fast: parts
def test_detected_from_the_checkpoint_and_the_hub_names_with_its_defaults(ltx_path, tmp_path):
    assert detect_family(ltx_path) == detect_flow_family(ltx_path) == "ltx"
    for hub_id in ("Lightricks/LTX-Video", "Lightricks/LTX-Video-0.9.7-dev", "a-r-r-o-w/LTX-Video-diffusers"):
        assert detect_family(hub_id) == "ltx", hub_id
    for other in ("LTXImageToVideoPipeline", "LTXConditionPipeline", "LTX2Pipeline", "WanPipeline"):
        (tmp_path / other).mkdir()
        (tmp_path / other / "model_index.json").write_text(json.dumps({"_class_name": other}))
        assert detect_family(str(tmp_path / other)) != "ltx", other
    args = ltx_args(ltx_path, "--rank", "4")
    assert args.family == "ltx" and args.output_dir == "ltx-model-finetuned-lora" and args.resolution == 512
    assert args.max_sequence_length == 16 and get_family("ltx").default_max_sequence_length == 128


@pytest.mark.parametrize("flag, message", [
    (["--train_text_encoder"], "--train_text_encoder: LTX-Video trains the transformer only"),
    (["--no_shift_by_resolution"], "--no_shift_by_resolution: LTXPipeline shifts every size and length"),
    (["--pretrained_vae_model_name_or_path", "x"], "LTX-Video's VAE is its own video VAE"),
    (["--snr_gamma", "5"], "--snr_gamma applies to SD 1.x/2.x/SDXL UNets"),
    (["--packing"], "--packing"),
    (["--vae_encode_mode", "mode"], "--vae_encode_mode applies to"),
    (["--with_prior_preservation", "--class_data_dir", "c", "--class_prompt", "a photo"],
     "--with_prior_preservation: generating class images with LTXPipeline"),
])
def test_flags_that_do_not_apply_are_refused_by_name(ltx_path, flag, message):
    with pytest.raises(script.UsageError, match=message):
        ltx_args(ltx_path, "--rank", "4", *flag)


def test_shift_by_resolution_upstream_flags_are_accepted_with_their_meaning(ltx_path):
    """--shift_by_resolution is what LTX does anyway; --weighting_scheme / --max_sequence_length keep their meaning."""
    args = ltx_args(ltx_path, "--rank", "4", "--shift_by_resolution", "--weighting_scheme", "logit_normal")
    models = get_family("ltx").load_models(args)
    assert models.options.by_resolution and models.options.weighting_scheme == "logit_normal"
    assert models.options.max_sequence_length == 16


def test_prompts_are_the_pipelines_embeddings_and_mask_and_each_caption_is_cacheable_alone(pipe):
    """(B, L, D) embeddings and the (B, L) mask LTXPipeline.encode_prompt gives; the long caption is cut at L tokens;
    a caption encoded alone equals its row (what --cache_text_embeddings memoises)."""
    family = get_family("ltx")
    embeds, mask = family.encode_prompts([pipe.tokenizer], [pipe.text_encoder], CAPTIONS, "cpu", 24)
    ref, ref_mask, _, _ = pipe.encode_prompt(list(CAPTIONS), do_classifier_free_guidance=False,
                                             max_sequence_length=24, device="cpu")
    assert embeds.shape == (4, 24, 32) and torch.equal(embeds, ref) and torch.equal(mask, ref_mask)
    assert mask[3].all() and not mask[2][1:].any()  # cut; the empty caption holds only </s>
    for i, caption in enumerate(CAPTIONS):
        alone, alone_mask = family.encode_prompts([pipe.tokenizer], [pipe.text_encoder], [caption], "cpu", 24)
        torch.testing.assert_close(alone[0], embeds[i], rtol=1e-5, atol=1e-6)
        assert torch.equal(alone_mask[0], mask[i])


def test_packing_and_normalisation_are_the_pipelines(pipe):
    """pack/unpack are LTXPipeline's _pack_latents/_unpack_latents (patch 1 and 2); normalising, then the pipeline's
    own step before decoding (_denormalize_latents with the VAE's buffers), gives the latents back."""
    from diffusers import LTXPipeline

    z = torch.randn(2, 8, 3, 4, 6)
    for p, pt in ((1, 1), (2, 1)):
        packed = pack_latents(z, p, pt)
        assert torch.equal(packed, LTXPipeline._pack_latents(z, p, pt))
        assert torch.equal(unpack_latents(packed, 3 // pt, 4 // p, 6 // p, p, pt), z)
    vae = pipe.vae
    assert not torch.equal(vae.latents_mean, torch.zeros(8))  # the tiny VAE's buffers are not the identity
    back = LTXPipeline._denormalize_latents(normalize_ltx_latents(z, vae), vae.latents_mean, vae.latents_std,
                                            vae.config.scaling_factor)
    torch.testing.assert_close(back, z, rtol=1e-5, atol=1e-6)


def test_predict_is_the_velocity_the_pipelines_scheduler_steps_with(pipe, models):
    """One Euler step from sigma 1 to 0 moves the packed latents by -velocity: predict() (timestep 1000, the prompt
    mask, the rotary scale at the pipeline's default 25 fps) gives exactly that velocity; the frame rate and the
    timestep reach the transformer."""
    family = get_family("ltx")
    x = torch.randn(1, 8, 2, 1, 2, generator=torch.Generator().manual_seed(1))  # 9 frames at 64x32
    stepped = pipe("a wide clip", height=32, width=64, num_frames=9, num_inference_steps=1, guidance_scale=1.0,
                   latents=pack_latents(x), output_type="latent", max_sequence_length=24).frames
    embeds, mask = family.encode_prompts([pipe.tokenizer], [pipe.text_encoder], ["a wide clip"], "cpu", 24)
    options, fps = models.options, models.extra["frame_rate"]
    assert fps == 25.0
    with torch.no_grad():
        velocity = family.predict(pipe.transformer, x, torch.tensor([1.0]), embeds, mask, options, fps)
        at_one = family.predict(pipe.transformer, x, torch.tensor([0.001]), embeds, mask, options, fps)
        at_16 = family.predict(pipe.transformer, x, torch.tensor([1.0]), embeds, mask, options, 16.0)
    torch.testing.assert_close(pack_latents(velocity), pack_latents(x) - stepped, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(velocity, at_one) and not torch.allclose(velocity, at_16)


def test_the_token_budgets_latent_patch_is_the_transformers_sequence_length_read_before_any_weight(pipe, ltx_path):
    """Family.latent_patch (--video_token_budget's token count, from the configs on the meta device): the pipeline's
    vae_spatial_compression_ratio x patch, its vae_temporal_compression_ratio and patch_size_t; a bucket's tokens are
    the length of the sequence LTXPipeline packs at that (W, H, F) (Wan's values would count 16x more here)."""
    from hf_arb.sampling.planning.batch_sizes import tokens_per_sample

    spatial, frame_step, patch_t = get_family("ltx").latent_patch(ltx_args(ltx_path))
    cfg = pipe.transformer.config
    assert (spatial, frame_step, patch_t) == (pipe.vae_spatial_compression_ratio * cfg.patch_size,
                                              pipe.vae_temporal_compression_ratio, cfg.patch_size_t)
    w, h, f = 96, 64, 17
    latents = torch.zeros(1, cfg.in_channels, (f - 1) // frame_step + 1, h // pipe.vae_spatial_compression_ratio,
                          w // pipe.vae_spatial_compression_ratio)
    tokens = pack_latents(latents).shape[1]
    assert tokens == int(tokens_per_sample([(w, h, f)], spatial=spatial, frame_step=frame_step, patch_t=patch_t)[0])


@pytest.mark.parametrize("bucket", [(64, 32, 9), (32, 64, 17), (96, 64, 1), (64, 96, 25)])
def test_each_buckets_shift_is_the_mu_the_pipeline_computes_at_that_size_and_length(pipe, models, bucket):
    """LTXPipeline passes mu = calculate_shift(latent frames x latent pixels) to the scheduler: recorded from a real
    call at (W, H, F), it equals the startup table's mu, and training's sigmas equal the scheduler's at that mu."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTXPipeline

    from hf_arb.families.shift import bucket_shift_table

    seen: list[float] = []

    class Recording(FlowMatchEulerDiscreteScheduler):
        def set_timesteps(self, num_inference_steps=None, device=None, sigmas=None, mu=None, timesteps=None):
            seen.append(mu)
            return super().set_timesteps(num_inference_steps, device, sigmas, mu, timesteps)

    w, h, f = bucket
    recording = LTXPipeline(**{**pipe.components, "scheduler": Recording.from_config(pipe.scheduler.config)})
    recording("a", height=h, width=w, num_frames=f, num_inference_steps=1, guidance_scale=1.0, output_type="latent",
              max_sequence_length=8)
    family, options = get_family("ltx"), models.options
    table = bucket_shift_table(np.array([bucket]), options.shift, family.vae_scale_factor(models.vae), 1,
                               frame_step=family.frame_rule(models).step)
    assert table["mu"][0] == pytest.approx(seen[0], rel=1e-12)
    t = unshifted_times(torch.linspace(0.02, 0.98, 12), 1000)
    reference = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
    reference.set_timesteps(sigmas=t.numpy(), mu=seen[0])
    latent = ((f - 1) // 8 + 1, h // 32, w // 32)
    torch.testing.assert_close(family.sigmas(options, t, latent), reference.sigmas[:-1], rtol=1e-6, atol=1e-7)
    assert not torch.allclose(family.sigmas(options, t, latent), t)  # shifted


def test_frame_rule_and_spatial_multiple_are_what_the_pipeline_keeps_and_accepts(pipe, models):
    """The frame rule (8k+1, from the VAE) keeps exactly the frame counts LTXPipeline returns as asked; the spatial
    multiple (VAE compression x patch) rejects exactly the sizes LTXPipeline.check_inputs rejects; check_buckets
    refuses a bucket of either kind by name."""
    family = get_family("ltx")
    rule = family.frame_rule(models)
    assert rule == FRAME_RULES["ltx"] == family.frame_rule() and rule.step == pipe.vae_temporal_compression_ratio
    for n in (1, 2, 8, 9, 10, 16, 17):
        out = pipe("a", height=32, width=32, num_frames=n, num_inference_steps=1, guidance_scale=1.0,
                   output_type="np", max_sequence_length=8).frames
        assert (out.shape[1] == n) == rule.is_valid(n), n
    step = family.spatial_multiple(models)
    assert step == pipe.vae_spatial_compression_ratio * pipe.transformer_spatial_patch_size == 32
    for w, h in [(64, 32), (32, 64), (48, 32), (64, 48), (96, 96), (80, 64), (128, 96)]:
        try:
            pipe.check_inputs("a", h, w)
            accepted = True
        except ValueError:
            accepted = False
        try:
            family.check_buckets(models, SimpleNamespace(resolutions=np.array([[w, h]])))
            ours = True
        except script.UsageError as err:
            assert "--bucket_step 32" in str(err) and "LTX-Video model" in str(err)
            ours = False
        assert ours == accepted, (w, h)
    family.check_buckets(models, SimpleNamespace(resolutions=np.array([[64, 32, 9], [32, 64, 1]])))  # (W, H, F)
    with pytest.raises(script.UsageError, match=r"frame counts \[5\] do not fit LTX-Video's 8k\+1 frames: use 1"):
        family.check_buckets(models, SimpleNamespace(resolutions=np.array([[64, 32, 9], [64, 32, 5]])))


def test_target_fps_sets_the_rotary_frame_rate_and_the_card_passes_it(ltx_path, pipe):
    """--target_fps (the clips' rate) is the frame rate the transformer's rotary positions assume in training, and
    the card's generation passes it as frame_rate; without it, the pipeline's default 25 and no frame_rate. Validation
    generates a bucket's frames (1 frame for a bucket of stills), which hf_arb.train.videos writes as an MP4."""
    family = get_family("ltx")
    args = ltx_args(ltx_path, "--rank", "4", "--video_column", "video", "--frames", "1,9", "--target_fps", "16")
    assert family.load_models(args).extra["frame_rate"] == 16.0
    assert family.generation_args(args, (64, 96, 9))[-2:] == ["num_frames=9", "frame_rate=16"]
    plain = ltx_args(ltx_path, "--rank", "4")
    assert family.generation_args(plain, (64, 96, 9))[-1] == "num_frames=9"
    assert "rotary positions assume 16 fps" in "\n".join(family.card_lines(args))
    kw = {"prompt": "a", "num_inference_steps": 1, "guidance_scale": 1.0, "max_sequence_length": 8}
    assert video_array(family.generate(pipe, (64, 32, 9), **kw)).shape == (9, 32, 64, 3)
    assert video_array(family.generate(pipe, (32, 64), **kw)).shape == (1, 64, 32, 3)


def test_validation_generates_at_the_target_fps_the_rotary_positions_trained_at(ltx_path, tmp_path):
    """log_validation passes the family's validation keywords to every pipeline call: --target_fps 16 reaches
    LTXPipeline as frame_rate=16 (not its default 25 fps rotary rate); without --target_fps no frame_rate is passed."""
    family = get_family("ltx")
    calls: list[dict[str, Any]] = []

    class Pipe:  # records each call's keywords; returns black frames
        def to(self, device):
            return self

        def set_progress_bar_config(self, **kwargs):
            pass

        def __call__(self, **kwargs):
            calls.append(kwargs)
            return SimpleNamespace(frames=[np.zeros((kwargs["num_frames"], kwargs["height"], kwargs["width"], 3),
                                                    np.uint8)])

    buckets = SimpleNamespace(resolutions=[(64, 96, 9), (64, 64, 9), (96, 64, 9)])
    main = SimpleNamespace(is_main_process=True, device=torch.device("cpu"), trackers=[])
    for extra, rate in ((["--target_fps", "16"], 16.0), ([], None)):
        calls.clear()
        args = ltx_args(ltx_path, "--rank", "4", "--video_column", "video", "--frames", "9", "--output_dir",
                        str(tmp_path / str(rate)), "--validation_prompts", "a fox", "--seed", "0", *extra)
        assert family.validation_kwargs(args) == ({"frame_rate": rate} if rate else {})
        script.log_validation(args, main, SimpleNamespace(family=family), None, buckets, 1, None, pipe=Pipe())
        assert len(calls) == 3 * args.num_validation_images
        assert [c.get("frame_rate") for c in calls] == [rate] * len(calls)
        assert {c["num_frames"] for c in calls} == {9}


# ------------------------------------------------------------------------------------------ fast: the loss
def test_clip_loss_backprops_takes_stills_as_one_frame_clips_and_caches_train_as_on_the_fly(ltx_path, models):
    """On a clip batch (B, C, F, H, W) the loss is finite and reaches every block; stills (B, C, H, W) train exactly
    as 1-frame clips; cached latent_stats and memoised prompts (embeddings and mask, as --cache_text_embeddings keeps
    them) train as the pixels and captions they encode; the latent normalisation is not the identity."""
    from hf_arb.train.cache.caches import TextEncoder, posterior_stats

    family = get_family("ltx")
    args = ltx_args(ltx_path, "--full_finetune")
    batch = clip_batch()
    loss = loss_of(family, args, models, batch)
    assert torch.isfinite(loss) and loss.item() > 0
    loss.backward()
    grads = {n: p.grad for n, p in models.unet.named_parameters() if p.grad is not None}
    models.unet.zero_grad()
    assert all(any(n.startswith(f"transformer_blocks.{i}.") and g.abs().sum() > 0 for n, g in grads.items())
               for i in range(2))
    with torch.no_grad():
        still = {"pixel_values": batch["pixel_values"][:, :, 0], "captions": batch["captions"]}
        one_frame = {"pixel_values": batch["pixel_values"][:, :, :1], "captions": batch["captions"]}
        assert loss_of(family, args, models, still).item() == loss_of(family, args, models, one_frame).item()
        memo = TextEncoder(models, torch.device("cpu"), torch.float32, cache=True)
        for pixels in (batch["pixel_values"], still["pixel_values"]):  # clips (B,2,C,F',h,w), stills (B,2,C,h,w)
            cached = {"latent_stats": posterior_stats(models.vae, pixels), "captions": batch["captions"]}
            assert cached["latent_stats"].ndim == pixels.ndim + 1
            memo(["a white box"])  # one caption memoised before the batch asks for both
            torch.testing.assert_close(loss_of(family, args, models, cached, text=memo),
                                       loss_of(family, args, models, {**batch, "pixel_values": pixels}),
                                       rtol=1e-5, atol=1e-6)
        buffers = models.vae.latents_mean.clone(), models.vae.latents_std.clone()
        models.vae.latents_mean.zero_(), models.vae.latents_std.fill_(1.0)
        try:
            assert loss_of(family, args, models, batch).item() != loss.item()  # the buffers enter the loss
        finally:
            models.vae.latents_mean.copy_(buffers[0]), models.vae.latents_std.copy_(buffers[1])


def test_gradient_checkpointing_gives_the_same_gradients_and_bf16_trains(ltx_path):
    """--gradient_checkpointing recomputes the blocks: the same loss and gradients; a bf16 transformer
    (--mixed_precision bf16 with LoRA's frozen base) gives a finite float32 loss that backprops."""
    family = get_family("ltx")
    grads = []
    for flags in ([], ["--gradient_checkpointing"]):
        args = ltx_args(ltx_path, "--full_finetune", *flags)
        m = family.load_models(args)
        assert m.unet.is_gradient_checkpointing == bool(flags)
        loss = loss_of(family, args, m, clip_batch())
        loss.backward()
        grads.append((loss.item(), {n: p.grad.clone() for n, p in m.unet.named_parameters() if p.grad is not None}))
    assert grads[0][0] == grads[1][0] and grads[0][1].keys() == grads[1][1].keys()
    for name, g in grads[0][1].items():
        torch.testing.assert_close(grads[1][1][name], g, rtol=1e-5, atol=1e-7)
    m.unet.to(torch.bfloat16)
    text = lambda caps: family.encode_text(m, m.text_encoders, caps, "cpu")  # noqa: E731
    loss = family.training_loss(args, m, m.unet, clip_batch(), text, torch.Generator().manual_seed(0),
                                torch.bfloat16)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()


def test_lora_targets_every_blocks_attention_and_feed_forward(ltx_path, models):
    from hf_arb.train.lora import add_lora

    family = get_family("ltx")
    args = ltx_args(ltx_path, "--rank", "4")
    m = family.load_models(args)
    m.unet.requires_grad_(False)
    add_lora(m.unet, target_modules=family.lora_targets(args), rank=4, dtype=torch.float32)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in m.unet.named_parameters() if ".lora_A" in n}
    assert {a.split(".", 2)[2] for a in adapted} == {
        "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k", "attn2.to_v",
        "attn2.to_out.0", "ff.net.0.proj", "ff.net.2"}
    blocks = family.lora_targets(ltx_args(ltx_path, "--rank", "4", "--lora_blocks", "1"))
    assert blocks[0] == "transformer_blocks.1.to_q"


# ------------------------------------------------------------------------------------------ slow: the script
@pytest.fixture(scope="module")
def ltx_runs(ltx_path, shared_artifact) -> dict[str, Any]:
    """The unchanged script on the mixed folder of clips and stills, one process each, 3 steps: a LoRA on the fly,
    and the same from cached latents and prompt embeddings."""
    def build(root: Path) -> dict[str, Any]:
        folder = mixed_clip_folder(root / "mixed")
        base = ["--pretrained_model_name_or_path", ltx_path, "--train_data_dir", folder, *LTX_CLIP, "--rank", "4",
                "--learning_rate", "2e-2", "--max_train_steps", "3", "--frame_sampling", "random"]
        out = {}
        for name, extra in (("lora", []), ("cached", ["--cache_latents", "--cache_text_embeddings"])):
            stats = test_train.run_script([*base, *extra, "--output_dir", str(root / name)])
            out[name] = {"dir": str(root / name), "log": stats["log"],
                         "stats": json.loads(json.dumps(stats, default=str))}
        return out

    return shared_artifact("ltx-runs", build)


@pytest.mark.slow
def test_the_script_trains_an_ltx_lora_on_clips_and_stills_and_from_caches_to_the_same_losses(ltx_runs):
    """Stills and 9-frame clips both trained, never in one batch; the card states the buckets, the frame plan and
    the per-bucket shift and generates at a clip bucket; the cached run encodes each row once and trains the same rows
    to the on-the-fly losses (within the float16 latent cache's tolerance)."""
    from test_train import read_trace

    run = ltx_runs["lora"]
    trace = read_trace(Path(run["dir"]), 0)
    assert [t["step"] for t in trace] == [0, 1, 2] and all(np.isfinite(t["loss"]) for t in trace)
    assert {len(t["shape"]) for t in trace} == {4, 5}, trace
    for t in trace:
        frames = int(t["label"].split("x")[2])
        assert (t["shape"][2] == frames == 9) if len(t["shape"]) == 5 else frames == 1
    assert run["stats"]["family"] == "ltx" and "Timestep shift: per bucket, mu from each bucket's video" in run["log"]
    card = (Path(run["dir"]) / "README.md").read_text()
    assert "64x96x9" in card and "96x64x1" in card  # the buckets
    assert "--frame_sampling random" in card and "windows of each bucket's frame count" in card  # the frame plan
    h, w, f = map(int, re.search(r"height=(\d+), width=(\d+), num_frames=(\d+)", card).groups())
    assert f == 9 and (w, h) in trained_sizes(run["log"])  # a clip bucket with rows (not the table's 2:3 one)
    assert 'export_to_video(frames, "video.mp4", fps=24)' in card
    assert 'pipe.load_lora_weights("' in card  # LTXPipeline's own LoRA loader
    fly, cached = trace, read_trace(Path(ltx_runs["cached"]["dir"]), 0)
    assert ltx_runs["cached"]["stats"]["latents_encoded"] >= 6
    assert [t["rows"] for t in cached] == [t["rows"] for t in fly]
    assert {len(t["shape"]) for t in cached} == {5, 6}  # stills' (B, 2, C, h, w), clips' (B, 2, C, F', h, w)
    np.testing.assert_allclose([t["loss"] for t in cached], [t["loss"] for t in fly], rtol=2e-3)


@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
def test_two_processes_train_the_same_clip_bucket_and_a_full_fine_tune_resumes_exactly(ddp_batch):
    """Both ranks train one (W, H, F) bucket per step (stills or clips, a non-square one), different rows; the full
    fine-tune resumed from checkpoint-2 replays each rank's steps 3-4 (across the epoch boundary) to the same
    transformer weights (max abs diff 0.0), which steps 3-4 changed; the output is an LTXPipeline."""
    from _family_runs import transformer_weights
    from test_train import read_trace

    full, resumed = batch_result(ddp_batch, "clips-ltx-full"), batch_result(ddp_batch, "clips-ltx-resumed")
    traces = [read_trace(Path(full["out"]), r) for r in (0, 1)]
    assert [t["label"] for t in traces[0]] == [t["label"] for t in traces[1]]
    assert {len(t["shape"]) for t in traces[0]} == {4, 5} and {t["epoch"] for t in traces[0]} == {0, 1}
    assert any(t["shape"][-1] != t["shape"][-2] for t in traces[0])
    for a, b in zip(*traces):
        assert not set(a["rows"]) & set(b["rows"])
    for r in (0, 1):
        again = read_trace(Path(resumed["out"]), r)
        assert [(t["step"], t["rows"], t["loss"]) for t in again] == [
            (t["step"], t["rows"], t["loss"]) for t in traces[r][2:]]
    a, b = transformer_weights(full["out"]), transformer_weights(resumed["out"])
    ckpt = transformer_weights(full["out"] / "checkpoint-2")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0
    assert any(not torch.equal(ckpt[k], a[k]) for k in a)
    assert json.loads((full["out"] / "model_index.json").read_text())["_class_name"] == "LTXPipeline"


STOCK = r"""
import json, sys
import numpy as np, torch
from diffusers import LTXPipeline
results = {}
for name, job in json.loads(sys.argv[1]).items():
    pipe = LTXPipeline.from_pretrained(job["model"])
    if job["lora"]:
        pipe.load_lora_weights(job["lora"])
    out = pipe("a slow pan", height=96, width=64, num_frames=9, num_inference_steps=2, output_type="np",
               max_sequence_length=16, generator=torch.Generator().manual_seed(0)).frames
    results[name] = {"cls": type(pipe).__name__, "shape": list(out.shape), "finite": bool(np.isfinite(out).all()),
                     "adapters": list(pipe.get_active_adapters()), "frames": out.tolist()}
    del pipe
print("RESULT" + json.dumps(results))
"""


@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
def test_the_lora_and_the_full_fine_tune_load_in_stock_diffusers_and_generate_a_non_square_9_frame_clip(
        ltx_path, ltx_runs, ddp_batch):
    """Where hf_arb cannot be imported: LTXPipeline.from_pretrained(tiny) + load_lora_weights for the LoRA,
    LTXPipeline.from_pretrained for the 2-process full fine-tune; each generates 9 frames at 64x96 (not the default
    161 at 704x512), other than the base model's."""
    full = batch_result(ddp_batch, "clips-ltx-full")["out"]
    jobs = {"lora": {"model": ltx_path, "lora": ltx_runs["lora"]["dir"]},
            "full": {"model": str(full), "lora": None},
            "base": {"model": ltx_path, "lora": None}}
    results = job_result(STOCK, [json.dumps(jobs)])
    base = np.asarray(results["base"]["frames"])
    for name in ("lora", "full"):
        r = results[name]
        assert r["cls"] == "LTXPipeline" and r["shape"] == [1, 9, 96, 64, 3] and r["finite"], (name, r["shape"])
        assert bool(r["adapters"]) == (jobs[name]["lora"] is not None), name
        assert np.abs(np.asarray(r["frames"]) - base).max() > 0, name  # the training changes the clip
