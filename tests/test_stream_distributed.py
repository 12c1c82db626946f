"""Real ``torchrun`` runs of BucketedStream over local parquet shards (2 and 3 processes on CPU, gloo).

One launch per world size; the worker (tests/_stream_worker.py) trains through a plain ``accelerator.prepare``,
resumes at several points and repeats the epoch in accelerate's dispatch mode. 2 ranks read 5 shards (datasets
then splits rows, not files), 3 ranks read 6 shards (whole files per rank).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_train import torchrun

WORKER = Path(__file__).resolve().parent / "_stream_worker.py"
ROOT = WORKER.parent.parent


def _write_shards(folder: Path, n: int, shards: int) -> np.ndarray:
    rng = np.random.default_rng(5)
    ids = rng.choice([-1, 0, 1, 2, 3, 4], size=n, p=[.04, .4, .3, .15, .1, .01]).astype(np.int32)
    size = np.maximum(ids + 1, 1) * 4
    table = pa.table({"key": np.arange(n), "bucket": ids, "bucket_width": size, "bucket_height": 8 + 0 * size})
    for i, part in enumerate(np.array_split(np.arange(n), shards)):
        pq.write_table(table.take(part), folder / f"part-{i:03d}.parquet")
    (folder / "counts.json").write_text(json.dumps(np.bincount(ids[ids >= 0], minlength=5).tolist()))
    return ids


@pytest.mark.slow
@pytest.mark.parametrize(("world", "shards"), [(2, 5), (3, 6)])
def test_torchrun_stream(tmp_path, world, shards):
    n, batch = 600, 3
    ids = _write_shards(tmp_path, n, shards)
    torchrun(WORKER, ["--data", str(tmp_path), "--out", str(tmp_path / "out"), "--batch", str(batch)], world)
    res = [json.loads((tmp_path / "out" / f"result_rank{r}.json").read_text()) for r in range(world)]

    steps = res[0]["steps"]
    counts = np.bincount(ids[ids >= 0], minlength=5)
    assert steps == int((counts // (world * batch)).sum()) > 0
    for r in res:  # equal step counts, and len(prepared loader) says so
        assert r["len"] == steps and len(r["full"]) == steps and r["schedule"] == res[0]["schedule"]
    for s in range(steps):  # the scheduled bucket on every rank at every step
        assert {r["full"][s][-1] for r in res} == {res[0]["schedule"][s]}
    keys = [k for r in res for step in r["full"] for k in step[:-1]]
    reports = [r["report"] for r in res]
    used = sum(rep["rows_used"] for rep in reports)
    assert len(set(keys)) == used and len(keys) == used + sum(rep["rows_repeated"] for rep in reports)
    read = sum(rep["rows_read"] for rep in reports)
    accounted = sum(rep[f] for rep in reports for f in ("rows_used", "rows_buffered", "rows_skipped_unassigned",
                                                        "rows_skipped_small", "rows_skipped_surplus", "rows_evicted"))
    assert read == accounted and read <= n
    assert all(rep["peak_buffered"] <= 150 + 5 * batch for rep in reports)
    for r in res:  # resume at several points: the remaining batches equal the uninterrupted run
        assert len(r["resumed"]) == 3
        for k, rest in r["resumed"].items():
            assert rest == r["full"][int(k):], f"resume at step {k} diverged"
        assert r["dispatched"] == r["full"]  # dispatch mode: rank 0 reads every split, same batches
        assert r["dispatch_rank"] is None
