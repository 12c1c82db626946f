"""--streaming with the `random` tier schedule (issue #27): RandomTierStream, every rank simulated in one process
(``rank=None`` reads every rank's split here, as accelerate's dispatch_batches does)."""

from __future__ import annotations

import json
from collections import Counter
from functools import lru_cache

import datasets
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from hf_arb.sampling.tiered.draw import RandomEpochIndex
from hf_arb.sampling.tiered.plan import Tiers, tier_bucket_ids
from hf_arb.sampling.tiered.stream import TieredStream, tier_stream_counts
from hf_arb.sampling.tiered.stream_draw import RandomTierStream, TierAssigner, stream_groups

TIERS = Tiers.preset("budget", [256, 512])
N = 160
EPOCHS = 2


@lru_cache(maxsize=None)
def _sizes(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Three aspect ratios, sides from below the small tier to above the large one: groups eligible at no tier, at
    the small one only and at both (a few (tier, bucket)s, so every rank of 3 sees each one)."""
    rng = np.random.default_rng(seed)
    side = rng.integers(150, 900, N)
    aspect = rng.choice([0.75, 1.0, 1.5], N)
    return np.round(side * np.sqrt(aspect)).astype(int), np.round(side / np.sqrt(aspect)).astype(int)


def _source() -> datasets.IterableDataset:
    w, h = _sizes()
    ds = datasets.Dataset.from_dict({"key": np.arange(N), "original_width": w, "original_height": h,
                                     "bucket": np.full(N, -1)})
    return ds.to_iterable_dataset(num_shards=12)


def _stream(world: int, seed: int = 3) -> RandomTierStream:
    return RandomTierStream(_source(), TIERS, 2, groups=stream_groups(*_sizes(), TIERS), num_replicas=world,
                            seed=seed, buffer_size=256, on_overflow="evict", snapshot_every=8,
                            shuffle_rows=16)


def _steps(stream: RandomTierStream, epochs: int, state=None, stop=None, ahead=1):
    """[(epoch, step, [[(key, tier, bucket), ...] per rank])], and per epoch its report; with ``stop`` (a global
    step count), stop ``ahead`` steps past it (the loader's read-ahead) and return the state after ``stop`` trained
    steps (JSON round trip) instead of the reports."""
    if state is not None:
        stream.load_state_dict(state)
    W, out, reports, at = stream.num_replicas, [], {}, {}
    while stream.epoch < epochs:
        e, items = stream.epoch, []
        stream.set_epoch(e)
        for item in stream:
            items.append([(int(r["key"]), int(r["tier"]), int(r["tier_bucket"])) for r in item])
            if len(items) % W == 0:
                out.append((e, stream.step - 1, items[-W:]))
                at[len(out)] = stream.step - 1
                if stop is not None and len(out) == stop + ahead:
                    step = at[stop] + 1 if stop in at and out[stop - 1][0] == e else 0
                    return out, json.loads(json.dumps(stream.state_dict(step=step)))
        reports[e] = stream.report()
        stream.set_epoch(e + 1)
    return out, reports


@lru_cache(maxsize=None)
def _full(world: int) -> tuple:
    return _steps(_stream(world), EPOCHS)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_rank_trains_the_planned_tier_and_bucket_and_each_row_one_eligible_tier_per_epoch(world) -> None:
    """Two epochs on 1-3 simulated ranks: at every step all ranks' rows are of one (tier, bucket), the one
    ``step_tiers`` gives (a fresh stream's: a pure function of sizes, seed and epoch); each row fits that bucket of
    that tier; per epoch a row trains in one tier only and appears more than once only as a counted repeat."""
    steps, reports = _full(world)
    ids = tier_bucket_ids(*_sizes(), TIERS)  # (T, N)
    fresh = _stream(world)
    for e in range(EPOCHS):
        tiers, buckets = fresh.step_tiers(e)
        mine = [ranks for ee, _, ranks in steps if ee == e]
        assert len(mine) == fresh.steps_in(e) == tiers.size
        tier_of: dict[int, int] = {}
        seen = Counter()
        for s, ranks in enumerate(mine):
            assert {(t, b) for rows in ranks for _, t, b in rows} == {(int(tiers[s]), int(buckets[s]))}, (e, s)
            for key, t, b in (x for rows in ranks for x in rows):
                assert ids[t, key] == b  # eligible at t, in its bucket there
                assert tier_of.setdefault(key, t) == t, (e, key)  # one tier per epoch
                seen[key] += 1
        assert sum(n - 1 for n in seen.values()) == reports[e].rows_repeated, e
        assert len(seen) == reports[e].rows_used


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.generate])
@given(world=st.integers(1, 3), seed=st.integers(0, 2**20), epoch=st.integers(0, 50))
def test_the_rows_drawn_per_tier_and_bucket_are_the_plans_counts(world, seed, epoch) -> None:
    """Reading the source as the ranks do, the assigners give each (tier, bucket) at most the plan's rows (with one
    rank: exactly them), each row one eligible tier, and the slots the ranks leave empty are the rows they skip
    beyond their share, so the plan's counts (the step plan) hold before any row is read."""
    w, h = _sizes()
    groups = stream_groups(w, h, TIERS)
    plan = RandomEpochIndex(groups, seed, epoch)
    ids = tier_bucket_ids(w, h, TIERS)
    got = np.zeros_like(plan.count)
    beyond = 0
    for r in range(world):
        a = TierAssigner(TIERS, groups, plan, rank=r, world=world, seed=seed, epoch=epoch)
        src = datasets.distributed.split_dataset_by_node(_source(), rank=r, world_size=world)
        for chunk in src.iter(batch_size=37):
            out = a(chunk)
            for key, c, t, b in zip(out["key"], out["bucket"], out["tier"], out["tier_bucket"]):
                if c < 0:
                    beyond += int((ids[:, key] >= 0).any())
                    continue
                assert ids[t, key] == b and c == TIERS.offsets[t] + b
                got[c] += 1
    assert np.all(got <= plan.count)
    assert int((plan.count - got).sum()) == beyond  # a group's rows beyond a rank's share = the slots left empty
    if world == 1:
        assert beyond == 0 and np.array_equal(got, plan.count)
    per_tier = [int(plan.count[TIERS.offsets[t] : TIERS.offsets[t + 1]].sum()) for t in range(2)]
    assert sum(per_tier) == int((ids >= 0).any(axis=0).sum())  # every eligible row once, in one tier


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.generate])
@given(world=st.integers(1, 3), data=st.data())
def test_resume_equals_the_uninterrupted_run_at_random_points(world, data) -> None:
    """A state saved at a random global step (the loader one step ahead, possibly in the next epoch) and loaded
    into a fresh stream gives the remaining steps of the uninterrupted run exactly, over two epochs."""
    full = _full(world)[0]
    stop = data.draw(st.integers(1, len(full) - 1), label="stop")
    head, state = _steps(_stream(world), EPOCHS, stop=stop)
    assert head == full[: stop + 1]
    rest, _ = _steps(_stream(world), EPOCHS, state=state)
    assert rest == full[stop:]


def test_tiered_stream_names_the_random_stream_and_a_foreign_state_is_refused() -> None:
    w, h = _sizes()
    with pytest.raises(ValueError, match="RandomTierStream"):
        TieredStream(_source(), TIERS, "random", 2, counts=tier_stream_counts(w, h, TIERS))
    _, state = _steps(_stream(1), 1, stop=3)
    with pytest.raises(ValueError, match="seed"):
        _stream(1, seed=4).load_state_dict(state)


@pytest.mark.parametrize("world, stop", [(1, 58), (2, 22), (2, 58)])
def test_resume_from_a_snapshot_with_counted_arrivals_equals_the_uninterrupted_run(world, stop) -> None:
    """Points where the replay starts at a source snapshot after rows of several groups have arrived (the earliest
    snapshot the state keeps has non-zero per-group counters): the resumed stream re-assigns the re-read rows and
    the later ones from those counters, and equals the uninterrupted run."""
    full = _full(world)[0]
    head, state = _steps(_stream(world), EPOCHS, stop=stop)
    first = [r["snapshots"][min(r["snapshots"], key=int)]["arrived"] for r in state["ranks"].values()]
    assert any(any(a) for a in first), first  # the counters are what the replay starts from
    rest, _ = _steps(_stream(world), EPOCHS, state=state)
    assert head == full[: stop + 1] and rest == full[stop:]


def test_each_arrival_draws_each_eligible_tier_equally_often_over_epochs() -> None:
    """OneTrainer's law: whatever its place in the arrival order (and its rank), a row of a group eligible at both
    tiers trains at each with probability 1/2 per epoch (300 epochs: each arrival's frequency within 5 standard
    deviations, the overall one within 5 of its own)."""
    groups = stream_groups(*_sizes(), TIERS)
    g = int(np.flatnonzero((groups.buckets >= 0).sum(axis=1) == 2)[0])
    n, epochs = int(groups.index.count[g]), 300
    for world in (1, 2):
        hits = np.zeros(n)
        for e in range(epochs):
            plan = RandomEpochIndex(groups, 7, e)
            for r in range(world):
                share = len(range(r, n, world))
                a = TierAssigner(TIERS, groups, plan, rank=r, world=world, seed=7, epoch=e)
                hits[r::world] += a.tiers_of(np.full(share, g)) == 0
        freq = hits / epochs
        assert np.all(np.abs(freq - 0.5) < 5 * np.sqrt(0.25 / epochs)), freq
        assert abs(freq.mean() - 0.5) < 5 * np.sqrt(0.25 / (epochs * n))
