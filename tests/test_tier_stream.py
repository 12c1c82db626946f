"""--streaming with several tiers (issue #27): TieredStream, every rank simulated in one process (``rank=None``
reads every rank's split here, as accelerate's dispatch_batches does)."""

from __future__ import annotations

import json
from functools import lru_cache

import datasets
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from hf_arb.sampling.streaming.stream import BucketedStream
from hf_arb.sampling.tiered.plan import Tiers, tier_bucket_ids
from hf_arb.sampling.tiered.stream import TierColumns, TieredStream, combined_counts, tier_stream_counts

TIERS = Tiers.preset("budget", [256, 512])
SCHEDULES = {"mix": "mix:256:1,512:2", "curriculum": "0-5:512,5-13:256,13-:512", "progressive": "progressive:9"}
N = 120
SIZES = ("original_width", "original_height")


def _source(seed: int = 0) -> tuple[datasets.IterableDataset, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w, h = rng.integers(150, 1400, N), rng.integers(150, 1400, N)
    ds = datasets.Dataset.from_dict({"key": np.arange(N), "original_width": w, "original_height": h,
                                     "bucket": np.full(N, -1)})
    return ds.to_iterable_dataset(num_shards=4), w, h


def _stream(kind: str, world: int, **kw) -> TieredStream:
    ds, w, h = _source()
    return TieredStream(ds, TIERS, SCHEDULES[kind], 2, counts=tier_stream_counts(w, h, TIERS), num_replicas=world,
                        seed=3, buffer_size=256, **kw)


def _steps(stream: TieredStream, epochs: int, state=None, stop=None, ahead=1):
    """[(epoch, step, [[(key, tier, bucket), ...] per rank])]; with ``stop`` (a global step count), stop ``ahead``
    steps past it (the loader's read-ahead): the steps produced and the state after ``stop`` trained steps (JSON
    round trip)."""
    if state is not None:
        stream.load_state_dict(state)
    W, out, saved = stream.num_replicas, [], None
    while stream.epoch < epochs:
        e, items = stream.epoch, []
        stream.set_epoch(e)
        for item in stream:
            items.append([(int(r["key"]), int(r["tier"]), int(r["tier_bucket"])) for r in item])
            if len(items) % W == 0:
                out.append((e, stream.step - 1, items[-W:]))
                if stop is not None and len(out) == stop + ahead:
                    return out, json.loads(json.dumps(stream.state_dict(step=(stop % stream.steps_per_epoch))))
        if stream.step >= stream.steps_per_epoch:
            stream.set_epoch(e + 1)
    return out, saved


@pytest.mark.parametrize("kind", sorted(SCHEDULES))
def test_every_rank_trains_the_scheduled_tier_and_bucket_and_each_tier_pass_is_the_single_tier_stream(kind) -> None:
    """Two epochs on 2 simulated ranks: at every step all ranks' rows are of one (tier, bucket), the one
    ``step_tiers`` computes (the same on every process: a pure function of the counts, seed and step), each row
    fits that bucket of that tier, and the steps of each tier's pass are exactly those of a single-tier
    BucketedStream over that tier's buckets (so no row twice in a pass beyond its counted repeats)."""
    stream, (_, w, h) = _stream(kind, 2), _source()
    ids = tier_bucket_ids(w, h, TIERS)
    steps, _ = _steps(stream, 2)
    assert len(steps) == 2 * stream.steps_per_epoch
    seen: dict[tuple[int, int], list] = {}
    pos = dict.fromkeys(stream.used, 0)
    for e, s, ranks in steps:
        tiers, buckets = stream.step_tiers(e)
        labels = {(t, b) for rows in ranks for _, t, b in rows}
        assert labels == {(int(tiers[s]), int(buckets[s]))}, (e, s, labels)
        t = int(tiers[s])
        q, pos[t] = pos[t] // stream.pass_steps[t], pos[t] + 1
        for rows in ranks:
            assert all(ids[tt, key] == b for key, tt, b in rows)
        seen.setdefault((t, q), []).append(ranks)
    ds, w, h = _source()
    for (t, q), got in seen.items():
        only = [c if u == t else 0 * c for u, c in enumerate(tier_stream_counts(w, h, TIERS))]
        alone = BucketedStream(ds.map(TierColumns(TIERS, t, SIZES), batched=True), 2, num_replicas=2, seed=3,
                               counts=combined_counts(only, TIERS), buffer_size=256)
        alone.set_epoch(q)
        items = [[(int(r["key"]), t, int(r["tier_bucket"])) for r in item] for item in alone]
        assert got == [items[i : i + 2] for i in range(0, len(items), 2)][: len(got)], (t, q)
    if kind == "curriculum":  # the switches at steps 5 and 13 (and a tier's stream continues where it stopped)
        tiers, _ = stream.step_tiers(0)
        assert tiers[:5].tolist() == [1] * 5 and tiers[5:13].tolist() == [0] * 8 and tiers[13:].min() == 1


@lru_cache(maxsize=None)
def _full(kind: str, world: int) -> list:
    return _steps(_stream(kind, world, steps_per_epoch=30), 2)[0]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.generate])
@given(kind=st.sampled_from(sorted(SCHEDULES)), world=st.integers(1, 2), data=st.data())
def test_resume_equals_the_uninterrupted_run_at_random_points_across_a_switch(kind, world, data) -> None:
    """A state saved at a random global step (the loader one step ahead) and loaded into a fresh stream gives the
    remaining steps of the uninterrupted run exactly, over two epochs of 30 steps (curriculum: switches at 5 and
    13; progressive at 9; tiers' passes end and restart within the run)."""
    full = _full(kind, world)
    stop = data.draw(st.integers(1, len(full) - 1), label="stop")
    head, state = _steps(_stream(kind, world, steps_per_epoch=30), 2, stop=stop)
    assert head == full[: stop + 1]
    rest, _ = _steps(_stream(kind, world, steps_per_epoch=30), 2, state=state)
    assert rest == full[stop:]


def test_random_and_a_foreign_state_are_refused_naming_the_fix() -> None:
    ds, w, h = _source()
    with pytest.raises(ValueError, match="step schedule"):
        TieredStream(ds, TIERS, "random", 2, counts=tier_stream_counts(w, h, TIERS))
    _, state = _steps(_stream("mix", 1), 1, stop=3)
    with pytest.raises(ValueError, match="config.schedule"):
        _stream("curriculum", 1).load_state_dict(state)


def test_resume_around_a_tier_pass_that_the_loader_already_ended_and_around_the_switches() -> None:
    """Curriculum on 2 ranks: tier 1 (17 steps a pass) trains global steps 0-4 and 13-, so its first pass ends at
    step 24 and its second begins at 25; a state at step 24 (loader at 25) describes a pass the stream has already
    left (the loader two steps ahead). Also the switches at 5 and 13 and the epoch boundary at 30."""
    full = _full("curriculum", 2)
    for stop in (4, 5, 12, 13, 23, 24, 25, 26, 30, 31):  # (a pass of an epoch ends with it: no read-ahead past 29)
        head, state = _steps(_stream("curriculum", 2, steps_per_epoch=30), 2, stop=stop, ahead=2)
        assert head == full[: stop + 2]
        rest, _ = _steps(_stream("curriculum", 2, steps_per_epoch=30), 2, state=state)
        assert rest == full[stop:], stop
