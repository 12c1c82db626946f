"""The pack planner (hf_arb.packing): every row once or reported, budgets, determinism, equal steps, resume;
per-image sizes fit the budget and the patch grid; per-pack metadata is consistent."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_arb.families.shift import ShiftConfig, calculate_mu, shift_sigmas
from hf_arb.packing.plan import first_fit_decreasing, fit_sizes, pack_meta, plan_packs

token_lists = st.lists(st.integers(-2, 300), min_size=0, max_size=120)


@settings(max_examples=150, deadline=None)
@given(tokens=token_lists, budget=st.integers(1, 256), world=st.integers(1, 5), seed=st.integers(0, 3),
       epoch=st.integers(0, 3), window=st.integers(1, 40), leftover=st.sampled_from(["drop", "fill"]))
def test_every_row_once_or_reported_budgets_and_equal_steps(tokens, budget, world, seed, epoch, window, leftover):
    t = np.array(tokens, dtype=np.int64)
    plan = plan_packs(t, budget, world, seed=seed, epoch=epoch, window=window, leftover=leftover)
    r = plan.report
    # every valid row exactly once, packed or reported (plus the counted repeats of "fill")
    seen = np.concatenate([np.unique(plan.rows), plan.leftover, plan.oversize])
    assert np.array_equal(np.sort(seen), np.flatnonzero(t > 0))
    assert np.unique(plan.rows).size == plan.rows.size - r.rows_repeated == r.rows_packed
    assert np.array_equal(np.sort(plan.oversize), np.flatnonzero(t > budget))
    assert r.rows_skipped == int((t <= 0).sum()) and r.rows_total == t.size
    assert r.rows_packed + r.rows_leftover + r.rows_oversize + r.rows_skipped == t.size
    # budgets, equal steps on every rank, ragged layout
    assert plan.offsets[0] == 0 and plan.offsets[-1] == plan.rows.size
    assert plan.offsets.size == plan.num_steps * world + 1
    for s in range(plan.num_steps):
        for k in range(world):
            assert t[plan.pack(s, k)].sum() <= budget
    assert all(plan.pack(s, k).size for s in range(plan.num_steps) for k in range(world))  # no empty pack
    if leftover == "drop":
        assert r.rows_repeated == 0
    else:
        assert r.rows_leftover == 0
    assert r.tokens_real == t[plan.rows].sum() and r.tokens_total == plan.num_steps * world * budget
    json.dumps(r.to_dict())


@settings(max_examples=40, deadline=None)
@given(tokens=token_lists, budget=st.integers(1, 256), world=st.integers(1, 4), seed=st.integers(0, 3))
def test_deterministic_and_resume_reproduces_the_rest(tokens, budget, world, seed):
    a = plan_packs(tokens, budget, world, seed=seed, epoch=1, window=16)
    b = plan_packs(list(tokens), budget, world, seed=seed, epoch=1, window=16)
    assert np.array_equal(a.rows, b.rows) and np.array_equal(a.offsets, b.offsets) and a.report == b.report
    # resume from state (epoch, step): the remaining packs of every rank are the uninterrupted ones
    step = a.num_steps // 2
    for k in range(world):
        full = [p.tolist() for p in a.iter_rank(k)]
        assert [p.tolist() for p in b.iter_rank(k, start_step=step)] == full[step:]


def test_order_is_random_per_epoch_and_packs_are_tight():
    rng = np.random.default_rng(0)
    t = rng.integers(1000, 4097, 4000)
    p0, p1 = plan_packs(t, 16384, 2, seed=0, epoch=0), plan_packs(t, 16384, 2, seed=0, epoch=1)
    assert not np.array_equal(p0.rows, p1.rows)
    assert p0.report.padding_fraction < 0.03  # greedy FFD within windows of 512 rows
    # the first packs are not all big images: packs are shuffled after FFD
    first = t[p0.rows[:p0.offsets[40]]]
    assert first.min() < 1500 and first.max() > 3800
    # sequential (naive) grouping of the same order pads much more
    naive = plan_packs(t, 16384, 2, seed=0, epoch=0, window=1)
    assert naive.report.padding_fraction > 2 * p0.report.padding_fraction


def test_first_fit_decreasing_is_optimal_on_a_known_case():
    bins = first_fit_decreasing([5, 5, 4, 3, 2, 1], 10)
    assert bins.max() == 1 and np.bincount(bins, weights=[5, 5, 4, 3, 2, 1]).tolist() == [10, 10]


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(world_size=0), dict(seed=-1), dict(leftover="empty")])
def test_bad_arguments_are_named(bad):
    kw = dict(max_tokens=10, world_size=1) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        plan_packs([1, 2, 3], **kw)
    with pytest.raises(ValueError, match="1-D"):
        plan_packs([[1, 2]], 10)


@settings(max_examples=200, deadline=None)
@given(w=st.integers(1, 8000), h=st.integers(1, 8000), budget=st.integers(1, 8192), up=st.booleans())
def test_fit_sizes_fit_the_budget_and_the_grid_without_more_crop_than_a_patch(w, h, budget, up):
    f = fit_sizes([w], [h], budget, upscale=up)
    fw, fh, rw, rh = int(f.width[0]), int(f.height[0]), int(f.resize_width[0]), int(f.resize_height[0])
    assert fw % 16 == 0 and fh % 16 == 0 and fw >= 16 and fh >= 16
    assert f.tokens[0] == (fw // 16) * (fh // 16) <= budget
    assert fw <= rw and fh <= rh
    s = np.sqrt(budget * 256 / (w * h))
    s = s if up else min(s, 1.0)
    normal = min(w, h) * s >= 16.5  # no side under one patch once scaled
    if normal:  # only the grid remainder is cropped, and the aspect ratio is kept up to pixel rounding
        assert rw - fw < 16 and rh - fh < 16
        if not up:
            assert rw <= w and rh <= h  # never enlarged
        assert abs(np.log(rw / rh) - np.log(w / h)) < 2 / min(rw, rh) + 1e-9


def test_fit_sizes_scale_big_images_to_the_budget():
    f = fit_sizes([4000, 1024], [3000, 1024], 4096)
    assert f.tokens.tolist()[1] == 4096 and 4096 * 0.95 < f.tokens[0] <= 4096
    assert abs(f.width[0] / f.height[0] - 4 / 3) < 0.02 and f.crop_fraction.max() < 0.01


def test_pack_meta_layout_and_per_image_shift():
    cfg = ShiftConfig(use_dynamic_shifting=True)
    m = pack_meta([[2, 3], [4, 1]], 12, text_lens=[3, 2], max_text_tokens=6, t=[0.5, 0.25], shift_config=cfg)
    assert m.cu_seqlens.dtype == np.int32 and m.cu_seqlens.tolist() == [0, 6, 10] and m.max_seqlen == 6
    assert m.document_id.tolist() == [0] * 6 + [1] * 4 + [-1] * 2
    assert m.positions[:10].tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2],
                                         [0, 0], [1, 0], [2, 0], [3, 0]]
    assert m.text_document_id.tolist() == [0, 0, 0, 1, 1, -1] and m.text_cu_seqlens.tolist() == [0, 3, 5]
    assert m.loss_mask.tolist() == [True] * 10 + [False] * 2 and abs(m.padding_fraction - 2 / 12) < 1e-12
    np.testing.assert_allclose(m.mu, calculate_mu([6, 4], cfg))
    np.testing.assert_allclose(m.sigmas, shift_sigmas(np.array([0.5, 0.25]), calculate_mu([6, 4], cfg), cfg))
    with pytest.raises(ValueError, match="max_tokens"):
        pack_meta([[4, 4]], 15)
    with pytest.raises(ValueError, match="text_lens"):
        pack_meta([[1, 1]], 4, text_lens=[1, 2])


def test_fit_sizes_and_report_errors_and_text():
    with pytest.raises(ValueError, match="row 1"):
        fit_sizes([10, 0], [10, 10], 64)
    with pytest.raises(ValueError, match="shape"):
        fit_sizes([10, 20], [10], 64)
    with pytest.raises(ValueError, match="max_tokens"):
        fit_sizes([10], [10], 0)
    plan = plan_packs([10, 20, 0, 500], 64, 2, leftover="fill")
    line = plan.report.text()
    assert "oversize 1" in line and "skipped 1" in line and "repeated" in line
