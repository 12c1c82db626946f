"""LoRA vs full fine-tune: step time and peak memory of ``train_text_to_image_arb.py`` on the tiny models.

Both sides run the same command (tiny SD and tiny SDXL of :mod:`hf_arb.testing.tiny`, CPU, one torch thread, batch 4 at
a 64² pixel budget, cached latents so that the step is UNet + optimizer, not image decoding), once with
``--full_finetune`` and once with ``--rank 4``. Each run is its own process, so its peak resident memory is its
own:

* **step time**: the run's training seconds / optimizer steps (the training loop only, after the models loaded);
* **peak RSS growth**: peak resident memory at the end of the run minus the peak after imports, i.e. what loading
  the models and training added;
* **trainable state**: parameters + gradients + AdamW's two moments of the trained parameters, in MB (computed
  from the trainable parameter count the run reports; all float32).

No GPU was lent to this benchmark's task; with tiny models most of the UNet's cost is per-call overhead, so the
step-time gap is far smaller than on SD 1.5 / SDXL at full size, where the frozen base's gradients and optimizer
state (3 x the UNet in float32) are what LoRA saves.

Usage: ``python benchmarks/bench_lora.py [--quick] [--steps N] [--rounds R]``
"""

from __future__ import annotations

import io
import json
import resource
import sys
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from _util import row, run_worker, save_result, training_bench_args  # noqa: E402


def worker(config: dict) -> dict:
    """One training run in this process; returns step time, RSS growth and the trainable parameter count."""
    import torch

    import train_text_to_image_arb as script

    torch.set_num_threads(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        stats = script.main(config["argv"])
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"step_s": stats["train_seconds"] / stats["global_step"], "rss_growth_mb": after - before,
            "trainable": stats["trainable_parameters"], "steps": stats["global_step"]}


def run(argv: list[str]) -> dict:
    return run_worker(__file__, {"argv": argv}, HERE.parent)


def main() -> None:
    args = training_bench_args(__doc__.splitlines()[0], default_rounds=3)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    steps, rounds = args.steps, args.rounds
    from hf_arb.testing.tiny import save_tiny_imagefolder, save_tiny_sd, save_tiny_sdxl

    rows, extra = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        models = {"SD": save_tiny_sd(tmp_path / "sd"), "SDXL": save_tiny_sdxl(tmp_path / "sdxl")}
        data = save_tiny_imagefolder(tmp_path / "images", per_size=4)
        for family, model in models.items():
            common = ["--pretrained_model_name_or_path", model, "--train_data_dir", data, "--resolution", "64",
                      "--bucket_step", "16", "--train_batch_size", "4", "--bucket_leftover", "fill",
                      "--max_train_steps", str(steps), "--checkpointing_steps", "100000", "--report_to", "none",
                      "--seed", "0", "--lr_warmup_steps", "0", "--center_crop", "--cache_latents",
                      "--latent_cache_dir", str(tmp_path / f"cache-{family}")]
            sides = {"full": ["--full_finetune", "--learning_rate", "1e-5"],
                     "lora": ["--rank", "4", "--learning_rate", "1e-4"]}
            run(common + sides["full"] + ["--output_dir", str(tmp_path / "warmup")])  # builds the latent cache
            results: dict[str, list[dict]] = {k: [] for k in sides}
            for r in range(rounds):  # interleaved: the shared machine's load changes between rounds
                for side, flags in sides.items():
                    results[side].append(run(common + flags + ["--output_dir", str(tmp_path / f"{family}-{side}-{r}")]))
            full = min(results["full"], key=lambda x: x["step_s"])
            lora = min(results["lora"], key=lambda x: x["step_s"])
            ratios = ", ".join(f"{f['step_s'] / lo['step_s']:.2f}" for f, lo in zip(results["full"], results["lora"]))
            note = f"tiny {family}, CPU, 1 thread, batch 4, {steps} steps, cached latents; quietest of {rounds} rounds"
            rows.append(row(f"{family}: step time, LoRA rank 4 vs full fine-tune", lora["step_s"] * 1000,
                            full["step_s"] * 1000, "ms/step", note=f"{note}; ratio per round: {ratios}"))
            rows.append(row(f"{family}: peak RSS growth over the run, LoRA vs full", min(x["rss_growth_mb"] for x in
                            results["lora"]), min(x["rss_growth_mb"] for x in results["full"]), "MB",
                            note="peak resident memory at the end minus after imports (least of the rounds)"))
            state = {k: v[0]["trainable"] * 4 * 4 / 2**20 for k, v in results.items()}  # p + grad + 2 moments
            rows.append(row(f"{family}: trainable state (params + grads + AdamW moments), LoRA vs full",
                            state["lora"], state["full"], "MB",
                            note=f"trainable parameters: LoRA {results['lora'][0]['trainable']:,}, "
                                 f"full {results['full'][0]['trainable']:,}"))
            extra[family] = results
    save_result(
        "lora", "LoRA vs full fine-tune (train_text_to_image_arb.py, tiny models, CPU)", rows,
        command="python benchmarks/bench_lora.py", baseline="the same command with --full_finetune",
        details="Each run is a separate process (its own peak RSS). Step time = training-loop seconds / steps. "
                "Tiny models on a shared 2-core CPU: the trainable-state figure is the one that carries over to "
                "full-size models; step time and RSS are dominated by per-call overhead and by the frozen parts.",
        extra=extra)


if __name__ == "__main__":
    main()
