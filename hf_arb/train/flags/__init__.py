"""The training script's command line, ``train/flags/``: every flag parsed and checked before a model loads.

- :mod:`~hf_arb.train.flags.args` — the parser (diffusers' flags plus the bucketing ones) and :func:`parse_args`;
- :mod:`~hf_arb.train.flags.arg_checks` — the flag checks, each naming its fix;
- :mod:`~hf_arb.train.flags.upstream_flags` — the flags of upstream's dreambooth scripts: aliases, no-ops, refusals;
- :mod:`~hf_arb.train.flags.quant_flags` — ``--do_fp8_training`` (torchao) and ``--bnb_quantization_config_path``
  (bitsandbytes, QLoRA): where they can run, the library to install, the JSON config;
- :mod:`~hf_arb.train.flags.mask_flags` — the masked-loss flags (``--masked_loss`` and its mask source);
- :mod:`~hf_arb.train.flags.video_flags` — the clip flags (``--video_column``, ``--frames``, ``--target_fps``, ...);
- :mod:`~hf_arb.train.flags.prior_flags` — prior preservation's flags (upstream's names and defaults) and their checks;
- :mod:`~hf_arb.train.flags.caption_flags` — the caption flags (kohya's tag shuffle and dropouts, caption files);
- :mod:`~hf_arb.train.flags.optimizer_flags` — ``--optimizer`` AdamW or prodigy and the ``--prodigy_*`` flags;
- :mod:`~hf_arb.train.flags.resume_flags` — the flags that shape a checkpoint, recorded in it and compared on resume;
- :mod:`~hf_arb.train.flags.dataset_config` — ``--dataset_config``: several datasets from a TOML / YAML file (and
  kohya's ``dataset_config.toml``), parsed and checked;
- :mod:`~hf_arb.train.flags.versions` — the tested package versions: a warning outside them, a refusal where a feature
  cannot work.

These modules, with the data sources (``train/sources/``), are the only ones that read the mode flags
(``tests/test_architecture.py``). ``hf_arb.train.args`` and ``hf_arb.train.arg_checks`` (0.2) still import, with a
``DeprecationWarning`` (:mod:`hf_arb.moved`).
"""
