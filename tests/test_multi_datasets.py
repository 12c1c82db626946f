"""Several datasets in one global plan (issue #36, item 1): exact shares per epoch, the same bucket on every rank,
resume equal to an uninterrupted run at random cuts, elastic 2 -> 3 processes (every rank simulated in one process),
each dataset's loss weight in the batch and the loss, and a short training run from a kohya toml with two folders."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _train_fixtures import SD_BASE  # noqa: E402

from hf_arb import BucketBatchSampler  # noqa: E402
from hf_arb.sampling.planning.shares import dataset_counts, epoch_slots, plan_slots  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:BucketBatchSampler:UserWarning")  # small plans drop or repeat rows
SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: several datasets: each a list of bucket ids (-1: skipped), drawn over 4 buckets
DATASETS = st.lists(st.lists(st.integers(-1, 3), min_size=1, max_size=60), min_size=2, max_size=4).filter(
    lambda ds: all(any(b >= 0 for b in d) for d in ds))


def concat(datasets: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    ids = np.concatenate([np.asarray(d, np.int64) for d in datasets])
    return ids, np.repeat(np.arange(len(datasets)), [len(d) for d in datasets])


def samplers(slot_ids: np.ndarray, world: int, batch: int, **kw) -> list[BucketBatchSampler]:
    return [BucketBatchSampler(slot_ids, batch, num_replicas=world, rank=r, seed=5, log_report=False, **kw)
            for r in range(world)]


# ------------------------------------------------------------------------------------------- shares
@SETTINGS
@given(DATASETS, st.data())
def test_repeats_give_every_row_exactly_its_repeats_and_the_plan_every_slot_once(datasets, data):
    ids, row_dataset = concat(datasets)
    repeats = np.array(data.draw(st.lists(st.integers(1, 4), min_size=len(datasets), max_size=len(datasets))))
    row_map, slots, kept = plan_slots(row_dataset, ids, len(datasets), repeats=repeats, seed=3)
    # the slot map: every trainable row exactly `repeats` times, skipped rows never
    times = np.bincount(row_map, minlength=ids.size)
    np.testing.assert_array_equal(times, np.where(ids >= 0, repeats[row_dataset], 0))
    np.testing.assert_array_equal(slots, kept * repeats)
    # the plan (leftover fill): every slot at least once; the rest are the fill repeats the report counts
    slot_ids, slot_dataset = ids[row_map], row_dataset[row_map]
    s = BucketBatchSampler(slot_ids, 2, num_replicas=2, seed=1, leftover="fill", log_report=False)
    for epoch in (0, 1):
        plan = s.plan(epoch)
        seen = np.bincount(plan.ravel(), minlength=slot_ids.size)
        assert (seen >= 1).all()
        assert int(seen.sum() - slot_ids.size) == s.report(epoch).rows_repeated
        trained = dataset_counts(plan, slot_dataset, len(datasets))
        assert (trained >= slots).all() and int((trained - slots).sum()) == s.report(epoch).rows_repeated
    # leftover drop: no slot twice, and what is missing is what the report drops
    s = BucketBatchSampler(np.concatenate([slot_ids, np.zeros(4, np.int64)]), 2, num_replicas=2, seed=1,
                           log_report=False)  # (four extra rows in bucket 0: a full global batch exists)
    plan = s.plan(0).ravel()
    assert np.bincount(plan).max() == 1 and slot_ids.size + 4 - plan.size == s.report(0).rows_dropped


@SETTINGS
@given(st.lists(st.integers(0, 500), min_size=1, max_size=6), st.data())
def test_weights_split_the_epoch_exactly_by_largest_remainder(rows, data):
    rows = np.array(rows)
    weights = np.array(data.draw(st.lists(st.floats(0.01, 10), min_size=rows.size, max_size=rows.size)))
    slots = epoch_slots(rows, weights=weights)
    assert int(slots.sum()) == int(rows.sum())  # the epoch keeps its length
    w = np.where(rows > 0, weights, 0)
    if w.sum():
        exact = w / w.sum() * rows.sum()
        assert (np.abs(slots - exact) < 1).all()  # each share within one row of its exact value
    assert (slots[rows == 0] == 0).all()


def test_weights_train_each_row_floor_or_ceil_times_and_the_same_rows_every_epoch():
    ids, row_dataset = concat([[0, 1, 2, 3] * 5, [1, 2] * 20])  # 20 and 40 rows
    row_map, slots, _ = plan_slots(row_dataset, ids, 2, weights=np.array([3.0, 1.0]), seed=0)
    assert slots.tolist() == [45, 15]  # 3:1 of 60 rows
    times = np.bincount(row_map, minlength=ids.size)
    assert sorted(set(times[:20].tolist())) == [2, 3] and times[:20].sum() == 45  # 2 x 20 + 5 drawn once more
    assert sorted(set(times[20:].tolist())) == [0, 1] and times[20:].sum() == 15  # 15 of 40 rows
    again, _, _ = plan_slots(row_dataset, ids, 2, weights=np.array([3.0, 1.0]), seed=0)
    np.testing.assert_array_equal(row_map, again)  # a pure function of the seed


# ------------------------------------------------------------------------------------------- one global plan
@SETTINGS
@given(DATASETS, st.integers(1, 3), st.integers(1, 3), st.integers(0, 2))
def test_every_rank_trains_the_same_bucket_and_only_rows_of_it(datasets, world, batch, epoch):
    ids, row_dataset = concat(datasets)
    row_map, _, _ = plan_slots(row_dataset, ids, len(datasets), repeats=np.arange(1, len(datasets) + 1), seed=0)
    slot_ids = ids[row_map]
    ranks = samplers(slot_ids, world, batch, leftover="fill", return_keys=True)
    for s in ranks:
        s.set_epoch(epoch)
    steps = [list(s.shard()) for s in ranks]
    assert len({len(x) for x in steps}) == 1
    for step in zip(*steps):
        targets = {t for batch_ in step for _, t, _ in batch_}
        assert len(targets) == 1  # one bucket on every rank at this step
        assert {int(slot_ids[r]) for batch_ in step for r, _, _ in batch_} == targets


@SETTINGS
@given(DATASETS, st.data())
def test_resume_at_a_random_cut_equals_the_uninterrupted_epoch(datasets, data):
    ids, row_dataset = concat(datasets)
    row_map, _, _ = plan_slots(row_dataset, ids, len(datasets), repeats=np.array([2] + [1] * (len(datasets) - 1)),
                               seed=0)
    slot_ids = ids[row_map]
    world = data.draw(st.integers(1, 3))
    full = samplers(slot_ids, world, 2, leftover="fill")
    whole = [list(s.shard()) for s in full]
    cut = data.draw(st.integers(0, len(whole[0])))
    run = samplers(slot_ids, world, 2, leftover="fill")
    its = [iter(s.shard()) for s in run]
    head = [[next(it) for _ in range(cut)] for it in its]
    state = json.loads(json.dumps(run[0].state_dict()))  # what a checkpoint holds
    resumed = samplers(slot_ids, world, 2, leftover="fill")
    for r, s in enumerate(resumed):
        s.load_state_dict(state)
        rest = list(s.shard())
        if cut < len(whole[r]):
            assert head[r] + rest == whole[r]
        else:  # after the epoch's last batch: the next epoch
            assert rest == full[r].plan(1)[:, r].tolist()


def test_elastic_resume_from_two_to_three_processes_keeps_the_global_sequence():
    rng = np.random.default_rng(0)
    datasets = [rng.integers(0, 4, 300).tolist(), rng.integers(0, 4, 200).tolist(), rng.integers(-1, 4, 90).tolist()]
    ids, row_dataset = concat(datasets)
    row_map, slots, _ = plan_slots(row_dataset, ids, 3, repeats=np.array([1, 2, 5]), seed=0)
    slot_ids = ids[row_map]
    two, three = samplers(slot_ids, 2, 6), samplers(slot_ids, 3, 4)
    g2 = np.stack([s.plan(0)[:, r] for r, s in enumerate(two)], 1).reshape(-1, 12)  # (steps, global batch)
    np.testing.assert_array_equal(g2, np.stack([s.plan(0)[:, r] for r, s in enumerate(three)], 1).reshape(-1, 12))
    k = 7
    its = [iter(s.shard()) for s in two]
    for it in its:
        for _ in range(k):
            next(it)
    state = two[0].state_dict()
    resumed = samplers(slot_ids, 3, 4)
    for s in resumed:
        s.load_state_dict(state)
    rest = np.stack([np.array(list(s.shard())) for s in resumed], axis=1).reshape(-1, 12)
    np.testing.assert_array_equal(rest, g2[k:])
    trained = dataset_counts(g2, row_dataset[row_map], 3)
    assert (trained <= slots).all() and (slots - trained).sum() == two[0].report(0).rows_dropped


# ------------------------------------------------------------------------------------------- the loss
def test_row_loss_weights_weight_each_row_and_ones_change_nothing():
    import torch

    from hf_arb.families.flow import flow_matching_loss
    from hf_arb.families.sample_weights import batch_mean as rows_mean

    g = torch.Generator().manual_seed(0)
    pred, lat, noise = (torch.randn(3, 4, 8, 8, generator=g) for _ in range(3))
    sig = torch.rand(3, generator=g)
    noisy = (1 - sig.view(-1, 1, 1, 1)) * lat + sig.view(-1, 1, 1, 1) * noise
    plain = flow_matching_loss(pred, lat, noise, noisy, sig, "none", False)
    assert torch.equal(plain, flow_matching_loss(pred, lat, noise, noisy, sig, "none", False, torch.ones(3)))
    per_row = torch.stack([flow_matching_loss(pred[i:i + 1], lat[i:i + 1], noise[i:i + 1], noisy[i:i + 1],
                                              sig[i:i + 1], "none", False) for i in range(3)])
    w = torch.tensor([2.0, 0.0, 0.5])
    torch.testing.assert_close(flow_matching_loss(pred, lat, noise, noisy, sig, "none", False, w),
                               (per_row * w).mean())
    assert torch.equal(rows_mean(per_row, None), per_row.mean())


def test_the_batch_carries_each_rows_dataset_loss_weight_only_when_one_is_not_1():
    from hf_arb.train.sources.multi import MixCollate

    def inner(samples):
        return {"rows": [s["row"] for s in samples]}

    slot_dataset = np.array([0, 0, 1, 1, 2])
    weighted = MixCollate(inner, slot_dataset, np.array([1.0, 0.5, 3.0]))
    batch = weighted([{"row": 4}, {"row": 0}, {"row": 2}])
    assert batch["sample_weights"].tolist() == [3.0, 1.0, 0.5]
    assert "sample_weights" not in MixCollate(inner, slot_dataset, np.ones(3))([{"row": 4}])


# ------------------------------------------------------------------------------------------- the source and a run
def sidecar_folder(images: str, out: Path, keep: int | None = None) -> Path:
    """The tiny imagefolder as kohya keeps one: images with their captions in .txt files beside them."""
    out.mkdir(parents=True, exist_ok=True)
    lines = (Path(images) / "metadata.jsonl").read_text().splitlines()[:keep]
    for line in lines:
        rec = json.loads(line)
        shutil.copy(Path(images) / rec["file_name"], out / rec["file_name"])
        (out / rec["file_name"]).with_suffix(".txt").write_text(rec["text"] + "\n")
    return out


def _args(train_assets, tmp_path, *extra):
    from hf_arb.train.flags.args import parse_args

    return parse_args(["--pretrained_model_name_or_path", train_assets["sd"], "--output_dir", str(tmp_path / "out"),
                       *SD_BASE, "--full_finetune", *extra])


def test_one_dataset_in_a_config_plans_exactly_as_train_data_dir(train_assets, tmp_path):
    """The same folder through --dataset_config (one dataset, repeats 1) and --train_data_dir: the same plan, bit for
    bit; and a run without --dataset_config still gets the source it always had."""
    from hf_arb.train.sources import build_source
    from hf_arb.train.sources.bucketed import BucketedSource
    from hf_arb.train.sources.multi import MultiSource

    one = SimpleAccelerator()
    config = tmp_path / "one.toml"
    config.write_text(f"[[datasets]]\ntrain_data_dir = '{train_assets['images']}'\n")
    single = build_source(_args(train_assets, tmp_path, "--train_data_dir", train_assets["images"]), None)
    multi = build_source(_args(train_assets, tmp_path, "--dataset_config", str(config)), None)
    assert type(single) is BucketedSource and type(multi) is MultiSource
    single.start(one)
    multi.start(one)
    for epoch in (0, 1):
        np.testing.assert_array_equal(single.sampler.plan(epoch), multi.sampler.plan(epoch))
    assert single.buckets == multi.buckets and single.sampler.fingerprint == multi.sampler.fingerprint


class SimpleAccelerator:
    num_processes, process_index, is_main_process, is_local_main_process = 1, 0, True, True


def test_a_kohya_toml_with_two_folders_trains_and_reports_its_shares(train_assets, tmp_path):
    """Two folders (one with .txt captions at repeats 3, one imagefolder at its own resolution with a loss weight):
    the report, the run statistics and the model card show rows, repeats and shares per dataset."""
    import train_text_to_image_arb as script

    a = sidecar_folder(train_assets["images"], tmp_path / "a", keep=8)
    config = tmp_path / "kohya.toml"
    config.write_text(f"""[general]
caption_extension = '.txt'

[[datasets]]
resolution = 64
  [[datasets.subsets]]
  image_dir = '{a}'
  num_repeats = 3

[[datasets]]
resolution = 48
  [[datasets.subsets]]
  image_dir = '{train_assets["images"]}'
  caption_extension = '.none'
  class_tokens = 'a photo'
""")
    stats = script.main(["--pretrained_model_name_or_path", train_assets["sd"], "--output_dir", str(tmp_path / "out"),
                         *SD_BASE, "--full_finetune", "--dataset_config", str(config), "--max_train_steps", "3",
                         "--bucket_leftover", "fill"])
    table = stats["datasets"]
    assert [(r["name"], r["rows"], r["repeats"], r["slots"]) for r in table] == [("a", 8, 3, 24), ("images", 20, 1, 20)]
    assert [r["share"] for r in table] == [round(24 / 44, 6), round(20 / 44, 6)]
    assert all(r["trained_per_epoch"] >= r["slots"] for r in table)
    card = (tmp_path / "out" / "README.md").read_text()
    assert "  * a: 8 rows (8 kept), repeats 3, 24 per epoch (54.55%)" in card
    assert "each dataset's table (--dataset_config): a at budget 64, images at budget 48" in card
    rows = [json.loads(line) for line in (tmp_path / "out" / "batches" / "rank0.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(len(r["rows"]) == 2 for r in rows)


def test_a_kohya_is_reg_subset_pairs_its_images_with_every_batch(train_assets, tmp_path):
    """kohya's DreamBooth layout (an instance folder and an is_reg folder of class images): every batch trains its
    instance rows and as many class images of its bucket (prior preservation, nothing generated); the report and the
    run statistics count the class images; each half's captions go through its own dataset's options."""
    import train_text_to_image_arb as script

    a = sidecar_folder(train_assets["images"], tmp_path / "a", keep=8)
    reg = sidecar_folder(train_assets["images"], tmp_path / "reg")
    config = tmp_path / "kohya.toml"
    config.write_text(f"""[general]
caption_extension = '.txt'

[[datasets]]
resolution = 64
  [[datasets.subsets]]
  image_dir = '{a}'
  shuffle_caption = true
  keep_tokens = 1
  [[datasets.subsets]]
  image_dir = '{reg}'
  is_reg = true
  caption_extension = '.none'
  class_tokens = 'a photo'
""")
    stats = script.main(["--pretrained_model_name_or_path", train_assets["sd"], "--output_dir", str(tmp_path / "out"),
                         *SD_BASE, "--full_finetune", "--dataset_config", str(config), "--max_train_steps", "2",
                         "--bucket_leftover", "fill", "--prior_loss_weight", "0.5"])
    assert stats["class_images_used"] == 20 and stats["class_images_generated"] == 0
    assert [(r["name"], r["rows"]) for r in stats["datasets"]] == [("a", 8)]  # the class images are not planned rows
    rows = [json.loads(line) for line in (tmp_path / "out" / "batches" / "rank0.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(len(r["rows"]) == 4 for r in rows)  # 2 instance + 2 class rows per batch
    assert all(c == "a photo" for r in rows for c in r["captions"][2:])  # the class half: its class_tokens


def test_paired_captions_augment_each_half_with_its_own_options():
    from hf_arb.train.captions import CaptionAugmenter, CaptionOptions
    from hf_arb.train.sources.multi import PairedCaptions

    shuffle = CaptionAugmenter([CaptionOptions(shuffle_caption=True, keep_tokens=1)], seed=0)
    plain = CaptionAugmenter([CaptionOptions()], seed=0)
    caption = "sks, red hair, smiling, outdoors, film grain"
    batch = {"rows": np.array([3, 4, 3, 4]), "captions": [caption] * 4}
    seen = [PairedCaptions(shuffle, plain)(batch, epoch)["captions"] for epoch in range(4)]
    assert all(c[2:] == [caption, caption] for c in seen)  # the class half: no option, untouched
    assert all(c[0].startswith("sks, ") for c in seen) and len({c[0] for c in seen}) > 1  # shuffled, kept first tag
    assert PairedCaptions(plain, plain)(batch, 0) is batch


def test_datasets_at_their_own_resolutions_keep_their_bucket_sizes_in_the_runs_table():
    import pyarrow as pa

    from hf_arb import BucketSet
    from hf_arb.train.sources.multi import remapped_columns, union_buckets

    a, b = BucketSet.from_budget(resolution=64, step=16), BucketSet.from_budget(resolution=48, step=16)
    union, luts = union_buckets([a, b], "log")
    assert len(union) == len({*map(tuple, a.resolutions.tolist()), *map(tuple, b.resolutions.tolist())})
    for table, lut in ((a, luts[0]), (b, luts[1])):
        ids = np.array([-1, *range(len(table))], np.int32)
        new = remapped_columns(pa.table({"bucket": pa.array(ids)}), lut=lut.tolist()).column("bucket").to_numpy()
        assert new[0] == -1  # skipped rows stay skipped
        np.testing.assert_array_equal(union.resolutions[new[1:]], table.resolutions)  # the same (w, h) per row
    same, identity = union_buckets([a, a], "log")
    assert same == a and all((lut == np.arange(len(a))).all() for lut in identity)


def test_a_checkpoint_of_other_repeats_is_refused_on_resume():
    """Resume with a changed --dataset_config: the slots differ, so the sampler's plan check names the field."""
    ids, row_dataset = concat([[0, 1, 1, 0] * 6, [1, 0] * 8])
    plans = [ids[plan_slots(row_dataset, ids, 2, repeats=np.array(r), seed=0)[0]] for r in ([1, 2], [2, 1])]
    saved = BucketBatchSampler(plans[0], 2, num_replicas=1, seed=0, log_report=False).state_dict()
    with pytest.raises(ValueError, match="fingerprint|rows"):
        BucketBatchSampler(plans[1], 2, num_replicas=1, seed=0, log_report=False).load_state_dict(saved)


def test_caption_files_beside_the_images_and_their_fallback(tmp_path):
    from PIL import Image

    from hf_arb.checks import UsageError
    from hf_arb.train.flags.dataset_config import DatasetSpec
    from hf_arb.train.sources.multi import caption_folder

    for name in ("a.png", "b.jpg"):
        Image.new("RGB", (8, 6)).save(tmp_path / name)
    (tmp_path / "a.txt").write_text("  a cat, sitting \n")
    spec = DatasetSpec(name="x", train_data_dir=str(tmp_path), caption_extension=".txt", where="cfg")
    with pytest.raises(UsageError, match="cfg: 1 of 2 images have no .txt caption file .*b.jpg.*prompt = "):
        caption_folder(spec, "image", "text")
    spec = DatasetSpec(name="x", train_data_dir=str(tmp_path), caption_extension=".txt", prompt="sks", where="cfg")
    assert caption_folder(spec, "image", "text")["text"] == ["a cat, sitting", "sks"]
