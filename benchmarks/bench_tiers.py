"""Multi-resolution tiers at web scale: TieredBatchSampler (3 tiers) vs the single-tier BucketBatchSampler.

Side by side in one process, on simulated sizes (width and height uniform in [256, 2048], int32), tiers
``Tiers.preset("budget", [512, 768, 1024])`` without upscale, 8 ranks, one pixel budget of 8 × 1024² per rank and
step (8 images at 1024², 32 at 512²), rank 0 measured (every rank does the same work), index files under one
``index_dir`` (the node-shared files, as at web scale):

* ours: ``TieredBatchSampler`` with each schedule (``curriculum``, ``progressive``, ``mix``, ``random``);
* baseline: ``BucketBatchSampler`` on the 1024 tier's bucket ids alone (the single-tier plan the targets were set
  for), same budget.

Figures: plan + first batch of an epoch, resume at random positions (``load_state_dict`` + first batch; for the
curriculum, positions on both sides of every tier switch), construction (first process of the node: builds the
tier columns and indexes; a restarted process: maps them), peak extra memory per rank (tracemalloc over a
construction with the files on disk, 2 epochs' first batches and 3 resumes; the caller's size columns and the
shared files are not counted). ``random`` draws the rows' tiers every epoch per group of rows with the same buckets
(``O(groups)``), so it is measured like the others: new epochs and resumes into epochs never planned before.

Usage: ``python benchmarks/bench_tiers.py [--quick] [--rows N]``
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import row, save_result  # noqa: E402

from hf_arb import BucketBatchSampler  # noqa: E402
from hf_arb.sampling import TieredBatchSampler, Tiers  # noqa: E402

WORLD, BUDGET = 8, 8 * 1024 * 1024
RES = [512, 768, 1024]
KW = dict(num_replicas=WORLD, seed=0, max_pixels_per_batch=BUDGET)  # rank 0 (the default)


def simulated_sizes(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(256, 2049, n, dtype=np.int32), rng.integers(256, 2049, n, dtype=np.int32)


def timed(fn):
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out


def resume(s, epoch: int, consumed: int) -> tuple[float, float]:
    state = {**s.state_dict(), "epoch": epoch, "batches_consumed": consumed}
    wall, cpu, _ = timed(lambda: (s.load_state_dict(state), next(iter(s))))
    return wall, cpu


def measure(make, positions, epochs=(4, 5, 6), resume_epoch=7) -> dict:
    """Cold construction (files on disk), plan + first batch, resumes, peak memory of one sampler."""
    gc.collect()
    tracemalloc.start()
    build_s, build_cpu, s = timed(make)
    build_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.reset_peak()
    for e in (1, 2):
        s.set_epoch(e)
        next(iter(s))
    for c in positions[:3]:
        resume(s, 1, int(c) % s.steps_per_epoch)
    plan_peak, held = tracemalloc.get_traced_memory()[1], tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    plan = [timed(lambda e=e: (s.set_epoch(e), next(iter(s))))[:2] for e in epochs]  # noqa: F821 (del below)
    res = [resume(s, resume_epoch, int(c) % s.steps_per_epoch) for c in positions]
    steps = s.steps_per_epoch
    del s
    gc.collect()
    fresh = []  # a restarted process (construction not counted): the first resume maps what it needs
    for c in positions[:2]:
        s = make()
        fresh.append(resume(s, resume_epoch, int(c) % s.steps_per_epoch))
        del s
        gc.collect()
    return {"fresh_resume_s": [f[0] for f in fresh], "fresh_resume_cpu_s": [f[1] for f in fresh],"build_s": build_s,
            "build_cpu_s": build_cpu, "plan_s": [p[0] for p in plan],
            "plan_cpu_s": [p[1] for p in plan], "resume_s": [r[0] for r in res], "resume_cpu_s": [r[1] for r in res],
            "steps": steps, "peak_mb": max(build_peak, plan_peak) / 1e6,
            "build_peak_mb": build_peak / 1e6,
            "plan_peak_mb": plan_peak / 1e6, "held_mb": held / 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="10⁶ rows instead of 10⁸")
    p.add_argument("--rows", type=int, default=None, help="rows (default 10⁸)")
    args = p.parse_args()
    n = args.rows or (1_000_000 if args.quick else 100_000_000)
    folder = Path(tempfile.mkdtemp(prefix="hf_arb_bench_tiers_"))
    tiers = Tiers.preset("budget", RES)
    med = lambda xs: float(np.median(xs)) * 1e3  # noqa: E731
    try:
        w, h = simulated_sizes(n)
        print(f"{n:,} simulated sizes", flush=True)
        first_s, first_cpu, s0 = timed(lambda: TieredBatchSampler(w, h, tiers, "progressive:1000,2000",
                                                                   index_dir=folder, **KW))
        S = s0.report(0).tiers  # noqa: F841 (touches the plan once)
        steps = [sum(v["batches"] for v in t["buckets"].values()) for t in S]  # steps of one pass of each tier
        del s0
        files_mb = sum(f.stat().st_size for f in folder.glob("*.npy")) / 1e6
        print("first construction", first_s, "steps per pass", steps, flush=True)
        a, b = steps[0] // 2, steps[0] // 2 + steps[1] // 2
        schedules = {"curriculum": f"0-{a}:512,{a}-{b}:768,{b}-:1024", "progressive": f"progressive:{a},{b}",
                     "mix": "mix:512:1,768:1,1024:2", "random": "random"}
        random_first_s, random_first_cpu, _ = timed(lambda: TieredBatchSampler(w, h, tiers, "random",
                                                                                index_dir=folder, **KW))
        with np.load(next(folder.glob("random-groups-*.meta.npz"))) as z:
            n_groups = int(z["buckets"].shape[0])  # rows with the same bucket in every tier
        print("random: first construction (row-group index)", random_first_s, "groups", n_groups, flush=True)
        rng = np.random.default_rng(1)
        out = {}
        for name, sched in schedules.items():
            kw = {} if name == "random" else {"steps_per_epoch": max(steps)}
            positions = rng.integers(0, min(steps), 11)
            if name == "curriculum":  # on both sides of the switches (global step = epoch·L + step)
                L = max(steps)
                positions = np.array([a - 1, a, b - 1, b, a + 5, b + 5, *rng.integers(0, L, 5)])
                out[name] = measure(lambda: TieredBatchSampler(w, h, tiers, sched, index_dir=folder, **KW, **kw),
                                    positions, resume_epoch=0)
            else:
                out[name] = measure(lambda: TieredBatchSampler(w, h, tiers, sched, index_dir=folder, **KW, **kw),
                                    positions)
            print(name, {k: v for k, v in out[name].items() if not k.startswith("resume")}, flush=True)
        ids1024 = np.asarray(np.load(folder / next(f.name for f in folder.glob("tiers-*.npy")), mmap_mode="r")[2])
        base_first = timed(lambda: BucketBatchSampler(ids1024, None,  # noqa: F821 (del below)
                                                      buckets=tiers.bucket_sets[2], index_dir=folder,
                                                      log_report=False, **KW))[0]
        base = measure(lambda: BucketBatchSampler(ids1024, None,  # noqa: F821 (del below)
                                                  buckets=tiers.bucket_sets[2], index_dir=folder,
                                                  log_report=False, **KW), rng.integers(0, steps[2], 11))
        print("baseline", {k: v for k, v in base.items() if not k.startswith("resume")}, flush=True)
        del ids1024
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    big = f"{n:,} rows × 3 tiers"
    rows = []
    for name, r in out.items():
        rows += [
            row(f"{name}: plan + first batch of an epoch ({big})", med(r["plan_s"]), med(base["plan_s"]), "ms",
                target="≤ 50 ms",
                note=f"median of {len(r['plan_s'])} new epochs; CPU {med(r['plan_cpu_s']):,.2f} ms (baseline "
                     f"{med(base['plan_cpu_s']):.2f} ms)" + ("; draws the tier counts of every row group "
                                                             "(O(groups))" if name == "random" else "")),
            row(f"{name}: resume at a random position ({big})", med(r["resume_s"]), med(base["resume_s"]), "ms",
                target="≤ 5 ms", note=f"median of {len(r['resume_s'])}, max {max(r['resume_s']) * 1e3:.1f} ms; CPU "
                                      f"{med(r['resume_cpu_s']):.2f} ms" +
                                      ("; positions on both sides of each tier switch and at random"
                                       if name == "curriculum" else "")),
            row(f"{name}: resume in a restarted process ({big}; construction not counted)", med(r["fresh_resume_s"]),
                med(base["fresh_resume_s"]), "ms", target="≤ 5 ms",
                note=f"median of 2; CPU {med(r['fresh_resume_cpu_s']):.2f} ms; maps the shared files"),
            row(f"{name}: peak extra memory per rank ({big})", r["peak_mb"], base["peak_mb"], "MB", target="≤ 64 MB",
                note=f"construction {r['build_peak_mb']:.1f} MB, planning and resumes {r['plan_peak_mb']:.1f} MB, "
                     f"held after {r['held_mb']:.2f} MB"),
            row(f"{name}: construction, files on the node ({big})", r["build_s"], base["build_s"], "s",
                note=f"CPU {r['build_cpu_s']:.1f} s: fingerprint the sizes, map the tier columns, count rows per "
                     "(tier, bucket)" + ("; map the row-group index" if name == "random" else "")),
        ]
    rows.append(row(f"first construction of the node ({big}: tier columns + 3 tier indexes)", first_s, base_first,
                    "s", note=f"CPU {first_cpu:.1f} s; baseline: the single-tier index of the 1024 tier from its ids "
                              f"(files exist after ours: it maps them). Shared files {files_mb:,.0f} MB "
                              f"({files_mb * 1e6 / n:.1f} bytes/row: int16 tier columns + 4 bytes per eligible row "
                              f"and tier)"))
    rows.append(row(f"random: first construction of the node's row-group index ({big})", random_first_s, None, "s",
                    note=f"CPU {random_first_cpu:.1f} s, once per node and dataset (the tier columns exist): finds "
                         f"the {n_groups} row groups and writes their 4-byte-per-row index"))
    load_avg = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    save_result(
        "tiers", f"Multi-resolution tiers ({big}, simulated sizes, {WORLD} ranks, pixel budget 8 × 1024²)", rows,
        command="python benchmarks/bench_tiers.py",
        baseline="BucketBatchSampler on the 1024 tier's bucket ids alone (one tier, the same pixel budget and index "
                 "files)",
        details=(f"Steps per pass of the tiers 512/768/1024: {steps}. Load average during the run: {load_avg} on "
                 f"{os.cpu_count()} cores (the machine is shared: compare CPU times). State per rank: step schedules "
                 "O(buckets × tiers) (segment tables of a few cached passes), any step from (seed, epoch, step); "
                 f"`random` (OneTrainer's rule) draws per epoch the tier counts of each of its {n_groups} row "
                 "groups (rows with the same bucket in every tier) and assigns a group's rows by a keyed "
                 "permutation: O(groups × tiers) per epoch, no pass over the rows after the node's first "
                 f"construction of the row-group index ({random_first_s:.1f} s)."),
        extra={"rows": n, "quick": args.quick, "ours": out, "baseline": base, "steps_per_pass": steps,
               "first_construction_s": first_s, "files_mb": files_mb, "random_groups": n_groups,
               "random_first_construction_s": random_first_s},
    )


if __name__ == "__main__":
    main()
