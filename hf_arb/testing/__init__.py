"""``testing/``: tiny, offline, randomly initialised models and their tokenizers, for tests, docs and demos.

- :mod:`~hf_arb.testing.tiny` — tiny SD 1.x/2.x and SDXL pipelines (:func:`~hf_arb.testing.tiny.save_tiny_sd`, …);
- :mod:`~hf_arb.testing.tiny_flow` — tiny SD3 and Flux.1 pipelines;
- :mod:`~hf_arb.testing.tiny_text` — CLIP/T5 tokenizers built locally (no Hub).

Imports no other floor of hf_arb: the builders only use diffusers, transformers and tokenizers.
"""
