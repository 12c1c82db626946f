"""HunyuanVideo 1.5 text-to-video (issue #38): detection, the two text encoders' embeddings and the transformer call
equal to ``HunyuanVideo15Pipeline``'s, the scheduler's fixed shift in training, the frame rule and spatial multiple
equal to what the pipeline generates, the loss on clip batches (stills as 1-frame clips; cached latents and memoised
prompts equal to on-the-fly), gradient checkpointing and bf16, and (slow) runs of the unchanged script: a LoRA on a
mixed folder of clips and stills, a full fine-tune and its exact resume, a 2-process LoRA in the shared batch; the
LoRAs (the pipeline has no ``load_lora_weights``: the transformer's ``load_lora_adapter``) and the full fine-tune load
in stock diffusers without hf_arb and generate a 48x32 clip of 5 frames (the default is 121).
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
from _train_fixtures import CLIP, GROUP, batch_result, mixed_clip_folder

import train_text_to_image_arb as script
from hf_arb.families import detect_family, detect_flow_family, get_family
from hf_arb.families.flow import unshifted_times
from hf_arb.families.hunyuan_video15 import HYV_TEXT_TOKENS, HYV_VISION_TOKENS, pack_glyphs, unpack_glyphs
from hf_arb.video.frames import FRAME_RULES

NAME = "hunyuan_video15"
CAPTIONS = ["a red fox in the snow", 'a shop sign that reads "OPEN"', "", "a very long caption " * 6]


@pytest.fixture(scope="session")
def hyv_assets(family_assets) -> dict[str, str]:
    return {"hyv": family_assets["hyv"], "images": family_assets["images"]}


@pytest.fixture(scope="module")
def pipe(hyv_assets):
    from diffusers import HunyuanVideo15Pipeline

    return HunyuanVideo15Pipeline.from_pretrained(hyv_assets["hyv"])


def hyv_args(path: str, *extra: str) -> Any:
    return script.parse_args(["--pretrained_model_name_or_path", path, "--train_data_dir", "d", *extra])


def clip_batch(frames: int = 5, seed: int = 0) -> dict[str, Any]:
    """Two synthetic clips (B, C, F, H, W) in [-1, 1] at 48x32: a bright square moving right, over noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(2, 3, frames, 32, 48, generator=g) * 0.4 - 0.2
    for f in range(frames):
        x[:, :, f, 8:24, 2 + 4 * f:18 + 4 * f] = 0.9
    return {"pixel_values": x, "captions": ["a square moving right", 'a box labelled "HI"']}


def loss_of(family, args, models, batch, seed=0, dtype=torch.float32):
    text = lambda caps: family.encode_text(models, models.text_encoders, caps, "cpu")  # noqa: E731
    return family.training_loss(args, models, models.unet, batch, text, torch.Generator().manual_seed(seed), dtype)


# ------------------------------------------------------------------------------------------ fast: parts
def test_detected_from_the_checkpoint_and_the_hub_names_with_its_defaults(hyv_assets, tmp_path):
    assert detect_family(hyv_assets["hyv"]) == detect_flow_family(hyv_assets["hyv"]) == NAME
    for hub_id in ("hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v",
                   "hunyuanvideo-community/HunyuanVideo-1.5-720p_t2v"):
        assert detect_family(hub_id) == NAME, hub_id
    assert detect_family("hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v") != NAME  # image to video
    (tmp_path / "i2v").mkdir()
    i2v = {"_class_name": "HunyuanVideo15ImageToVideoPipeline"}
    (tmp_path / "i2v" / "model_index.json").write_text(json.dumps(i2v))
    assert detect_family(str(tmp_path / "i2v")) != NAME
    args = hyv_args(hyv_assets["hyv"], "--rank", "4")
    assert args.family == NAME and args.output_dir == f"{NAME}-model-finetuned-lora" and args.resolution == 480


@pytest.mark.parametrize("flag, message", [
    (["--train_text_encoder"], "--train_text_encoder: HunyuanVideo 1.5 trains the transformer only"),
    (["--shift_by_resolution"], "--shift_by_resolution: HunyuanVideo15Pipeline samples every size and length"),
    (["--pretrained_vae_model_name_or_path", "x"], "its own video VAE"),
    (["--max_sequence_length", "1001"], "above HunyuanVideo15Pipeline's 1000 Qwen2.5-VL tokens"),
    (["--snr_gamma", "5"], "--snr_gamma applies to SD 1.x/2.x/SDXL UNets"),
    (["--packing"], "--packing"),
    (["--vae_encode_mode", "mode"], "--vae_encode_mode applies to"),
    (["--with_prior_preservation", "--class_data_dir", "c", "--class_prompt", "a photo"],
     "--with_prior_preservation: generating class images with HunyuanVideo15Pipeline"),
])
def test_flags_that_do_not_apply_are_refused_by_name(hyv_assets, flag, message):
    with pytest.raises(script.UsageError, match=message):
        hyv_args(hyv_assets["hyv"], "--rank", "4", *flag)


def test_guidance_scale_is_refused_before_training(hyv_assets):
    """The transformer has no guidance input (the pipeline's guider does classifier-free guidance at inference)."""
    with pytest.raises(script.UsageError, match="--guidance_scale 5.0: .*takes no guidance input"):
        get_family(NAME).load_models(hyv_args(hyv_assets["hyv"], "--rank", "4", "--guidance_scale", "5"))


def test_prompt_encoding_is_the_pipelines_and_each_caption_is_cacheable_alone(pipe):
    """The four tensors HunyuanVideo15Pipeline conditions on (Qwen embeddings and mask, ByT5 glyph embeddings and
    mask: only the quoted caption has glyphs), through the pipeline's own encode_prompt; the tiny tokenizer crops
    exactly its 108-token template prefix; a caption encoded alone equals its row (what --cache_text_embeddings
    memoises); the defaults are the pipeline's."""
    family = get_family(NAME)
    assert family.default_max_sequence_length == pipe.tokenizer_max_length == HYV_TEXT_TOKENS
    assert HYV_VISION_TOKENS == pipe.vision_num_semantic_tokens
    prefix = pipe.tokenizer.apply_chat_template([[{"role": "system", "content": pipe.system_message}]],
                                                tokenize=True, return_dict=True).input_ids[0]
    user = pipe.tokenizer("<|im_start|>user\n").input_ids
    assert len(prefix) + len(user) == pipe.prompt_template_encode_start_idx == 108
    tokenizers, encoders = [pipe.tokenizer, pipe.tokenizer_2], [pipe.text_encoder, pipe.text_encoder_2]
    with torch.no_grad():
        embeds, packed = family.encode_prompts(tokenizers, encoders, CAPTIONS, "cpu", HYV_TEXT_TOKENS)
        ref = pipe.encode_prompt(CAPTIONS, device="cpu", batch_size=len(CAPTIONS))
    mask, glyphs, glyph_mask = unpack_glyphs(packed, embeds.shape[1], pipe.transformer.config.text_embed_2_dim)
    for ours, theirs in zip((embeds, mask, glyphs, glyph_mask), ref):
        assert torch.equal(ours, theirs)
    assert glyph_mask.sum(1).tolist()[:3] == [0, len('Text "OPEN". ') + 1, 0]  # the quoted text's bytes + </s>
    assert torch.equal(pack_glyphs(mask, glyphs, glyph_mask), packed)
    with torch.no_grad():
        for i, caption in enumerate(CAPTIONS):
            alone, alone_packed = family.encode_prompts(tokenizers, encoders, [caption], "cpu", HYV_TEXT_TOKENS)
            torch.testing.assert_close(alone[0], embeds[i], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(alone_packed[0], packed[i], rtol=1e-5, atol=1e-6)


def test_predict_is_the_velocity_the_pipelines_scheduler_steps_with(pipe):
    """One Euler step from sigma 1 to 0 of the stock pipeline (text to video: zero condition latents, zero mask,
    zero image embeddings; guidance off) moves the latents by -velocity at timestep 1000: predict() gives exactly
    that velocity."""
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline
    from diffusers.guiders import ClassifierFreeGuidance

    family = get_family(NAME)
    euler = HunyuanVideo15Pipeline(**{**pipe.components, "scheduler": FlowMatchEulerDiscreteScheduler(shift=1.0),
                                      "guider": ClassifierFreeGuidance(guidance_scale=1.0)})
    x = torch.randn(1, 4, 2, 2, 3, generator=torch.Generator().manual_seed(1))  # 5 frames at 48x32
    stepped = euler("a wide clip", height=32, width=48, num_frames=5, num_inference_steps=1, latents=x.clone(),
                    output_type="latent").frames
    options = family.options(pipe.scheduler.config, pipe.transformer)
    with torch.no_grad():
        embeds, packed = family.encode_prompts([pipe.tokenizer, pipe.tokenizer_2],
                                               [pipe.text_encoder, pipe.text_encoder_2], ["a wide clip"], "cpu",
                                               HYV_TEXT_TOKENS)
        velocity = family.predict(pipe.transformer, x, torch.tensor([1.0]), embeds, packed, options)
        at_zero = family.predict(pipe.transformer, x, torch.tensor([0.001]), embeds, packed, options)
    torch.testing.assert_close(velocity, x - stepped, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(velocity, at_zero)  # the timestep reaches the transformer (1000, not 1)


@pytest.mark.parametrize("shift", [5.0, 7.0])
def test_training_sigmas_are_the_schedulers_fixed_shift_at_every_size(pipe, shift):
    """Training shifts its times with the scheduler's own shift, the same at every bucket size and frame count:
    equal to what the pipeline's set_timesteps(sigmas=...) gives at inference (it passes no mu)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    family = get_family(NAME)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift=shift)
    options = family.options(scheduler.config, pipe.transformer)
    assert options.shift.shift == shift and not options.by_resolution
    t = unshifted_times(torch.linspace(0.02, 0.98, 12), 1000)
    scheduler.set_timesteps(sigmas=t.numpy())
    torch.testing.assert_close(family.sigmas(options, t), scheduler.sigmas[:-1], rtol=1e-6, atol=1e-7)
    assert not torch.allclose(family.sigmas(options, t), t)  # shifted


def test_the_token_budgets_latent_patch_is_the_transformers_video_sequence_read_before_any_weight(pipe, hyv_assets):
    """Family.latent_patch (--video_token_budget's token count, from the configs): the pipeline's
    vae_scale_factor_spatial x the patch, its vae_scale_factor_temporal and patch_size_t; a bucket's tokens are the
    video tokens the transformer's patch embedding makes at that (W, H, F)."""
    from hf_arb.sampling.planning.batch_sizes import tokens_per_sample

    spatial, frame_step, patch_t = get_family("hunyuan_video15").latent_patch(hyv_args(hyv_assets["hyv"]))
    cfg = pipe.transformer.config
    assert (spatial, frame_step, patch_t) == (pipe.vae_scale_factor_spatial * cfg.patch_size,
                                              pipe.vae_scale_factor_temporal, cfg.patch_size_t)
    w, h, f = 48, 32, 9
    latents = torch.zeros(1, pipe.transformer.x_embedder.proj.in_channels, (f - 1) // frame_step + 1,
                          h // pipe.vae_scale_factor_spatial, w // pipe.vae_scale_factor_spatial)
    with torch.no_grad():
        tokens = pipe.transformer.x_embedder(latents).shape[1]
    assert tokens == int(tokens_per_sample([(w, h, f)], spatial=spatial, frame_step=frame_step, patch_t=patch_t)[0])


def test_frame_rule_and_spatial_multiple_are_what_the_pipeline_generates(pipe, hyv_assets):
    """The frame rule (4k+1, from the VAE) keeps exactly the frame counts the pipeline generates unchanged; the
    spatial multiple (VAE factor x patch, 16) keeps exactly the sizes it generates unchanged; check_buckets refuses
    a bucket of either kind by name."""
    family = get_family(NAME)
    models = family.load_models(hyv_args(hyv_assets["hyv"], "--rank", "4"))
    rule = family.frame_rule(models)
    assert rule == FRAME_RULES["hunyuan_video"] == family.frame_rule()
    assert rule.step == pipe.vae_scale_factor_temporal == 4
    step = family.spatial_multiple(models)
    assert step == pipe.vae_scale_factor_spatial * pipe.transformer.config.patch_size == 16
    kw = {"prompt": "a", "num_inference_steps": 1, "output_type": "np"}
    for n in range(1, 7):
        out = pipe(height=16, width=16, num_frames=n, **kw).frames
        assert (out.shape[1] == n) == rule.is_valid(n), n
    for w, h in [(48, 32), (40, 32), (48, 24)]:
        out = pipe(height=h, width=w, num_frames=1, **kw).frames
        accepted = out.shape[2:4] == (h, w)
        try:
            family.check_buckets(models, SimpleNamespace(resolutions=np.array([[w, h]])))
            ours = True
        except script.UsageError as err:
            assert "--bucket_step 16" in str(err)
            ours = False
        assert ours == accepted, (w, h)
    family.check_buckets(models, SimpleNamespace(resolutions=np.array([[48, 32, 9], [32, 48, 1]])))  # (W, H, F)
    with pytest.raises(script.UsageError, match=r"frame counts \[6\] do not fit HunyuanVideo 1.5's 4k\+1 frames"):
        family.check_buckets(models, SimpleNamespace(resolutions=np.array([[48, 32, 9], [48, 32, 6]])))


# ------------------------------------------------------------------------------------------ fast: the loss
def test_clip_loss_backprops_takes_stills_as_one_frame_clips_and_cached_equals_on_the_fly(hyv_assets):
    """On a fixed batch of two clips the loss is finite and reaches both blocks, and nothing trainable is left
    without a gradient (DDP would wait for it); stills train exactly as 1-frame clips; cached latent_stats (clips and
    stills) train as the pixels they encode; the memoised prompts (--cache_text_embeddings) give the same loss."""
    from hf_arb.train.cache.caches import TextEncoder, posterior_stats

    family = get_family(NAME)
    args = hyv_args(hyv_assets["hyv"], "--full_finetune", "--max_sequence_length", "16")
    models = family.load_models(args)
    batch = clip_batch()
    loss = loss_of(family, args, models, batch)
    assert torch.isfinite(loss) and loss.item() > 0
    loss.backward()
    trained = {n: p.grad for n, p in models.unet.named_parameters() if p.requires_grad}
    assert all(g is not None for g in trained.values()), [n for n, g in trained.items() if g is None]
    assert all(any(n.startswith(f"transformer_blocks.{i}.") and g.abs().sum() > 0 for n, g in trained.items())
               for i in range(2))
    models.unet.zero_grad()
    with torch.no_grad():
        still = {"pixel_values": batch["pixel_values"][:, :, 0], "captions": batch["captions"]}
        one_frame = {"pixel_values": batch["pixel_values"][:, :, :1], "captions": batch["captions"]}
        assert loss_of(family, args, models, still).item() == loss_of(family, args, models, one_frame).item()
        for pixels in (batch["pixel_values"], still["pixel_values"]):
            cached = {"latent_stats": posterior_stats(models.vae, pixels), "captions": batch["captions"]}
            assert cached["latent_stats"].ndim == pixels.ndim + 1
            torch.testing.assert_close(loss_of(family, args, models, cached),
                                       loss_of(family, args, models, {**batch, "pixel_values": pixels}),
                                       rtol=1e-5, atol=1e-6)
        memo = TextEncoder(models, torch.device("cpu"), torch.float32, cache=True)
        memo(["a square moving right"])  # memoised alone, then served with the other caption
        on_the_fly = loss_of(family, args, models, batch).item()
        cached_text = family.training_loss(args, models, models.unet, batch, memo, torch.Generator().manual_seed(0),
                                           torch.float32).item()
        assert cached_text == pytest.approx(on_the_fly, rel=1e-5)


def test_gradient_checkpointing_gives_the_same_gradients_and_bf16_trains(hyv_assets):
    """--gradient_checkpointing recomputes the blocks: the same loss and gradients; a bf16 transformer (LoRA's
    frozen base under --mixed_precision bf16) gives a finite float32 loss that backprops."""
    family = get_family(NAME)
    grads = []
    for flags in ([], ["--gradient_checkpointing"]):
        args = hyv_args(hyv_assets["hyv"], "--full_finetune", "--max_sequence_length", "16", *flags)
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
    loss = loss_of(family, args, models, clip_batch(), dtype=torch.bfloat16)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()


def test_lora_file_round_trips_for_resume_and_loads_in_the_stock_pipelines_transformer(pipe, hyv_assets, tmp_path):
    """HunyuanVideo15Pipeline has no save/load_lora_weights: the family's LoRA file class writes the adapters (with
    lora_alpha != r) and reads them back into a fresh adapter exactly (a LoRA checkpoint's resume), and
    Family.load_lora_into puts them in a stock pipeline's transformer at the trained strength (alpha / r)."""
    from diffusers import HunyuanVideo15Transformer3DModel
    from peft.utils import get_peft_model_state_dict

    from hf_arb.train.lora import add_lora, load_lora, save_lora

    family = get_family(NAME)
    assert not hasattr(pipe, "load_lora_weights") and not hasattr(type(pipe), "save_lora_weights")
    args = hyv_args(hyv_assets["hyv"], "--rank", "4")
    cls = family.lora_file_class(args)
    models = []
    for seed in (0, 1):
        model = HunyuanVideo15Transformer3DModel.from_pretrained(hyv_assets["hyv"], subfolder="transformer")
        add_lora(model, rank=4, alpha=8, target_modules=family.lora_targets(args))
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
        models.append(model)
    save_lora(cls, tmp_path, models[0], denoiser="transformer")
    load_lora(cls, tmp_path, models[1], denoiser="transformer")
    want, got = get_peft_model_state_dict(models[0]), get_peft_model_state_dict(models[1])
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    family.load_lora_into(pipe, str(tmp_path))
    try:
        config = next(iter(pipe.transformer.peft_config.values()))
        assert (config.r, config.lora_alpha) == (4, 8)
        loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=next(iter(pipe.transformer.peft_config)))
        assert loaded.keys() == want.keys() and all(torch.equal(loaded[k], want[k]) for k in want)
    finally:
        pipe.transformer.delete_adapters(list(pipe.transformer.peft_config))


# ------------------------------------------------------------------------------------------ slow: the script
@pytest.fixture(scope="module")
def hyv_runs(hyv_assets, shared_artifact) -> dict[str, Any]:
    """The unchanged script, one process each: a 3-step LoRA on a mixed folder of clips and stills (cached latents
    and prompts, final validation loading the saved LoRA as users do); a 4-step full fine-tune on the same folder
    (checkpoint at 2) and its resume from checkpoint-2 in a new folder."""
    def build(root: Path) -> dict[str, Any]:
        folder = mixed_clip_folder(root / "clips")
        preset = CLIP.index("--bucket_preset") + 1
        clips = ["--pretrained_model_name_or_path", hyv_assets["hyv"], "--train_data_dir", folder, *CLIP[:preset],
                 "hunyuan_video", *CLIP[preset + 1:]]
        full = [*clips, "--full_finetune", "--learning_rate", "1e-3", "--max_train_steps", "4",
                "--checkpointing_steps", "2", "--random_flip"]
        argvs = {"lora": [*clips, "--rank", "4", "--learning_rate", "2e-2", "--max_train_steps", "3",
                          "--cache_text_embeddings", "--cache_latents", "--validation_prompt", "a pan",
                          "--num_validation_inference_steps", "1", "--output_dir", str(root / "lora")],
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

    return shared_artifact("hyv-runs", build)


@pytest.mark.slow
def test_the_unchanged_script_trains_a_lora_on_clips_and_stills_and_validates_the_saved_file(hyv_runs):
    """3 steps on clip and still buckets from cached latents and prompts; the adapters are in diffusers'
    transformer-LoRA file (the attention projections and the image stream's feed-forward, not the last block's
    unreached text outputs) with their LoraConfig; the final validation loaded that file into a fresh base pipeline
    (the transformer's load_lora_adapter); the card says how to load it and states buckets and frames."""
    from safetensors import safe_open
    from test_train import read_trace

    run, out = hyv_runs["lora"], Path(hyv_runs["lora"]["dir"])
    trace = read_trace(out, 0)
    assert [t["step"] for t in trace] == [0, 1, 2] and all(np.isfinite(t["loss"]) for t in trace)
    assert {len(t["shape"]) for t in trace} == {5, 6}  # cached stills (B, 2, C, h, w), clips (B, 2, C, F', h, w)
    assert run["stats"]["family"] == NAME and run["stats"]["latents_encoded"] > 0
    assert "Timestep shift: fixed shift 5 from the scheduler" in run["log"]
    with safe_open(str(out / "pytorch_lora_weights.safetensors"), "pt") as f:
        keys, meta = list(f.keys()), f.metadata()
    modules = {k.split(".lora_")[0].split(".", 3)[-1] for k in keys if ".transformer_blocks." in k}
    assert all(k.startswith("transformer.") for k in keys)
    assert modules == {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                       "attn.add_v_proj", "ff.net.0.proj", "ff.net.2"}
    config = json.loads(meta["lora_adapter_metadata"])  # the LoraConfig, keys prefixed "transformer."
    assert config["transformer.r"] == 4 and config["transformer.lora_alpha"] == 4
    assert any(p.name.startswith("final-") for p in (out / "validation").iterdir())
    card = (out / "README.md").read_text()
    assert 'pipe.transformer.load_lora_adapter(' in card and "has no `load_lora_weights`" in card
    assert "num_frames=" in card and 'export_to_video(frames, "video.mp4", fps=24)' in card
    assert "4k+1 frames" in card


@pytest.mark.slow
def test_a_full_fine_tune_on_clips_and_stills_resumes_exactly(hyv_runs):
    """The full fine-tune trains clips (5-D batches) and stills (4-D) of the mixed folder, never in one batch; steps
    3-4 resumed from checkpoint-2 replay the rows and losses to the same transformer weights, which steps 3-4
    changed (measured: max abs diff 0.0 on CPU, asserted exactly); the saved pipeline is a HunyuanVideo15Pipeline."""
    from _family_runs import transformer_weights
    from test_train import read_trace

    assert {len(t["shape"]) for t in read_trace(Path(hyv_runs["full"]["dir"]), 0)} == {4, 5}

    check_full_resume(hyv_runs, NAME, "HunyuanVideo15Pipeline", "Timestep shift: fixed shift 5 from the scheduler")
    full, resumed = (transformer_weights(Path(hyv_runs[k]["dir"])) for k in ("full", "resumed"))
    assert all(torch.equal(full[k], resumed[k]) for k in full)


@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
def test_two_processes_train_the_same_clip_bucket_at_every_step(ddp_batch):
    """The 2-process LoRA of the shared batch: both ranks train one (W, H, F) bucket per step, different rows."""
    from test_train import read_trace

    run = batch_result(ddp_batch, "clips-hyv")
    traces = [read_trace(Path(run["out"]), r) for r in (0, 1)]
    assert [t["step"] for t in traces[0]] == [0, 1, 2]
    assert [t["label"] for t in traces[0]] == [t["label"] for t in traces[1]]
    for a, b in zip(*traces):
        assert a["shape"] == b["shape"] and not set(a["rows"]) & set(b["rows"])
    assert (Path(run["out"]) / "pytorch_lora_weights.safetensors").exists()


STOCK = r"""
import json, sys
import numpy as np, torch
from diffusers import HunyuanVideo15Pipeline
results = {}
for name, job in json.loads(sys.argv[1]).items():
    pipe = HunyuanVideo15Pipeline.from_pretrained(job["model"])
    if job["lora"]:  # the pipeline has no load_lora_weights
        pipe.transformer.load_lora_adapter(job["lora"], weight_name="pytorch_lora_weights.safetensors",
                                           prefix="transformer")
    out = pipe("a wide clip", height=32, width=48, num_frames=5, num_inference_steps=2, output_type="np",
               generator=torch.Generator().manual_seed(0)).frames
    results[name] = {"cls": type(pipe).__name__, "shape": list(out.shape), "finite": bool(np.isfinite(out).all()),
                     "adapters": list(getattr(pipe.transformer, "peft_config", None) or []), "frames": out.tolist()}
    del pipe
print("RESULT" + json.dumps(results))
"""


@pytest.mark.slow
def test_every_output_loads_in_stock_diffusers_and_generates_a_non_square_5_frame_clip(hyv_assets, hyv_runs):
    """Where hf_arb cannot be imported: HunyuanVideo15Pipeline.from_pretrained(tiny) + the transformer's
    load_lora_adapter for the LoRA, from_pretrained for the full fine-tune; each generates 5 frames at 48x32 (not
    the default 121), other than the base model's."""
    jobs = {"lora": {"model": hyv_assets["hyv"], "lora": hyv_runs["lora"]["dir"]},
            "full": {"model": hyv_runs["full"]["dir"], "lora": None},
            "base": {"model": hyv_assets["hyv"], "lora": None}}
    results = job_result(STOCK, [json.dumps(jobs)])
    base = np.asarray(results["base"]["frames"])
    for name in ("lora", "full"):
        r = results[name]
        assert r["cls"] == "HunyuanVideo15Pipeline" and r["shape"] == [1, 5, 32, 48, 3] and r["finite"], name
        assert bool(r["adapters"]) == (jobs[name]["lora"] is not None), name
        assert np.abs(np.asarray(r["frames"]) - base).max() > 0, name  # the training changes the clip
