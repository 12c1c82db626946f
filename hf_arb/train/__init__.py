"""Floor 7, ``train/``: what the training script needs beyond the model family.

- :mod:`~hf_arb.train.args` — the command line (diffusers' flags plus the bucketing ones);
  :mod:`~hf_arb.train.arg_checks` — the flag checks, each naming its fix;
- :mod:`~hf_arb.train.environment` — what is checked and set up on this machine before a model loads;
- :mod:`~hf_arb.train.data` — the training dataset and its bucket columns; :mod:`~hf_arb.train.streaming` —
  ``--streaming``; :mod:`~hf_arb.train.tiers` — multi-resolution tiers (``--resolution 512,1024``);
- :mod:`~hf_arb.train.loaders` — sampler, DataLoader, micro-batch generators and loss weights;
  :mod:`~hf_arb.train.schedule` — the step arithmetic and what each micro-batch draws;
- :mod:`~hf_arb.train.models` — the run's models through the family adapter, the optimizer and hooks;
  :mod:`~hf_arb.train.lora` — LoRA helpers (targets, saved metadata, portable weights);
- :mod:`~hf_arb.train.latents` (+ :mod:`~hf_arb.train.latent_dataset`) — the content-addressed latent cache and
  its dataset; :mod:`~hf_arb.train.cache_keys` its keys; :mod:`~hf_arb.train.caches` a run's two caches (latents,
  prompt embeddings);
- :mod:`~hf_arb.train.checkpointing` — accelerate checkpoint folders and our small JSON state beside them;
  :mod:`~hf_arb.train.progress` — the run's counters and ``hf_arb_state.json``;
  :mod:`~hf_arb.train.resume_flags` — the flags that shape a checkpoint, recorded and checked on resume;
  :mod:`~hf_arb.train.signals` — Ctrl-C and SIGTERM: one agreed stop, an optional checkpoint, one line;
- :mod:`~hf_arb.train.outputs` — validation grids, the saved pipeline or LoRA, the card, the startup report;
  :mod:`~hf_arb.train.files` — the files a run writes beside accelerate's, by name.

May import every floor below: the ground floor, ``buckets``, ``images``, ``sampling``, ``annotate``, ``families``,
``packing``.
"""
