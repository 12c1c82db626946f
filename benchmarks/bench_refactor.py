"""No regression from the stage-folder refactor (#25): the same tiny training, this checkout vs an older one.

Each side runs ``train_text_to_image_arb.py`` in its own subprocess (the two checkouts cannot share a process: both
are the package ``hf_arb``) on the same tiny SD pipeline and photo folder, alternating sides ``--rounds`` times so
that machine load hits both alike; the best round of each side is kept. Measured per run:

* **loop images/s**: the run's own ``images_per_second`` (first batch to last: data, VAE, UNet, optimizer);
* **run CPU s**: user + system CPU of the whole process (imports, model loading, training, saving);
* **--help CPU s**: CPU time of ``train_text_to_image_arb.py --help`` (what a user waits for before any error;
  CPU time, not wall time, so that a loaded machine does not decide it).

Usage: ``python benchmarks/bench_refactor.py [--old PATH] [--quick]``. PATH is a checkout of the baseline; by default
a temporary ``git worktree`` of :data:`BASELINE` (the last commit before the refactor) is made and removed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
from _util import row, save_result  # noqa: E402

#: the last commit before the stage-folder refactor
BASELINE = "486401b"


def run(tree: Path, argv: list[str]) -> tuple[float, float]:
    """(wall seconds, child CPU seconds) of one subprocess running ``tree``'s script."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "WORLD_SIZE": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(tree / "train_text_to_image_arb.py"), *argv], env=env, cwd=tree,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{tree}: the run failed:\n{proc.stderr[-3000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", type=Path, default=None, help=f"a checkout of the baseline (default: {BASELINE})")
    p.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    p.add_argument("--rounds", type=int, default=None)
    args = p.parse_args()
    rounds = args.rounds or (2 if args.quick else 3)
    steps = 6 if args.quick else 24
    from hf_arb.testing.tiny import save_tiny_imagefolder, save_tiny_sd

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.old is None:
            args.old = tmp / "baseline"
            made = subprocess.run(["git", "worktree", "add", "--detach", str(args.old), BASELINE], cwd=ROOT,
                                  capture_output=True, text=True)
            if made.returncode:
                print(f"bench_refactor: skipped, no checkout of {BASELINE} ({made.stderr.strip()[:200]})")
                return
        model, images = save_tiny_sd(tmp / "sd"), save_tiny_imagefolder(tmp / "images")
        sides = {"new": ROOT, "old": args.old.resolve()}
        best: dict[str, dict[str, float]] = {s: {"ips": 0.0, "cpu": float("inf"), "help": float("inf")} for s in sides}
        for r in range(rounds):
            for side, tree in sides.items():
                out = tmp / f"out-{side}-{r}"
                argv = ["--pretrained_model_name_or_path", model, "--train_data_dir", images, "--output_dir", str(out),
                        "--resolution", "64", "--bucket_step", "16", "--train_batch_size", "2", "--report_to", "none",
                        "--seed", "0", "--max_train_steps", str(steps), "--full_finetune", "--learning_rate", "1e-4"]
                _, cpu = run(tree, argv)
                stats = json.loads((out / "hf_arb_run.json").read_text())
                _, help_cpu = run(tree, ["--help"])
                b = best[side]
                b["ips"], b["cpu"], b["help"] = max(b["ips"], stats["images_per_second"]), min(b["cpu"], cpu), \
                    min(b["help"], help_cpu)
        if args.old == tmp / "baseline":
            subprocess.run(["git", "worktree", "remove", "--force", str(args.old)], cwd=ROOT, capture_output=True)
    new, old = best["new"], best["old"]
    rows = [
        row("tiny SD training loop: this checkout vs the baseline checkout", new["ips"], old["ips"], "images/s",
            higher_is_better=True, target="no regression (ratio >= 0.95)",
            note=f"best of {rounds} alternating rounds, {steps} steps"),
        row("whole run (imports, load, train, save)", new["cpu"], old["cpu"], "CPU s"),
        row("train_text_to_image_arb.py --help", new["help"], old["help"], "CPU s"),
    ]
    save_result("refactor", "Stage-folder refactor (#25): no regression", rows,
                command="python benchmarks/bench_refactor.py", baseline=f"commit {BASELINE} (before the refactor)",
                details="Each side in its own subprocess, alternating; best round kept.",
                extra={"old": str(args.old), "rounds": rounds, "steps": steps})


if __name__ == "__main__":
    main()
