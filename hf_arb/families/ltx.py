"""LTX-Video text-to-video (``LTXPipeline``): loading, T5 prompts with their mask, the video VAE's normalised and
packed latents, the per-bucket sequence-length shift and the flow-matching loss on clip latents, as one adapter.

What ``LTXPipeline`` (diffusers 0.42) does, and the trainer follows:

- **prompts**: T5's last hidden states of each caption tokenised to ``max_sequence_length`` (128 by default; the
  encoder sees no mask, so the padding rows are not zeros) and the tokens' attention mask, which the transformer
  applies in cross-attention. :func:`encode_ltx_prompts` calls the pipeline's public ``encode_prompt`` (on a pipeline
  around the tokenizer and encoder only) and returns ``(embeds, mask)``; the mask rides in the pooled slot, so
  ``--cache_text_embeddings`` memoises both per caption.
- **clips**: a batch's ``pixel_values`` are ``(B, C, F, H, W)`` in ``[-1, 1]`` or ``(B, C, H, W)`` for stills, trained
  as 1-frame clips (:func:`~hf_arb.families.wan.clip_pixels`, :class:`~hf_arb.families.wan.ClipVAE`: the same
  conventions as Wan). ``F`` follows the VAE's frame rule, ``8k+1`` (``LTXPipeline.vae_temporal_compression_ratio``,
  the VAE's ``temporal_compression_ratio``); the latents are ``(B, C, F', H / 32, W / 32)`` with
  ``F' = (F - 1) // 8 + 1``.
- **VAE normalisation**: ``(z - latents_mean) * scaling_factor / latents_std`` per channel, with the VAE's
  ``latents_mean`` / ``latents_std`` *buffers* (weights, not config: the VAE always loads, :attr:`LTXFamily.loss_reads`)
  — the inverse of the pipeline's ``_denormalize_latents`` before decoding (:func:`normalize_ltx_latents`).
- **packing**: the transformer takes ``(B, F' h' w', C p_t p p)`` tokens (:func:`pack_latents`, the pipeline's
  ``_pack_latents`` layout; patch 1 x 1 in the released checkpoints), its latent ``num_frames``, ``height``,
  ``width`` and ``rope_interpolation_scale = (8 / frame_rate, 32, 32)`` (``frame_rate``: ``--target_fps``, else the
  pipeline's default 25), the timestep ``sigma * num_train_timesteps`` and the prompt mask; it predicts the velocity
  ``noise - x``.
- **timestep shift**: per bucket. ``LTXPipeline.__call__`` passes ``mu = calculate_shift(video_sequence_length, ...)``
  with ``video_sequence_length = F' * (H / 32) * (W / 32)`` (latent frames x latent pixels; the transformer's patch
  does not enter) and the scheduler's ``base/max_image_seq_len``, ``base/max_shift``; the scheduler
  (``use_dynamic_shifting``) shifts exponentially by it. Training shifts each batch's times with its bucket's ``mu``
  (:func:`ltx_sequence_length`); ``--no_shift_by_resolution`` is refused. The scheduler's ``shift_terminal`` stretch
  (0.1 in ``Lightricks/LTX-Video``) rescales a whole inference schedule and has no per-sample counterpart.
- **sizes**: bucket sides are multiples of the VAE's ``spatial_compression_ratio`` x the transformer's
  ``patch_size`` (32, what ``LTXPipeline.check_inputs`` demands); frames follow :meth:`LTXFamily.frame_rule`.

LoRA adapts every block's attention projections (self and cross: ``to_q``, ``to_k``, ``to_v``, ``to_out.0``) and
feed-forward (``ff.net.0.proj``, ``ff.net.2``), saved in diffusers' keys for ``LTXPipeline.load_lora_weights``. The
T5 encoder stays frozen.

LTX-2 (``LTX2Pipeline``) is not this family: it denoises video *and* audio latents jointly (``audio_vae``, a Gemma-3
encoder with ``connectors``, a transformer that returns ``(noise_pred_video, noise_pred_audio)``), another objective;
docs/video.md says why it is not trained.

Example:
    ```py
    >>> from hf_arb.families import get_family
    >>> family = get_family("ltx")
    >>> parts = family.load("Lightricks/LTX-Video")
    >>> embeds, mask = family.encode_prompts(parts.tokenizers, parts.text_encoders, ["a cat"], "cpu", 128)
    ```
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from hf_arb.checks import UsageError
from hf_arb.lazy import LazyModule

from .base import FROZEN_PARTS, Models, builtin_family
from .flow_family import FlowFamily, FlowOptions
from .sample_weights import SAMPLE_WEIGHTS
from .wan import WanFamily

torch: Any = LazyModule("torch")  # family detection must not import torch

__all__ = ["LTX_HUB_NAMES", "LTX_LORA_TARGET_MODULES", "LTXFamily", "encode_ltx_prompts", "ltx_sequence_length",
           "normalize_ltx_latents", "pack_latents", "pipeline_frame_rate", "unpack_latents"]

#: the transformer's attention (self and cross) and feed-forward linears, in every block
LTX_LORA_TARGET_MODULES: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2")
#: Hub names of LTX-Video checkpoints (lower case): ``Lightricks/LTX-Video`` and its versions (not LTX-2)
LTX_HUB_NAMES: tuple[str, ...] = ("ltx-video",)


def pipeline_frame_rate() -> int:
    """``LTXPipeline.__call__``'s default ``frame_rate`` (25), read from its signature."""
    import inspect

    from diffusers import LTXPipeline

    return int(inspect.signature(LTXPipeline.__call__).parameters["frame_rate"].default)


def encode_ltx_prompts(tokenizer: Any, text_encoder: Any, captions: list[str], device: Any,
                       max_sequence_length: int) -> tuple[Any, Any]:
    """``LTXPipeline.encode_prompt``'s ``(prompt_embeds (B, L, D), prompt_attention_mask (B, L) bool)``, through a
    pipeline that holds only ``tokenizer`` and ``text_encoder``."""
    from diffusers import LTXPipeline

    pipe = LTXPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=None, scheduler=None, transformer=None)
    embeds, mask, _, _ = pipe.encode_prompt(list(captions), do_classifier_free_guidance=False,
                                            max_sequence_length=max_sequence_length, device=device)
    return embeds, mask


def normalize_ltx_latents(latents: Any, vae: Any) -> Any:
    """``(z - latents_mean) * scaling_factor / latents_std`` per channel of ``(B, C, F', h, w)`` latents, with the
    VAE's buffers: the inverse of what ``LTXPipeline`` undoes before decoding."""
    view = (1, -1, 1, 1, 1)
    mean = vae.latents_mean.detach().to(latents.device, torch.float32).view(view)
    std = vae.latents_std.detach().to(latents.device, torch.float32).view(view)
    return (latents - mean) * float(vae.config.scaling_factor) / std


def pack_latents(latents: Any, patch_size: int = 1, patch_size_t: int = 1) -> Any:
    """``(B, C, F, H, W)`` → the transformer's tokens ``(B, F/p_t * H/p * W/p, C p_t p p)``, frame-major then row-major
    (``LTXPipeline``'s packing)."""
    b, c, f, h, w = latents.shape
    x = latents.reshape(b, c, f // patch_size_t, patch_size_t, h // patch_size, patch_size, w // patch_size,
                        patch_size)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4, 7).flatten(1, 3)


def unpack_latents(tokens: Any, frames: int, height: int, width: int, patch_size: int = 1,
                   patch_size_t: int = 1) -> Any:
    """The inverse of :func:`pack_latents`: tokens → ``(B, C, frames * p_t, height * p, width * p)`` (``frames``,
    ``height``, ``width``: the token grid)."""
    b = tokens.shape[0]
    x = tokens.reshape(b, frames, height, width, -1, patch_size_t, patch_size, patch_size)
    return x.permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(2, 3)


def ltx_sequence_length(latent_frames: Any, latent_height: Any, latent_width: Any) -> Any:
    """``LTXPipeline.__call__``'s ``video_sequence_length``: latent frames x latent height x latent width (the
    transformer's patch does not enter), the input of its ``calculate_shift``."""
    return latent_frames * latent_height * latent_width


@builtin_family
class LTXFamily(WanFamily):
    """LTX-Video text-to-video (``LTXPipeline``, ``LTXVideoTransformer3DModel``, ``AutoencoderKLLTXVideo``, T5).

    Clips, stills, the frame-rule checks and the card's video lines are Wan's (:class:`~hf_arb.families.wan.
    WanFamily`); the prompts, the latents, the shift and the transformer call are LTX's."""

    name = "ltx"
    #: the text-to-video pipeline only: not ``LTXImageToVideoPipeline``, ``LTXConditionPipeline``, ``LTX2Pipeline``
    class_prefixes = ("LTXPipeline", "LTXVideoTransformer3DModel")
    hub_name_hints = LTX_HUB_NAMES
    card_tags = ("ltx-video", "text-to-video")
    pipeline_class_name = "LTXPipeline"
    transformer_class_name = "LTXVideoTransformer3DModel"
    vae_class_name = "AutoencoderKLLTXVideo"
    lora_target_modules = LTX_LORA_TARGET_MODULES
    default_max_sequence_length = 128  # LTXPipeline.__call__'s default
    frame_rule_name = "ltx"
    #: the latents are normalised by the VAE's latents_mean / latents_std buffers (weights): the VAE always loads
    loss_reads = frozenset({"vae"})
    # LTXPipeline's default height (512 x 704 at 161 frames); one validation video per shape
    full_defaults = (512, 1, 1)
    lora_defaults = (512, 1, 1)
    #: the frame rate of the card's MP4 (``LTXPipeline``'s own example: ``export_to_video(video, ..., fps=24)``)
    video_fps = 24

    @property
    def title(self) -> str:  # type: ignore[override]
        return "LTX-Video"

    def check_flags(self, args: argparse.Namespace) -> None:
        FlowFamily.check_flags(self, args)
        if getattr(args, "train_text_encoder", False):
            raise UsageError("--train_text_encoder: LTX-Video trains the transformer only (its T5 encoder stays "
                             "frozen): drop it.")
        if getattr(args, "pretrained_vae_model_name_or_path", None):
            raise UsageError("--pretrained_vae_model_name_or_path replaces an AutoencoderKL; LTX-Video's VAE is its "
                             "own video VAE (AutoencoderKLLTXVideo): drop the flag.")
        if getattr(args, "with_prior_preservation", False):
            raise UsageError("--with_prior_preservation: generating class images with LTXPipeline (it returns "
                             "frames, not images) is not supported yet: drop it.")
        if getattr(args, "shift_by_resolution", None) is False:
            raise UsageError("--no_shift_by_resolution: LTXPipeline shifts every size and length by its video "
                             "sequence length (calculate_shift), which training follows per bucket; one shift for "
                             "every bucket would train noise levels inference never uses. Drop it.")

    # ------------------------------------------------------------------------------------------ loading
    def load_text_encoders(self, path: str, revision: str | None, variant: str | None) -> tuple[list[Any], list[Any]]:
        """The T5 tokenizer and encoder."""
        from transformers import AutoTokenizer, T5EncoderModel

        return ([AutoTokenizer.from_pretrained(path, subfolder="tokenizer", revision=revision)],
                [T5EncoderModel.from_pretrained(path, subfolder="text_encoder", variant=variant, revision=revision)])

    def load_models(self, args: argparse.Namespace, parts: frozenset[str] = FROZEN_PARTS,
                    transformer_kw: Mapping[str, Any] | None = None) -> Models:
        """:meth:`FlowFamily.load_models` (the VAE always: :attr:`loss_reads`); ``models.extra["frame_rate"]``: the
        rate the transformer's rotary positions assume, ``--target_fps`` (the clips' rate) or the pipeline's
        default (:func:`pipeline_frame_rate`)."""
        models = FlowFamily.load_models(self, args, parts, transformer_kw)
        fps = getattr(args, "target_fps", None)
        models.extra["frame_rate"] = float(fps) if fps else float(pipeline_frame_rate())
        return models

    def options(self, scheduler_config: Mapping[str, Any], transformer: Any, **kwargs: Any) -> FlowOptions:
        """:meth:`FlowFamily.options`: the scheduler's dynamic shift (``mu`` per bucket, as ``LTXPipeline``)."""
        return FlowFamily.options(self, scheduler_config, transformer, **kwargs)

    def latent_patch(self, args: argparse.Namespace) -> tuple[int, int, int]:
        """``(spatial_compression_ratio x patch_size, temporal_compression_ratio, patch_size_t)`` (32, 8, 1 for the
        released checkpoints): ``--video_token_budget``'s token count, as ``LTXPipeline`` packs its latents. The VAE's
        ratios are derived from its config in its constructor, so it is built on the meta device (accelerate's
        ``init_empty_weights``: no weight allocates or loads)."""
        import diffusers
        from accelerate import init_empty_weights

        path, rev = args.pretrained_model_name_or_path, args.revision
        with init_empty_weights():
            vae = diffusers.AutoencoderKLLTXVideo.from_config(
                diffusers.AutoencoderKLLTXVideo.load_config(path, subfolder="vae", revision=rev))
        config = diffusers.LTXVideoTransformer3DModel.load_config(path, subfolder="transformer", revision=rev)
        return (int(vae.spatial_compression_ratio) * int(config["patch_size"]), int(vae.temporal_compression_ratio),
                int(config["patch_size_t"]))

    @staticmethod
    def vae_scale_factor(vae: Any) -> int:
        """The VAE's ``spatial_compression_ratio`` (32): ``LTXPipeline.vae_spatial_compression_ratio``."""
        return int(vae.spatial_compression_ratio)

    def token_patch(self, transformer: Any) -> int:
        """The transformer's spatial ``patch_size`` (1 in the released checkpoints)."""
        return int(transformer.config.patch_size)

    def frame_rule(self, models: Models | None = None) -> Any:
        """``8k+1`` frames: :data:`~hf_arb.video.frames.FRAME_RULES` ``["ltx"]``, its step read from the loaded VAE's
        ``temporal_compression_ratio`` x the transformer's ``patch_size_t`` where ``models`` is given
        (``LTXPipeline.vae_temporal_compression_ratio``)."""
        from hf_arb.video.frames import FrameRule, frame_rule

        rule = frame_rule(self.frame_rule_name)
        if models is None:
            return rule
        step = int(models.vae.temporal_compression_ratio) * int(models.unet.config.patch_size_t)
        return FrameRule(rule.name, step, rule.pipelines)

    def shift_table(self, models: Models, buckets: Any) -> str:
        """Each bucket's ``video_sequence_length`` and ``mu`` as ``LTXPipeline`` computes them."""
        from .shift import shift_table_text

        return shift_table_text(buckets, models.options.shift, self.vae_scale_factor(models.vae), 1,
                                frame_step=self.frame_rule(models).step)

    def startup_lines(self, models: Models, buckets: Any) -> str:
        rule = self.frame_rule(models)
        return (f"Timestep shift: per bucket, mu from each bucket's video sequence length (latent frames x latent "
                f"pixels), as LTXPipeline computes it; clips of {rule.step}k+1 frames (stills are 1-frame clips), "
                f"sides multiples of {self.spatial_multiple(models)}, rotary positions at "
                f"{models.extra.get('frame_rate', pipeline_frame_rate()):g} fps\n" + self.shift_table(models, buckets))

    # ------------------------------------------------------------------------------------------ training
    def encode_prompts(self, tokenizers: list[Any], text_encoders: list[Any], captions: list[str],
                       device: Any, max_sequence_length: int) -> tuple[Any, Any]:
        """See :func:`encode_ltx_prompts`: ``(embeds (B, L, D), mask (B, L))``."""
        return encode_ltx_prompts(tokenizers[0], text_encoders[0], captions, device, max_sequence_length)

    def sigmas(self, options: FlowOptions, t: Any, latent_shape: tuple[int, ...] = (1, 1, 1)) -> Any:  # type: ignore[override]
        """Training sigmas of unshifted times ``t`` in ``(0, 1]`` for latents of ``latent_shape`` ``(F', h, w)``:
        the scheduler's exponential time shift by ``mu`` of :func:`ltx_sequence_length` (``LTXPipeline``'s
        ``calculate_shift``)."""
        from .shift import calculate_mu, shift_sigmas

        f, h, w = (int(n) for n in latent_shape[-3:])
        return shift_sigmas(t, float(calculate_mu(ltx_sequence_length(f, h, w), options.shift)), options.shift)

    def predict(self, transformer: Any, noisy: Any, sigmas: Any, prompt_embeds: Any, mask: Any,  # type: ignore[override]
                options: FlowOptions, frame_rate: float = 25.0, vae_factors: tuple[int, int] = (8, 32),
                patch: tuple[int, int] | None = None) -> Any:
        """The velocity ``(B, C, F', h, w)`` at ``sigmas (B,)``: the latents packed into tokens, the transformer at
        timestep ``sigma * num_train_timesteps`` with the prompt ``mask`` and ``rope_interpolation_scale = (temporal
        / frame_rate, spatial, spatial)`` (``vae_factors``: the VAE's temporal and spatial compression), unpacked.
        ``patch``: the transformer's ``(patch_size, patch_size_t)`` (default: its config; a DDP-wrapped transformer
        has none)."""
        p, pt = patch or (int(transformer.config.patch_size), int(transformer.config.patch_size_t))
        f, h, w = noisy.shape[2:]
        t = sigmas.to(noisy.device, torch.float32) * options.num_train_timesteps
        temporal, spatial = vae_factors
        out = transformer(hidden_states=pack_latents(noisy, p, pt), encoder_hidden_states=prompt_embeds.to(noisy.dtype),
                          timestep=t, encoder_attention_mask=mask, num_frames=f // pt, height=h // p, width=w // p,
                          rope_interpolation_scale=(temporal / frame_rate, spatial, spatial), return_dict=False)[0]
        return unpack_latents(out, f // pt, h // p, w // p, p, pt)

    def training_loss(self, args: argparse.Namespace, models: Models, denoiser: Any, batch: dict[str, Any],
                      text: Any, generator: Any, dtype: Any) -> Any:
        """Flow matching on normalised clip latents ``(B, C, F', h, w)`` (:func:`normalize_ltx_latents`), shifted by
        the bucket's ``mu``; stills train as 1-frame clips. Draws, in order: posterior sample, noise, ``u``, prompt
        dropout."""
        from .flow import batch_device, draw, drop_captions, flow_matching_loss, noise_latents, posterior
        from .loss_mask import batch_loss_mask

        options, device = models.options, batch_device(batch)
        mean, std = posterior(batch, models.vae, device)
        if mean.ndim == 4:  # stills (encoded or cached as image latents): 1-frame clips
            mean, std = mean.unsqueeze(2), std.unsqueeze(2)
        latents = normalize_ltx_latents(mean + std * draw("randn", mean.shape, generator, device), models.vae)
        noise, sigmas, noisy = noise_latents(latents, options, generator,
                                             sigmas_of=lambda t, _: self.sigmas(options, t, latents.shape))
        captions = drop_captions(batch["captions"], args.proportion_empty_prompts, generator)
        embeds, mask = text(captions)
        factors = (int(models.vae.temporal_compression_ratio), self.vae_scale_factor(models.vae))
        patch = (int(models.unet.config.patch_size), int(models.unet.config.patch_size_t))
        pred = self.predict(denoiser, noisy.to(dtype), sigmas, embeds, mask, options,
                            models.extra.get("frame_rate", 25.0), factors, patch)
        loss_mask = batch_loss_mask(batch, device)
        if loss_mask is not None and loss_mask.ndim == 4:  # a still's (B, 1, h, w) mask on its one latent frame
            loss_mask = loss_mask.unsqueeze(2)
        return flow_matching_loss(pred, latents, noise, noisy, sigmas, options.weighting_scheme,
                                  options.precondition_outputs, batch.get(SAMPLE_WEIGHTS), mask=loss_mask)

    def lora_targets(self, args: argparse.Namespace) -> list[str]:
        """:data:`LTX_LORA_TARGET_MODULES`, or ``--lora_layers``; ``--lora_blocks``: those of these blocks only
        (LTX's blocks are ``transformer_blocks.<i>``)."""
        return FlowFamily.lora_targets(self, args)

    # ------------------------------------------------------------------------------------------ outputs
    def card_lines(self, args: argparse.Namespace) -> list[str]:
        fps = getattr(args, "target_fps", None)
        rate = f"resampled to {fps:g} fps" if fps else "at each clip's own frame rate"
        lines = ["LTX-Video trains on clips of 8k+1 frames (stills as 1-frame clips), each bucket's timesteps shifted "
                 "by its video sequence length as `LTXPipeline` computes `mu` at that size and length.", "",
                 f"Frame plan: `--frame_sampling {getattr(args, 'frame_sampling', 'head')}` windows of each bucket's "
                 f"frame count, {rate}; the transformer's rotary positions assume "
                 f"{fps or pipeline_frame_rate():g} fps (`frame_rate`).", ""]
        if getattr(args, "family_report", None):
            lines += ["```", args.family_report, "```", ""]
        return lines

    def generation_args(self, args: argparse.Namespace, shape: tuple[int, ...]) -> list[str]:
        """Wan's (prompt, ``height``, ``width``, ``num_frames``), and ``frame_rate`` where ``--target_fps`` trained
        the rotary positions at another rate than the pipeline's default."""
        call = super().generation_args(args, shape)
        fps = getattr(args, "target_fps", None)
        return [*call, f"frame_rate={fps:g}"] if fps and fps != pipeline_frame_rate() else call

    def validation_kwargs(self, args: argparse.Namespace) -> dict[str, Any]:
        """``frame_rate``: ``--target_fps`` where given, the rate the rotary positions trained at (else none: the
        pipeline's default, which training assumed too)."""
        fps = getattr(args, "target_fps", None)
        return {"frame_rate": fps} if fps else {}

    def generation_lines(self, call: str) -> list[str]:
        """Generate the frames and write them as an MP4 with diffusers' ``export_to_video`` at :attr:`video_fps`."""
        return [f"frames = pipe({call}).frames[0]  # a trained bucket shape",
                f'export_to_video(frames, "video.mp4", fps={self.video_fps})  # imageio + imageio-ffmpeg write the MP4']
