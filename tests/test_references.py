"""Reference images as first-class columns (issue #26): annotation under both policies, the composite batch key,
and batches that always stack on every rank."""

from __future__ import annotations

import functools
from pathlib import Path

import datasets
import numpy as np
import pytest
from _photos import PHOTOS, encode, photo
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_arb import BucketBatchSampler, BucketSet
from hf_arb.annotate.arrow_batch import BatchAnnotator
from hf_arb.annotate.core import annotate_sizes
from hf_arb.annotate.map import add_bucket_columns
from hf_arb.annotate.references import annotate_references
from hf_arb.buckets.references import (
    composite_bucket_ids,
    composite_summary,
    read_composite,
    reference_info,
    stored_reference_columns,
)
from hf_arb.sampling.composite import composite_sampler

TARGET = BucketSet.from_budget(256)
SMALL = BucketSet.from_budget(128)


@functools.lru_cache(maxsize=2)  # datasets are immutable: every test gets the same rows, encoded once
def pairs(broken: int | None = 3) -> datasets.Dataset:
    """Before/after pairs from the bundled photos: odd rows share the target's size, even rows have a reference of
    half the width; row ``broken`` has an unreadable reference."""
    rows: dict[str, list] = {"image": [], "before": [], "text": []}
    for i, name in enumerate(PHOTOS):
        im = photo(name)
        ref = im if i % 2 else im.resize((im.width // 2, im.height))
        rows["image"].append({"bytes": encode(im, "PNG"), "path": None})
        rows["before"].append({"bytes": b"not an image" if i == broken else encode(ref, "PNG"), "path": None})
        rows["text"].append(f"make it {name}")
    return datasets.Dataset.from_dict(rows, features=datasets.Features(
        {"image": datasets.Image(), "before": datasets.Image(), "text": datasets.Value("string")}))


@pytest.fixture(scope="module")
def edit_ds() -> datasets.Dataset:
    return pairs()


# ----------------------------------------------------------------------------------- annotation
def test_strict_reference_takes_the_target_bucket_and_a_broken_one_skips_its_row(edit_ds) -> None:
    out = add_bucket_columns(edit_ds, TARGET, reference_columns=["before"], show_summary=False)
    t = out.select_columns(["bucket", "before_bucket", "before_bucket_width", "bucket_width", "before_width",
                            "skip_reason"]).to_pandas()
    assert t.loc[3, "bucket"] == -1 and t.loc[3, "skip_reason"].startswith("reference before: unreadable")
    kept = t["bucket"] >= 0
    assert kept.sum() == len(PHOTOS) - 1
    assert (t.loc[kept, "before_bucket"] == t.loc[kept, "bucket"]).all()
    assert (t.loc[kept, "before_bucket_width"] == t.loc[kept, "bucket_width"]).all()
    # header sizes: even rows have a reference of half the width
    widths = [w for w, _ in PHOTOS.values()]
    assert t.loc[0, "before_width"] == widths[0] // 2 and t.loc[1, "before_width"] == widths[1]
    assert reference_info(out.features, "before")[0] == "strict"
    assert stored_reference_columns(out.features) == ("before",)


def test_own_reference_gets_its_own_bucket_set(edit_ds) -> None:
    out = add_bucket_columns(edit_ds, TARGET, reference_columns=["before"], reference_policy="own",
                             reference_buckets=SMALL, show_summary=False)
    policy, stored = reference_info(out.features, "before")
    assert policy == "own" and stored == SMALL
    t = out.select_columns(["bucket", "before_bucket", "before_width", "before_height", "before_bucket_width",
                            "before_bucket_height"]).to_pandas()
    kept = t["bucket"] >= 0
    ids, _ = SMALL.assign(t.loc[kept, "before_width"].to_numpy(float), t.loc[kept, "before_height"].to_numpy(float))
    assert (t.loc[kept, "before_bucket"].to_numpy() == ids).all()
    res = np.asarray(SMALL.resolutions)[ids]
    assert (t.loc[kept, "before_bucket_width"].to_numpy() == res[:, 0]).all()
    assert (t.loc[~kept, "before_bucket"] == -1).all()


def test_every_engine_path_gives_the_same_columns(edit_ds) -> None:
    """datasets map-style, streaming, and the engines' BatchAnnotator run one Arrow-batch function."""
    kw = dict(reference_columns=["before"], reference_policy="own", reference_buckets=SMALL)
    mapped = add_bucket_columns(edit_ds, TARGET, show_summary=False, batch_size=3, **kw)
    streamed = add_bucket_columns(edit_ds.to_iterable_dataset(), TARGET, batch_size=5, **kw)
    cols = ["bucket", "before_bucket", "before_width", "skip_reason"]
    want = mapped.select_columns(cols).to_dict()
    got = {c: [r[c] for r in streamed] for c in cols}
    assert got == want
    raw = edit_ds.cast_column("image", datasets.Image(decode=False)).cast_column("before", datasets.Image(decode=False))
    table = raw.with_format("arrow")[:]
    fn = BatchAnnotator.create(TARGET, **kw)
    engine = fn(table.to_batches(max_chunksize=4)[0])
    assert engine.column("before_bucket").to_pylist() == want["before_bucket"][:4]
    assert "before_bucket" in fn.input_columns or "before" in fn.input_columns


def test_reference_core_is_vectorised_and_skips_like_a_target() -> None:
    w, h = np.array([512, 512, 300, np.nan]), np.array([512, 256, 600, 200])
    target = annotate_sizes(w, h, TARGET)
    refs = {"a": (np.array([100, np.nan, 300, 50]), np.array([100, 80, 600, 50]), [None, None, None, None])}
    out = annotate_references(target, refs, TARGET, policy="strict")
    assert out.column("bucket").to_pylist()[:2] == [target.column("bucket")[0].as_py(), -1]
    assert out.column("skip_reason").to_pylist()[1] == "reference a: missing"
    assert out.column("skip_reason").to_pylist()[3] == "missing"  # the target's own reason wins
    assert out.column("a_bucket").to_pylist() == out.column("bucket").to_pylist()


def test_bad_policy_and_reference_buckets_under_strict_are_refused(edit_ds) -> None:
    with pytest.raises(ValueError, match="reference_policy"):
        add_bucket_columns(edit_ds, TARGET, reference_columns=["before"], reference_policy="loose")
    with pytest.raises(ValueError, match="applies to reference_policy='own'"):
        add_bucket_columns(edit_ds, TARGET, reference_columns=["before"], reference_buckets=SMALL)
    with pytest.raises(ValueError, match="no such column"):
        add_bucket_columns(edit_ds, TARGET, reference_columns=["after"], show_summary=False)


# ----------------------------------------------------------------------------------- composite key
def test_composite_ids_group_equal_tuples_only() -> None:
    t, r = np.array([0, 0, 1, 1, -1, 0]), np.array([2, 3, 2, 2, 0, 2])
    ids, table = composite_bucket_ids(t, [r])
    assert ids[4] == -1
    assert table.tolist() == [[0, 2], [0, 3], [1, 2]]
    assert (table[ids[ids >= 0]] == np.stack([t, r], 1)[ids >= 0]).all()


def _check_stacks(ids: np.ndarray, table: np.ndarray, target: np.ndarray, refs: np.ndarray, world: int,
                  batch: int, seed: int, leftover: str = "fill") -> None:
    """Every batch of every rank has one target bucket and one bucket per reference; ranks agree at each step."""
    ranks = [BucketBatchSampler(ids, batch, num_replicas=world, rank=r, seed=seed, log_report=False,
                                leftover=leftover)
             for r in range(world)]
    per_rank = [list(s.shard(r)) for r, s in enumerate(ranks)]
    assert len({len(p) for p in per_rank}) == 1 and len(per_rank[0]) > 0
    for step in zip(*per_rank):
        keys = {(int(target[i]), *map(int, refs[i])) for b in step for i in b}
        assert len(keys) == 1, keys
        assert all(len(b) == batch for b in step)


@pytest.mark.filterwarnings("ignore::UserWarning")
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(60, 200), k=st.integers(1, 4), r=st.integers(1, 2), world=st.sampled_from([2, 3]),
       seed=st.integers(0, 2**16), strict=st.booleans())
def test_batches_of_four_never_mix_reference_shapes(n, k, r, world, seed, strict) -> None:
    rng = np.random.default_rng(seed)
    target = rng.integers(-1, k, n)
    refs = (np.repeat(target[:, None], r, 1) if strict else rng.integers(0, 3, (n, r)))
    refs[target < 0] = -1
    ids, table = composite_bucket_ids(target, list(refs.T))
    _check_stacks(ids, table, target, refs, world, 4, seed)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("policy", ["strict", "own"])
@pytest.mark.parametrize("world", [2, 3])
def test_composite_sampler_on_annotated_pairs(policy, world) -> None:
    """Many rows of the photo pairs (tiled), real annotation, batch 4: shapes never mix on any rank."""
    base = pairs(broken=None)
    ds = datasets.concatenate_datasets([base] * 12)
    kw = {"reference_buckets": SMALL} if policy == "own" else {}
    ann = add_bucket_columns(ds, TARGET, reference_columns=["before"], reference_policy=policy, show_summary=False,
                             **kw)
    sampler, table = composite_sampler(ann, 4, num_replicas=world, seed=1, log_report=False)
    target, ref = np.asarray(ann["bucket"]), np.asarray(ann["before_bucket"])[:, None]
    ids, _ = read_composite(ann)
    _check_stacks(ids, table, target, ref, world, 4, 1, leftover="drop")
    _check_stacks(ids, table, target, ref, world, 4, 1, leftover="fill")
    rep = sampler.report()
    assert sum(rep.rows_per_bucket.values()) == int((ids >= 0).sum())
    assert set(rep.rows_per_bucket) <= set(range(len(table)))
    # resume: a state saved mid-epoch restores the same remaining batches
    it = iter(sampler)
    first = [next(it) for _ in range(world)]
    state = sampler.state_dict()
    rest = list(it)
    again, _ = composite_sampler(ann, 4, num_replicas=world, seed=1, log_report=False)
    again.load_state_dict(state)
    assert list(again) == rest and first


def test_stats_counts_rows_per_composite_bucket(edit_ds) -> None:
    ann = add_bucket_columns(edit_ds, TARGET, reference_columns=["before"], reference_policy="own",
                             reference_buckets=SMALL, show_summary=False)
    text = composite_summary(ann)
    ids, table = read_composite(ann)
    assert "rows per composite bucket (target + before)" in text
    assert sum(int(line.split()[-2]) for line in text.splitlines()[1:1 + len(table)]) == int((ids >= 0).sum())
    assert "saved" in text
    strict = add_bucket_columns(edit_ds, TARGET, reference_columns=["before"], show_summary=False)
    assert "0.0% saved" in composite_summary(strict)


# ----------------------------------------------------------------------------------- data
def _dataset(policy: str, broken: int | None, **kw):
    from hf_arb.images.references import BucketedReferenceDataset

    extra = {"reference_buckets": SMALL} if policy == "own" else {}
    ann = add_bucket_columns(pairs(broken=broken), TARGET, reference_columns=["before"], reference_policy=policy,
                             show_summary=False, **extra)
    sampler, table = composite_sampler(ann, 2, num_replicas=1, seed=0, return_keys=True, log_report=False,
                                       leftover="fill")
    return ann, sampler, BucketedReferenceDataset(ann, composite=table, caption_column="text", **kw), table


def test_strict_reference_is_cut_at_the_target_crop() -> None:
    """Odd rows' reference is the target image itself: under strict its pixels equal the target's exactly."""
    ann, sampler, data, table = _dataset("strict", None, random_flip=True, seed=3)
    seen = 0
    for keys in sampler:
        batch = data.collate([data[k] for k in keys])
        ref = batch["reference_pixel_values"][0]
        assert ref.shape == batch["pixel_values"].shape
        assert (batch["reference_crop_top_lefts"][:, 0] == batch["crop_top_lefts"]).all()
        for i, row in enumerate(batch["rows"].tolist()):
            if row % 2:
                assert (ref[i] == batch["pixel_values"][i]).all()
                seen += 1
    assert seen > 0


def test_own_reference_has_its_composite_shape_and_relative_crop() -> None:
    ann, sampler, data, table = _dataset("own", None)
    res = np.asarray(SMALL.resolutions)
    for keys in sampler:
        batch = data.collate([data[k] for k in keys])
        (_, k, _) = keys[0]
        w, h = res[table[k, 1]]
        assert batch["reference_pixel_values"][0].shape[-2:] == (h, w)
        assert batch["pixel_values"].shape[-2:] == tuple(np.asarray(TARGET.resolutions)[table[k, 0]][::-1])


def test_reference_plan_keeps_the_relative_offset() -> None:
    from hf_arb.images.geometry import plan_fit
    from hf_arb.images.references import reference_plan

    target = plan_fit((600, 400), (256, 256), crop="random", rng=np.random.default_rng(0))
    own = reference_plan(target, (300, 200), (128, 128))
    tx = target.crop_left / (target.scaled_size[0] - 256)
    ox = own.crop_left / (own.scaled_size[0] - 128)
    assert abs(tx - ox) <= 1 / (own.scaled_size[0] - 128)
    strict = reference_plan(target, (300, 200))
    assert strict.source_box == tuple(c / 2 for c in target.source_box)


def test_broken_reference_is_substituted_and_counted(tmp_path) -> None:
    """A reference that header-reads but does not decode: the row is replaced by one of its composite bucket."""
    from hf_arb.images.references import BucketedReferenceDataset

    ds = pairs(broken=None)
    good = ds.cast_column("before", datasets.Image(decode=False))
    cell = good[0]["before"]
    truncated = {"bytes": cell["bytes"][: len(cell["bytes"]) // 3], "path": None}  # header intact, body cut
    rows = good.to_dict()
    rows["before"][0] = truncated
    ds = datasets.Dataset.from_dict(rows, features=good.features)
    ann = add_bucket_columns(ds, TARGET, reference_columns=["before"], show_summary=False)
    assert ann[0]["bucket"] >= 0  # header-only annotation keeps it
    _, table = read_composite(ann)
    ids, _ = read_composite(ann)
    data = BucketedReferenceDataset(ann, composite=table, caption_column="text",
                                    bad_image_log=tmp_path / "skipped_rows.jsonl")
    sample = data[(0, int(ids[0]), 0)]
    assert sample["row"] != 0 and ids[sample["row"]] == ids[0]
    assert data.bad_images.count >= 1 and (tmp_path / "skipped_rows.jsonl").read_text().count('"row": 0') == 1
    strict = BucketedReferenceDataset(ann, composite=table, caption_column="text", on_bad_image="error")
    with pytest.raises(Exception, match="reference image in column 'before'"):
        strict[(0, int(ids[0]), 0)]


# ----------------------------------------------------------------------------------- CLI
def test_cli_annotate_reference_column_and_stats(tmp_path, capsys) -> None:
    from hf_arb.cli.app import main

    pairs(broken=3).save_to_disk(str(tmp_path / "pairs"))
    out = tmp_path / "pairs-own"
    assert main(["annotate", str(tmp_path / "pairs"), "--output-dir", str(out), "--resolution", "256",
                 "--reference-column", "before", "--reference-policy", "own", "--reference-resolution", "128"]) == 0
    ann = datasets.load_from_disk(str(out))["train"]
    assert reference_info(ann.features, "before") == ("own", SMALL)
    row = ann.select_columns(["bucket", "skip_reason"])[3]
    assert row["bucket"] == -1 and row["skip_reason"].startswith("reference before:")
    capsys.readouterr()
    pytest.importorskip("matplotlib")
    assert main(["stats", str(out), "--plot", str(tmp_path / "chart.png")]) == 0
    text = capsys.readouterr().out
    assert "reference before" in text and "rows per composite bucket (target + before)" in text
    # one line per composite bucket: its rows and share of the kept rows, as the composite ids count them
    from hf_arb.buckets.references import composite_label_counts

    counts = composite_label_counts(ann)
    kept = sum(counts.values())
    assert kept == len(PHOTOS) - 1 and len(counts) >= 2
    for label, n in counts.items():
        assert f"  {label:<28} {n:>8}  {100 * n / kept:5.1f}%" in text
    chart = tmp_path / "chart_composite.png"
    assert f"composite chart: {chart}" in text
    from PIL import Image

    with Image.open(chart) as im:
        assert im.format == "PNG" and im.width >= 600
    with pytest.raises(SystemExit):
        main(["annotate", str(tmp_path / "pairs"), "--output-dir", str(tmp_path / "x"), "--reference-column",
              "before", "--reference-resolution", "128"])  # --reference-resolution needs --reference-policy own


# ----------------------------------------------------------------------------------- weighting, report, streaming
@pytest.fixture(scope="module")
def tiled(edit_ds) -> dict:
    """The photo pairs (with a broken reference) annotated under each policy and tiled 12 times: 96 rows."""
    ds = edit_ds
    return {policy: datasets.concatenate_datasets([add_bucket_columns(
        ds, TARGET, reference_columns=["before"], reference_policy=policy, show_summary=False,
        **({"reference_buckets": SMALL} if policy == "own" else {}))] * 12) for policy in ("strict", "own")}


def test_composite_lookup_equals_composite_ids() -> None:
    rng = np.random.default_rng(0)
    t, r = rng.integers(-1, 5, 500), rng.integers(0, 7, (500, 2))
    ids, table = composite_bucket_ids(t, list(r.T))
    from hf_arb.sampling.composite import composite_lookup

    np.testing.assert_array_equal(composite_lookup(t, list(r.T), table), ids)
    shuffled = rng.permutation(len(table))
    got = composite_lookup(t, list(r.T), table[shuffled])  # any row order of the table
    np.testing.assert_array_equal(np.where(got >= 0, shuffled[np.maximum(got, 0)], -1), ids)
    assert (composite_lookup([9, 0], [[0, 99], [0, 0]], table) == -1).all()  # tuples not in the table are skipped
    with pytest.raises(ValueError, match="bucket columns"):
        composite_lookup(t, [r[:, 0]], table)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("policy", ["strict", "own"])
def test_composite_weighting_and_report_count_composite_buckets(tiled, policy) -> None:
    """Each composite bucket gets steps in proportion to its rows (its full global batches), and the report's
    rows per bucket are the rows per composite id."""
    ann = tiled[policy]
    ids, table = read_composite(ann)
    counts = np.bincount(ids[ids >= 0], minlength=len(table))
    assert (counts > 0).sum() >= 2
    if policy == "own":  # composites that share a target bucket are kept apart
        assert len(np.unique(table[:, 0])) < len(table)
    sampler, _ = composite_sampler(ann, 2, num_replicas=2, seed=0, log_report=False, leftover="drop")
    rep = sampler.report()
    assert rep.rows_per_bucket == {k: int(c) for k, c in enumerate(counts) if c}
    assert rep.batches_per_bucket == {k: int(c) // 4 for k, c in enumerate(counts) if c >= 4}
    seen = np.zeros(len(table), int)
    for batch in sampler.shard(0):  # rank 0's batch of every step: its composite id is the step's
        seen[ids[batch[0]]] += 1
    np.testing.assert_array_equal(seen, counts // 4)


def _stream_rows(stream) -> list:  # type: ignore[no-untyped-def]
    return [[(r["composite_bucket"], r["bucket"], r["before_bucket"]) for r in batch] for batch in stream]


@pytest.mark.parametrize("policy", ["strict", "own"])
@pytest.mark.parametrize("world", [2, 3])
def test_composite_stream_never_mixes_reference_shapes(tiled, policy, world) -> None:
    """The streamed batches (``BucketedStream`` over the composite column, ranks simulated in one process): every
    step's ``world`` batches of 4 hold one composite bucket, so one target and one reference shape; a state saved
    mid-epoch resumes to the same remaining batches."""
    from hf_arb.sampling.composite import composite_stream

    ann = tiled[policy]
    ids, table = read_composite(ann)
    counts = np.bincount(ids[ids >= 0], minlength=len(table))
    src = ann.select_columns(["bucket", "before_bucket"]).to_iterable_dataset(num_shards=6)
    kw = dict(table=table, counts=counts, num_replicas=world, seed=1, buffer_size=64, snapshot_every=8)
    stream = composite_stream(src, 4, **kw)
    items = _stream_rows(stream)
    assert len(items) == world * stream.steps_per_epoch and stream.steps_per_epoch >= 3
    for s in range(stream.steps_per_epoch):
        step = items[s * world:(s + 1) * world]
        keys = {row for batch in step for row in batch}
        assert len({k[0] for k in keys}) == 1 and all(len(b) == 4 for b in step), keys
        (k, target, ref), = {(int(k), int(t), int(r)) for k, t, r in keys}
        assert table[k].tolist() == [target, ref] and k >= 0
    assert set(stream.report().batches_per_bucket) <= set(np.flatnonzero(counts).tolist())
    with pytest.raises(ValueError, match="same reference columns"):
        composite_stream(src, 4, **{**kw, "table": table[:, :1]})
    # resume after 2 steps
    again = composite_stream(src, 4, **kw)
    it = iter(again)
    head = [next(it) for _ in range(2 * world)]
    state = again.state_dict(step=2)
    resumed = composite_stream(src, 4, **kw)
    resumed.load_state_dict(state)
    assert _stream_rows(head) == items[:2 * world]
    assert _stream_rows(resumed) == items[2 * world:]


def test_edit_docs_numbers_are_real() -> None:
    """docs/edit.md's `hf-arb stats` lines (rows and share per composite bucket, reference pixels) are what the
    three annotations of its example print (`--resolution 512` is ``from_budget(512)``)."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "edit.md").read_text()
    big, ref = BucketSet.from_budget(512), BucketSet.from_budget(256)
    for kw in ({}, {"reference_policy": "own", "reference_buckets": ref}, {"reference_policy": "own"}):
        ann = add_bucket_columns(pairs(broken=None), big, reference_columns=["before"], show_summary=False, **kw)
        text = composite_summary(ann)
        assert text in doc, text


def test_cached_latents_see_the_replacement_rows_references(tmp_path) -> None:
    """--cache_latents with an encoder that sees the reference pixels (Qwen-Image-Edit): a row whose reference
    failed to decode when the cache was built holds its replacement's latents, and the pixels handed to the encoder
    are that replacement's references too (not the broken file, not another row's)."""
    import torch

    from hf_arb.images.references import BucketedReferenceDataset
    from hf_arb.train.cache.latent_dataset import CachedLatentDataset, CachedLatentsWithReferences
    from hf_arb.train.cache.latents import LatentCache, build_index, fill_cache

    good = pairs(broken=None).cast_column("before", datasets.Image(decode=False))
    rows = good.to_dict()
    cell = rows["before"][0]
    rows["before"][0] = {"bytes": cell["bytes"][: len(cell["bytes"]) // 3], "path": None}  # header reads, body cut
    ann = add_bucket_columns(datasets.Dataset.from_dict(rows, features=good.features), TARGET,
                             reference_columns=["before"], show_summary=False)
    ids, table = read_composite(ann)
    images = BucketedReferenceDataset(ann, composite=table, caption_column="text")
    keep = np.flatnonzero(ids >= 0)
    index = build_index([(int(r), int(ids[r])) for r in keep], [f"h{r}" for r in range(len(ann))],
                        lambda row, b, v: images.fit_row(row, int(table[b, 0]), v).key(), variants=1, vae_id="t")

    def encode(pixels: torch.Tensor) -> torch.Tensor:  # a stand-in VAE: 8x subsampling, std 1
        mean = pixels[:, :, ::8, ::8]
        return torch.stack([mean, torch.ones_like(mean)], dim=1)  # (B, 2, 3, H/8, W/8)

    cache = LatentCache(tmp_path / "cache")
    fill_cache(cache, index, rank=0, world=1, load_batch=lambda keys: images.collate([images[k] for k in keys]),
               encode=encode, batch_size=2)
    cached = CachedLatentDataset(cache, index, ann["text"], target_buckets=table[:, 0])
    data = CachedLatentsWithReferences(cached, BucketedReferenceDataset(ann, composite=table, caption_column="text"))
    item = data[(0, int(ids[0]), 0)]  # would raise on the broken reference before
    source = item["source_row"]
    assert source != 0 and ids[source] == ids[0]
    want = images[(source, int(ids[source]), 0)]
    assert torch.equal(item["reference_pixel_values"][0], want["reference_pixel_values"][0])
    assert torch.allclose(item["latent_stats"][0], want["pixel_values"][:, ::8, ::8], atol=2e-3)  # float16 cache
    other = next(int(r) for r in keep if r != 0)
    assert data[(other, int(ids[other]), 0)]["source_row"] == other  # a sound row reads its own references
