"""Multi-resolution tiers (issue #27, library core): tier columns, schedules and TieredBatchSampler, every rank
simulated in one process (one sampler per rank, as every process builds its own)."""

from __future__ import annotations

import json
from functools import lru_cache

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_arb import BucketBatchSampler, BucketSet
from hf_arb.sampling.tiered.plan import Tiers, random_tier_ids, tier_bucket_ids
from hf_arb.sampling.tiered.sampler import TieredBatchSampler
from hf_arb.sampling.tiered.schedule import (
    MIX_BLOCK,
    curriculum_schedule,
    mix_counts,
    mix_schedule,
    parse_resolution_schedule,
    progressive_schedule,
    random_schedule,
    stream_positions,
)

TIERS = Tiers.preset("budget", [256, 512])
SCHEDULES = {"random": random_schedule(), "mix": mix_schedule([1, 2]),
             "curriculum": curriculum_schedule([(0, 7, 1), (7, 19, 0), (19, None, 1)]),
             "progressive": progressive_schedule([11])}
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@lru_cache(maxsize=None)
def sizes(n: int = 600, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(150, 1400, n), rng.integers(150, 1400, n)


def make(kind: str, world: int = 1, rank: int | None = 0, batch=(3, 2), **kw) -> TieredBatchSampler:
    """One rank's sampler (``rank=None``: built as under accelerator.prepare, iterated for the global plan)."""
    w, h = sizes()
    kw.setdefault("steps_per_epoch", None if kind == "random" else 23)
    return TieredBatchSampler(w, h, TIERS, SCHEDULES[kind], batch_size=list(batch),
                              num_replicas=world, rank=rank, return_keys=True, **kw)


def global_steps(kind: str, world: int, epochs: int, **kw) -> list[list[list[tuple]]]:
    """[step][rank] -> keys over ``epochs`` epochs, each rank read from its own sampler's shard."""
    per_rank = []
    for r in range(world):
        s = make(kind, world, r, **kw)
        per_rank.append([b for e in range(epochs) for b in (s.set_epoch(e), list(s.shard()))[1]])
    return [list(step) for step in zip(*per_rank, strict=True)]


# ------------------------------------------------------------------------------------------- tier columns
@SETTINGS
@given(st.lists(st.tuples(st.integers(1, 3000), st.integers(1, 3000)), min_size=1, max_size=60),
       st.sampled_from([1.0, 1.5]))
def test_tier_ids_are_each_tiers_assignment_where_no_more_upscale_than_allowed(wh, up):
    w, h = (np.array(c, dtype=np.int64) for c in zip(*wh))
    tiers = Tiers.preset("budget", [256, 512, 1024], max_upscale=up)
    ids = tier_bucket_ids(w, h, tiers)  # (T, n)
    for t, bs in enumerate(tiers.bucket_sets):
        want, _ = bs.assign(w, h)
        scale = np.maximum(bs.resolutions[want, 0] / w, bs.resolutions[want, 1] / h)
        np.testing.assert_array_equal(ids[t], np.where(scale <= up * (1 + 1e-9), want, -1))


def test_rows_without_a_valid_size_are_eligible_nowhere():
    ids = tier_bucket_ids(np.array([np.nan, 0, 800, -5]), np.array([600, 600, 900, 10]), TIERS)
    assert (ids[:, [0, 1, 3]] == -1).all() and (ids[:, 2] >= 0).all()


def test_random_draw_is_uniform_among_eligible_tiers():
    ids = np.array([[0] * 4000 + [1] * 2000 + [-1] * 500, [2] * 4000 + [-1] * 2000 + [-1] * 500], np.int16)
    off = np.array([0, 5, 10])
    comb = random_tier_ids(ids, off, seed=3, epoch=0)
    assert set(comb[4000:6000].tolist()) == {1} and set(comb[6000:].tolist()) == {-1}
    frac = (comb[:4000] == 7).mean()  # tier 1's bucket 2
    assert 0.46 < frac < 0.54 and set(comb[:4000].tolist()) == {0, 7}
    assert (random_tier_ids(ids, off, seed=3, epoch=1) != comb).any()  # a new draw per epoch


# ------------------------------------------------------------------------------------------- schedules
def test_parse_every_schedule_form():
    res = [256, 512, 1024]
    assert parse_resolution_schedule("random", res) == random_schedule()
    assert parse_resolution_schedule("mix:256:1,1024:3", res).weights == (1.0, 0.0, 3.0)
    c = parse_resolution_schedule("0-2000:512,2000-:1024", res)
    assert c == parse_resolution_schedule("curriculum:0-2000:512, 2000-:1024", res)
    assert c.phases == ((0, 2000, 1), (2000, None, 2))
    assert parse_resolution_schedule("progressive:100,300", res).phases == ((0, 100, 0), (100, 300, 1),
                                                                             (300, None, 2))
    assert json.loads(json.dumps(c.to_dict())) == c.to_dict()


@pytest.mark.parametrize("text, words", [
    ("mix:768:1", ["'768'", "[256, 512, 1024]"]),
    ("mix:256:x", ["weight", "mix:256:1,1024:3"]),
    ("0-2000:512,2500-:1024", ["starts at step 2500", "Start it at 2000"]),
    ("0-2000:512,2000-3000:1024", ["open-ended"]),
    ("0-2000:512,abc", ["'abc'", "start-end:resolution"]),
    ("progressive:100", ["2 increasing switch", "progressive:2000,4000"]),
    ("cosine", ["'cosine'", "random"]),
])
def test_schedule_errors_name_the_value_and_the_fix(text, words):
    with pytest.raises(ValueError) as e:
        parse_resolution_schedule(text, [256, 512, 1024])
    for w in words:
        assert w in str(e.value)


def test_mix_shares_are_exact_in_every_block_and_streams_count_up():
    sched = mix_schedule([1, 3])
    g = np.arange(3 * MIX_BLOCK)
    tiers, pos = stream_positions(sched, 5, g)
    for b in range(3):
        np.testing.assert_array_equal(np.bincount(tiers[b * MIX_BLOCK:(b + 1) * MIX_BLOCK]), mix_counts([1, 3]))
    for t in (0, 1):  # a tier's steps are its stream positions 0, 1, 2, ... in order
        np.testing.assert_array_equal(pos[tiers == t], np.arange((tiers == t).sum()))
    part = stream_positions(sched, 5, g[1234:1300])  # any window gives the same values (pure in the step)
    np.testing.assert_array_equal(part[1], pos[1234:1300])


def test_curriculum_tier_that_comes_back_continues_its_stream():
    tiers, pos = stream_positions(SCHEDULES["curriculum"], 0, np.arange(30))
    assert tiers.tolist() == [1] * 7 + [0] * 12 + [1] * 11
    assert pos.tolist() == list(range(7)) + list(range(12)) + list(range(7, 18))


# ------------------------------------------------------------------------------------------- the sampler
@SETTINGS
@given(st.sampled_from(sorted(SCHEDULES)), st.integers(1, 3), st.integers(0, 50), st.sampled_from(["drop", "fill"]))
def test_every_rank_trains_the_same_tier_and_bucket_at_every_step(kind, world, seed, leftover):
    w, h = sizes()
    ids = tier_bucket_ids(w, h, TIERS)
    steps = global_steps(kind, world, 2, seed=seed, leftover=leftover)
    ref = make(kind, world, 0, seed=seed, leftover=leftover)
    for e in range(2):
        assert sum(1 for s in steps if s[0][0][3] == e) == (ref.set_epoch(e), ref.steps_per_epoch)[1]
    for g, step in enumerate(steps):  # global step g (epochs of 23 steps back to back)
        (t, b, e), = {(k[1], k[2], k[3]) for batch in step for k in batch}  # one (tier, bucket, epoch) per step
        assert {len(batch) for batch in step} == {ref._sizes[t][b]}
        assert all(ids[t, k[0]] == b for batch in step for k in batch)  # every row belongs to it
        if kind == "curriculum":
            assert t == (0 if 7 <= g < 19 else 1)


@pytest.mark.parametrize("kind", sorted(SCHEDULES))
@pytest.mark.parametrize("leftover", ["drop", "fill"])
def test_no_row_twice_in_a_tier_pass_beyond_counted_repeats(kind, leftover):
    s = make(kind, 2, 0, leftover=leftover, seed=4)
    rep = s.report()
    for t in range(2):
        per_pass = sum(v["batches"] for v in rep.tiers[t]["buckets"].values())
        repeats = sum(v["repeats"] for v in rep.tiers[t]["buckets"].values())
        if kind == "random":  # one epoch is one pass over the rows drawn for each tier
            passes = [[k[0] for st_ in global_steps(kind, 2, 1, leftover=leftover, seed=4) for batch in st_
                       for k in batch if k[1] == t]]
        else:  # the tier's k-th step is position k of its stream: cut it into passes
            steps = [st_ for st_ in global_steps(kind, 2, 4, leftover=leftover, seed=4) if st_[0][0][1] == t]
            passes = [[k[0] for st_ in steps[i:i + per_pass] for batch in st_ for k in batch]
                      for i in range(0, len(steps), per_pass)]
        assert passes and all(passes)
        for i, rows in enumerate(passes):
            twice = len(rows) - len(set(rows))
            whole = kind == "random" or (i + 1) * per_pass <= len(steps)  # else the start of a pass
            assert twice == repeats if whole else twice <= repeats
            if leftover == "drop":
                assert twice == repeats == 0


@SETTINGS
@given(st.sampled_from(sorted(SCHEDULES)), st.integers(1, 3), st.data())
def test_resume_anywhere_equals_the_uninterrupted_run(kind, world, data):
    full = global_steps(kind, world, 3, seed=7)
    switches = [7, 19, 23 + 7] if kind == "curriculum" else [11] if kind == "progressive" else []
    cut = data.draw(st.sampled_from(switches) | st.integers(0, len(full) - 1) if switches
                    else st.integers(0, len(full) - 1), label="cut")
    for r in range(world):
        s = make(kind, world, r, seed=7)
        it, done = None, 0
        for e in range(3):
            s.set_epoch(e)
            it = iter(s.shard())
            n = min(cut - done, s.steps_per_epoch)
            for _ in range(n):
                next(it)
            done += n
            if done == cut:
                break
        state = json.loads(json.dumps(s.state_dict()))
        fresh = make(kind, world, r, seed=7)
        fresh.load_state_dict(state)
        rest = list(fresh.shard())
        for e in range(fresh.epoch + 1, 3):
            fresh.set_epoch(e)
            rest += list(fresh.shard())
        assert rest == [step[r] for step in full[cut:]]


def test_elastic_resume_continues_the_same_global_sequence():
    full = global_steps("mix", 2, 2, batch=(4, 2), seed=1)  # 2 ranks × (4, 2) rows = global batches (8, 4)
    glob = [[k for batch in step for k in batch] for step in full]
    a = make("mix", 2, 0, batch=(4, 2), seed=1)
    it = iter(a.shard())
    for _ in range(9):  # cut mid-epoch
        next(it)
    state = a.state_dict()
    rest = []
    for r in range(4):  # 4 ranks × (2, 1) rows: the same global batches
        b = make("mix", 4, r, batch=(2, 1), seed=1)
        b.load_state_dict(state)
        got = list(b.shard())
        b.set_epoch(1)
        rest.append(got + list(b.shard()))
    assert [[k for batch in step for k in batch] for step in zip(*rest)] == glob[9:]
    with pytest.raises(ValueError, match="global_batch_sizes"):
        make("mix", 4, 0, batch=(4, 2), seed=1).load_state_dict(state)


def test_global_iteration_is_every_ranks_batch_step_major():
    s, shards = make("random", 3, None, seed=2), [make("random", 3, r, seed=2) for r in range(3)]
    with pytest.raises(RuntimeError, match="shard"):  # the plain-DDP habit: rank= and iterating the sampler
        next(iter(shards[1]))
    got = list(s)
    assert len(got) == len(s) == 3 * s.steps_per_epoch
    assert got == [b for step in zip(*(list(x.shard()) for x in shards)) for b in step]
    tiers, buckets = s.step_tiers(0)
    assert [(b[0][1], b[0][2]) for b in got[::3]] == list(zip(tiers.tolist(), buckets.tolist()))
    assert s.step_batch_sizes(0).tolist() == [len(b) for b in got[::3]]


@pytest.mark.parametrize("even_batches", [True, False])
def test_accelerate_batch_sampler_shard_deals_each_rank_its_planned_batches(even_batches):
    """accelerate's BatchSamplerShard (what accelerator.prepare wraps a batch sampler in) over the global plan:
    rank r receives exactly shard(r)'s batches, so every rank gets the same (tier, bucket) at every step."""
    from accelerate.data_loader import BatchSamplerShard

    for kind in ("random", "curriculum"):
        s = make(kind, 3, None, seed=6)
        want = [list(make(kind, 3, r, seed=6).shard()) for r in range(3)]
        for r in range(3):
            shard = BatchSamplerShard(s, num_processes=3, process_index=r, even_batches=even_batches)
            s.set_epoch(0)  # what the prepared loader does before every pass
            assert len(shard) == s.steps_per_epoch and list(shard) == want[r]


def test_garbage_state_is_refused_naming_the_field():
    s = make("curriculum", 2, 0, seed=3)
    good = s.state_dict()
    cases = [({**good, "seed": 4}, "`seed`"), ({**good, "schedule": SCHEDULES["mix"].to_dict()}, "`schedule`"),
             ({**good, "fingerprint": "0" * 32}, "`fingerprint`"), ({**good, "kind": None}, "`kind`"),
             ({**good, "tiers": good["tiers"][:1]}, "`tiers`"), ({**good, "epoch": -1}, "`epoch`"),
             ({**good, "batches_consumed": 10**6}, "`batches_consumed`"), ({**good, "format": 9}, "`format`"),
             ({**good, "options": {**good["options"], "leftover": "fill"}}, "`options.leftover`"),
             ({**good, "steps_per_epoch": 5}, "`steps_per_epoch`"), ("{not json", "not JSON")]
    for state, field in cases:
        with pytest.raises(ValueError) as e:
            s.load_state_dict(state)
        assert field in str(e.value), (field, str(e.value))
    with pytest.raises(TypeError):
        s.load_state_dict([1, 2])
    single = BucketBatchSampler([0] * 8, 2, num_replicas=1, log_report=False)
    with pytest.raises(ValueError, match="`format`|`kind`"):
        s.load_state_dict(single.state_dict())


@pytest.mark.parametrize("other, field, fix", [
    (Tiers.preset("budget", [256, 768]), "`tiers`", "checkpoint's tiers"),
    (Tiers(TIERS.resolutions, TIERS.bucket_sets, 2.0), "`max_upscale`", "checkpoint's max_upscale")])
def test_a_state_of_other_tiers_is_refused_for_its_tiers_not_the_rows(other, field, fix):
    """The same rows under another tier list or max_upscale (issue 34, item 3): the message names that field and
    its fix; the rows' fingerprint (which covers the tiers) must not speak first and blame the dataset."""
    w, h = sizes()
    saved = TieredBatchSampler(w, h, other, SCHEDULES["mix"], batch_size=[3, 2], num_replicas=1, rank=0,
                               steps_per_epoch=23).state_dict()
    with pytest.raises(ValueError) as e:
        make("mix").load_state_dict(saved)
    assert field in str(e.value) and fix in str(e.value) and "rows' sizes" not in str(e.value), str(e.value)


def test_index_dir_gives_the_same_plan_as_memory(tmp_path):
    for kind in ("random", "progressive"):
        mem = global_steps(kind, 2, 2, seed=5)
        disk = global_steps(kind, 2, 2, seed=5, index_dir=tmp_path)
        assert mem == disk
    assert any(p.name.startswith("random-") for p in tmp_path.iterdir())
    assert not any(p.name.endswith(".tmp") or ".tmp." in p.name for p in tmp_path.iterdir())


def test_pixel_budget_per_tier_and_report():
    w, h = sizes()
    s = TieredBatchSampler(w, h, TIERS, "mix:256:1,512:1", max_pixels_per_batch=4 * 512 * 512, num_replicas=2,
                           steps_per_epoch=40)
    rep = s.report()
    assert rep.steps == 40 and sum(t["steps"] for t in rep.tiers) == 40 and s.batch_size is None
    for t, tier in enumerate(rep.tiers):
        bs = TIERS.bucket_sets[t]
        for b, row in tier["buckets"].items():
            assert row["batch_size"] == 4 * 512 * 512 // int(bs.resolutions[b].prod())
            assert row["batches"] * 2 * row["batch_size"] + row["drops"] == row["rows"]
    assert rep.rows_no_tier == int((tier_bucket_ids(w, h, TIERS) < 0).all(axis=0).sum())
    assert "tier 1 (512)" in str(rep) and json.dumps(rep.to_dict())


def test_construction_errors_name_the_fix():
    w, h = sizes()
    with pytest.raises(ValueError, match="no full global batch"):
        TieredBatchSampler(w, h, TIERS, "progressive:5", batch_size=400, num_replicas=1)
    with pytest.raises(ValueError, match="leftover"):
        TieredBatchSampler(w, h, TIERS, "random", batch_size=2, num_replicas=1, leftover="catch_all")
    with pytest.raises(ValueError, match="steps_per_epoch"):
        TieredBatchSampler(w, h, TIERS, "random", batch_size=2, num_replicas=1, steps_per_epoch=9)
    with pytest.raises(ValueError, match="one per tier"):
        TieredBatchSampler(w, h, TIERS, "random", batch_size=[1, 2, 3], num_replicas=1)
    with pytest.raises(ValueError, match="unique"):
        Tiers((512, 512), (BucketSet.sdxl(), BucketSet.sdxl()))


def test_from_dataset_reads_the_stored_sizes_and_nulls_are_eligible_nowhere():
    from datasets import Dataset

    w, h = sizes()
    ds = Dataset.from_dict({"original_width": [None, *w[1:].tolist()], "original_height": h.tolist()})
    s = TieredBatchSampler.from_dataset(ds, TIERS, "random", batch_size=[3, 2], num_replicas=1)
    ref = TieredBatchSampler(np.r_[np.nan, w[1:]], h, TIERS, "random", batch_size=[3, 2], num_replicas=1)
    assert list(s) == list(ref) and s.state_dict() == ref.state_dict()
    assert 0 not in {r for b in s for r in b}
