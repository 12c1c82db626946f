"""The keys of the latent cache (:mod:`hf_arb.train.cache.latents`): what makes two encodings the same.

An entry's key hashes the image *content* (:func:`content_hash`: SHA-256 of its encoded bytes), the exact fit plan
(bucket ``(w, h)``, scaled size, crop offset, flip) and the VAE's identity (:func:`vae_fingerprint`: config and
weights), so an edited image, a changed bucket set or another VAE map to new keys (:func:`entry_key`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm


def vae_fingerprint(vae: Any) -> str:
    """16 hex digits identifying a VAE: SHA-256 of its config and every weight (as float32 bytes).

    Two VAEs with the same architecture but other weights (a fine-tuned VAE, SDXL's fp16-fix VAE) get different
    fingerprints. Costs one pass over the weights (about 0.5 s for SD's 84 M-parameter VAE on CPU).
    """
    import torch

    h = hashlib.sha256()
    config = {k: v for k, v in dict(vae.config).items() if not k.startswith("_")}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, tensor in vae.state_dict().items():
            h.update(name.encode())
            h.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def content_hash(source: Any) -> str:
    """SHA-256 (hex) of an image's encoded bytes.

    Args:
        source: what ``datasets`` gives for an ``Image(decode=False)`` column (``{"bytes": ..., "path": ...}``),
            raw ``bytes``, a file path, or a PIL image (hashed by mode, size and pixels when nothing else exists).
    """
    if isinstance(source, dict):
        if source.get("bytes") is not None:
            return hashlib.sha256(source["bytes"]).hexdigest()
        if source.get("path"):
            return content_hash(source["path"])
        raise ValueError(f"Image entry has neither bytes nor path: {source!r}.")
    if isinstance(source, (bytes, bytearray, memoryview)):
        return hashlib.sha256(source).hexdigest()
    if isinstance(source, (str, os.PathLike)):
        h = hashlib.sha256()
        with open(source, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()
    if hasattr(source, "tobytes") and hasattr(source, "mode"):  # PIL image
        h = hashlib.sha256(f"{source.mode}:{source.size}".encode())
        h.update(source.tobytes())
        return h.hexdigest()
    raise TypeError(f"Cannot hash an image given as {type(source).__name__}; pass bytes, a path or a dict.")


def content_hashes(ds: Any, image_column: str, indices: Sequence[int] | None = None, *,
                   show_progress: bool = False) -> list[str]:
    """Content hashes of ``ds[image_column]`` at ``indices`` (all rows by default), without decoding images
    (``show_progress``: a tqdm bar)."""
    import datasets

    if image_column not in ds.column_names:
        raise ValueError(f"Image column {image_column!r} not in the dataset; columns are {ds.column_names}.")
    col = ds.select_columns([image_column])
    if isinstance(col.features[image_column], datasets.Image):
        col = col.cast_column(image_column, datasets.Image(decode=False))
    if indices is not None:
        col = col.select(list(indices))
    return [content_hash(x) for x in tqdm(col[image_column], desc="Hashing images", unit="img",
                                          disable=not show_progress)]


def entry_key(content: str, plan: Any, vae: str) -> str:
    """32 hex digits: SHA-256 over the content hash, the fit plan (bucket, resize, crop, flip) and the VAE id.

    Args:
        content: :func:`content_hash` of the image.
        plan: the exact geometry the data pipeline applies, e.g. ``FitPlan.key()`` (bucket size, scaled size,
            crop offset, flip); anything with a stable ``repr``.
        vae: :func:`vae_fingerprint`.
    """
    payload = f"v1|{content}|{plan!r}|{vae}"
    return hashlib.sha256(payload.encode()).hexdigest()[:32]
