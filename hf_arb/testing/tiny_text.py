"""Offline tiny CLIP tokenizer and text encoder, shared by the tiny SD/SDXL (:mod:`hf_arb.testing.tiny`) and SD3/Flux
(:mod:`hf_arb.testing.tiny_flow`) pipelines."""

from __future__ import annotations

from typing import Any

import torch

TEXT_HIDDEN = 32


def tiny_clip_tokenizer(model_max_length: int = 77) -> Any:
    """A working ``CLIPTokenizer`` with a byte-level alphabet vocabulary and no merges (no download).

    Every byte character ``c`` of GPT-2's byte-level alphabet is a token, as is ``c + "</w>"`` (the end-of-word
    form CLIP's BPE produces for the last character of a word), plus the start and end tokens (the end token
    doubles as padding and unknown). Vocabulary size is ``2 + 2 * 256 = 514``.
    """
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    vocab: dict[str, int] = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(ch, len(vocab))
        vocab.setdefault(ch + "</w>", len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=model_max_length)


def tiny_clip_text_encoder(vocab_size: int, *, with_projection: bool, seed: int) -> Any:
    """A 2-layer CLIP text encoder with random weights (seeded without touching the global RNG)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=TEXT_HIDDEN,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        projection_dim=TEXT_HIDDEN,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    with torch.random.fork_rng(devices=[]):  # leaves the caller's global RNG untouched
        torch.random.manual_seed(seed)
        cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
        return cls(config).eval()
