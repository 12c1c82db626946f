"""Real multi-process runs of BucketBatchSampler: ``torchrun --nproc_per_node 2`` and ``3`` on CPU (gloo).

The worker (tests/_sampler_worker.py) gathers every rank's batches and records what it saw; these tests
assert on those records. The 2-process run (batch 3) saves a sampler state mid-epoch that the 3-process
run (batch 2, the same global batch of 6) resumes: elastic resume across real launches.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parent / "_sampler_worker.py"
ROOT = WORKER.parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(nproc: int, script: Path, *args: str, cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    """torchrun on CPU (gloo); retried on a fresh port if another process took the chosen one meanwhile."""
    env = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               TOKENIZERS_PARALLELISM="false")
    for _attempt in range(3):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(script), *args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
        if proc.returncode == 0 or "address already in use" not in (proc.stdout + proc.stderr).lower():
            break
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc


def _torchrun(nproc: int, out: Path, *args: str, timeout: int = 120) -> list[dict]:
    _launch(nproc, WORKER, "--out", str(out), *args, cwd=ROOT, timeout=timeout)
    return [json.loads((out / f"result_rank{r}.json").read_text()) for r in range(nproc)]


def _check_accelerate_run(results: list[dict], world: int) -> None:
    for rank, res in enumerate(results):
        for mode in ("shard", "dispatch", "split"):
            for epoch, ep in res[mode].items():
                where = f"rank {rank}, {mode}, epoch {epoch}"
                assert ep["steps"] == ep["len"] > 0, where
                assert ep["matches_plan"], f"{where}: gathered batches differ from plan_epoch"
                assert ep["duplicates"] == 0, where
                assert ep["same_bucket"], f"{where}: ranks in different buckets at a step"
        r = res["resume"]
        assert r["state_epoch"] == 1 and r["state_consumed"] == r["k"], r  # exact despite workers reading ahead
        assert r["head_matches_plan"], r
        assert r["resumed_len"] == r["rest_len"] > 0, r
        assert r["resumed_equals_rest"] and r["next_epoch_equal"] and r["next_epoch_is_plan2"], r
        assert r["all_equal_over_ranks"], r
        for mode in ("shard", "dispatch", "split"):  # plain accelerator.prepare is refused, not silently thinned
            err = res[f"naive_prepare_error_{mode}"]
            assert "prepare_dataloader" in err or (mode == "split" and "split_batches" in err), (mode, err)
        s = res["skip_first_batches"]
        assert s["equals_rest"] and s["then_epoch2"], s


@pytest.mark.slow
def test_torchrun_2_then_3_processes_with_elastic_resume(tmp_path: Path) -> None:
    state = tmp_path / "elastic_state.json"
    two = _torchrun(2, tmp_path / "w2", "--batch-size", "3", "--resume-at", "4", "--save-elastic", str(state))
    _check_accelerate_run(two, 2)
    saved = json.loads(state.read_text())
    assert saved["num_replicas"] == 2 and saved["batches_consumed"] == 4

    three = _torchrun(3, tmp_path / "w3", "--batch-size", "2", "--resume-at", "7", "--load-elastic", str(state))
    _check_accelerate_run(three, 3)
    for res in three:
        e = res["elastic"]
        assert e["saved_world"] == 2 and e["world"] == 3
        assert e["steps"] == e["expected_steps"] > 0
        assert e["continues_global_sequence"], e


@pytest.mark.slow
def test_plain_torchrun_without_accelerate(tmp_path: Path) -> None:
    results = _torchrun(2, tmp_path, "--mode", "plain", "--batch-size", "4")
    for res in results:
        assert res["num_replicas"] == 2 and res["rank_ok"]
        for epoch in ("epoch0", "epoch1"):
            assert res[epoch]["matches_plan"] and res[epoch]["duplicates"] == 0, res
        assert res["resume_exact"]


@pytest.mark.slow
def test_docs_recipe_runs_and_resumes(tmp_path: Path) -> None:
    """The accelerate recipe in docs/sampler.md, run as written on 2 processes, twice: the second run loads
    the checkpoint taken at step 100 of epoch 2 and trains only the rest of that epoch."""
    doc = (ROOT / "docs" / "sampler.md").read_text()
    section = doc[doc.index("### The recipe"):]
    code = section[section.index("```python") + len("```python"):]
    code = code[: code.index("```")]
    script = tmp_path / "example_train.py"
    script.write_text(code)
    outs = []
    for _ in range(2):
        proc = _launch(2, script, cwd=tmp_path, timeout=180)
        outs.append([line for line in proc.stdout.splitlines() if "done" in line])
    assert [line.split(":")[0] for line in outs[0]] == ["epoch 0 done", "epoch 1 done", "epoch 2 done"]
    assert [line.split(":")[0] for line in outs[1]] == ["epoch 2 done"]
    assert (tmp_path / "checkpoints" / "last" / "custom_checkpoint_0.pkl").exists()
