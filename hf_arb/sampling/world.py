"""The sampler's world: processes, this process's rank, and the batch per rank and per yielded batch."""

from __future__ import annotations

from typing import NamedTuple

from .inputs import default_world
from .planning.plan import check_nonneg, check_positive


class World(NamedTuple):
    """``num_replicas`` and ``rank``; ``per_rank_batch_size``: rows per batch of one rank (the plan's batch);
    ``batch_size``: rows per yielded batch (read by accelerate's ``BatchSamplerShard``)."""

    num_replicas: int
    rank: int
    per_rank_batch_size: int
    batch_size: int


def resolve_world(num_replicas: int | None, rank: int | None, batch_size: int, split_batches: bool) -> World:
    """Fill ``num_replicas``/``rank`` from the running process group (or ``WORLD_SIZE``, else 1) and check them.

    Raises:
        ValueError: a rank outside ``[0, num_replicas)``, a non-positive batch, or with ``split_batches`` a global
            batch that is not a multiple of ``num_replicas`` (the message gives the next one that is).
    """
    w, r = default_world()
    num_replicas = check_positive("num_replicas", w if num_replicas is None else num_replicas)
    if rank is None:  # this process's rank, when the sampler is built for the running world
        rank = r if num_replicas == w else 0
    rank = check_nonneg("rank", rank)
    if rank >= num_replicas:
        raise ValueError(f"`rank` must be < num_replicas ({num_replicas}), got {rank}.")
    batch_size = check_positive("batch_size", batch_size)
    if split_batches and batch_size % num_replicas:
        raise ValueError(f"With split_batches=True, `batch_size` is the global batch and must be a multiple of "
                         f"num_replicas ({num_replicas}), got {batch_size}. Use "
                         f"{-(-batch_size // num_replicas) * num_replicas}.")
    return World(num_replicas, rank, batch_size // num_replicas if split_batches else batch_size, batch_size)
