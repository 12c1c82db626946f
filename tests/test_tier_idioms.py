"""The accelerate resume idioms on TieredBatchSampler (issue #27): the same as BucketBatchSampler's
(tests/test_sampler_idioms.py), through the cursor both share (hf_arb/sampling/cursor.py). Every rank simulated in
one process with accelerate's public loader classes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tiers import SCHEDULES, TIERS, sizes

from hf_arb import resume_dataloader
from hf_arb.sampling.tiered.sampler import TieredBatchSampler


def _sampler(kind: str, world: int, state=None) -> TieredBatchSampler:
    """One process's sampler as under accelerator.prepare (no ``rank=``), restored as load_state does."""
    w, h = sizes()
    s = TieredBatchSampler(w, h, TIERS, SCHEDULES[kind], batch_size=[3, 2], num_replicas=world, return_keys=True,
                           steps_per_epoch=None if kind == "random" else 23)
    if state is not None:
        s.load_state_dict(state)
    return s


def _rank_loader(sampler: TieredBatchSampler, rank: int | None):
    """accelerate's prepared loader of one rank, from its public classes: behind ``BatchSamplerShard`` (``rank``
    given) or over the sampler itself (``rank`` None: what ``dispatch_batches=True`` reads on rank 0)."""
    from accelerate.data_loader import BatchSamplerShard, DataLoaderShard

    shard = rank is not None and sampler.num_replicas > 1
    bs = BatchSamplerShard(sampler, sampler.num_replicas, rank) if shard else sampler
    return DataLoaderShard(_Identity(), batch_sampler=bs, collate_fn=lambda b: b)


class _Identity:
    """A map-style dataset whose item is its key (a ``(row, tier, bucket, epoch)`` tuple)."""

    def __getitem__(self, key):
        return key

    def __len__(self) -> int:
        return len(sizes()[0])


def _keys(batch: list) -> list:
    """``[(row, tier, bucket, epoch), ...]`` as lists (comparable whatever container the loader used)."""
    return [list(k) for k in batch]


def _plan(kind: str, world: int, epoch: int) -> list[list[list]]:
    """[step][rank] -> keys of ``epoch``, read from every rank's shard of a fresh sampler."""
    s = _sampler(kind, world)
    per_rank = []
    for r in range(world):
        s.set_epoch(epoch)
        per_rank.append([_keys(b) for b in s.shard(r)])
    return [list(step) for step in zip(*per_rank, strict=True)]


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(sorted(SCHEDULES)), world=st.integers(1, 3), epoch=st.integers(0, 1), data=st.data())
def test_tiered_resume_idioms_per_rank_are_exact_or_refused(kind, world, epoch, data) -> None:
    """After a restore ``k`` steps into ``epoch`` with the sampler ``ahead`` steps further (accelerate's read-ahead),
    on every rank: ``skip_first_batches(loader, k)`` gives exactly the plan's remaining (tier, bucket, rows), then
    the prepared loader is refused until the loop's ``set_epoch``, after which it is the next epoch exactly;
    ``resume_dataloader`` is exact; a plain re-iteration is refused before its first batch (unless the restore is
    at the start of epoch 0); ``dispatch_batches=True`` (rank 0 reads W batches a step) is exact. The curriculum
    schedule switches tier at steps 7 and 19, so restores across a tier switch are drawn."""
    from accelerate.data_loader import skip_first_batches

    plan, after = _plan(kind, world, epoch), _plan(kind, world, epoch + 1)
    steps = len(plan)
    k = data.draw(st.integers(0, steps - 1), label="k")
    ahead = data.draw(st.integers(0, steps - k - (0 if k else 1)), label="ahead")
    state = {**_sampler(kind, world).state_dict(), "epoch": epoch, "batches_consumed": k + ahead}
    acc = SimpleNamespace(skip_first_batches=skip_first_batches)
    done = sum(_sampler(kind, world).steps_in(e) for e in range(epoch)) + k  # the loop's counter (random: epochs vary)
    for r in range(world):
        want, nxt = [step[r] for step in plan[k:]], [step[r] for step in after]
        s = _sampler(kind, world, state)  # accelerate's checkpointing guide
        loader = _rank_loader(s, r)
        assert len(loader) == steps
        assert [_keys(b) for b in skip_first_batches(loader, k)] == want, (r, k, ahead)
        with pytest.raises(RuntimeError, match=r"TieredBatchSampler.*set_epoch\(epoch\)"):
            next(iter(loader))
        loader.set_epoch(epoch + 1)
        assert [_keys(b) for b in loader] == nxt
        s = _sampler(kind, world, state)  # hf_arb.resume_dataloader
        loader = _rank_loader(s, r)
        first, e = resume_dataloader(acc, loader, done)
        assert e == epoch and [_keys(b) for b in first] == want and [_keys(b) for b in loader] == nxt
        s = _sampler(kind, world, state)  # iterate the prepared loader again
        loader, served = _rank_loader(s, r), []
        if epoch == 0 and k + ahead == 0:
            assert [_keys(b) for b in loader] == [step[r] for step in plan]
        else:
            with pytest.raises(RuntimeError, match="TieredBatchSampler.*(resume_dataloader|set_epoch)"):
                for b in loader:
                    served.append(b)
            assert served == []
    if world > 1:  # dispatch_batches=True: the skip counts the sampler's batches, W per step
        s = _sampler(kind, world, state)
        got = [_keys(b) for b in skip_first_batches(_rank_loader(s, None), k)]
        assert [got[i : i + world] for i in range(0, len(got), world)] == plan[k:]


def test_tiered_skip_beyond_the_restored_position_is_refused_and_moves_nothing() -> None:
    """A ``k`` beyond the steps the restored sampler handed out (the global step, say) is refused naming
    ``global_step % len(train_dataloader)``; the right ``k`` then works."""
    from accelerate.data_loader import skip_first_batches

    state = {**_sampler("curriculum", 2).state_dict(), "epoch": 1, "batches_consumed": 5}
    s = _sampler("curriculum", 2, state)
    with pytest.raises(RuntimeError, match=r"global_step % len\(train_dataloader\)"):
        next(iter(skip_first_batches(_rank_loader(s, 0), 23 + 5)))
    assert s.batches_consumed == 5
    got = [_keys(b) for b in skip_first_batches(_rank_loader(s, 0), 5)]
    assert got == [step[0] for step in _plan("curriculum", 2, 1)[5:]]


def test_a_restore_whose_read_ahead_handed_out_the_whole_random_epoch_keeps_that_epochs_length():
    """``random`` epochs differ in length: restored with every batch of epoch 0 handed out (accelerate's read-ahead
    k + ahead = all), the prepared loader still has epoch 0's length, and skip_first_batches serves its rest (hypothesis
    drew this once: len 228 against the epoch's 227)."""
    from accelerate.data_loader import skip_first_batches

    plan = _plan("random", 1, 0)
    steps, k = len(plan), 1
    assert _sampler("random", 1).steps_in(1) != steps  # the next epoch has another length
    state = {**_sampler("random", 1).state_dict(), "epoch": 0, "batches_consumed": steps}
    loader = _rank_loader(_sampler("random", 1, state), 0)
    assert len(loader) == steps
    assert [_keys(b) for b in skip_first_batches(loader, k)] == [step[0] for step in plan[k:]]
