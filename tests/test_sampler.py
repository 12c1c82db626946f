"""BucketBatchSampler and plan_epoch, single process: all ranks are simulated by building one sampler per rank.

Multi-process runs through torchrun + accelerate are in tests/test_sampler_distributed.py.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_arb import BucketBatchSampler, plan_epoch
from hf_arb.sampling import merge_small_buckets

ROOT = Path(__file__).resolve().parent.parent


def make_ids(n: int = 1000, k: int = 5, seed: int = 0, skip: float = 0.05) -> np.ndarray:
    """Bucket ids with unequal bucket sizes and some -1 rows, shape (n,)."""
    rng = np.random.default_rng(seed)
    p = np.geomspace(1, 0.1, k)
    ids = rng.choice(k, size=n, p=p / p.sum())
    ids[rng.random(n) < skip] = -1
    return ids


def all_ranks(ids, batch_size, world, **kw) -> list[BucketBatchSampler]:
    """One sampler per simulated rank, each built independently as every process would build its own."""
    return [BucketBatchSampler(ids, batch_size, num_replicas=world, rank=r, **kw) for r in range(world)]


def epoch_batches(samplers: list[BucketBatchSampler], epoch: int) -> np.ndarray:
    """Every rank's batches of one epoch, each read from its own sampler's rank view: (steps, world, batch)."""
    out = []
    for s in samplers:
        s.set_epoch(epoch)
        out.append(np.array(list(s.shard()), dtype=np.int64).reshape(-1, s.per_rank_batch_size))
    return np.stack(out, axis=1)


def check_epoch(ids: np.ndarray, plan: np.ndarray, targets: np.ndarray, leftover: str, sync: bool,
                catch_all: int | None = None) -> None:
    """The invariants every epoch must satisfy; plan (steps, world, batch), targets (steps, world)."""
    assert plan.ndim == 3 and plan.shape[0] > 0
    assert (ids[plan] >= 0).all(), "a -1 row was sampled"
    own = ids[plan]  # (steps, world, batch)
    pure = (own == targets[:, :, None]).all(axis=2)  # (steps, world)
    if leftover == "catch_all":
        assert (pure | (targets == catch_all)).all(), "a non catch-all batch mixes buckets"
    else:
        assert pure.all(), "a batch holds rows of another bucket"
    if sync:
        assert (targets == targets[:, :1]).all(), "ranks in different buckets at the same step"
    flat = plan.reshape(-1)
    if leftover in ("drop", "catch_all"):
        assert np.unique(flat).size == flat.size, "a row appears twice in one epoch"
    if leftover == "fill" and sync:
        assert set(np.flatnonzero(ids >= 0).tolist()) <= set(flat.tolist()), "fill must use every row"


# ---------------------------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("leftover", ["drop", "fill", "catch_all"])
@pytest.mark.parametrize("world,batch", [(1, 4), (2, 3), (3, 2), (4, 5)])
def test_sampler_invariants_over_grid(leftover: str, world: int, batch: int) -> None:
    ids = make_ids(900, k=6, seed=world * 10 + batch)
    samplers = all_ranks(ids, batch, world, seed=3, leftover=leftover, catch_all_bucket=0)
    lens = {len(s.shard()) for s in samplers}
    assert len(lens) == 1, "len() differs between ranks"
    assert {len(s) for s in samplers} == {min(lens) * world}, "the global sampler yields world batches per step"
    for epoch in (0, 1):
        got = epoch_batches(samplers, epoch)
        assert got.shape[0] == min(lens) == samplers[0].steps_per_epoch, "len() must equal the batches yielded"
        whole = BucketBatchSampler(ids, batch, num_replicas=world, seed=3, leftover=leftover, catch_all_bucket=0)
        whole.set_epoch(epoch)  # no `rank=`: the global plan, as accelerator.prepare reads it
        assert list(whole) == got.reshape(-1, batch).tolist(), "global order is step-major, rank-minor"
        targets = np.stack([s.batch_buckets(epoch) for s in samplers], axis=1)
        check_epoch(ids, got, targets, leftover, sync=True, catch_all=0)
        ref, ref_t = plan_epoch(ids, batch, world, seed=3, epoch=epoch, leftover=leftover, catch_all_bucket=0,
                                return_buckets=True)
        np.testing.assert_array_equal(got, ref)  # the class yields exactly the pure plan
        np.testing.assert_array_equal(targets, ref_t)


@pytest.mark.parametrize("leftover", ["drop", "fill", "catch_all"])
def test_independent_draws_mode(leftover: str) -> None:
    ids = make_ids(1200, k=5, seed=1)
    plan, targets = plan_epoch(ids, 4, 3, seed=0, sync_buckets=False, leftover=leftover, catch_all_bucket=0,
                               return_buckets=True)
    check_epoch(ids, plan, targets, leftover, sync=False, catch_all=0)
    assert (targets != targets[:, :1]).any(), "independent draws should put ranks in different buckets"
    samplers = all_ranks(ids, 4, 3, seed=0, sync_buckets=False, leftover=leftover, catch_all_bucket=0)
    np.testing.assert_array_equal(epoch_batches(samplers, 0), plan)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.lists(st.integers(-1, 7), min_size=1, max_size=400),
    batch=st.integers(1, 6),
    world=st.integers(1, 5),
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 50),
    leftover=st.sampled_from(["drop", "fill", "catch_all"]),
    sync=st.booleans(),
)
def test_plan_invariants_hypothesis(data, batch, world, seed, epoch, leftover, sync) -> None:
    ids = np.array(data)
    kw = dict(seed=seed, epoch=epoch, leftover=leftover, catch_all_bucket=0, sync_buckets=sync, return_buckets=True)
    plan, targets = plan_epoch(ids, batch, world, **kw)
    assert plan.dtype == np.int64 and plan.shape[1:] == (world, batch) and targets.shape == plan.shape[:2]
    if plan.shape[0] == 0:
        return
    check_epoch(ids, plan, targets, leftover, sync, catch_all=0)
    if sync:
        counts = np.bincount(ids[ids >= 0], minlength=8)
        G = world * batch
        if leftover == "drop":
            assert plan.shape[0] == int((counts // G).sum())
        elif leftover == "fill":
            assert plan.shape[0] == int((-(-counts // G)).sum())
        else:
            assert plan.shape[0] == int((counts // G).sum() + (counts % G).sum() // G)
    again = plan_epoch(ids, batch, world, **kw)[0]
    np.testing.assert_array_equal(plan, again)


# ---------------------------------------------------------------------------------------------- weighting


def test_first_bucket_drawn_in_proportion_to_batches() -> None:
    """P(bucket at step s) = remaining batches of the bucket / remaining batches, at every step: check the
    first step and a middle step over many seeds against the batch proportions."""
    counts = np.array([600, 300, 90, 10])
    ids = np.repeat(np.arange(4), counts)
    G = 10
    nb = counts // G  # (4,) global batches per bucket = 60, 30, 9, 1
    expected = nb / nb.sum()
    firsts, middles = [], []
    for seed in range(1500):
        t = plan_epoch(ids, G, 1, seed=seed, return_buckets=True)[1][:, 0]
        firsts.append(t[0])
        middles.append(t[len(t) // 2])
    for draws in (firsts, middles):
        freq = np.bincount(draws, minlength=4) / len(draws)
        sd = np.sqrt(expected * (1 - expected) / len(draws))
        assert (np.abs(freq - expected) < 5 * sd + 1e-9).all(), (freq, expected)


def test_buckets_do_not_empty_early() -> None:
    """Weighting by remaining size keeps every bucket's share steady over the epoch (no small-bucket rush)."""
    ids = np.repeat(np.arange(3), [4000, 2000, 400])
    t = plan_epoch(ids, 4, 1, seed=5, return_buckets=True)[1][:, 0]
    halves = np.array_split(t, 2)
    share = [np.bincount(h, minlength=3) / len(h) for h in halves]
    np.testing.assert_allclose(share[0], share[1], atol=0.04)


# ---------------------------------------------------------------------------------------------- determinism


def test_deterministic_across_instances_and_epochs_differ() -> None:
    ids = make_ids(800)
    a = BucketBatchSampler(ids, 4, num_replicas=2, seed=9)
    b = BucketBatchSampler(ids, 4, num_replicas=2, seed=9)
    assert list(a) == list(b)
    p0, p1 = a.plan(0), a.plan(1)
    assert not np.array_equal(p0, p1), "epochs must differ"
    assert set(p0.reshape(-1).tolist()) != set(p1.reshape(-1).tolist()), "drop must drop a different subset"
    assert not np.array_equal(p0, BucketBatchSampler(ids, 4, num_replicas=2, rank=1, seed=10).plan(0))


def test_no_global_rng_read_or_written() -> None:
    import torch

    ids = make_ids(500)
    ref = plan_epoch(ids, 3, 2, seed=1, epoch=4, leftover="catch_all", catch_all_bucket=0)
    for s in (0, 123):
        random.seed(s)
        np.random.seed(s)
        torch.manual_seed(s)
        before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone())
        sampler = BucketBatchSampler(ids, 3, num_replicas=2, seed=1, leftover="catch_all", catch_all_bucket=0)
        sampler.set_epoch(4)
        list(sampler)
        got = plan_epoch(ids, 3, 2, seed=1, epoch=4, leftover="catch_all", catch_all_bucket=0)
        plan_epoch(ids, 3, 2, seed=1, epoch=4, sync_buckets=False)
        np.testing.assert_array_equal(got, ref)
        assert random.getstate() == before[0]
        assert np.array_equal(np.random.get_state()[1], before[1])
        assert torch.equal(torch.get_rng_state(), before[2])


@pytest.mark.slow  # fresh interpreters importing hf_arb (and torch)
def test_deterministic_across_processes_with_different_hash_seeds() -> None:
    code = (
        "import numpy as np, hashlib; from hf_arb import plan_epoch;"
        "ids = np.random.default_rng(0).integers(-1, 6, 3000);"
        "p = plan_epoch(ids, 4, 3, seed=11, epoch=2, leftover='catch_all', catch_all_bucket=2);"
        "print(hashlib.sha256(p.tobytes()).hexdigest())"
    )
    outs = set()
    for hs in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=hs, PYTHONPATH=str(ROOT))
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout.strip())
    assert len(outs) == 1 and len(outs.pop()) == 64


# ---------------------------------------------------------------------------------------------- resume


@pytest.mark.parametrize("sync", [True, False])
@pytest.mark.parametrize("leftover", ["drop", "fill", "catch_all"])
def test_resume_after_every_k(leftover: str, sync: bool) -> None:
    ids = make_ids(300, k=4, seed=2)
    kw = dict(num_replicas=2, rank=1, seed=4, leftover=leftover, catch_all_bucket=1, sync_buckets=sync)
    full = BucketBatchSampler(ids, 3, **kw)
    full.set_epoch(3)
    whole = list(full.shard())
    assert (full.epoch, full.batches_consumed) == (3, len(whole))
    # set_epoch holds: another pass repeats epoch 3 (as DistributedSampler); without set_epoch it moves on
    assert list(full.shard()) == whole and full.epoch == 3
    auto = BucketBatchSampler(ids, 3, **kw)
    assert [list(auto.shard()) for _ in range(2)] == [full.plan(e)[:, 1].tolist() for e in (0, 1)]
    for k in range(len(whole) + 1):
        s = BucketBatchSampler(ids, 3, **kw)
        s.set_epoch(3)
        it = iter(s.shard())
        head = [next(it) for _ in range(k)]
        state = json.loads(json.dumps(s.state_dict()))  # JSON round trip
        fresh = BucketBatchSampler(ids, 3, **kw)
        fresh.load_state_dict(state)
        if k < len(whole):
            assert (fresh.epoch, fresh.batches_consumed) == (3, k)
            assert head + list(fresh.shard()) == whole, f"resume after {k} batches"
        else:  # a state taken after the last batch resumes at the next epoch
            assert (fresh.epoch, fresh.batches_consumed) == (4, 0)
            assert list(fresh.shard()) == [b.tolist() for b in full.plan(4)[:, 1]]


def test_state_is_small_json_and_load_is_o1() -> None:
    ids = make_ids(20000, k=8)
    s = BucketBatchSampler(ids, 4, num_replicas=2, rank=0)
    text = json.dumps(s.state_dict())
    assert len(text) < 600
    fresh = BucketBatchSampler(ids, 4, num_replicas=2, rank=0)
    cached = fresh._layout_cache
    fresh.load_state_dict({**json.loads(text), "epoch": 7, "batches_consumed": 3})
    assert fresh._layout_cache is cached, "load must not plan an epoch"
    assert (fresh.epoch, fresh.batches_consumed) == (7, 3)


@pytest.mark.parametrize("bad, kind, match", [
    (None, TypeError, "got NoneType"),
    ([1, 2], TypeError, "got list"),
    ("not json", ValueError, "not JSON"),
    ('{"format": 1', ValueError, "not JSON"),
    ({"format": 1}, ValueError, "`plan_version`"),
    ({"epoch": 0}, ValueError, "`format`"),
])
def test_load_state_dict_rejects_what_is_not_a_state(bad, kind, match) -> None:
    s = BucketBatchSampler(make_ids(200), 4, num_replicas=1)
    with pytest.raises(kind, match=match):
        s.load_state_dict(bad)
    state = s.state_dict()
    with pytest.raises(ValueError, match="`options`"):
        s.load_state_dict({**state, "options": None})
    with pytest.raises(ValueError, match="`batches_consumed`.*corrupt"):
        s.load_state_dict({**state, "batches_consumed": 10**6})
    with pytest.raises(ValueError, match="`epoch`"):
        s.load_state_dict({**state, "epoch": -1})
    s.load_state_dict(json.dumps(state))  # the JSON text of a state is fine


def test_load_rejects_mismatch_naming_the_field() -> None:
    ids = make_ids(500)
    s = BucketBatchSampler(ids, 4, num_replicas=2, rank=0, seed=1)
    state = s.state_dict()
    other = ids.copy()
    other[np.flatnonzero(other >= 0)[0]] = (other[np.flatnonzero(other >= 0)[0]] + 1) % 5
    cases = [
        (BucketBatchSampler(other, 4, num_replicas=2, rank=0, seed=1), "fingerprint"),
        (BucketBatchSampler(ids, 4, num_replicas=2, rank=0, seed=2), "seed"),
        (BucketBatchSampler(ids, 5, num_replicas=2, rank=0, seed=1), "global_batch_size"),
        (BucketBatchSampler(ids, 4, num_replicas=2, rank=0, seed=1, leftover="fill"), "options.leftover"),
    ]
    with pytest.raises(ValueError, match="`plan_version`"):
        s.load_state_dict({**state, "plan_version": 0})
    assert state["plan_version"] == 2
    with pytest.raises(ValueError, match=r"`plan_version` does not match: saved 1, .*set_epoch"):
        s.load_state_dict({**state, "plan_version": 1})  # a state of the materialising plan (hf_arb <= issue 10)
    for sampler, field in cases:
        with pytest.raises(ValueError, match=f"`{field}`"):
            sampler.load_state_dict(state)


def test_elastic_resume_same_global_batch() -> None:
    """2 ranks × batch 6 checkpointed at step k continue as 3 ranks × batch 4 with the same global sequence."""
    ids = make_ids(2000, k=5, seed=3)
    two = all_ranks(ids, 6, 2, seed=8)
    three = all_ranks(ids, 4, 3, seed=8)
    g2 = epoch_batches(two, 1).reshape(-1, 12)  # (steps, global batch)
    g3 = epoch_batches(three, 1).reshape(-1, 12)
    np.testing.assert_array_equal(g2, g3)
    for s in two:
        s.set_epoch(1)
    k = 5
    its = [iter(s.shard()) for s in two]
    for it in its:
        for _ in range(k):
            next(it)
    state = two[0].state_dict()
    resumed = all_ranks(ids, 4, 3, seed=8)
    for s in resumed:
        s.load_state_dict(state)
    rest = np.stack([np.array(list(s.shard())) for s in resumed], axis=1).reshape(-1, 12)
    np.testing.assert_array_equal(rest, g2[k:])
    with pytest.raises(ValueError, match="global_batch_size"):
        all_ranks(ids, 4, 2, seed=8)[0].load_state_dict(state)
    indep = BucketBatchSampler(ids, 6, num_replicas=2, rank=0, seed=8, sync_buckets=False)
    with pytest.raises(ValueError, match="batch_size"):
        BucketBatchSampler(ids, 4, num_replicas=3, rank=0, seed=8, sync_buckets=False).load_state_dict(
            indep.state_dict())


def test_set_epoch_semantics() -> None:
    ids = make_ids(400)
    s = BucketBatchSampler(ids, 4, num_replicas=1, rank=0)
    it = iter(s)
    next(it), next(it)
    assert s.batches_consumed == 2
    s.set_epoch(0)  # set_epoch always starts the epoch afresh (as accelerate calls it before every pass)
    assert (s.epoch, s.batches_consumed) == (0, 0)
    s.set_epoch(1)
    assert (s.epoch, s.batches_consumed, len(s)) == (1, 0, s.steps_per_epoch)
    assert [b for b in s] == s.plan(1)[:, 0].tolist()
    # after a restore, a set_epoch for another epoch (a loop that forgot loader.set_epoch) is pointed out
    s.load_state_dict({**s.state_dict(), "epoch": 3, "batches_consumed": 2})
    with pytest.warns(UserWarning, match="restored at epoch 3"):
        s.set_epoch(0)
    s.load_state_dict({**s.state_dict(), "epoch": 3, "batches_consumed": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.set_epoch(3)
    assert list(s) == s.plan(3)[:, 0].tolist()
    assert s.locate(0) == (0, 0) and s.locate(s.steps_per_epoch * 2 + 5) == (2, 5)


# ---------------------------------------------------------------------------------------------- leftovers, report


def test_report_counts_and_log_line(caplog: pytest.LogCaptureFixture) -> None:
    ids = make_ids(1000, k=5, seed=4)
    assigned = int((ids >= 0).sum())
    for leftover in ("drop", "fill", "catch_all"):
        s = BucketBatchSampler(ids, 4, num_replicas=2, leftover=leftover, catch_all_bucket=0)
        rep = s.report()
        plan = s.plan()
        distinct = np.unique(plan).size
        assert rep.rows_used == distinct
        assert rep.rows_dropped == assigned - distinct
        assert rep.rows_repeated == plan.size - distinct
        assert rep.rows_unassigned == int((ids < 0).sum())
        assert rep.steps == s.steps_per_epoch == len(s) // 2 == plan.shape[0]
        assert sum(rep.batches_per_bucket.values()) == plan.shape[0]
        assert json.loads(json.dumps(rep.to_dict()))["rows_used"] == distinct
        if leftover == "catch_all":
            counts = np.bincount(ids[ids >= 0])
            pool = int((counts % 8).sum())
            assert rep.rows_catch_all == pool // 8 * 8 > 0
        else:
            assert rep.rows_catch_all == 0
        with caplog.at_level("INFO", logger="hf_arb.sampling.sampler"):
            next(iter(s))
        assert "dropped" in caplog.text
        caplog.clear()


def test_catch_all_batches_are_served_at_the_base_bucket() -> None:
    ids = np.repeat(np.arange(4), [13, 7, 9, 30])
    res = np.array([[512, 512], [384, 896], [896, 384], [704, 512]])
    s = BucketBatchSampler(ids, 2, num_replicas=2, rank=0, leftover="catch_all", buckets=res, return_keys=True)
    assert s.catch_all_bucket == 0  # the square bucket by default
    plan, targets = s.plan(), s.batch_buckets()
    mixed = ~(ids[plan] == targets[:, None, None]).all(axis=(1, 2))
    assert mixed.any() and (targets[mixed] == 0).all()
    for batch, t in zip(s.shard(), targets.tolist()):
        assert all(isinstance(x, int) for key in batch for x in key)
        assert {key[1] for key in batch} == {t} and {key[2] for key in batch} == {0}
    pool = int((np.array([13, 7, 9, 30]) % 4).sum())  # leftovers of each bucket: 1 + 3 + 1 + 2 = 7
    assert s.report().rows_catch_all == pool // 4 * 4 == 4
    assert s.report().rows_dropped == pool % 4


def test_merge_small_buckets_into_nearest_log_aspect() -> None:
    res = np.array([[512, 512], [448, 576], [832, 448], [1024, 256], [256, 1024]])  # aspects 1, .78, 1.86, 4, .25
    counts = np.array([100, 3, 80, 2, 1])
    m = merge_small_buckets(counts, res[:, 0] / res[:, 1], 8)
    assert m.tolist() == [0, 0, 2, 2, 0]
    ids = np.repeat(np.arange(5), counts)
    s = BucketBatchSampler(ids, 4, num_replicas=2, rank=0, merge_small=True, buckets=res, leftover="fill")
    assert s.report().rows_merged == 6
    plan, targets = s.plan(), s.batch_buckets()  # (steps, 2, 4), (steps,)
    assert set(targets.tolist()) == {0, 2}
    served_at = np.full(ids.size, -1)
    served_at[plan.reshape(len(targets), -1)] = np.repeat(targets, 8).reshape(len(targets), 8)
    assert (served_at == m[ids]).all(), "every row is served at its (merged) bucket"
    with pytest.raises(ValueError, match="resolutions"):
        BucketBatchSampler(ids, 4, num_replicas=1, rank=0, merge_small=True)


def test_warns_when_more_than_10_percent_dropped() -> None:
    ids = np.repeat(np.arange(3), [20, 15, 15])
    with pytest.warns(UserWarning, match="10%"):
        BucketBatchSampler(ids, 4, num_replicas=2, rank=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        BucketBatchSampler(ids, 4, num_replicas=2, rank=0, leftover="fill")


# ---------------------------------------------------------------------------------------------- edge cases


def test_edge_cases() -> None:
    one = np.zeros(17, dtype=int)
    s = BucketBatchSampler(one, 4, num_replicas=1, rank=0)
    assert len(s) == 4 and all(len(b) == 4 for b in s)
    with pytest.raises(ValueError, match="multiple of num_replicas"):
        BucketBatchSampler(one, 3, num_replicas=2, split_batches=True)
    with pytest.raises(ValueError, match="contradicts"):
        BucketBatchSampler(one, 4, True, leftover="fill", num_replicas=1)
    # world larger than a bucket: bucket 1 (3 rows) cannot fill a global batch of 8
    ids = np.array([0] * 40 + [1] * 3)
    d = all_ranks(ids, 2, 4)
    assert 1 not in d[0].batch_buckets().tolist() and d[0].report().rows_dropped == 3 + 40 % 8
    f = all_ranks(ids, 2, 4, leftover="fill")
    got = epoch_batches(f, 0)
    assert set(np.flatnonzero(ids == 1).tolist()) <= set(got.reshape(-1).tolist())
    with pytest.raises(ValueError, match="No row has a bucket"):
        BucketBatchSampler([], 2, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="No row has a bucket"):
        BucketBatchSampler([-1, -1], 2, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="zero batches.*leftover=\"fill\".*merge_small"):
        BucketBatchSampler([0, 0, 1, 1], 2, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="rank"):
        BucketBatchSampler([0, 0], 1, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match=">= -1"):
        BucketBatchSampler([0, -2], 1, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="1-D"):
        plan_epoch([[0, 1]], 1)


def test_defaults_world_one_and_unshuffled() -> None:
    s = BucketBatchSampler([0, 0, 1, 1, 0, 0], 2, shuffle=False)
    assert (s.num_replicas, s.rank) == (1, 0)
    assert list(s) == [[0, 1], [4, 5], [2, 3]]


def test_dataset_input_reads_bucket_and_resolution_columns() -> None:
    datasets = pytest.importorskip("datasets")
    ids = np.array([0, 1, 1, -1, 0, 0, 1, 0])
    ds = datasets.Dataset.from_dict({
        "bucket": ids.astype(np.int32),
        "bucket_width": np.where(ids == 1, 384, 512).astype(np.int32),
        "bucket_height": np.where(ids == 1, 896, 512).astype(np.int32),
    })
    s = BucketBatchSampler(ds, 1, num_replicas=1, rank=0, leftover="catch_all")
    assert s.resolutions.tolist() == [[512, 512], [384, 896]] and s.catch_all_bucket == 0
    assert sorted(r for b in s for r in b) == np.flatnonzero(ids >= 0).tolist()
    sub = ds.select([7, 6, 5])  # indices mapping: rows of the view, not of the table
    assert BucketBatchSampler(sub, 1, num_replicas=1, rank=0, shuffle=False).batch_buckets().tolist() == [0, 0, 1]
    with pytest.raises(ValueError, match="add_bucket_columns"):
        BucketBatchSampler(datasets.Dataset.from_dict({"x": [1]}), 1)
    with pytest.raises(TypeError, match=r"splits \['train'\]; pick one: ds\['train'\]"):
        BucketBatchSampler(datasets.DatasetDict({"train": ds}), 1)


def test_diffusers_dreambooth_call_works() -> None:
    """diffusers' `BucketBatchSampler(dataset, batch_size, drop_last=...)` call, positionally."""
    ids = np.repeat([0, 1, 2], [10, 7, 5])
    keep = BucketBatchSampler(ids, 4, False, num_replicas=1)  # drop_last=False: every row, full batches
    rows = [r for b in keep for r in b]
    assert set(rows) == set(range(ids.size)) and all(len(set(ids[b])) == 1 for b in keep)
    with pytest.warns(UserWarning, match=r"drops 6 of 22 assigned rows \(27.3% > 10%\)"):  # said, not silent
        drop = BucketBatchSampler(ids, 4, drop_last=True, num_replicas=1)
    assert drop.leftover == "drop" and drop.report().rows_dropped == 2 + 3 + 1


def test_reads_the_bucket_set_of_an_annotated_dataset() -> None:
    """add_bucket_columns stores the BucketSet in the dataset: catch-all and merging find resolutions there."""
    datasets = pytest.importorskip("datasets")
    from hf_arb import BucketSet, add_bucket_columns

    rng = np.random.default_rng(0)
    ds = datasets.Dataset.from_dict({"w": rng.integers(300, 2000, 300), "h": rng.integers(300, 2000, 300)})
    ds = add_bucket_columns(ds, BucketSet.novelai(), image_column=None, width_column="w", height_column="h")
    s = BucketBatchSampler(ds, 2, num_replicas=1, rank=0, leftover="catch_all")
    np.testing.assert_array_equal(s.resolutions, BucketSet.novelai().resolutions)
    assert s.resolutions[s.catch_all_bucket].tolist() == [512, 512]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        merged = BucketBatchSampler(ds, 4, num_replicas=2, rank=0, merge_small=True)
    assert merged.report().rows_merged > 0
    assert set(merged.batch_buckets().tolist()) <= set(np.flatnonzero(np.bincount(ds["bucket"]) >= 8).tolist())


# ---------------------------------------------------------------------------------------------- loaders


def _loader(ids: np.ndarray, sampler: BucketBatchSampler, **kw):
    import torch
    from torch.utils.data import DataLoader

    return DataLoader(torch.arange(len(ids)), batch_sampler=sampler, **kw)


def test_stateful_dataloader_with_workers_resumes_exactly() -> None:
    """torchdata's StatefulDataLoader reads the sampler's state_dict in step with the batches it returns, so a
    loader with workers reading ahead still resumes at the next batch the loop has not seen."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    ids = make_ids(400, seed=6)
    s = BucketBatchSampler(ids, 4, num_replicas=1, seed=2)
    dl = StatefulDataLoader(torch.arange(len(ids)), batch_sampler=s, num_workers=2)
    it = iter(dl)
    head = [next(it).tolist() for _ in range(5)]
    state = json.loads(json.dumps(dl.state_dict(), default=int))
    rest = [b.tolist() for b in it]
    assert head + rest == s.plan(0)[:, 0].tolist()
    fresh = BucketBatchSampler(ids, 4, num_replicas=1, seed=2)
    dl2 = StatefulDataLoader(torch.arange(len(ids)), batch_sampler=fresh, num_workers=2)
    dl2.load_state_dict(state)
    assert [b.tolist() for b in dl2] == rest


@pytest.mark.parametrize("stateful", [False, True])
def test_accelerate_single_process_save_load_state(tmp_path: Path, stateful: bool) -> None:
    """Plain accelerator.prepare; resume through save_state/load_state and the loop's step counter."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    from hf_arb import resume_dataloader

    ids = make_ids(300, seed=8)
    cfg = DataLoaderConfiguration(use_stateful_dataloader=stateful)
    acc = Accelerator(cpu=True, dataloader_config=cfg)
    s = BucketBatchSampler(ids, 3, seed=1)
    dl = acc.prepare(_loader(ids, s, num_workers=1))
    acc.register_for_checkpointing(s)
    assert len(dl) == s.steps_per_epoch
    assert [b.tolist() for b in dl] == s.plan(0)[:, 0].tolist()
    it = iter(dl)  # accelerate's second pass: epoch 1
    head = [next(it).tolist() for _ in range(4)]
    acc.save_state(str(tmp_path))
    rest = [b.tolist() for b in it]
    assert head + rest == s.plan(1)[:, 0].tolist()
    steps_done = s.steps_per_epoch + 4  # the loop's own counter, saved with the checkpoint
    acc2 = Accelerator(cpu=True, dataloader_config=cfg)
    s2 = BucketBatchSampler(ids, 3, seed=1)
    dl2 = acc2.prepare(_loader(ids, s2, num_workers=1))
    acc2.register_for_checkpointing(s2)
    acc2.load_state(str(tmp_path))
    if stateful:  # the loader restores its own position; the loop only sets the epoch
        dl2.set_epoch(1)
        first = dl2
    else:
        first, epoch = resume_dataloader(acc2, dl2, steps_done)
        assert epoch == 1
    assert [b.tolist() for b in first] == rest
    assert [b.tolist() for b in dl2] == s.plan(2)[:, 0].tolist()


def test_sampler_built_for_another_world_is_refused(tmp_path: Path) -> None:
    """A sampler whose num_replicas differs from the running process group would lose bucket sync. In this process
    (a one-process gloo group, destroyed after; no process group is left from other tests): torch.distributed's state
    is what the sampler reads, not anything of a fresh interpreter's."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError) as err:
            next(iter(BucketBatchSampler(np.zeros(8, int), 2, num_replicas=2)))
    finally:
        dist.destroy_process_group()
    assert "num_replicas=2, but torch.distributed runs 1 processes" in str(err.value)
    assert "num_replicas=accelerator.num_processes" in str(err.value)


# ------------------------------------------------------------------------------------------ counter-based plan


@pytest.mark.parametrize("n", [0, 1, 2, 10, 255, 256, 257, 1000, 70_001])
def test_feistel_is_a_deterministic_bijection(n: int) -> None:
    from hf_arb.sampling.planning.feistel import FeistelPermutation

    p = FeistelPermutation(n, (3, 2, 1, 7))
    y = p(np.arange(n))
    assert y.dtype == np.int64
    np.testing.assert_array_equal(np.sort(y), np.arange(n))  # a permutation of [0, n)
    np.testing.assert_array_equal(FeistelPermutation(n, (3, 2, 1, 7))(np.arange(n)), y)  # a pure function of its key
    if n >= 10:
        assert not np.array_equal(FeistelPermutation(n, (3, 2, 1, 8))(np.arange(n)), y), "keys must matter"
        assert (y != np.arange(n)).mean() > 0.5
        perm = np.random.default_rng(n).permutation(n)[: min(n, 50)]
        np.testing.assert_array_equal(p(perm.reshape(-1, 1)).ravel(), y[perm])  # any positions, any shape
    np.testing.assert_array_equal(FeistelPermutation(n, (3,), shuffle=False)(np.arange(n)), np.arange(n))


def test_feistel_small_table_equals_cycle_walking(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small domains are tabulated once; the table is the same permutation as walking by re-encryption."""
    from hf_arb.sampling.planning.feistel import FeistelPermutation

    tabulated = FeistelPermutation(1000, (4, 5))(np.arange(1000))
    monkeypatch.setattr("hf_arb.sampling.planning.feistel._TABLE_MAX", 0)
    np.testing.assert_array_equal(FeistelPermutation(1000, (4, 5))(np.arange(1000)), tabulated)


def test_feistel_beyond_32_bits() -> None:
    """Domains past 2^32 (a bucket of 10^10 rows) use 64-bit arithmetic and stay inside and injective."""
    from hf_arb.sampling.planning.feistel import FeistelPermutation

    n = 3 * 2**33 + 5
    x = np.concatenate([np.arange(20_000), n - 1 - np.arange(20_000)])
    y = FeistelPermutation(n, (0, 1))(x)
    assert y.min() >= 0 and y.max() < n and np.unique(y).size == x.size
    assert y.max() > 2**32, "images must spread over the whole domain"


@pytest.mark.parametrize("n", [10, 37])
def test_feistel_positions_are_uniform_over_keys(n: int) -> None:
    """Over many keys every value lands at every position equally often (χ²/dof ≈ 1, within 5 sd) and a pair
    keeps its order half the time: the statistics of a uniform shuffle."""
    from hf_arb.sampling.planning.feistel import FeistelPermutation

    keys = 3000
    hits = np.zeros((n, n))
    before = 0
    for e in range(keys):
        y = FeistelPermutation(n, (0, e, 1, 0))(np.arange(n))
        hits[y, np.arange(n)] += 1
        before += int(y[0] < y[n - 1])
    expected = keys / n
    dof = (n - 1) ** 2
    chi_per_dof = float(((hits - expected) ** 2 / expected).sum()) / dof
    assert abs(chi_per_dof - 1) < 5 * np.sqrt(2 / dof), chi_per_dof
    assert abs(before / keys - 0.5) < 5 * np.sqrt(0.25 / keys)


def test_row_index_recovers_high_bits_of_row_ids() -> None:
    """The index keeps only the low bits of a row id; the high bits come from per-block counts. With 3 low bits
    (blocks of 8 rows) every row id >= 8 exercises it; the plan is the same as with 32 bits."""
    from hf_arb.sampling.planning.index import build_index, count_blocks
    from hf_arb.sampling.planning.sync import SyncLayout

    ids = make_ids(500, k=4, seed=12)
    mm = np.array([0, 1, 1, 3])  # bucket 2 merged into 1
    eff = np.where(ids >= 0, mm[np.maximum(ids, 0)], -1)
    narrow = build_index(ids, mm, 4, count_blocks(ids, 4, low_bits=3), low_bits=3)
    wide = build_index(ids, mm, 4)
    assert narrow.block_ends is not None and wide.block_ends is None
    for b in range(4):
        members = np.flatnonzero(eff == b)
        np.testing.assert_array_equal(narrow.rows(b, np.arange(members.size)), members)
        np.testing.assert_array_equal(wide.rows(b, np.arange(members.size)), members)
    for leftover in ("drop", "fill", "catch_all"):
        a, c = (SyncLayout(ix, 2, 3, 5, 1, True, leftover, 0) for ix in (narrow, wide))
        np.testing.assert_array_equal(a.rows(0, a.num_steps), c.rows(0, c.num_steps))


def test_epoch_state_is_o_buckets_at_web_scale() -> None:
    """A layout over 10^10 rows (a stand-in index: only counts) is built, located and reported in closed form;
    its last step's positions come straight from the permutations, nothing of size n is allocated."""
    import tracemalloc

    from hf_arb.sampling.planning.index import RowIndex
    from hf_arb.sampling.planning.sync import SyncLayout

    count = np.array([6 * 10**9, 3 * 10**9 + 17, 10**9 + 5], dtype=np.int64)
    index = RowIndex(low=np.empty(0, np.uint32), start=np.concatenate([[0], np.cumsum(count)[:-1]]), count=count,
                     block_ends=None)
    tracemalloc.start()
    lay = SyncLayout(index, 8, 8, 0, 3, True, "catch_all", 0)
    last = lay.step_targets(lay.num_steps - 1, lay.num_steps)
    seg, loc = lay._segments(lay.num_steps - 1, lay.num_steps)
    b = int(seg[0])
    p = (loc[:, None] * 64 + np.arange(64)).ravel()
    q = lay._pool_rows(p) if b == lay.k else lay._perm(b)(p)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1_000_000, peak
    assert lay.num_steps == int((count // 64).sum() + (count % 64).sum() // 64)
    assert last.shape == (1, 8) and (last == last[0, 0]).all()
    assert np.unique(q).size == 64 and q.max() >= 2**32 or b == lay.k
    assert sum(lay.batches_per_target().values()) == lay.num_steps
    assert lay.usage()[2] == (count % 64).sum() // 64 * 64


def test_index_file_is_built_once_and_mapped(tmp_path: Path) -> None:
    """With index_dir the grouped rows go to one .npy file that later samplers (every rank of a node) map
    read-only; a damaged file is rebuilt; the plan is the same as with the in-memory index."""
    ids = make_ids(3000, k=5, seed=13).astype(np.int8)
    ref = BucketBatchSampler(ids, 4, num_replicas=2, seed=1, leftover="catch_all", catch_all_bucket=0)
    a = BucketBatchSampler(ids, 4, num_replicas=2, seed=1, leftover="catch_all", catch_all_bucket=0,
                           index_dir=tmp_path)
    files = list(tmp_path.glob("*.npy"))
    assert len(files) == 1 and files[0].stat().st_size < 4 * ids.size + 256  # <= 4 bytes per row
    mtime = files[0].stat().st_mtime_ns
    b = BucketBatchSampler(ids, 4, num_replicas=2, seed=1, leftover="catch_all", catch_all_bucket=0,
                           index_dir=tmp_path)
    assert isinstance(b._plan.index.low, np.memmap) and not b._plan.index.low.flags.writeable
    assert files[0].stat().st_mtime_ns == mtime, "an existing index must be mapped, not rebuilt"
    np.testing.assert_array_equal(a.plan(2), ref.plan(2))
    np.testing.assert_array_equal(b.plan(2), ref.plan(2))
    np.save(files[0], np.zeros(5, np.uint32))  # wrong size: rebuilt
    c = BucketBatchSampler(ids, 4, num_replicas=2, seed=1, leftover="catch_all", catch_all_bucket=0,
                           index_dir=tmp_path)
    np.testing.assert_array_equal(c.plan(2), ref.plan(2))
    assert list(tmp_path.glob("*.tmp")) == []


def test_construction_memory_does_not_grow_with_rows(tmp_path: Path) -> None:
    """Besides the shared index file, building a sampler reads the ids in chunks: its peak Python-heap memory
    (tracemalloc) stays far below a per-row copy of the ids, and resuming plans nothing of size n."""
    import tracemalloc

    peaks = []
    for n in (1_000_000, 4_000_000):
        ids = np.random.default_rng(0).integers(-1, 19, n).astype(np.int8)
        tracemalloc.start()
        s = BucketBatchSampler(ids, 8, num_replicas=8, seed=0, leftover="catch_all", catch_all_bucket=0,
                               index_dir=tmp_path, log_report=False)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.reset_peak()
        s.load_state_dict({**s.state_dict(), "epoch": 3, "batches_consumed": s.steps_per_epoch - 2})
        first = next(iter(s))
        resume_peak = tracemalloc.get_traced_memory()[1] - tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        assert resume_peak < 200_000, resume_peak
    assert peaks[1] < 1.3 * peaks[0] + 1e6, f"peak grows with rows: {peaks}"
    assert peaks[1] < 4 * 4_000_000, f"{peaks[1] / 1e6:.1f} MB: as much as an int32 copy of the ids"
    assert len(first) == 8


def test_sampler_resumes_anywhere_and_matches_the_plan() -> None:
    ids = make_ids(600, k=4, seed=9)
    for leftover in ("drop", "fill", "catch_all"):
        kw = dict(seed=2, leftover=leftover, catch_all_bucket=0)
        ref, ref_t = plan_epoch(ids, 3, 2, epoch=1, return_buckets=True, **kw)
        check_epoch(ids, ref, ref_t, leftover, sync=True, catch_all=0)
        for k in (0, 1, 7, len(ref) // 2, len(ref) - 1):
            s = BucketBatchSampler(ids, 3, num_replicas=2, rank=1, **kw)
            s.load_state_dict({**s.state_dict(), "epoch": 1, "batches_consumed": k})
            assert list(s.shard()) == ref[k:, 1].tolist(), (leftover, k)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("even_batches", [True, False])
def test_accelerate_batch_sampler_shard_deals_each_rank_its_planned_batches(world: int, even_batches: bool) -> None:
    """accelerate's own BatchSamplerShard (what accelerator.prepare wraps a batch sampler in) over the global
    plan: rank r receives exactly plan[:, r], in both even_batches modes and with split_batches."""
    from accelerate.data_loader import BatchSamplerShard

    ids = make_ids(700, seed=10)
    for leftover in ("drop", "fill", "catch_all"):
        s = BucketBatchSampler(ids, 3, num_replicas=world, seed=5, leftover=leftover, catch_all_bucket=0)
        plan = s.plan()  # (steps, world, 3)
        for r in range(world):
            shard = BatchSamplerShard(s, num_processes=world, process_index=r, even_batches=even_batches)
            assert len(shard) == s.steps_per_epoch
            s.set_epoch(0)  # what the prepared loader does before every pass
            assert list(shard) == plan[:, r].tolist(), (leftover, r)
        split = BucketBatchSampler(ids, 3 * world, num_replicas=world, seed=5, leftover=leftover,
                                   catch_all_bucket=0, split_batches=True)
        np.testing.assert_array_equal(split.plan(), plan)  # same plan, yielded as one global batch per step
        for r in range(world):
            shard = BatchSamplerShard(split, num_processes=world, process_index=r, split_batches=True,
                                      even_batches=even_batches)
            split.set_epoch(0)
            assert len(shard) == split.steps_per_epoch and list(shard) == plan[:, r].tolist()


def test_deepspeed_auto_micro_batch_is_filled_from_the_sampler() -> None:
    """DeepSpeed reads DataLoader.batch_size (None with a batch sampler): an "auto" micro batch gets the
    sampler's per-rank batch, a number set by the user is kept. (DeepSpeed itself is not installed here.)"""
    from types import SimpleNamespace

    from hf_arb.sampling.accelerate import fill_deepspeed_micro_batch

    class Plugin:
        def __init__(self, value):
            self.deepspeed_config = {"train_micro_batch_size_per_gpu": value}

        def is_auto(self, key):
            return self.deepspeed_config[key] == "auto"

    with pytest.warns(UserWarning, match="drops 38 of 290 assigned rows"):
        s = BucketBatchSampler(make_ids(300), 12, num_replicas=3, split_batches=True)
    for value, expected in (("auto", 4), (7, 7)):
        acc = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=Plugin(value)))
        fill_deepspeed_micro_batch(acc, s)
        assert acc.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == expected
    fill_deepspeed_micro_batch(SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=None)), s)  # no DeepSpeed


def test_warns_when_fill_repeats_more_than_half_the_rows() -> None:
    """issue 34: `--bucket_leftover fill` at batch 64 on 39 rows in 10 buckets repeated 601 rows in silence (drop
    warns): the warning gives the count and the remedies; a few copies completing the last batches stay silent."""
    ids = np.repeat(np.arange(10), [4] * 9 + [3])  # 39 rows in 10 buckets
    with pytest.warns(UserWarning, match=r"repeats 601 rows per epoch \(39 assigned rows, 1541% > 50%\)") as w:
        s = BucketBatchSampler(ids, 64, num_replicas=1, rank=0, leftover="fill")
    assert s.report().rows_repeated == 601 and 'leftover="drop"' in str(w[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        BucketBatchSampler(np.repeat(np.arange(3), [20, 15, 15]), 4, num_replicas=2, rank=0, leftover="fill")
    from hf_arb.flag_parser import in_flags
    from hf_arb.train.data import SAMPLER_FLAG_NAMES

    said = in_flags(str(w[0].message), SAMPLER_FLAG_NAMES)  # what the training script logs
    assert said.startswith("The epoch plan repeats 601 rows") and "`" not in said, said
    assert "with --bucket_leftover fill" in said and "--bucket_leftover drop (or catch_all)" in said, said
