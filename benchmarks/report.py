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


def render() -> str:
    parts = [HEADER]
    for path in sorted(RESULTS.glob("*.json")):
        res = json.loads(path.read_text())
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
    return "\n".join(parts)


def main() -> None:
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(render())
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
