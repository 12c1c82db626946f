"""The stream's RankBuffer against the one it replaced, run side by side: the block-planned buffer of 83fc72e
(benchmarks/_stream_v2, itself checked here against the step-by-step buffer before it). The same batches, reports and
JSON state_dicts at every step (hypothesis over bucket weights, unassigned rows, 1-3 ranks, small buffers that evict
heavily, pick windows, fill levels, chunk sizes and pick blocks), a state saved in the middle of a chunk or a pick
block resumes exactly, on either buffer, to the uninterrupted run's batches, and every state stays small: the read
indices of the rows it holds and only the snapshots they need."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from unittest import mock

import datasets
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from hf_arb.sampling.streaming.stream import BucketedStream

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _stream_v2  # noqa: E402
from _stream_v2 import buffer as v2_buffer  # noqa: E402

from hf_arb.sampling.streaming import buffer as new_buffer  # noqa: E402


def _ids(weights: list[int], unassigned: int, n: int, seed: int) -> np.ndarray:
    p = np.array([unassigned] + weights, dtype=float)
    ids = np.random.default_rng(seed).choice(np.arange(-1, len(weights)), size=n, p=p / p.sum())
    if (ids < 0).all():
        ids[0] = 0
    return ids


def _stream(ids: np.ndarray, shards: int, batch: int, cls: type, **kw) -> BucketedStream:
    ds = datasets.Dataset.from_dict({"key": np.arange(ids.size), "bucket": ids}).to_iterable_dataset(num_shards=shards)
    counts = np.bincount(ids[ids >= 0], minlength=int(ids.max()) + 1)
    return cls(ds, batch, counts=counts, **kw)


NEW = BucketedStream
REFERENCES = {"v2": (_stream_v2.BucketedStreamV2, v2_buffer)}


def _keys(item) -> list[tuple[int, int]] | None:
    return None if item is None else [(int(r["key"]), int(r["bucket"])) for r in item]


def _check_small(state: dict, stream: BucketedStream) -> None:
    """A state holds what a resume needs and no more: per rank the read indices of the rows buffered (at most
    ``buffer_size``) and in the repeat reserve (at most a batch per bucket), and exactly the source snapshots that
    precede one of them or the read position (the latest at or before each)."""
    for rank in state["ranks"].values():
        assert len(rank["buffer"]) <= stream.buffer_size
        reserve = [i for v in rank["reserve"].values() for i in v]
        assert all(len(v) <= stream.batch_size for v in rank["reserve"].values())
        keys = sorted(int(k) for k in rank["snapshots"])
        need = [i for i, _ in rank["buffer"]] + reserve + [rank["read"]]
        assert sorted({max(k for k in keys if k <= i) for i in need}) == keys


def _lockstep(old: BucketedStream, new: BucketedStream, world: int, back: int) -> tuple[list, list[dict]]:
    """Iterate both streams together: equal items, and equal JSON states at every step (this step and ``back``
    steps before it, as a prefetching loader asks). Returns the items and new's state after every step."""
    items, states, it_old, it_new = [], [], iter(old), iter(new)
    assert old.steps_per_epoch == new.steps_per_epoch
    for s in range(old.steps_per_epoch):
        for _ in range(world):
            got, want = next(it_new), next(it_old)
            assert got == want, f"step {s}"  # the same row dicts (every column), or both None
            items.append(_keys(got))
        for k in range(max(0, s + 1 - back), s + 2):
            a, b = json.dumps(old.state_dict(step=k)), json.dumps(new.state_dict(step=k))
            assert a == b, f"state at step {k} after step {s}"
        states.append(json.loads(json.dumps(new.state_dict(step=s + 1))))
        _check_small(states[-1], new)
        assert old.report() == new.report()
    for it in (it_old, it_new):
        assert next(it, "end") == "end"
    return items, states


@pytest.mark.parametrize("reference", sorted(REFERENCES))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(weights=st.lists(st.integers(1, 20), min_size=1, max_size=6), unassigned=st.integers(0, 3),
       n=st.integers(40, 400), world=st.integers(1, 3), batch=st.integers(1, 5), buffer_mult=st.integers(1, 30),
       shards=st.integers(1, 6), seed=st.integers(0, 5), window=st.integers(1, 12), every=st.sampled_from([3, 7, 32]),
       fill=st.floats(0, 1), order=st.sampled_from(["arrival", "shuffle"]), cut=st.floats(0, 1),
       block=st.sampled_from([4, 1024]))
def test_buffer_equals_the_buffers_it_replaced(reference, weights, unassigned, n, world, batch, buffer_mult, shards,
                                              seed, window, every, fill, order, cut, block):
    ids = _ids(weights, unassigned, n, seed)
    buffer_size = batch * buffer_mult  # small multiples: heavy eviction
    kw = dict(num_replicas=world, seed=seed, buffer_size=buffer_size, on_overflow="evict", snapshot_every=every,
              pick_window=batch * window, schedule=order, shuffle_rows=int(fill * buffer_size), history=4)
    # PICK_BLOCK 4: the steps' pick positions are planned in blocks of 4 steps (many block boundaries)
    OLD, old_buffer = REFERENCES[reference]
    with mock.patch.object(new_buffer, "PICK_BLOCK", block), mock.patch.object(old_buffer, "PICK_BLOCK", block):
        try:
            list(_stream(ids, shards, batch, OLD, **kw))
        except RuntimeError as err:  # a rank without a row of a scheduled bucket: both refuse at the same step
            with pytest.raises(RuntimeError) as again:
                list(_stream(ids, shards, batch, NEW, **kw))
            assert str(again.value) == str(err)
            return
        items, states = _lockstep(*(_stream(ids, shards, batch, cls, **kw) for cls in (OLD, NEW)), world, back=3)
        if len(states) < 2:
            return
        # resume from the state after step k (k + 1 steps done; not the epoch's end, which restarts it), on both
        k = min(int(cut * len(states)), len(states) - 2)
        rest = {}
        for cls in (OLD, NEW):
            resumed = _stream(ids, shards, batch, cls, **kw)
            resumed.load_state_dict(states[k])
            rest[cls] = ([_keys(item) for item in resumed], resumed.report())
    assert rest[NEW] == rest[OLD]
    assert rest[NEW][0] == items[(k + 1) * world:]  # and equal the uninterrupted run


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(weights=st.lists(st.integers(1, 20), min_size=1, max_size=6), unassigned=st.integers(0, 3),
       n=st.integers(40, 200), world=st.integers(1, 3), batch=st.integers(1, 4), buffer_mult=st.integers(1, 30),
       shards=st.integers(1, 6), seed=st.integers(0, 5), every=st.sampled_from([3, 7, 32]), cut=st.floats(0, 1))
def test_arrow_reader_equals_the_source_reader(weights, unassigned, n, world, batch, buffer_mult, shards, seed,
                                               every, cut):
    """reader='arrow' (Arrow chunks made python columns at once) gives the frozen buffer's row dicts (every column),
    reports and states at every step: the same read indices, counters and source snapshots, the same config; its
    states resume exactly to the uninterrupted run's batches, with either reader."""
    ids = _ids(weights, unassigned, n, seed)
    kw = dict(num_replicas=world, seed=seed, buffer_size=batch * buffer_mult, on_overflow="evict",
              snapshot_every=every, history=4)
    try:
        list(_stream(ids, shards, batch, _stream_v2.BucketedStreamV2, **kw))
    except RuntimeError as err:  # a rank without a row of a scheduled bucket: both refuse at the same step
        with pytest.raises(RuntimeError) as again:
            list(_stream(ids, shards, batch, NEW, reader="arrow", **kw))
        assert str(again.value) == str(err)
        return
    old, new = _stream(ids, shards, batch, _stream_v2.BucketedStreamV2, **kw), _stream(ids, shards, batch, NEW,
                                                                                          reader="arrow", **kw)
    items, states, it_old, it_new = [], [], iter(old), iter(new)
    for s in range(old.steps_per_epoch):
        for _ in range(world):
            got, want = next(it_new), next(it_old)
            assert got == want, f"step {s}"
            items.append(_keys(got))
        a, b = old.state_dict(step=s + 1), json.loads(json.dumps(new.state_dict(step=s + 1)))
        assert json.dumps(b) == json.dumps(a), f"step {s}"  # the reader leaves no trace in the state
        _check_small(b, new)
        states.append(b)
        assert old.report() == new.report()
    assert next(it_new, "end") == "end"
    if len(states) < 2:
        return
    k = min(int(cut * len(states)), len(states) - 2)
    resumed = _stream(ids, shards, batch, NEW, reader="arrow", **kw)
    resumed.load_state_dict(states[k])
    assert [_keys(item) for item in resumed] == items[(k + 1) * world:]
    across = _stream(ids, shards, batch, NEW, **kw)  # the source reader resumes it too (a switch of reader)
    across.load_state_dict(states[k])
    assert [_keys(item) for item in across] == items[(k + 1) * world:]
