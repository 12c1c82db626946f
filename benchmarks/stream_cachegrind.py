"""The stream's own cost in simulated CPU events, which the machine's load does not change: instructions, L1 and
last-level cache misses of one pass of each side of ``bench_stream.py`` (floor, hold, ours, before, floor_arrow),
counted by valgrind's callgrind with its cache simulator.

On the shared 2-core machine the CPU time of a memory-bound loop depends on what the other processes do to the
caches, and ``bench_stream.py``'s ratios move by ±20 % between runs. Here each side runs once to warm up, then once
counted (callgrind's instrumentation is switched on for that pass only, from outside with ``callgrind_control``),
in its own process under valgrind. Modelled cycles = instructions + 10 × L1 misses + 50 × last-level misses (the
simulated last level is 512 KiB, the machine's L2 per core: a miss there goes to the L3 shared with the other
processes, or to memory). The model knows no hardware prefetcher and no other process, so it shows how much work
each side does, not what it costs on a loaded machine.

Needs ``valgrind`` (with ``callgrind_control``). Runs take about 2 minutes per side (the imports under valgrind).

Usage: ``python benchmarks/stream_cachegrind.py [--rows 20000] [--sides floor,hold,ours,before,floor_arrow]``
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
SIDES = ("floor", "hold", "ours", "before", "floor_arrow")


def child(rows: int, side: str, data: Path, sig: Path) -> None:
    """Run ``side`` once to warm up, then once between the ``ready``/``go`` and ``done``/``exit`` signal files."""
    import _stream_v2
    from bench_stream import floor, floor_arrow, hold, ours
    from datasets import load_dataset

    ids = np.load(data / "ids.npy")
    counts = np.bincount(ids[ids >= 0], minlength=int(ids.max()) + 1)
    ds = load_dataset("parquet", data_files=sorted(str(p) for p in data.glob("*.parquet")), split="train",
                      streaming=True)
    fn = {"floor": lambda: floor(ds), "hold": lambda: hold(ds), "ours": lambda: ours(ds, counts),
          "before": lambda: ours(ds, counts, _stream_v2.BucketedStreamV2), "floor_arrow": lambda: floor_arrow(ds)}[side]
    fn()
    (sig / "ready").touch()
    while not (sig / "go").exists():
        time.sleep(0.05)
    fn()
    (sig / "done").touch()
    while not (sig / "exit").exists():
        time.sleep(0.05)


def _wait(path: Path, proc: subprocess.Popen) -> None:
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the valgrind child exited ({proc.returncode}) before {path.name}")
        time.sleep(0.2)


def measure(rows: int, side: str, data: Path) -> dict[str, int]:
    """Callgrind's event totals of one counted pass of ``side``."""
    with tempfile.TemporaryDirectory() as tmp:
        sig, out = Path(tmp), Path(tmp) / "callgrind.out"
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--cache-sim=yes", "--D1=32768,8,64",
               "--I1=32768,8,64", "--LL=524288,8,64", f"--callgrind-out-file={out}", sys.executable, __file__,
               "--child", side, "--rows", str(rows), "--data", str(data), "--sig", str(sig)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait(sig / "ready", proc)
        subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True, capture_output=True)
        (sig / "go").touch()
        _wait(sig / "done", proc)
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
        (sig / "exit").touch()
        proc.wait()
        text = Path(f"{out}.1").read_text()
    events = next(line.split()[1:] for line in text.splitlines() if line.startswith("events:"))
    totals = next(line.split()[1:] for line in text.splitlines() if line.startswith("summary:"))
    return dict(zip(events, map(int, totals)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--child", choices=SIDES)
    ap.add_argument("--data", type=Path)
    ap.add_argument("--sig", type=Path)
    args = ap.parse_args()
    if args.child:
        child(args.rows, args.child, args.data, args.sig)
        return
    from bench_stream import write_source

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        np.save(data / "ids.npy", write_source(data, args.rows))
        got = {side: measure(args.rows, side, data) for side in args.sides.split(",")}
    print(f"{args.rows:,} rows, per row: instructions, L1 misses, last-level misses, modelled cycles (ratio to the "
          "first side)")
    base = None
    for side, e in got.items():
        l1 = e["I1mr"] + e["D1mr"] + e["D1mw"]
        ll = e["ILmr"] + e["DLmr"] + e["DLmw"]
        cycles = e["Ir"] + 10 * l1 + 50 * ll
        base = base or (e["Ir"], ll, cycles)
        print(f"{side:>11}: {e['Ir'] / args.rows:8.0f} instr ({e['Ir'] / base[0]:.2f}×), {l1 / args.rows:6.0f} L1, "
              f"{ll / args.rows:6.0f} LL ({ll / base[1]:.2f}×), {cycles / args.rows:8.0f} cycles "
              f"({cycles / base[2]:.2f}×)")


if __name__ == "__main__":
    main()
