"""The ``random`` tier schedule's O(groups) epoch plan (issue #27): row groups, the per-group multinomial draw and
the keyed assignment of a group's rows, checked against OneTrainer's rule (each row uniform over its eligible
tiers, independently, every epoch), and through TieredBatchSampler with every rank simulated."""

from __future__ import annotations

import json
from functools import lru_cache

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_arb.sampling.planning.feistel import FeistelPermutation
from hf_arb.sampling.planning.index import build_index, count_blocks
from hf_arb.sampling.tiered import draw as tier_random
from hf_arb.sampling.tiered.draw import GroupColumn, RandomEpochIndex, RowGroups, draw_tier_counts, find_groups
from hf_arb.sampling.tiered.plan import Tiers, tier_bucket_ids
from hf_arb.sampling.tiered.sampler import TieredBatchSampler

TIERS = Tiers.preset("budget", [256, 512])
THREE = Tiers.preset("budget", [256, 512, 1024])
SETTINGS = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@lru_cache(maxsize=None)
def sizes(n: int = 600, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(150, 1400, n), rng.integers(150, 1400, n)


def row_groups(ids: np.ndarray, tiers: Tiers) -> RowGroups:
    buckets = find_groups(ids, tiers.num_buckets)
    column = GroupColumn(ids, buckets, tiers.num_buckets)
    blocks = count_blocks(column, buckets.shape[0])
    return RowGroups(buckets, build_index(column, None, buckets.shape[0], blocks), tiers.offsets)


@lru_cache(maxsize=None)
def groups_of(n: int = 600, three: bool = False) -> tuple[np.ndarray, RowGroups]:
    tiers = THREE if three else TIERS
    ids = tier_bucket_ids(*sizes(n), tiers)
    return ids, row_groups(ids, tiers)


def make(world: int, rank: int, batch=(3, 2), **kw) -> TieredBatchSampler:
    w, h = sizes()
    return TieredBatchSampler(w, h, TIERS, "random", batch_size=list(batch), num_replicas=world, rank=rank,
                              return_keys=True, **kw)


# ------------------------------------------------------------------------------------------- groups
@SETTINGS
@given(st.lists(st.tuples(st.integers(1, 3000), st.integers(1, 3000)), min_size=1, max_size=80))
def test_a_group_is_the_rows_with_the_same_bucket_in_every_tier(wh):
    w, h = (np.array(c, dtype=np.int64) for c in zip(*wh))
    ids = tier_bucket_ids(w, h, THREE)  # (T, n)
    g = row_groups(ids, THREE)
    want = np.unique(ids[:, (ids >= 0).any(axis=0)].T, axis=0)  # the distinct tuples of rows eligible somewhere
    assert sorted(map(tuple, g.buckets.tolist())) == sorted(map(tuple, want.tolist()))
    seen = []
    for k in range(g.num_groups):
        rows = g.index.rows(k, np.arange(g.index.count[k]))
        assert (ids[:, rows] == g.buckets[k][:, None]).all()
        seen += rows.tolist()
    assert sorted(seen) == np.flatnonzero((ids >= 0).any(axis=0)).tolist()


def test_a_large_key_space_finds_the_same_groups(monkeypatch):
    """Above 2^16 possible bucket tuples the groups are found by sorting keys instead of a presence table."""
    ids, dense = groups_of(600, True)
    monkeypatch.setattr(tier_random, "_DENSE_KEYS", 0)
    sparse = row_groups(ids, THREE)
    np.testing.assert_array_equal(sparse.buckets, dense.buckets)
    np.testing.assert_array_equal(sparse.index.count, dense.index.count)
    np.testing.assert_array_equal(np.asarray(sparse.index.low), np.asarray(dense.index.low))


# ------------------------------------------------------------------------------------------- one epoch
@SETTINGS
@given(st.integers(0, 10**6), st.integers(0, 50), st.booleans())
def test_every_eligible_row_is_drawn_for_exactly_one_of_its_tiers(seed, epoch, three):
    ids, g = groups_of(600, three)
    ep = RandomEpochIndex(g, seed, epoch)
    comb = ep.combined_ids(ids.shape[1])  # (n,) -1 where eligible nowhere; each row listed once (else overwritten)
    assert sum(ep.count.tolist()) == int((ids >= 0).any(axis=0).sum()) == int((comb >= 0).sum())
    off = g.offsets
    t = np.searchsorted(off, comb, side="right") - 1
    drawn = comb >= 0
    assert (ids[t[drawn], np.flatnonzero(drawn)] == (comb - off[t])[drawn]).all()  # an eligible tier, its bucket
    assert (comb[~(ids >= 0).any(axis=0)] == -1).all()
    np.testing.assert_array_equal(np.bincount(comb[drawn], minlength=int(off[-1])), ep.count)
    again = RandomEpochIndex(g, seed, epoch)  # a pure function of (seed, epoch): any rank computes the same
    assert (again.combined_ids(ids.shape[1]) == comb).all()


def group_chi2(counts: np.ndarray, eligible: np.ndarray, sizes_: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic of the tier counts of groups with >= 2 eligible tiers against n_g / m_g per tier, and
    its degrees of freedom (Σ m_g - 1): ``counts`` ``(D, G, T)`` over D draws."""
    m = eligible.sum(axis=1)  # (G,)
    use = m >= 2
    expect = (sizes_ / m)[None, :, None]  # (1, G, 1)
    terms = np.where(eligible[None], (counts - expect) ** 2 / expect, 0.0)[:, use]
    return float(terms.sum()), int(counts.shape[0] * (m[use] - 1).sum())


def test_group_tier_counts_have_the_law_of_independent_uniform_draws(monkeypatch):
    """Pearson's χ² of every group's counts per tier against n_g / m_g, over 600 draws (fixed seeds): χ²/dof within
    ±15% of 1 (about ±10 standard deviations at this many degrees of freedom, so not failing by chance), and the
    same statistic rejects a rule that sends every row to one tier, or splits a group evenly every time."""
    _, g = groups_of(3000, True)
    elig, n = g.buckets >= 0, g.index.count
    draws = np.stack([draw_tier_counts(n, elig, s, e) for s in range(30) for e in range(20)])  # (600, G, T)
    assert (draws.sum(axis=2) == n).all() and (draws[:, ~elig] == 0).all()
    chi2, dof = group_chi2(draws, elig, n)
    assert dof > 5000 and 0.85 < chi2 / dof < 1.15, (chi2, dof)
    first = np.where(np.cumsum(elig, axis=1) == 1, elig, False) * n[:, None]  # every row to its first tier
    assert group_chi2(np.broadcast_to(first, draws.shape), elig, n)[0] / dof > 10
    even = np.where(elig, n[:, None] / np.maximum(elig.sum(axis=1, keepdims=True), 1), 0)  # never any spread
    assert group_chi2(np.broadcast_to(even, draws.shape), elig, n)[0] / dof < 0.1
    assert not (draws[0] == draws[1]).all()  # a new draw per epoch


def row_chi2(ids: np.ndarray, g: RowGroups, epochs: int) -> tuple[float, int]:
    """Pearson's statistic of how often each row (eligible in >= 2 tiers) drew each of its tiers over ``epochs``
    epochs against ``epochs / m_r``, and its degrees of freedom."""
    T, n = ids.shape
    hits = np.zeros((T, n))
    for e in range(epochs):
        comb = RandomEpochIndex(g, 11, e).combined_ids(n)
        t = np.searchsorted(g.offsets, comb, side="right") - 1
        np.add.at(hits, (t[comb >= 0], np.flatnonzero(comb >= 0)), 1)
    elig = ids >= 0
    m = elig.sum(axis=0)
    use = m >= 2
    expect = epochs / np.maximum(m, 1)
    return float(np.where(elig, (hits - expect) ** 2 / expect, 0)[:, use].sum()), int((m[use] - 1).sum())


def test_each_row_draws_each_eligible_tier_equally_often_over_epochs(monkeypatch):
    """Per row, over 120 epochs: χ²/dof of its tier counts against uniform within ±25% of 1 (a few hundred rows:
    about ±5 standard deviations), and the statistic rejects assigning a group's rows in a fixed order (the
    counts alone random), which would give the first rows of a group its first tier nearly every epoch."""
    ids, g = groups_of(600)
    chi2, dof = row_chi2(ids, g, 120)
    assert dof > 150 and 0.75 < chi2 / dof < 1.25, (chi2, dof)
    monkeypatch.setattr(tier_random, "FeistelPermutation", lambda n, key: FeistelPermutation(n, key, shuffle=False))
    bad, _ = row_chi2(ids, g, 120)
    assert bad / dof > 5, bad / dof


# ------------------------------------------------------------------------------------------- the sampler
def epoch_keys(world: int, epoch: int, **kw) -> list[list[list[tuple]]]:
    """[step][rank] -> keys of one epoch, each rank read from its own sampler's shard."""
    per_rank = []
    for r in range(world):
        s = make(world, r, **kw)
        s.set_epoch(epoch)
        per_rank.append(list(s.shard()))
    return [list(step) for step in zip(*per_rank, strict=True)]


@SETTINGS
@given(st.integers(1, 3), st.integers(0, 40), st.integers(0, 5))
def test_with_fill_an_epoch_trains_every_eligible_row_at_one_eligible_tier(world, seed, epoch):
    w, h = sizes()
    ids = tier_bucket_ids(w, h, TIERS)
    tier_of: dict[int, set] = {}
    for step in epoch_keys(world, epoch, seed=seed, leftover="fill"):
        (t, b, e), = {(k[1], k[2], k[3]) for batch in step for k in batch}  # one (tier, bucket) on every rank
        assert e == epoch
        for batch in step:
            for row, *_ in batch:
                assert ids[t, row] == b
                tier_of.setdefault(row, set()).add(t)
    assert sorted(tier_of) == np.flatnonzero((ids >= 0).any(axis=0)).tolist()
    assert all(len(ts) == 1 for ts in tier_of.values())  # repeats (fill) stay in the row's one tier


@pytest.mark.parametrize("cut", [0, 5, 17, 40])
def test_random_elastic_resume_continues_the_same_global_sequence(cut):
    full = [epoch_keys(2, e, batch=(4, 2), seed=1) for e in range(2)]  # 2 ranks × (4, 2) = global (8, 4)
    glob = [[k for batch in step for k in batch] for ep in full for step in ep]
    a = make(2, 0, batch=(4, 2), seed=1)
    it = iter(a.shard())
    for _ in range(cut):
        next(it)
    state = json.loads(json.dumps(a.state_dict()))
    rest = []
    for r in range(4):  # 4 ranks × (2, 1) rows: the same global batches
        b = make(4, r, batch=(2, 1), seed=1)
        b.load_state_dict(state)
        got = list(b.shard())
        b.set_epoch(1)
        rest.append(got + list(b.shard()))
    assert [[k for batch in step for k in batch] for step in zip(*rest)] == glob[cut:]


def test_random_states_carry_plan_version_2_and_older_ones_are_refused():
    s = make(2, 0, seed=3)
    state = s.state_dict()
    assert state["plan_version"] == 2 and state["schedule"]["kind"] == "random"
    with pytest.raises(ValueError, match="`plan_version`.*version 2"):
        s.load_state_dict({**state, "plan_version": 1})  # a state of the O(rows) per-row-hash plan


def test_an_epoch_plan_reads_no_row():
    """A new epoch's plan and its first batch read the group index at that batch's rows only (O(groups) plan):
    the index's row array is replaced by one that records every position read."""
    s = make(1, 0, seed=2)
    s.set_epoch(0)
    next(iter(s.shard()))
    index = s._groups.index
    read: list[int] = []

    class Recording(np.ndarray):
        def __getitem__(self, key):
            read.append(int(np.size(key)))
            return np.asarray(self).__getitem__(key)

    index.low = index.low.view(Recording)
    for e in range(1, 4):
        s.set_epoch(e)
        batch = next(iter(s.shard()))
        assert sum(read) == len(batch), (e, read)
        read.clear()
