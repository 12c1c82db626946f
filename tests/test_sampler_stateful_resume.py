"""Exact resume through torchdata's ``StatefulDataLoader`` (accelerate's ``use_stateful_dataloader=True``), in one
process, at every kind of position: mid-epoch in the first and a later epoch, and exactly at an epoch boundary.

With several processes the batch sampler torchdata sees is accelerate's ``BatchSamplerShard`` around ours (not
``Stateful``), so torchdata restores by fast-forwarding a new pass over it; on one process it is our sampler itself
and torchdata calls its ``load_state_dict``. A state saved exactly at the end of a pass (accelerate saves it with
``_iterator_finished=True``) makes torchdata build a restoring pass, let its worker read ahead, drop it, and then
start the real pass. That dropped pass used to move the sampler's cursor: 3 processes resumed one epoch too far,
1 process skipped ``prefetch_factor × num_workers`` batches. The loop here is accelerate's: ``set_epoch`` before
every pass (accelerate's loader does it), the sampler restored as ``register_for_checkpointing`` does, and
``set_epoch(sampler.locate(steps_done)[0])`` after the restore (docs/sampler.md, "The recipe", rule 3).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from hf_arb import BucketBatchSampler

EPOCHS = 3
IDS = np.random.default_rng(5).choice([-1, 0, 1, 2], size=70, p=[0.05, 0.5, 0.3, 0.15])


def _loader(sampler: BucketBatchSampler, world: int, rank: int):
    """What accelerate builds with use_stateful_dataloader=True: torchdata's loader, one worker reading ahead,
    over accelerate's own shard of the sampler when there are several processes."""
    import torch
    from accelerate.data_loader import BatchSamplerShard
    from torchdata.stateful_dataloader import StatefulDataLoader

    batch_sampler = sampler if world == 1 else BatchSamplerShard(sampler, num_processes=world, process_index=rank)
    return StatefulDataLoader(torch.arange(len(IDS)), batch_sampler=batch_sampler, num_workers=1)


def _run(world: int, rank: int, save_at: int) -> tuple[list, list, dict, dict, BucketBatchSampler]:
    """Every batch of ``EPOCHS`` passes on ``rank``, and the loader's and sampler's states after ``save_at`` steps
    (after a pass's last batch: once the pass has ended, as accelerate's look-ahead loader saves it)."""
    s = BucketBatchSampler(IDS, 2, num_replicas=world, seed=3, drop_last=False, log_report=False)
    dl = _loader(s, world, rank)
    seen: list = []
    states = None
    for e in range(EPOCHS):
        s.set_epoch(e)  # what accelerate's prepared loader does before every pass
        for b in dl:
            seen.append(b.tolist())
            if len(seen) == save_at and save_at % s.steps_per_epoch:
                states = dl.state_dict(), s.state_dict()
        if len(seen) == save_at:
            states = dl.state_dict(), s.state_dict()
    assert states is not None
    dl_state, s_state = json.loads(json.dumps(states, default=int))
    expected = [b for e in range(EPOCHS) for b in s.plan(e)[:, rank].tolist()]
    return seen, expected, dl_state, s_state, s


@pytest.mark.parametrize("world,rank", [(1, 0), (3, 1)], ids=["1-process", "3-processes"])
@pytest.mark.parametrize("where", ["mid-epoch-0", "end-of-epoch-0", "mid-epoch-1", "end-of-epoch-1"])
def test_stateful_loader_resumes_at_every_position(world: int, rank: int, where: str) -> None:
    steps = BucketBatchSampler(IDS, 2, num_replicas=world, seed=3, drop_last=False, log_report=False).steps_per_epoch
    save_at = {"mid-epoch-0": 3, "end-of-epoch-0": steps, "mid-epoch-1": steps + 2, "end-of-epoch-1": 2 * steps}[where]
    seen, expected, dl_state, s_state, _ = _run(world, rank, save_at)
    assert seen == expected  # the uninterrupted run trains the plan
    assert dl_state.get("_iterator_finished") == (save_at % steps == 0)  # the boundary case is the finished state
    s2 = BucketBatchSampler(IDS, 2, num_replicas=world, seed=3, drop_last=False, log_report=False)
    s2.load_state_dict(s_state)  # accelerate.load_state: register_for_checkpointing
    dl2 = _loader(s2, world, rank)
    dl2.load_state_dict(dl_state)  # accelerate.load_state: the loader's own state
    first_epoch = s2.locate(save_at)[0]
    rest: list = []
    for e in range(first_epoch, EPOCHS):
        s2.set_epoch(e)
        rest += [b.tolist() for b in dl2]
    assert rest == seen[save_at:], f"{where}: resumed {len(rest)} batches, expected {len(seen) - save_at}"


def test_set_epoch_holds_and_a_dropped_pass_does_not_move_the_next() -> None:
    """The sampler-level properties behind the test above, without torchdata."""
    s = BucketBatchSampler(IDS, 2, num_replicas=1, seed=3, drop_last=False, log_report=False)
    plans = [s.plan(e)[:, 0].tolist() for e in range(3)]
    assert [list(s) for _ in range(2)] == plans[:2]  # never set: a finished pass moves on by itself
    s.set_epoch(1)
    assert list(s) == plans[1] and list(s) == plans[1]  # set_epoch holds for every pass, as DistributedSampler
    it = iter(s)
    next(it), next(it)  # a pass begun and dropped ...
    assert list(s) == plans[1]  # ... does not shift the next one
    s2 = BucketBatchSampler(IDS, 2, num_replicas=1, seed=3, drop_last=False, log_report=False)
    s2.load_state_dict({**s.state_dict(), "epoch": 0, "batches_consumed": len(plans[0])})  # saved after a pass
    it = iter(s2)
    next(it), next(it)  # torchdata's dropped restoring pass, read ahead by its worker
    assert list(s2) == plans[1] and list(s2) == plans[2]  # the restored position holds until used up, then moves on


def test_resume_dataloader_supersedes_a_state_restored_one_epoch_ahead():
    """accelerate reads one batch ahead: a state saved after an epoch's last step may already be in the next epoch.
    The loop's step counter wins, silently: resume_dataloader yields the counter's batches and no set_epoch warning."""
    import warnings

    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from hf_arb import BucketBatchSampler, resume_dataloader

    ids = np.repeat(np.arange(3), 8)
    acc = Accelerator(cpu=True)
    plain = BucketBatchSampler(ids, batch_size=2, num_replicas=1, seed=3, log_report=False)
    epoch0 = [b for b in plain.shard(0)]  # the whole of epoch 0
    ahead = BucketBatchSampler(ids, batch_size=2, num_replicas=1, seed=3, log_report=False)
    ahead.set_epoch(1)
    next(iter(ahead.shard(0)))  # the state after epoch 0 and one batch of epoch 1 read ahead
    restored = BucketBatchSampler(ids, batch_size=2, num_replicas=1, seed=3, log_report=False)
    restored.load_state_dict(ahead.state_dict())
    assert restored.epoch == 1
    loader = acc.prepare(DataLoader(list(range(len(ids))), batch_sampler=restored, collate_fn=list))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rest, epoch = resume_dataloader(acc, loader, len(epoch0) - 1)  # the counter: epoch 0's last step is next
        batches = list(rest)
    assert epoch == 0 and batches == [list(map(int, epoch0[-1]))]
    assert not [w for w in caught if "after the sampler was restored" in str(w.message)]
