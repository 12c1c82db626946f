"""Real ``torchrun`` runs of BucketedStream over local parquet shards (2 and 3 processes on CPU, gloo).

The worker (tests/_stream_worker.py) trains through a plain ``accelerator.prepare``, resumes at several points and
repeats the epoch in accelerate's dispatch mode. 2 ranks read 5 shards (datasets then splits rows, not files): that
run is one of the shared 2-process batch (``ddp_batch``, tests/_train_fixtures.py), so it costs no launch of its
own; 3 ranks read 6 shards (whole files per rank) in a launch of their own, whose launcher imports only what the
worker needs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _train_fixtures import (
    GROUP,
    LIGHT_PRELOAD,
    STREAM_DIST_BATCH,
    STREAM_DIST_ROWS,
    STREAM_DIST_SHARDS,
    batch_result,
    launch_stages,
    write_stream_shards,
)

WORKER = Path(__file__).resolve().parent / "_stream_worker.py"
ROOT = WORKER.parent.parent


@pytest.mark.slow
@pytest.mark.parametrize(("world", "shards"), [(3, STREAM_DIST_SHARDS[3])])
def test_torchrun_stream(tmp_path, world, shards):
    ids = np.asarray(write_stream_shards(tmp_path, STREAM_DIST_ROWS, shards))
    launch_stages(tmp_path, [{"name": "stream", "script": WORKER, "nproc": world, "args": [
        "--data", str(tmp_path), "--out", str(tmp_path / "out"), "--batch", str(STREAM_DIST_BATCH)]}],
        LIGHT_PRELOAD)  # the launcher imports only what the worker needs (not the training stack)
    _check([json.loads((tmp_path / "out" / f"result_rank{r}.json").read_text()) for r in range(world)], ids, world)


@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
def test_two_ranks_stream_in_the_shared_batch(ddp_batch):
    """2 ranks, 5 shards: the ``stream-dist`` run of the shared 2-process batch."""
    run = batch_result(ddp_batch, "stream-dist")
    _check([json.loads((run["out"] / f"result_rank{r}.json").read_text()) for r in range(2)], np.asarray(run["ids"]),
           2)


def _check(res: list[dict], ids: np.ndarray, world: int) -> None:
    """Each rank's result (tests/_stream_worker.py) against the rows' bucket ids ``(n,)``."""
    n, batch = STREAM_DIST_ROWS, STREAM_DIST_BATCH
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
