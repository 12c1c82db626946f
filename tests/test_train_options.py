"""Upstream training options the script takes from diffusers' scripts: timestep bias, DREAM, EMA placement,
per-row debug loss and the resize filter."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import test_train
import torch
from test_train import COMMON, run_script

import train_text_to_image_arb as script
from hf_arb.families import unet_loss  # noqa: E402

assets = test_train.assets  # the session's tiny models and images
_clean_accelerate_state = test_train._clean_accelerate_state


def bias_args(**kw: object) -> argparse.Namespace:
    base = {"timestep_bias_strategy": "none", "timestep_bias_multiplier": 1.0, "timestep_bias_begin": 0,
            "timestep_bias_end": 1000, "timestep_bias_portion": 0.25}
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("strategy, biased", [("later", slice(750, 1000)), ("earlier", slice(0, 250)),
                                              ("range", slice(100, 300))])
def test_timestep_bias_weights(strategy, biased):
    w = unet_loss.timestep_bias_weights(bias_args(timestep_bias_strategy=strategy, timestep_bias_multiplier=3.0,
                                               timestep_bias_begin=100, timestep_bias_end=300), 1000)
    assert w.shape == (1000,) and abs(float(w.sum()) - 1) < 1e-6
    mask = torch.zeros(1000, dtype=torch.bool)
    mask[biased] = True
    torch.testing.assert_close(w[mask], torch.full((int(mask.sum()),), float(w[~mask][0]) * 3))
    assert torch.all(w[~mask] == w[~mask][0])


def test_timestep_bias_range_beyond_scheduler_is_an_error():
    with pytest.raises(script.UsageError, match="--timestep_bias_end 1200 exceeds"):
        unet_loss.timestep_bias_weights(bias_args(timestep_bias_strategy="range", timestep_bias_end=1200), 1000)


def test_dream_adjust_follows_the_paper():
    from diffusers import DDPMScheduler

    sched = DDPMScheduler(num_train_timesteps=1000)
    t = torch.tensor([10, 900])
    noise, noisy = torch.randn(2, 4, 3, 3), torch.randn(2, 4, 3, 3)
    # a perfect model: no correction
    n2, tgt = unet_loss.dream_adjust(sched, t, noise, noisy, noise, 1.0, lambda x: noise)
    torch.testing.assert_close(n2, noisy)
    torch.testing.assert_close(tgt, noise)
    # a model predicting zero: delta = noise * sigma ** p; noisy += sigma * delta; target = noise + delta
    sigma = (1 - sched.alphas_cumprod[t]).sqrt().view(-1, 1, 1, 1)
    n2, tgt = unet_loss.dream_adjust(sched, t, noise, noisy, noise, 2.0, lambda x: torch.zeros_like(x))
    torch.testing.assert_close(tgt, noise + noise * sigma ** 2)
    torch.testing.assert_close(n2, noisy + sigma * noise * sigma ** 2)
    sched.register_to_config(prediction_type="v_prediction")
    with pytest.raises(script.UsageError, match="epsilon prediction only"):
        unet_loss.dream_adjust(sched, t, noise, noisy, noise, 1.0, lambda x: x)


@pytest.mark.slow
@pytest.mark.xdist_group("train_options")
def test_upstream_options_run_end_to_end(assets, tmp_path):
    """DREAM + timestep bias + EMA (foreach, offloaded) + debug loss + bicubic resizing in one short run."""
    out = tmp_path / "out"
    common = list(COMMON)
    common[common.index("--report_to") + 1] = "tensorboard"  # the per-row debug losses go to the tracker
    argv = ["--pretrained_model_name_or_path", assets["sd"], "--train_data_dir", assets["images"],
            "--output_dir", str(out), *common, "--max_train_steps", "2", "--checkpointing_steps", "100",
            "--dream_training", "--timestep_bias_strategy", "later", "--timestep_bias_multiplier", "5",
            "--use_ema", "--foreach_ema", "--offload_ema", "--debug_loss", "--image_interpolation_mode", "bicubic"]
    stats = run_script(argv)
    assert stats["global_step"] == 2 and all(math.isfinite(v) for v in stats["losses"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = set()
    for events in (out / "logs").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        rows |= {t for t in acc.Tags()["scalars"] if t.startswith("loss_for_row")}
    trained = {r for line in (out / "batches" / "rank0.jsonl").read_text().splitlines()
               for r in json.loads(line)["rows"]}
    assert rows == {f"loss_for_row{r}" for r in trained}
    assert json.loads((out / "unet" / "config.json").read_text())  # the EMA weights were saved as the UNet
