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
