"""Flux.2's ``--text_encoder_out_layers`` (diffusers' ``train_dreambooth_lora_flux2*.py`` flag): which hidden layers
of the text encoder are stacked into the prompt embeddings, checked against the loaded encoder, and what the model
card tells the user to pass to the pipeline. Used by :mod:`hf_arb.families.flux2`."""

from __future__ import annotations

import argparse
from typing import Any

from hf_arb.checks import UsageError

__all__ = ["layers_card_lines", "text_layers"]


def text_layers(args: argparse.Namespace, encoder: Any, default: tuple[int, ...]) -> tuple[int, ...]:
    """``--text_encoder_out_layers`` or the pipeline's ``default``; a layer past the encoder's ``num_hidden_layers``
    (hidden state 0 is the embeddings) is a UsageError naming the flag."""
    layers = tuple(getattr(args, "text_encoder_out_layers", None) or default)
    config = encoder.config.get_text_config() if hasattr(encoder.config, "get_text_config") else encoder.config
    depth = int(config.num_hidden_layers)
    if max(layers) > depth:
        raise UsageError(f"--text_encoder_out_layers {' '.join(map(str, layers))}: {args.pretrained_model_name_or_path}"
                         f"'s text encoder has {depth} layers (hidden states 0..{depth}).")
    return layers


def layers_card_lines(args: argparse.Namespace) -> list[str]:
    """The model card's note when the layers are not the pipeline's default: pass them to the pipeline call."""
    layers = getattr(args, "text_encoder_out_layers", None)
    if not layers:
        return []
    return [f"Trained with the text encoder's hidden layers {tuple(layers)} stacked into the prompt embeddings "
            f"(`--text_encoder_out_layers`): pass `text_encoder_out_layers={tuple(layers)}` to the pipeline call to "
            "prompt as training did.", ""]
