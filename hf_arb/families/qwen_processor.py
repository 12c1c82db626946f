"""The Qwen2-VL processor of the Qwen-Image edit pipelines, for images only: :class:`QwenImageOnlyProcessor`.

``QwenImageEditPipeline`` and ``QwenImageEditPlusPipeline`` call their ``processor`` (a ``Qwen2VLProcessor``) with
``text=`` and ``images=`` only. transformers 5 builds a ``Qwen2VLProcessor`` only with a video processor, and its
video processors need torchvision: without torchvision the constructor fails even for ``video_processor=None``
(the argument check looks the video class up). :class:`QwenImageOnlyProcessor` is the same processor, a subclass of
``Qwen2VLProcessor``, whose constructor takes no video processor: ``ProcessorMixin`` reads a processor's parts from
its constructor's signature (``get_attributes``), so it holds and checks an image processor and a tokenizer only.
It expands ``<|image_pad|>`` and returns ``input_ids``, ``attention_mask``, ``pixel_values`` and
``image_grid_thw`` exactly as ``Qwen2VLProcessor`` does (it runs its code), and the stock pipelines accept it as
their ``processor`` (it *is* a ``Qwen2VLProcessor``, which diffusers checks). What a run saves names the stock
``Qwen2VLProcessor`` (:func:`hf_arb.families.qwenimage_edit.save_edit_pipeline`), so the output loads without hf_arb.

This module imports transformers when it is imported; :mod:`hf_arb.families.qwenimage_edit` imports it only when
a processor is built (family detection must stay light).

Example:
    ```py
    >>> processor = QwenImageOnlyProcessor(image_processor=Qwen2VLImageProcessorPil(), tokenizer=tokenizer)
    >>> QwenImageEditPipeline.from_pretrained(path, processor=processor)
    ```
"""

from __future__ import annotations

from typing import Any

from transformers import Qwen2VLProcessor

__all__ = ["QwenImageOnlyProcessor"]


class QwenImageOnlyProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` without a video processor (no torchvision needed): an image processor (e.g. the
    PIL-only ``Qwen2VLImageProcessorPil``) and a tokenizer.

    Args:
        image_processor: a transformers image processor with ``merge_size`` (Qwen2-VL's).
        tokenizer: the Qwen2 tokenizer holding ``<|image_pad|>``.
        chat_template: as for ``Qwen2VLProcessor`` (the edit pipelines use none).
    """

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template, **kwargs)
