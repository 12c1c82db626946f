"""Annotation from width/height columns on 10^7 Parquet rows: ``datasets``, Ray Data and Spark side by side.

Data: 10^7 LAION-like rows (``id``, ``WIDTH``, ``HEIGHT`` int64, ~1 % null/invalid) in 10 Parquet files of 10^6
rows, written once under /tmp (not part of any figure). Every engine runs the same Arrow-batch function
(:func:`hf_arb.annotate.arrow_batch.annotate_batch`) end to end, Parquet in -> annotated Parquet out (the BucketSet in
the schema metadata), on the same machine in one process run:

- ``datasets``: ``load_dataset("parquet")`` + ``hf_arb.add_bucket_columns`` + ``Dataset.to_parquet`` (one process);
- ``datasets.map``: the same, but ``Dataset.map(annotate_batch, batched=True)`` over Arrow batches of 10^5 rows;
- Ray Data: ``ray.init(num_cpus=N)``, ``read_parquet`` + ``hf_arb.annotate.engines.ray.add_bucket_columns`` +
``write_parquet``;
- Spark: ``local[N]``, ``read.parquet`` + ``hf_arb.annotate.engines.spark.add_bucket_columns`` + ``write_parquet``.

Cluster start-up is excluded (reported separately); the summary (counts per bucket, skips by reason) aggregated on
each engine is timed on its own. The machine's load average is recorded: on a shared machine the figures are
pessimistic.

Usage: ``python benchmarks/bench_engines.py [--quick] [--rows N] [--cpus N]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _util import row, save_result

from hf_arb import BucketSet

BUCKETS = BucketSet.sdxl()


def make_data(root: Path, rows: int, files: int = 10, seed: int = 0) -> Path:
    """``files`` Parquet files of LAION-like sizes under ``root`` (kept as a cache keyed by the row count)."""
    folder = root / f"sizes-{rows}"
    done = root / f"sizes-{rows}.done"
    if done.exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    per = rows // files
    for i in range(files):
        w = rng.integers(64, 4096, per).astype(np.int64)
        h = (w / np.exp(rng.normal(0, 0.4, per))).astype(np.int64) + 1
        w[rng.random(per) < 0.005] = 0
        table = pa.table({"id": np.arange(i * per, (i + 1) * per), "WIDTH": pa.array(w, mask=rng.random(per) < 0.005),
                          "HEIGHT": h})
        pq.write_table(table, folder / f"part-{i:03d}.parquet", row_group_size=per // 4)
    done.touch()
    return folder


def _timed(fn):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run_datasets(src: Path, out: Path, use_map: bool) -> tuple[float, float, int]:
    import datasets

    from hf_arb import add_bucket_columns
    from hf_arb.annotate.arrow_batch import annotate_batch
    from hf_arb.annotate.map import summarize_annotation

    datasets.disable_progress_bars()
    shutil.rmtree(out, ignore_errors=True)
    cache = out.parent / (out.name + "-cache")
    shutil.rmtree(cache, ignore_errors=True)

    def go() -> datasets.Dataset:
        ds = datasets.load_dataset("parquet", data_dir=str(src), split="train", cache_dir=str(cache))
        if use_map:
            ann = ds.with_format("arrow").map(
                annotate_batch, batched=True, batch_size=100_000, load_from_cache_file=False,
                fn_kwargs=dict(buckets=BUCKETS, width_column="WIDTH", height_column="HEIGHT")).with_format(None)
        else:
            ann = add_bucket_columns(ds, BUCKETS, width_column="WIDTH", height_column="HEIGHT", show_summary=False)
        ann.to_parquet(str(out / "data.parquet"))
        return ann

    seconds, ann = _timed(go)
    summary_s, summary = _timed(lambda: summarize_annotation(ann, BUCKETS))
    shutil.rmtree(cache, ignore_errors=True)
    return seconds, summary_s, summary.rows


def run_ray(src: Path, out: Path, cpus: int) -> tuple[float, float, float, int]:
    import ray

    from hf_arb.annotate.engines import ray as hf_ray

    start, _ = _timed(lambda: ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False))
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        shutil.rmtree(out, ignore_errors=True)
        ray.data.range(cpus).map_batches(lambda b: b).materialize()  # warm the worker pool (start-up, not work)

        def go():  # type: ignore[no-untyped-def]
            ds = hf_ray.add_bucket_columns(ray.data.read_parquet(str(src)), BUCKETS, width_column="WIDTH",
                                           height_column="HEIGHT")
            ds.write_parquet(str(out))

        seconds, _ = _timed(go)
        summary_s, summary = _timed(lambda: hf_ray.summarize(ray.data.read_parquet(str(out)), BUCKETS))
    finally:
        ray.shutdown()
    return start, seconds, summary_s, summary.rows


def run_spark(src: Path, out: Path, cpus: int) -> tuple[float, float, float, int]:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from hf_arb.annotate.engines import spark as hf_spark

    start, spark = _timed(lambda: SparkSession.builder.master(f"local[{cpus}]").config("spark.ui.enabled", "false")
                          .config("spark.sql.shuffle.partitions", str(2 * cpus)).config("spark.driver.memory", "4g")
                          .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    try:
        shutil.rmtree(out, ignore_errors=True)
        spark.range(cpus).repartition(cpus).rdd.map(lambda x: x).count()  # warm the Python workers

        def go() -> None:
            df = hf_spark.add_bucket_columns(spark.read.parquet(str(src)), BUCKETS, width_column="WIDTH",
                                             height_column="HEIGHT")
            hf_spark.write_parquet(df, str(out), BUCKETS)

        seconds, _ = _timed(go)
        summary_s, summary = _timed(lambda: hf_spark.summarize(spark.read.parquet(str(out)), BUCKETS))
    finally:
        spark.stop()
    return start, seconds, summary_s, summary.rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="10^6 rows")
    p.add_argument("--rows", type=int, default=None)
    p.add_argument("--cpus", type=int, default=os.cpu_count() or 2)
    p.add_argument("--cache", default="/tmp/hf_arb_bench_engines")
    p.add_argument("--only", default="datasets,map,ray,spark")
    args = p.parse_args()
    rows = args.rows or (1_000_000 if args.quick else 10_000_000)
    root = Path(args.cache)
    src = make_data(root, rows)
    load0 = os.getloadavg()[0]
    only = set(args.only.split(","))
    results: dict[str, dict[str, float]] = {}
    runs = [("datasets", "datasets", lambda: (None, *run_datasets(src, root / "out-datasets", use_map=False))),
            ("map", "datasets.map", lambda: (None, *run_datasets(src, root / "out-map", use_map=True))),
            ("ray", "Ray Data", lambda: run_ray(src, root / "out-ray", args.cpus)),
            ("spark", "Spark", lambda: run_spark(src, root / "out-spark", args.cpus))]
    for key, name, fn in runs:
        if key not in only:
            continue
        st, s, sm, n = fn()
        assert n == rows, (name, n, rows)
        results[name] = {"seconds": s, "summary": sm, **({} if st is None else {"startup": st})}
        _save(results, rows, args, load0)  # after every engine: a later failure keeps the figures so far
    return 0


def _save(results: dict[str, dict[str, float]], rows: int, args: argparse.Namespace, load0: float) -> None:
    load1 = os.getloadavg()[0]
    base = results.get("datasets", {}).get("seconds")
    table = []
    for name, r in results.items():
        note = f"{r['seconds']:.1f} s end to end; summary {r['summary']:.2f} s"
        if "startup" in r:
            note += f"; cluster start {r['startup']:.1f} s (not counted)"
        table.append(row(f"{name}: Parquet -> annotated Parquet, {rows:,} rows, {args.cpus} cores", rows / r["seconds"],
                         rows / base if base else None, "rows/s", higher_is_better=True, note=note))
        table.append(row(f"{name}: summary on the engine, {rows:,} rows", rows / r["summary"], None, "rows/s",
                         higher_is_better=True))
    save_result(
        "engines", f"Annotation on datasets, Ray Data and Spark ({rows:,} rows from width/height columns)", table,
        command=f"python benchmarks/bench_engines.py{' --quick' if args.quick else ''}",
        baseline="hf_arb.add_bucket_columns on a datasets.Dataset (one process), same rows and files",
        details=(f"Same Arrow-batch function on every engine, {args.cpus} cores, local clusters. Load average "
                 f"{load0:.1f} at the start and {load1:.1f} at the end (the machine was shared: figures are "
                 "pessimistic for Ray and Spark, which need free cores for their workers)."),
        extra={"rows": rows, "cpus": args.cpus, "loadavg": [load0, load1], "results": results})


if __name__ == "__main__":
    raise SystemExit(main())
