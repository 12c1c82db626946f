"""train_text_to_image_arb.py --streaming: a BucketedStream over annotated local parquet shards.

Fast tests check the flag errors (before anything loads); the slow ones launch the script with
``torchrun --nproc_per_node 2`` (see tests/test_train.py) and check that both ranks train the same bucket at every
step, and that a run resumed from a mid-epoch checkpoint ends with the uninterrupted run's weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _train_fixtures import GROUP, batch_result, stream_argv
from test_train import (
    max_weight_diff,
    read_trace,
    reset_accelerate,
    script,
)

from hf_arb.train.progress import Progress
from hf_arb.train.sources.stream import build_stream_dataloader, restore_stream, stream_state_path, streaming_dataset


def _args(assets: dict[str, Any], out: Path, *extra: str) -> list[str]:
    return stream_argv(assets, "--output_dir", str(out), *extra)


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
        streaming_dataset(args)


def test_stream_counts_file_is_used(stream_assets, tmp_path):
    counts = tmp_path / "counts.json"
    counts.write_text('{"4": 8, "6": 12}')
    args = script.parse_args(_args(stream_assets, tmp_path, "--stream_counts", str(counts)))
    assert streaming_dataset(args)[2].tolist() == [0, 0, 0, 0, 8, 0, 12]


def test_stream_counts_come_from_the_shards(stream_assets):
    import numpy as np

    args = script.parse_args(_args(stream_assets, Path("unused")))
    _, buckets, counts = streaming_dataset(args)
    assert counts.tolist()[: len(stream_assets["counts"])] == stream_assets["counts"]
    assert int(counts.sum()) == stream_assets["rows"] and len(counts) == len(buckets)
    assert np.count_nonzero(counts) == 5  # the five aspect ratios of the tiny photos


# ----------------------------------------------------------------------------------- slow: torchrun x2
@pytest.fixture(scope="module")
def stream_runs(ddp_batch) -> dict[str, Any]:
    """5 steps on 2 processes, checkpoint at 2, and checkpoint-2 resumed (tests/_train_fixtures.py, in the suite's
    one 2-process launch)."""
    full, resumed = batch_result(ddp_batch, "stream-full"), batch_result(ddp_batch, "stream-resumed")
    return {"full": full["out"], "resumed": resumed["out"], "stats_full": full["stats"],
            "stats_resumed": resumed["stats"]}


@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
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
@pytest.mark.xdist_group(GROUP)
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
    micro-batch counter is refused (no model: the stream alone, one process). The rows are the shards' rows as an
    Arrow-backed IterableDataset: datasets 5.2 sleeps 5 s each time a parquet stream's reader closes (three times
    here, docs/sampler.md "Limits"); the training runs above read the parquet shards themselves."""
    import json
    from types import SimpleNamespace

    import datasets

    args = script.parse_args(_args(stream_assets, tmp_path, "--train_batch_size", "6"))
    parquet, _, counts = streaming_dataset(args)
    files = sorted(str(f) for f in Path(stream_assets["shards"]).glob("*.parquet"))
    ds = datasets.Dataset.from_parquet(files).to_iterable_dataset(num_shards=len(files))
    assert ds.features == parquet.features
    loader, stream = build_stream_dataloader(args, None, ds, counts)
    steps = stream.steps_per_epoch
    assert sum(1 for _ in loader) == steps
    rank0 = SimpleNamespace(process_index=0)
    stream_state_path(tmp_path, rank0).write_text(json.dumps(stream.state_dict(step=steps)))
    _, again = build_stream_dataloader(args, None, ds, counts)
    restore_stream(rank0, again, tmp_path, Progress(micro_step=steps))
    assert (again.epoch, again.step) == (0, steps)
    _, wrong = build_stream_dataloader(args, None, ds, counts)
    with pytest.raises(ValueError, match="micro_step"):
        restore_stream(rank0, wrong, tmp_path, Progress(micro_step=steps - 1))
    with pytest.raises(script.UsageError, match="stream_rank0.json"):
        restore_stream(rank0, wrong, tmp_path / "nowhere", Progress())
