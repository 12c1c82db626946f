"""Epoch planning: BucketBatchSampler vs a re-implementation of NovelAI's reference bucket sampler.

Both run on 5,310,961 rows with NovelAI's published bucket proportions (their README's "entries" per
bucket, plus their 344 skipped rows), 8 ranks, batch 8, in one process run:

* ours: plan an epoch and yield all of rank 0's batches (lists of row indices);
* baseline: NovelAI's algorithm as described in their blog / README, written here from the description:
  per epoch and rank, shuffle all ids, trim to a multiple of world × batch, take this rank's shard, fill
  per-bucket Python lists, move each bucket's remainder to a catch-all bucket, then for every batch draw a
  bucket with probability proportional to its remaining size and slice the batch off the front of its list.

Also measured: resuming at a random position (ours: ``load_state_dict`` + first batch; the baseline has no
state, so it must replay the epoch up to that position), peak extra memory (tracemalloc), and a simulation
of rank balance with step cost ∝ pixels of the step's bucket: efficiency = Σ mean-rank cost / Σ max-rank
cost (the slowest rank sets every step's time) for ``sync_buckets=True`` vs independent per-rank draws.

Usage: ``python benchmarks/bench_sampler.py [--quick]``
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import row, save_result  # noqa: E402

from hf_arb import BucketBatchSampler, BucketSet, plan_epoch  # noqa: E402

WORLD, BATCH = 8, 8
#: NovelAI README sample output: entries per bucket, keyed by (width, height), plus 344 skipped images.
NOVELAI_ENTRIES = {
    (512, 704): 2189784, (512, 768): 661814, (704, 512): 586743, (512, 512): 429811, (576, 640): 417592,
    (448, 832): 247869, (640, 576): 231463, (768, 512): 209557, (832, 448): 173294, (384, 896): 42191,
    (320, 1024): 38428, (384, 1024): 24377, (256, 1024): 16618, (896, 384): 15046, (384, 960): 12010,
    (1024, 384): 4512, (1024, 320): 3704, (960, 384): 3478, (1024, 256): 2326,
}
NOVELAI_SKIPPED = 344


def novelai_ids(scale: float = 1.0, seed: int = 0) -> np.ndarray:
    """Bucket ids with NovelAI's published proportions in a random row order, shape (n,), -1 = skipped."""
    res = BucketSet.novelai().resolutions.tolist()  # ids of our table
    counts = np.zeros(len(res), dtype=np.int64)
    for wh, c in NOVELAI_ENTRIES.items():
        counts[res.index(list(wh))] = round(c * scale)
    ids = np.concatenate([np.repeat(np.arange(len(res)), counts), np.full(round(NOVELAI_SKIPPED * scale), -1)])
    return np.random.default_rng(seed).permutation(ids).astype(np.int64)


# ------------------------------------------------------------------------------------------- baseline


class NovelAIStyleSampler:
    """NovelAI's per-rank bucket sampler, re-implemented from its published description (not its code).

    Uses a private ``numpy.random.Generator``; the algorithm (Python lists, per-item loop, per-batch weighted
    draw, slicing the batch off the front of a list) is what the description and the issue state.
    """

    def __init__(self, bucket_of: list[int], batch_size: int, world: int, rank: int, base_bucket: int, seed: int):
        self.bucket_of = bucket_of  # Python list: bucket per item id (-1 = pruned)
        self.item_ids = [i for i, b in enumerate(bucket_of) if b >= 0]
        self.bs, self.world, self.rank, self.base = batch_size, world, rank, base_bucket
        self.prng = np.random.Generator(np.random.PCG64(seed))

    def start_epoch(self) -> None:
        ids = self.prng.permutation(np.asarray(self.item_ids)).tolist()
        keep = len(ids) // (self.world * self.bs) * (self.world * self.bs)
        ids = ids[:keep]
        per_rank = keep // self.world
        shard = ids[self.rank * per_rank : (self.rank + 1) * per_rank]
        buckets: dict[int, list[int]] = {}
        for item in shard:  # per-item Python loop
            buckets.setdefault(self.bucket_of[item], []).append(item)
        self.left_over: list[int] = []
        for b in list(buckets):
            lst = buckets[b]
            r = len(lst) % self.bs
            if r:
                self.left_over.extend(lst[len(lst) - r :])
                del lst[len(lst) - r :]
            if not lst:
                del buckets[b]
        self.buckets = buckets

    def get_batch(self) -> tuple[list[int], int] | None:
        keys = list(self.buckets)
        sizes = [len(self.buckets[b]) for b in keys]
        if len(self.left_over) >= self.bs:
            keys.append(-1)
            sizes.append(len(self.left_over))
        if not keys:
            return None
        p = np.asarray(sizes, dtype=np.float64)
        chosen = keys[int(self.prng.choice(len(keys), p=p / p.sum()))]
        if chosen == -1:
            batch, self.left_over = self.left_over[: self.bs], self.left_over[self.bs :]
            return batch, self.base
        lst = self.buckets[chosen]
        batch, rest = lst[: self.bs], lst[self.bs :]  # slicing the front off: O(remaining) per batch
        if rest:
            self.buckets[chosen] = rest
        else:
            del self.buckets[chosen]
        return batch, chosen

    def drain(self) -> int:
        n = 0
        while self.get_batch() is not None:
            n += 1
        return n


# ------------------------------------------------------------------------------------------- ours


def ours_epoch(sampler: BucketBatchSampler, epoch: int) -> int:
    """Plan ``epoch`` and drain rank 0's batches (the sampler itself yields every rank's, step-major)."""
    sampler.set_epoch(epoch)
    n = 0
    for _ in sampler.shard(0):
        n += 1
    return n


def rank_balance(targets: np.ndarray, pixels: np.ndarray) -> float:
    """Σ_s mean_r cost / Σ_s max_r cost for targets (steps, world), cost = pixels of the bucket."""
    cost = pixels[targets]  # (steps, world)
    return float(cost.mean(axis=1).sum() / cost.max(axis=1).sum())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="~200k rows instead of 5.31 M (for run_all --quick)")
    args = p.parse_args()
    scale = 200_000 / 5_310_961 if args.quick else 1.0
    ids = novelai_ids(scale)
    n = ids.size
    bs = BucketSet.novelai()
    res = bs.resolutions  # (19, 2)
    base = int(np.flatnonzero((res[:, 0] == 512) & (res[:, 1] == 512))[0])

    # ours: construction (once per run) and planning + draining one epoch on rank 0
    tracemalloc.start()
    t0 = time.perf_counter()
    sampler = BucketBatchSampler(ids, BATCH, num_replicas=WORLD, seed=0, leftover="catch_all",
                                 catch_all_bucket=base, log_report=False)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    yielded = ours_epoch(sampler, 1)  # the global plan: every rank's batch of every step
    steps = sampler.steps_per_epoch
    assert yielded == steps * WORLD
    first_epoch_s = time.perf_counter() - t0
    peak_mb = tracemalloc.get_traced_memory()[1] / 1e6
    tracemalloc.stop()
    epoch_times, cpu_times = [], []
    for e in range(2, 5):
        t0, c0 = time.perf_counter(), time.process_time()
        ours_epoch(sampler, e)
        epoch_times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    ours_s = min([first_epoch_s] + epoch_times)

    # ours: resume at random positions = load_state_dict (O(1)) + first batch (plans lazily)
    rng = np.random.default_rng(1)
    resume_s, load_s = [], []
    for e in range(5, 16):
        sampler.set_epoch(e)
        state = sampler.state_dict()
        state["batches_consumed"] = int(rng.integers(0, steps))
        fresh_t0 = time.perf_counter()
        sampler.load_state_dict(state)
        load_s.append(time.perf_counter() - fresh_t0)
        next(iter(sampler.shard(0)))
        resume_s.append(time.perf_counter() - fresh_t0)
    resume_ms = float(np.median(resume_s) * 1e3)

    # baseline: NovelAI-style per-rank sampler, rank 0
    bucket_of = ids.tolist()
    base_sampler = NovelAIStyleSampler(bucket_of, BATCH, WORLD, 0, base, seed=0)
    t0, c0 = time.perf_counter(), time.process_time()
    base_sampler.start_epoch()
    base_start_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    base_steps = base_sampler.drain()
    base_drain_s = time.perf_counter() - t0
    base_cpu_s = time.process_time() - c0
    base_total = base_start_s + base_drain_s
    # baseline resume: no state; replay start + half an epoch on average
    base_resume_ms = (base_start_s + base_drain_s / 2) * 1e3

    # rank balance: 8 ranks, step cost ∝ pixels of the step's target bucket
    pixels = (res[:, 0] * res[:, 1]).astype(np.float64)
    _, t_sync = plan_epoch(ids, BATCH, WORLD, seed=0, leftover="catch_all", catch_all_bucket=base, return_buckets=True)
    _, t_ind = plan_epoch(ids, BATCH, WORLD, seed=0, sync_buckets=False, leftover="catch_all", catch_all_bucket=base,
                          return_buckets=True)
    eff_sync, eff_ind = rank_balance(t_sync, pixels), rank_balance(t_ind, pixels)
    diff_share = float((t_ind != t_ind[:, :1]).any(axis=1).mean())

    rep = sampler.report()
    rows = [
        row("plan an epoch + yield all of rank 0's batches", ours_s, base_total, "s",
            target="≤ 0.4 s, ≥ 20× faster",
            note=f"{n:,} rows, {WORLD} ranks × batch {BATCH}, {steps:,} batches per rank (baseline: {base_steps:,}); "
                 f"ours yields all {WORLD} ranks' batches ({yielded:,}), as a prepared loader reads them; "
                 f"ours best of 4 epochs (the first, {first_epoch_s:.2f} s, runs under tracemalloc); "
                 f"baseline epoch start {base_start_s:.2f} s + "
                 f"drain {base_drain_s:.2f} s. CPU time (the machine is shared): ours {min(cpu_times):.3f} s, "
                 f"baseline {base_cpu_s:.2f} s"),
        row("sampler construction (once per run: validate, group rows, fingerprint)", build_s, None, "s"),
        row("resume at a random position (load_state_dict + first batch)", resume_ms, base_resume_ms, "ms",
            target="≤ 50 ms",
            note=f"median of 11 (max {max(resume_s) * 1e3:.0f} ms); load_state_dict alone "
                 f"{np.median(load_s) * 1e6:.0f} µs; the first batch plans the epoch "
                 "lazily (batch order + the buckets it touches). Baseline has no resumable state: replaying epoch "
                 "start + half an epoch of draws"),
        row("peak extra memory (construction + one epoch on rank 0)", peak_mb, None, "MB", target="≤ 100 MB",
            note="tracemalloc peak; the input id array itself is not counted"),
        row("rank-balance efficiency, step cost ∝ pixels (Σ mean / Σ max over 8 ranks)", eff_sync, eff_ind, "",
            higher_is_better=True, target="1.0 with sync_buckets",
            note=f"baseline: independent per-rank draws (sync_buckets=False, NovelAI's behaviour): ranks are in "
                 f"different buckets at {100 * diff_share:.1f}% of steps"),
    ]
    save_result(
        "sampler", f"Epoch planning ({n:,} rows, NovelAI bucket proportions, {WORLD} ranks × batch {BATCH})", rows,
        command="python benchmarks/bench_sampler.py",
        baseline="NovelAI's reference bucket sampler, re-implemented from its published description (per-rank "
                 "shard, per-item loop, weighted draw per batch, list slicing)",
        details=f"NovelAI published 1.86 s epoch start + 6.49 s drain per rank for their own code on this class of "
                f"machine (8.35 s, i.e. {8.35 / ours_s:.0f}× our time); the re-implementation here follows the "
                "published description (per-batch list slicing), which is slower than their measured code, so the "
                "ratio column overstates the gain over their code. "
                f"Leftovers: catch_all at 512×512 for both. Ours per epoch: {rep.rows_used:,} rows used, "
                f"{rep.rows_dropped:,} dropped, {rep.rows_catch_all:,} in catch-all batches.",
        extra={"rows": n, "quick": args.quick, "ours_epoch_s": [first_epoch_s] + epoch_times,
               "baseline_start_s": base_start_s, "baseline_drain_s": base_drain_s,
               "resume_ms": [x * 1e3 for x in resume_s],
               "efficiency_sync": eff_sync, "efficiency_independent": eff_ind, "report": rep.to_dict()},
    )


if __name__ == "__main__":
    main()
