"""PackBatchSampler (hf_arb.packing.sampler) and PackedImageDataset (hf_arb.packing.dataset): the packed data path.

The sampler yields plan_packs' global plan step-major/rank-minor with each row's fitted size, accelerate's own
BatchSamplerShard deals it (variable-size batches), and the state resumes exactly; the dataset renders each row at
its own fitted size and the collate keeps the images apart."""

from __future__ import annotations

import json
import os
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from hf_arb import (
    BucketBatchSampler,
    BucketSet,
    PackBatchSampler,
    PackedImageDataset,
    add_bucket_columns,
)
from hf_arb.packing.layout import fit_sizes
from hf_arb.packing.plan import plan_packs
from hf_arb.packing.sampler import pack_sizes

skimage = pytest.importorskip("skimage")
DATA = Path(os.path.dirname(skimage.__file__)) / "data"


def _sizes(n: int = 300, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    r = np.random.default_rng(seed)
    return r.integers(100, 1400, n), r.integers(100, 1400, n)


def _drain(sampler) -> list[list[tuple]]:
    return [list(b) for b in sampler]


@pytest.mark.parametrize("world", [1, 3])
def test_yields_the_global_pack_plan_step_major_rank_minor(world):
    w, h = _sizes()
    s = PackBatchSampler((w, h), max_tokens=2048, num_replicas=world, seed=7, window=64, log_report=False)
    fit = fit_sizes(w, h, 2048)
    plan = plan_packs(fit.tokens, 2048, world, seed=7, epoch=0, window=64)
    got = _drain(s)
    assert s.batch_size is None and len(got) == len(s) == plan.num_steps * world
    for i, batch in enumerate(got):
        rows = plan.pack(i // world, i % world)
        assert [k[0] for k in batch] == rows.tolist()
        assert [(k[1], k[2]) for k in batch] == list(zip(fit.width[rows].tolist(), fit.height[rows].tolist()))
        assert {k[3] for k in batch} == {0}
        assert fit.tokens[rows].sum() <= 2048
    seen = np.concatenate([[k[0] for k in b] for b in got])
    rep = s.report(0)
    assert np.unique(seen).size == seen.size == rep.rows_packed  # every row at most once
    assert rep.rows_packed + rep.rows_leftover == 300  # the rest is counted
    # the next pass is epoch 1: another order, keys carry the epoch
    nxt = _drain(s)
    assert s.epoch == 1 and {k[3] for b in nxt for k in b} == {1}
    assert [k[0] for k in nxt[0]] == plan_packs(fit.tokens, 2048, world, seed=7, epoch=1, window=64).pack(0, 0).tolist()


def test_rows_without_a_size_are_skipped_and_counted():
    w, h = _sizes(50)
    w[[3, 10]] = 0
    s = PackBatchSampler((w, h), max_tokens=4096, num_replicas=1, log_report=False)
    rows = {k[0] for b in _drain(s) for k in b}
    assert 3 not in rows and 10 not in rows and len(rows) == 48
    assert s.report(0).rows_skipped == 2 and s.sizes.tokens[3] == 0
    assert "skipped 2" in s.report(0).text()
    assert 0 <= s.mean_crop_fraction() < 0.05


def test_accelerate_batch_sampler_shard_deals_each_rank_its_pack():
    """accelerate's own BatchSamplerShard (what accelerator.prepare wraps a batch sampler in) with variable-size
    packs: batch_size None makes it deal every round, so each rank gets exactly its planned pack."""
    from accelerate.data_loader import BatchSamplerShard, SkipBatchSampler

    w, h = _sizes(400, seed=1)
    world = 2
    s = PackBatchSampler((w, h), max_tokens=1024, num_replicas=world, seed=3, log_report=False)
    plan = s.plan(0)
    assert len({plan.pack(i, 0).size for i in range(plan.num_steps)}) > 1  # really variable sizes
    for even in (True, False):
        for rank in range(world):
            s.set_epoch(0)
            shard = BatchSamplerShard(s, num_processes=world, process_index=rank, even_batches=even)
            got = [[k[0] for k in b] for b in shard]
            assert len(shard) == plan.num_steps and got == [p.tolist() for p in plan.iter_rank(rank)]
    # resume the accelerate way: skip the first steps of this rank's shard
    s.set_epoch(0)
    rest = [[k[0] for k in b] for b in SkipBatchSampler(BatchSamplerShard(s, world, 1), skip_batches=5)]
    assert rest == [p.tolist() for p in plan.iter_rank(1, start_step=5)]


def test_prepared_loader_and_resume_dataloader_single_process():
    from accelerate import Accelerator

    from hf_arb import resume_dataloader

    w, h = _sizes(120, seed=2)
    acc = Accelerator(cpu=True)
    s = PackBatchSampler((w, h), max_tokens=2048, num_replicas=1, seed=1, log_report=False, return_keys=False)
    dl = DataLoader(list(range(120)), batch_sampler=s, collate_fn=list)
    prepared = acc.prepare(dl)
    full = {e: (prepared.set_epoch(e), list(prepared))[1] for e in (0, 1)}
    assert len(full[0]) == s.steps_in(0)
    steps_done = s.steps_in(0) + 3  # mid epoch 1
    loader, epoch = resume_dataloader(acc, prepared, steps_done)
    assert epoch == 1 and list(loader) == full[1][3:]


def test_state_dict_resumes_mid_epoch_and_is_json():
    w, h = _sizes(200, seed=4)
    s = PackBatchSampler((w, h), max_tokens=2048, num_replicas=2, seed=5, log_report=False)
    it = iter(s)
    for _ in range(2 * 4):
        next(it)
    state = json.loads(json.dumps(s.state_dict()))
    assert state["batches_consumed"] == 4
    rest = list(it)
    t = PackBatchSampler((w, h), max_tokens=2048, num_replicas=2, seed=5, log_report=False)
    t.load_state_dict(json.dumps(state))
    assert _drain(t) == rest
    # locate walks epochs of different lengths
    steps = [t.steps_in(e) for e in range(3)]
    assert t.locate(steps[0] + steps[1] + 1) == (2, 1) and t.total_steps(3) == sum(steps)


@pytest.mark.parametrize(("change", "field"), [
    ({"seed": 6}, "seed"),
    ({"max_tokens": 4096}, "max_tokens"),
    ({"window": 32}, "options.window"),
    ({"num_replicas": 1}, "num_replicas"),
])
def test_load_state_dict_names_the_field_that_differs(change, field):
    w, h = _sizes(200, seed=4)
    base = {"max_tokens": 2048, "num_replicas": 2, "seed": 5, "log_report": False}
    state = PackBatchSampler((w, h), **base).state_dict()
    other = PackBatchSampler((w, h), **{**base, **change})
    with pytest.raises(ValueError, match=f"`{field}`"):
        other.load_state_dict(state)


def test_load_state_dict_refuses_other_data_and_other_samplers():
    w, h = _sizes(200, seed=4)
    s = PackBatchSampler((w, h), max_tokens=2048, num_replicas=1, log_report=False)
    w2 = w.copy()
    w2[0] += 300
    with pytest.raises(ValueError, match="`fingerprint`"):
        PackBatchSampler((w2, h), max_tokens=2048, num_replicas=1, log_report=False).load_state_dict(s.state_dict())
    bucket_state = BucketBatchSampler([0] * 8, 2, num_replicas=1).state_dict()
    with pytest.raises(ValueError, match="`format`|`kind`"):
        s.load_state_dict(bucket_state)
    with pytest.raises(ValueError, match="not JSON"):
        s.load_state_dict("{oops")
    with pytest.raises(ValueError, match="zero steps"):
        PackBatchSampler(([64], [64]), max_tokens=64, num_replicas=2)


# ------------------------------------------------------------------------------------------------- dataset
PHOTOS = ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png"]
SIZES = [(300, 200), (200, 300), (256, 256), (420, 140), (130, 260), (333, 222), (180, 180), (250, 100)]


@pytest.fixture(scope="module")
def photo_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("pack_photos")
    paths = []
    for i, (w, h) in enumerate(SIZES):
        path = root / f"img{i}.png"
        Image.open(DATA / PHOTOS[i % len(PHOTOS)]).convert("RGB").resize((w, h), Image.LANCZOS).save(path)
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def annotated(photo_paths):
    ds = datasets.Dataset.from_dict({"image": photo_paths, "text": [f"photo {i}" for i in range(len(SIZES))]})
    ds = ds.cast_column("image", datasets.Image())
    return add_bucket_columns(ds, BucketSet([(64, 64), (96, 64), (64, 96)]), show_summary=False)


def test_pack_sizes_reads_the_annotated_original_sizes(annotated):
    fit = pack_sizes(annotated, 256)
    want = fit_sizes([w for w, _ in SIZES], [h for _, h in SIZES], 256)
    assert fit.width.tolist() == want.width.tolist() and fit.resize_height.tolist() == want.resize_height.tolist()


def test_dataset_renders_each_row_at_its_fitted_size(annotated):
    s = PackBatchSampler(annotated, max_tokens=512, max_image_tokens=160, num_replicas=1, seed=0, log_report=False)
    data = PackedImageDataset(annotated, s.sizes, seed=0, random_flip=True)
    loader = DataLoader(data, batch_sampler=s, collate_fn=data.collate)
    rows = []
    for batch in loader:
        assert isinstance(batch["pixel_values"], list) and len(batch["pixel_values"]) == len(batch["captions"])
        assert int((batch["grids"][:, 0] * batch["grids"][:, 1]).sum()) <= 512
        for px, grid, row in zip(batch["pixel_values"], batch["grids"].tolist(), batch["rows"].tolist()):
            assert px.shape == (3, 16 * grid[0], 16 * grid[1])
            assert (px.shape[2], px.shape[1]) == (s.sizes.width[row], s.sizes.height[row])
            assert px.min() >= -1 and px.max() <= 1
            rows.append(row)
        assert batch["captions"] == [f"photo {r}" for r in batch["rows"].tolist()]
    assert sorted(rows) == list(range(len(SIZES)))
    # the plan: resize to fit_sizes' resize_*, crop less than one patch a side; same key, same pixels
    for row in range(len(SIZES)):
        plan = data.fit_row(row, epoch=0)
        assert plan.scaled_size == (s.sizes.resize_width[row], s.sizes.resize_height[row])
        assert plan.bucket == (s.sizes.width[row], s.sizes.height[row])
        assert all(0 <= e < 16 for e in np.subtract(plan.scaled_size, plan.bucket))
    key = (3, int(s.sizes.width[3]), int(s.sizes.height[3]), 0)
    assert torch.equal(data[key]["pixel_values"], data[key]["pixel_values"])
    with pytest.raises(ValueError, match="sampler's `sizes`"):
        data[(3, 16, 16, 0)]
    with pytest.raises(ValueError, match="covers 3 rows"):
        PackedImageDataset(annotated, pack_sizes(([64] * 3, [64] * 3), 64))


def test_a_bad_image_is_replaced_by_a_row_of_the_same_fitted_size(photo_paths, tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    sizes = SIZES + [(300, 200)]  # the bad row claims row 0's size
    ds = datasets.Dataset.from_dict({"image": photo_paths + [str(bad)], "text": ["x"] * len(sizes),
                                     "width": [w for w, _ in sizes], "height": [h for _, h in sizes]})
    ds = add_bucket_columns(ds, BucketSet([(64, 64)]), image_column="image", width_column="width",
                            height_column="height", show_summary=False)
    fit = pack_sizes(ds, 256)
    data = PackedImageDataset(ds, fit, on_bad_image="replace")
    sample = data[(8, int(fit.width[8]), int(fit.height[8]), 0)]
    assert sample["row"] == 0 and sample["pixel_values"].shape[1:] == (fit.height[8], fit.width[8])
    assert data.bad_images.count == 1


def test_a_restored_pack_sampler_resumes_like_the_bucket_sampler():
    """PackBatchSampler holds the same StepCursor as BucketBatchSampler: after a restore taken mid-epoch with the
    sampler a few steps ahead of the loop (accelerate's read-ahead), accelerate's ``skip_first_batches(loader, k)``
    serves exactly the rest of each rank's packs, the prepared loader iterated again without ``set_epoch`` is
    refused before its first pack (it would silently restart the epoch), and ``set_epoch`` pins an epoch for every
    pass until the next one."""
    from accelerate.data_loader import BatchSamplerShard, DataLoaderShard, skip_first_batches

    from hf_arb.sampling.resume.cursor import StepCursor

    w, h = _sizes(300, seed=6)
    world, k, ahead = 2, 3, 2

    def restored(state):
        s = PackBatchSampler((w, h), max_tokens=2048, num_replicas=world, seed=2, log_report=False,
                             return_keys=False)
        if state is not None:
            s.load_state_dict(state)
        return s

    ref = restored(None)
    assert isinstance(ref.cursor, StepCursor)
    plan, epoch = ref.plan(1), 1
    state = {**ref.state_dict(), "epoch": epoch, "batches_consumed": k + ahead}
    for r in range(world):
        s = restored(state)
        loader = DataLoaderShard(list(range(300)), batch_sampler=BatchSamplerShard(s, world, r), collate_fn=list)
        assert list(skip_first_batches(loader, k)) == [p.tolist() for p in plan.iter_rank(r, start_step=k)]
        s = restored(state)
        loader = DataLoaderShard(list(range(300)), batch_sampler=BatchSamplerShard(s, world, r), collate_fn=list)
        with pytest.raises(RuntimeError, match="resume_dataloader|set_epoch"):
            next(iter(loader))
    s = restored(None)
    s.set_epoch(1)
    assert _drain(s) == _drain(s)  # set_epoch pins the epoch for every pass, as for the other samplers
    assert s.epoch == 1
