"""What the sampler is built from: bucket ids and resolutions, the world, the leftover policy, the catch-all
bucket and the fingerprint that ties a saved state to its plan."""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any

import numpy as np

from hf_arb.buckets.schema import buckets_from_features, read_bucket_ids, read_resolutions
from hf_arb.checks import UsageError

from .planning.index import CHUNK
from .planning.plan import as_bucket_ids, check_leftover, check_nonneg


def runtime_world() -> tuple[int, int] | None:
    """(world size, rank) of an initialised ``torch.distributed`` process group, else None (torch not imported)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size()), int(dist.get_rank())
    return None


def check_world(num_replicas: int) -> None:
    """A RuntimeError when ``torch.distributed`` runs another number of processes than the sampler was built for."""
    live = runtime_world()
    if live is not None and live[0] != num_replicas:
        raise RuntimeError(
            f"BucketBatchSampler was built for num_replicas={num_replicas}, but torch.distributed runs "
            f"{live[0]} processes: its global batches would be dealt to the wrong ranks and buckets would not be "
            f"in sync. Build the sampler after creating the Accelerator (the default reads the process group) "
            f"or pass num_replicas=accelerator.num_processes."
        )


def default_world() -> tuple[int, int]:
    """(num_replicas, rank): ``torch.distributed`` when initialised, else the launcher's ``WORLD_SIZE``/``RANK``
    environment (set by ``torchrun`` and ``accelerate launch`` before the Accelerator exists), else ``(1, 0)``."""
    live = runtime_world()
    if live is not None:
        return live
    try:
        return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    except ValueError:
        return 1, 0


def aspects(resolutions: np.ndarray) -> np.ndarray:
    """width / height per bucket, shape (k,); NaN where a resolution is unknown (0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        a = resolutions[:, 0] / resolutions[:, 1]
    a[~(resolutions > 0).all(axis=1)] = np.nan
    return a


def frame_groups(resolutions: np.ndarray) -> np.ndarray:
    """Frames per bucket, shape (k,): the third column of a clip table, 1 for an image table. Buckets of different
    frame counts never share a batch (no merge, no catch-all across them)."""
    return resolutions[:, 2] if resolutions.shape[1] == 3 else np.ones(resolutions.shape[0], np.int64)


def leftover_from(drop_last: bool | None, leftover: str | None) -> str:
    """Resolve diffusers' ``drop_last`` and our ``leftover`` into one policy (``drop_last=False`` keeps every row)."""
    if leftover is None:
        return "fill" if drop_last is False else "drop"
    leftover = check_leftover(leftover)
    if drop_last is True and leftover != "drop" or drop_last is False and leftover == "drop":
        raise ValueError(f"`drop_last={drop_last}` contradicts `leftover={leftover!r}`: drop_last=True means "
                         "leftover='drop'; drop_last=False keeps every row (leftover='fill' or 'catch_all'). Pass one.")
    return leftover


def read_input(bucket_ids: Any, buckets: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """Bucket ids ``(n,)`` and, when known, resolutions ``(k, 2)`` (``(k, 3)`` with frames) from an annotated dataset
    or arrays."""
    resolutions = None
    if hasattr(bucket_ids, "column_names") or isinstance(bucket_ids, dict):
        ds = bucket_ids
        bucket_ids = read_bucket_ids(ds)
        if buckets is None and buckets_from_features(getattr(ds, "features", None)) is not None:
            resolutions = read_resolutions(ds)
        elif buckets is None and {"bucket_width", "bucket_height"} <= set(ds.column_names):
            resolutions = read_resolutions(ds)
    if buckets is not None:
        resolutions = np.asarray(getattr(buckets, "resolutions", buckets), dtype=np.int64)
        if resolutions.ndim != 2 or resolutions.shape[1] not in (2, 3):
            raise ValueError(f"`buckets` must be a BucketSet or (k, 2) resolutions ((k, 3) with frames), got shape "
                             f"{resolutions.shape}.")
    ids = as_bucket_ids(bucket_ids)
    if ids.size and resolutions is not None and resolutions.shape[0] <= int(ids.max()):
        raise ValueError(f"`buckets` has {resolutions.shape[0]} resolutions but bucket id {int(ids.max())} occurs. "
                         "Pass the BucketSet the dataset was annotated with.")
    return ids, resolutions


def choose_catch_all(leftover: str, catch_all_bucket: int | None, resolutions: np.ndarray | None,
                     counts: np.ndarray) -> int | None:
    """The bucket serving catch-all batches: the given one, else closest to square (largest area), else the
    most populous; None unless ``leftover="catch_all"``."""
    if leftover != "catch_all":
        return None
    if resolutions is not None:
        used = np.unique(frame_groups(resolutions)[: counts.size][counts > 0])
        if used.size > 1:
            raise UsageError(f"leftover='catch_all' would put rows of different frame counts ({used.tolist()}: images "
                             "and clips, or clips of different lengths) into one batch. Use leftover='drop' or 'fill' "
                             "with clip buckets.")
    if catch_all_bucket is None:
        if resolutions is not None:
            la = np.abs(np.log(aspects(resolutions)))  # NaN for unknown (0 x 0) entries: sorted last
            area = resolutions[:, 0] * resolutions[:, 1]
            return int(np.lexsort((-area, la))[0])
        return int(np.argmax(counts))
    return check_nonneg("catch_all_bucket", catch_all_bucket)


def fingerprint(ids: np.ndarray, merge_map: np.ndarray | None) -> str:
    """A hash of the bucket ids ``(n,)`` and the merge map: a saved state only applies to the same plan input."""
    h = hashlib.blake2b(digest_size=16)
    for c0 in range(0, ids.size, CHUNK):  # the int32 bytes of the ids, hashed chunk by chunk (no O(n) copy)
        h.update(memoryview(np.ascontiguousarray(ids[c0 : c0 + CHUNK], dtype=np.int32)).cast("B"))
    if merge_map is not None:
        h.update(np.ascontiguousarray(merge_map, dtype=np.int64).tobytes())
    return h.hexdigest()
