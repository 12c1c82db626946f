"""Qwen-Image-Edit (``QwenImageEditPipeline``): Qwen-Image trained on a target image plus one reference image.

At inference ``QwenImageEditPipeline`` conditions on the input image twice, and :class:`QwenImageEditFamily` trains
exactly that, with the batch's reference column (``reference_pixel_values``, one ``(B, 3, H, W)`` tensor, from
:class:`~hf_arb.images.references.BucketedReferenceDataset`) as the input image:

- **in the prompt**: the edit template holds ``<|vision_start|><|image_pad|><|vision_end|>`` before the caption; the
  processor expands ``<|image_pad|>`` to one token per merged 28×28 patch of the image (its image processor's
  ``image_grid_thw.prod() // merge_size**2``) and Qwen2.5-VL's vision tower fills those tokens. The last hidden
  states of each prompt's tokens, the template's first 64 dropped, are the prompt embeddings (not cut to
  ``max_sequence_length``: the pipeline does not). :func:`edit_prompt_inputs` builds the processor's inputs from
  the tokenizer and image processor of the checkpoint's ``processor`` folder; the stock pipeline gets
  :func:`qwen2_vl_processor` (a ``Qwen2VLProcessor`` built without a video processor, so without torchvision).
- **in the image sequence**: the image's VAE latents (the posterior's mode, normalised per channel) are packed 2×2
  and appended to the noisy target's tokens, with ``img_shapes`` ``[(1, h/2, w/2), (1, h_r/2, w_r/2)]`` per sample;
  the prediction keeps the target's tokens. The resolution shift ``mu`` comes from the target's tokens alone.

The reference reaches the text encoder as the uint8 image it came from (``[-1, 1]`` pixels mapped back), as the
pipeline hands the processor a PIL image. The prompt embeddings depend on the image, so they are not cached; with
``--cache_latents`` the target's and the reference's latents are (:func:`pack_reference_mean` packs the cached
mean) and the batches still carry the reference pixels for the text encoder (docs/edit.md, "Cached latents").

Example:
    ```py
    >>> tokens, shapes = reference_latent_tokens(vae, pixels)      # (B, (h/2)(w/2), 4C), [(1, h/2, w/2)]
    ```
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from hf_arb.checks import UsageError
from hf_arb.lazy import LazyModule

from .base import Models, builtin_family
from .flow_family import FlowOptions, FlowParts
from .qwenimage import FramelessVAE, QwenImageFamily

torch: Any = LazyModule("torch")  # family detection must not import torch

__all__ = ["QWEN_EDIT_TEMPLATE_DROP", "QwenImageEditFamily", "edit_prompt_inputs", "edit_prompt_template",
           "edit_texts", "encode_edit_prompts", "pack_reference_mean", "qwen2_vl_processor", "reference_latent_tokens",
           "save_edit_pipeline", "stock_processor_code", "to_uint8_images"]

#: ``QwenImageEditPipeline.prompt_template_encode_start_idx``: template tokens before the image and caption
QWEN_EDIT_TEMPLATE_DROP = 64
IMAGE_PAD = "<|image_pad|>"


def edit_prompt_template() -> str:
    """``QwenImageEditPipeline.prompt_template_encode``."""
    return ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
            "background), then explain how the user's text instruction should alter or modify the image. Generate a "
            "new image that meets the user's requirements while maintaining consistency with the original input "
            "where appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}"
            "<|im_end|>\n<|im_start|>assistant\n")


def to_uint8_images(pixels: Any) -> list[Any]:
    """``(B, 3, H, W)`` pixels in ``[-1, 1]`` → ``B`` RGB PIL images (``round((x + 1) * 127.5)``, exact for pixels
    that came from uint8 images as ``x / 127.5 - 1``)."""
    from PIL import Image

    arr = ((pixels.detach().float().cpu() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return [Image.fromarray(a.permute(1, 2, 0).numpy()) for a in arr]


def edit_texts(captions: list[str]) -> list[str]:
    """The captions in :func:`edit_prompt_template` (one image placeholder each)."""
    return [edit_prompt_template().format(c) for c in captions]


def edit_prompt_inputs(tokenizer: Any, image_processor: Any, texts: list[str], images: list[Any]) -> dict[str, Any]:
    """What ``Qwen2VLProcessor(text=texts, images=images, padding=True, return_tensors="pt")`` returns:
    ``input_ids`` / ``attention_mask`` ``(B, L)``, ``pixel_values`` ``(patches, D)``, ``image_grid_thw``
    ``(n_images, 3)``.

    ``images`` holds one image per ``<|image_pad|>`` of ``texts``, in reading order; each placeholder becomes
    ``image_grid_thw[k].prod() // merge_size**2`` copies, as the processor expands it."""
    vision = image_processor(images=images, return_tensors="pt")
    merge = int(image_processor.merge_size) ** 2
    counts = iter([int(thw.prod()) // merge for thw in vision["image_grid_thw"]])
    expanded = []
    for text in texts:
        parts = text.split(IMAGE_PAD)
        expanded.append(parts[0] + "".join(IMAGE_PAD * next(counts) + p for p in parts[1:]))
    tokens = tokenizer(expanded, padding=True, return_tensors="pt")
    return {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"],
            "pixel_values": vision["pixel_values"], "image_grid_thw": vision["image_grid_thw"]}


def encode_edit_prompts(tokenizer: Any, image_processor: Any, text_encoder: Any, texts: list[str],
                        images: list[Any], device: Any) -> tuple[Any, Any]:
    """Qwen-Image-Edit prompt embeddings of templated ``texts`` (:func:`edit_texts`) with their ``images``, as
    ``QwenImageEditPipeline.encode_prompt(captions, image=images)``.

    Returns:
        ``embeds (B, L, D)`` (each prompt's hidden states, template dropped, then zeros up to the longest) and
        ``mask (B, L)`` int64 (1 on each prompt's tokens).
    """
    inputs = {k: v.to(device) for k, v in edit_prompt_inputs(tokenizer, image_processor, texts, images).items()}
    hidden = text_encoder(**inputs, output_hidden_states=True).hidden_states[-1]
    keep = inputs["attention_mask"].bool()
    rows = [hidden[i][keep[i]][QWEN_EDIT_TEMPLATE_DROP:] for i in range(len(texts))]
    n = max(r.shape[0] for r in rows)
    embeds = hidden.new_zeros(len(rows), n, hidden.shape[-1])
    mask = torch.zeros(len(rows), n, dtype=torch.long, device=hidden.device)
    for i, row in enumerate(rows):
        embeds[i, :row.shape[0]] = row
        mask[i, :row.shape[0]] = 1
    return embeds, mask


def qwen2_vl_processor(tokenizer: Any, image_processor: Any) -> Any:
    """The stock pipeline's ``processor`` from ``tokenizer`` and ``image_processor``: a
    :class:`~hf_arb.families.qwen_processor.QwenImageOnlyProcessor` (a ``Qwen2VLProcessor`` without a video
    processor, which transformers 5 cannot build without torchvision; images never need one)."""
    from .qwen_processor import QwenImageOnlyProcessor

    return QwenImageOnlyProcessor(image_processor=image_processor, tokenizer=tokenizer)


def stock_processor_code(folder: str) -> list[str]:
    """Source lines that build ``processor``, the edit pipelines' ``Qwen2VLProcessor`` of ``folder`` (a local
    pipeline folder or a Hub id), with public transformers APIs only (no hf_arb) and without torchvision: the
    model card passes it to ``from_pretrained(..., processor=processor)``. It is :func:`qwen2_vl_processor`'s
    class (:class:`~hf_arb.families.qwen_processor.QwenImageOnlyProcessor`) written out: transformers 5 builds a
    ``Qwen2VLProcessor`` only with a video processor, which needs torchvision, although the pipelines pass images
    only."""
    return [
        "from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen2VLProcessor",
        "",
        "class ImageOnlyProcessor(Qwen2VLProcessor):  # no video processor: no torchvision needed",
        "    def __init__(self, image_processor=None, tokenizer=None, chat_template=None):",
        "        super().__init__(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)",
        "",
        f'processor = ImageOnlyProcessor(Qwen2VLImageProcessorPil.from_pretrained("{folder}", subfolder="processor"),',
        f'                               AutoTokenizer.from_pretrained("{folder}", subfolder="processor"))',
    ]


def save_edit_pipeline(pipe: Any, output_dir: Any) -> None:
    """``pipe.save_pretrained(output_dir)`` with the processor in the layout of the Hub checkpoints: its tokenizer
    and ``preprocessor_config.json`` in ``processor/`` and ``"processor": ["transformers", "Qwen2VLProcessor"]`` in
    ``model_index.json`` (not hf_arb's :func:`qwen2_vl_processor` class), so stock diffusers loads it without hf_arb.
    A processor with a video processor (transformers with torchvision) is saved as it is."""
    import json
    from pathlib import Path

    processor = pipe.processor
    if getattr(processor, "video_processor", None) is not None:
        pipe.save_pretrained(output_dir)
        return
    out = Path(output_dir)
    pipe.register_modules(processor=None)
    try:
        pipe.save_pretrained(out)
    finally:
        pipe.register_modules(processor=processor)
    processor.tokenizer.save_pretrained(out / "processor")
    processor.image_processor.save_pretrained(out / "processor")
    index = json.loads((out / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (out / "model_index.json").write_text(json.dumps(index, indent=2))


def reference_latent_tokens(vae: Any, pixels: Any) -> tuple[Any, tuple[int, int, int]]:
    """The reference image as the pipeline's ``image_latents``: the posterior's mode of ``pixels`` ``(B, 3, H, W)``,
    :func:`pack_reference_mean` → ``(B, (H/16)(W/16), 4C)`` and its ``img_shapes`` entry ``(1, H/16, W/16)``.
    ``vae`` is a :class:`~hf_arb.families.qwenimage.FramelessVAE` (or the video VAE)."""
    flat = vae if isinstance(vae, FramelessVAE) else FramelessVAE(vae)
    with torch.no_grad():
        mean = flat.encode(pixels.to(flat.device, flat.dtype)).latent_dist.mean  # mode of a diagonal Gaussian
    return pack_reference_mean(flat.config, mean)


def pack_reference_mean(vae_config: Any, mean: Any) -> tuple[Any, tuple[int, int, int]]:
    """A reference's posterior mean ``(B, C, h, w)`` (encoded now, or ``--cache_latents``' cached mean), normalised
    per channel ``(z - latents_mean) / latents_std`` and packed 2×2 → ``((B, (h/2)(w/2), 4C), (1, h/2, w/2))``."""
    from .flux import pack_latents

    view = (1, len(vae_config.latents_mean), 1, 1)
    lmean = torch.tensor(vae_config.latents_mean, device=mean.device, dtype=mean.dtype).view(view)
    lstd = torch.tensor(vae_config.latents_std, device=mean.device, dtype=mean.dtype).view(view)
    latents = (mean - lmean) / lstd
    h, w = latents.shape[-2:]
    return pack_latents(latents), (1, h // 2, w // 2)


@builtin_family
class QwenImageEditFamily(QwenImageFamily):
    """Qwen-Image-Edit (``QwenImageEditPipeline``: Qwen-Image's transformer and VAE, Qwen2.5-VL with its vision
    tower). Defaults are Qwen-Image's; one ``--reference_image_column`` (the input image) is required."""

    name = "qwenimage-edit"
    class_prefixes = ("QwenImageEditPipeline",)  # not Plus / inpaint: their prompts differ
    hub_name_hints = ("qwen-image-edit",)  # the dated Plus releases too: their subclass's claim wins
    hub_name_excludes = ()
    card_tags = ("qwen-image", "qwen-image-edit", "qwen-image-diffusers", "image-editing")
    pipeline_class_name = "QwenImageEditPipeline"
    #: the training script's ``--reference_image_column`` applies
    supports_references = True
    #: how many reference columns the pipeline takes (None: any number)
    max_references: int | None = 1
    image_argument = "one"
    #: with ``--cache_latents`` the batches still carry ``reference_pixel_values``: the text encoder's vision tower
    #: sees the reference pixels at every step (docs/edit.md, "Cached latents")
    reference_pixels_with_cache = True

    @property
    def title(self) -> str:  # type: ignore[override]
        return "Qwen-Image-Edit"

    def check_flags(self, args: argparse.Namespace) -> None:
        super().check_flags(args)
        refs = getattr(args, "reference_image_column", None) or []
        if not refs:
            raise UsageError(f"{self.title} trains on input images: add --reference_image_column COLUMN (the "
                             "'before' image of each before/after pair).")
        if self.max_references is not None and len(refs) > self.max_references:
            raise UsageError(f"--reference_image_column: {self.title} edits one input image, got {len(refs)} "
                             "reference columns: name exactly one (several: Qwen-Image-Edit-2509, the Plus pipeline).")
        if getattr(args, "cache_text_embeddings", False):
            raise UsageError("--cache_text_embeddings: Qwen-Image-Edit's prompt embeddings depend on the reference "
                             "image (it goes through the text encoder's vision tower), so they cannot be cached "
                             "per caption: drop the flag.")
        if getattr(args, "validation_prompt", None):
            raise UsageError("--validation_prompt: QwenImageEditPipeline needs an input image, which the validation "
                             "step does not have: drop the flag and edit with the saved LoRA (docs/edit.md).")

    def load(self, path: str, revision: str | None = None, variant: str | None = None,
             transformer_kw: Mapping[str, Any] | None = None) -> FlowParts:
        """Qwen-Image's parts, the tokenizer taken from the ``processor`` folder (the one the pipeline's prompts go
        through) and its image processor appended: ``tokenizers = [tokenizer, image_processor]``."""
        from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

        parts = super().load(path, revision, variant, transformer_kw)
        kw = {"subfolder": "processor", "revision": revision}
        parts.tokenizers = [AutoTokenizer.from_pretrained(path, **kw),
                            Qwen2VLImageProcessorPil.from_pretrained(path, **kw)]
        return parts

    def predict(self, transformer: Any, noisy: Any, sigmas: Any, prompt_embeds: Any, pooled: Any,
                options: FlowOptions, references: tuple[Any, list[tuple[int, int, int]]] | None = None) -> Any:
        """Qwen-Image's transformer call with the reference tokens appended (``img_shapes`` gains each reference's
        shape); the output keeps the target's tokens only, as the pipeline does."""
        if references is None:
            return super().predict(transformer, noisy, sigmas, prompt_embeds, pooled, options)
        from .flux import pack_latents, unpack_latents

        ref_tokens, ref_shapes = references
        b, _, h, w = noisy.shape
        target = pack_latents(noisy)
        mask = pooled.to(noisy.device) > 0.5
        n = max(int(mask.sum(1).max()), 1)
        mask = mask[:, :n]
        out = transformer(hidden_states=torch.cat([target, ref_tokens.to(target.dtype)], dim=1),
                          encoder_hidden_states=prompt_embeds[:, :n],
                          encoder_hidden_states_mask=None if bool(mask.all()) else mask,
                          timestep=sigmas.to(noisy.device, noisy.dtype),
                          img_shapes=[[(1, h // 2, w // 2), *ref_shapes]] * b, return_dict=False)[0]
        return unpack_latents(out[:, : target.shape[1]], h, w)

    def conditioned_predict(self, models: Models, denoiser: Any, batch: dict[str, Any], noisy: Any, sigmas: Any,
                            captions: list[str], text: Any, dtype: Any) -> Any:
        """Encode the captions with the reference image through the vision tower, append its latent tokens."""
        refs = batch.get("reference_pixel_values")
        if not refs:
            raise UsageError("Qwen-Image-Edit trains on a reference image: add --reference_image_column COLUMN.")
        texts, images = self.prompt_inputs(captions, refs)
        tokenizer, image_processor = models.tokenizers[:2]
        with torch.no_grad():
            embeds, mask = encode_edit_prompts(tokenizer, image_processor, models.text_encoders[0], texts, images,
                                               noisy.device)
        cached = batch.get("reference_latent_stats")  # --cache_latents: (B, 2, C, h_j, w_j) per reference
        if cached:
            packed = [pack_reference_mean(models.vae.config, s[:, 0].to(noisy.device, torch.float32))
                      for s in cached]
        else:
            packed = [reference_latent_tokens(models.vae, pixels) for pixels in refs]
        tokens = torch.cat([t for t, _ in packed], dim=1).to(dtype)
        return self.predict(denoiser, noisy, sigmas, embeds.to(dtype), mask, models.options,
                            references=(tokens, [shape for _, shape in packed]))

    def prompt_inputs(self, captions: list[str], refs: list[Any]) -> tuple[list[str], list[Any]]:
        """The templated prompts and the images (reading order) the text encoder sees: the reference as is."""
        return edit_texts(captions), to_uint8_images(refs[0])

    def usage(self, args: argparse.Namespace, repo_id: str) -> tuple[str, list[str]]:
        """The pipeline loaded with :func:`stock_processor_code`'s processor (the stock load needs torchvision),
        from the output folder, or from the base model with the LoRA."""
        cls = self.pipeline_class_name
        lora = getattr(args, "lora", False)
        folder = args.pretrained_model_name_or_path if lora else repo_id
        lines = [*stock_processor_code(folder), f'pipe = {cls}.from_pretrained("{folder}", processor=processor)']
        return cls, lines + ([f'pipe.load_lora_weights("{repo_id}")'] if lora else [])

    def save_pipeline(self, args: argparse.Namespace, pipe: Any, output_dir: str) -> None:
        """:func:`save_edit_pipeline` (the processor saved even where transformers cannot save it)."""
        save_edit_pipeline(pipe, output_dir)

    def build_pipeline(self, args: argparse.Namespace, models: Models, denoiser: Any, dtype: Any, *,
                       final: bool = False) -> Any:
        """The stock ``QwenImageEditPipeline`` around the trained transformer, loaded from the base folder."""
        from .flow import stock_pipeline

        parts: dict[str, Any] = {"processor": qwen2_vl_processor(*models.tokenizers[:2])}
        if not final:
            parts.update(vae=models.vae.vae if isinstance(models.vae, FramelessVAE) else models.vae,
                         text_encoder=models.text_encoders[0])
        return stock_pipeline(self, models.options, args.pretrained_model_name_or_path, denoiser,
                              components=parts, revision=args.revision, variant=args.variant, dtype=dtype)
