# ruff: noqa: E402 (its imports follow the sys.path line)
"""train_text_to_image_arb.py's bucket-table flags: every preset, --aspect_ratio_buckets, --bucket_metric, the
kohya side flags, and the start-up note of presets that ignore --resolution.

Argument-level tests build the table from the parsed flags (no model, no torch); one dataset-level test annotates a
tiny imagefolder as the script does; one tiny real run (shared models of test_train.py) trains on a bucket string.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import train_text_to_image_arb as script  # noqa: I001 (after the sys.path line)
from hf_arb.train.flags import args as train_args  # noqa: E402
from hf_arb.train.sources import dataset as train_data  # noqa: E402
from hf_arb.train import files as train_files  # noqa: E402
from hf_arb.train.sources.loaders import make_sampler  # noqa: E402
from test_train import COMMON, run_script
from test_train import assets as _assets  # the shared tiny models and photos (a session fixture)

from hf_arb import PRESETS, BucketSet
from hf_arb.buckets.presets import PRESET_INFO, preset_notes

assets = _assets


@pytest.fixture(scope="module")
def sd_folder(tmp_path_factory) -> str:
    """A folder whose unet/config.json says SD 1.x (all parse_args reads): family default --resolution 512."""
    folder = tmp_path_factory.mktemp("fake-sd")
    (folder / "unet").mkdir()
    (folder / "unet" / "config.json").write_text("{}")
    (folder / "model_index.json").write_text("{}")
    return str(folder)


def parse(sd_folder: str, *extra: str):
    return script.parse_args(["--pretrained_model_name_or_path", sd_folder, "--train_data_dir", "d",
                              "--full_finetune", *extra])


def test_bucket_preset_choices_are_every_library_preset():
    from hf_arb.buckets.presets import VIDEO_PRESETS

    action = next(a for a in train_args.build_parser()._actions if "--bucket_preset" in a.option_strings)
    assert tuple(action.choices) == PRESETS + VIDEO_PRESETS and len(PRESETS) == 10  # clip tables: --video_column


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_builds_the_library_table(name, sd_folder):
    args = parse(sd_folder, "--bucket_preset", name)
    info = PRESET_INFO[name]
    assert args.bucket_step == info.default_step  # the preset's own step (diffusers: 16), not budget's 64
    expected = BucketSet.preset(name, resolution=512 if info.default_resolution else None, step=info.default_step)
    assert train_data.bucket_set_from_args(args) == expected


def test_default_is_budget_at_the_family_resolution(sd_folder):
    args = parse(sd_folder)
    assert (args.bucket_preset, args.bucket_step, args.bucket_metric) == ("budget", 64, "log")
    assert train_data.bucket_set_from_args(args) == BucketSet.preset("budget", resolution=512)


def test_aspect_ratio_buckets_are_height_first(sd_folder):
    args = parse(sd_folder, "--aspect_ratio_buckets", "1024,1024;768,1360")
    bs = train_data.bucket_set_from_args(args)
    assert args.bucket_preset is None and bs.resolutions.tolist() == [[1024, 1024], [1360, 768]]
    assert bs.metric == "log"
    native = train_data.bucket_set_from_args(parse(sd_folder, "--aspect_ratio_buckets", "1024,1024;768,1360",
                                               "--bucket_metric", "native"))
    assert native == BucketSet.from_string("1024,1024;768,1360") and native.metric == "cross"  # find_nearest_bucket
    assert "`--aspect_ratio_buckets 1024,1024;768,1360`" in train_data.bucket_origin(args)


@pytest.mark.parametrize("extra, message", [
    (["--bucket_preset", "sdxl", "--aspect_ratio_buckets", "512,512"],
     "--aspect_ratio_buckets is a bucket table and --bucket_preset sdxl names another: pass only one of them."),
    (["--aspect_ratio_buckets", "512,512;768"], "--aspect_ratio_buckets: Bucket 1 of '512,512;768' is '768'"),
    (["--bucket_preset", "pixart", "--resolution", "768"],
     ("--bucket_preset pixart: Preset 'pixart' has tables for resolution [256, 512, 1024, 2048], got 768. Pass one "
      "of those as --resolution.")),
    (["--bucket_preset", "kohya", "--resolution", "2048"], "Pass --bucket_max_side 2048 or more."),
    (["--bucket_max_side", "2048"], "--bucket_max_side is a parameter of --bucket_preset kohya"),
    (["--bucket_step", "1024"], "--bucket_preset budget: --bucket_step (1024) must not exceed --resolution (512)"),
    (["--bucket_step", "0"], "--bucket_step must be >= 1, got 0."),
])
def test_bad_bucket_flags_fail_at_parse_time_in_flags(extra, message, sd_folder):
    with pytest.raises(script.UsageError) as err:
        parse(sd_folder, *extra)
    assert message in str(err.value) and "`" not in str(err.value)


def test_kohya_side_flags_reach_the_table(sd_folder):
    args = parse(sd_folder, "--bucket_preset", "kohya", "--resolution", "1536", "--bucket_max_side", "2048",
                 "--bucket_min_side", "512")
    assert train_data.bucket_set_from_args(args) == BucketSet.preset("kohya", 1536, 64, min_side=512, max_side=2048)


def test_bucket_metric_linear_reproduces_novelai_assignment(sd_folder):
    bs = train_data.bucket_set_from_args(parse(sd_folder, "--bucket_preset", "novelai", "--bucket_metric", "linear"))
    assert bs == BucketSet.novelai(metric="linear")
    w = np.arange(300, 3000, 7, dtype=np.int64)
    h = np.full_like(w, 1000)
    ids, _ = bs.assign(w, h)
    # NovelAI's reference rule: argmin |bucket aspect - image aspect| per image
    reference = np.abs(bs.aspects[None, :] - (w / h)[:, None]).argmin(axis=1)
    assert np.array_equal(ids, reference)
    log_ids, _ = train_data.bucket_set_from_args(parse(sd_folder, "--bucket_preset", "novelai")).assign(w, h)
    assert (log_ids != ids).any()  # the flag changes the assignment


def test_fixed_table_note_is_logged_once_and_only_on_the_main_process(sd_folder, caplog):
    args = parse(sd_folder, "--bucket_preset", "flux_kontext")
    _, notes = train_data.bucket_table_from_args(args)
    assert notes == preset_notes("flux_kontext", 512) and len(notes) == 1  # the sentence `hf-arb buckets` prints
    with caplog.at_level(logging.INFO, logger=script.logger.name):
        train_data.log_bucket_notes(args, notes)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, f"--bucket_preset: {notes[0]}")]  # --resolution was the SD default: info, not a warning
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=script.logger.name):
        train_data.log_bucket_notes(parse(sd_folder, "--bucket_preset", "sdxl", "--resolution", "768"),
                                preset_notes("sdxl", 768))
    assert [r.levelno for r in caplog.records] == [logging.WARNING]  # given explicitly: a warning
    assert train_data.bucket_table_from_args(parse(sd_folder, "--bucket_preset", "pixart"))[1] == []


@pytest.fixture(scope="module")
def five_images(tmp_path_factory) -> str:
    from hf_arb.testing.tiny import save_tiny_imagefolder

    return save_tiny_imagefolder(tmp_path_factory.mktemp("five") / "images", per_size=1)


@pytest.mark.parametrize("metric", ["log", "linear"])
def test_dataset_annotation_uses_bucket_metric(metric, sd_folder, five_images, caplog):
    # 122x72 (aspect 1.69) lies between the log midpoint (1.58) and the linear midpoint (1.75) of buckets 1:1 and
    # 2.5:1, so the two metrics put it in different buckets.
    args = script.parse_args(["--pretrained_model_name_or_path", sd_folder, "--train_data_dir", five_images,
                              "--full_finetune", "--aspect_ratio_buckets", "64,64;32,80", "--bucket_metric", metric])
    not_main = SimpleNamespace(is_main_process=False, main_process_first=contextlib.nullcontext)
    with caplog.at_level(logging.INFO, logger=script.logger.name):
        ds, buckets = train_data.dataset_with_buckets(args, not_main)
    assert buckets.metric == metric and not [r for r in caplog.records if "--bucket_preset" in r.getMessage()]
    sizes = list(zip(ds["original_width"], ds["original_height"]))
    bucket_of = dict(zip(sizes, ds["bucket"]))
    assert bucket_of[(122, 72)] == (1 if metric == "log" else 0)
    w, h = np.asarray(ds["original_width"]), np.asarray(ds["original_height"])
    assert ds["bucket"] == BucketSet.from_string("64,64;32,80", metric=metric).assign(w, h)[0].tolist()


def test_dataset_annotation_logs_the_fixed_table_note_on_the_main_process(sd_folder, five_images, caplog):
    args = script.parse_args(["--pretrained_model_name_or_path", sd_folder, "--train_data_dir", five_images,
                              "--full_finetune", "--bucket_preset", "hunyuan_dit", "--resolution", "1024"])
    with caplog.at_level(logging.INFO, logger=script.logger.name):
        train_data.dataset_with_buckets(args, None)
    notes = [r for r in caplog.records if "ignores resolution=1024" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.WARNING


# ------------------------------------------------------------------------------------ one tiny real run
@pytest.mark.slow
@pytest.mark.xdist_group("train_sd")
def test_training_on_a_bucket_string_with_linear_metric(tmp_path, assets):
    table = "64,64;48,96;96,48"  # not the 64/16 budget table the other tiny runs use
    stats = run_script(["--pretrained_model_name_or_path", assets["sd"], "--train_data_dir", assets["images"],
                        "--output_dir", str(tmp_path),
                        *[a for i, a in enumerate(COMMON) if "--bucket_step" not in COMMON[max(i - 1, 0):i + 1]],
                        "--max_train_steps", "1", "--aspect_ratio_buckets", table, "--bucket_metric", "linear"])
    assert stats["global_step"] == 1
    saved = json.loads((tmp_path / train_files.BUCKETS_FILE).read_text())
    assert saved["metric"] == "linear" and saved["resolutions"] == [[64, 64], [96, 48], [48, 96]]
    trace = [json.loads(line) for line in (tmp_path / "batches" / "rank0.jsonl").read_text().splitlines()]
    assert len(trace) == 1
    for t in trace:
        w, h = saved["resolutions"][t["bucket"]]
        assert t["shape"] == [2, 3, h, w]
    assert f"`--aspect_ratio_buckets {table}`" in (tmp_path / "README.md").read_text()


# ------------------------------------------------- an annotated dataset meets bucket flags (issue 24, item 3)
@pytest.fixture(scope="module")
def annotated_budget_1024(five_images, tmp_path_factory) -> str:
    """five_images annotated as `hf-arb annotate --preset budget --resolution 1024` would, saved to disk."""
    import datasets

    from hf_arb import add_bucket_columns

    ds = datasets.load_dataset("imagefolder", data_dir=five_images, split="train")
    ds = add_bucket_columns(ds, BucketSet.preset("budget", resolution=1024), show_summary=False)
    folder = tmp_path_factory.mktemp("annotated") / "ds"
    ds.save_to_disk(str(folder))
    return str(folder)


def annotated_args(sd_folder, folder, *extra):
    return script.parse_args(["--pretrained_model_name_or_path", sd_folder, "--dataset_name", folder,
                              "--full_finetune", *extra])


def test_explicit_bucket_flags_reassign_an_annotated_dataset(sd_folder, annotated_budget_1024, caplog):
    args = annotated_args(sd_folder, annotated_budget_1024, "--bucket_preset", "novelai", "--resolution", "512")
    with caplog.at_level(logging.INFO, logger=script.logger.name):
        ds, buckets = train_data.dataset_with_buckets(args, None)
    wanted = BucketSet.novelai()
    assert buckets == wanted and BucketSet.from_dataset(ds) == wanted
    w, h = np.asarray(ds["original_width"]), np.asarray(ds["original_height"])
    assert ds["bucket"] == wanted.assign(w, h)[0].tolist()  # the rows now sit in the requested table's buckets
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "--bucket_preset novelai" in warned[0] and "re-assigned its 5 rows" in warned[0]
    assert "--bucket_preset novelai" in train_data.bucket_origin(args)


def test_annotated_dataset_without_table_flags_keeps_its_buckets_and_the_card_says_so(sd_folder,
                                                                                      annotated_budget_1024, caplog):
    args = annotated_args(sd_folder, annotated_budget_1024)  # family default --resolution 512: not a user's flag
    with caplog.at_level(logging.INFO, logger=script.logger.name):
        ds, buckets = train_data.dataset_with_buckets(args, None)
    assert buckets == BucketSet.preset("budget", resolution=1024)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    origin = train_data.bucket_origin(args)
    assert "dataset's own bucket columns" in origin and "--bucket_preset" not in origin
    # --resolution alone is not applied to the dataset's table: one warning names it
    caplog.clear()
    args = annotated_args(sd_folder, annotated_budget_1024, "--resolution", "512")
    with caplog.at_level(logging.INFO, logger=script.logger.name):
        _, buckets = train_data.dataset_with_buckets(args, None)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert buckets == BucketSet.preset("budget", resolution=1024)
    assert len(warned) == 1 and "--resolution 512 is not applied" in warned[0]


# ------------------------------------------------------- the sampler's advice in flags (issue 24, item 7)
def test_sampler_advice_is_said_once_in_flags_from_the_main_process(sd_folder, five_images, caplog):
    import warnings

    args = script.parse_args(["--pretrained_model_name_or_path", sd_folder, "--train_data_dir", five_images,
                              "--full_finetune", "--aspect_ratio_buckets", "64,64", "--train_batch_size", "2", "--seed",
                              "0"])
    ds, buckets = train_data.dataset_with_buckets(args, None)  # 5 rows, one bucket: batches of 2 drop 1 row (20 %)
    for main in (True, False):
        rank = SimpleNamespace(num_processes=1, process_index=0, is_main_process=main)
        with caplog.at_level(logging.INFO, logger=script.logger.name), warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            make_sampler(args, ds, buckets, rank)
        said = [r.getMessage() for r in caplog.records if "drops" in r.getMessage()]
        assert not [x for x in w if issubclass(x.category, UserWarning)]  # no UserWarning with its source line
        if main:
            assert len(said) == 1 and "--bucket_leftover fill (or catch_all)" in said[0]
            assert "a smaller --train_batch_size" in said[0] and "leftover=" not in said[0]
            assert "merge_small" not in said[0] and "`" not in said[0]
        else:
            assert said == []
        caplog.clear()


def test_fill_that_repeats_most_rows_is_said_once_in_flags(sd_folder, five_images, caplog):
    """issue 34: --bucket_leftover fill at a batch far above the rows repeated them in silence (drop warned)."""
    import warnings

    args = script.parse_args(["--pretrained_model_name_or_path", sd_folder, "--train_data_dir", five_images,
                              "--full_finetune", "--aspect_ratio_buckets", "64,64", "--train_batch_size", "8",
                              "--bucket_leftover", "fill", "--seed", "0"])
    ds, buckets = train_data.dataset_with_buckets(args, None)  # 5 rows, one bucket: a batch of 8 repeats 3 (60 %)
    rank = SimpleNamespace(num_processes=1, process_index=0, is_main_process=True)
    with caplog.at_level(logging.INFO, logger=script.logger.name), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        make_sampler(args, ds, buckets, rank)
    said = [r.getMessage() for r in caplog.records if "repeats" in r.getMessage()]
    assert not [x for x in w if issubclass(x.category, UserWarning)]
    assert len(said) == 1 and said[0].startswith("The epoch plan repeats 3 rows per epoch (5 assigned rows"), said
    assert "with --bucket_leftover fill" in said[0] and "--bucket_leftover drop (or catch_all)" in said[0]
    assert "`" not in said[0] and "merge_small" not in said[0]


# ------------------------------------------------------------ a quiet console (issue 24, items 7 and 10)
def test_on_the_fly_annotation_summary_is_said_once_without_the_table_in_script_flags(sd_folder, five_images,
                                                                                      capsys):
    args = script.parse_args(["--pretrained_model_name_or_path", sd_folder, "--train_data_dir", five_images,
                              "--full_finetune", "--aspect_ratio_buckets", "64,64"])
    not_main = SimpleNamespace(is_main_process=False, main_process_first=contextlib.nullcontext)
    train_data.dataset_with_buckets(args, not_main)
    assert capsys.readouterr().out == ""  # other ranks print nothing
    train_data.dataset_with_buckets(args, None)
    out = capsys.readouterr().out
    assert out.count("rows: 5  kept: 5") == 1
    assert "rows per bucket" not in out and "64 x 64" not in out  # the table is the start-up report's
    assert "skip them with --max_aspect_error 0.25" in out  # 4 rows cropped far: advice in this script's flag
    assert "Python:" not in out and "--max-aspect-error" not in out
