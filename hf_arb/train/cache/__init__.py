"""A run's caches, ``train/cache/``: what is encoded once and reused.

- :mod:`~hf_arb.train.cache.latents` — the content-addressed latent cache (one entry per image, bucket, crop and
  flip) and its index;
- :mod:`~hf_arb.train.cache.latent_dataset` — the dataset that serves cached posteriors instead of pixels;
- :mod:`~hf_arb.train.cache.cache_keys` — the entry keys (content hash, VAE fingerprint, crop);
- :mod:`~hf_arb.train.cache.caches` — a run's two caches: filling the latent cache before training, and the
  prompt-embedding memo (:class:`TextEncoder`).

The 0.2 flat paths (``hf_arb.train.latents``…) still import, with a ``DeprecationWarning`` (:mod:`hf_arb.moved`).
"""
