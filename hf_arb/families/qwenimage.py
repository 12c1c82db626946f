"""Qwen-Image: loading, prompt encoding, the video VAE's frame axis and the transformer call, as one adapter.

``QwenImagePipeline`` differs from Flux.1 in three ways the trainer must follow:

- **prompts** go through a chat template into Qwen2.5-VL; the last hidden states of the caption's tokens (the
  template's first 34 tokens dropped) are the prompt embeddings, of *variable length* per caption, with a mask.
  :func:`encode_qwen_prompts` pads each caption's embeddings to ``max_sequence_length`` (mask ``(B, L)`` in the
  ``pooled`` slot), so that the memoised per-caption embeddings of ``--cache_text_embeddings`` stack; the
  transformer call trims the batch back to its longest caption, as the pipeline pads a batch.
- **latents** come from ``AutoencoderKLQwenImage``, a video VAE with a frame axis ``(B, C, 1, h, w)`` and
  per-channel ``latents_mean`` / ``latents_std``. :class:`FramelessVAE` wraps it so the script (and the latent
  cache) see image latents ``(B, C, h, w)``; :meth:`QwenImageFamily.training_loss` normalises per channel.
- **the transformer** takes 2×2-packed latents (Flux's packing, :func:`hf_arb.families.flux.pack_latents`), the
  text mask and ``img_shapes`` ``[(1, h/2, w/2)]`` per sample; the timestep is ``sigma``.

The per-bucket shift is the pipeline's: ``image_seq_len = (h/2)(w/2)`` packed tokens and ``calculate_shift`` with
the scheduler's values (Qwen-Image: 256 → 0.5, 8192 → 0.9, dynamic). Bucket sides are multiples of 16 pixels.
Defaults follow diffusers' ``train_dreambooth_lora_qwen_image.py``: no loss weighting, velocity target, 512 text
tokens, LoRA on the attention projections ``to_k, to_q, to_v, to_out.0``; the text encoder is not trained.

Example:
    ```py
    >>> from hf_arb.families import get_family
    >>> family = get_family("qwenimage")
    >>> parts = family.load("Qwen/Qwen-Image")
    >>> embeds, mask = family.encode_prompts(parts.tokenizers, parts.text_encoders, ["a cat"], "cpu", 512)
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
from .flow_family import FlowFamily, FlowOptions
from .sample_weights import SAMPLE_WEIGHTS

torch: Any = LazyModule("torch")  # family detection must not import torch

__all__ = ["QWEN_LORA_TARGET_MODULES", "QWEN_TEMPLATE_DROP", "FramelessVAE", "QwenImageFamily", "encode_qwen_prompts",
           "qwen_prompt_template"]

#: diffusers' ``train_dreambooth_lora_qwen_image.py`` default LoRA targets (every attention's projections)
QWEN_LORA_TARGET_MODULES: tuple[str, ...] = ("to_k", "to_q", "to_v", "to_out.0")
#: ``QwenImagePipeline.prompt_template_encode_start_idx``: template tokens before the caption
QWEN_TEMPLATE_DROP = 34
#: ``QwenImagePipeline.tokenizer_max_length``
QWEN_TOKENIZER_MAX = 1024


def qwen_prompt_template() -> str:
    """``QwenImagePipeline.prompt_template_encode`` (the system prompt wrapped around each caption)."""
    return ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
            "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
            "<|im_start|>assistant\n")


def encode_qwen_prompts(tokenizer: Any, text_encoder: Any, captions: list[str], device: Any,
                        max_sequence_length: int) -> tuple[Any, Any]:
    """Qwen-Image prompt embeddings, as ``QwenImagePipeline.encode_prompt``, padded to a fixed length.

    Returns:
        ``embeds (B, max_sequence_length, D)``: each caption's hidden states (template dropped, at most
        ``max_sequence_length``) then zeros; ``mask (B, max_sequence_length)`` int64, 1 on the caption's tokens.
        ``embeds[:, :n]`` and ``mask[:, :n]`` with ``n = mask.sum(1).max()`` are the pipeline's own outputs.
    """
    txt = [qwen_prompt_template().format(c) for c in captions]
    tokens = tokenizer(txt, max_length=QWEN_TOKENIZER_MAX + QWEN_TEMPLATE_DROP, padding=True, truncation=True,
                       return_tensors="pt").to(device)
    hidden = text_encoder(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                          output_hidden_states=True).hidden_states[-1]
    keep = tokens.attention_mask.bool()
    rows = [hidden[i][keep[i]][QWEN_TEMPLATE_DROP:][:max_sequence_length] for i in range(len(captions))]
    embeds = hidden.new_zeros(len(captions), max_sequence_length, hidden.shape[-1])
    mask = torch.zeros(len(captions), max_sequence_length, dtype=torch.long, device=hidden.device)
    for i, row in enumerate(rows):
        embeds[i, :row.shape[0]] = row
        mask[i, :row.shape[0]] = 1
    return embeds, mask


class FramelessVAE:
    """``AutoencoderKLQwenImage`` seen as an image VAE: ``encode`` takes ``(B, 3, H, W)`` and its
    ``latent_dist.mean`` / ``.std`` are ``(B, C, h, w)`` (the frame axis of length 1 removed).

    Everything else (``config``, ``dtype``, ``device``, ``state_dict``, ``decode``…) is the wrapped VAE's;
    ``to`` moves the wrapped VAE and returns the wrapper. ``vae`` is the diffusers model, for pipelines.
    """

    def __init__(self, vae: Any) -> None:
        self.vae = vae

    def encode(self, pixels: Any) -> SimpleNamespace:
        dist = self.vae.encode(pixels.unsqueeze(2)).latent_dist
        return SimpleNamespace(latent_dist=SimpleNamespace(mean=dist.mean[:, :, 0], std=dist.std[:, :, 0]))

    def to(self, *args: Any, **kwargs: Any) -> FramelessVAE:
        self.vae.to(*args, **kwargs)
        return self

    def __getattr__(self, name: str) -> Any:
        if name == "vae":  # not set yet (copy / unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.vae, name)


def inner_vae(vae: Any) -> Any:
    """The diffusers VAE behind a :class:`FramelessVAE` (or ``vae`` itself)."""
    return vae.vae if isinstance(vae, FramelessVAE) else vae


@builtin_family
class QwenImageFamily(FlowFamily):
    """Qwen-Image (``QwenImagePipeline``, ``QwenImageTransformer2DModel``, ``AutoencoderKLQwenImage``)."""

    name = "qwenimage"
    class_prefixes = ("QwenImagePipeline", "QwenImageTransformer2DModel")  # not the edit pipelines
    hub_name_hints = ("qwen-image",)
    hub_name_excludes = ("edit",)  # the edit models are families of their own
    card_tags = ("qwen-image", "qwen-image-diffusers")
    pipeline_class_name = "QwenImagePipeline"
    transformer_class_name = "QwenImageTransformer2DModel"
    lora_target_modules = QWEN_LORA_TARGET_MODULES
    lora_text_encoder_count = 0
    default_weighting_scheme = "none"
    default_precondition_outputs = False
    default_max_sequence_length = 512
    supports_packing = False  # --packing's block-diagonal step is written for SD3 / Flux's transformers
    supports_vae_encode_mode = False  # its own loss (not flow_loss): --vae_encode_mode is refused

    @property
    def title(self) -> str:  # type: ignore[override]
        return "Qwen-Image"

    def check_flags(self, args: argparse.Namespace) -> None:
        super().check_flags(args)
        if args.max_sequence_length is not None and args.max_sequence_length > QWEN_TOKENIZER_MAX:
            raise UsageError(f"--max_sequence_length {args.max_sequence_length} is above Qwen-Image's "
                             f"{QWEN_TOKENIZER_MAX} text tokens: use at most {QWEN_TOKENIZER_MAX}.")
        if getattr(args, "train_text_encoder", False):
            raise UsageError("--train_text_encoder: Qwen-Image trains the transformer only (its Qwen2.5-VL encoder "
                             "stays frozen, as in diffusers' train_dreambooth_lora_qwen_image.py): drop it.")
        if getattr(args, "pretrained_vae_model_name_or_path", None):
            raise UsageError("--pretrained_vae_model_name_or_path replaces an AutoencoderKL; Qwen-Image's VAE is "
                             "its own video VAE: drop the flag.")

    vae_class_name = "AutoencoderKLQwenImage"

    def load_text_encoders(self, path: str, revision: str | None, variant: str | None) -> tuple[list[Any], list[Any]]:
        """Qwen2 tokenizer and Qwen2.5-VL encoder."""
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

        kw = {"revision": revision}
        return ([AutoTokenizer.from_pretrained(path, subfolder="tokenizer", **kw)],
                [Qwen2_5_VLForConditionalGeneration.from_pretrained(path, subfolder="text_encoder", variant=variant,
                                                                    **kw)])

    def load_vae(self, args: argparse.Namespace) -> Any:
        """``AutoencoderKLQwenImage``, as :class:`FramelessVAE`."""
        return FramelessVAE(super().load_vae(args))

    def load_models(self, args: argparse.Namespace, parts: frozenset[str] = FROZEN_PARTS,
                    transformer_kw: Mapping[str, Any] | None = None) -> Models:
        """:meth:`FlowFamily.load_models`, then freeze what no loss reaches: the last block's text-stream outputs
        (``attn.to_add_out``, ``txt_mlp``) feed only text tokens that no later block reads. They never get a
        gradient, so training is unchanged; frozen, DDP does not wait for their gradients (it would fail)."""
        models = super().load_models(args, parts, transformer_kw)
        last = models.unet.transformer_blocks[-1]
        last.attn.to_add_out.requires_grad_(False)
        last.txt_mlp.requires_grad_(False)
        return models

    @staticmethod
    def vae_scale_factor(vae: Any) -> int:
        """``2 ** len(temperal_downsample)`` (8), as the pipeline."""
        return 2 ** len(vae.config.temperal_downsample)

    def token_patch(self, transformer: Any) -> int:
        """The transformer's ``patch_size`` (2: the pipeline packs 2×2 latent patches)."""
        return int(transformer.config.patch_size)

    def encode_prompts(self, tokenizers: list[Any], text_encoders: list[Any], captions: list[str],
                       device: Any, max_sequence_length: int) -> tuple[Any, Any]:
        """See :func:`encode_qwen_prompts`: ``(embeds (B, L, D), mask (B, L))``; the mask takes the pooled slot."""
        return encode_qwen_prompts(tokenizers[0], text_encoders[0], captions, device, max_sequence_length)

    def predict(self, transformer: Any, noisy: Any, sigmas: Any, prompt_embeds: Any, pooled: Any,
                options: FlowOptions) -> Any:
        """Trim the text to the batch's longest caption, pack, call the transformer, unpack: ``(B, C, h, w)``.

        ``pooled`` is the text mask ``(B, L)`` (any dtype; nonzero = token); all ones passes no mask, as the pipeline.
        """
        from .flux import pack_latents, unpack_latents

        b, _, h, w = noisy.shape
        mask = pooled.to(noisy.device) > 0.5
        n = max(int(mask.sum(1).max()), 1)
        mask = mask[:, :n]
        out = transformer(hidden_states=pack_latents(noisy), encoder_hidden_states=prompt_embeds[:, :n],
                          encoder_hidden_states_mask=None if bool(mask.all()) else mask,
                          timestep=sigmas.to(noisy.device, noisy.dtype), img_shapes=[[(1, h // 2, w // 2)]] * b,
                          return_dict=False)[0]
        return unpack_latents(out, h, w)

    def training_loss(self, args: argparse.Namespace, models: Models, denoiser: Any, batch: dict[str, Any],
                      text: Any, generator: Any, dtype: Any) -> Any:
        """Flow matching on per-channel normalised latents ``(z - latents_mean) / latents_std`` (the pipeline's
        inverse), with the batch's resolution shift; draws: posterior sample, noise, ``u``, prompt dropout."""
        from .flow import batch_device, draw, drop_captions, flow_matching_loss, noise_latents, posterior

        options, device = models.options, batch_device(batch)
        mean, std = posterior(batch, models.vae, device)
        cfg = models.vae.config
        view = (1, len(cfg.latents_mean), 1, 1)
        lmean = torch.tensor(cfg.latents_mean, device=device, dtype=torch.float32).view(view)
        lstd = torch.tensor(cfg.latents_std, device=device, dtype=torch.float32).view(view)
        latents = (mean + std * draw("randn", mean.shape, generator, device) - lmean) / lstd
        noise, sigmas, noisy = noise_latents(latents, options, generator)
        captions = drop_captions(batch["captions"], args.proportion_empty_prompts, generator)
        pred = self.conditioned_predict(models, denoiser, batch, noisy.to(dtype), sigmas, captions, text, dtype)
        from .loss_mask import batch_loss_mask

        return flow_matching_loss(pred, latents, noise, noisy, sigmas, options.weighting_scheme,
                                  options.precondition_outputs, batch.get(SAMPLE_WEIGHTS),
                                  mask=batch_loss_mask(batch, device))

    def conditioned_predict(self, models: Models, denoiser: Any, batch: dict[str, Any], noisy: Any, sigmas: Any,
                            captions: list[str], text: Any, dtype: Any) -> Any:
        """The prediction ``(B, C, h, w)`` for the batch's (dropped-out) ``captions``, encoded by ``text``; an edit
        family conditions on the batch's reference images here."""
        embeds, mask = text(captions)
        return self.predict(denoiser, noisy, sigmas, embeds, mask, models.options)

    def build_pipeline(self, args: argparse.Namespace, models: Models, denoiser: Any, dtype: Any, *,
                       final: bool = False) -> Any:
        """The stock ``QwenImagePipeline`` around the trained transformer (validation reuses the loaded parts)."""
        from .flow import stock_pipeline

        parts: dict[str, Any] = {}
        if not final:
            parts = {"vae": inner_vae(models.vae), "text_encoder": models.text_encoders[0],
                     "tokenizer": models.tokenizers[0]}
        return stock_pipeline(self, models.options, args.pretrained_model_name_or_path, denoiser,
                              components=parts, revision=args.revision, variant=args.variant, dtype=dtype)
