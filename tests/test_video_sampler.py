"""The sampler over (width, height, frames) buckets (issue 37 item 4), in one process: every rank simulated by its own
sampler, over datasets that mix stills (1-frame buckets) and clips. The (W, H, F) keys run through the same bucket-id
mechanism as images: the same bucket on every rank at every step, buckets drawn in proportion to their batches, no
batch mixing stills and clips, exact resume at any step, elastic resume, a batch size per bucket (clips smaller), and
the streaming path (BucketedStream). Two real processes resume over (W, H, F) buckets in
tests/test_sampler_distributed.py (the ``video`` mode of its shared launches)."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from hf_arb import BucketBatchSampler, BucketSet, plan_epoch
from hf_arb.buckets.schema import with_stored_buckets
from hf_arb.sampling.streaming.plan import as_counts
from hf_arb.sampling.streaming.stream import BucketedStream

#: stills (1 frame) and clips of 9, 17 and 33 frames (Wan's 4k+1), each at three aspects
VIDEO_SET = BucketSet([(w, h, f) for f in (1, 9, 17, 33) for (w, h) in ((832, 480), (480, 832), (624, 624))])
STILL = VIDEO_SET.frames == 1  # (k,) bucket ids of stills


def mixed_rows(n: int, seed: int, still_share: float = 0.4) -> tuple[np.ndarray, np.ndarray]:
    """``(bucket ids, is_clip)`` of ``n`` rows: stills and clips of 9-60 frames at random sizes, assigned by the
    BucketSet (as annotation does), ~3 % unreadable (-1)."""
    rng = np.random.default_rng(seed)
    w = rng.integers(200, 2000, n).astype(float)
    h = (w / np.exp(rng.normal(0, 0.5, n))).round()
    clip = rng.random(n) >= still_share
    frames = np.where(clip, rng.integers(9, 61, n), 1)
    ids, _ = VIDEO_SET.assign(w, h, frames)
    ids = ids.astype(np.int64)
    ids[rng.random(n) < 0.03] = -1
    return ids, clip


def _ranks(ids: np.ndarray, batch, world: int, **kw) -> list[BucketBatchSampler]:
    return [BucketBatchSampler(ids, batch, num_replicas=world, rank=r, buckets=VIDEO_SET, log_report=False, **kw)
            for r in range(world)]


def _epoch(samplers: list[BucketBatchSampler], epoch: int) -> list[list[list[int]]]:
    """``[step][rank] -> rows`` of one epoch, each rank read from its own sampler."""
    per_rank = []
    for s in samplers:
        s.set_epoch(epoch)
        per_rank.append(list(s.shard()))
    assert len({len(r) for r in per_rank}) == 1, "ranks yield different numbers of batches"
    return [list(step) for step in zip(*per_rank)]


def _check_steps(steps: list[list[list[int]]], ids: np.ndarray, clip: np.ndarray, sizes: np.ndarray | None) -> None:
    for s, step in enumerate(steps):
        buckets = {int(b) for rows in step for b in ids[rows]}
        assert len(buckets) == 1, f"step {s}: ranks in buckets {buckets}"  # one (W, H, F) bucket on every rank
        b = buckets.pop()
        assert b >= 0
        kinds = {bool(c) for rows in step for c in clip[rows]}
        assert kinds == {not STILL[b]}, f"step {s}: stills and clips mixed"  # never a still beside a clip
        if sizes is not None:
            assert {len(rows) for rows in step} == {int(sizes[b])}, f"step {s}: not the bucket's batch size"


@pytest.mark.filterwarnings("ignore:BucketBatchSampler drops")
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(n=st.integers(80, 600), world=st.integers(1, 4), batch=st.integers(1, 3), seed=st.integers(0, 50),
       epoch=st.integers(0, 3), leftover=st.sampled_from(["drop", "fill"]), per_bucket=st.booleans(),
       cut=st.floats(0, 1), still_share=st.floats(0.1, 0.9))
def test_simulated_ranks_over_stills_and_clips(n, world, batch, seed, epoch, leftover, per_bucket, cut,
                                               still_share) -> None:
    """Every rank's own sampler: equal lengths, one (W, H, F) bucket per step on every rank, stills and clips never
    together, every kept row trained once (drop: at most once), and a resume from any rank's state at a random step
    continues batch for batch."""
    ids, clip = mixed_rows(n, seed, still_share)
    # a token-budget habit: stills in batches of 2 x batch, clips of batch (issue 37: a separate image batch size)
    size = {b: (2 * batch if STILL[b] else batch) for b in range(len(VIDEO_SET))} if per_bucket else batch
    try:
        samplers = _ranks(ids, size, world, seed=seed, leftover=leftover)
    except ValueError as e:  # no bucket holds one global batch: refused by name, before any batch
        assert "global batch" in str(e) or "no bucket" in str(e).lower(), e
        return
    steps = _epoch(samplers, epoch)
    sizes = np.array([size[b] for b in range(len(VIDEO_SET))]) if per_bucket else None
    _check_steps(steps, ids, clip, sizes)
    served = np.array([r for step in steps for rows in step for r in rows], np.int64)
    kept = np.flatnonzero(ids >= 0)
    if leftover == "drop":
        assert np.unique(served).size == served.size and np.isin(served, kept).all()
    else:
        assert set(served.tolist()) == set(kept.tolist()) or not steps
    if not steps:
        return
    k = min(int(cut * len(steps)), len(steps) - 1)
    first = _ranks(ids, size, world, seed=seed, leftover=leftover)
    its = []
    for s in first:
        s.set_epoch(epoch)
        its.append(iter(s.shard()))
        for _ in range(k):
            next(its[-1])
    state = json.loads(json.dumps(first[world - 1].state_dict()))  # any rank's state: the same global position
    resumed = _ranks(ids, size, world, seed=seed, leftover=leftover)
    for s in resumed:
        s.load_state_dict(state)
    rest = [list(step) for step in zip(*[list(s.shard()) for s in resumed])]
    assert rest == steps[k:], f"resume after {k} of {len(steps)} steps differs"


def test_buckets_are_drawn_in_proportion_to_their_batches() -> None:
    """The weighting is the images': P(bucket at a step) = its remaining batches / all remaining batches, for (W, H,
    F) buckets too (first step and middle step over many seeds)."""
    counts = np.array([0, 0, 300, 600, 0, 0, 90, 0, 10, 0, 0, 0])  # rows per bucket of VIDEO_SET
    ids = np.repeat(np.arange(len(VIDEO_SET)), counts)
    nb = counts // 10
    expected = nb / nb.sum()
    firsts, middles = [], []
    for seed in range(800):
        t = plan_epoch(ids, 10, 1, seed=seed, return_buckets=True)[1][:, 0]
        firsts.append(t[0])
        middles.append(t[len(t) // 2])
    for draws in (firsts, middles):
        freq = np.bincount(draws, minlength=len(VIDEO_SET)) / len(draws)
        sd = np.sqrt(expected * (1 - expected) / len(draws))
        assert (np.abs(freq - expected) < 5 * sd + 1e-9).all(), (freq, expected)


def test_elastic_resume_over_frame_buckets() -> None:
    """2 ranks x 6 checkpointed mid-epoch continue as 3 ranks x 4 (the same global batch of 12), batch for batch."""
    ids, clip = mixed_rows(3000, 4)
    two, three = _ranks(ids, 6, 2, seed=8), _ranks(ids, 4, 3, seed=8)
    g2 = np.array(_epoch(two, 1)).reshape(-1, 12)
    np.testing.assert_array_equal(g2, np.array(_epoch(three, 1)).reshape(-1, 12))
    its = []
    for s in two:
        s.set_epoch(1)
        its.append(iter(s.shard()))
        for _ in range(7):
            next(its[-1])
    resumed = _ranks(ids, 4, 3, seed=8)
    for s in resumed:
        s.load_state_dict(two[0].state_dict())
    rest = np.stack([np.array(list(s.shard())) for s in resumed], axis=1).reshape(-1, 12)
    np.testing.assert_array_equal(rest, g2[7:])
    _check_steps([[list(r)] for r in rest], ids, clip, None)


def test_sampler_reads_an_annotated_clip_dataset() -> None:
    """``BucketBatchSampler(ds, ...)`` on a dataset annotated with a clip set takes its (k, 3) table from the stored
    set, and from the bucket_width/height/frames columns when the feature lost it."""
    ids, _ = mixed_rows(400, 1)
    res = VIDEO_SET.resolutions
    safe = np.where(ids >= 0, ids, 0)
    cols = {"bucket": ids.astype(np.int32).tolist()}
    for j, c in enumerate(("bucket_width", "bucket_height", "bucket_frames")):
        cols[c] = [int(v) if b >= 0 else None for v, b in zip(res[safe, j], ids)]
    plain = datasets.Dataset.from_dict(cols, features=datasets.Features(
        {"bucket": datasets.Value("int32"), **{c: datasets.Value("int32") for c in cols if c != "bucket"}}))
    stored = with_stored_buckets(plain, VIDEO_SET)
    for ds in (stored, plain):
        s = BucketBatchSampler(ds, 2, seed=3, log_report=False)
        assert s.resolutions.shape[1] == 3
        for batch in s:
            b = int(ids[batch[0]])
            assert (ids[batch] == b).all() and tuple(s.resolutions[b]) == VIDEO_SET[b]


def _stream_run(stream: BucketedStream, state: dict | None = None, stop_after: int | None = None):
    if state is not None:
        stream.load_state_dict(state)
    out, w = [], stream.num_replicas
    for item in stream:
        out.append([(int(r["key"]), int(r["bucket"])) for r in item])
        if stop_after is not None and len(out) == (stop_after + 1) * w:
            return out, json.loads(json.dumps(stream.state_dict(step=stop_after)))
    return out, None


@pytest.mark.parametrize("world", [1, 2])
def test_streaming_over_frame_buckets_resumes_exactly(world: int) -> None:
    """BucketedStream over (W, H, F) buckets with the counts a clip dataset's card records (``"WxHxF"`` labels):
    every rank serves the scheduled bucket at every step, stills and clips apart, and a mid-epoch resume continues
    exactly."""
    ids, clip = mixed_rows(700, 2)
    rows = np.flatnonzero(ids >= -1)
    ds = datasets.Dataset.from_dict({"key": rows, "bucket": ids}).to_iterable_dataset(num_shards=4)
    per = np.bincount(ids[ids >= 0], minlength=len(VIDEO_SET))
    card = {"counts": {label: int(c) for label, c in zip(VIDEO_SET.labels(), per)}}
    counts = as_counts(card, VIDEO_SET)  # the card's "WxHxF" keys read back in id order
    assert counts.tolist() == per.tolist()
    # the same labels key a batch size per bucket (clips 3, stills 6)
    sizes = BucketBatchSampler(ids, {label: 6 if label.endswith("x1") else 3 for label in VIDEO_SET.labels()},
                               buckets=VIDEO_SET, log_report=False).report().batch_size_per_bucket
    assert {int(b): v for b, v in sizes.items() if per[int(b)]} == {b: 6 if STILL[b] else 3 for b in
                                                                      np.flatnonzero(per)}
    kw = dict(counts=counts, num_replicas=world, seed=4, buffer_size=300, on_overflow="evict", snapshot_every=16)
    stream = BucketedStream(ds, 3, **kw)
    full, _ = _stream_run(stream)
    steps = stream.steps_per_epoch
    assert steps > 10 and len(full) == steps * world
    for s in range(steps):
        step = full[s * world:(s + 1) * world]
        assert {b for item in step for _, b in item} == {int(stream.schedule[s])}
        assert len({bool(clip[k]) for item in step for k, _ in item}) == 1  # stills and clips apart
    for k in (3, steps // 2):
        _, state = _stream_run(BucketedStream(ds, 3, **kw), stop_after=k)
        rest, _ = _stream_run(BucketedStream(ds, 3, **kw), state)
        assert rest == full[k * world:], k
