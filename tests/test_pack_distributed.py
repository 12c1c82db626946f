"""Packing on 2 real processes (torchrun, CPU gloo): PackBatchSampler through a plain ``accelerator.prepare``
deals each rank exactly its planned packs (variable-size batches) and resumes mid-epoch; PackedFlowModel under
DDP averages the ranks' packed-loss gradients like the same losses computed without DDP. The 2 processes are those
of the shared 2-process batch (its ``pack-dist`` run, tests/_train_fixtures.py): no torchrun launch of its own."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from hf_arb.packing.plan import fit_sizes, plan_packs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pack_worker import MAX_TOKENS, MODES, SEED, sizes
from _train_fixtures import GROUP, batch_result

pytestmark = pytest.mark.xdist_group(GROUP)


@pytest.fixture(scope="module")
def results(ddp_batch) -> list[dict]:
    out = batch_result(ddp_batch, "pack-dist")["out"]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_each_rank_gets_its_planned_packs_and_resumes(results):
    tokens = fit_sizes(*sizes(), MAX_TOKENS).tokens
    plans = [plan_packs(tokens, MAX_TOKENS, 2, seed=SEED, epoch=e) for e in range(2)]
    for mode in MODES:
        for rank, res in enumerate(results):
            rec = res["data"][mode]
            assert rec["len"] == [p.num_steps for p in plans], mode
            for e, plan in enumerate(plans):
                assert rec["epochs"][e] == [p.tolist() for p in plan.iter_rank(rank)], (mode, rank, e)
            assert rec["resumed_epoch"] == 1
            assert rec["resumed"] == [p.tolist() for p in plans[1].iter_rank(rank, start_step=3)], (mode, rank)
    sizes_per_step = {len(b) for b in results[0]["data"]["default"]["epochs"][0]}
    assert len(sizes_per_step) > 1  # packs really hold different numbers of images


@pytest.mark.slow
def test_ddp_averages_the_packed_loss_gradients(results):
    for res in results:
        m = res["model"]
        assert m["wrapped"] == "DistributedDataParallel" and len(m["losses"]) == 2
        for name, ref in m["reference"].items():
            got, want = np.array(m["ddp"][name]), np.array(ref)
            assert np.abs(got - want).max() <= 1e-6 + 1e-5 * np.abs(want).max(), name
    assert results[0]["model"]["losses"] != results[1]["model"]["losses"]  # each rank trained its own pack
