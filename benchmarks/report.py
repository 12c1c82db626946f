"""Render every ``benchmarks/results/*.json`` into ``docs/benchmarks.md``.

Usage: ``python benchmarks/report.py`` (``benchmarks/run_all.py`` calls it after the runs).
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"

HEADER = """# Benchmarks

Every figure on this page is written by a script in `benchmarks/`; nothing is typed by hand.
Each script runs our implementation and its baseline side by side in one process run.
Reproduce everything with:

<!-- not runnable: runs every benchmark (tens of minutes) and rewrites this page -->

```bash
make bench            # = .venv/bin/python benchmarks/run_all.py
```

or one benchmark with the command shown in its section. "ratio" is how many times better
ours is than the baseline (faster, or less memory).
"""


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 100:
            return f"{v:,.0f}"
        if abs(v) >= 1:
            return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
        return f"{v:.3g}"
    return str(v)


def plot_ratios(results: list[dict], path: Path) -> bool:
    """Bar chart of every figure that has a baseline: how many times better ours is (log scale)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    bars = [(f"{res['name']}: {r['figure']}", r["ratio"]) for res in results for r in res["rows"] if r.get("ratio")]
    if not bars:
        return False
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(bars) + 1.2))
    labels, ratios = zip(*bars)
    ax.barh(range(len(bars)), ratios, color=["#4c72b0" if x >= 1 else "#dd8452" for x in ratios])
    ax.set_yticks(range(len(bars)), [label[:70] for label in labels], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(1, color="black", lw=0.8)
    ax.set_xlabel("ours vs baseline (× better, log scale)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def render() -> str:
    results = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))]
    parts = [HEADER]
    if plot_ratios(results, DOC.parent / "img" / "benchmarks.png"):
        parts.append("![ratios](img/benchmarks.png)\n")
    for res in results:
        parts.append(f"\n## {res['title']}\n")
        parts.append(f"Baseline: {res['baseline']}\n")
        if res.get("details"):
            parts.append(res["details"].strip() + "\n")
        parts.append("| figure | ours | baseline | unit | ratio | target | machine |")
        parts.append("|---|---|---|---|---|---|---|")
        for r in res["rows"]:
            ratio = f"{r['ratio']:.1f}×" if r.get("ratio") else "-"
            parts.append(
                f"| {r['figure']} | {_fmt(r['ours'])} | {_fmt(r['baseline'])} | {r['unit']} | {ratio} "
                f"| {r.get('target') or '-'} | {res['machine']} |"
            )
        notes = [f"- {r['figure']}: {r['note']}" for r in res["rows"] if r.get("note")]
        if notes:
            parts.append("")
            parts.extend(notes)
        plot = res.get("extra", {}).get("plot")
        if plot:
            parts.append(f"\n![{res['title']}]({plot})")
        parts.append(f"\nReproduce: `{res['command']}` (measured {res['date']}, commit {res['commit']}).\n")
    for path in sorted((RESULTS / "gpu").glob("*.json")):  # bench_gpu.py's results, one file per card
        from bench_gpu import markdown

        gpu = json.loads(path.read_text())
        parts.append(f"\n## Full-size models on a GPU: {gpu['environment'].get('gpu', path.stem)}\n")
        parts.append(markdown(gpu))
        parts.append(f"\nReproduce: `make bench-gpu` (`python benchmarks/bench_gpu.py`; measured {gpu.get('date')}, "
                     f"file benchmarks/results/gpu/{path.name}).\n")
    for path in sorted((RESULTS / "gpu_video").glob("*.json")):  # bench_gpu_video.py's results, one file per card
        from bench_gpu_video import markdown as video_markdown

        gpu = json.loads(path.read_text())
        parts.append(f"\n## Wan 2.1 1.3B on a GPU: (W, H, F) buckets against fixed-size clips, "
                     f"{gpu['environment'].get('gpu', path.stem)}\n")
        parts.append(video_markdown(gpu))
        parts.append(f"\nReproduce: `{gpu['command']}` (measured {gpu.get('date')}, "
                     f"file benchmarks/results/gpu_video/{path.name}).\n")
    return "\n".join(parts)


def main() -> None:
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(render())
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
