"""How fast the training script answers ``--help`` and bad arguments, vs the imports it avoids.

Every case runs ``train_text_to_image_arb.py`` in a fresh interpreter (the way users meet it) on the tiny offline
assets, and is timed as wall seconds and as the child's CPU seconds (user + sys): on a shared machine the wall
time also counts other jobs, the CPU time is what the command costs. The baseline is what the same process would
pay if it imported torch and diffusers first, as the script did before its arguments were parsed up front:
``python -c "import torch, diffusers"``.

Usage: ``python benchmarks/bench_cli.py [--quick]``
"""

from __future__ import annotations

import argparse
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
from _util import row, save_result  # noqa: E402


def timed(cmd: list[str], repeat: int) -> tuple[float, float, str]:
    """Least wall and least CPU seconds over ``repeat`` runs, and the last stderr line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "1"}
    walls, cpus, last = [], [], ""
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        walls.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        lines = proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines()[:1] or [""]
        last = lines[-1]
    return min(walls), min(cpus), last


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one repeat; figures are not the documented ones")
    args = p.parse_args()
    repeat = 1 if args.quick else 3
    from hf_arb.testing.tiny import save_tiny_imagefolder, save_tiny_sd

    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_sd(Path(tmp) / "sd")
        data = save_tiny_imagefolder(Path(tmp) / "images", per_size=1)
        base = [sys.executable, str(ROOT / "train_text_to_image_arb.py"), "--pretrained_model_name_or_path", model,
                "--train_data_dir", data, "--output_dir", str(Path(tmp) / "out"), "--report_to", "none",
                "--learning_rate", "1e-5"]
        cases = {
            "--help": [sys.executable, str(ROOT / "train_text_to_image_arb.py"), "--help"],
            "flag error (--lr_scheduler cosine_warm)": base + ["--lr_scheduler", "cosine_warm"],
            "environment error (--report_to wandb, not installed)": base + ["--report_to", "wandb"],
            "mixed precision error (--mixed_precision fp16 on CPU)": base + ["--mixed_precision", "fp16"],
            "data error (--caption_column caption)": base + ["--caption_column", "caption"],
            "empty plan (--train_batch_size 4, one image per bucket)": base + ["--train_batch_size", "4"],
        }
        import_wall, import_cpu, _ = timed([sys.executable, "-c", "import torch, diffusers"], repeat)
        rows, lines = [], {}
        for name, cmd in cases.items():
            wall, cpu, last = timed(cmd, repeat)
            lines[name] = last
            rows.append(row(f"{name}: CPU seconds to the answer", cpu, import_cpu, "s CPU",
                            target="< 2 s (--help), < 5 s (errors)", note=f"wall {wall:.2f} s; answer: {last[:90]}"))
    save_result("cli", "Argument validation: time to --help and to each error (fresh process, CPU)", rows,
                command="python benchmarks/bench_cli.py", baseline='python -c "import torch, diffusers"',
                details=f"Least of {repeat} runs each. Wall seconds are in the notes (shared 2-core machine: other "
                        f"jobs inflate them); baseline wall {import_wall:.2f} s.", extra={"answers": lines})


if __name__ == "__main__":
    main()
