"""Qwen-Image-Edit-2509 / 2511 (``QwenImageEditPlusPipeline``): Qwen-Image-Edit with several input images.

It differs from :mod:`hf_arb.families.qwenimage_edit` only in how the input images are handed over, and
:class:`QwenImageEditPlusFamily` follows it, with one reference column per input image (in
``--reference_image_column`` order):

- **in the prompt**: ``Picture 1: <|vision_start|><|image_pad|><|vision_end|>Picture 2: …`` precedes the caption
  inside the template (which has no placeholder of its own); each image reaches the vision tower resized (Lanczos)
  to the pipeline's *condition* size, ``calculate_dimensions(384², aspect)`` (sides multiples of 32);
- **in the image sequence**: every image's latent tokens follow the target's, each with its own ``img_shapes`` entry.

At inference the pipeline resizes each input image to about 1024² pixels for the VAE; training uses each
reference at its bucket (``--reference_policy own`` gives each reference its own). The template drops 64 tokens,
as Qwen-Image-Edit's.
"""

from __future__ import annotations

from typing import Any

from .base import builtin_family
from .qwenimage_edit import QwenImageEditFamily, to_uint8_images

__all__ = ["QwenImageEditPlusFamily", "condition_images", "plus_prompt_template", "plus_texts"]


def plus_prompt_template() -> str:
    """``QwenImageEditPlusPipeline.prompt_template_encode``."""
    return ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
            "background), then explain how the user's text instruction should alter or modify the image. Generate a "
            "new image that meets the user's requirements while maintaining consistency with the original input "
            "where appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")


def plus_texts(captions: list[str], images: int) -> list[str]:
    """Each caption after ``images`` ``Picture k: <|vision_start|><|image_pad|><|vision_end|>`` prefixes, in the
    template (``QwenImageEditPlusPipeline._get_qwen_prompt_embeds``' prompt)."""
    prefix = "".join(f"Picture {k + 1}: <|vision_start|><|image_pad|><|vision_end|>" for k in range(images))
    return [plus_prompt_template().format(prefix + c) for c in captions]


def condition_images(images: list[Any]) -> list[Any]:
    """PIL images resized (Lanczos) to the pipeline's condition size ``calculate_dimensions(384 * 384, w / h)``."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, calculate_dimensions
    from PIL import Image

    out = []
    for im in images:
        w, h = calculate_dimensions(CONDITION_IMAGE_SIZE, im.size[0] / im.size[1])
        out.append(im.resize((int(w), int(h)), resample=Image.LANCZOS))
    return out


@builtin_family
class QwenImageEditPlusFamily(QwenImageEditFamily):
    """Qwen-Image-Edit-2509 / 2511 (``QwenImageEditPlusPipeline``): one reference column per input image."""

    name = "qwenimage-edit-plus"
    class_prefixes = ("QwenImageEditPlusPipeline",)
    hub_name_hints = ("qwen-image-edit-2509", "qwen-image-edit-2511", "qwen-image-edit-plus")
    pipeline_class_name = "QwenImageEditPlusPipeline"
    max_references = None
    image_argument = "list"

    @property
    def title(self) -> str:  # type: ignore[override]
        return "Qwen-Image-Edit-Plus"

    def prompt_inputs(self, captions: list[str], refs: list[Any]) -> tuple[list[str], list[Any]]:
        """Picture prefixes per reference; the images sample by sample, each at the condition size."""
        per_ref = [to_uint8_images(pixels) for pixels in refs]  # r lists of B images
        images = [im for sample in zip(*per_ref) for im in condition_images(list(sample))]
        return plus_texts(captions, len(refs)), images
