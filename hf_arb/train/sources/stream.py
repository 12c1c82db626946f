"""``--streaming``: bucketed batches from a streamed dataset (:class:`hf_arb.BucketedStream`), its per-rank
resume files and its report."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from hf_arb.checks import UsageError
from hf_arb.lazy import LazyModule

from ..files import SKIPPED_ROWS_FILE, STATE_FILE
from ..schedule import Schedule

torch: Any = LazyModule("torch")  # loaded when a function needs it: --help and flag errors answer before torch
logger = logging.getLogger("train_text_to_image_arb")


def stream_files(args: argparse.Namespace) -> list[str]:
    """The annotated parquet shards of --train_data_dir (for --streaming)."""
    files = sorted(str(f) for f in Path(args.train_data_dir).glob("*.parquet"))
    if not files:
        raise UsageError(f"--streaming --train_data_dir {args.train_data_dir}: no *.parquet shards there. Write the "
                         "annotated dataset as parquet shards (`hf-arb annotate ...`, then `ds.to_parquet`).")
    return files


def streaming_dataset(args: argparse.Namespace) -> tuple[Any, Any, np.ndarray]:
    """``(IterableDataset, BucketSet, rows per bucket)`` for --streaming; the data must carry bucket columns. With
    several tiers: ``(IterableDataset, TierTable, rows per combined (tier, bucket) id)``."""
    import datasets

    from hf_arb import BucketSet
    from hf_arb.sampling.streaming.plan import as_counts
    from hf_arb.sampling.streaming.stream import shuffle_shards

    files = stream_files(args) if args.dataset_name is None else None
    ds = datasets.load_dataset(args.dataset_name or "parquet", args.dataset_config_name, data_files=files,
                               data_dir=args.train_data_dir if args.dataset_name else None, split="train",
                               streaming=True, cache_dir=args.cache_dir)
    ds = shuffle_shards(ds, args.seed)  # shard order only, one shard at a time: the stream's buffer mixes the rows
    columns = ds.column_names or list(ds.features or [])
    if "bucket" not in columns:
        raise UsageError(f"--streaming needs a dataset with bucket columns; {args.dataset_name or args.train_data_dir} "
                         f"has {columns}. Run `hf-arb annotate` first and stream the annotated shards.")
    for flag in ("image_column", "caption_column", "stream_key_column"):
        if getattr(args, flag) not in columns:
            raise UsageError(f"--{flag} value '{getattr(args, flag)}' needs to be one of: {', '.join(columns)}")
    key_type = getattr((ds.features or {}).get(args.stream_key_column), "dtype", None)
    if key_type is not None and not str(key_type).startswith(("int", "uint")):
        raise UsageError(
            f"--stream_key_column {args.stream_key_column} holds {key_type}, not integers: pass an integer "
            "id column (e.g. the row number, added when writing the shards)."
        )
    buckets = BucketSet.from_dataset(ds)
    if len(args.resolutions) > 1:  # several tiers: every row's bucket in each tier, from its stored size
        return ds, *tiered_counts(args, ds, files)
    if args.stream_counts is not None:
        counts = as_counts(json.loads(Path(args.stream_counts).read_text()), buckets)
    elif files is not None:  # local shards: the bucket column alone, vectorised
        import pyarrow.parquet as pq

        ids = np.concatenate([pq.read_table(f, columns=["bucket"]).column("bucket").to_numpy() for f in files])
        counts = np.bincount(ids[ids >= 0], minlength=len(buckets)).astype(np.int64)
    else:
        counts = hub_counts(args, ds, buckets)
    if counts.sum() == 0:
        raise UsageError("No trainable images: the stream's bucket column assigns no row to a bucket. Re-annotate "
                         "(`hf-arb annotate`) with a looser --max_aspect_error or another preset.")
    return ds, buckets, counts


def tiered_counts(args: argparse.Namespace, ds: Any, files: list[str] | None) -> tuple[Any, np.ndarray]:
    """``(TierTable, rows per combined (tier, bucket) id)`` from the stored sizes: local shards read the two size
    columns vectorised, a hub dataset streams them once (docs/tiers.md, "With streaming")."""
    from hf_arb.sampling.tiered.stream import combined_counts, tier_stream_counts

    from .tiers import tier_table

    table = tier_table(args)
    w, h = stored_sizes(ds, files)
    counts = combined_counts(tier_stream_counts(w, h, table.tiers), table.tiers)
    if counts.sum() == 0:
        raise UsageError(f"No image is eligible in any tier of --resolution {','.join(map(str, args.resolutions))} "
                         "(too small under --max_upscale): lower the resolutions or raise --max_upscale.")
    return table, counts


def stored_sizes(ds: Any, files: list[str] | None) -> tuple[np.ndarray, np.ndarray]:
    """Every row's stored ``(original_width, original_height)``, float64 ``(n,)`` each (NaN: missing): local shards
    read the two columns vectorised, a hub dataset streams them once."""
    cols = ["original_width", "original_height"]
    if files is not None:
        import pyarrow.parquet as pq

        parts = [pq.read_table(f, columns=cols) for f in files]
        return tuple(np.concatenate([p.column(c).to_numpy(zero_copy_only=False) for p in parts]).astype(np.float64)
                     for c in cols)  # type: ignore[return-value]
    w: list[Any] = []
    h: list[Any] = []
    for batch in ds.select_columns(cols).iter(batch_size=65536):
        w += batch[cols[0]]
        h += batch[cols[1]]
    return tuple(np.array([np.nan if v is None else v for v in a], np.float64) for a in (w, h))  # type: ignore[return-value]


def hub_counts(args: argparse.Namespace, ds: Any, buckets: Any) -> np.ndarray:
    """Rows per bucket from the dataset card (``hf_arb.push_to_hub``), else one pass over the bucket column."""
    from hf_arb.sampling.streaming.plan import counts_from_card

    try:
        from huggingface_hub import DatasetCard

        return counts_from_card(DatasetCard.load(args.dataset_name), "train", buckets)
    except Exception as err:  # noqa: BLE001 -- no card, no hf_arb stats in it, offline: count instead (said, not silent)
        logger.warning("--streaming: no bucket counts from the card of %s (%s); counting the bucket column in one "
                       "pass (pass --stream_counts to skip it).", args.dataset_name, err)
    counts = np.zeros(len(buckets), dtype=np.int64)
    for batch in ds.select_columns(["bucket"]).iter(batch_size=65536):
        ids = np.asarray(batch["bucket"], dtype=np.int64)
        counts += np.bincount(ids[ids >= 0], minlength=len(buckets))[: len(buckets)]
    return counts


def build_stream_dataloader(args: argparse.Namespace, accelerator: Any, ds: Any, counts: np.ndarray) -> tuple[Any, Any]:
    """``(DataLoader, BucketedStream)``: one bucket per step on every rank, each rank reading its own split."""
    import hf_arb
    from hf_arb.sampling import StreamImageCollate

    collate = StreamImageCollate(args.stream_key_column, args.image_column, args.caption_column, seed=args.seed,
                                 center_crop=args.center_crop, random_flip=args.random_flip,
                                 on_bad_image=args.on_bad_image,
                                 bad_image_log=Path(args.output_dir) / SKIPPED_ROWS_FILE)
    if len(args.resolutions) > 1:  # one stream per tier, the schedule picks the tier of every step
        from hf_arb.sampling.tiered.stream import build_tiered_stream_loader

        from .tiers import tier_table

        tiers = tier_table(args).tiers
        try:
            if args.resolution_schedule == "random":  # a tier per image and epoch: one stream over every (tier, bucket)
                from hf_arb.sampling.tiered.stream_draw import build_random_stream_loader, stream_groups

                groups = stream_groups(*stored_sizes(ds, stream_files(args) if args.dataset_name is None else None),
                                       tiers)
                return build_random_stream_loader(ds, tiers, args.train_batch_size, groups=groups,
                                                  accelerator=accelerator, seed=args.seed,
                                                  buffer_size=args.stream_buffer_size,
                                                  on_overflow=args.stream_on_overflow, collate_fn=collate)
            return build_tiered_stream_loader(ds, tiers, args.resolution_schedule,
                                              args.train_batch_size, counts=counts, accelerator=accelerator,
                                              seed=args.seed, buffer_size=args.stream_buffer_size,
                                              on_overflow=args.stream_on_overflow, collate_fn=collate)
        except ValueError as err:
            raise UsageError(f"--streaming --resolution {','.join(map(str, args.resolutions))}: {err}") from None
    return hf_arb.build_stream_loader(ds, args.train_batch_size, counts=counts, accelerator=accelerator,
                                      seed=args.seed, buffer_size=args.stream_buffer_size,
                                      on_overflow=args.stream_on_overflow, collate_fn=collate)


def stream_state_path(folder: Path | str, accelerator: Any) -> Path:
    return Path(folder) / f"stream_rank{accelerator.process_index}.json"


def stream_startup_report(accelerator: Any, buckets: Any, counts: np.ndarray, stream: Any, schedule: Schedule,
                          args: argparse.Namespace) -> None:
    """--streaming's first table: rows per bucket (from the counts), the stream's report, the step arithmetic."""
    if not accelerator.is_main_process:
        return
    lines = [f"{'bucket':>11} {'aspect':>7} {'rows':>9}"]
    for i in buckets.portrait_to_landscape():
        w, h = buckets.resolutions[i]
        lines.append(f"{w:>5} x {h:<5} {w / h:7.3f} {int(counts[i]) if i < len(counts) else 0:>9,}")
    print("\n".join(lines), flush=True)
    print(stream.report(), flush=True)
    print(f"***** Running training (streaming) *****\n  Num examples = {int(counts.sum())}\n"
          f"  Steps per epoch = {schedule.batches_per_epoch}\n  Num Epochs = {schedule.num_train_epochs}\n"
          f"  Instantaneous batch size per device = {args.train_batch_size}\n"
          f"  Total optimization steps = {schedule.max_train_steps}", flush=True)


def restore_stream(accelerator: Any, stream: Any, resume_dir: Path, progress: Any) -> None:
    """--streaming: this rank's stream state from the checkpoint; it must sit where the micro-batch counter is."""
    path = stream_state_path(resume_dir, accelerator)
    if not path.exists():
        raise UsageError(f"Checkpoint {resume_dir} has no {path.name}: it was not saved by a --streaming run (or with "
                         "another number of processes). Resume it without --streaming, or start a new run.")
    stream.load_state_dict(json.loads(path.read_text()))
    where = locate_micro(stream, progress.micro_step)
    at_end = stream.step >= stream.steps_per_epoch  # saved after an epoch's last batch: the next epoch starts
    if (stream.epoch + at_end, 0 if at_end else stream.step) != where:
        raise ValueError(f"Checkpoint {resume_dir}: {path.name} is at epoch {stream.epoch} step {stream.step}, but "
                         f"{STATE_FILE}'s micro_step {progress.micro_step} is at epoch {where[0]} step {where[1]}.")


def locate_micro(sampler: Any, micro_step: int) -> tuple[int, int]:
    """``(epoch, micro-batches into it)`` of a rank's ``micro_step`` in a stream: its ``steps_in`` per epoch (epochs
    of their own length: tiered streams), else ``steps_per_epoch`` each."""
    steps_in = getattr(sampler, "steps_in", None)
    if steps_in is None:
        return divmod(int(micro_step), sampler.steps_per_epoch)
    epoch, left = 0, int(micro_step)
    while left >= steps_in(epoch):
        left, epoch = left - steps_in(epoch), epoch + 1
    return epoch, left


def stream_print(accelerator: Any, stream: Any, when: str) -> None:
    if stream is not None and accelerator.is_main_process:
        print(f"[stream, {when}] {stream.report()}", flush=True)
