"""Shared helpers for the benchmark scripts.

Every ``bench_*.py`` script measures our implementation and its baseline side by side in one
process run, then calls :func:`save_result`, which writes ``benchmarks/results/<name>.json``.
``benchmarks/report.py`` renders all result files into ``docs/benchmarks.md``; the numbers in
the docs therefore always come from a script, never typed by hand.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine() -> str:
    """A one-line description of the machine the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = ""
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f", GPU {torch.cuda.get_device_name(0)}"
    except Exception:  # noqa: BLE001 - torch is optional for some benchmarks
        pass
    return f"{cpu}, {os.cpu_count()} cores, {mem_gib:.0f} GiB{gpu}, Python {platform.python_version()}"


def timeit(fn: Callable[[], Any], repeat: int = 3) -> tuple[float, Any]:
    """Best wall time in seconds over ``repeat`` calls of ``fn`` and the last result."""
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def row(figure: str, ours: float, baseline: float | None, unit: str, *, higher_is_better: bool = False,
        target: str = "", note: str = "") -> dict[str, Any]:
    """One table row. ``ratio`` is how many times better ours is than the baseline."""
    ratio = None
    if baseline is not None and ours and baseline:
        ratio = (ours / baseline) if higher_is_better else (baseline / ours)
    return {"figure": figure, "ours": ours, "baseline": baseline, "unit": unit, "ratio": ratio,
            "target": target, "note": note}


def save_result(name: str, title: str, rows: list[dict[str, Any]], *, command: str, baseline: str,
                details: str = "", extra: dict[str, Any] | None = None) -> Path:
    """Write ``benchmarks/results/<name>.json`` (``results/quick/`` under ``--quick``) atomically; print the rows."""
    # --quick runs (small sizes, used by `run_all.py --quick` and smoke tests) never replace the documented figures.
    out_dir = RESULTS_DIR / "quick" if "--quick" in sys.argv else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "name": name, "title": title, "rows": rows, "command": command, "baseline": baseline,
        "details": details, "machine": machine(), "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d"), "extra": extra or {},
    }
    path = out_dir / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    tmp.replace(path)
    for r in rows:
        ratio = f"{r['ratio']:.1f}x" if r["ratio"] else "-"
        print(f"{r['figure']}: ours {r['ours']:.4g} {r['unit']}, baseline {r['baseline']} -> {ratio} {r['target']}")
    print(f"wrote {path}")
    return path


def run_worker(script: str | os.PathLike[str], config: dict[str, Any], cwd: str | os.PathLike[str]) -> dict:
    """Run ``script --worker <config as JSON>`` in a fresh interpreter (each measurement in its own process) and
    return the JSON object it prints last; the worker's stderr tail is the error if it fails."""
    proc = subprocess.run([sys.executable, str(script), "--worker", json.dumps(config)], capture_output=True,
                          text=True, cwd=cwd)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def training_bench_args(description: str, default_rounds: int) -> Any:
    """The options of the per-process training benchmarks (``--quick``, ``--steps``, ``--rounds``, and the hidden
    ``--worker`` that :func:`run_worker` passes). Returns the parsed arguments with ``steps`` and ``rounds``
    resolved (defaults 20 and ``default_rounds``; ``--quick``: 3 and 1)."""
    import argparse

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="few steps, one round; figures are not the documented ones")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 20; quick 3)")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"interleaved rounds, the quietest is kept (default {default_rounds})")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.steps = args.steps or (3 if args.quick else 20)
    args.rounds = args.rounds or (1 if args.quick else default_rounds)
    return args
