"""A batch size per bucket (a pixel budget or a mapping): the pure functions, the ragged plan and the sampler, all
ranks simulated in one process (one sampler per rank, as every process builds its own).

The real torchrun run of a variable-batch mode is in tests/test_sampler_distributed.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_arb import BucketBatchSampler, plan_epoch
from hf_arb.sampling.planning.batch_sizes import accumulation_weights, batch_sizes_for_pixels, batch_sizes_from_mapping
from hf_arb.sampling.planning.ragged import plan_epoch_ragged

RES = np.array([(512, 512), (1024, 1024), (768, 512), (512, 768), (1024, 576)])  # (k, 2) as (width, height)
MP = 1024 * 1024


def make_ids(n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = rng.random(k) + 0.05
    ids = rng.choice(k, size=n, p=p / p.sum())
    ids[rng.random(n) < 0.05] = -1
    return ids


def rank_steps(ids, cap, world: int, epoch: int, **kw) -> list[list[list[int]]]:
    """Every simulated rank's batches of one epoch, each read from its own sampler: [rank][step] -> rows."""
    out = []
    for r in range(world):
        s = BucketBatchSampler(ids, cap, num_replicas=world, rank=r, log_report=False, **kw)
        s.set_epoch(epoch)
        out.append([list(b) for b in s.shard()])
    return out


# ------------------------------------------------------------------------------------------ the pure functions
def test_batch_sizes_for_pixels_floor_cap_and_error() -> None:
    assert batch_sizes_for_pixels(RES, 4 * MP).tolist() == [16, 4, 10, 10, 7]
    assert batch_sizes_for_pixels(RES, 4 * MP, max_batch_size=8).tolist() == [8, 4, 8, 8, 7]
    assert batch_sizes_for_pixels(RES, MP).tolist() == [4, 1, 2, 2, 1]  # exactly one 1024² image fits
    with pytest.raises(ValueError, match=r"cannot hold one image of bucket 1 \(1024x1024.*at least 1,048,576"):
        batch_sizes_for_pixels(RES, MP - 1)
    # a bucket nobody needs (no rows) does not stop the budget; it gets a placeholder size
    assert batch_sizes_for_pixels(RES, MP - 1, needed=[1, 0, 1, 1, 1])[1] == 1
    with pytest.raises(ValueError, match="max_pixels_per_batch"):
        batch_sizes_for_pixels(RES, 0)


def test_batch_sizes_from_mapping_labels_ids_and_errors() -> None:
    sizes = batch_sizes_from_mapping({"512x512": 8, 1: 2, "768x512": 4, 3: 4}, 5, resolutions=RES,
                                     needed=[1, 1, 1, 1, 0])
    assert sizes.tolist() == [8, 2, 4, 4, 8]  # bucket 4 (no rows) gets the largest size given
    with pytest.raises(ValueError, match=r"no entry for bucket 4 \(1024x576\)"):
        batch_sizes_from_mapping({0: 8, 1: 2, 2: 4, 3: 4}, 5, resolutions=RES)
    with pytest.raises(ValueError, match="Unknown bucket '9x9'.*'512x512'"):
        batch_sizes_from_mapping({"9x9": 1}, 5, resolutions=RES)
    with pytest.raises(ValueError, match="batch size of bucket 0"):
        batch_sizes_from_mapping({0: 0}, 5)


@given(b=st.lists(st.integers(1, 9), min_size=1, max_size=30), accum=st.integers(1, 5),
       losses=st.lists(st.floats(0, 10), min_size=300, max_size=300))
@settings(max_examples=60, deadline=None)
def test_accumulation_weights_make_every_image_of_a_step_weigh_the_same(b, accum, losses) -> None:
    """accelerate divides each micro-step's loss by A; with the weights, the optimizer step sees the plain mean
    of all its images' losses (also in a short last window)."""
    w = accumulation_weights(b, accum)
    per_image = iter(losses)
    images = [[next(per_image) for _ in range(n)] for n in b]  # each step's per-image losses
    for j in range(0, len(b), accum):
        window = range(j, min(j + accum, len(b)))
        got = sum(w[s] * np.mean(images[s]) / accum for s in window)
        flat = [x for s in window for x in images[s]]
        assert got == pytest.approx(np.mean(flat), rel=1e-9, abs=1e-12)
    if len(set(b)) == 1 and len(b) % accum == 0:
        np.testing.assert_allclose(w, 1.0)  # one batch size, full windows: the plain diffusers loss


def test_ragged_plan_with_one_size_is_the_fixed_plan() -> None:
    ids = make_ids(700, 5, 1)
    for leftover in ("drop", "fill", "catch_all"):
        kw = dict(seed=3, epoch=2, leftover=leftover, catch_all_bucket=0)
        fixed = plan_epoch(ids, 3, 2, **kw)
        ragged = plan_epoch_ragged(ids, [3] * 5, 2, **kw)
        np.testing.assert_array_equal(ragged.rows, fixed.reshape(-1))
        assert (ragged.batch == 3).all() and ragged.offsets[-1] == fixed.size


def test_steps_per_bucket_are_rows_over_its_global_batch() -> None:
    """Weighting by size in rows: bucket b gets floor(n_b / (world × b_b)) steps ("drop")."""
    ids = make_ids(3000, 5, 2)
    sizes = batch_sizes_for_pixels(RES, 2 * MP)  # [8, 2, 5, 5, 3]
    plan = plan_epoch_ragged(ids, sizes, 2, seed=0)
    n = np.bincount(ids[ids >= 0], minlength=5)
    np.testing.assert_array_equal(np.bincount(plan.buckets, minlength=5), n // (2 * sizes))
    # the order is a shuffle of those batches: buckets interleave instead of coming in id order
    assert (np.diff(plan.buckets) != 0).sum() > plan.num_steps // 3


# ------------------------------------------------------------------------------------------ the sampler
@given(data=st.data(), world=st.integers(1, 4), budget=st.sampled_from([MP, 2 * MP, 3 * MP]),
       cap=st.sampled_from([None, 3]), seed=st.integers(0, 2**31), leftover=st.sampled_from(["drop", "fill",
                                                                                             "catch_all"]))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@pytest.mark.filterwarnings("ignore:BucketBatchSampler drops")
def test_all_ranks_same_bucket_and_batch_size_every_row_once_or_reported(data, world, budget, cap, seed,
                                                                         leftover) -> None:
    n = data.draw(st.integers(150, 500))
    ids = make_ids(n, 5, data.draw(st.integers(0, 1000)))
    kw = dict(buckets=RES, max_pixels_per_batch=budget, seed=seed, leftover=leftover)
    ref = BucketBatchSampler(ids, cap, num_replicas=world, log_report=False, **kw)
    sizes = batch_sizes_for_pixels(RES, budget, max_batch_size=cap)
    per_rank = rank_steps(ids, cap, world, 1, **kw)
    steps = {len(r) for r in per_rank}
    assert len(steps) == 1, "ranks have different numbers of steps"
    assert steps.pop() == ref.steps_per_epoch
    report = ref.report(epoch=1)
    seen: list[int] = []
    targets = ref.batch_buckets(epoch=1)  # (steps,)
    for s in range(ref.steps_per_epoch):
        batches = [per_rank[r][s] for r in range(world)]
        bucket = ids[np.array(batches)]  # (world, b): one shape on every rank
        target = int(targets[s])
        if leftover != "catch_all" or target != ref.catch_all_bucket:
            assert (bucket == target).all(), "a batch holds another bucket, or ranks differ"
        assert bucket.shape[1] == sizes[target] == ref.step_batch_sizes(1)[s], "batch size is not the bucket's"
        seen += [x for b in batches for x in b]
    assigned = set(np.flatnonzero(ids >= 0).tolist())
    assert set(seen) <= assigned
    if leftover == "fill":
        assert set(seen) == assigned and len(seen) - len(assigned) == report.rows_repeated
    else:
        assert len(seen) == len(set(seen)), "a row twice in one epoch"
        assert len(seen) == report.rows_used and len(assigned) - len(seen) == report.rows_dropped
    # resume at any step equals the uninterrupted epoch
    k = data.draw(st.integers(0, ref.steps_per_epoch - 1))
    r = data.draw(st.integers(0, world - 1))
    s = BucketBatchSampler(ids, cap, num_replicas=world, rank=r, log_report=False, **kw)
    s.load_state_dict(json.dumps({**ref.state_dict(), "epoch": 1, "batches_consumed": k}))
    assert [list(b) for b in s.shard()] == per_rank[r][k:]


def test_state_locate_and_elastic_resume_with_the_same_global_batches() -> None:
    ids = make_ids(800, 5, 4)
    two = BucketBatchSampler(ids, None, num_replicas=2, rank=0, buckets=RES, max_pixels_per_batch=MP, seed=1)
    assert two.batch_size is None and two.batch_sizes == {0: 4, 1: 1, 2: 2, 3: 2, 4: 1}
    one = BucketBatchSampler(ids, {"512x512": 8, "1024x1024": 2, 2: 4, 3: 4, 4: 2}, num_replicas=1, buckets=RES, seed=1)
    assert two.state_dict()["global_batch_sizes"] == [8, 2, 4, 4, 2] == one.state_dict()["global_batch_sizes"]
    plan = two.plan()
    steps = two.steps_per_epoch
    assert two.locate(steps + 5) == (1, 5)
    one.load_state_dict({**two.state_dict(), "batches_consumed": 5})  # 1 process continues 2 processes' plan
    rest = [list(b) for b in one]
    assert rest == [plan.rows[plan.offsets[s] : plan.offsets[s + 1]].tolist() for s in range(5, steps)]
    other = BucketBatchSampler(ids, None, num_replicas=2, buckets=RES, max_pixels_per_batch=2 * MP, seed=1)
    with pytest.raises(ValueError, match="`global_batch_sizes` does not match.*max_pixels_per_batch"):
        other.load_state_dict(two.state_dict())
    fixed = BucketBatchSampler(ids, 2, num_replicas=2, seed=1)
    assert fixed.state_dict()["global_batch_sizes"] is None
    saved = {k: v for k, v in fixed.state_dict().items() if k != "global_batch_sizes"}  # a state from before
    fixed.load_state_dict(saved)


def test_modes_that_cannot_work_are_refused_and_equal_sizes_are_the_fixed_plan() -> None:
    ids = make_ids(400, 5, 5)
    with pytest.raises(ValueError, match="split_batches"):
        BucketBatchSampler(ids, None, num_replicas=2, buckets=RES, max_pixels_per_batch=MP, split_batches=True)
    with pytest.raises(ValueError, match="sync_buckets=True"):
        BucketBatchSampler(ids, None, num_replicas=2, buckets=RES, max_pixels_per_batch=MP, sync_buckets=False)
    with pytest.raises(ValueError, match="needs the bucket resolutions"):
        BucketBatchSampler(ids, None, max_pixels_per_batch=MP)
    with pytest.raises(ValueError, match=r"cannot hold one image of bucket 1 \(1024x1024"):
        BucketBatchSampler(ids, None, buckets=RES, max_pixels_per_batch=MP // 2)
    with pytest.raises(ValueError, match="zero batches.*its batch size"):
        BucketBatchSampler(ids[:10], {b: 50 for b in range(5)} | {0: 60}, buckets=RES)
    # merge_small compares each bucket with its own global batch: 1 row of 1024² < 2 ranks × 1 → merged into 512²
    small = np.r_[np.zeros(40, int), [1], np.full(30, 2)]
    merged = BucketBatchSampler(small, None, num_replicas=2, buckets=RES, max_pixels_per_batch=MP, merge_small=True)
    assert merged.report().rows_merged == 1 and 1 not in merged.report().batches_per_bucket
    # one size for every bucket (here: a cap below every budget) is the plain fixed-batch sampler
    same = BucketBatchSampler(ids, 2, num_replicas=2, buckets=RES, max_pixels_per_batch=4 * MP, seed=3)
    plain = BucketBatchSampler(ids, 2, num_replicas=2, seed=3)
    assert same.batch_size == 2 and same.batch_sizes is None
    np.testing.assert_array_equal(same.plan(), plain.plan())


@pytest.mark.parametrize("even_batches", [True, False])
def test_accelerate_batch_sampler_shard_deals_variable_batches(even_batches: bool) -> None:
    """accelerate's BatchSamplerShard reads batch_size None as batches of varying length: each rank receives
    exactly its planned batch of every step, in both even_batches modes and both drop_last values."""
    from accelerate.data_loader import BatchSamplerShard

    ids = make_ids(600, 5, 6)
    for leftover in ("drop", "fill"):
        s = BucketBatchSampler(ids, None, num_replicas=3, buckets=RES, max_pixels_per_batch=2 * MP, seed=2,
                               leftover=leftover)
        plan = s.plan()
        for r in range(3):
            shard = BatchSamplerShard(s, num_processes=3, process_index=r, even_batches=even_batches)
            s.set_epoch(0)
            assert len(shard) == s.steps_per_epoch
            assert list(shard) == [plan.step(i)[r].tolist() for i in range(plan.num_steps)]
