"""How a shuffle buffer holds its rows, measured as bare buffers (no buckets, decisions, state or counters): the
``hold`` side of ``bench_stream.py`` (python-formatted chunks split into row tuples) against the same buffer over
Arrow reads (``reader="arrow"``'s chunks: ``Table.to_pydict()``) holding row tuples, holding each chunk's python
columns plus each row's read index (a *columnar hold*: the dict made from the columns when the row leaves, a chunk
dropped when its last row has left), or holding the Arrow tables and making a chunk's columns when its first row
leaves. CPU time of each over ``bench_stream.floor``'s (python-formatted chunks, no buffer); the floor read as Arrow
too. Also the cost of making a batch's rows with ``Table.take(...).to_pylist()``.

Usage: ``python benchmarks/stream_hold_variants.py [--rows 100000] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_stream import BATCH, BUFFER, WORLD, floor, floor_arrow, hold, pick, write_source  # noqa: E402


def _chunks(ds, r: int, chunk: int, arrow: bool, tables: bool = False):
    from datasets.distributed import split_dataset_by_node

    split = split_dataset_by_node(ds, rank=r, world_size=WORLD)
    if not arrow:
        return iter(split.iter(batch_size=chunk))
    it = split.with_format("arrow").iter(batch_size=chunk)
    return iter(it) if tables else (t.to_pydict() for t in it)


def bare(ds, how: str, chunk: int = 256, fill: int = BUFFER // 2, block: int = 1024) -> int:
    """``hold``'s buffer (the same draws) holding its rows ``how``: ``"tuples"`` (row tuples over Arrow reads),
    ``"columns"`` / ``"columns_arrow"`` (chunk columns + read indices over python / Arrow reads) or ``"tables"``."""
    g = np.random.default_rng(0)
    arrow = how != "columns"
    its = [_chunks(ds, r, chunk, arrow, tables=how == "tables") for r in range(WORLD)]
    held: list[list] = [[] for _ in range(WORLD)]
    store: list[dict] = [{} for _ in range(WORLD)]
    names: list[tuple] = [() for _ in range(WORLD)]
    nread = [0] * WORLD
    reading, serving, batches, step = set(range(WORLD)), set(range(WORLD)), 0, 0
    while serving:
        if step % block == 0:
            u = g.random((block, WORLD, BATCH)).tolist()
        for r in sorted(serving):
            q, st = held[r], store[r]
            while len(q) < fill + BATCH and r in reading:
                got = next(its[r], None)
                if got is None:
                    reading.discard(r)
                elif how == "tuples":
                    names[r] = tuple(got)
                    q.extend(zip(*got.values()))
                else:
                    m = len(got) if how == "tables" else len(next(iter(got.values())))
                    st[nread[r] // chunk] = [got, m, None] if how == "tables" else [(tuple(got), list(got.values())),
                                                                                      m, None]
                    q.extend(range(nread[r], nread[r] + m))
                    nread[r] += m
            if len(q) < BATCH:
                serving.discard(r)
                continue
            rows = pick(q, u[step % block][r])
            if how == "tuples":
                batch = [dict(zip(names[r], row)) for row in rows]
            else:
                batch = []
                for i in rows:
                    c, p = divmod(i, chunk)
                    e = st[c]
                    if how == "tables":
                        if e[2] is None:
                            d = e[0].to_pydict()
                            e[2] = (tuple(d), list(d.values()))
                        cols = e[2]
                    else:
                        cols = e[0]
                    batch.append({k: col[p] for k, col in zip(*cols)})
                    e[1] -= 1
                    if e[1] == 0:
                        del st[c]
            batches += len(batch) // BATCH
        step += 1
    return batches


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from datasets import load_dataset

    with tempfile.TemporaryDirectory() as tmp:
        write_source(Path(tmp), args.rows)
        ds = load_dataset("parquet", data_files=sorted(str(p) for p in Path(tmp).glob("*.parquet")), split="train",
                          streaming=True)
        sides = {"floor": lambda: floor(ds), "floor_arrow": lambda: floor_arrow(ds), "hold": lambda: hold(ds),
                 "columns": lambda: bare(ds, "columns"), "tuples_arrow": lambda: bare(ds, "tuples"),
                 "columns_arrow": lambda: bare(ds, "columns_arrow"), "tables_arrow": lambda: bare(ds, "tables")}
        cpu: dict[str, list[float]] = {k: [] for k in sides}
        for _ in range(args.repeats):  # alternated, on a shared machine
            for name, fn in sides.items():
                c0 = time.process_time()
                fn()
                cpu[name].append(time.process_time() - c0)
        table = next(iter(ds.with_format("arrow").iter(batch_size=256)))
        idx = np.random.default_rng(0).integers(0, len(table), (200, BATCH))
        c0 = time.process_time()
        for i in idx:
            table.take(i).to_pylist()
        take_us = (time.process_time() - c0) / len(idx) * 1e6
    base = statistics.median(cpu["floor"])
    print(f"{args.rows:,} rows, CPU s per run (median / floor's median):")
    for name, v in cpu.items():
        print(f"{name:>14}: {' '.join(f'{x:.2f}' for x in v)}  {statistics.median(v) / base:.2f}×")
    print(f"Table.take({BATCH} rows).to_pylist(): {take_us:.0f} µs per batch")


if __name__ == "__main__":
    main()
