"""Floor 7, ``train/``: what the training script needs beyond the model family.

- :mod:`~hf_arb.train.sources` — the run's data, one source object per mode (map-style, stream, packed, tiered, with
  references), built once from the flags: the loader, the batch's bucket, checkpoint state, reports, the schedule;
- :mod:`~hf_arb.train.flags` — the command line: the parser, its checks, upstream's aliases and refusals, the flags a
  checkpoint records, the tested package versions;
- :mod:`~hf_arb.train.environment` — the launch: resume folder, seed, processes, the Accelerator, logging;
- :mod:`~hf_arb.train.models` — the models through the family adapter, the optimizer (AdamW, Prodigy), LoRA setup;
- :mod:`~hf_arb.train.schedule` — diffusers' step arithmetic, each micro-batch's generator and loss weight;
- :mod:`~hf_arb.train.progress` — the run's counters (``hf_arb_state.json``), restoring and saving checkpoints;
  :mod:`~hf_arb.train.signals` — Ctrl-C and SIGTERM: one agreed stop, an optional checkpoint, one line;
- :mod:`~hf_arb.train.checkpointing` — accelerate checkpoint folders and our small JSON state beside them;
- :mod:`~hf_arb.train.cache` — the content-addressed latent cache, its dataset and keys, and a run's two caches
  (latents, prompt embeddings);
- :mod:`~hf_arb.train.encoded` — encode once, train anywhere: latents and prompt embeddings as a sharded dataset
  (``hf-arb encode``), its fingerprint, shards and reader (trained by the ``--encoded_dataset`` source);
- :mod:`~hf_arb.train.outputs` — validation grids, the saved pipeline or LoRA, the model card, the push;
- :mod:`~hf_arb.train.videos` — a video family's validation samples as MP4s (PyAV), frame strips and tracker entries;
- :mod:`~hf_arb.train.lora` — LoRA helpers (targets, saved metadata, portable weights);
- :mod:`~hf_arb.train.quantization` — ``--do_fp8_training`` (torchao FP8) and ``--bnb_quantization_config_path``
  (bitsandbytes QLoRA): the transformer's load keywords and its conversion;
- :mod:`~hf_arb.train.captions` — captions from ``.txt`` files beside a folder's images, and their per-epoch tag
  shuffle, kept tokens, caption and tag dropout (pure in seed, epoch and row);
- :mod:`~hf_arb.train.files` — the names of the files a run writes beside accelerate's.

May import every floor below: the ground floor, ``buckets``, ``images``, ``sampling``, ``annotate``, ``families``,
``packing``.
"""
