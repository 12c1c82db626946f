"""One rank's view of the global plan, for plain PyTorch DDP without accelerate (``sampler.shard(rank)``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def refuse_rank_idiom(num_replicas: int, rank: int, rank_given: bool) -> None:
    """Refuse torch's ``DistributedSampler`` habit: a sampler given ``rank=`` with ``num_replicas > 1``, iterated
    directly, would serve the global plan (every rank's batches) to this rank.

    Iterating the sampler is also what accelerate's ``BatchSamplerShard`` does under ``accelerator.prepare``, and the
    two callers cannot be told apart without inspecting accelerate's objects; an explicit ``rank=`` (never needed
    under ``prepare``) is the signal. The one-line error names both fixes.
    """
    if rank_given and num_replicas > 1:
        raise RuntimeError(
            f"BucketBatchSampler(num_replicas={num_replicas}, rank={rank}) iterated directly would serve the global "
            f"plan (every rank's batches), not rank {rank}'s: for plain DDP use `sampler.shard({rank})` "
            f"(DataLoader(ds, batch_sampler=sampler.shard())); under accelerator.prepare build the sampler without "
            f"`rank=` (accelerate deals the global plan to the ranks itself).")


class RankBatchSampler:
    """One rank's view of a :class:`BucketBatchSampler` (``sampler.shard(rank)``): yields ``plan[s, rank]`` for
    each step. The cursor, epoch and state are the parent sampler's."""

    def __init__(self, parent: Any, rank: int) -> None:
        if not 0 <= int(rank) < parent.num_replicas:
            raise ValueError(f"`rank` must be in [0, {parent.num_replicas}), got {rank}.")
        self.parent, self.rank = parent, int(rank)
        # None with a batch size per bucket (batches of varying length, as the parent)
        self.batch_size = None if parent.batch_size is None else parent.per_rank_batch_size
        self.drop_last = parent.drop_last

    def __len__(self) -> int:
        return self.parent.steps_per_epoch

    def __iter__(self) -> Iterator[list]:
        yield from self.parent.rank_batches(self.rank)

    def set_epoch(self, epoch: int) -> None:
        self.parent.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.parent.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.parent.load_state_dict(state)
