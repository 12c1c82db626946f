"""Worker for tests/test_pack_distributed.py, run on 2 processes (CPU, gloo) as the ``pack-dist`` run of the shared
2-process batch (tests/_train_batch_worker.py calls ``main(argv)``; ``torchrun --nproc_per_node 2`` also works).

1. Data: a ``PackBatchSampler`` in a plain ``accelerator.prepare(DataLoader(...))`` (default, worker and
   ``even_batches=False`` modes): each rank records the rows of every pack it gets in two epochs, and the rest of
   epoch 1 after ``hf_arb.resume_dataloader`` at a mid-epoch step.
2. Model: the tiny SD3 transformer in ``PackedFlowModel``, prepared (DDP); each rank backpropagates the packed
   loss of its own pack for two steps; it records its gradients after the first step, which DDP must have
   averaged over the ranks, and the gradients of the same two packs computed locally without DDP.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

N_ROWS, MAX_TOKENS, SEED = 300, 1024, 7
MODES = {"default": ({}, 0), "workers": ({}, 2), "even_batches_off": ({"even_batches": False}, 0)}


def sizes() -> tuple[np.ndarray, np.ndarray]:
    r = np.random.default_rng(0)
    return r.integers(100, 900, N_ROWS), r.integers(100, 900, N_ROWS)


class Rows(Dataset):
    def __len__(self) -> int:
        return N_ROWS

    def __getitem__(self, key: tuple) -> list:
        return [int(k) for k in key]


def collate(samples: list) -> list:
    return samples


def data_records(mode: str) -> dict:
    from accelerate import Accelerator, DataLoaderConfiguration

    import hf_arb

    kwargs, workers = MODES[mode]
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(**kwargs))
    sampler = hf_arb.PackBatchSampler(sizes(), MAX_TOKENS, seed=SEED, log_report=False)
    loader = acc.prepare(DataLoader(Rows(), batch_sampler=sampler, collate_fn=collate, num_workers=workers))
    out = {"len": [], "epochs": []}
    for epoch in range(2):
        loader.set_epoch(epoch)
        out["len"].append(len(loader))
        out["epochs"].append([[k[0] for k in batch] for batch in loader])
    resumed, epoch = hf_arb.resume_dataloader(acc, loader, sampler.steps_in(0) + 3)
    out["resumed_epoch"] = epoch
    out["resumed"] = [[k[0] for k in batch] for batch in resumed]
    return out


def _pack(rank: int) -> dict:
    g = torch.Generator().manual_seed(100 + rank)
    shapes = [(8, 12), (6, 6)] if rank == 0 else [(10, 10), (4, 8), (6, 4)]
    return {"latents": [torch.randn(16, h, w, generator=g) for h, w in shapes],
            "noise": [torch.randn(16, h, w, generator=g) for h, w in shapes],
            "text": [torch.randn(5, 64, generator=g) for _ in shapes],
            "pooled": torch.randn(len(shapes), 64, generator=g),
            "sigmas": torch.rand(len(shapes), generator=g) * 0.9 + 0.05}


def _grads(model: torch.nn.Module) -> dict[str, list[float]]:
    names = ["transformer." + n for n in ("transformer_blocks.0.attn.to_q.weight", "pos_embed.proj.weight",
                                         "proj_out.weight", "time_text_embed.timestep_embedder.linear_1.weight")]
    params = dict(model.named_parameters())
    return {n: params[n].grad.flatten()[:64].tolist() for n in names}


def model_records(rank: int, world: int) -> dict:
    from accelerate import Accelerator

    from hf_arb.packing.loss import PackedFlowModel
    from hf_arb.testing.tiny_flow import tiny_sd3_pipeline

    acc = Accelerator()
    local = PackedFlowModel(tiny_sd3_pipeline().transformer)  # same seed on every rank: same weights
    for r in range(world):  # reference: the mean of the ranks' losses, without DDP
        p = _pack(r)
        loss, _ = local(p["latents"], p["noise"], p["text"], p["pooled"], p["sigmas"], max_tokens=128)
        (loss / world).backward()
    reference = _grads(local)
    model = PackedFlowModel(tiny_sd3_pipeline().transformer)
    ddp = acc.prepare(model)
    p = _pack(rank)
    losses = []
    for _step in range(2):  # a second step fails if DDP's reducer was bypassed or saw unused parameters
        model.zero_grad()
        loss, _ = ddp(p["latents"], p["noise"], p["text"], p["pooled"], p["sigmas"], max_tokens=128)
        acc.backward(loss)
        losses.append(float(loss.detach()))
        if _step == 0:
            synced = _grads(acc.unwrap_model(ddp))
    return {"reference": reference, "ddp": synced, "losses": losses, "wrapped": type(ddp).__name__}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from accelerate import Accelerator

    state = Accelerator()  # reads ACCELERATE_USE_CPU (a bare PartialState() does not)
    result = {"data": {m: data_records(m) for m in MODES}, "model": model_records(state.process_index,
                                                                                  state.num_processes)}
    Path(args.out, f"rank{state.process_index}.json").write_text(json.dumps(result))
    state.wait_for_everyone()  # a clean gloo teardown: exiting with the group alive can abort()
    state.end_training()


if __name__ == "__main__":
    main()
