"""Worker for tests/test_sampler_distributed.py, launched with ``torchrun --nproc_per_node N``.

Every check that needs all ranks runs here; rank 0 writes ``result.json`` (under ``--out``) with what it
saw, and the test asserts on it. Scenarios (``--mode``):

* ``accelerate``: ``DataLoader(batch_sampler=BucketBatchSampler)`` through ``hf_arb.prepare_dataloader``
  under three dataloader configurations (default sharding, ``dispatch_batches=True``,
  ``split_batches=True``): a whole epoch is gathered from all ranks and compared with the pure plan;
  mid-epoch ``save_state``/``load_state`` with DataLoader workers reading ahead; the
  ``skip_first_batches`` recipe; the elastic state (``--save-elastic`` / ``--load-elastic``).
* ``plain``: ``torch.distributed`` without accelerate (gloo), the sampler defaults read the process group.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import hf_arb
from hf_arb.sampler import plan_epoch

SEED = 7
N_ROWS = 700


def bucket_ids() -> np.ndarray:
    """Unequal buckets incl. one smaller than a global batch and skipped rows, shape (N_ROWS,)."""
    rng = np.random.default_rng(0)
    return rng.choice([-1, 0, 1, 2, 3, 4], size=N_ROWS, p=[0.03, 0.4, 0.25, 0.2, 0.11, 0.01])


class RowDataset(Dataset):
    """Returns the row index and its bucket, so a batch tells which rows it holds."""

    def __init__(self, ids: np.ndarray) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, int]:
        return {"row": int(i), "bucket": int(self.ids[i])}


def rows_of(batch: dict[str, torch.Tensor]) -> list[int]:
    return batch["row"].tolist()


def gather_steps(accelerator, steps: list[list[int]], batch_size: int) -> np.ndarray:
    """All ranks' batches, shape (world, steps, batch); also checks equal step counts via gather."""
    counts = accelerator.gather(torch.tensor([len(steps)]))
    assert len(set(counts.tolist())) == 1, f"unequal step counts over ranks: {counts.tolist()}"
    t = torch.tensor(steps, dtype=torch.int64).reshape(len(steps), batch_size)
    g = accelerator.gather(t.unsqueeze(0))  # (world, steps, batch)
    return g.numpy()


def build(accelerator, ids, batch_size, num_workers=0, register=True):
    sampler = hf_arb.BucketBatchSampler(ids, batch_size, seed=SEED)
    dl = DataLoader(RowDataset(ids), batch_sampler=sampler, num_workers=num_workers)
    prepared = hf_arb.prepare_dataloader(accelerator, dl)
    if register:
        accelerator.register_for_checkpointing(sampler)
    return sampler, prepared


def run_accelerate(args) -> dict:
    from accelerate import Accelerator, DataLoaderConfiguration

    ids = bucket_ids()
    B = args.batch_size
    out: dict = {}
    for name, cfg in (("shard", {}), ("dispatch", {"dispatch_batches": True}),
                      ("split", {"split_batches": True})):
        acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**cfg))
        W, r = acc.num_processes, acc.process_index
        sampler, dl = build(acc, ids, B, register=False)
        epoch_out = {}
        for epoch in range(2):  # the loader's own pass counter must reach the plan (set_epoch)
            steps = [rows_of(b) for b in dl]
            g = gather_steps(acc, steps, B)
            expected = plan_epoch(ids, B, W, seed=SEED, epoch=epoch)  # (steps, world, batch)
            flat = g.reshape(-1)
            epoch_out[epoch] = {
                "steps": len(steps),
                "len": expected.shape[0],
                "matches_plan": bool(np.array_equal(g.transpose(1, 0, 2), expected)),
                "duplicates": int(flat.size - np.unique(flat).size),
                "same_bucket": bool((ids[g] == ids[g[:1, :, :1]]).all()),
            }
        out[name] = epoch_out

    # a plain accelerator.prepare would shard the per-rank sampler a second time: refused loudly
    for name, cfg in (("shard", {}), ("dispatch", {"dispatch_batches": True}), ("split", {"split_batches": True})):
        acc_naive = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**cfg))
        try:  # accelerate itself refuses split_batches when batch_size % world != 0
            naive = acc_naive.prepare(
                DataLoader(RowDataset(ids), batch_sampler=hf_arb.BucketBatchSampler(ids, B, seed=SEED)))
            next(iter(naive))
            out[f"naive_prepare_error_{name}"] = ""
        except (RuntimeError, ValueError) as err:
            out[f"naive_prepare_error_{name}"] = str(err)
        acc_naive.wait_for_everyone()

    # exact mid-epoch resume through save_state/load_state, with 2 DataLoader workers reading ahead
    W = acc.num_processes
    ckpt = Path(args.out) / "ckpt"
    acc = Accelerator(cpu=True)
    sampler, dl = build(acc, ids, B, num_workers=2)
    for _ in dl:  # finish epoch 0
        pass
    k = args.resume_at
    it = iter(dl)
    head = [rows_of(next(it)) for _ in range(k)]
    acc.save_state(str(ckpt))
    acc.wait_for_everyone()  # rank 0 writes the files; the load below must not race it
    state_at_k = sampler.state_dict()
    if args.save_elastic:
        Path(args.save_elastic).write_text(json.dumps(state_at_k))
    rest = [rows_of(b) for b in it]
    nxt = [rows_of(b) for b in dl]  # epoch 2
    acc2 = Accelerator(cpu=True)
    sampler2, dl2 = build(acc2, ids, B, num_workers=2)
    acc2.load_state(str(ckpt))
    resumed_len = len(dl2)
    resumed = [rows_of(b) for b in dl2]
    resumed_next = [rows_of(b) for b in dl2]
    plan1 = plan_epoch(ids, B, W, seed=SEED, epoch=1)[:, acc.process_index].tolist()
    out["resume"] = {
        "state_epoch": state_at_k["epoch"], "state_consumed": state_at_k["batches_consumed"], "k": k,
        "head_matches_plan": head == plan1[:k],
        "resumed_equals_rest": resumed == rest, "resumed_len": resumed_len, "rest_len": len(rest),
        "next_epoch_equal": resumed_next == nxt,
        "next_epoch_is_plan2": nxt == plan_epoch(ids, B, W, seed=SEED, epoch=2)[:, acc.process_index].tolist(),
        "all_equal_over_ranks": bool(
            np.unique(acc2.gather(torch.tensor([int(resumed == rest and resumed_next == nxt)])).numpy()).tolist() == [1]
        ),
    }

    # the skip_first_batches recipe: fresh sampler at epoch 1, skip k batches
    acc3 = Accelerator(cpu=True)
    sampler3, dl3 = build(acc3, ids, B, register=False)
    sampler3.set_epoch(1)
    skipped = [rows_of(b) for b in acc3.skip_first_batches(dl3, k)]
    after = [rows_of(b) for b in dl3]
    out["skip_first_batches"] = {
        "equals_rest": skipped == plan1[k:],
        "then_epoch2": after == plan_epoch(ids, B, W, seed=SEED, epoch=2)[:, acc.process_index].tolist(),
    }

    # elastic: continue a state saved with another number of processes (same global batch)
    if args.load_elastic:
        state = json.loads(Path(args.load_elastic).read_text())
        acc4 = Accelerator(cpu=True)
        sampler4, dl4 = build(acc4, ids, B, register=False)
        sampler4.load_state_dict(state)
        steps = [rows_of(b) for b in dl4]
        g = gather_steps(acc4, steps, B)  # (world, steps, batch)
        glob = g.transpose(1, 0, 2).reshape(len(steps), -1)  # (steps, global batch)
        G = state["global_batch_size"]
        expected = plan_epoch(ids, G, 1, seed=SEED, epoch=state["epoch"])[state["batches_consumed"]:, 0]
        out["elastic"] = {"saved_world": state["num_replicas"], "world": W,
                          "continues_global_sequence": bool(np.array_equal(glob, expected)),
                          "steps": len(steps), "expected_steps": int(expected.shape[0])}
    return out


def run_plain(args) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    W, r = dist.get_world_size(), dist.get_rank()
    ids = bucket_ids()
    B = args.batch_size
    sampler = hf_arb.BucketBatchSampler(ids, B, seed=SEED)  # defaults read torch.distributed
    dl = hf_arb.prepare_dataloader(None, DataLoader(RowDataset(ids), batch_sampler=sampler, num_workers=1))
    out: dict = {"num_replicas": sampler.num_replicas, "rank_ok": sampler.rank == r}
    for epoch in range(2):
        steps = [rows_of(b) for b in dl]
        t = torch.tensor(steps, dtype=torch.int64)
        parts = [torch.empty_like(t) for _ in range(W)]
        dist.all_gather(parts, t)
        g = torch.stack(parts).numpy()
        flat = g.reshape(-1)
        out[f"epoch{epoch}"] = {
            "matches_plan": bool(np.array_equal(g.transpose(1, 0, 2), plan_epoch(ids, B, W, seed=SEED, epoch=epoch))),
            "duplicates": int(flat.size - np.unique(flat).size),
        }
    it = iter(dl)
    for _ in range(3):
        next(it)
    state = sampler.state_dict()
    s2 = hf_arb.BucketBatchSampler(ids, B, seed=SEED)
    s2.load_state_dict(json.loads(json.dumps(state)))
    out["resume_exact"] = list(s2) == [rows_of(b) for b in it]
    dist.destroy_process_group()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["accelerate", "plain"], default="accelerate")
    p.add_argument("--out", required=True)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--resume-at", type=int, default=5)
    p.add_argument("--save-elastic", default="")
    p.add_argument("--load-elastic", default="")
    args = p.parse_args()
    result = run_accelerate(args) if args.mode == "accelerate" else run_plain(args)
    rank = int(os.environ.get("RANK", "0"))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"result_rank{rank}.json").write_text(json.dumps(result, indent=1))
    if args.mode == "accelerate":  # a clean gloo teardown: exiting with the group alive can abort()
        from accelerate import PartialState

        PartialState().wait_for_everyone()
        PartialState().destroy_process_group()


if __name__ == "__main__":
    main()
