"""Per-bucket resolution shift equals what diffusers' flow-matching scheduler and pipelines compute."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_arb import BucketSet
from hf_arb.families.shift import (
    ShiftConfig,
    bucket_shift_table,
    calculate_mu,
    check_latent_sizes,
    image_seq_len,
    shift_sigmas,
    shift_table_text,
)

SIZES = [(512, 512), (1024, 1024), (1360, 768), (768, 1360), (2048, 512), (256, 1024), (1568, 672), (64, 32)]
FLUX = {"shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
        "base_image_seq_len": 256, "max_image_seq_len": 4096}  # black-forest-labs/FLUX.1-dev scheduler_config.json
CONFIGS = [FLUX, {**FLUX, "max_shift": 1.16, "max_image_seq_len": 8192}, {**FLUX, "time_shift_type": "linear"},
           {"shift": 3.0}]  # the last: SD3's static shift


def _scheduler(cfg):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**cfg)


def test_image_seq_len_and_mu_equal_the_pipelines_calculate_shift():
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift as flux_shift
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift as sd3_shift

    w, h = np.array(SIZES).T
    seq = image_seq_len(w, h, vae_scale_factor=8, patch_size=2)
    assert seq.tolist() == [(hh // 8 // 2) * (ww // 8 // 2) for ww, hh in SIZES]  # SD3's expression
    for cfg in CONFIGS[:2]:
        sc = ShiftConfig.from_scheduler_config(_scheduler(cfg).config)
        mu = calculate_mu(seq, sc)
        for fn in (flux_shift, sd3_shift):
            ref = [fn(int(n), sc.base_image_seq_len, sc.max_image_seq_len, sc.base_shift, sc.max_shift) for n in seq]
            assert mu.tolist() == ref  # bit-identical float64


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("steps", [1, 4, 28])
def test_shifted_sigmas_equal_set_timesteps_for_each_bucket(cfg, steps):
    sched = _scheduler(cfg)
    sc = ShiftConfig.from_scheduler_config(sched.config)
    assert sc.use_dynamic_shifting == cfg.get("use_dynamic_shifting", False)
    table = bucket_shift_table(BucketSet(SIZES[:-1]), sc)
    base = np.linspace(1.0, 1 / steps, steps)  # Flux pipeline's default sigmas
    for mu in table["mu"]:
        sched.set_timesteps(sigmas=base, mu=float(mu))
        ours = shift_sigmas(base.astype(np.float32), mu, sc)
        np.testing.assert_allclose(np.asarray(ours, np.float32), sched.sigmas[:-1].numpy(), rtol=2e-7, atol=0)
        if not sc.use_dynamic_shifting:
            continue
        sched.set_timesteps(steps, mu=float(mu))  # SD3 pipeline: no sigmas, the scheduler's own (unshifted) grid
        grid = np.linspace(sched.config.num_train_timesteps, 1, steps) / sched.config.num_train_timesteps
        np.testing.assert_allclose(np.asarray(shift_sigmas(grid, mu, sc), np.float32), sched.sigmas[:-1].numpy(),
                                   rtol=2e-7, atol=0)


def test_buckets_get_different_shifts_and_bigger_means_noisier():
    sc = ShiftConfig(**FLUX)
    bs = BucketSet.preset("flux_kontext")
    table = bucket_shift_table(bs, sc)
    assert len(np.unique(table["mu"])) > 1
    t = np.full(len(bs), 0.5)
    s = shift_sigmas(t, table["mu"], sc)
    order = np.argsort(table["image_seq_len"])
    assert (np.diff(s[order]) >= 0).all() and (s > 0.5).all()  # more tokens → larger mu → more noise at t
    text = shift_table_text(bs, sc)
    assert "seq_len" in text and len(text.splitlines()) == len(bs) + 1


def test_torch_per_sample_mu_keeps_dtype_and_matches_numpy():
    sc = ShiftConfig(**FLUX)
    t = torch.rand(6, dtype=torch.float32).clamp_min(1e-3)
    mu = np.array([0.5, 0.7, 1.15, 0.5, 0.9, 1.0])
    out = shift_sigmas(t, torch.tensor(mu), sc)
    assert out.dtype == torch.float32 and out.shape == (6,)
    np.testing.assert_allclose(out.numpy(), shift_sigmas(t.double().numpy(), mu, sc), rtol=1e-6)
    static = shift_sigmas(t, None, ShiftConfig(shift=3.0))
    np.testing.assert_allclose(static.numpy(), (3 * t / (1 + 2 * t)).numpy())


def test_illegal_latent_sizes_name_the_step():
    with pytest.raises(ValueError, match=r"1 bucket\(s\) \(520x512\) are not divisible by 16 .*multiples of 16"):
        check_latent_sizes([(512, 512), (520, 512)], vae_scale_factor=8, patch_size=2)
    with pytest.raises(ValueError, match="divisible by 32"):
        bucket_shift_table(BucketSet.preset("budget", resolution=512, step=16), ShiftConfig(), 16, 2)
    check_latent_sizes(BucketSet.preset("sana", resolution=512).resolutions, 32, 1)  # Sana: VAE 32, patch 1


def test_config_validation_and_round_trip():
    with pytest.raises(ValueError, match="time_shift_type"):
        ShiftConfig(time_shift_type="cosine")
    sc = ShiftConfig(**FLUX)
    assert ShiftConfig(**sc.to_dict()) == sc


def test_cli_prints_each_buckets_seq_len_and_mu(tmp_path, capsys):
    import json

    from hf_arb.cli.app import main

    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps(FLUX))
    assert main(["buckets", "--preset", "hunyuan_dit", "--scheduler", str(tmp_path)]) == 0
    out = capsys.readouterr().out.split("resolution shift", 1)[1]
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert len(rows) == 10
    got = {(int(r[1]), int(r[2])): (int(r[3]), float(r[4])) for r in rows}
    assert got[(1024, 1024)] == (4096, 1.15) and got[(1280, 1280)] == (6400, pytest.approx(1.54, abs=1e-4))
    capsys.readouterr()
    with pytest.raises(SystemExit):  # an argparse-style one-line error, not a traceback
        main(["buckets", "--preset", "budget", "--resolution", "512", "--step", "16", "--scheduler", str(tmp_path),
              "--vae-scale-factor", "16"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "not divisible by 32" in err
    # in this CLI's flags only (issue 24, item 7): no script flag, no Python call, no garbled `--step=...`
    assert err.endswith("Pass --step 32 (or a multiple of 32), or a --preset whose table is.")
    assert "--bucket_step" not in err and "BucketSet" not in err and "`" not in err
