"""Run every benchmark (each side by side with its baseline) and regenerate docs/benchmarks.md.

Usage: ``python benchmarks/run_all.py [--quick] [--only assign,sampler]``

Each ``bench_*.py`` runs in its own process (so one benchmark's memory does not colour the
next one's), writes ``benchmarks/results/<name>.json``, and ``report.py`` renders them all.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true",
                   help="small sizes (seconds each); figures then are not the documented ones")
    p.add_argument("--only", default="", help="comma-separated benchmark names (bench_<name>.py)")
    args = p.parse_args()
    scripts = [s for s in sorted(HERE.glob("bench_*.py")) if not s.name.startswith("bench_gpu")]  # make bench-gpu
    if args.only:
        wanted = {n.strip() for n in args.only.split(",")}
        scripts = [s for s in scripts if s.stem.removeprefix("bench_") in wanted]
    failed = []
    for script in scripts:
        cmd = [sys.executable, str(script)] + (["--quick"] if args.quick else [])
        print(f"== {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        if subprocess.run(cmd, cwd=HERE.parent).returncode != 0:
            failed.append(script.name)
        print(f"   {time.perf_counter() - t0:.1f} s", flush=True)
    subprocess.run([sys.executable, str(HERE / "report.py")], check=True)
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
