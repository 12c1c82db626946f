"""torchrun worker for tests/test_stream_distributed.py: BucketedStream over local parquet shards through a plain
``accelerator.prepare``, per-rank reading (``dispatch_batches=False``), resume at several points, and accelerate's
default dispatch mode. Each rank writes what it got to ``--out/result_rank{r}.json``. ``main(argv)`` is also run by
tests/_train_batch_worker.py (the 2-process case, inside the shared 2-process batch)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from datasets import load_dataset

from hf_arb.sampling.streaming.stream import build_stream_loader


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Tensors, with a pixel tensor shaped by the bucket (what a real collate returns)."""
    w, h = rows[0]["bucket_width"], rows[0]["bucket_height"]
    return {"key": torch.tensor([r["key"] for r in rows]), "bucket": torch.tensor([r["bucket"] for r in rows]),
            "pixels": torch.zeros(len(rows), 3, h, w)}


def record(batch: dict[str, torch.Tensor]) -> list[int]:
    """``keys + [bucket]``; the pixel tensor must match the bucket of every row."""
    b = batch["bucket"].unique().tolist()
    assert len(b) == 1, f"a batch mixes buckets {b}"
    return batch["key"].tolist() + b


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=3)
    args = ap.parse_args(argv)
    files = sorted(str(p) for p in Path(args.data).glob("*.parquet"))
    counts = json.loads((Path(args.data) / "counts.json").read_text())
    ds = load_dataset("parquet", data_files=files, split="train", streaming=True)
    kw = dict(counts=counts, seed=7, buffer_size=150, on_overflow="evict", snapshot_every=10, collate_fn=collate)

    acc = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=False))
    loader, stream = build_stream_loader(ds, args.batch, accelerator=acc, **kw)
    assert stream.rank == acc.process_index, "each process must read only its own split"
    prepared = acc.prepare(loader)
    steps = stream.steps_per_epoch
    points = sorted({1, steps // 2, steps - 1})
    full, states = [], {}
    for i, batch in enumerate(prepared):
        full.append(record(batch))
        if i + 1 in points:  # the loader has run ahead; ask for the state after the steps trained
            states[i + 1] = json.loads(json.dumps(stream.state_dict(step=i + 1)))
    report = stream.report().to_dict()

    resumed = {}
    for k, state in states.items():  # a fresh process would build the same loader, load, and go on
        loader2, stream2 = build_stream_loader(ds, args.batch, accelerator=acc, **kw)
        prepared2 = acc.prepare(loader2)
        stream2.load_state_dict(state)
        prepared2.set_epoch(stream2.epoch)
        resumed[k] = [record(b) for b in prepared2]

    acc_d = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    loader3, stream3 = build_stream_loader(ds, args.batch, accelerator=acc_d, **kw)
    dispatched = [record(b) for b in acc_d.prepare(loader3)]

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"result_rank{acc.process_index}.json").write_text(json.dumps({
        "steps": steps, "len": len(prepared), "schedule": stream.schedule.tolist(), "full": full,
        "resumed": {str(k): v for k, v in resumed.items()}, "dispatched": dispatched, "report": report,
        "dispatch_rank": stream3.rank,
    }))
    acc.wait_for_everyone()  # a clean gloo teardown: exiting with the group alive can abort() ("terminate called
    acc.end_training()       # without an active exception", seen once in CI)


if __name__ == "__main__":
    main()
