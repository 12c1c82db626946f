"""Tiny, randomly initialised Flux.2 pipelines (dev: ``Flux2Pipeline``; klein: ``Flux2KleinPipeline``) built offline.

The Flux.2 architecture at toy size, from configs alone: ``AutoencoderKLFlux2`` (VAE factor 8, 2×2 latent patches
normalised by the VAE's batch-norm statistics, which are set to non-trivial values here so that the normalisation
is exercised), ``Flux2Transformer2DModel`` (4-axis rotary ids), and the text encoder the pipeline stacks three
hidden layers of: Mistral-3 (dev: ``Mistral3ForConditionalGeneration``, layers 10/20/30) or Qwen-3 (klein:
``Qwen3ForCausalLM``, layers 9/18/27). The text encoders have just enough (tiny) layers for the pipelines'
default layer indices, so the stock pipelines run with their defaults.

Tokenizers are built locally: a byte-level BPE over GPT-2's byte alphabet, no merges (every byte is a token), with
the special tokens and a minimal chat template. Klein's is a ``Qwen2TokenizerFast``; dev's is a fast tokenizer
whose chat template reads the content-list messages ``Flux2Pipeline`` sends (the real checkpoint ships a
``PixtralProcessor``, which needs torchvision; the pipeline only calls its ``apply_chat_template``). The tiny dev
template renders the user's text and skips the system message, so short ``max_sequence_length`` keeps the prompt.

Example:
    ```py
    >>> from hf_arb.testing.tiny_flux2 import save_tiny_flux2
    >>> path = save_tiny_flux2("/tmp/tiny-flux2-klein", klein=True)
    >>> from diffusers import Flux2KleinPipeline
    >>> pipe = Flux2KleinPipeline.from_pretrained(path)
    >>> pipe(prompt="a cat", height=48, width=80, num_inference_steps=1).images[0].size
    (80, 48)
    ```
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["TEXT_HIDDEN", "save_tiny_flux2", "tiny_flux2_pipeline", "tiny_mistral_tokenizer", "tiny_qwen_tokenizer"]

#: the tiny text encoders' width; the transformer's ``joint_attention_dim`` is 3 × this (three stacked layers)
TEXT_HIDDEN = 16
_LATENT_CHANNELS = 4  # the VAE's; the transformer sees 4 × this after 2×2 patchify (real Flux.2: 32 → 128)

#: Qwen-3's chat format, as the klein pipeline renders one user message (``enable_thinking=False``)
QWEN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
#: Mistral's instruction format over content lists; the tiny one skips the system message (see the module doc)
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST]{% for c in m['content'] %}"
    "{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}[/INST]{% endif %}{% endfor %}")


def _byte_vocab(specials: list[str]) -> dict[str, int]:
    from tokenizers import pre_tokenizers

    vocab = {s: i for i, s in enumerate(specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(ch, len(vocab))
    return vocab


def tiny_qwen_tokenizer(model_max_length: int = 4096) -> Any:
    """A working ``Qwen2TokenizerFast`` (byte-level BPE, no merges, Qwen's chat tokens and template), no download."""
    from transformers import Qwen2TokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = _byte_vocab([])
    tok = Qwen2TokenizerFast(vocab=vocab, merges=[], unk_token=None, eos_token="<|im_end|>",
                             pad_token="<|endoftext|>", model_max_length=model_max_length)
    tok.add_special_tokens({"additional_special_tokens": specials[1:]})
    tok.chat_template = QWEN_CHAT_TEMPLATE
    return tok


def tiny_mistral_tokenizer(model_max_length: int = 4096) -> Any:
    """A working fast tokenizer with Mistral's special tokens (``<s>`` = 2, ``</s>`` = 3, ``<pad>`` = 4, ``[IMG]`` = 1)
    and a chat template over content-list messages, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "[IMG]", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
    bpe = Tokenizer(models.BPE(vocab=_byte_vocab(specials), merges=[], unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", additional_special_tokens=specials[5:],
                                  model_max_length=model_max_length)
    tok.chat_template = MISTRAL_CHAT_TEMPLATE
    return tok


def _seeded(seed: int, build: Any) -> Any:
    with torch.random.fork_rng(devices=[]):  # leaves the caller's global RNG untouched
        torch.random.manual_seed(seed)
        return build()


def _qwen3_encoder(vocab_size: int, seed: int) -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=vocab_size, hidden_size=TEXT_HIDDEN, intermediate_size=24, num_hidden_layers=27,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    return _seeded(seed, lambda: Qwen3ForCausalLM(config).eval())


def _mistral3_encoder(vocab_size: int, seed: int) -> Any:
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    config = Mistral3Config(
        text_config={"model_type": "mistral", "vocab_size": vocab_size, "hidden_size": TEXT_HIDDEN,
                     "intermediate_size": 24, "max_position_embeddings": 4096, "num_attention_heads": 2,
                     "num_hidden_layers": 30, "num_key_value_heads": 1, "head_dim": 8, "sliding_window": None,
                     "bos_token_id": 2, "eos_token_id": 3, "pad_token_id": 4},
        vision_config={"model_type": "pixtral", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "intermediate_size": 24, "image_size": 30, "patch_size": 6, "num_channels": 3, "head_dim": 8},
        image_token_index=1, vision_feature_layer=-1, bos_token_id=2, eos_token_id=3, pad_token_id=4)
    return _seeded(seed, lambda: Mistral3ForConditionalGeneration(config).eval())


def _flux2_vae(seed: int) -> Any:
    from diffusers import AutoencoderKLFlux2

    def build() -> Any:
        vae = AutoencoderKLFlux2(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,  # scale factor 8
            up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 16, 16), layers_per_block=1,
            latent_channels=_LATENT_CHANNELS, norm_num_groups=4, sample_size=64, use_quant_conv=False,
            use_post_quant_conv=False)
        vae.bn.running_mean.copy_(torch.randn(4 * _LATENT_CHANNELS) * 0.1)  # trained statistics, not 0 / 1
        vae.bn.running_var.copy_(torch.rand(4 * _LATENT_CHANNELS) + 0.5)
        return vae.eval()

    return _seeded(seed, build)


def _scheduler() -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    # FLUX.2's scheduler config: resolution-dependent shifting (the pipeline passes its empirical mu)
    return FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                           base_image_seq_len=256, max_image_seq_len=4096)


def tiny_flux2_pipeline(seed: int = 0, klein: bool = False, text_layers: int = 3) -> Any:
    """A ``Flux2Pipeline`` (dev: Mistral-3 text encoder, guidance-distilled transformer) or, with ``klein``, a
    ``Flux2KleinPipeline`` (Qwen-3 text encoder, no guidance input) at toy size, random weights. ``text_layers``:
    the stacked text-encoder layers its transformer takes (3, the pipelines' default; 1 as diffusers' own
    ``hf-internal-testing/tiny-flux2``, which its tests train with ``--text_encoder_out_layers 1``)."""
    from diffusers import Flux2KleinPipeline, Flux2Pipeline, Flux2Transformer2DModel

    tok = tiny_qwen_tokenizer() if klein else tiny_mistral_tokenizer()
    encoder = (_qwen3_encoder if klein else _mistral3_encoder)(len(tok), seed + 2)
    transformer = _seeded(seed + 3, lambda: Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * _LATENT_CHANNELS, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=text_layers * TEXT_HIDDEN, timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4), guidance_embeds=not klein))
    cls = Flux2KleinPipeline if klein else Flux2Pipeline
    return cls(scheduler=_scheduler(), vae=_flux2_vae(seed + 1), text_encoder=encoder, tokenizer=tok,
               transformer=transformer)


def save_tiny_flux2(path: str | Path, seed: int = 0, klein: bool = False, text_layers: int = 3) -> str:
    """Build :func:`tiny_flux2_pipeline` and ``save_pretrained`` it to ``path``; returns the path as a string."""
    tiny_flux2_pipeline(seed, klein, text_layers).save_pretrained(Path(path))
    return str(path)
