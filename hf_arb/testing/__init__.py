"""``testing/``: tiny, offline, randomly initialised models and their tokenizers, for tests, docs and demos.

- :mod:`~hf_arb.testing.tiny` — tiny SD 1.x/2.x and SDXL pipelines (:func:`~hf_arb.testing.tiny.save_tiny_sd`, …);
- :mod:`~hf_arb.testing.tiny_flow` — tiny SD3, Flux.1 and Flux.1 Kontext pipelines;
- :mod:`~hf_arb.testing.tiny_flux2` — tiny Flux.2 [dev] and [klein] pipelines and their Qwen-3 / Mistral tokenizers;
- :mod:`~hf_arb.testing.tiny_qwen` — tiny Qwen-Image, Qwen-Image-Edit and Qwen-Image-Edit-Plus pipelines;
- :mod:`~hf_arb.testing.tiny_zimage` — a tiny Z-Image pipeline;
- :mod:`~hf_arb.testing.tiny_wan` — a tiny Wan 2.1 text-to-video pipeline (UMT5, ``AutoencoderKLWan``, 4k+1 frames);
- :mod:`~hf_arb.testing.tiny_ltx` — a tiny LTX-Video pipeline (T5, ``AutoencoderKLLTXVideo``, 8k+1 frames, sides of 32);
- :mod:`~hf_arb.testing.tiny_hunyuan_video` — a tiny HunyuanVideo 1.5 text-to-video pipeline (Qwen2.5-VL + ByT5);
- :mod:`~hf_arb.testing.tiny_text` — CLIP/T5 tokenizers built locally (no Hub);
- :mod:`~hf_arb.testing.clips` — tiny real video clips (H.264/MP4, VP9/WebM, rotated) encoded locally with PyAV.

May import: the ground floor, and :mod:`hf_arb.families.qwenimage_edit` alone of the stage folders — a tiny edit
model is built with the Qwen2-VL processor and saved with the saver a trained one uses (docs/code_map.md); the
builders otherwise use diffusers, transformers and tokenizers.
"""
