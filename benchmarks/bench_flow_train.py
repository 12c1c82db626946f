"""SD3 and Flux training speed: steps/s of ``train_text_to_image_arb.py`` on the tiny flow models, with and
without cached latents.

Both sides run the same command (tiny SD3 / tiny Flux of :mod:`hf_arb.testing.tiny`, CPU, one torch thread, batch 4 at a
64² pixel budget with 16-pixel bucket steps, full fine-tune, per-bucket shift at each family's default), once
encoding every batch with the VAE on the fly (the baseline) and once from ``--cache_latents`` (the cache is built
by a warm-up run first, so the measured run only reads it). Each run is its own process; steps/s is optimizer steps
/ training-loop seconds (after the models loaded). Rounds are interleaved and the quietest kept, since the machine
is shared.

Tiny models on a CPU: the transformer is small, so the VAE encoder's share of a step (what the cache removes) is
larger than at full size on a GPU; the figure shows the loop's overhead and the cache's effect, not production
throughput.

Usage: ``python benchmarks/bench_flow_train.py [--quick] [--steps N] [--rounds R]``
"""

from __future__ import annotations

import io
import json
import sys
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from _util import row, run_worker, save_result, training_bench_args  # noqa: E402 (after the sys.path lines)


def worker(config: dict) -> dict:
    """One training run in this process; returns steps/s of its training loop."""
    import torch

    import train_text_to_image_arb as script

    torch.set_num_threads(1)
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        stats = script.main(config["argv"])
    return {"steps_per_s": stats["global_step"] / stats["train_seconds"], "steps": stats["global_step"],
            "vae_encode_calls": stats["vae_encode_calls"], "images_per_s": stats["images_per_second"]}


def run(argv: list[str]) -> dict:
    return run_worker(__file__, {"argv": argv}, HERE.parent)


def main() -> None:
    args = training_bench_args(__doc__.splitlines()[0], default_rounds=2)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    steps, rounds = args.steps, args.rounds
    from hf_arb.testing.tiny import save_tiny_flux, save_tiny_imagefolder, save_tiny_sd3

    rows, extra = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        models = {"SD3": save_tiny_sd3(tmp_path / "sd3"), "Flux": save_tiny_flux(tmp_path / "flux")}
        data = save_tiny_imagefolder(tmp_path / "images", per_size=4)
        for family, model in models.items():
            common = ["--pretrained_model_name_or_path", model, "--train_data_dir", data, "--resolution", "64",
                      "--bucket_step", "16", "--train_batch_size", "4", "--bucket_leftover", "fill",
                      "--max_train_steps", str(steps), "--checkpointing_steps", "100000", "--report_to", "none",
                      "--seed", "0", "--lr_warmup_steps", "0", "--center_crop", "--full_finetune",
                      "--learning_rate", "1e-5", "--max_sequence_length", "32"]
            cache = ["--cache_latents", "--latent_cache_dir", str(tmp_path / f"cache-{family}")]
            sides = {"on_the_fly": [], "cached": cache}
            run(common + cache + ["--output_dir", str(tmp_path / "warmup")])  # builds the latent cache
            results: dict[str, list[dict]] = {k: [] for k in sides}
            for r in range(rounds):
                for side, flags in sides.items():
                    results[side].append(run(common + flags + ["--output_dir", str(tmp_path / f"{family}-{side}-{r}")]))
            fly = max(results["on_the_fly"], key=lambda x: x["steps_per_s"])
            cached = max(results["cached"], key=lambda x: x["steps_per_s"])
            assert cached["vae_encode_calls"] == 0 and fly["vae_encode_calls"] == steps
            note = f"tiny {family}, CPU, 1 thread, batch 4, {steps} steps, full fine-tune; quietest of {rounds} rounds"
            rows.append(row(f"{family}: training steps/s, cached latents vs VAE on the fly", cached["steps_per_s"],
                            fly["steps_per_s"], "steps/s", higher_is_better=True, note=note))
            extra[family] = results
    save_result(
        "flow_train", "SD3 / Flux training steps/s (train_text_to_image_arb.py, tiny models, CPU)", rows,
        command="python benchmarks/bench_flow_train.py", baseline="the same command without --cache_latents",
        details="Each run is a separate process; steps/s = optimizer steps / training-loop seconds. The cached "
                "side reads a latent cache built by a warm-up run (the VAE encoder never runs).", extra=extra)


if __name__ == "__main__":
    main()
