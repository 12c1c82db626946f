"""Ray Data and Spark run the same Arrow-batch function as ``datasets.map``: row-for-row equal results.

The clusters are real and local (``ray.init(num_cpus=2)``, ``local[2]``): tests/conftest.py's ``ray_cluster`` and
``spark`` start each once per process (test_encoded.py's Ray test shares the cluster) and stop it after the last test
that asks for it; the cluster tests share one xdist group, so under ``-n 2 --dist loadgroup`` one worker runs them
all.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _photos import PHOTOS, encode, photo
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_arb import BucketBatchSampler, BucketSet, add_bucket_columns
from hf_arb.annotate.arrow_batch import (
    ERROR_BIN,
    BatchAnnotator,
    annotate_batch,
    bucket_columns,
    summary_from_groups,
    summary_partials,
)
from hf_arb.annotate.map import summarize_annotation, summarize_columns
from hf_arb.buckets.schema import BUCKET_COLUMNS, CONFIG_ID_PREFIX, buckets_from_card

BUCKETS = BucketSet.sdxl().replace(max_aspect_error=0.12)
OPTS = dict(max_upscale=2.0, min_size=64)
ROWS = 20_000  # 5 row groups; every kind of odd size occurs (the rarest, beyond int32, ~40 times)


def _sizes_table(n: int = ROWS, seed: int = 0) -> pa.Table:
    """``id``, ``WIDTH``, ``HEIGHT`` (int64), LAION-like, with nulls, zeros, negatives, huge and extreme sizes."""
    rng = np.random.default_rng(seed)
    w = rng.integers(16, 4000, n).astype(np.int64)
    h = (w / np.exp(rng.normal(0, 0.4, n))).astype(np.int64) + 1
    mask_w = rng.random(n) < 0.01  # null widths
    w[rng.random(n) < 0.005] = 0
    h[rng.random(n) < 0.005] = -5
    w[rng.random(n) < 0.002] = 3_000_000_000  # beyond int32
    h[rng.random(n) < 0.01] = 1  # extreme aspect -> "aspect"
    return pa.table({"id": pa.array(np.arange(n)), "WIDTH": pa.array(w, mask=mask_w), "HEIGHT": pa.array(h),
                     "caption": pa.array([f"c{i % 97}" for i in range(n)])})


@pytest.fixture(scope="session")
def sizes_parquet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sizes") / "sizes.parquet"
    pq.write_table(_sizes_table(), path, row_group_size=ROWS // 5)
    return path


@pytest.fixture(scope="session")
def images_parquet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A datasets-written Parquet with an ``Image`` column: real JPEG/PNG bytes, empty bytes, text, null, path."""
    root = tmp_path_factory.mktemp("images")
    rows = [{"bytes": encode(photo(name), "JPEG" if i % 2 else "PNG"), "path": name}
            for i, name in enumerate(sorted(PHOTOS))]
    rows += [{"bytes": b"", "path": "empty.jpg"}, {"bytes": b"not an image", "path": "text.jpg"}, None,
             {"bytes": encode(photo("coffee.png", (40, 30)), "PNG"), "path": "tiny.png"}]
    ds = datasets.Dataset.from_dict({"id": list(range(len(rows))), "image": rows},
                                    features=datasets.Features({"id": datasets.Value("int64"),
                                                                "image": datasets.Image()}))
    path = root / "images.parquet"
    ds.to_parquet(str(path))
    return path


def _reference(path: Path, **kwargs: object) -> datasets.Dataset:
    ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
    return add_bucket_columns(ds, BUCKETS, show_summary=False, **OPTS, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def sizes_reference(sizes_parquet: Path) -> datasets.Dataset:
    return _reference(sizes_parquet, width_column="WIDTH", height_column="HEIGHT")


def _by_id(ds: datasets.Dataset) -> pa.Table:
    t = ds.with_format("arrow")[:]
    return t.take(np.argsort(t.column("id").to_numpy(), kind="stable"))


def _assert_rows_equal(got: datasets.Dataset, want: datasets.Dataset) -> None:
    g, w = _by_id(got), _by_id(want)
    assert g.num_rows == w.num_rows
    assert g.column("id").equals(w.column("id"))
    for c in BUCKET_COLUMNS:
        assert g.column(c).type == w.column(c).type, c
        assert g.column(c).combine_chunks().equals(w.column(c).combine_chunks()), c  # nulls and NaN positions too


def _assert_summary_equal(got, want) -> None:  # type: ignore[no-untyped-def]
    assert got.rows == want.rows
    assert got.skipped_by_reason == want.skipped_by_reason
    assert sorted(got.unreadable_examples) == sorted(want.unreadable_examples)  # order: engine's, not the rows'

    np.testing.assert_array_equal(got.assignment.counts, want.assignment.counts)
    if math.isnan(want.assignment.error_mean):
        assert math.isnan(got.assignment.error_mean)
        return
    assert got.assignment.error_mean == pytest.approx(want.assignment.error_mean, rel=1e-9)
    assert got.assignment.error_max == want.assignment.error_max
    assert abs(got.assignment.error_median - want.assignment.error_median) <= ERROR_BIN


def _check_round_trip(folder: Path, want: datasets.Dataset) -> None:
    """The engine's Parquet loads with datasets, restores the exact BucketSet and feeds the sampler."""
    loaded = datasets.load_dataset("parquet", data_dir=str(folder), split="train")
    _assert_rows_equal(loaded, want)
    assert loaded.features["bucket"].id == CONFIG_ID_PREFIX + BUCKETS.to_json()
    restored = BucketSet.from_dataset(loaded)
    assert restored == BUCKETS and restored.fingerprint == BUCKETS.fingerprint
    sampler = BucketBatchSampler(loaded, 8, seed=1, log_report=False)
    ids = np.asarray(loaded["bucket"])
    batches = list(sampler)
    assert batches and all(len(set(ids[b].tolist())) == 1 and ids[b[0]] >= 0 for b in batches)


#: BUCKETS with a frame axis of 1: the same bucket ids, summarised as a clip set's (frames and fps histograms)
BUCKETS_F = BucketSet([(w, h, 1) for w, h in BUCKETS.resolutions.tolist()]).replace(max_aspect_error=0.12)


def _clip_values(ids: np.ndarray) -> tuple[pa.Array, pa.Array]:
    """``original_frames`` and ``original_fps`` as a function of ``id`` (the Spark test writes the same as Spark
    expressions): hundreds of frame counts and rates (12 ranges each), images (1 frame at fps 0), nulls and NaN."""
    frames = (ids * 7919) % 397 + 1
    fps = ((ids * 104729) % 100003) / 977.0
    image = ids % 10 == 3
    frames, fps = np.where(image, 1, frames), np.where(image, 0.0, np.where(ids % 101 == 0, np.nan, fps))
    null = ids % 50 == 0
    return pa.array(frames, pa.int64(), mask=null), pa.array(fps, pa.float64(), mask=null)


def _clip_view_summary(reference: datasets.Dataset):  # type: ignore[no-untyped-def]
    """The datasets path's summary of the 20k rows read as a clip set (BUCKETS_F, :func:`_clip_values`)."""
    t = reference.with_format("arrow")[:]
    want = summarize_columns(t.column("bucket"), t.column("aspect_error"), t.column("skip_reason"), BUCKETS_F,
                             clips=_clip_values(t.column("id").to_numpy()))
    assert len(want.frames_histogram) == len(want.fps_histogram) == 12  # ranges, not distinct values
    return want


def _assert_histograms_equal(got, want) -> None:  # type: ignore[no-untyped-def]
    assert want.frames_histogram and want.fps_histogram
    assert got.frames_histogram == want.frames_histogram and got.fps_histogram == want.fps_histogram


# ----------------------------------------------------------------------------------- pure, no cluster
def test_arrow_batch_keeps_type_metadata_and_matches_the_core() -> None:
    t = _sizes_table(3000, seed=3)
    batch = t.to_batches(max_chunksize=3000)[0]
    out = annotate_batch(batch, BUCKETS, width_column="WIDTH", height_column="HEIGHT", **OPTS)
    assert isinstance(out, pa.RecordBatch)
    assert out.schema.names == t.column_names + list(BUCKET_COLUMNS)
    again = annotate_batch(pa.Table.from_batches([out]), BUCKETS, width_column="WIDTH", height_column="HEIGHT", **OPTS)
    assert isinstance(again, pa.Table) and again.column_names == out.schema.names  # old columns replaced
    features = datasets.Features.from_arrow_schema(out.schema)
    assert BucketSet.from_dataset(datasets.Dataset(pa.Table.from_batches([out]),
                                                   info=datasets.DatasetInfo(features=features))) == BUCKETS
    cols = bucket_columns(t, BUCKETS, width_column="WIDTH", height_column="HEIGHT", **OPTS)
    assert pa.Table.from_batches([out]).select(list(BUCKET_COLUMNS)).equals(cols)
    with pytest.raises(ValueError, match="'W'.*columns are"):
        bucket_columns(t, BUCKETS, width_column="W", height_column="HEIGHT")
    with pytest.raises(TypeError, match="BucketSet"):
        BatchAnnotator.create("sdxl")  # type: ignore[arg-type]


def test_pickled_annotator_runs_without_importing_datasets(tmp_path: Path) -> None:
    """What a Ray/Spark worker does: unpickle the annotator, map a batch; the metadata was made on the driver."""
    import pickle
    import subprocess

    fn = BatchAnnotator.create(BUCKETS, width_column="WIDTH", height_column="HEIGHT", **OPTS)
    (tmp_path / "fn.pkl").write_bytes(pickle.dumps(fn))
    pq.write_table(_sizes_table(1000), tmp_path / "in.parquet")
    code = ("import pickle, sys, pyarrow.parquet as pq; fn = pickle.load(open(sys.argv[1], 'rb')); "
            "pq.write_table(fn(pq.read_table(sys.argv[2])), sys.argv[3]); assert 'datasets' not in sys.modules")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "fn.pkl"), str(tmp_path / "in.parquet"),
                    str(tmp_path / "out.parquet")], check=True, env={**os.environ,
                                                                     "PYTHONPATH": os.pathsep.join(sys.path)})
    loaded = datasets.load_dataset("parquet", data_files=str(tmp_path / "out.parquet"), split="train")
    assert BucketSet.from_dataset(loaded) == BUCKETS
    assert loaded.features["id"] == datasets.Value("int64")  # left to datasets to infer


def test_summary_from_groups_equals_column_summary() -> None:
    t = bucket_columns(_sizes_table(20_000, seed=5), BUCKETS, width_column="WIDTH", height_column="HEIGHT", **OPTS)
    parts = pa.concat_tables([summary_partials(b) for b in t.to_batches(max_chunksize=3000)])  # 7 partial batches
    g = parts.group_by(["bucket", "skip_reason", "error_bin"]).aggregate(
        [("count", "sum"), ("error_sum", "sum"), ("error_max", "max")])
    assert g.num_rows < parts.num_rows < t.num_rows
    got = summary_from_groups(*(g.column(c).to_pylist() for c in ("bucket", "skip_reason", "error_bin", "count_sum",
                                                                  "error_sum_sum", "error_max_max")), BUCKETS)
    want = summarize_columns(t.column("bucket"), t.column("aspect_error"), t.column("skip_reason"), BUCKETS)
    assert set(want.skipped_by_reason) >= {"missing", "invalid_size", "aspect", "too_small", "upscale"}
    _assert_summary_equal(got, want)


def test_summary_from_groups_counts_slide_windows_as_the_column_summary() -> None:
    """The engines' partial sums of ``frame_start`` (a window: any start; a clip: start 0) give the datasets path's
    ``slide`` (``slide_counts_of``), however the windows of one clip fall into batches; none without windows."""
    from hf_arb.annotate.clips import slide_counts_of

    rng = np.random.default_rng(7)
    n = 3000
    kind = rng.choice(3, n, p=[0.6, 0.3, 0.1])  # 0: a clip, 1: a still, 2: skipped
    counts = np.where(kind == 0, rng.integers(1, 6, n), 1)  # windows per input row
    row = np.repeat(np.arange(n), counts)
    window = np.arange(row.size) - np.repeat(np.cumsum(counts) - counts, counts)
    clip = kind[row] == 0
    ids = np.where(kind[row] == 2, -1, rng.integers(0, len(CLIPS), n)[row])
    t = pa.table({"bucket": pa.array(ids, pa.int32()),
                  "aspect_error": pa.array(np.where(ids >= 0, rng.random(n)[row] * 0.1, np.nan), from_pandas=True),
                  "skip_reason": pa.array([None if i >= 0 else "too_few_frames" for i in ids.tolist()], pa.string()),
                  "frame_start": pa.array((window * 3).astype(np.int32), pa.int32(), mask=~clip)})
    want = summarize_columns(t.column("bucket"), t.column("aspect_error"), t.column("skip_reason"), CLIPS,
                             frame_start=t.column("frame_start"))
    expected = (int((kind == 0).sum()), int(counts[kind == 0].sum()))  # (clips, windows)
    assert want.slide == slide_counts_of(t.column("frame_start")) == expected

    def grouped(table: pa.Table) -> pa.Table:
        parts = pa.concat_tables([summary_partials(b) for b in table.to_batches(max_chunksize=701)])
        return parts.group_by(["bucket", "skip_reason", "error_bin"]).aggregate(
            [("count", "sum"), ("error_sum", "sum"), ("error_max", "max"), ("windows", "sum"), ("clips", "sum")])

    g = grouped(t)
    cols = ("bucket", "skip_reason", "error_bin", "count_sum", "error_sum_sum", "error_max_max")
    got = summary_from_groups(*(g.column(c).to_pylist() for c in cols), CLIPS,
                              windows=g.column("windows_sum").to_pylist(), clips=g.column("clips_sum").to_pylist())
    assert got.slide == want.slide
    assert str(got).splitlines()[1] == str(want).splitlines()[1]  # "slide: N clips -> M rows (K added by windows)"
    _assert_summary_equal(got, want)
    # head / uniform (no start) and an image set (no column): no slide line
    for table in (t.set_column(3, "frame_start", pa.nulls(t.num_rows, pa.int32())), t.drop_columns(["frame_start"])):
        g = grouped(table)
        assert summary_from_groups(*(g.column(c).to_pylist() for c in cols), CLIPS, windows=g.column("windows_sum"),
                                   clips=g.column("clips_sum")).slide is None


def _clip_value_columns(n: int, rng: np.random.Generator, distinct: int) -> tuple[pa.Array, pa.Array]:
    """``original_frames`` (int32) and ``original_fps`` (float32, as the annotation writes them) for ``n`` rows:
    ``distinct`` frame counts and rates (NTSC's 29.97..., VFR averages with many decimals), images (1 frame at fps 0),
    nulls (unreadable rows) and NaN."""
    frames = rng.choice(rng.integers(2, 2000, distinct), n).astype(np.int32)
    fps = rng.choice(np.r_[30000 / 1001, 24000 / 1001, rng.random(max(distinct - 2, 0)) * 120], n).astype(np.float32)
    image = rng.random(n) < 0.1
    frames[image], fps[image] = 1, 0.0
    fps[rng.random(n) < 0.01] = np.nan
    null = rng.random(n) < 0.05
    return pa.array(frames, mask=null), pa.array(fps, mask=null)


@given(seed=st.integers(0, 2**32 - 1), distinct=st.sampled_from([1, 5, 12, 13, 40, 400]),
       chunk=st.integers(97, 700))
@settings(max_examples=15, deadline=None)
def test_histogram_partials_add_up_to_the_datasets_histograms(seed: int, distinct: int, chunk: int) -> None:
    """The engines' frames / fps histograms: rows per value summed over any split into batches (each batch's
    ``summary_partials``, then the engines' groupby) give the datasets path's ``value_histogram`` bars, distinct values
    (<= 12) or 12 ranges alike; an image set's summary shows none."""
    from hf_arb.annotate.summary import value_histogram

    rng = np.random.default_rng(seed)
    n = 1500
    frames, fps = _clip_value_columns(n, rng, distinct)
    ids = rng.integers(-1, len(CLIPS), n)
    t = pa.table({"bucket": pa.array(ids, pa.int32()),
                  "aspect_error": pa.array(np.where(ids >= 0, rng.random(n) * 0.1, np.nan), from_pandas=True),
                  "skip_reason": pa.array([None if i >= 0 else "unreadable: x" for i in ids.tolist()], pa.string()),
                  "original_frames": frames, "original_fps": fps})
    want = summarize_columns(t.column("bucket"), t.column("aspect_error"), t.column("skip_reason"), CLIPS,
                             clips=(frames, fps))
    assert want.frames_histogram == value_histogram(frames, integer=True) and want.fps_histogram
    parts = pa.concat_tables([summary_partials(b) for b in t.to_batches(max_chunksize=chunk)])
    g = parts.group_by(["bucket", "skip_reason", "error_bin"]).aggregate(
        [("count", "sum"), ("error_sum", "sum"), ("error_max", "max")])
    cols = [g.column(c).to_pylist() for c in ("bucket", "skip_reason", "error_bin", "count_sum", "error_sum_sum",
                                              "error_max_max")]
    got = summary_from_groups(*cols, CLIPS)
    assert got.frames_histogram == want.frames_histogram and got.fps_histogram == want.fps_histogram
    assert str(got).splitlines()[-2:] == str(want).splitlines()[-2:]  # "rows per frames (...)", "rows per fps (...)"
    _assert_summary_equal(got, want)  # the histogram rows are not counted as rows or skips
    assert summary_from_groups(*cols, BUCKETS).frames_histogram == ()  # an image set: none


@given(values=st.lists(st.one_of(st.none(), st.integers(0, 10**6)), max_size=300))
@settings(max_examples=100, deadline=None)
def test_value_histogram_of_integers_is_numpys(values: list[int | None]) -> None:
    """The frames histogram, now drawn from rows per value, is the one numpy draws from the values themselves."""
    from hf_arb.annotate.summary import value_histogram

    v = np.asarray([x for x in values if x is not None], dtype=np.float64)
    uniq, counts = np.unique(v, return_counts=True)
    if uniq.size <= 12:
        want = tuple((str(int(u)), int(c)) for u, c in zip(uniq.tolist(), counts.tolist()))
    else:
        counts, edges = np.histogram(v, bins=12)
        lo, hi = np.ceil(edges[:-1]), np.floor(edges[1:]) - np.r_[np.ones(11), 0]
        want = tuple((f"{int(a)}-{int(b)}", int(c)) for a, b, c in zip(lo.tolist(), np.maximum(lo, hi).tolist(),
                                                                       counts.tolist()))
    assert value_histogram(pa.array(values, pa.int64()), integer=True) == want


# ----------------------------------------------------------------------------------- Ray
@pytest.mark.slow
@pytest.mark.xdist_group("engines")  # one worker: the clusters start once and never compete
def test_ray_equals_datasets_map_on_20k_rows(ray_cluster, sizes_parquet: Path, sizes_reference: datasets.Dataset,
                                             tmp_path: Path) -> None:
    from hf_arb.annotate.engines import ray as hf_ray

    ds = ray_cluster.data.read_parquet(str(sizes_parquet))
    out = hf_ray.add_bucket_columns(ds, BUCKETS, width_column="WIDTH", height_column="HEIGHT", **OPTS)
    out = out.materialize()
    out.write_parquet(str(tmp_path / "out"))
    _check_round_trip(tmp_path / "out", sizes_reference)

    def clip_columns(batch: pa.Table) -> pa.Table:  # a clip set's columns, computed as _clip_values does
        ids = batch.column("id").to_numpy()
        frames = (ids * 7919) % 397 + 1
        fps = ((ids * 104729) % 100003) / 977.0
        image = ids % 10 == 3
        frames, fps = np.where(image, 1, frames), np.where(image, 0.0, np.where(ids % 101 == 0, np.nan, fps))
        null = ids % 50 == 0
        return (batch.append_column("original_frames", pa.array(frames, pa.int64(), mask=null))
                .append_column("original_fps", pa.array(fps, pa.float64(), mask=null))
                .append_column("frame_start", pa.nulls(batch.num_rows, pa.int32())))

    # the summary of the same job, read as a clip set's: counts and skips as before, and the frames / fps histograms
    # (12 ranges, summed from the blocks' rows per value) equal to the datasets path's
    got = hf_ray.summarize(out.map_batches(clip_columns, batch_format="pyarrow"), BUCKETS_F)
    want = _clip_view_summary(sizes_reference)
    _assert_summary_equal(got, want)
    _assert_histograms_equal(got, want)


@pytest.mark.slow
@pytest.mark.xdist_group("engines")  # one worker: the clusters start once and never compete
def test_cli_engine_ray_on_image_bytes(ray_cluster, images_parquet: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Ray's image-bytes equality with datasets, through the CLI (which reuses the running cluster)."""
    _check_cli("ray", images_parquet, tmp_path, capsys)


def _check_cli(engine: str, images_parquet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``hf-arb annotate --engine`` (the API underneath, with the source's features) on image bytes."""
    from hf_arb.cli.app import main

    want = _reference(images_parquet)
    assert {"unreadable", "missing", "too_small",
            "upscale"} <= set(summarize_annotation(want, BUCKETS).skipped_by_reason)
    out = tmp_path / "out"
    rc = main(["annotate", str(images_parquet), "--engine", engine, "--output-dir", str(out), "--preset", "sdxl",
               "--max-aspect-error", "0.12", "--max-upscale", "2", "--min-size", "64"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "unreadable 2" in printed and "rows: 12" in printed
    loaded = datasets.load_dataset("parquet", data_dir=str(out), split="train")
    assert BucketSet.from_dataset(loaded) == BUCKETS
    assert buckets_from_card(out / "README.md") == BUCKETS  # the card travels with the files
    assert isinstance(loaded.features["image"], datasets.Image)
    _assert_rows_equal(loaded, want)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exc:  # an argparse error of `hf-arb annotate`
        main(["annotate", str(tmp_path / "empty"), "--engine", engine, "--output-dir", str(tmp_path / "x")])
    assert exc.value.code == 2 and "is not a .parquet file" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- reference columns
EDIT_TARGET = BucketSet.from_budget(256)  # what `hf-arb annotate --resolution 256` builds
EDIT_SMALL = BucketSet.from_budget(128)  # `--reference-policy own --reference-resolution 128`


@pytest.fixture(scope="session")
def pairs_parquet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Before/after pairs (``image``, ``before``: ``Image``) from the bundled photos: odd rows' reference is the
    photo itself, even rows' is half as wide; then a row with unreadable reference bytes, one with no reference,
    and one whose target is broken too (the target's reason wins)."""
    rows: dict[str, list] = {"id": [], "image": [], "before": []}
    for i, name in enumerate(sorted(PHOTOS)):
        im = photo(name).convert("RGB")
        ref = im if i % 2 else im.resize((im.width // 2, im.height))
        rows["image"].append({"bytes": encode(im), "path": None})
        rows["before"].append({"bytes": encode(ref), "path": None})
    good = rows["image"][0]
    for target, before in ((good, {"bytes": b"not an image", "path": None}), (good, None),
                           ({"bytes": b"", "path": None}, {"bytes": b"xx", "path": None})):
        rows["image"].append(target)
        rows["before"].append(before)
    rows["id"] = list(range(len(rows["image"])))
    ds = datasets.Dataset.from_dict(rows, features=datasets.Features(
        {"id": datasets.Value("int64"), "image": datasets.Image(), "before": datasets.Image()}))
    path = tmp_path_factory.mktemp("pairs") / "pairs.parquet"
    ds.to_parquet(str(path))
    return path


def _edit_reference(path: Path, policy: str) -> datasets.Dataset:
    ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
    extra = {"reference_buckets": EDIT_SMALL} if policy == "own" else {}
    return add_bucket_columns(ds, EDIT_TARGET, reference_columns=["before"], reference_policy=policy,
                              show_summary=False, **extra)  # type: ignore[arg-type]


def _check_edit_output(folder: Path, path: Path, policy: str, summary) -> None:  # type: ignore[no-untyped-def]
    """The engine's Parquet has the datasets map's bucket and reference columns row for row, the same policy and
    BucketSets in its features, the same composite key, and the same skip counts."""
    from hf_arb.buckets.references import read_composite, reference_column_names, reference_info

    want = _edit_reference(path, policy)
    got = datasets.load_dataset("parquet", data_dir=str(folder), split="train")
    g, w = _by_id(got), _by_id(want)
    assert g.column("id").equals(w.column("id"))
    for c in (*BUCKET_COLUMNS, *reference_column_names("before")):
        assert g.column(c).type == w.column(c).type, c
        assert g.column(c).combine_chunks().equals(w.column(c).combine_chunks()), c
    reasons = w.column("skip_reason").to_pylist()
    assert sum(str(r).startswith("reference before:") for r in reasons) == 2 and reasons[-1].startswith("unreadable")
    assert reference_info(got.features, "before") == reference_info(want.features, "before")
    assert reference_info(got.features, "before")[1] == (EDIT_SMALL if policy == "own" else EDIT_TARGET)
    assert BucketSet.from_dataset(got) == EDIT_TARGET
    assert isinstance(got.features["before"], datasets.Image)
    ids_g, table_g = read_composite(got.sort("id"))
    ids_w, table_w = read_composite(want)
    np.testing.assert_array_equal(table_g, table_w)
    np.testing.assert_array_equal(ids_g, ids_w)
    expected = summarize_annotation(want, EDIT_TARGET)
    assert expected.skipped_by_reason["reference before"] == 2
    _assert_summary_equal(summary, expected)


@pytest.mark.slow
@pytest.mark.xdist_group("engines")  # one worker: the clusters start once and never compete
def test_ray_reference_columns_equal_datasets_map(ray_cluster, pairs_parquet: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Strict through the Python entry point, own through ``hf-arb annotate --engine ray`` (then ``hf-arb stats``)."""
    from hf_arb.annotate.engines import ray as hf_ray

    features = datasets.Features.from_arrow_schema(pq.read_schema(pairs_parquet))
    out = hf_ray.add_bucket_columns(ray_cluster.data.read_parquet(str(pairs_parquet)), EDIT_TARGET,
                                    features=features, reference_columns=["before"]).materialize()
    out.write_parquet(str(tmp_path / "strict"))
    _check_edit_output(tmp_path / "strict", pairs_parquet, "strict", hf_ray.summarize(out, EDIT_TARGET))
    _check_edit_cli("ray", pairs_parquet, tmp_path, capsys)


def _check_edit_cli(engine: str, path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``hf-arb annotate --engine E --reference-column before --reference-policy own``, and ``hf-arb stats`` of
    its output prints the datasets path's rows per composite bucket."""
    from hf_arb.buckets.references import composite_summary
    from hf_arb.cli.app import main

    out = tmp_path / "own"
    capsys.readouterr()
    assert main(["annotate", str(path), "--engine", engine, "--output-dir", str(out), "--resolution", "256",
                 "--reference-column", "before", "--reference-policy", "own", "--reference-resolution", "128"]) == 0
    assert "reference before 2" in capsys.readouterr().out
    got = datasets.load_dataset("parquet", data_dir=str(out), split="train")
    _check_edit_output(out, path, "own", summarize_annotation(got, EDIT_TARGET))
    assert main(["stats", str(out)]) == 0
    assert composite_summary(_edit_reference(path, "own")) in capsys.readouterr().out


# ----------------------------------------------------------------------------------- clips (issue 37)
CLIPS = BucketSet([(w, h, f) for f in (1, 5, 9) for (w, h) in ((64, 48), (48, 64))])


@pytest.fixture(scope="session")
def clips_parquet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A datasets-written Parquet with a ``Video`` column: real H.264/VP9 bytes (one rotated), a JPEG still, a cut
    clip, empty bytes and a null."""
    pytest.importorskip("av")
    from hf_arb.testing.clips import panning_frames, write_clip

    frames = panning_frames(np.asarray(photo("astronaut.png")), 13)
    mp4 = write_clip(None, frames[:9])
    rows = [{"bytes": mp4, "path": "a.mp4"}, {"bytes": write_clip(None, frames, suffix=".webm"), "path": "b.webm"},
            {"bytes": write_clip(None, frames[:5], rotation=90), "path": "rot.mp4"},
            {"bytes": encode(photo("coffee.png", (64, 48)), "JPEG"), "path": "still.jpg"},
            {"bytes": mp4[: len(mp4) // 2], "path": "cut.mp4"}, {"bytes": b"", "path": "empty.mp4"}, None]
    ds = datasets.Dataset.from_dict({"id": list(range(len(rows))), "video": rows},
                                    features=datasets.Features({"id": datasets.Value("int64"),
                                                                "video": datasets.Video()}))
    path = tmp_path_factory.mktemp("clips") / "clips.parquet"
    ds.to_parquet(str(path))
    return path


def _clip_reference(path: Path) -> datasets.Dataset:
    ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
    return add_bucket_columns(ds, CLIPS, show_summary=False)


def _assert_clip_rows_equal(got: datasets.Dataset, want: datasets.Dataset) -> None:
    from hf_arb.buckets.schema import CLIP_BUCKET_COLUMNS

    g, w = _by_id(got), _by_id(want)
    for c in (*BUCKET_COLUMNS, *CLIP_BUCKET_COLUMNS):
        assert g.column(c).combine_chunks().equals(w.column(c).combine_chunks()), c
    assert BucketSet.from_dataset(got) == CLIPS  # the frame axis travels in the files


@pytest.mark.slow
@pytest.mark.xdist_group("engines")  # one worker: the clusters start once and never compete
def test_cli_engine_ray_on_clip_bytes(ray_cluster, clips_parquet: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``hf-arb annotate --engine ray --frames 1,5,9 --frame-sampling slide`` on a Parquet with a ``Video`` column
    (detected): the datasets path's rows (the 13-frame WebM clip, 9-frame windows 2 frames apart: 3 rows), the
    (W, H, F) set in the files and the card, and Ray's summary (``summarize``, the Python entry point the CLI calls)
    counts the clips and windows as the datasets path's does."""
    from hf_arb.cli.app import main

    ds = datasets.load_dataset("parquet", data_files=str(clips_parquet), split="train")
    want = add_bucket_columns(ds, CLIPS, frame_sampling="slide", slide_stride=2, show_summary=False)
    assert set(want["skip_reason"]) == {None, "missing", "unreadable: truncated or corrupt container",
                                        "unreadable: empty (0 bytes)"}
    want_summary = summarize_annotation(want, CLIPS)
    assert want_summary.slide == (3, 5) and len(want) == len(ds) + 2
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["annotate", str(clips_parquet), "--engine", "ray", "--output-dir", str(out), "--aspect-ratio-buckets",
                 "48,64;64,48", "--frames", "1,5,9", "--metric", "log", "--frame-sampling", "slide",
                 "--slide-stride", "2"]) == 0
    printed = capsys.readouterr().out
    assert "unreadable 2" in printed
    assert str(want_summary).splitlines()[:2] == [  # rows, then "slide: 3 clips -> 5 rows (2 added by windows)"
        line for line in printed.splitlines() if line.startswith(("rows: ", "slide: "))]
    hists = [line for line in str(want_summary).splitlines() if line.startswith("rows per f")]
    assert len(hists) == 2 and all(line in printed.splitlines() for line in hists)  # the frames and fps histograms
    _assert_clip_rows_equal(datasets.load_dataset("parquet", data_dir=str(out), split="train"), want)
    assert buckets_from_card(out / "README.md") == CLIPS


# ----------------------------------------------------------------------------------- Spark
# After every Ray test (here and in test_encoded.py, collected earlier): tests/conftest.py stops each cluster after
# its last test, so the Ray daemons and Spark's JVM never idle through the other engine's tests.
@pytest.mark.slow
@pytest.mark.xdist_group("engines")  # one worker: the clusters start once and never compete
def test_spark_equals_datasets_map_on_20k_rows(spark, sizes_parquet: Path, sizes_reference: datasets.Dataset,
                                               tmp_path: Path) -> None:
    from hf_arb.annotate.engines import spark as hf_spark

    df = spark.read.parquet(str(sizes_parquet))
    out = hf_spark.add_bucket_columns(df, BUCKETS, width_column="WIDTH", height_column="HEIGHT", **OPTS).cache()
    hf_spark.write_parquet(out, str(tmp_path / "out"), BUCKETS)
    assert not (tmp_path / "out" / "_temporary").exists()
    _check_round_trip(tmp_path / "out", sizes_reference)
    from pyspark.sql import functions as F

    ids = F.col("id")  # a clip set's columns, as _clip_values computes them
    null, image = ids % 50 == 0, ids % 10 == 3
    clip = out.select(
        "bucket", "aspect_error", "skip_reason", F.lit(None).cast("int").alias("frame_start"),
        F.when(null, None).when(image, 1).otherwise(ids * 7919 % 397 + 1).alias("original_frames"),
        F.when(null, None).when(image, 0.0).when(ids % 101 == 0, float("nan"))
        .otherwise(ids * 104729 % 100003 / F.lit(977.0)).alias("original_fps"))
    # the summary of the same job, read as a clip set's: counts and skips as before, and the frames / fps histograms
    # (12 ranges, summed from the partitions' rows per value) equal to the datasets path's
    got = hf_spark.summarize(clip, BUCKETS_F)
    want = _clip_view_summary(sizes_reference)
    _assert_summary_equal(got, want)
    _assert_histograms_equal(got, want)
    out.unpersist()


@pytest.mark.slow
@pytest.mark.xdist_group("engines")  # one worker: the clusters start once and never compete
def test_spark_equals_datasets_map_on_image_bytes(spark, images_parquet: Path, tmp_path: Path) -> None:
    from hf_arb.annotate.engines import spark as hf_spark

    want = _reference(images_parquet)
    df = spark.read.parquet(str(images_parquet))
    out = hf_spark.add_bucket_columns(df, BUCKETS, **OPTS)
    features = datasets.Features.from_arrow_schema(pq.read_schema(images_parquet))
    hf_spark.write_parquet(out, str(tmp_path / "out"), BUCKETS, features=features)
    loaded = datasets.load_dataset("parquet", data_dir=str(tmp_path / "out"), split="train")
    _assert_rows_equal(loaded, want)
    assert isinstance(loaded.features["image"], datasets.Image)
    assert BucketSet.from_dataset(loaded) == BUCKETS
    _assert_summary_equal(hf_spark.summarize(out, BUCKETS), summarize_annotation(want, BUCKETS))


@pytest.mark.slow
@pytest.mark.xdist_group("engines")  # one worker: the clusters start once and never compete
def test_cli_engine_spark_on_image_bytes(spark, images_parquet: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    _check_cli("spark", images_parquet, tmp_path, capsys)


@pytest.mark.slow
@pytest.mark.xdist_group("engines")  # one worker: the clusters start once and never compete
def test_spark_reference_columns_equal_datasets_map(spark, pairs_parquet: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from hf_arb.annotate.engines import spark as hf_spark

    features = datasets.Features.from_arrow_schema(pq.read_schema(pairs_parquet))
    refs = dict(reference_columns=["before"], reference_policy="strict")
    out = hf_spark.add_bucket_columns(spark.read.parquet(str(pairs_parquet)), EDIT_TARGET, **refs).cache()
    hf_spark.write_parquet(out, str(tmp_path / "strict"), EDIT_TARGET, features=features, **refs)
    _check_edit_output(tmp_path / "strict", pairs_parquet, "strict", hf_spark.summarize(out, EDIT_TARGET))
    out.unpersist()
    _check_edit_cli("spark", pairs_parquet, tmp_path, capsys)


@pytest.mark.slow
@pytest.mark.xdist_group("engines")  # one worker: the clusters start once and never compete
def test_spark_equals_datasets_map_on_clip_bytes(spark, clips_parquet: Path, tmp_path: Path) -> None:
    from hf_arb.annotate.engines import spark as hf_spark

    want = _clip_reference(clips_parquet)
    out = hf_spark.add_bucket_columns(spark.read.parquet(str(clips_parquet)), CLIPS, image_column=None,
                                      video_column="video")
    features = datasets.Features.from_arrow_schema(pq.read_schema(clips_parquet))
    hf_spark.write_parquet(out, str(tmp_path / "out"), CLIPS, features=features)
    loaded = datasets.load_dataset("parquet", data_dir=str(tmp_path / "out"), split="train")
    _assert_clip_rows_equal(loaded, want)
    assert isinstance(loaded.features["video"], datasets.Video)


@pytest.mark.slow
@pytest.mark.xdist_group("engines")  # one worker: the clusters start once and never compete
def test_spark_slide_windows_equal_datasets_map(spark, clips_parquet: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """``frame_sampling="slide"`` changes the row count inside the one Arrow-batch function: Spark's ``mapInArrow``
    gives the datasets path's rows (the 13-frame WebM clip, 9-frame windows 2 frames apart: 3 rows); Spark's
    ``summarize`` counts the clips and windows as the datasets path's summary does, and ``hf-arb annotate --engine
    spark --frame-sampling slide`` prints them."""
    from hf_arb.annotate.engines import spark as hf_spark
    from hf_arb.annotate.summary import summarize_annotation
    from hf_arb.cli.app import main

    ds = datasets.load_dataset("parquet", data_files=str(clips_parquet), split="train")
    want = add_bucket_columns(ds, CLIPS, frame_sampling="slide", slide_stride=2, show_summary=False)
    assert [r["frame_start"] for r in want.select_columns(["id", "frame_start"]).to_list() if r["id"] == 1] == [0, 2, 4]
    out = hf_spark.add_bucket_columns(spark.read.parquet(str(clips_parquet)), CLIPS, image_column=None,
                                      video_column="video", frame_sampling="slide", slide_stride=2)
    features = datasets.Features.from_arrow_schema(pq.read_schema(clips_parquet))
    hf_spark.write_parquet(out, str(tmp_path / "out"), CLIPS, features=features)
    loaded = datasets.load_dataset("parquet", data_dir=str(tmp_path / "out"), split="train")
    assert len(loaded) == len(want) == len(ds) + 2
    key = ["id", "frame_start"]
    got_rows = sorted(loaded.remove_columns(["video"]).to_list(), key=lambda r: (r["id"], r["frame_start"] or 0))
    want_rows = sorted(want.remove_columns(["video"]).to_list(), key=lambda r: (r["id"], r["frame_start"] or 0))
    assert [[r[k] for k in key] for r in got_rows] == [[r[k] for k in key] for r in want_rows]
    assert got_rows == want_rows
    want_summary = summarize_annotation(want, CLIPS)
    assert str(summarize_annotation(loaded, CLIPS)).splitlines()[1] == "slide: 3 clips -> 5 rows (2 added by windows)"
    got = hf_spark.summarize(spark.read.parquet(str(tmp_path / "out")), CLIPS)  # the Python entry point (native)
    assert got.slide == want_summary.slide == (3, 5)
    assert str(got).splitlines()[:2] == str(want_summary).splitlines()[:2]  # rows, then the slide line
    _assert_summary_equal(got, want_summary)
    _assert_histograms_equal(got, want_summary)  # rows (windows) per frame count and rate, the datasets path's
    capsys.readouterr()
    assert main(["annotate", str(clips_parquet), "--engine", "spark", "--output-dir", str(tmp_path / "cli"),
                 "--aspect-ratio-buckets", "48,64;64,48", "--frames", "1,5,9", "--metric", "log",
                 "--frame-sampling", "slide", "--slide-stride", "2"]) == 0
    printed = capsys.readouterr().out
    assert str(want_summary).splitlines()[:2] == [line for line in printed.splitlines()
                                                  if line.startswith(("rows: ", "slide: "))]
