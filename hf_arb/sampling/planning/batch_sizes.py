"""A batch size per bucket: derived from a pixel budget, or given as a mapping; and the loss weights that keep every
image's weight equal when batch sizes vary between the micro-steps of an optimizer step.

UNets (SD 1.x/2.x, SDXL) cannot pack images of different shapes into one sequence, but they can keep the *pixels*
of a batch roughly constant: a 512×512 bucket takes four times the images of a 1024×1024 one. Open-Sora's
``bucket_config`` does the same (a batch size per resolution). :func:`batch_sizes_for_pixels` derives the sizes
from a budget, :func:`batch_sizes_from_mapping` takes them from the user, and
:class:`~hf_arb.sampling.sampler.BucketBatchSampler` plans with them (every rank in the same bucket, so with the
same batch size, at every step).

Clips (``(k, 3)`` tables of ``(width, height, frames)``): the pixel budget counts pixels × frames, and
:func:`batch_sizes_for_tokens` derives the sizes from a budget of latent tokens (pixels × frames ÷ the patch volume,
exactly as the model patches them), with an optional separate batch size for the 1-frame (image) buckets, like
diffusion-pipe's ``image_micro_batch_size_per_gpu``. Images and clips are different buckets, so a batch never mixes
them (the sampler keeps its merges and catch-all batches within one frame count).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from hf_arb.checks import check_positive


def _label(res: np.ndarray, b: int) -> str:
    return "x".join(str(int(v)) for v in res[b])


def _table(resolutions: Any) -> np.ndarray:
    res = np.asarray(getattr(resolutions, "resolutions", resolutions), dtype=np.int64)
    if res.ndim != 2 or res.shape[1] not in (2, 3):
        raise ValueError(f"`resolutions` must have shape (k, 2) as (width, height), or (k, 3) as (width, height, "
                         f"frames), got {res.shape}.")
    return res


def batch_sizes_for_pixels(resolutions: Any, max_pixels_per_batch: int, *, max_batch_size: int | None = None,
                           needed: Any | None = None) -> np.ndarray:
    """Rows per batch of each bucket under a pixel budget: ``floor(max_pixels_per_batch / (width × height))``
    (``× frames`` for clips), capped at ``max_batch_size``.

    Args:
        resolutions: bucket ``(width, height)`` pairs, shape ``(k, 2)`` (a ``BucketSet``'s ``resolutions``), or
            ``(width, height, frames)`` triples, ``(k, 3)``.
        max_pixels_per_batch: pixels (× frames) of one batch on one rank (at the bucket resolution, before the VAE).
        max_batch_size: optional cap on every bucket's batch size.
        needed: optional bool mask ``(k,)`` of the buckets that must fit one image (default: all); the others
            get batch size 1 when they do not fit (they never form a batch).

    Returns:
        ``np.ndarray[int64]`` of shape ``(k,)``, every entry ``>= 1``.

    Raises:
        ValueError: a needed bucket cannot hold even one image in the budget (naming the bucket and the fix).

    Example:
        ```py
        >>> batch_sizes_for_pixels([(512, 512), (1024, 1024), (768, 512)], 4 * 1024 * 1024).tolist()
        [16, 4, 10]
        ```
    """
    res = _table(resolutions)
    budget = check_positive("max_pixels_per_batch", max_pixels_per_batch)
    area = res.prod(axis=1)  # (k,) pixels, x frames for clips
    need = np.ones(res.shape[0], bool) if needed is None else np.asarray(needed, bool)
    bad = np.flatnonzero(need & (area <= 0))
    if bad.size:
        raise ValueError(f"Bucket {int(bad[0])} has resolution {_label(res, int(bad[0]))}: a pixel budget needs "
                         "every bucket's width and height. Pass the BucketSet the dataset was annotated with.")
    sizes = np.where(area > 0, budget // np.maximum(area, 1), 1)  # (k,)
    small = np.flatnonzero(need & (sizes < 1))
    if small.size:
        b = int(small[np.argmax(area[small])])
        raise ValueError(
            f"max_pixels_per_batch={budget:,} cannot hold one image of bucket {b} ({_label(res, b)}, "
            f"{int(area[b]):,} pixels). Raise max_pixels_per_batch to at least {int(area[need].max()):,} (the "
            "largest bucket's area), or use a bucket set without buckets that large."
        )
    if max_batch_size is not None:
        sizes = np.minimum(sizes, check_positive("max_batch_size", max_batch_size))
    return np.maximum(sizes, 1).astype(np.int64)


def tokens_per_sample(resolutions: Any, *, spatial: int = 16, frame_step: int = 1, patch_t: int = 1) -> np.ndarray:
    """Latent tokens of one sample of each bucket: ``(width // spatial) × (height // spatial) × ceil(latent_frames /
    patch_t)`` with ``latent_frames = (frames - 1) // frame_step + 1`` (a causal video VAE's, as every video pipeline
    computes it; 1 for an image), int64 of shape ``(k,)``. That is pixels × frames ÷ the patch volume
    (``spatial² × frame_step × patch_t``), counted as the model patches them.

    Args:
        resolutions: ``(k, 2)`` or ``(k, 3)`` bucket sizes (a ``BucketSet``).
        spatial: pixels per token side: the VAE's spatial factor × the transformer's patch size (16 for Wan and
            HunyuanVideo: 8 × 2; 32 for LTX: 32 × 1).
        frame_step: the VAE's temporal compression (``FRAME_RULES[family].step``: 4, or 8 for LTX).
        patch_t: the transformer's temporal patch size (1 for Wan, LTX and HunyuanVideo).

    Example:
        ```py
        >>> tokens_per_sample([(832, 480, 81), (832, 480, 1)], spatial=16, frame_step=4).tolist()  # Wan's default
        [32760, 1560]
        ```
    """
    res = _table(resolutions)
    for name, v in (("spatial", spatial), ("frame_step", frame_step), ("patch_t", patch_t)):
        check_positive(name, v)
    frames = res[:, 2] if res.shape[1] == 3 else np.ones(res.shape[0], np.int64)
    latent = (frames - 1) // int(frame_step) + 1  # (k,)
    return (res[:, 0] // spatial) * (res[:, 1] // spatial) * (-(-latent // int(patch_t)))


def batch_sizes_for_tokens(resolutions: Any, max_tokens_per_batch: int, *, spatial: int = 16, frame_step: int = 1,
                           patch_t: int = 1, image_batch_size: int | None = None, max_batch_size: int | None = None,
                           needed: Any | None = None) -> np.ndarray:
    """Rows per batch of each bucket under a budget of latent tokens: ``floor(max_tokens_per_batch / tokens)``
    (:func:`tokens_per_sample`), capped at ``max_batch_size``; the 1-frame (image) buckets get ``image_batch_size``
    instead when it is given (diffusion-pipe's ``image_micro_batch_size_per_gpu``).

    One rare long clip bucket then gets a batch that fits where a fixed batch size would run out of memory, and a
    short or small bucket fills its batch with more clips. Pass the result to the sampler as a mapping:
    ``BucketBatchSampler(ds, dict(enumerate(sizes.tolist())), buckets=bs)``.

    Args:
        resolutions: ``(k, 2)`` or ``(k, 3)`` bucket sizes (a ``BucketSet``).
        max_tokens_per_batch: latent tokens of one batch on one rank.
        spatial, frame_step, patch_t: the model's patch volume (:func:`tokens_per_sample`).
        image_batch_size: rows per batch of every 1-frame bucket; ``None``: the token budget decides for them too.
        max_batch_size: optional cap on every bucket's batch size (not on ``image_batch_size``).
        needed: optional bool mask ``(k,)`` of the buckets that must fit one sample (default: all).

    Returns:
        ``np.ndarray[int64]`` of shape ``(k,)``, every entry ``>= 1``.

    Raises:
        ValueError: a needed bucket cannot hold even one sample in the budget (naming it and the budget it needs).

    Example:
        ```py
        >>> batch_sizes_for_tokens([(832, 480, 81), (480, 832, 33), (1280, 720, 1)], 65536, frame_step=4,
        ...                        image_batch_size=8).tolist()
        [2, 4, 8]
        ```
    """
    res = _table(resolutions)
    budget = check_positive("max_tokens_per_batch", max_tokens_per_batch)
    tokens = tokens_per_sample(res, spatial=spatial, frame_step=frame_step, patch_t=patch_t)  # (k,)
    image = (res[:, 2] == 1) if res.shape[1] == 3 else np.ones(res.shape[0], bool)
    if image_batch_size is not None:
        check_positive("image_batch_size", image_batch_size)
    need = np.ones(res.shape[0], bool) if needed is None else np.asarray(needed, bool)
    if image_batch_size is not None:
        need = need & ~image
    bad = np.flatnonzero(need & (tokens <= 0))
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"Bucket {b} ({_label(res, b)}) has no latent token at spatial={spatial}: its sides must be "
                         f"at least {spatial} pixels. Pass the BucketSet the dataset was annotated with.")
    sizes = budget // np.maximum(tokens, 1)  # (k,)
    small = np.flatnonzero(need & (sizes < 1))
    if small.size:
        b = int(small[np.argmax(tokens[small])])
        raise ValueError(f"max_tokens_per_batch={budget:,} cannot hold one sample of bucket {b} ({_label(res, b)}, "
                         f"{int(tokens[b]):,} latent tokens). Raise it to at least {int(tokens[need].max()):,} (the "
                         f"largest bucket's), or use a bucket set without buckets that large.")
    if max_batch_size is not None:
        sizes = np.minimum(sizes, check_positive("max_batch_size", max_batch_size))
    if image_batch_size is not None:
        sizes[image] = int(image_batch_size)
    return np.maximum(sizes, 1).astype(np.int64)


def batch_sizes_from_mapping(mapping: Mapping[Any, int], num_buckets: int, *, resolutions: Any | None = None,
                             needed: Any | None = None) -> np.ndarray:
    """Rows per batch of each bucket from ``{bucket: batch size}``.

    Args:
        mapping: keys are bucket ids (``int``) or labels ``"WxH"`` (``"WxHxF"`` for clips; needs ``resolutions``);
            values positive ints.
        num_buckets: ``k``, the number of bucket ids.
        resolutions: bucket ``(width, height)`` pairs ``(k', 2)`` (or ``(k', 3)`` with frames), to read labels.
        needed: bool mask ``(k,)`` of the buckets that must have a size (those with rows, the catch-all bucket);
            default: all. Buckets not needed and not named get the largest size given (they never form a batch).

    Returns:
        ``np.ndarray[int64]`` of shape ``(k,)``.

    Raises:
        ValueError: an unknown key, a size that is not a positive int, or a needed bucket without a size.
    """
    if not isinstance(mapping, Mapping) or not mapping:
        raise ValueError(
            f"A per-bucket batch size must be a non-empty mapping {{bucket: batch size}}, got {mapping!r}."
        )
    res = None if resolutions is None else np.asarray(getattr(resolutions, "resolutions", resolutions), np.int64)
    labels = {} if res is None else {_label(res, b): b for b in range(res.shape[0])}
    sizes = np.zeros(num_buckets, np.int64)
    for key, value in mapping.items():
        if isinstance(key, str) and key in labels:
            b = labels[key]
        elif isinstance(key, (int, np.integer)) and not isinstance(key, bool) and 0 <= int(key) < num_buckets:
            b = int(key)
        else:
            known = f"labels like {next(iter(labels))!r} or " if labels else ""
            raise ValueError(f"Unknown bucket {key!r} in the batch size mapping: use {known}bucket ids in "
                             f"[0, {num_buckets}).")
        if b < num_buckets:
            sizes[b] = check_positive(f"batch size of bucket {key!r}", value)
    need = np.ones(num_buckets, bool) if needed is None else np.asarray(needed, bool)[:num_buckets]
    missing = np.flatnonzero(need & (sizes == 0))
    if missing.size:
        b = int(missing[0])
        name = f"{b} ({_label(res, b)})" if res is not None and b < res.shape[0] else str(b)
        raise ValueError(f"The batch size mapping has no entry for bucket {name}, which has rows (or serves the "
                         f"catch-all batches): add it, e.g. {{{b}: 4, ...}}, or pass `max_pixels_per_batch`.")
    sizes[sizes == 0] = int(sizes.max())
    return sizes


def resolve_batch_sizes(batch_size: Any, *, max_pixels_per_batch: int | None, resolutions: Any | None,
                        needed: np.ndarray) -> np.ndarray:
    """The sampler's per-bucket batch sizes, int64 ``(k,)`` (``k``: resolutions known, else ``needed.size``).

    ``max_pixels_per_batch`` given: :func:`batch_sizes_for_pixels` capped at ``batch_size`` (None: no cap);
    else ``batch_size`` is a mapping for :func:`batch_sizes_from_mapping`. ``needed``: bool ``(k',)``, the
    buckets that need a size (those with rows and the catch-all bucket).
    """
    k = needed.size if resolutions is None else max(needed.size, len(resolutions))
    need = np.zeros(k, bool)
    need[: needed.size] = needed
    if max_pixels_per_batch is None:
        return batch_sizes_from_mapping(batch_size, k, resolutions=resolutions, needed=need)
    if resolutions is None:
        raise ValueError("`max_pixels_per_batch` needs the bucket resolutions: pass `buckets=BucketSet(...)` (or an "
                         "annotated dataset).")
    if isinstance(batch_size, Mapping):
        raise ValueError("With `max_pixels_per_batch`, `batch_size` is the cap on every bucket's batch (an int or "
                         "None), got a mapping. Pass one or the other.")
    return batch_sizes_for_pixels(resolutions, max_pixels_per_batch, max_batch_size=batch_size, needed=need)


def accumulation_weights(step_batch: Any, accumulation_steps: int) -> np.ndarray:
    """Loss multipliers that weight every image of an optimizer step equally when batch sizes vary.

    A training step averages ``accumulation_steps`` micro-batches (accelerate divides each micro-batch's loss by
    ``accumulation_steps``; DDP averages the ranks). With batch sizes ``b_s`` that differ between micro-steps, the
    images of a small batch would weigh more than those of a large one. Multiplying micro-step ``s``'s *mean* loss
    by ``w_s = b_s · accumulation_steps / n_window`` (``n_window``: images per rank in its accumulation window)
    makes the step's gradient the mean over all its images, on every rank alike (all ranks train the same bucket,
    so the same ``b_s``, at each step). With one batch size and full windows every ``w_s`` is 1.

    Args:
        step_batch: rows per rank of each step of the epoch, shape ``(steps,)``.
        accumulation_steps: micro-steps per optimizer step. Windows are ``[j·A, (j+1)·A)`` within the epoch; the
            last one may be shorter (accelerate steps the optimizer at the end of the dataloader).

    Returns:
        ``np.ndarray[float64]`` of shape ``(steps,)``.
    """
    b = np.asarray(step_batch, dtype=np.float64)
    A = check_positive("accumulation_steps", accumulation_steps)
    window = np.arange(b.size) // A  # (steps,)
    n_window = np.bincount(window, weights=b)[window] if b.size else b  # (steps,)
    return b * A / n_window


__all__ = ["accumulation_weights", "batch_sizes_for_pixels", "batch_sizes_for_tokens", "batch_sizes_from_mapping",
           "resolve_batch_sizes", "tokens_per_sample"]
