"""Quantized training of the transformer, as diffusers' Flux.2, Qwen-Image and Z-Image dreambooth LoRA scripts do it
(issue 35; the flags are checked before any model loads by :mod:`hf_arb.train.flags.quant_flags`).

- ``--bnb_quantization_config_path``: the JSON becomes a ``diffusers.BitsAndBytesConfig`` (with
  ``bnb_4bit_compute_dtype`` set to the mixed-precision dtype where ``load_in_4bit``, as upstream) passed to the
  transformer's ``from_pretrained`` with ``torch_dtype`` (:func:`transformer_load_kwargs`); peft's
  ``prepare_model_for_kbit_training`` then freezes it and upcasts its unquantized half-precision parameters to
  float32 (:func:`quantize_transformer`), and LoRA trains on top (QLoRA; the base is never cast to another dtype).
- ``--do_fp8_training``: torchao's ``convert_to_float8_training`` with ``Float8LinearConfig(pad_inner_dim=True)`` and
  upstream's module filter (:func:`fp8_module_filter`) swaps the transformer's linear layers for ``Float8Linear``
  (a ``torch.nn.Linear`` whose matmuls run in FP8) before LoRA wraps them. The module names do not change, so the
  saved LoRA (or the fully fine-tuned transformer) loads in stock diffusers.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from hf_arb.lazy import LazyModule

torch: Any = LazyModule("torch")
logger = logging.getLogger("train_text_to_image_arb")

__all__ = ["FP8_SKIPPED_MODULE", "bnb_config_kwargs", "card_lines", "fp8_module_filter", "plain_linear_count",
           "quantize_transformer", "transformer_load_kwargs"]

#: upstream's filter keeps the transformer's output projection in high precision
FP8_SKIPPED_MODULE = "proj_out"


def fp8_module_filter(module: Any, fqn: str) -> bool:
    """Upstream's ``module_filter_fn``: convert every module but the output projection (``proj_out``) and the linear
    layers whose ``in_features`` or ``out_features`` is not a multiple of 16 (FP8 matmuls need it)."""
    if fqn == FP8_SKIPPED_MODULE:
        return False
    if isinstance(module, torch.nn.Linear):
        return module.in_features % 16 == 0 and module.out_features % 16 == 0
    return True


def bnb_config_kwargs(config: dict[str, Any], weight_dtype: Any) -> dict[str, Any]:
    """``BitsAndBytesConfig`` arguments from the user's JSON: upstream sets ``bnb_4bit_compute_dtype`` to the
    mixed-precision dtype for 4-bit (overriding the file's, which warns once if it differs)."""
    out = dict(config)
    if out.get("load_in_4bit"):
        given = out.get("bnb_4bit_compute_dtype")
        if given is not None and str(given).replace("torch.", "") != str(weight_dtype).replace("torch.", ""):
            logger.warning("bnb_4bit_compute_dtype %s in --bnb_quantization_config_path is replaced by the "
                           "mixed-precision dtype %s, as upstream's scripts do (set --mixed_precision instead).",
                           given, str(weight_dtype).replace("torch.", ""))
        out["bnb_4bit_compute_dtype"] = weight_dtype
    return out


def transformer_load_kwargs(args: argparse.Namespace, weight_dtype: Any) -> dict[str, Any]:
    """The transformer's extra ``from_pretrained`` keywords: ``quantization_config`` and ``torch_dtype`` with
    ``--bnb_quantization_config_path``, else none."""
    path = getattr(args, "bnb_quantization_config_path", None)
    if path is None:
        return {}
    from diffusers import BitsAndBytesConfig

    from hf_arb.train.flags.quant_flags import read_bnb_config

    dtype = weight_dtype if weight_dtype is not None else torch.float32
    return {"quantization_config": BitsAndBytesConfig(**bnb_config_kwargs(read_bnb_config(path), dtype)),
            "torch_dtype": dtype}


def quantize_transformer(args: argparse.Namespace, transformer: Any) -> str | None:
    """After loading: peft's ``prepare_model_for_kbit_training`` for a bitsandbytes transformer, torchao's FP8
    conversion with ``--do_fp8_training``. Returns the line it logged (None when neither flag is given)."""
    if getattr(args, "bnb_quantization_config_path", None) is not None:
        from peft import prepare_model_for_kbit_training

        prepare_model_for_kbit_training(transformer, use_gradient_checkpointing=False)
        bits = 4 if getattr(transformer, "is_loaded_in_4bit", False) else 8
        line = f"QLoRA: the transformer is loaded {bits}-bit with bitsandbytes ({args.bnb_quantization_config_path})."
    elif getattr(args, "do_fp8_training", False):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        linear = plain_linear_count(transformer)
        convert_to_float8_training(transformer, module_filter_fn=fp8_module_filter,
                                   config=Float8LinearConfig(pad_inner_dim=True))
        fp8 = linear - plain_linear_count(transformer)  # (torchao's Float8Linear is not public: counted as the rest)
        line = (f"FP8 training (torchao): {fp8} of the transformer's {linear} linear layers convert (not "
                f"{FP8_SKIPPED_MODULE}, nor those with a side that is not a multiple of 16).")
    else:
        return None
    logger.info(line)
    return line


def plain_linear_count(model: Any) -> int:
    """How many of ``model``'s modules are plain ``torch.nn.Linear`` (not a subclass such as torchao's
    ``Float8Linear``)."""
    return sum(type(m) is torch.nn.Linear for m in model.modules())


def card_lines(args: argparse.Namespace) -> list[str]:
    """The model card's line on quantized training (upstream's card says "Quant training? FP8 TorchAO" /
    "BitsandBytes")."""
    if getattr(args, "do_fp8_training", False):
        return ["* quantized training: FP8 (torchao), the transformer's linear layers (not `proj_out`)"]
    if getattr(args, "bnb_quantization_config_path", None) is not None:
        return [f"* quantized training: bitsandbytes (QLoRA on the transformer loaded with "
                f"`{Path(args.bnb_quantization_config_path).name}`)"]
    return []
