"""``train/encoded/``: encode once, train anywhere: the VAE posteriors and prompt embeddings of a run's data as a
sharded ``datasets`` dataset (Parquet) that can go to the Hub, and what trains from it.

An encoded dataset is the training data pipeline (the bucket plan, every crop/flip variant, the family's prompt
encoding) run once and written down. It holds three tables (``datasets`` configs):

- ``latents``: one row per (image, bucket, crop/flip variant): ``row``, ``bucket``, ``variant``, ``source_row``,
  ``latent_stats`` (the posterior's mean and std, ``(2, C, h, w)`` float16 bytes, exactly what the per-file
  ``--cache_latents`` cache stores) with ``latent_shape``, ``original_size``, ``crop_top_left``, ``target_size``;
- ``prompts``: one row per distinct caption (and ``""``, for prompt dropout): ``caption``, ``prompt_embeds`` (float32
  bytes, what ``--cache_text_embeddings`` keeps in memory in a float32 run) with its shape, ``pooled_prompt_embeds``
  where the family has them;
- ``rows``: one row per source image: the bucket columns (the sampler runs on them unchanged) and the caption.

The fingerprint (``hf_arb_encoded.json`` and the card's YAML) says what it was encoded with: the VAE and text
encoders (config hashes, the VAE's weights), the bucket set, the fit policy, the variant count and the format
version. A run whose flags or model differ is refused in one line naming the field and both values.

Modules:

- :mod:`~hf_arb.train.encoded.fingerprint` — the fingerprint of a run's flags and model, and the comparison;
- :mod:`~hf_arb.train.encoded.shards` — shard layout, atomic Parquet writes, the resume check of a damaged shard;
- :mod:`~hf_arb.train.encoded.encode` — the encode run (one rank's share, accelerate, Ray Data), the card, the push;
- :mod:`~hf_arb.train.encoded.from_cache` — ``hf-arb encode --from-cache``: a per-file latent cache converted, no
  VAE call;
- :mod:`~hf_arb.train.encoded.reader` — opening an encoded dataset (folder or Hub id), its latents and prompts.
- :mod:`~hf_arb.train.encoded.weights` — the VAE's weights hash read from its safetensors files (a run checks it
  and loads no VAE).

The data source that trains from it is :class:`hf_arb.train.sources.encoded.EncodedSource`. Part of floor 7
(``train/``): imports the floors below and ``train/``'s own modules, never the script.
"""
