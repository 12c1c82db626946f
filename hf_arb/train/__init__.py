"""Floor 7, ``train/``: what the training script needs beyond the model family.

- :mod:`~hf_arb.train.latents` (+ ``latent_dataset``) — the content-addressed latent cache and its dataset;
- :mod:`~hf_arb.train.checkpointing` — accelerate checkpoint folders and our small JSON state beside them;
- :mod:`~hf_arb.train.lora` — LoRA helpers (targets, saved metadata, portable weights).

May import every floor below: the ground floor, ``buckets``, ``images``, ``sampling``, ``annotate``, ``families``,
``packing``.
"""
