"""The idioms users bring to the sampler: each does what they meant or is refused with one line naming the fix.

In-process (all ranks simulated): torch's ``DistributedSampler`` idiom (``num_replicas=W, rank=r``, iterate it)
and garbage resume states. The real-process cells (accelerate modes × 2 and 3 processes) are in
``tests/test_sampler_distributed.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_arb import BucketBatchSampler


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(20, 400), k=st.integers(1, 6), batch=st.integers(1, 5), world=st.integers(1, 4),
       seed=st.integers(0, 2**31), leftover=st.sampled_from(["drop", "fill", "catch_all"]))
def test_distributed_sampler_idiom_is_one_ranks_share_or_refused(n, k, batch, world, seed, leftover) -> None:
    ids = np.random.default_rng(seed).integers(-1, k, size=n)
    kw = dict(seed=seed, leftover=leftover, catch_all_bucket=0, return_keys=True, log_report=False)
    try:
        ranks = [BucketBatchSampler(ids, batch, num_replicas=world, rank=r, **kw) for r in range(world)]
    except ValueError as e:  # a plan with zero batches is refused at construction (tested in test_sampler.py)
        assert "zero" in str(e) or "No row" in str(e) or "batch" in str(e)
        return
    views = []
    for r, s in enumerate(ranks):
        s.set_epoch(0)  # every pass below reads epoch 0 (set_epoch holds, as DistributedSampler's)
        if world > 1:  # the idiom itself: refused before any batch, naming both fixes
            with pytest.raises(RuntimeError, match=r"sampler\.shard\(%d\).*without `rank=`" % r):
                next(iter(s))
            assert s.batches_consumed == 0, "the refusal must not move the cursor"
            view = list(s.shard(r))
        else:  # one rank: the global plan is that rank's share
            view = list(s)
            assert view == list(s.shard(0))
        assert len(view) == len(s.shard(r)) == s.steps_per_epoch, "len() of the rank view = its batches"
        assert len(s) == s.steps_per_epoch * world
        views.append(view)
    assert len({len(v) for v in views}) == 1, "every rank the same number of steps"
    for step in zip(*views):
        targets = {t for b in step for _, t, _ in b}
        assert len(targets) == 1, "the same bucket on every rank at every step"
        assert all(len(b) == batch for b in step)
    rows = [row for v in views for b in v for row, _, _ in b]
    report = ranks[0].report()
    assert len(rows) - len(set(rows)) == report.rows_repeated, "no row twice outside the report's repeats"
    assert len(set(rows)) == report.rows_used


def _stream():
    import datasets

    from hf_arb.sampling.streaming.stream import BucketedStream

    ids = np.zeros(40, dtype=int)
    ds = datasets.Dataset.from_dict({"key": np.arange(ids.size), "bucket": ids}).to_iterable_dataset(num_shards=2)
    return BucketedStream(ds, 4, counts=[40])


def _resumables():
    from hf_arb import PackBatchSampler

    ids = np.random.default_rng(0).integers(0, 3, size=200)
    bucket = BucketBatchSampler(ids, 4, num_replicas=2, seed=1, log_report=False)
    w = np.full(300, 512)
    packs = PackBatchSampler((w, w), max_tokens=4096, num_replicas=1, log_report=False)
    return {"BucketedStream": _stream(), "BucketBatchSampler": bucket, "RankBatchSampler": bucket.shard(1),
            "PackBatchSampler": packs}


GARBAGE = [None, [], "text", 3, {"version": 2}, {"format": 1}, {}]


@pytest.mark.parametrize("name", ["BucketedStream", "BucketBatchSampler", "RankBatchSampler", "PackBatchSampler"])
def test_every_resumable_refuses_garbage_state_naming_what_it_expected(name) -> None:
    obj = _resumables()[name]
    good = obj.state_dict()
    for garbage in GARBAGE:
        with pytest.raises((TypeError, ValueError)) as err:
            obj.load_state_dict(garbage)
        msg = str(err.value)
        assert "state" in msg and any(w in msg for w in ("expected", "should be", "this sampler has",
                                                         "this version reads")), (garbage, msg)
        assert not isinstance(err.value, (KeyError, AttributeError))
    obj.load_state_dict(good)  # the real state still loads after the refusals
    if name == "BucketedStream":  # a state with a field of the wrong kind names the field
        with pytest.raises(ValueError, match="field `ranks`"):
            obj.load_state_dict({**good, "ranks": [1]})
        with pytest.raises(ValueError, match="field `epoch`"):
            obj.load_state_dict({**good, "epoch": -1})


# ------------------------------------------------------------------------ resume idioms, every rank in-process
def _rank_loader(sampler: BucketBatchSampler, rank: int | None):
    """accelerate's prepared loader of one rank, built from its public classes in this process: behind
    ``BatchSamplerShard`` (``rank`` given; the default, even_batches and split modes) or over the sampler itself
    (``rank`` None: what ``dispatch_batches=True`` reads on rank 0)."""
    from accelerate.data_loader import BatchSamplerShard, DataLoaderShard

    shard = rank is not None and sampler.num_replicas > 1  # one process: accelerate leaves the batch sampler as is
    bs = BatchSamplerShard(sampler, sampler.num_replicas, rank,
                           split_batches=sampler.split_batches) if shard else sampler
    return DataLoaderShard(list(range(sampler._plan.rows_total)), batch_sampler=bs, collate_fn=lambda b: b)


def _restored(ids, batch, world, seed, state, split=False) -> BucketBatchSampler:
    s = BucketBatchSampler(ids, batch * (world if split else 1), num_replicas=world, seed=seed, leftover="fill",
                           log_report=False, split_batches=split)
    if state is not None:
        s.load_state_dict(state)  # what accelerator.load_state does for a registered sampler, in a new process
    return s


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(30, 300), k_buckets=st.integers(1, 4), batch=st.integers(1, 4), world=st.integers(1, 4),
       seed=st.integers(0, 2**31), epoch=st.integers(0, 1), split=st.booleans(), data=st.data())
def test_resume_idioms_per_rank_are_exact_or_refused(n, k_buckets, batch, world, seed, epoch, split, data) -> None:
    """Every rank's view after a restore taken ``k`` steps into ``epoch`` with the sampler ``ahead`` steps further
    (accelerate's and the workers' read-ahead): accelerate's ``skip_first_batches(loader, k)`` (behind
    BatchSamplerShard, and over the sampler itself as dispatch_batches reads it) and ``resume_dataloader`` give
    exactly the plan's remaining steps on every rank, and the next epoch after ``set_epoch``; the prepared loader
    iterated again is refused before its first batch, unless the restore sits at the start of epoch 0. With and
    without ``split_batches`` (one global batch per step, split by accelerate)."""
    from types import SimpleNamespace

    from accelerate.data_loader import skip_first_batches

    from hf_arb import resume_dataloader

    ids = np.random.default_rng(seed).integers(-1, k_buckets, size=n)
    try:
        ref = _restored(ids, batch, world, seed, None, split)
    except ValueError:  # zero batches: refused at construction (test_sampler.py)
        return
    plan, after = ref.plan(epoch), ref.plan(epoch + 1)  # (steps, world, batch)
    steps = len(plan)
    k = data.draw(st.integers(0, steps - 1), label="k")
    # k = 0 with the whole epoch handed out reads as "the next epoch, step 0" (nothing tells the two apart)
    ahead = data.draw(st.integers(0, steps - k - (0 if k else 1)), label="ahead")
    state = {**ref.state_dict(), "epoch": epoch, "batches_consumed": k + ahead}
    acc = SimpleNamespace(skip_first_batches=skip_first_batches)
    for r in range(world):
        want, nxt = plan[k:, r].tolist(), after[:, r].tolist()
        s = _restored(ids, batch, world, seed, state, split)  # accelerate's checkpointing guide
        loader = _rank_loader(s, r)
        assert len(loader) == steps and len(s) == steps * (1 if split else world)
        assert list(skip_first_batches(loader, k)) == want, (r, k, ahead)
        with pytest.raises(RuntimeError, match=r"set_epoch\(epoch\)"):  # back on the loader, epoch not set
            next(iter(loader))
        loader.set_epoch(epoch + 1)
        assert list(loader) == nxt and len(loader) == steps
        s = _restored(ids, batch, world, seed, state, split)  # hf_arb.resume_dataloader
        loader = _rank_loader(s, r)
        first, e = resume_dataloader(acc, loader, epoch * steps + k)
        assert e == epoch and list(first) == want and list(loader) == nxt
        s = _restored(ids, batch, world, seed, state, split)  # iterate the prepared loader again
        loader, served = _rank_loader(s, r), []
        if epoch == 0 and k + ahead == 0:
            assert list(loader) == plan[:, r].tolist()  # nothing to resume: the epoch from its start, exact
        else:
            with pytest.raises(RuntimeError, match="resume_dataloader|set_epoch"):
                for b in loader:
                    served.append(b)
            assert served == []
    if world > 1:  # dispatch_batches=True: rank 0 reads the sampler, W batches a step; the skip counts batches
        s = _restored(ids, batch, world, seed, state, split)
        got = list(skip_first_batches(_rank_loader(s, None), k))
        if split:  # one global batch a step: rank r's rows are its slice
            assert got == plan[k:].reshape(steps - k, -1).tolist()
        else:
            assert [got[i : i + world] for i in range(0, len(got), world)] == plan[k:].tolist()


def test_skip_beyond_the_restored_position_and_a_foreign_epoch_are_refused() -> None:
    """A ``k`` larger than the steps the restored sampler had handed out is not the loop's counter of that epoch
    (e.g. the global step): refused before a batch, naming ``global_step % len(train_dataloader)``. A restore at an
    epoch's start followed by a prepared loader starting another epoch is refused naming ``set_epoch``; with the
    loop's ``set_epoch`` it is exact."""
    from accelerate.data_loader import skip_first_batches

    ids = np.random.default_rng(4).integers(0, 3, size=120)
    ref = BucketBatchSampler(ids, 2, num_replicas=2, seed=1, leftover="fill", log_report=False)
    steps = ref.steps_per_epoch
    state = {**ref.state_dict(), "epoch": 1, "batches_consumed": 5}
    s = _restored(ids, 2, 2, 1, state)
    with pytest.raises(RuntimeError, match=r"global_step % len\(train_dataloader\)"):
        next(iter(skip_first_batches(_rank_loader(s, 0), steps + 5)))
    assert s.batches_consumed == 5, "the refusal moves nothing"
    assert list(skip_first_batches(_rank_loader(s, 0), 5)) == ref.plan(1)[5:, 0].tolist()  # the right k still works
    at_start = {**state, "batches_consumed": steps}  # epoch 1 handed out: the restore is at epoch 2's start
    s = _restored(ids, 2, 2, 1, at_start)
    loader = _rank_loader(s, 1)
    with pytest.raises(RuntimeError, match=r"set_epoch\(2\)"):
        next(iter(loader))  # a new process: accelerate's pass counter says 0
    loader.set_epoch(2)
    assert list(loader) == ref.plan(2)[:, 1].tolist()
