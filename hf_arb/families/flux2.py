"""Flux.2 (dev: ``Flux2Pipeline``; klein: ``Flux2KleinPipeline``): loading, prompt encoding, latent patchify and
packing, the per-bucket shift and the training step, for the training script (:class:`Flux2DevFamily`,
:class:`Flux2KleinFamily`).

What differs from Flux.1, read from diffusers' pipelines:

- **latents**: ``AutoencoderKLFlux2`` latents ``(B, C, h, w)`` are patchified 2×2 into channels ``(B, 4C, h/2, w/2)``
  and normalised by the VAE's batch-norm running statistics; the transformer sees them packed ``(B, (h/2)(w/2),
  4C)`` with 4-axis position ids ``(0, row, column, 0)`` (text tokens: ``(0, 0, 0, index)``). The model space of
  training (noise, target, loss) is the patchified, normalised one, as diffusers' ``train_dreambooth_lora_flux2.py``.
- **prompts**: three hidden layers of one decoder text encoder, stacked along the feature axis: dev renders a chat
  (system message + user text) for Mistral-3 and takes layers 10/20/30; klein renders Qwen-3's chat template per
  prompt and takes layers 9/18/27. ``(B, L, 3 D)``; no pooled embedding.
- **shift**: the pipelines pass ``mu = compute_empirical_mu(image_seq_len, num_inference_steps)`` (a fit of BFL's,
  not the scheduler's linear ``calculate_shift``). Training shifts each bucket with the ``mu`` of the pipeline's
  default :attr:`Flux2Family.mu_reference_steps` (50) steps at that bucket's size (:func:`empirical_mu`).
- **timestep** ``sigma`` (the pipeline's ``t / 1000``); dev takes a guidance input, klein none (real CFG).

Nothing here imports torch at import time.

Example:
    ```py
    >>> from hf_arb.families.flux2 import empirical_mu, patchify, unpatchify
    >>> x = torch.randn(2, 32, 6, 10)
    >>> torch.equal(unpatchify(patchify(x)), x)   # patchify: (2, 128, 3, 5)
    True
    >>> round(empirical_mu(64 * 64, 50), 4)       # a 1024 x 1024 image
    2.0234
    ```
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hf_arb.checks import UsageError
from hf_arb.lazy import LazyModule

from . import flux2_text
from .base import FROZEN_PARTS, Models, builtin_family
from .flow_family import FlowFamily, FlowOptions
from .sample_weights import SAMPLE_WEIGHTS

torch: Any = LazyModule("torch")  # family detection must not import torch

__all__ = ["FLUX2_HUB_NAME", "Flux2DevFamily", "Flux2Family", "Flux2KleinFamily", "empirical_mu", "flux2_lora_targets",
           "latent_ids", "normalize_latents", "pack", "patchify", "stack_hidden_layers", "text_ids", "unpack",
           "unpatchify"]

#: a Hub id's name that means Flux.2 ("FLUX.2-dev", "flux2-klein-4b", "flux-2-…")
FLUX2_HUB_NAME = re.compile(r"flux[._\- ]?2")


def flux2_lora_targets(num_single_blocks: int) -> tuple[str, ...]:
    """diffusers' ``train_dreambooth_lora_flux2*.py`` default targets: the double blocks' attention projections, the
    single blocks' fused ``to_qkv_mlp_proj`` and their attention output (dev: 48 single blocks; klein: 24)."""
    return ("to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj",
            *(f"single_transformer_blocks.{i}.attn.to_out" for i in range(num_single_blocks)))


# ------------------------------------------------------------------------------------------ pure tensor functions
def patchify(latents: torch.Tensor) -> torch.Tensor:
    """``(B, C, h, w)`` → ``(B, 4C, h/2, w/2)``: each 2×2 patch into channels (channel, patch row, patch column)."""
    b, c, h, w = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"Flux.2 patchifies 2x2 latent patches; latent size {h}x{w} is not even (bucket sides must "
                         "be multiples of 16 pixels).")
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`patchify`: ``(B, 4C, H, W)`` → ``(B, C, 2H, 2W)``."""
    b, c4, h, w = latents.shape
    x = latents.reshape(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return x.reshape(b, c4 // 4, h * 2, w * 2)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """``(B, C, H, W)`` → the token sequence ``(B, H*W, C)``, row-major."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).permute(0, 2, 1)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of :func:`pack`: ``(B, H*W, C)`` → ``(B, C, H, W)``."""
    b, _, c = tokens.shape
    return tokens.permute(0, 2, 1).reshape(b, c, height, width)


def latent_ids(batch: int, height: int, width: int, device: Any = "cpu") -> torch.Tensor:
    """Position ids ``(0, row, column, 0)`` of the packed tokens of ``height`` × ``width`` (patchified) latents:
    ``(B, H*W, 4)`` int64, as ``Flux2Pipeline.prepare_latents`` returns them."""
    rows = torch.arange(height, device=device).repeat_interleave(width)
    cols = torch.arange(width, device=device).repeat(height)
    zeros = torch.zeros_like(rows)
    return torch.stack([zeros, rows, cols, zeros], dim=1).unsqueeze(0).expand(batch, -1, -1)


def text_ids(batch: int, length: int, device: Any = "cpu") -> torch.Tensor:
    """Position ids ``(0, 0, 0, index)`` of ``length`` text tokens: ``(B, L, 4)`` int64, as ``encode_prompt``'s."""
    index = torch.arange(length, device=device)
    zeros = torch.zeros_like(index)
    return torch.stack([zeros, zeros, zeros, index], dim=1).unsqueeze(0).expand(batch, -1, -1)


def normalize_latents(patchified: torch.Tensor, vae: Any) -> torch.Tensor:
    """``(B, 4C, H, W)`` patchified latents → the model space: minus the VAE batch norm's running mean, over
    ``sqrt(running_var + batch_norm_eps)`` (``Flux2Pipeline._encode_vae_image``)."""
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(patchified.device, patchified.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(patchified.device,
                                                                                          patchified.dtype)
    return (patchified - mean) / std


def stack_hidden_layers(hidden_states: Any, layers: tuple[int, ...]) -> torch.Tensor:
    """Layers ``layers`` of a text encoder's hidden states ``(B, L, D)`` each → ``(B, L, len(layers) * D)``, the
    features of each token layer after layer (the pipelines' stack, permute and reshape)."""
    out = torch.stack([hidden_states[k] for k in layers], dim=1)
    b, n, length, d = out.shape
    return out.permute(0, 2, 1, 3).reshape(b, length, n * d)


def empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """``mu`` of the Flux.2 pipelines for ``image_seq_len`` latent tokens sampled in ``num_steps`` steps: BFL's fit,
    linear in the token count, interpolated between its 10- and 200-step lines (above 4300 tokens: the 200-step
    line). The same float arithmetic as ``diffusers.pipelines.flux2.pipeline_flux2.compute_empirical_mu``."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    m_200 = a2 * image_seq_len + b2
    m_10 = a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    b = m_200 - 200.0 * a
    return float(a * num_steps + b)


# ------------------------------------------------------------------------------------------ the family
class Flux2Family(FlowFamily):
    """What Flux.2 dev and klein share: everything but the text encoder (see the module doc). Defaults follow
    diffusers' ``train_dreambooth_lora_flux2.py``: no loss weighting, velocity target, 512 text tokens, guidance
    3.5 where the transformer takes one; the text encoder stays frozen."""

    transformer_class_name = "Flux2Transformer2DModel"
    vae_class_name = "AutoencoderKLFlux2"
    loss_reads = frozenset({"vae"})  # its latents are normalised by the VAE's batch-norm statistics (weights)
    card_tags = ("flux2", "flux2-diffusers")
    default_weighting_scheme = "none"
    default_precondition_outputs = False
    default_max_sequence_length = 512
    lora_text_encoder_count = 0
    supports_packing = False
    supports_vae_encode_mode = False  # its loss trains the posterior mean, as its scripts
    refusal_note = " (Flux.2 trains with --weighting_scheme and --shift_by_resolution instead)."
    #: the pipelines' default ``num_inference_steps``: the ``mu`` each bucket is trained with is theirs at this count
    mu_reference_steps: int = 50
    #: the text encoder's hidden layers the pipeline stacks (its ``text_encoder_out_layers`` default)
    hidden_layers: tuple[int, ...] = ()
    single_blocks: int = 48
    display_name: str = "Flux.2"
    #: ``--reference_image_column`` (repeatable): the pipelines' ``image=[...]`` multi-reference conditioning
    supports_references = True
    image_argument = "list"

    @property
    def title(self) -> str:  # type: ignore[override]
        return self.display_name

    @property
    def lora_target_modules(self) -> tuple[str, ...]:  # type: ignore[override]
        return flux2_lora_targets(self.single_blocks)

    def lora_targets(self, args: argparse.Namespace) -> list[str]:
        """diffusers' Flux.2 targets (:func:`flux2_lora_targets`) or ``--lora_layers``; ``--lora_blocks``: those
        modules (default: the attention projections) of those double-stream ``transformer_blocks`` only."""
        if args.lora_blocks is None:
            return super().lora_targets(args)
        modules = ([m.strip() for m in args.lora_layers.split(",")] if args.lora_layers
                   else ["attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0"])
        return [f"transformer_blocks.{int(b)}.{m}" for b in args.lora_blocks.split(",") for m in modules]

    def check_flags(self, args: argparse.Namespace) -> None:
        super().check_flags(args)
        if getattr(args, "train_text_encoder", False):
            raise UsageError(f"--train_text_encoder: {self.title}'s text encoder stays frozen (diffusers' "
                             "train_dreambooth_lora_flux2 scripts train the transformer only). "
                             "Drop --train_text_encoder.")
        if getattr(args, "packing", False):
            raise UsageError(f"--packing is implemented for SD3 / Flux.1, not yet for {self.title}: drop --packing "
                             "(buckets batch same-size images without padding).")

    def load_text(self, path: str, **kw: Any) -> tuple[Any, Any]:
        """Required. ``(tokenizer, text encoder)`` of the checkpoint."""
        raise NotImplementedError

    def load_text_encoders(self, path: str, revision: str | None, variant: str | None) -> tuple[list[Any], list[Any]]:
        tokenizer, encoder = self.load_text(path, revision=revision, variant=variant)
        return [tokenizer], [encoder]

    def load_models(self, args: argparse.Namespace, parts: frozenset[str] = FROZEN_PARTS,
                    transformer_kw: Mapping[str, Any] | None = None) -> Models:
        """:meth:`FlowFamily.load_models`, with the run's :meth:`out_layers` (checked against the text encoder where
        it is loaded)."""
        models = super().load_models(args, parts, transformer_kw)
        layers = (self.out_layers(args, models.text_encoders[0]) if models.text_encoders
                  else tuple(getattr(args, "text_encoder_out_layers", None) or self.hidden_layers))
        models.options = dataclasses.replace(models.options, text_layers=layers)
        return models

    def out_layers(self, args: argparse.Namespace, encoder: Any) -> tuple[int, ...]:
        """The stacked layers: ``--text_encoder_out_layers`` or :attr:`hidden_layers` (:mod:`.flux2_text`)."""
        return flux2_text.text_layers(args, encoder, self.hidden_layers)

    def encode_text(self, models: Models, encoders: list[Any], captions: list[str], device: Any) -> tuple[Any, Any]:
        return self.encode_prompts(models.tokenizers, encoders, captions, device, models.options.max_sequence_length,
                                   layers=models.options.text_layers)

    def token_patch(self, transformer: Any) -> int:
        """2: the pipeline patchifies 2×2 latent patches into one token."""
        return 2

    def bucket_mu(self, width: int, height: int, vae_scale_factor: int = 8) -> float:
        """The ``mu`` the stock pipeline uses at ``width`` × ``height`` pixels (:attr:`mu_reference_steps` steps)."""
        step = vae_scale_factor * 2
        return empirical_mu((height // step) * (width // step), self.mu_reference_steps)

    def batch_sigmas(self, t: torch.Tensor, latent_hw: tuple[int, int], options: FlowOptions) -> torch.Tensor:
        """Shift times ``t (B,)`` of a batch whose patchified latents are ``latent_hw``: with the per-bucket shift, by
        :func:`empirical_mu` of its token count; else the static shift (1: none, as diffusers' script)."""
        from .shift import shift_sigmas

        mu = empirical_mu(latent_hw[0] * latent_hw[1], self.mu_reference_steps) if options.by_resolution else 0.0
        return shift_sigmas(t, mu, options.shift)

    def startup_lines(self, models: Models, buckets: Any) -> str:
        """Each bucket's ``image_seq_len``, the pipeline's ``mu`` and the shifted sigma at t = 0.5."""
        import numpy as np

        from .shift import shift_sigmas

        options, factor = models.options, self.vae_scale_factor(models.vae)
        head = (f"Resolution shift: per bucket (mu = the {self.title} pipeline's empirical mu at "
                f"{self.mu_reference_steps} steps; {options.shift.time_shift_type})" if options.by_resolution
                else f"Resolution shift: off, one static shift {options.shift.shift:g} for every bucket "
                     "(--shift_by_resolution shifts each bucket as the pipeline does at its size)")
        lines = [head, f"{'id':>3}  {'width':>5}  {'height':>6}  {'seq_len':>7}  {'mu':>7}  {'sigma(0.5)':>10}"]
        for i, (w, h) in enumerate(np.asarray(buckets.resolutions).reshape(-1, 2).tolist()):
            seq = (h // (factor * 2)) * (w // (factor * 2))
            mu = self.bucket_mu(w, h, factor)
            mid = float(shift_sigmas(0.5, mu, options.shift))
            lines.append(f"{i:>3}  {w:>5}  {h:>6}  {seq:>7}  {mu:7.4f}  {mid:10.4f}")
        return "\n".join(lines)

    def predict(self, transformer: Any, noisy: torch.Tensor, sigmas: torch.Tensor, prompt_embeds: torch.Tensor,
                pooled: Any, options: FlowOptions, references: tuple[Any, Any] | None = None) -> torch.Tensor:
        """One transformer call on patchified latents ``noisy (B, 4C, H, W)`` at ``sigmas (B,)`` → ``(B, 4C, H, W)``:
        packed tokens with their ids (then ``references``' tokens and ids: :mod:`hf_arb.families.flux2_refs`),
        timestep ``sigma``, guidance where the transformer takes it."""
        b, _, h, w = noisy.shape
        device = noisy.device
        guidance = self.guidance(options, b, device)
        timesteps = sigmas.to(device, torch.float32) * options.num_train_timesteps
        tokens, ids = pack(noisy), latent_ids(b, h, w, device)
        if references is not None:
            tokens, ids = torch.cat([tokens, references[0].to(tokens.dtype)], 1), torch.cat([ids, references[1]], 1)
        out = transformer(hidden_states=tokens, timestep=(timesteps / options.num_train_timesteps).to(noisy.dtype),
                          guidance=guidance, encoder_hidden_states=prompt_embeds,
                          txt_ids=text_ids(b, prompt_embeds.shape[1], device), img_ids=ids, return_dict=False)[0]
        return unpack(out[:, :h * w], h, w)

    def training_loss(self, args: argparse.Namespace, models: Models, denoiser: Any, batch: dict[str, Any],
                      text: Any, generator: Any, dtype: Any) -> Any:
        """One micro-batch: the posterior mode (as diffusers' script) → patchify → batch-norm normalise → noise,
        ``u``, the bucket's shifted sigmas → transformer → the weighted MSE against ``noise - x``. Draws from
        ``generator`` in this order: noise, ``u``, prompt dropout."""
        from .flow import batch_device, drop_captions, flow_matching_loss, noise_latents, posterior

        options, device = models.options, batch_device(batch)
        mean, _ = posterior(batch, models.vae, device)
        latents = normalize_latents(patchify(mean), models.vae)
        noise, sigmas, noisy = noise_latents(latents, options, generator,
                                             lambda t, size: self.batch_sigmas(t, size, options))
        prompt_embeds, _ = text(drop_captions(batch["captions"], args.proportion_empty_prompts, generator))
        from .flux2_refs import batch_references

        pred = self.predict(denoiser, noisy.to(dtype), sigmas, prompt_embeds.to(dtype), None, options,
                            references=batch_references(models.vae, batch, lambda m: normalize_latents(
                                patchify(m), models.vae), device, dtype))
        from .loss_mask import batch_loss_mask

        mask = batch_loss_mask(batch, device)  # (B, 1, h, w): patchified as the latents, one weight per element
        mask = None if mask is None else patchify(mask.expand(-1, mean.shape[1], -1, -1).contiguous())
        return flow_matching_loss(pred, latents, noise, noisy, sigmas, options.weighting_scheme,
                                  options.precondition_outputs, batch.get(SAMPLE_WEIGHTS), mask=mask)

    def card_lines(self, args: argparse.Namespace) -> list[str]:
        encoder = flux2_text.layers_card_lines(args)
        if not getattr(args, "family_report", None):
            return encoder
        return [*encoder, "Per-bucket resolution shift (`mu` from each bucket's latent token count, as the "
                f"{self.title} "
                f"pipeline computes it at {self.mu_reference_steps} inference steps):", "", "```",
                args.family_report, "```", ""]


@builtin_family
class Flux2KleinFamily(Flux2Family):
    """Flux.2 [klein] (``Flux2KleinPipeline``): Qwen-3 text encoder (layers 9/18/27), no guidance input, 24 single
    blocks in diffusers' LoRA targets. Asked before :class:`Flux2DevFamily` (a klein name contains "flux.2")."""

    name = "flux2_klein"
    display_name = "Flux.2 [klein]"
    class_prefixes = ("Flux2Klein",)
    pipeline_class_name = "Flux2KleinPipeline"
    hidden_layers = (9, 18, 27)
    single_blocks = 24

    @classmethod
    def detect(cls, path: str) -> bool:
        if Path(path).is_dir():
            return super().detect(path)
        name = Path(path).name.lower()
        return bool(FLUX2_HUB_NAME.search(name)) and "klein" in name

    def load_text(self, path: str, **kw: Any) -> tuple[Any, Any]:
        from transformers import AutoTokenizer, Qwen3ForCausalLM

        return (AutoTokenizer.from_pretrained(path, subfolder="tokenizer", revision=kw["revision"]),
                Qwen3ForCausalLM.from_pretrained(path, subfolder="text_encoder", **kw))

    def encode_prompts(self, tokenizers: list[Any], text_encoders: list[Any], captions: list[str],
                       device: torch.device, max_sequence_length: int,
                       layers: tuple[int, ...] | None = None) -> tuple[torch.Tensor, None]:
        """Each caption as one user turn of Qwen-3's chat template (generation prompt, thinking off), padded to
        ``max_sequence_length``; layers 9/18/27 stacked: ``(B, max_sequence_length, 3 D)``, no pooled."""
        tok, encoder = tokenizers[0], text_encoders[0]
        ids, masks = [], []
        for caption in captions:
            rendered = tok.apply_chat_template([{"role": "user", "content": caption}], tokenize=False,
                                               add_generation_prompt=True, enable_thinking=False)
            enc = tok(rendered, return_tensors="pt", padding="max_length", truncation=True,
                      max_length=max_sequence_length)
            ids.append(enc["input_ids"])
            masks.append(enc["attention_mask"])
        out = encoder(input_ids=torch.cat(ids).to(device), attention_mask=torch.cat(masks).to(device),
                      output_hidden_states=True, use_cache=False)
        return stack_hidden_layers(out.hidden_states, layers or self.hidden_layers).to(encoder.dtype), None


@builtin_family
class Flux2DevFamily(Flux2Family):
    """Flux.2 [dev] (``Flux2Pipeline``): Mistral-3 text encoder (layers 10/20/30) on a chat with the pipeline's
    system message, guidance-distilled transformer, 48 single blocks in diffusers' LoRA targets."""

    name = "flux2"
    display_name = "Flux.2 [dev]"
    class_prefixes = ("Flux2Pipeline", "Flux2Transformer2DModel")
    pipeline_class_name = "Flux2Pipeline"
    hidden_layers = (10, 20, 30)
    single_blocks = 48

    @classmethod
    def detect(cls, path: str) -> bool:
        if Path(path).is_dir():
            return super().detect(path)
        name = Path(path).name.lower()
        return bool(FLUX2_HUB_NAME.search(name)) and "klein" not in name

    def load_text(self, path: str, **kw: Any) -> tuple[Any, Any]:
        """The processor (``PixtralProcessor``; a tokenizer where the folder holds only one) and Mistral-3."""
        from transformers import AutoProcessor, Mistral3ForConditionalGeneration

        return (AutoProcessor.from_pretrained(path, subfolder="tokenizer", revision=kw["revision"]),
                Mistral3ForConditionalGeneration.from_pretrained(path, subfolder="text_encoder", **kw))

    def encode_prompts(self, tokenizers: list[Any], text_encoders: list[Any], captions: list[str],
                       device: torch.device, max_sequence_length: int,
                       layers: tuple[int, ...] | None = None) -> tuple[torch.Tensor, None]:
        """The captions as chats (the pipeline's system message, then the user text), padded to
        ``max_sequence_length``; layers 10/20/30 stacked: ``(B, max_sequence_length, 3 D)``, no pooled."""
        from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

        tok, encoder = tokenizers[0], text_encoders[0]
        chats = [[{"role": "system", "content": [{"type": "text", "text": SYSTEM_MESSAGE}]},
                  {"role": "user", "content": [{"type": "text", "text": c.replace("[IMG]", "")}]}] for c in captions]
        enc = tok.apply_chat_template(chats, add_generation_prompt=False, tokenize=True, return_dict=True,
                                      return_tensors="pt", padding="max_length", truncation=True,
                                      max_length=max_sequence_length)
        out = encoder(input_ids=enc["input_ids"].to(device), attention_mask=enc["attention_mask"].to(device),
                      output_hidden_states=True, use_cache=False)
        return stack_hidden_layers(out.hidden_states, layers or self.hidden_layers).to(encoder.dtype), None
