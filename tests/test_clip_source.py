"""Clips reach the training loop (issues 37/38): ``--video_column`` builds the clip source, whose rows are annotated
with (W, H, F) buckets from container headers, planned by the bucket sampler and decoded frame by planned frame.

Fast: the clip dataset's samples (a clip's planned frames at the bucket's size in [-1, 1], (3, F, H, W); a still
through the image path, (3, H, W)), batches of one kind only, a clip damaged after annotation replaced and counted, a
clip's latent-cache key (its crop and its frame plan), an annotated clip dataset's own buckets and frame rate, the clip
flags' mistakes in one line. Slow: the unchanged script trains a Wan LoRA on a mixed folder of MP4 and WebM clips and
PNG stills, and the same from cached latents to the same losses; on 2 processes in the shared 2-process batch
(tests/_train_fixtures.py ``clip_runs``) every rank trains the same (W, H, F) bucket at every step, and the resume
from checkpoint-2 is exact across the epoch boundary."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import test_train
import torch
from _train_fixtures import CLIP, batch_result, mixed_clip_folder
from test_card_code import trained_sizes

import train_text_to_image_arb as script

_clean_accelerate_state = test_train._clean_accelerate_state
CLIP_FLAGS = CLIP


@pytest.fixture(scope="session")
def clip_folder(shared_artifact) -> str:
    return shared_artifact("clip-folder", lambda root: {"folder": mixed_clip_folder(root / "mixed")})["folder"]


def clip_args(model: str, folder: str, *extra: str) -> Any:
    return script.parse_args(["--pretrained_model_name_or_path", model, "--train_data_dir", folder, *CLIP_FLAGS,
                              *extra])


# ------------------------------------------------------------------------------------------ fast: the dataset
@pytest.fixture(scope="module")
def clip_rows(clip_folder, family_assets, tmp_path_factory) -> dict[str, Any]:
    from hf_arb.train.sources.clips import ClipSource

    out = tmp_path_factory.mktemp("clip-rows")
    folder = out / "mixed"
    shutil.copytree(clip_folder, folder)
    source = ClipSource(clip_args(family_assets["wan"], str(folder), "--output_dir", str(out / "run")), None)
    return {"source": source, "folder": folder, "out": out}


def test_clips_decode_their_planned_frames_and_stills_take_the_image_path(clip_rows):
    """A clip row is read_clip's planned frames at its bucket's size and frame count, in [-1, 1], (3, F, H, W); a
    still is a 1-frame bucket, (3, H, W), fitted as the image dataset fits it; the cut file was skipped."""
    from hf_arb import BucketedImageDataset
    from hf_arb.video import read_clip

    source = clip_rows["source"]
    data = source.dataset()
    ds = source.ds
    res = np.asarray(source.buckets.resolutions)
    ids = np.asarray(ds["bucket"])
    names = [Path(p).name for p in ds["video"]]
    assert ids[names.index("cut.mp4")] == -1
    for row, name in enumerate(names):
        if ids[row] < 0:
            continue
        w, h, f = res[ids[row]].tolist()
        sample = data[(row, int(ids[row]), 0)]
        if name.endswith(".png"):
            assert f == 1 and sample["kind"] == "stills" and tuple(sample["pixel_values"].shape) == (3, h, w)
            images = BucketedImageDataset(ds.remove_columns(["bucket_width", "bucket_height"]), res[:, :2],
                                          image_column="video", caption_column=None, seed=0)
            torch.testing.assert_close(sample["pixel_values"], images[(row, int(ids[row]), 0)]["pixel_values"],
                                       rtol=0, atol=0)
        else:
            assert f > 1 and sample["kind"] == "clips" and tuple(sample["pixel_values"].shape) == (3, f, h, w)
            clip = read_clip(ds[row]["video"], (w, h), f, seed=0, epoch=0, row=row, crop="random")
            expect = torch.from_numpy(clip.frames).float().permute(1, 0, 2, 3) / 127.5 - 1
            torch.testing.assert_close(sample["pixel_values"], expect, rtol=0, atol=1e-6)
            assert sample["pixel_values"].min() >= -1 and sample["pixel_values"].max() <= 1


def test_a_batch_is_one_kind_and_one_bucket(clip_rows):
    """Every batch of the sampler's plan collates to (B, C, F, H, W) clips or (B, C, H, W) stills, tagged so."""
    source = clip_rows["source"]

    class _One:
        num_processes, process_index, is_main_process = 1, 0, True

    source.start(_One())
    data = source.dataset()
    kinds = set()
    for keys in source.sampler:
        batch = data.collate([data[k] for k in keys])
        kinds.add(batch["kind"])
        assert batch["pixel_values"].ndim == (5 if batch["kind"] == "clips" else 4)
        assert len(set(batch["buckets"].tolist())) == 1
    assert kinds == {"clips", "stills"}


def test_a_clip_damaged_after_annotation_is_replaced_and_counted(clip_rows):
    """A clip whose file went bad after annotation is a bad row: another clip of its bucket trains instead, and the
    row is named in skipped_rows.jsonl; nothing raises."""
    source = clip_rows["source"]
    ds = source.ds
    names = [Path(p).name for p in ds["video"]]
    row = names.index("pan1.mp4")
    bucket = int(ds["bucket"][row])
    Path(ds[row]["video"]).write_bytes(b"\x00" * 4096)  # the file overwritten since annotation
    data = source.dataset()
    sample = data[(row, bucket, 0)]
    assert sample["row"] != row and int(ds["bucket"][sample["row"]]) == bucket and sample["kind"] == "clips"
    log = [json.loads(line) for line in (clip_rows["out"] / "run" / "skipped_rows.jsonl").read_text().splitlines()]
    assert [r["row"] for r in log] == [row] and log[0]["replaced_by"] == sample["row"]


# ------------------------------------------------------------------------------------------ fast: flags
@pytest.mark.parametrize("extra, message", [
    (["--slide_stride", "4"], r"--slide_stride 4: applies to --frame_sampling slide; add it or drop --slide_stride"),
    (["--alpha_mask"], r"--masked_loss with --video_column: not with clips yet \(masks are per image\)"),
])
def test_clip_flag_mistakes_are_one_line(family_assets, clip_folder, extra, message):
    with pytest.raises(script.UsageError, match=message):
        clip_args(family_assets["wan"], clip_folder, *extra)


def test_clip_flags_without_a_video_column_and_a_clip_run_of_an_image_family_are_refused(family_assets, clip_folder):
    from hf_arb.train.sources import build_source

    with pytest.raises(script.UsageError, match=r"--frames applies to clips: add --video_column"):
        script.parse_args(["--pretrained_model_name_or_path", family_assets["wan"], "--train_data_dir", "d",
                           "--frames", "1,5"])
    args = script.parse_args(["--pretrained_model_name_or_path", family_assets["wan"], "--train_data_dir",
                              clip_folder, "--video_column", "video"])  # an unannotated folder without a clip table
    with pytest.raises(script.UsageError, match=r"no clip bucket columns, and clips train in \(width, height, frames"):
        build_source(args, None)
    with pytest.raises(script.UsageError, match=r"family trains images only"):
        script.parse_args(["--pretrained_model_name_or_path", family_assets["flux2_klein"], "--train_data_dir", "d",
                           "--video_column", "video", "--bucket_preset", "wan"])


# ------------------------------------------------------------------------------------------ slow: the script
@pytest.fixture(scope="module")
def clip_runs(family_assets, clip_folder, shared_artifact) -> dict[str, Any]:
    """The unchanged script on the mixed folder: a 4-step Wan LoRA and the same LoRA from cached latents and prompt
    embeddings."""
    def build(root: Path) -> dict[str, Any]:
        base = ["--pretrained_model_name_or_path", family_assets["wan"], "--train_data_dir", clip_folder,
                *CLIP_FLAGS, "--rank", "4", "--learning_rate", "2e-2", "--max_train_steps", "4",
                "--checkpointing_steps", "2", "--random_flip", "--frame_sampling", "random"]
        out = {}
        for name in ("lora", "cached"):  # the resume: 2 processes, in the shared batch (below)
            argv = [*base, "--output_dir", str(root / name)]
            if name == "cached":
                argv += ["--cache_latents", "--cache_text_embeddings"]
            stats = test_train.run_script(argv)
            out[name] = {"dir": str(root / name), "log": stats["log"], "family": stats["family"],
                         "latents_encoded": stats["latents_encoded"]}
        return out

    return shared_artifact("clip-runs", build)


@pytest.mark.slow
def test_the_unchanged_script_trains_a_wan_lora_on_clips_and_stills(clip_runs):
    """The LoRA trains (W, H, F) clip batches (B, 3, F, H, W) and 1-frame still batches, never mixed; the start-up
    table shows the frames and the card generates at a clip bucket."""
    from test_train import read_trace

    run = clip_runs["lora"]
    trace = read_trace(Path(run["dir"]), 0)
    assert [t["step"] for t in trace] == [0, 1, 2, 3] and all(np.isfinite(t["loss"]) for t in trace)
    assert {len(t["shape"]) for t in trace} == {4, 5}, trace  # stills and clips both trained, never in one batch
    for t in trace:
        frames = int(t["label"].split("x")[2])
        assert (t["shape"][2] == frames) if len(t["shape"]) == 5 else frames == 1
    assert run["family"] == "wan" and "frames      rows" in run["log"]
    card = (Path(run["dir"]) / "README.md").read_text()  # the card generates at a clip bucket, not a still's
    h, w, f = map(int, re.search(r"height=(\d+), width=(\d+), num_frames=(\d+)", card).groups())
    assert f > 1 and (w, h) in trained_sizes(run["log"]) and "num_frames=1" not in card  # a clip bucket with rows
    assert (Path(run["dir"]) / "pytorch_lora_weights.safetensors").exists()


@pytest.mark.slow
def test_two_processes_train_the_same_clip_bucket_at_every_step_and_resume_exactly(ddp_batch):
    """Both ranks train one (W, H, F) bucket per step (stills or clips), different rows; the resume from
    checkpoint-2 replays each rank's steps 3-4 (the 4th in the next epoch) to the same LoRA weights."""
    from safetensors.torch import load_file
    from test_train import read_trace

    full, resumed = batch_result(ddp_batch, "clips-wan-full"), batch_result(ddp_batch, "clips-wan-resumed")
    traces = [read_trace(Path(full["out"]), r) for r in (0, 1)]
    assert [t["label"] for t in traces[0]] == [t["label"] for t in traces[1]]
    assert {len(t["shape"]) for t in traces[0]} == {4, 5} and {t["epoch"] for t in traces[0]} == {0, 1}
    for a, b in zip(*traces):
        assert not set(a["rows"]) & set(b["rows"])
    for r in (0, 1):
        again = read_trace(Path(resumed["out"]), r)
        assert [(t["step"], t["rows"], t["loss"]) for t in again] == [
            (t["step"], t["rows"], t["loss"]) for t in traces[r][2:]]
    a = load_file(str(Path(full["out"]) / "pytorch_lora_weights.safetensors"))
    b = load_file(str(Path(resumed["out"]) / "pytorch_lora_weights.safetensors"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0


def test_a_clips_cache_key_is_its_crop_and_its_frame_plan(clip_rows):
    """--cache_latents keys a clip by its fit plan plus the frames it trains on: the frame plan (start, stride,
    count) is what read_clip decodes; a random window moves with the epoch and so does the key, a head window with a
    centre crop and no flip keeps it; a still's key is the image path's own fit plan."""
    from hf_arb.images.geometry import FitPlan
    from hf_arb.video import read_clip
    from hf_arb.video.dataset import BucketedClipDataset

    source = clip_rows["source"]
    ds, ids = source.ds, np.asarray(source.ds["bucket"])
    names = [Path(p).name for p in ds["video"]]
    row = names.index("pan2.mp4")  # 13 frames in a 9-frame bucket: 5 possible windows
    common = dict(video_column="video", caption_column="text", seed=0, center_crop=True)
    drawn = BucketedClipDataset(ds, source.buckets, mode="random", **common)
    head = BucketedClipDataset(ds, source.buckets, mode="head", **common)
    keys = [drawn.fit_row(row, int(ids[row]), e) for e in range(6)]
    assert len({k.key() for k in keys}) > 1 and len({head.fit_row(row, None, e).key() for e in range(6)}) == 1
    w, h, f = np.asarray(source.buckets.resolutions)[ids[row]].tolist()
    for e, plan in enumerate(keys):
        assert plan.fit.key() == FitPlan.key(head.fit_row(row, None, e).fit) and plan.key()[:-5] == plan.fit.key()
        clip = read_clip(ds[row]["video"], (w, h), f, mode="random", seed=0, epoch=e, row=row)
        start, stride, count = plan.frames
        assert np.round(clip.times * 8).astype(int).tolist() == list(range(start, start + stride * count, stride))
    still = names.index("still0.png")
    assert isinstance(drawn.fit_row(still), FitPlan)


@pytest.mark.slow
def test_a_clip_lora_from_cached_latents_trains_as_on_the_fly(clip_runs):
    """--cache_latents --cache_text_embeddings with clips: every (W, H, F) row encoded once, (B, 2, C, F', h, w)
    latent stats for clips, the on-the-fly run's rows and losses within the float16 cache's tolerance."""
    from test_train import read_trace

    fly, cached = (read_trace(Path(clip_runs[k]["dir"]), 0) for k in ("lora", "cached"))
    assert clip_runs["cached"]["latents_encoded"] == 12
    assert [t["rows"] for t in cached] == [t["rows"] for t in fly]
    assert {len(t["shape"]) for t in cached} == {5, 6}  # stills' (B, 2, C, h, w), clips' (B, 2, C, F', h, w)
    np.testing.assert_allclose([t["loss"] for t in cached], [t["loss"] for t in fly], rtol=2e-3)


def test_an_annotated_clip_dataset_trains_its_own_buckets_at_its_own_frame_rate(family_assets, clip_folder, tmp_path):
    """A dataset annotated with clip buckets (at --target-fps 4: every 2nd frame of the 8 fps clips) keeps its table
    without a clip-table flag; training it at another frame rate is refused naming the strides and the fix."""
    import datasets

    from hf_arb import BucketSet, add_bucket_columns
    from hf_arb.train.sources import build_source

    files = sorted(str(p) for p in Path(clip_folder).iterdir())
    table = BucketSet([(w, h, f) for f in (1, 5) for (w, h) in ((64, 48), (48, 64))])
    ds = add_bucket_columns(datasets.Dataset.from_dict({"video": files}), table, video_column="video", target_fps=4,
                            show_summary=False)
    ds.save_to_disk(str(tmp_path / "annotated"))
    argv = ["--pretrained_model_name_or_path", family_assets["wan"], "--dataset_name", str(tmp_path / "annotated"),
            "--video_column", "video", "--instance_prompt", "a pan", "--rank", "4", "--train_batch_size", "1",
            "--output_dir", str(tmp_path / "out")]
    source = build_source(script.parse_args([*argv, "--target_fps", "4"]), None)
    assert source.buckets == table and source.args.buckets_from_dataset
    with pytest.raises(script.UsageError, match=r"^no --target_fps \(each clip's own rate\): the dataset was "
                                                r"annotated at another frame rate \(8 clips' frame strides differ, "
                                                r"e.g. row \d+: stride 2 annotated, 1 here\)"):
        build_source(script.parse_args(argv), None)


def test_the_loss_per_kind_averages_the_stills_and_the_clips_buckets_of_an_update():
    """With --gradient_accumulation_steps an update may train both kinds: each gets its own key, the mean of its
    buckets' losses (every rank's); an update of one kind has that key only."""
    from hf_arb.train.sources.clips import kind_losses

    frames = np.array([1, 1, 9, 17])
    assert kind_losses({0: [1.0, 3.0], 1: [2.0], 2: [4.0, 6.0], 3: [8.0]}, frames) == {"loss/stills": 2.0,
                                                                                         "loss/clips": 6.0}
    assert kind_losses({3: [0.5, 1.5]}, frames) == {"loss/clips": 1.0}
