"""HunyuanVideo 1.5 text-to-video (``HunyuanVideo15Pipeline``): loading, the two text encoders, the video VAE and the
flow-matching loss on clip latents, as one adapter.

What ``HunyuanVideo15Pipeline`` (diffusers 0.42) does, and the trainer follows:

- **prompts** go through two encoders. Qwen2.5-VL (``Qwen2_5_VLTextModel``) reads each caption in a chat template
  with the pipeline's system message, padded to ``tokenizer_max_length`` (1000) + the 108 template tokens it crops;
  the prompt embeddings are the third hidden state from the end, with their mask. ByT5 (``T5EncoderModel``) encodes
  the quoted text of a caption (glyphs, ``"…"``), 256 bytes with a mask; a caption without quotes gives zeros and an
  all-zero mask. :func:`encode_hunyuan_video_prompts` calls the pipeline's own public ``encode_prompt`` on a pipeline
  holding only the tokenizers and encoders, so the four tensors are the pipeline's exactly. The trainer's
  ``(hidden, pooled)`` pair carries them as ``hidden`` = the Qwen embeddings ``(B, L, D)`` and ``pooled`` = the Qwen
  mask, the ByT5 mask and the ByT5 embeddings flattened, ``(B, L + L2 + L2 D2)`` (:func:`pack_glyphs` /
  :func:`unpack_glyphs`): each caption's row is independent of the batch, which ``--cache_text_embeddings``
  memoises.
- **clips** are ``(B, C, F, H, W)`` in ``[-1, 1]`` (stills ``(B, C, H, W)`` train as 1-frame clips, as Wan's, through
  :class:`~hf_arb.families.wan.ClipVAE`). ``AutoencoderKLHunyuanVideo15`` compresses 16× in space and 4× in time
  (``temporal_compression_ratio``: clips of ``4k+1`` frames); the latents are scaled by ``vae.config.scaling_factor``
  (the pipeline divides by it before decoding).
- **timestep shift**: fixed. The pipeline calls ``scheduler.set_timesteps(sigmas=linspace(1, 0, n))`` and never
  passes a resolution ``mu``, so its ``FlowMatchEulerDiscreteScheduler`` shifts every size and length with its
  config's ``shift``; training shifts its times with the same value (``shift * t / (1 + (shift - 1) t)``).
  ``--shift_by_resolution`` is refused.
- **the transformer** (``HunyuanVideo15Transformer3DModel``, patch 1) takes, for text to video, the noisy latents
  concatenated with zero condition latents and a zero mask (``2 C + 1`` channels), zero image embeddings
  (``vision_num_semantic_tokens`` × ``image_embed_dim``), the timestep ``sigma * 1000`` and both text streams with
  their masks; it predicts the velocity ``noise - x``.
- **sizes**: bucket sides are multiples of the VAE's ``spatial_compression_ratio`` × the transformer's
  ``patch_size`` (16 × 1), what the pipeline's ``prepare_latents`` divides by; frames follow the VAE's rule.

LoRA adapts every attention's projections (image stream ``to_q``, ``to_k``, ``to_v``, ``to_out.0``; text stream
``add_q_proj``, ``add_k_proj``, ``add_v_proj``) and the image stream's feed-forward (``ff.net.0.proj``,
``ff.net.2``), not the last block's text outputs (``to_add_out``, ``ff_context``), which no loss reaches.
``HunyuanVideo15Pipeline`` has no LoRA loader (no ``load_lora_weights`` / ``save_lora_weights`` in diffusers 0.42):
the adapters are saved in diffusers' transformer-LoRA file (``transformer.``-prefixed keys plus the
``LoraConfig`` metadata, written by ``HunyuanVideoLoraLoaderMixin.save_lora_weights``), which stock diffusers loads
with ``pipe.transformer.load_lora_adapter(folder, prefix="transformer")``; the strength is the transformer's
``attention_kwargs={"scale": s}`` (1.0 by default), as the pipelines with a loader set it. The encoders stay frozen.

Example:
    ```py
    >>> from hf_arb.families import get_family
    >>> family = get_family("hunyuan_video15")
    >>> parts = family.load("hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v")
    >>> embeds, packed = family.encode_prompts(parts.tokenizers, parts.text_encoders, ["a cat"], "cpu", 1000)
    ```
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from hf_arb.checks import UsageError
from hf_arb.lazy import LazyModule

from .base import FROZEN_PARTS, Models, builtin_family
from .flow_family import FlowOptions
from .sample_weights import SAMPLE_WEIGHTS
from .video_family import VideoFamily
from .wan import ClipVAE, inner_vae, wan_scheduler_shift

torch: Any = LazyModule("torch")  # family detection must not import torch

__all__ = ["HYV_HUB_NAMES", "HYV_LORA_TARGET_MODULES", "HYV_TEXT_TOKENS", "HYV_VISION_TOKENS", "HunyuanVideo15Family",
           "encode_hunyuan_video_prompts", "pack_glyphs", "unpack_glyphs"]

#: the attention projections of every block (image and text streams) and the image stream's feed-forward
HYV_LORA_TARGET_MODULES: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj",
                                            "add_v_proj", "ff.net.0.proj", "ff.net.2")
#: Hub names of HunyuanVideo 1.5 checkpoints (lower case)
HYV_HUB_NAMES: tuple[str, ...] = ("hunyuanvideo-1.5", "hunyuanvideo1.5", "hunyuanvideo-1-5")
#: ``HunyuanVideo15Pipeline.tokenizer_max_length``: Qwen2.5-VL tokens per caption
HYV_TEXT_TOKENS = 1000
#: ``HunyuanVideo15Pipeline.vision_num_semantic_tokens``: the (zero, for text to video) image embeddings' length
HYV_VISION_TOKENS = 729
#: the LoRA file's weights and its prefix (``load_lora_adapter``'s ``prefix``)
LORA_FILE, LORA_PREFIX = "pytorch_lora_weights.safetensors", "transformer"


class VAEStandIn:
    """What ``HunyuanVideo15Pipeline.__init__`` reads of its VAE (the real model's compression and channels), for a
    pipeline that only encodes prompts."""

    temporal_compression_ratio = 4
    spatial_compression_ratio = 16
    config = SimpleNamespace(latent_channels=32)


def text_pipeline(tokenizers: list[Any], text_encoders: list[Any], max_sequence_length: int) -> Any:
    """A ``HunyuanVideo15Pipeline`` holding only the tokenizers and text encoders, its ``tokenizer_max_length`` set
    to ``max_sequence_length``. Its constructor reads the VAE's compression and latent channels (never used by
    ``encode_prompt``): a stand-in with the real model's values takes the VAE's place."""
    from diffusers import HunyuanVideo15Pipeline

    pipe = HunyuanVideo15Pipeline(text_encoder=text_encoders[0], tokenizer=tokenizers[0], transformer=None,
                                  vae=VAEStandIn(),
                                  scheduler=None, text_encoder_2=text_encoders[1], tokenizer_2=tokenizers[1],
                                  guider=None)
    pipe.tokenizer_max_length = int(max_sequence_length)
    return pipe


def pack_glyphs(mask: Any, embeds_2: Any, mask_2: Any) -> Any:
    """The Qwen mask ``(B, L)``, the ByT5 mask ``(B, L2)`` and the ByT5 embeddings ``(B, L2, D2)`` as one ``(B, L +
    L2 + L2 D2)`` tensor (the trainer's ``pooled`` slot, cached per caption); :func:`unpack_glyphs` inverts it."""
    return torch.cat([mask.to(embeds_2.dtype), mask_2.to(embeds_2.dtype), embeds_2.flatten(1)], dim=1)


def unpack_glyphs(packed: Any, text_tokens: int, glyph_dim: int) -> tuple[Any, Any, Any]:
    """``(mask (B, L), embeds_2 (B, L2, D2), mask_2 (B, L2))`` of a :func:`pack_glyphs` tensor, ``L`` =
    ``text_tokens``, ``D2`` = ``glyph_dim`` (the transformer's ``text_embed_2_dim``)."""
    rest = packed.shape[1] - text_tokens
    if rest % (glyph_dim + 1):
        raise ValueError(f"packed prompt width {packed.shape[1]} is not {text_tokens} + L2 x ({glyph_dim} + 1).")
    glyphs = rest // (glyph_dim + 1)
    mask = packed[:, :text_tokens]
    mask_2 = packed[:, text_tokens:text_tokens + glyphs]
    embeds_2 = packed[:, text_tokens + glyphs:].reshape(packed.shape[0], glyphs, glyph_dim)
    return mask, embeds_2, mask_2


def encode_hunyuan_video_prompts(tokenizers: list[Any], text_encoders: list[Any], captions: list[str], device: Any,
                                 max_sequence_length: int = HYV_TEXT_TOKENS) -> tuple[Any, Any]:
    """``HunyuanVideo15Pipeline.encode_prompt``'s four tensors for ``captions``: ``(embeds (B, L, D), packed)``
    with ``packed`` = :func:`pack_glyphs` of the Qwen mask, the ByT5 embeddings and the ByT5 mask, ``L`` =
    ``max_sequence_length`` (the pipeline's 1000 by default)."""
    pipe = text_pipeline(tokenizers, text_encoders, max_sequence_length)
    embeds, mask, embeds_2, mask_2 = pipe.encode_prompt(list(captions), device=device, batch_size=len(captions),
                                                        dtype=text_encoders[0].dtype)
    return embeds, pack_glyphs(mask, embeds_2.to(embeds.dtype), mask_2)


@builtin_family
class HunyuanVideo15Family(VideoFamily):
    """HunyuanVideo 1.5 text-to-video (``HunyuanVideo15Pipeline``, ``HunyuanVideo15Transformer3DModel``,
    ``AutoencoderKLHunyuanVideo15``, Qwen2.5-VL + ByT5)."""

    name = "hunyuan_video15"
    #: the text-to-video pipeline only (not ``HunyuanVideo15ImageToVideoPipeline``)
    class_prefixes = ("HunyuanVideo15Pipeline", "HunyuanVideo15Transformer3DModel")
    hub_name_hints = HYV_HUB_NAMES
    hub_name_excludes = ("i2v",)
    card_tags = ("hunyuan-video-1.5", "hunyuanvideo1.5-diffusers", "text-to-video")
    pipeline_class_name = "HunyuanVideo15Pipeline"
    transformer_class_name = "HunyuanVideo15Transformer3DModel"
    lora_target_modules = HYV_LORA_TARGET_MODULES
    lora_text_encoder_count = 0
    default_weighting_scheme = "none"
    default_precondition_outputs = False
    default_max_sequence_length = HYV_TEXT_TOKENS
    supports_packing = False  # --packing's block-diagonal step is written for SD3 / Flux's transformers
    supports_vae_encode_mode = False  # its own loss (not flow_loss): --vae_encode_mode is refused
    frame_rule_name = "hunyuan_video"
    vae_class_name = "AutoencoderKLHunyuanVideo15"
    # the 480p checkpoints' bucket height; one validation video per shape
    full_defaults = (480, 1, 1)
    lora_defaults = (480, 1, 1)
    #: frames per second of the card's and validation's MP4s (HunyuanVideo 1.5 trains and samples at 24)
    video_fps = 24

    @property
    def title(self) -> str:  # type: ignore[override]
        return "HunyuanVideo 1.5"

    def check_flags(self, args: argparse.Namespace) -> None:
        super().check_flags(args)
        if args.max_sequence_length is not None and args.max_sequence_length > HYV_TEXT_TOKENS:
            raise UsageError(f"--max_sequence_length {args.max_sequence_length} is above HunyuanVideo15Pipeline's "
                             f"{HYV_TEXT_TOKENS} Qwen2.5-VL tokens per caption (its tokenizer_max_length): use at "
                             f"most {HYV_TEXT_TOKENS}.")
        if getattr(args, "train_text_encoder", False):
            raise UsageError("--train_text_encoder: HunyuanVideo 1.5 trains the transformer only (its Qwen2.5-VL and "
                             "ByT5 encoders stay frozen): drop it.")
        if getattr(args, "pretrained_vae_model_name_or_path", None):
            raise UsageError("--pretrained_vae_model_name_or_path replaces an AutoencoderKL; HunyuanVideo 1.5's VAE "
                             "is its own video VAE (AutoencoderKLHunyuanVideo15): drop the flag.")
        if getattr(args, "with_prior_preservation", False):
            raise UsageError("--with_prior_preservation: generating class images with HunyuanVideo15Pipeline (it "
                             "returns frames, not images) is not supported yet: drop it.")
        if getattr(args, "shift_by_resolution", None):
            raise UsageError("--shift_by_resolution: HunyuanVideo15Pipeline samples every size and length with its "
                             "scheduler's fixed shift, which training uses too; a per-bucket shift would train noise "
                             "levels inference never uses. Drop it.")

    # ------------------------------------------------------------------------------------------ loading
    def load_text_encoders(self, path: str, revision: str | None, variant: str | None) -> tuple[list[Any], list[Any]]:
        """The Qwen2 tokenizer and Qwen2.5-VL text model, then the ByT5 tokenizer and T5 encoder."""
        from transformers import AutoTokenizer, ByT5Tokenizer, Qwen2_5_VLTextModel, T5EncoderModel

        kw = {"revision": revision}
        return ([AutoTokenizer.from_pretrained(path, subfolder="tokenizer", **kw),
                 ByT5Tokenizer.from_pretrained(path, subfolder="tokenizer_2", **kw)],
                [Qwen2_5_VLTextModel.from_pretrained(path, subfolder="text_encoder", variant=variant, **kw),
                 T5EncoderModel.from_pretrained(path, subfolder="text_encoder_2", variant=variant, **kw)])

    def load_vae(self, args: argparse.Namespace) -> Any:
        """The checkpoint's ``AutoencoderKLHunyuanVideo15``, as :class:`~hf_arb.families.wan.ClipVAE` (clips and
        stills through one encode), slicing on: the VAE's causal attention mask in diffusers 0.42 broadcasts wrongly
        for a batch of more than one clip (``enable_slicing`` encodes them one by one, the same numbers)."""
        vae = super().load_vae(args)
        vae.enable_slicing()
        return ClipVAE(vae)

    def load_models(self, args: argparse.Namespace, parts: frozenset[str] = FROZEN_PARTS,
                    transformer_kw: Mapping[str, Any] | None = None) -> Models:
        """:meth:`FlowFamily.load_models`, then freeze what no loss reaches: the last block's text-stream outputs
        (``attn.to_add_out``, ``ff_context``) feed only text tokens no later block reads. They never get a gradient,
        so training is unchanged; frozen, DDP does not wait for their gradients."""
        models = super().load_models(args, parts, transformer_kw)
        last = models.unet.transformer_blocks[-1]
        last.attn.to_add_out.requires_grad_(False)
        last.ff_context.requires_grad_(False)
        return models

    def options(self, scheduler_config: Mapping[str, Any], transformer: Any, **kwargs: Any) -> FlowOptions:
        """:meth:`FlowFamily.options` with the scheduler's fixed ``shift`` (the pipeline passes no ``mu``)."""
        return super().options(wan_scheduler_shift(scheduler_config), transformer, **kwargs)

    def latent_patch(self, args: argparse.Namespace) -> tuple[int, int, int]:
        """``(spatial_compression_ratio x patch_size, temporal_compression_ratio, patch_size_t)`` (16, 4, 1) from the
        checkpoint's VAE and transformer configs, as the pipeline patchifies: ``--video_token_budget``'s token count,
        read before any weight loads."""
        import diffusers

        path, rev = args.pretrained_model_name_or_path, args.revision
        vae = diffusers.AutoencoderKLHunyuanVideo15.load_config(path, subfolder="vae", revision=rev)
        config = diffusers.HunyuanVideo15Transformer3DModel.load_config(path, subfolder="transformer", revision=rev)
        return (int(vae["spatial_compression_ratio"]) * int(config["patch_size"]),
                int(vae["temporal_compression_ratio"]), int(config["patch_size_t"]))

    @staticmethod
    def vae_scale_factor(vae: Any) -> int:
        """``vae.config.spatial_compression_ratio`` (16): ``HunyuanVideo15Pipeline.vae_scale_factor_spatial``."""
        return int(vae.config.spatial_compression_ratio)

    def token_patch(self, transformer: Any) -> int:
        """The transformer's spatial ``patch_size`` (1)."""
        return int(transformer.config.patch_size)

    def spatial_multiple(self, models: Models) -> int:
        """What every bucket side must be a multiple of: the VAE's spatial factor × the patch (16 × 1)."""
        return self.vae_scale_factor(models.vae) * self.token_patch(models.unet)

    def frame_rule(self, models: Models | None = None) -> Any:
        """``4k+1`` frames: :data:`~hf_arb.video.frames.FRAME_RULES` ``["hunyuan_video"]``, its step read from the
        loaded VAE's ``temporal_compression_ratio`` where ``models`` is given (the pipeline's
        ``vae_scale_factor_temporal``)."""
        from hf_arb.video.frames import FrameRule, frame_rule

        rule = frame_rule(self.frame_rule_name)
        if models is None:
            return rule
        return FrameRule(rule.name, int(models.vae.config.temporal_compression_ratio), rule.pipelines)

    def startup_lines(self, models: Models, buckets: Any) -> str:
        rule = self.frame_rule(models)
        return (f"Timestep shift: fixed shift {models.options.shift.shift:g} from the scheduler, every bucket "
                f"(HunyuanVideo15Pipeline samples every size and length with it); clips of {rule.step}k+1 frames "
                f"(stills are 1-frame clips), sides multiples of {self.spatial_multiple(models)}")

    # ------------------------------------------------------------------------------------------ training
    def encode_prompts(self, tokenizers: list[Any], text_encoders: list[Any], captions: list[str],
                       device: Any, max_sequence_length: int) -> tuple[Any, Any]:
        """See :func:`encode_hunyuan_video_prompts`: ``(Qwen embeds (B, L, D), packed masks and glyphs)``."""
        return encode_hunyuan_video_prompts(tokenizers, text_encoders, captions, device, max_sequence_length)

    def sigmas(self, options: FlowOptions, t: Any) -> Any:
        """Training sigmas of unshifted times ``t`` in ``(0, 1]``: the scheduler's fixed shift, ``shift * t / (1 +
        (shift - 1) t)``, whatever the bucket's size and frames (``set_timesteps(sigmas=...)`` without ``mu``)."""
        from .shift import shift_sigmas

        return shift_sigmas(t, 0.0, options.shift)

    def predict(self, transformer: Any, noisy: Any, sigmas: Any, prompt_embeds: Any, pooled: Any,
                options: FlowOptions, config: Any = None) -> Any:
        """The velocity ``(B, C, F', h, w)`` at ``sigmas (B,)``, called as the text-to-video pipeline calls the
        transformer: the latents then zero condition latents and a zero mask on the channel axis, zero image
        embeddings, the timestep ``sigma * num_train_timesteps`` and both text streams (``pooled``: the packed masks
        and glyphs of :func:`pack_glyphs`). ``config``: the transformer's config where ``transformer`` is wrapped
        (DDP)."""
        b, c, f, h, w = noisy.shape
        cfg = config if config is not None else transformer.config
        mask, embeds_2, mask_2 = unpack_glyphs(pooled.to(noisy.device), prompt_embeds.shape[1],
                                               int(cfg.text_embed_2_dim))
        hidden = torch.cat([noisy, torch.zeros_like(noisy), noisy.new_zeros(b, 1, f, h, w)], dim=1)
        image_embeds = noisy.new_zeros(b, HYV_VISION_TOKENS, int(cfg.image_embed_dim))
        t = (sigmas.to(noisy.device, torch.float32) * options.num_train_timesteps).to(noisy.dtype)
        return transformer(hidden_states=hidden, image_embeds=image_embeds, timestep=t,
                           encoder_hidden_states=prompt_embeds.to(noisy.device, noisy.dtype),
                           encoder_attention_mask=mask.to(noisy.dtype),
                           encoder_hidden_states_2=embeds_2.to(noisy.dtype),
                           encoder_attention_mask_2=mask_2.to(noisy.dtype), return_dict=False)[0]

    def training_loss(self, args: argparse.Namespace, models: Models, denoiser: Any, batch: dict[str, Any],
                      text: Any, generator: Any, dtype: Any) -> Any:
        """Flow matching on clip latents ``(B, C, F', h, w)`` × ``scaling_factor`` with the scheduler's fixed shift;
        stills train as 1-frame clips. Draws, in order: posterior sample, noise, ``u``, prompt dropout."""
        from .flow import batch_device, draw, drop_captions, flow_matching_loss, noise_latents, posterior
        from .loss_mask import batch_loss_mask

        options, device = models.options, batch_device(batch)
        mean, std = posterior(batch, models.vae, device)
        if mean.ndim == 4:  # stills (encoded or cached as image latents): 1-frame clips
            mean, std = mean.unsqueeze(2), std.unsqueeze(2)
        latents = (mean + std * draw("randn", mean.shape, generator, device)) * float(models.vae.config.scaling_factor)
        noise, sigmas, noisy = noise_latents(latents, options, generator,
                                             sigmas_of=lambda t, _: self.sigmas(options, t))
        captions = drop_captions(batch["captions"], args.proportion_empty_prompts, generator)
        embeds, packed = text(captions)
        pred = self.predict(denoiser, noisy.to(dtype), sigmas, embeds, packed, options, models.unet.config)
        mask = batch_loss_mask(batch, device)
        if mask is not None and mask.ndim == 4:  # a still's (B, 1, h, w) mask on its one latent frame
            mask = mask.unsqueeze(2)
        return flow_matching_loss(pred, latents, noise, noisy, sigmas, options.weighting_scheme,
                                  options.precondition_outputs, batch.get(SAMPLE_WEIGHTS), mask=mask)

    def lora_targets(self, args: argparse.Namespace) -> list[str]:
        """:data:`HYV_LORA_TARGET_MODULES`, or ``--lora_layers``; ``--lora_blocks``: those of these blocks only
        (``transformer_blocks.<i>``)."""
        targets = ([m.strip() for m in args.lora_layers.split(",")] if args.lora_layers
                   else list(self.lora_target_modules))
        if args.lora_blocks is not None:
            targets = [f"transformer_blocks.{int(b)}.{m}" for b in args.lora_blocks.split(",") for m in targets]
        return targets

    # ------------------------------------------------------------------------------------------ LoRA files
    def lora_file_class(self, args: argparse.Namespace | None = None) -> Any:
        """``HunyuanVideoLoraLoaderMixin``: ``HunyuanVideo15Pipeline`` has no ``save_lora_weights``; this diffusers
        mixin writes (and ``lora_state_dict`` reads) the transformer-only LoRA file, ``transformer.``-prefixed keys
        with the ``LoraConfig`` in its metadata, which ``transformer.load_lora_adapter`` loads."""
        from diffusers.loaders import HunyuanVideoLoraLoaderMixin

        return HunyuanVideoLoraLoaderMixin

    def load_lora_into(self, pipe: Any, folder: str) -> None:
        """``pipe.transformer.load_lora_adapter`` (the pipeline has no ``load_lora_weights``), at strength 1."""
        pipe.transformer.load_lora_adapter(folder, weight_name=LORA_FILE, prefix=LORA_PREFIX)

    # ------------------------------------------------------------------------------------------ outputs
    def build_pipeline(self, args: argparse.Namespace, models: Models, denoiser: Any, dtype: Any, *,
                       final: bool = False) -> Any:
        """The stock ``HunyuanVideo15Pipeline`` around the trained transformer (validation reuses the loaded
        parts)."""
        from .flow import stock_pipeline

        parts: dict[str, Any] = {}
        if not final:
            parts = {"vae": inner_vae(models.vae), "text_encoder": models.text_encoders[0],
                     "tokenizer": models.tokenizers[0], "text_encoder_2": models.text_encoders[1],
                     "tokenizer_2": models.tokenizers[1]}
        return stock_pipeline(self, models.options, args.pretrained_model_name_or_path, denoiser,
                              components=parts, revision=args.revision, variant=args.variant, dtype=dtype)

    def card_lines(self, args: argparse.Namespace) -> list[str]:
        lines = ["HunyuanVideo 1.5 trains on clips of 4k+1 frames (stills as 1-frame clips) with its scheduler's "
                 "fixed `shift`, as `HunyuanVideo15Pipeline` samples every size and length.", ""]
        if getattr(args, "lora", False):
            lines += ["`HunyuanVideo15Pipeline` has no `load_lora_weights` (diffusers 0.42): the code below loads "
                      "the adapter into the transformer with `pipe.transformer.load_lora_adapter`; pass "
                      '`attention_kwargs={"scale": s}` to the pipeline call for another strength than 1.', ""]
        if getattr(args, "family_report", None):
            lines += ["```", args.family_report, "```", ""]
        return lines

    def usage(self, args: argparse.Namespace, repo_id: str) -> tuple[str, list[str]]:
        """A full fine-tune: ``from_pretrained``; a LoRA: the base pipeline, then the transformer's
        ``load_lora_adapter`` (the pipeline has no ``load_lora_weights``)."""
        cls = self.pipeline_class_name
        if getattr(args, "lora", False):
            return cls, [f'pipe = {cls}.from_pretrained("{args.pretrained_model_name_or_path}")',
                         f'pipe.transformer.load_lora_adapter("{repo_id}", weight_name="{LORA_FILE}", '
                         f'prefix="{LORA_PREFIX}")  # no pipe.load_lora_weights for this pipeline']
        return cls, [f'pipe = {cls}.from_pretrained("{repo_id}")']
