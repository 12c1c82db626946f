"""train_text_to_image_arb.py --streaming: a BucketedStream over annotated local parquet shards.

Fast tests check the flag errors (before anything loads); the slow ones launch the script with
``torchrun --nproc_per_node 2`` (see tests/test_train.py) and check that both ranks train the same bucket at every
step, and that a run resumed from a mid-epoch checkpoint ends with the uninterrupted run's weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from test_train import COMMON, max_weight_diff, read_trace, reset_accelerate, run_script, script

#: 20 tiny photos (5 aspect ratios x 4) repeated this many times with distinct ids, so each rank's split
#: holds rows of every bucket.
REPEAT = 3
SHARDS = 4


def build_shards(root: Path) -> dict[str, Any]:
    """Annotated parquet shards (``bucket*`` columns + an integer ``id``), rows shuffled, in ``SHARDS`` files."""
    import datasets
    import numpy as np

    from hf_arb import BucketSet, add_bucket_columns
    from hf_arb.tiny import save_tiny_imagefolder, save_tiny_sd

    images = save_tiny_imagefolder(root / "images")
    ds = datasets.load_dataset("imagefolder", data_files={"train": str(Path(images) / "**")}, split="train")
    ds = add_bucket_columns(ds, BucketSet.preset("budget", resolution=64, step=16), image_column="image")
    ds = datasets.concatenate_datasets([ds] * REPEAT)
    ds = ds.select(np.random.default_rng(0).permutation(len(ds)))
    ds = ds.add_column("id", list(range(len(ds))))
    shards = root / "shards"
    shards.mkdir()
    for i in range(SHARDS):
        ds.shard(SHARDS, i, contiguous=True).to_parquet(str(shards / f"train-{i:05d}.parquet"))
    ids = np.asarray(ds["bucket"])
    return {"shards": str(shards), "sd": save_tiny_sd(root / "tiny-sd"), "rows": len(ds),
            "counts": np.bincount(ids[ids >= 0]).tolist()}


@pytest.fixture(scope="session")
def stream_assets(shared_artifact) -> dict[str, Any]:
    return shared_artifact("train-stream-assets", build_shards)


def _args(assets: dict[str, Any], out: Path, *extra: str) -> list[str]:
    return ["--pretrained_model_name_or_path", assets["sd"], "--train_data_dir", assets["shards"], *COMMON,
            "--streaming", "--stream_key_column", "id", "--output_dir", str(out), *extra]


# ------------------------------------------------------------------------------------------- fast: flags
def _error(argv: list[str]) -> str:
    with pytest.raises(script.UsageError) as err:
        args = script.parse_args(argv)
        script.check_environment(args)
    return str(err.value)


def test_streaming_needs_a_key_column(stream_assets, tmp_path):
    argv = _args(stream_assets, tmp_path)
    i = argv.index("--stream_key_column")
    message = _error(argv[:i] + argv[i + 2:])
    assert "--streaming needs --stream_key_column" in message and "\n" not in message


def test_streaming_rejects_cache_latents(stream_assets, tmp_path):
    assert "--cache_latents does not apply to --streaming" in _error(_args(stream_assets, tmp_path, "--cache_latents"))


def test_stream_flags_need_streaming(stream_assets, tmp_path):
    argv = [a for a in _args(stream_assets, tmp_path) if a != "--streaming"]
    assert "--stream_key_column configures streaming" in _error(argv)


def test_missing_stream_counts_file_is_an_error(stream_assets, tmp_path):
    message = _error(_args(stream_assets, tmp_path, "--stream_counts", str(tmp_path / "nope.json")))
    assert "--stream_counts" in message and "nope.json" in message


def test_unannotated_data_is_an_error(stream_assets, tmp_path):
    import pyarrow.parquet as pq

    plain = tmp_path / "plain"
    plain.mkdir()
    table = pq.read_table(next(Path(stream_assets["shards"]).glob("*.parquet")))
    pq.write_table(table.drop_columns([c for c in table.column_names if c.startswith("bucket")]),
                   plain / "train-0.parquet")
    argv = _args(stream_assets, tmp_path / "out")
    argv[argv.index("--train_data_dir") + 1] = str(plain)
    try:
        with pytest.raises(script.UsageError, match="hf-arb annotate"):
            script.main(argv)
    finally:
        reset_accelerate()


def test_non_integer_key_column_is_an_error(stream_assets, tmp_path):
    args = script.parse_args(_args(stream_assets, tmp_path, "--stream_key_column", "text"))
    with pytest.raises(script.UsageError, match="--stream_key_column text holds string, not integers"):
        script.streaming_dataset(args)


def test_stream_counts_file_is_used(stream_assets, tmp_path):
    counts = tmp_path / "counts.json"
    counts.write_text('{"4": 8, "6": 12}')
    args = script.parse_args(_args(stream_assets, tmp_path, "--stream_counts", str(counts)))
    assert script.streaming_dataset(args)[2].tolist() == [0, 0, 0, 0, 8, 0, 12]


def test_stream_counts_come_from_the_shards(stream_assets):
    import numpy as np

    args = script.parse_args(_args(stream_assets, Path("unused")))
    _, buckets, counts = script.streaming_dataset(args)
    assert counts.tolist()[: len(stream_assets["counts"])] == stream_assets["counts"]
    assert int(counts.sum()) == stream_assets["rows"] and len(counts) == len(buckets)
    assert np.count_nonzero(counts) == 5  # the five aspect ratios of the tiny photos


# ----------------------------------------------------------------------------------- slow: torchrun x2
@pytest.fixture(scope="module")
def stream_runs(stream_assets, tmp_path_factory) -> dict[str, Any]:
    full = tmp_path_factory.mktemp("stream_full")
    base = ["--random_flip", "--max_train_steps", "5", "--checkpointing_steps", "2"]
    stats_full = run_script(_args(stream_assets, full, *base), nproc=2)
    resumed = tmp_path_factory.mktemp("stream_resumed")
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    stats_resumed = run_script(_args(stream_assets, resumed, *base, "--resume_from_checkpoint", "latest"), nproc=2)
    return {"full": full, "resumed": resumed, "stats_full": stats_full, "stats_resumed": stats_resumed}


@pytest.mark.slow
@pytest.mark.xdist_group("train_stream")
def test_streaming_two_ranks_train_the_same_bucket(stream_runs):
    r0, r1 = read_trace(stream_runs["full"], 0), read_trace(stream_runs["full"], 1)
    assert len(r0) == len(r1) == 5
    assert [t["step"] for t in r0] == [t["step"] for t in r1] == [0, 1, 2, 3, 4]
    assert [t["bucket"] for t in r0] == [t["bucket"] for t in r1]
    assert [t["shape"] for t in r0] == [t["shape"] for t in r1]
    for a, b in zip(r0, r1):  # each rank its own rows
        assert not set(a["rows"]) & set(b["rows"])
    stats = stream_runs["stats_full"]
    assert stats["global_step"] == 5 and stats["num_processes"] == 2
    report = stats["stream_report"]
    assert report["steps"] == stats["schedule"]["batches_per_epoch"]
    assert "[stream, epoch 0 start]" in stats["log"]
    for rank in (0, 1):
        assert (stream_runs["full"] / "checkpoint-2" / f"stream_rank{rank}.json").exists()


@pytest.mark.slow
@pytest.mark.xdist_group("train_stream")
def test_streaming_resume_reaches_the_same_weights(stream_runs):
    full, resumed = stream_runs["full"], stream_runs["resumed"]
    for rank in (0, 1):
        tail = [t for t in read_trace(full, rank) if t["step"] >= 2]
        again = read_trace(resumed, rank)
        assert [(t["step"], t["rows"], t["time_ids_first"]) for t in again] == \
               [(t["step"], t["rows"], t["time_ids_first"]) for t in tail]
    assert stream_runs["stats_resumed"]["global_step"] == 5
    assert max_weight_diff(full, resumed) < 1e-6


def test_restore_stream_at_an_epoch_end_and_a_wrong_counter(stream_assets, tmp_path):
    """A checkpoint after an epoch's last batch resumes at the next epoch; a stream file that disagrees with the
    micro-batch counter is refused (no model: the stream alone, one process)."""
    import json
    from types import SimpleNamespace

    args = script.parse_args(_args(stream_assets, tmp_path, "--train_batch_size", "6"))
    ds, _, counts = script.streaming_dataset(args)
    loader, stream = script.build_stream_dataloader(args, None, ds, counts)
    steps = stream.steps_per_epoch
    assert sum(1 for _ in loader) == steps
    rank0 = SimpleNamespace(process_index=0)
    script.stream_state_path(tmp_path, rank0).write_text(json.dumps(stream.state_dict(step=steps)))
    _, again = script.build_stream_dataloader(args, None, ds, counts)
    script.restore_stream(rank0, again, tmp_path, script.Progress(micro_step=steps))
    assert (again.epoch, again.step) == (0, steps)
    _, wrong = script.build_stream_dataloader(args, None, ds, counts)
    with pytest.raises(ValueError, match="micro_step"):
        script.restore_stream(rank0, wrong, tmp_path, script.Progress(micro_step=steps - 1))
    with pytest.raises(script.UsageError, match="stream_rank0.json"):
        script.restore_stream(rank0, wrong, tmp_path / "nowhere", script.Progress())
