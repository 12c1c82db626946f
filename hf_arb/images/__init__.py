"""Floor 2, ``images/``: one image at a time — its size, its pixels, its fit to a bucket, the torch dataset.

- :mod:`~hf_arb.images.sizes` — header-only ``(width, height)`` of an image file or value (EXIF-aware);
- :mod:`~hf_arb.images.values` — what an image column holds (paths, bytes, PIL, dicts) as sizes or files;
- :mod:`~hf_arb.images.geometry` — the pure arithmetic of a fit: scale, crop box, original size (no pixels);
- :mod:`~hf_arb.images.fitting` — :func:`fit_to_bucket` and :func:`to_tensor`: pixels resized and cropped;
- :mod:`~hf_arb.images.dataset` — :class:`BucketedImageDataset`, rows fitted to their bucket, and its collate;
- :mod:`~hf_arb.images.collate` — what every batch format shares (captions, crop coordinates);
- :mod:`~hf_arb.images.references` — edit-model samples: references fitted with a crop consistent with the target;
- :mod:`~hf_arb.images.masks` — loss masks (alpha, a column, a folder) fitted with their image's crop, per latent cell;
- :mod:`~hf_arb.images.bad_images` — a broken image is substituted, counted and logged, never silently lost.

May import: the ground floor and :mod:`hf_arb.buckets`.
"""
