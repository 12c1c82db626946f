"""Streaming: BucketedStream vs plain ``datasets`` streaming of the same local parquet source.

Source: 1,000,000 rows in 16 parquet files (metadata — key, caption, bucket columns — plus a small embedded PNG
per row, 16×16, drawn from a pool of 64, stored as bytes so neither side decodes it), bucket ids with NovelAI's
published proportions in random order. Two ranks, *simulated in one process* (the machine has 2 shared cores):

* ours: ``BucketedStream(num_replicas=2, rank=None, batch_size=8, buffer_size=4096, reader="arrow")`` — every
  rank's split read through ``split_dataset_by_node`` as Arrow chunks made python columns at once, buffered per
  bucket, one batch per rank and step of the global schedule (the same batches as the source reader gives);
* baseline: the same two splits read with plain ``datasets`` streaming (``for row in split``, what a
  ``DataLoader`` over the stream does) and cut into batches of 8 with no bucketing (rank 0's split, then rank 1's);
* floor (for reference): the same splits read the way BucketedStream reads them, in chunks of 256 rows
  (``split.iter(batch_size=256)``, split into row dicts), cut into batches of 8 — reading without bucketing;
* floor_arrow (for reference): the floor read the way ours reads (``with_format("arrow")``, each chunk made python
  columns with ``Table.to_pydict()``): reading without bucketing at the cost ours reads at;
* before (for reference): ours with the previous rank buffer (the one of commit 83fc72e, frozen in
  ``benchmarks/_stream_v2``, which reads through the source's python formatting), the same batches, to compare the
  two in one process;
* hold (for reference): a bare shuffle buffer of the same size, without buckets (:func:`hold`): the same chunked
  reads, each rank holding ``shuffle_rows`` (= ``buffer_size // 2``) rows and popping its batch at random positions,
  the ranks interleaved step by step as ours. What holding that many rows costs by itself: the part of ours over the
  floor that no bookkeeping can remove while the rows are held as Python objects.

Repeats alternate baseline, ours, floor, before, hold and floor_arrow (3 by default); every repeat is reported with
wall time and CPU time per row (CPU time is what the machine's load does not change much; the machine is shared).
Also measured: peak rows held by a rank (buffer + repeat reserve, bounded by ``buffer_size + k × batch``) and their
memory, the state size and the time to resume mid-epoch (``load_state_dict`` + first batch).

Usage: ``python benchmarks/bench_stream.py [--quick] [--rows N] [--repeats R]``
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _stream_v2  # noqa: E402
from _util import row, save_result  # noqa: E402
from bench_sampler import novelai_ids  # noqa: E402

from hf_arb.sampling.streaming.stream import BucketedStream  # noqa: E402

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


def floor(ds, chunk: int = 256) -> int:
    from datasets.distributed import split_dataset_by_node

    batches = 0
    for r in range(WORLD):
        batch = []
        for cols in split_dataset_by_node(ds, rank=r, world_size=WORLD).iter(batch_size=chunk):
            for ex in (dict(zip(cols, values)) for values in zip(*cols.values())):
                batch.append(ex)
                if len(batch) == BATCH:
                    batches, batch = batches + 1, []
    return batches


def floor_arrow(ds, chunk: int = 256) -> int:
    """The floor read the way ``reader="arrow"`` reads: the same splits as Arrow tables of ``chunk`` rows, each made
    python columns at once (``Table.to_pydict()``), split into row dicts and cut into batches of 8."""
    from datasets.distributed import split_dataset_by_node

    batches = 0
    for r in range(WORLD):
        batch = []
        for table in split_dataset_by_node(ds, rank=r, world_size=WORLD).with_format("arrow").iter(batch_size=chunk):
            cols = table.to_pydict()
            for ex in (dict(zip(cols, values)) for values in zip(*cols.values())):
                batch.append(ex)
                if len(batch) == BATCH:
                    batches, batch = batches + 1, []
    return batches


def pick(q: list, draws) -> list:
    """Take ``len(draws)`` items out of ``q`` at the positions the uniform ``draws`` (in [0, 1)) pick, each taken item
    replaced by ``q``'s last (the shuffle buffer's O(1) removal)."""
    n, rows = len(q), []
    for x in draws:
        i, n = int(x * n), n - 1
        rows.append(q[i])
        q[i] = q[n]
        del q[n]
    return rows


def hold(ds, chunk: int = 256, fill: int = BUFFER // 2, block: int = 1024) -> int:
    """A bare shuffle buffer of the same size as ours, without buckets: the same chunked reads, each rank's split
    read into one list of row tuples kept at ``fill`` rows (``shuffle_rows``' default), and at every step each rank's
    batch taken at uniform positions (drawn in blocks of steps; a taken row's slot gets the list's last row, so no
    list is shifted) and made row dicts; the ranks interleaved step by step as ours. What holding the rows costs,
    without the bucketing's bookkeeping."""
    from datasets.distributed import split_dataset_by_node

    g = np.random.default_rng(0)
    its = [iter(split_dataset_by_node(ds, rank=r, world_size=WORLD).iter(batch_size=chunk)) for r in range(WORLD)]
    held: list[list[tuple]] = [[] for _ in range(WORLD)]
    names: list[tuple[str, ...]] = [() for _ in range(WORLD)]
    reading, serving, batches, step = set(range(WORLD)), set(range(WORLD)), 0, 0
    while serving:
        if step % block == 0:  # uniforms for a block of steps, as ours draws them
            u = g.random((block, WORLD, BATCH)).tolist()
        for r in sorted(serving):
            q = held[r]
            while len(q) < fill + BATCH and r in reading:
                cols = next(its[r], None)
                if cols is None:
                    reading.discard(r)
                else:
                    names[r] = tuple(cols)
                    q.extend(zip(*cols.values()))
            if len(q) < BATCH:
                serving.discard(r)
                continue
            rows = pick(q, u[step % block][r])
            batch = [dict(zip(names[r], row)) for row in rows]
            batches += len(batch) // BATCH
        step += 1
    return batches


def row_bytes_in_memory(ds) -> float:
    """Mean Python memory of a decoded row (the dict and its values), over the first 1,000 rows."""
    sizes = [sys.getsizeof(ex) + sum(sys.getsizeof(v) for v in ex.values()) for ex in ds.take(1000)]
    return float(np.mean(sizes))


def ours(ds, counts: np.ndarray, cls: type = BucketedStream, **kw) -> tuple[int, BucketedStream]:
    kw = {"reader": "arrow", **kw} if cls is BucketedStream else kw  # the frozen buffer has the source reader only
    stream = cls(ds, BATCH, counts=counts, num_replicas=WORLD, seed=0, buffer_size=BUFFER, on_overflow="evict",
                 **kw)
    return sum(1 for _ in stream), stream


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows of the source (default 1e6)")
    ap.add_argument("--repeats", type=int, default=3, help="alternated runs of each side (default 3)")
    args = ap.parse_args()
    n = 50_000 if args.quick else args.rows
    from datasets import load_dataset

    with tempfile.TemporaryDirectory() as tmp:
        ids = write_source(Path(tmp), n)
        counts = np.bincount(ids[ids >= 0], minlength=int(ids.max()) + 1)
        files = sorted(str(p) for p in Path(tmp).glob("*.parquet"))
        ds = load_dataset("parquet", data_files=files, split="train", streaming=True)
        size_mb = sum(Path(f).stat().st_size for f in files) / 1e6
        # (wall s, CPU s) per run of each side
        runs: dict[str, list[tuple[float, float]]] = {"plain": [], "ours": [], "floor": [], "before": [], "hold": [],
                                                      "floor_arrow": []}
        for _ in range(args.repeats):  # alternated, on a shared machine
            for name, times in runs.items():
                t0, c0 = time.perf_counter(), time.process_time()
                if name == "plain":
                    nb_plain = plain(ds)
                elif name == "ours":
                    nb_ours, stream = ours(ds, counts)
                elif name == "before":
                    ours(ds, counts, _stream_v2.BucketedStreamV2)
                elif name == "hold":
                    hold(ds)
                elif name == "floor_arrow":
                    floor_arrow(ds)
                else:
                    floor(ds)
                times.append((time.perf_counter() - t0, time.process_time() - c0))
                print(name, f"{times[-1][0]:.2f} s wall, {times[-1][1]:.2f} s CPU", flush=True)
        rep = stream.report()
        med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in runs.items()}
        row_bytes = size_mb * 1e6 / n
        mem_row = row_bytes_in_memory(ds)
        # resume mid-epoch: state after half the steps, then load + first batch in a fresh stream
        half = BucketedStream(ds, BATCH, counts=counts, num_replicas=WORLD, seed=0, buffer_size=BUFFER,
                              on_overflow="evict")
        it = iter(half)
        for _ in range(WORLD * (half.steps_per_epoch // 2 + 1)):
            next(it)
        state = json.loads(json.dumps(half.state_dict(step=half.steps_per_epoch // 2)))
        t0, c0 = time.perf_counter(), time.process_time()
        again = BucketedStream(ds, BATCH, counts=counts, num_replicas=WORLD, seed=0, buffer_size=BUFFER,
                               on_overflow="evict")
        again.load_state_dict(state)
        next(iter(again))
        resume_s, resume_cpu = time.perf_counter() - t0, time.process_time() - c0

    k = counts.size
    bound = BUFFER + k * BATCH

    def per_row(name: str) -> str:
        return ", ".join(f"{w:.1f} s/{c / n * 1e6:.1f}" for w, c in runs[name])

    us = {name: med[name][1] / n * 1e6 for name in runs}

    def ratios(a: str, b: str) -> str:
        """CPU time of side ``a`` over side ``b``: the ratio of the medians, then each run's (in run order)."""
        per = ", ".join(f"{x[1] / y[1]:.2f}×" for x, y in zip(runs[a], runs[b]))
        return f"{med[a][1] / med[b][1]:.2f}× (per run: {per})"

    rows = [
        row("rows/s read, 2 ranks simulated in one process (median)", n / med["ours"][0], n / med["plain"][0],
            "rows/s", higher_is_better=True, target="within 1.3× of plain streaming (ratio ≥ 0.77)",
            note=f"ours {med['ours'][0]:.2f} s for {rep.rows_read:,} rows read / {nb_ours:,} batches; plain "
                 f"{med['plain'][0]:.2f} s for {n:,} rows / {nb_plain:,} batches; medians of {args.repeats} alternated "
                 f"runs on a shared 2-core machine (each run wall s/CPU µs per row: ours {per_row('ours')}; plain "
                 f"{per_row('plain')})"),
        row("CPU time per row (median; load-independent)", us["ours"], us["plain"], "µs/row",
            target="ratio ≥ 0.77",
            note=f"floor, the same chunked reads (iter(batch_size=256)) without bucketing: {us['floor']:.1f} µs/row "
                 f"(runs {per_row('floor')}), so bucketing costs {us['ours'] - us['floor']:.1f} µs/row over reading"),
        row("bucketing's own cost: CPU time of ours over the floor's (median)", med["ours"][1], med["floor"][1],
            "s CPU",
            target="≤ 1.5× (issue #39)",
            note=f"ours / floor = {ratios('ours', 'floor')}; the floor reads the same splits in the same chunks "
                 "into row dicts and cuts batches of 8, without bucketing; before (the rank buffer of commit 83fc72e, "
                 f"benchmarks/_stream_v2, same batches) / floor = {ratios('before', 'floor')}; hold (a bare shuffle "
                 f"buffer of shuffle_rows = {BUFFER // 2} rows per rank, no buckets, the same reads) / floor = "
                 f"{ratios('hold', 'floor')}, ours / hold = {ratios('ours', 'hold')}; min over runs: ours "
                 f"{min(c for _, c in runs['ours']):.2f} s, before {min(c for _, c in runs['before']):.2f} s, "
                 f"hold {min(c for _, c in runs['hold']):.2f} s, floor {min(c for _, c in runs['floor']):.2f} s; "
                 f"ours reads with reader='arrow': against the floor read the same way (Arrow chunks made python "
                 f"columns, floor_arrow, {us['floor_arrow']:.1f} µs/row) ours / floor_arrow = "
                 f"{ratios('ours', 'floor_arrow')}, floor / floor_arrow = {ratios('floor', 'floor_arrow')}"),
        row("peak rows held by one rank (buffer + repeat reserve)", float(rep.peak_buffered), None, "rows",
            target=f"≤ buffer_size + k × batch = {bound:,}",
            note=f"≈ {rep.peak_buffered * mem_row / 1e6:.1f} MB as decoded Python rows ({mem_row:.0f} B/row; "
                 f"{row_bytes:.0f} B/row on disk); bound {bound:,} rows ≈ {bound * mem_row / 1e6:.1f} MB, plus the "
                 f"chunk being read (snapshot_every = 256 rows ≈ {256 * mem_row / 1e6:.2f} MB)"),
        row("resume mid-epoch (load_state_dict + first batch, both ranks)", resume_s, None, "s",
            note=f"{resume_cpu:.2f} s CPU; state {len(json.dumps(state)) / 1e3:.0f} kB JSON (read indices, counters, "
                 f"source snapshots); "
                 "replays at most snapshot_every=256 rows per snapshot it restores"),
    ]
    details = (f"{n:,} rows, {FILES} parquet files, {size_mb:.0f} MB (metadata + a 16×16 PNG per row, not decoded); "
               f"{WORLD} ranks simulated in one process, batch {BATCH}, buffer_size {BUFFER}; epoch report: {rep}")
    save_result("stream", f"Streaming ({n:,} parquet rows, 2 ranks simulated, batch {BATCH})", rows,
                command="python benchmarks/bench_stream.py" + ("" if args.quick or n == 1_000_000 else f" --rows {n}")
                + ("" if args.repeats == 3 else f" --repeats {args.repeats}"),
                baseline="plain datasets streaming of the same splits (split_dataset_by_node, row by row), "
                         "batches of 8, no bucketing", details=details,
                extra={"report": rep.to_dict(), "runs_wall_cpu_s": runs, "cpu_us_per_row_median": us})


if __name__ == "__main__":
    main()
