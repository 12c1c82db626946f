"""BucketSet.fit: a bucket table fitted to the data (hf_arb/fit.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hf_arb import BucketSet
from hf_arb.buckets.fit import candidate_shapes, fit_table


def _crop(table: np.ndarray, w: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Crop share of every size in its nearest-in-log-aspect bucket (brute force over the table)."""
    x = np.log(w / h)[:, None]
    a = np.log(table[:, 0] / table[:, 1])[None, :]
    return 1 - np.exp(-np.abs(x - a).min(axis=1))


def _sizes(seed: int, n: int = 300) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(600, 2000, n), rng.integers(600, 2000, n)


@pytest.mark.parametrize("seed,k,max_crop", [(0, 3, None), (1, 4, None), (2, 7, 0.25), (3, 9, 0.3)])
def test_fit_is_the_exact_optimum_among_candidates(seed, k, max_crop):
    """Brute force over every k-subset of the step-aligned candidates: fit finds the minimum mean crop under the
    worst-crop bound (its histogram bins are narrower than any gap that would change the answer here)."""
    w, h = _sizes(seed)
    cand = candidate_shapes(128, 1024 * 1024, 512, 2048, min_area_ratio=0.99)  # each width's largest height
    best = None
    for comb in itertools.combinations(range(len(cand)), k):
        c = _crop(cand[list(comb)], w, h)
        if max_crop is not None and c.max() > max_crop:
            continue
        if best is None or c.mean() < best[0] - 1e-12:
            best = (c.mean(), comb)
    assert best is not None
    res = fit_table(w, h, k, step=128, max_crop=max_crop, min_area_ratio=0.99)
    assert res.mean_crop == pytest.approx(best[0], rel=1e-9)
    assert res.mean_crop == pytest.approx(_crop(res.table, w, h).mean(), rel=1e-12)
    if max_crop is not None:
        assert res.worst_crop <= max_crop


def test_fit_honours_step_budget_limits_and_saves_like_any_bucketset():
    w, h = _sizes(4, 2000)
    bs = BucketSet.fit((w, h), 12, step=16, max_pixels=768 * 768, min_side=384, max_side=1280)
    res = bs.resolutions
    assert len(bs) <= 12 and bs.metric == "log"
    assert (res % 16 == 0).all() and (res[:, 0] * res[:, 1] <= 768 * 768).all()
    assert (res >= 384).all() and (res <= 1280).all()
    # deterministic, and the same call on (n, 2) rows
    assert BucketSet.fit(np.stack([w, h], 1), 12, step=16, max_pixels=768 * 768, min_side=384, max_side=1280) == bs
    assert BucketSet.from_json(bs.to_json()) == bs
    # more buckets never crop more
    crops = [fit_table(w, h, k).mean_crop for k in (1, 2, 4, 8)]
    assert crops == sorted(crops, reverse=True) and crops[-1] < crops[0]


def test_fit_beats_a_preset_with_as_many_buckets_on_skewed_data():
    """Phone portraits (3:4, 9:16) dominate: a fitted set of at most 6 buckets crops less than the 'budget' preset's
    17, because its buckets sit where the rows are."""
    rng = np.random.default_rng(5)
    n = 20000
    aspect = np.where(rng.random(n) < 0.7, 3 / 4, 9 / 16) * np.exp(rng.normal(0, 0.02, n))
    h = rng.integers(1500, 4000, n)
    w = np.rint(h * aspect).astype(np.int64)
    fitted = BucketSet.fit((w, h), 6)
    budget = BucketSet.preset("budget")
    assert len(fitted) < len(budget)
    assert _crop(fitted.resolutions, w, h).mean() < _crop(budget.resolutions, w, h).mean()


def test_fit_errors_name_the_value_and_the_fix():
    w, h = _sizes(6)
    with pytest.raises(ValueError, match=r"max_crop=0\.02 cannot be met .* (buckets meet it|smaller `step`)"):
        fit_table(w, h, 2, max_crop=0.02)
    # an 8:1 banner is out of reach of the 1:4 ... 4:1 candidates
    with pytest.raises(ValueError, match=r"aspect_range|max_side"):
        BucketSet.fit([(4000, 500), (1000, 1000)], 4, max_crop=0.3)
    with pytest.raises(ValueError, match=r"`max_crop` must be a share"):
        BucketSet.fit([(100, 100)], 2, max_crop=1.5)
    with pytest.raises(ValueError, match=r"`sizes` must be \(width, height\) rows"):
        BucketSet.fit(np.ones((3, 3)), 2)
    with pytest.raises(ValueError, match=r"heights\[0\] = 0"):
        BucketSet.fit([(100, 0)], 2)
    with pytest.raises(ValueError, match=r"metric=.log."):
        BucketSet.fit([(100, 100)], 2, metric="linear")
    with pytest.raises(ValueError, match=r"`step` \(2048\) exceeds"):
        BucketSet.fit([(100, 100)], 2, step=2048)


def test_fit_takes_rows_columns_or_an_annotated_dataset():
    import datasets

    from hf_arb import add_bucket_columns

    rows = [(4000, 3000), (3000, 4000), (1080, 1920)]
    by_rows = BucketSet.fit(rows, 3)
    assert BucketSet.fit(tuple(rows[:2]), 2) == BucketSet.fit(rows[:2], 2)  # a tuple of two pairs: rows
    assert BucketSet.fit((np.array([4000, 3000, 1080]), np.array([3000, 4000, 1920])), 3) == by_rows
    ds = datasets.Dataset.from_dict({"w": [4000, 3000, 1080, None], "h": [3000, 4000, 1920, 5]})
    annotated = add_bucket_columns(ds, BucketSet.sdxl(), width_column="w", height_column="h", show_summary=False)
    assert BucketSet.fit(annotated, 3) == by_rows  # the row without a size is left out
    with pytest.raises(ValueError, match="must be annotated"):
        BucketSet.fit(ds, 3)
    with pytest.raises(ValueError, match=r"too many .* larger `step`"):
        BucketSet.fit(rows, 3, step=8, max_pixels=1024 ** 4)


def test_a_fit_with_fewer_buckets_than_asked_says_why():
    """issue 34: `--fit --n-buckets 2` returned 1 bucket without saying why; FitResult.fewer says it."""
    one_shape = fit_table(np.full(40, 4000), np.full(40, 3000), 2)
    assert len(one_shape.table) == 1
    assert one_shape.fewer == ("1 bucket, not 2: more buckets would not lower the mean crop (all 40 sizes have one "
                               "aspect ratio, 1.333 w/h).")
    few = fit_table(np.array([4000, 3000, 1000]), np.array([3000, 4000, 4000]), 50, step=256, max_pixels=512 * 512)
    assert few.fewer.startswith(f"{len(few.table)} bucket") and f"only {few.candidates} step-aligned shapes fit " \
        "(step 256, max_pixels=262144, sides 256 to 1024)" in few.fewer, few.fewer
    assert fit_table(np.array([4000, 3000]), np.array([3000, 4000]), 2).fewer == ""  # both asked for: nothing to say
