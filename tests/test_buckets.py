"""BucketSet: presets, assignment properties, serialisation, errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_arb import BucketSet
from hf_arb.cli.app import main as cli_main

NOVELAI_PUBLISHED = [
    (256, 1024), (320, 1024), (384, 1024), (384, 960), (384, 896), (448, 832), (512, 768), (512, 704),
    (512, 512), (576, 640), (640, 576), (704, 512), (768, 512), (832, 448), (896, 384), (960, 384),
    (1024, 384), (1024, 320), (1024, 256),
]

sizes = st.integers(min_value=1, max_value=20_000)


def brute_force_errors(bs: BucketSet, w: np.ndarray, h: np.ndarray) -> np.ndarray:
    """(n, k) distance of every image to every bucket, the definition assign() must minimise."""
    a = w.astype(np.float64) / h
    if bs.metric == "log":
        return np.abs(np.log(a)[:, None] - np.log(bs.aspects)[None, :])
    if bs.metric == "linear_hw":
        return np.abs(1 / a[:, None] - 1 / bs.aspects[None, :])
    return np.abs(a[:, None] - bs.aspects[None, :])


def test_novelai_defaults_match_published_table():
    bs = BucketSet.novelai()
    assert len(bs) == 19
    assert sorted(map(tuple, bs.resolutions.tolist())) == sorted(NOVELAI_PUBLISHED)
    # preset ids run portrait to landscape
    assert (np.diff(bs.aspects) > 0).all()


def test_novelai_respects_its_parameters():
    bs = BucketSet.novelai(max_area=256 * 384, max_side=512, step=32, min_side=128, extra=())
    res = bs.resolutions
    assert (res % 32 == 0).all() and (res <= 512).all() and (res >= 128).all()
    assert (res[:, 0] * res[:, 1] <= 256 * 384).all()
    assert (256, 256) not in set(bs)


def test_sdxl_table_both_orientations():
    bs = BucketSet.sdxl()
    assert len(bs) == 41
    pairs = set(bs)
    assert (1024, 1024) in pairs and (512, 2048) in pairs and (2048, 512) in pairs
    assert all((h, w) in pairs for w, h in pairs)


@settings(max_examples=60, deadline=None)
@given(resolution=st.integers(16, 2048), step=st.sampled_from([8, 16, 32, 64]))
def test_from_budget_never_exceeds_budget_and_respects_step(resolution, step):
    if step > resolution:
        with pytest.raises(ValueError, match="step"):
            BucketSet.from_budget(resolution, step=step)
        return
    bs = BucketSet.from_budget(resolution, step=step)
    assert (bs.resolutions % step == 0).all()
    assert (bs.areas <= resolution**2).all()
    assert len(bs) >= 1


def _brute_force_budget(resolution: int, aspects: list[float], step: int, min_area_ratio: float = 0.75) -> set:
    """Every step-grid shape within the budget; per aspect the nearest in log aspect among those using >= 75 % of it
    (all if none does), ties to the larger area: the rule from_budget documents, by enumeration."""
    budget = resolution * resolution
    shapes = [(w, h) for w in range(step, budget // step + 1, step)
              for h in {(budget // w) // step * step} if h >= step]
    shapes += [(h, w) for w, h in shapes]
    kept = [s for s in shapes if s[0] * s[1] >= min_area_ratio * budget] or shapes
    return {min(kept, key=lambda s: (round(abs(np.log(s[0] / s[1]) - np.log(a)), 12), -s[0] * s[1])) for a in aspects}


@settings(max_examples=40, deadline=None)
@given(resolution=st.integers(16, 1200), step=st.sampled_from([8, 16, 32, 64]),
       aspects=st.lists(st.floats(0.05, 20), min_size=1, max_size=4))
def test_from_budget_equals_the_brute_force_rule(resolution, step, aspects):
    """The windowed search (O(aspects), issue 24) picks what enumerating the whole step grid picks."""
    if step > resolution:
        return
    assert set(BucketSet.from_budget(resolution, aspects, step=step)) == _brute_force_budget(resolution, aspects, step)


def test_from_budget_is_cheap_at_any_side_and_refuses_a_pixel_count():
    """from_budget(10**6) allocated 21.7 GB (a grid over every side); now a pixel count is refused in one line and
    the largest legal side builds in a few kilobytes."""
    import tracemalloc

    for value, text in ((10**6, "resolution=1000000 looks like a pixel count (1000²)"),
                        (1024 * 1024, "looks like a pixel count (1024²)"),
                        (10_000, "beyond the largest side any supported model trains at (8192)")):
        with pytest.raises(ValueError, match=re.escape(text)):
            BucketSet.from_budget(value)
        with pytest.raises(ValueError, match="pixel count|beyond"):
            BucketSet.preset("novelai", resolution=value)
    tracemalloc.start()
    big = BucketSet.from_budget(8192, step=8)  # 2**20 grid sides: the old table built (14, 2**21) float arrays
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert (8192, 8192) in set(big) and peak < 2 * 2**20, peak


def test_from_budget_tiny_and_default_ladders():
    tiny = BucketSet.from_budget(64, step=16)
    assert (64, 64) in set(tiny) and len(tiny) >= 5  # square plus several tall and wide shapes
    big = BucketSet.from_budget(1024)
    assert (1024, 1024) in set(big)
    # every OneTrainer aspect is represented within 8 % (log distance)
    for a in (4.0, 3.0, 2.0, 1.5, 1.25, 1.0, 0.8, 0.5, 0.25):
        assert np.abs(np.log(big.aspects / a)).min() < 0.08
    assert (big.areas >= 0.75 * 1024**2).all()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(sizes, sizes), min_size=1, max_size=50), st.sampled_from(["log", "linear", "linear_hw"]),
       st.sampled_from(["novelai", "sdxl", "budget", "onetrainer", "kohya"]))
def test_assign_minimises_metric(pairs, metric, preset):
    bs = BucketSet.preset(preset, resolution=512 if preset in ("budget", "onetrainer", "kohya") else None, step=32,
                          metric=metric)
    w, h = np.array(pairs).T
    ids, err = bs.assign(w, h)
    d = brute_force_errors(bs, w, h)
    chosen = d[np.arange(len(w)), ids]
    np.testing.assert_allclose(chosen, d.min(axis=1), rtol=0, atol=2e-6)  # float32 ties only
    np.testing.assert_allclose(err, d.min(axis=1), rtol=1e-5, atol=1e-6)
    assert ids.dtype == np.int32 and err.dtype == np.float32


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(sizes, sizes), min_size=1, max_size=40), st.sampled_from(["novelai", "sdxl", "budget"]))
def test_swapping_sides_gives_transposed_bucket(pairs, preset):
    bs = BucketSet.preset(preset, resolution=768 if preset == "budget" else None)  # symmetric sets, log metric
    w, h = np.array(pairs).T
    ids, err = bs.assign(w, h)
    ids_t, err_t = bs.assign(h, w)
    res = bs.resolutions
    d = brute_force_errors(bs, w, h).min(axis=1)
    # Exact ties (e.g. a square image between two mirrored buckets) may go either way; elsewhere transposed.
    clear = np.sort(brute_force_errors(bs, w, h), axis=1)[:, 1] - d > 1e-5
    np.testing.assert_array_equal(res[ids[clear]][:, ::-1], res[ids_t[clear]])
    np.testing.assert_allclose(err, err_t, atol=1e-6)


def test_log_metric_is_symmetric_linear_is_not():
    bs = BucketSet([(512, 512)])
    _, err_log = bs.assign([300, 900], [900, 300])
    assert err_log[0] == pytest.approx(err_log[1])
    lin = BucketSet([(512, 512)], metric="linear")
    _, err_lin = lin.assign([300, 900], [900, 300])
    assert err_lin[1] == pytest.approx(3 * err_lin[0])  # |1 - 3| = 2 vs |1 - 1/3| = 2/3: wide images look farther


def test_ties_go_to_lowest_id_like_argmin():
    bs = BucketSet([(1024, 1024), (512, 512)])  # same aspect
    ids, _ = bs.assign([100, 700], [100, 900])
    assert ids.tolist() == [0, 0]


def test_pruning_by_error_and_aspect_range():
    bs = BucketSet.novelai(max_aspect_error=0.1)
    ids, err = bs.assign([512, 5000, 100], [512, 100, 4000])
    assert ids[0] >= 0 and ids[1] == -1 and ids[2] == -1
    assert err[1] > 0.1
    dalle = BucketSet.novelai(aspect_range=(0.5, 2.0))
    ids, _ = dalle.assign([1000, 1000, 1000, 1000], [499, 500, 2000, 2001])
    assert (ids[1:3] >= 0).all()  # 1:2 and 2:1 sit on the range limits and are kept
    assert ids[0] == -1 and ids[3] == -1


def test_summary_counts_and_stats():
    bs = BucketSet.novelai(max_aspect_error=0.2)
    rng = np.random.default_rng(0)
    w, h = rng.integers(64, 4000, 5000), rng.integers(64, 4000, 5000)
    ids, err = bs.assign(w, h)
    s = bs.summarize(ids, err)
    assert s.total == 5000 and s.skipped == int((ids < 0).sum()) > 0
    assert s.counts.sum() == 5000 - s.skipped
    kept = err[ids >= 0]
    assert s.error_mean == pytest.approx(kept.mean(), rel=1e-6)
    assert s.error_median == pytest.approx(np.median(kept), rel=1e-6)
    assert s.error_max == pytest.approx(kept.max())
    text = str(s)
    assert "skipped" in text and "256 x 1024" in text
    json.dumps(s.to_dict())


@pytest.mark.parametrize("bs", [BucketSet.novelai(), BucketSet.sdxl(metric="linear"),
                                BucketSet.from_budget(64, step=16, max_aspect_error=0.3, aspect_range=(0.25, 4))])
def test_json_round_trip_preserves_fingerprint(bs):
    back = BucketSet.from_dict(json.loads(json.dumps(bs.to_dict())))
    assert back == bs and back.fingerprint == bs.fingerprint
    np.testing.assert_array_equal(back.resolutions, bs.resolutions)
    assert BucketSet.from_json(bs.to_json()) == bs


def test_fingerprint_changes_with_rule_and_is_stable_across_processes():
    a = BucketSet.novelai()
    assert a.fingerprint != BucketSet.novelai(metric="linear").fingerprint
    assert a.fingerprint != BucketSet.novelai(max_aspect_error=0.1).fingerprint
    code = "from hf_arb import BucketSet; print(BucketSet.novelai().fingerprint)"
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout.strip()
        for seed in ("0", "12345")
    }
    assert outs == {a.fingerprint}


def test_immutable():
    bs = BucketSet.novelai()
    with pytest.raises(ValueError):
        bs.resolutions[0, 0] = 1
    with pytest.raises(AttributeError):
        bs.foo = 1  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "w, h, match",
    [
        ([10, 0, 5], [1, 1, 1], r"widths\[1\] = 0"),
        ([10, 5], [1, -3], r"heights\[1\] = -3"),
        ([10.0, float("nan")], [1, 1], r"widths\[1\] = nan"),
        ([10.0, float("inf")], [1, 1], r"widths\[1\] = inf"),
        ([10, 5, 3], [1, 1], "same length, got 3 and 2"),
        ([[1, 2]], [[1, 2]], "1-D"),
        (["a"], [1], "numeric"),
    ],
)
def test_assign_errors_name_index_and_value(w, h, match):
    with pytest.raises(ValueError, match=match):
        BucketSet.novelai().assign(w, h)


@pytest.mark.parametrize(
    "resolutions, match",
    [
        ([], "at least one resolution"),
        ([(512, 512), (512, 512)], r"\(512, 512\) appears more than once"),
        ([(512, 0)], "positive"),
        ([(512, 512, 3, 1)], "pairs"),  # (512, 512, 3) is a 3-frame clip bucket
    ],
)
def test_bad_bucket_lists(resolutions, match):
    with pytest.raises(ValueError, match=match):
        BucketSet(resolutions)


def test_bad_options():
    with pytest.raises(ValueError, match="metric"):
        BucketSet([(1, 1)], metric="cosine")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_aspect_error"):
        BucketSet([(1, 1)], max_aspect_error=-1)
    with pytest.raises(ValueError, match="aspect_range"):
        BucketSet([(1, 1)], aspect_range=(2, 1))
    with pytest.raises(ValueError, match="Unknown bucket preset"):
        BucketSet.preset("nai")
    with pytest.raises(ValueError, match="not a bucket"):
        BucketSet.novelai().index((513, 512))


def test_near_identical_aspects_fall_back_to_binary_search():
    bs = BucketSet([(100000, 100001), (100001, 100000), (512, 512)])
    w = np.array([100000, 100001, 512, 3])
    ids, _ = bs.assign(w, np.array([100001, 100000, 512, 4]))
    d = brute_force_errors(bs, w, np.array([100001, 100000, 512, 4]))
    np.testing.assert_allclose(d[np.arange(4), ids], d.min(1), atol=2e-6)


def test_cli_buckets_prints_table(capsys):
    assert cli_main(["buckets", "--preset", "novelai"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert len(rows) == 19
    aspects = [float(r[3]) for r in rows]
    assert aspects == sorted(aspects)  # portrait to landscape
    assert {(int(r[1]), int(r[2])) for r in rows} == set(NOVELAI_PUBLISHED)
    assert cli_main(["buckets", "--preset", "budget", "--resolution", "64", "--step", "16"]) == 0
    assert "64      64" in capsys.readouterr().out


@pytest.mark.parametrize("module", ["hf_arb", "hf_arb.cli"])
def test_python_m_entry_points_list_every_sub_command(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("buckets", "annotate", "stats"):
        assert command in out


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 64), st.integers(1, 64)), min_size=1, max_size=12, unique=True),
       st.lists(st.tuples(sizes, sizes), min_size=1, max_size=40))
def test_cross_metric_is_exact_argmin_with_last_tie(table, pairs):
    bs = BucketSet([(16 * w, 16 * h) for w, h in table], metric="cross")
    w, h = (np.array(x, dtype=np.int64) for x in zip(*pairs))
    ids, err = bs.assign(w, h)
    d = np.abs(h[:, None] * bs.resolutions[None, :, 0] - w[:, None] * bs.resolutions[None, :, 1])  # (n, k) exact
    last = len(bs) - 1 - d[:, ::-1].argmin(axis=1)
    np.testing.assert_array_equal(ids, last)
    np.testing.assert_allclose(err, d[np.arange(len(w)), ids] / (w * bs.resolutions[ids, 0]), rtol=1e-6)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.5, 0.75, 1.0, 4 / 3, 2.0]), st.integers(4, 40)), min_size=1,
                max_size=12, unique=True),
       st.lists(st.tuples(sizes, sizes), min_size=1, max_size=40))
def test_match_aspects_then_nearest_area(groups, pairs):
    """HunyuanDiT's rule on random tables: nearest matching aspect (linear), then the closest area, first id."""
    res = [(s * 16, s * 16 + i) for i, (_, s) in enumerate(groups)]  # distinct sizes, aspects ignored
    match = [m for m, _ in groups]
    bs = BucketSet(res, metric="linear", match_aspects=match, nearest_area=True)
    w, h = (np.array(x, dtype=np.int64) for x in zip(*pairs))
    ids, _ = bs.assign(w, h)
    m = np.asarray(match)
    d = np.abs(m[None, :] - (w / h)[:, None])  # (n, k)
    best = d.min(axis=1, keepdims=True)
    tied = np.isclose(d, best, rtol=0, atol=1e-12)
    area = np.where(tied, np.abs(bs.areas[None, :] - (w * h)[:, None]), np.inf)
    expect = area.argmin(axis=1)
    near_tie = np.array([np.sort(np.unique(row))[1] - row.min() < 1e-5 if np.unique(row).size > 1 else False
                         for row in d])
    np.testing.assert_array_equal(ids[~near_tie], expect[~near_tie])
