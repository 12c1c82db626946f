"""Streaming: BucketedStream vs plain ``datasets`` streaming of the same local parquet source.

Source: 1,000,000 rows in 16 parquet files (metadata — key, caption, bucket columns — plus a small embedded PNG
per row, 16×16, drawn from a pool of 64, stored as bytes so neither side decodes it), bucket ids with NovelAI's
published proportions in random order. Two ranks, *simulated in one process* (the machine has 2 shared cores):

* ours: ``BucketedStream(num_replicas=2, rank=None, batch_size=8, buffer_size=4096)`` — every rank's split read
  through ``split_dataset_by_node``, buffered per bucket, one batch per rank and step of the global schedule;
* baseline: the same two splits read with plain ``datasets`` streaming and cut into batches of 8 with no
  bucketing (rank 0's split, then rank 1's).

Also measured: peak rows held by a rank (buffer + repeat reserve, bounded by ``buffer_size + k × batch``) and
its bytes, the state size and the time to resume mid-epoch (``load_state_dict`` + first batch).

Usage: ``python benchmarks/bench_stream.py [--quick] [--rows N]``
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import row, save_result  # noqa: E402
from bench_sampler import novelai_ids  # noqa: E402

from hf_arb.sampling.stream import BucketedStream  # noqa: E402

WORLD, BATCH, BUFFER, FILES = 2, 8, 4096, 16


def _pngs(n: int) -> list[bytes]:
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def write_source(folder: Path, n: int) -> np.ndarray:
    ids = novelai_ids(n / 5_310_961)[:n]
    rng = np.random.default_rng(1)
    pool = _pngs(64)
    table = pa.table({
        "key": np.arange(ids.size), "caption": pa.array([f"photo {i}" for i in range(ids.size)]),
        "image": pa.array([pool[i] for i in rng.integers(0, 64, ids.size)], pa.binary()),
        "bucket": ids.astype(np.int32), "bucket_width": np.full(ids.size, 512, np.int32),
        "bucket_height": np.full(ids.size, 512, np.int32),
    })
    for i, part in enumerate(np.array_split(np.arange(ids.size), FILES)):
        pq.write_table(table.take(part), folder / f"part-{i:03d}.parquet")
    return ids


def plain(ds) -> int:
    from datasets.distributed import split_dataset_by_node

    batches = 0
    for r in range(WORLD):
        batch = []
        for ex in split_dataset_by_node(ds, rank=r, world_size=WORLD):
            batch.append(ex)
            if len(batch) == BATCH:
                batches, batch = batches + 1, []
    return batches


def ours(ds, counts: np.ndarray) -> tuple[int, BucketedStream]:
    stream = BucketedStream(ds, BATCH, counts=counts, num_replicas=WORLD, seed=0, buffer_size=BUFFER,
                            on_overflow="evict")
    return sum(1 for _ in stream), stream


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows of the source (default 1e6)")
    args = ap.parse_args()
    n = 50_000 if args.quick else args.rows
    from datasets import load_dataset

    with tempfile.TemporaryDirectory() as tmp:
        ids = write_source(Path(tmp), n)
        counts = np.bincount(ids[ids >= 0], minlength=int(ids.max()) + 1)
        files = sorted(str(p) for p in Path(tmp).glob("*.parquet"))
        ds = load_dataset("parquet", data_files=files, split="train", streaming=True)
        size_mb = sum(Path(f).stat().st_size for f in files) / 1e6
        times_plain, times_ours, cpu_plain, cpu_ours = [], [], [], []
        for _ in range(2):  # alternate, best of 2 each (shared machine)
            t0, c0 = time.perf_counter(), time.process_time()
            nb_plain = plain(ds)
            times_plain.append(time.perf_counter() - t0)
            cpu_plain.append(time.process_time() - c0)
            t0, c0 = time.perf_counter(), time.process_time()
            nb_ours, stream = ours(ds, counts)
            times_ours.append(time.perf_counter() - t0)
            cpu_ours.append(time.process_time() - c0)
        rep = stream.report()
        t_plain, t_ours = min(times_plain), min(times_ours)
        row_bytes = size_mb * 1e6 / n
        # resume mid-epoch: state after half the steps, then load + first batch in a fresh stream
        half = BucketedStream(ds, BATCH, counts=counts, num_replicas=WORLD, seed=0, buffer_size=BUFFER,
                              on_overflow="evict")
        it = iter(half)
        for _ in range(WORLD * (half.steps_per_epoch // 2 + 1)):
            next(it)
        state = json.loads(json.dumps(half.state_dict(step=half.steps_per_epoch // 2)))
        t0 = time.perf_counter()
        again = BucketedStream(ds, BATCH, counts=counts, num_replicas=WORLD, seed=0, buffer_size=BUFFER,
                               on_overflow="evict")
        again.load_state_dict(state)
        next(iter(again))
        resume_s = time.perf_counter() - t0

    rows_s_ours, rows_s_plain = rep.rows_read / t_ours, n / t_plain
    k = counts.size
    rows = [
        row("rows/s read, 2 ranks simulated in one process", rows_s_ours, rows_s_plain, "rows/s",
            higher_is_better=True, target="within 1.3× of plain streaming (ratio ≥ 0.77)",
            note=f"ours {t_ours:.2f} s for {rep.rows_read:,} rows read / {nb_ours:,} batches; plain {t_plain:.2f} s "
                 f"for {n:,} rows / {nb_plain:,} batches (best of 2 each, alternated, on a shared 2-core machine); CPU time "
                 f"ours {min(cpu_ours):.2f} s, plain {min(cpu_plain):.2f} s (ratio {min(cpu_plain) / min(cpu_ours):.2f})"),
        row("peak rows held by one rank (buffer + repeat reserve)", float(rep.peak_buffered), None, "rows",
            target=f"≤ buffer_size + k × batch = {BUFFER + k * BATCH:,}",
            note=f"≈ {rep.peak_buffered * row_bytes / 1e6:.2f} MB at {row_bytes:.0f} B/row on disk (decoded "
                 "Python rows take several times more)"),
        row("resume mid-epoch (load_state_dict + first batch, both ranks)", resume_s, None, "s",
            note=f"state {len(json.dumps(state)) / 1e3:.0f} kB JSON (read indices, counters, source snapshots); "
                 "replays at most snapshot_every=256 rows per snapshot it restores"),
    ]
    details = (f"{n:,} rows, {FILES} parquet files, {size_mb:.0f} MB (metadata + a 16×16 PNG per row, not decoded); "
               f"{WORLD} ranks simulated in one process, batch {BATCH}, buffer_size {BUFFER}; epoch report: {rep}")
    save_result("stream", f"Streaming ({n:,} parquet rows, 2 ranks simulated, batch {BATCH})", rows,
                command="python benchmarks/bench_stream.py",
                baseline="plain datasets streaming of the same splits (split_dataset_by_node), batches of 8, "
                         "no bucketing", details=details, extra={"report": rep.to_dict()})


if __name__ == "__main__":
    main()
