"""Tiny offline SD3 and Flux pipelines load and generate non-square images with stock diffusers, without hf_arb,
and the stock pipelines shift each size's sigmas exactly as hf_arb.families.shift computes for that bucket."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
from _stock import job_result

from hf_arb import BucketSet
from hf_arb.families.shift import ShiftConfig, bucket_shift_table, shift_sigmas
from hf_arb.testing.tiny import save_tiny_flux, save_tiny_sd3, tiny_t5_tokenizer

SIZES = [(80, 48), (48, 96), (64, 64)]  # (width, height), multiples of 16: legal for VAE 8 x patch 2
STEPS = 2

_STOCK = textwrap.dedent('''
    import importlib.abc, json, sys

    class _Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "hf_arb" or name.startswith("hf_arb."):
                raise ImportError(f"{name} is blocked: the pipeline must load with stock diffusers alone")

    sys.meta_path.insert(0, _Block())
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, StableDiffusion3Pipeline

    sd3_path, flux_path, sizes, steps = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    out = {}
    for name, cls, path in [("flux", FluxPipeline, flux_path), ("sd3_dynamic", StableDiffusion3Pipeline, sd3_path)]:
        pipe = cls.from_pretrained(path)
        if name == "sd3_dynamic":  # SD3/3.5 ship a static shift; give it Flux-style shifting to compare schedules
            pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config,
                                                                        use_dynamic_shifting=True)
        runs = {}
        for w, h in sizes:
            img = pipe("a red fox in the snow", height=h, width=w, num_inference_steps=steps, output_type="np",
                       generator=torch.Generator().manual_seed(0)).images
            runs[f"{w}x{h}"] = {"shape": list(img.shape), "finite": bool((img == img).all()),
                                "sigmas": pipe.scheduler.sigmas[:-1].tolist()}
        out[name] = {"runs": runs, "scheduler": dict(pipe.scheduler.config)}
    print("RESULT" + json.dumps(out))
''')


def test_tiny_t5_tokenizer_works_offline():
    tok = tiny_t5_tokenizer(16)
    ids = tok("A photo, 3 cats!", padding="max_length", max_length=16).input_ids
    assert len(ids) == 16 and ids.count(1) == 1 and tok.unk_token_id not in ids  # one </s>, nothing unknown
    assert tok.decode(ids, skip_special_tokens=True).replace(" ", "") == "Aphoto,3cats!"


@pytest.mark.slow
def test_stock_pipelines_load_generate_non_square_and_shift_per_bucket(tmp_path):
    sd3, flux = save_tiny_sd3(tmp_path / "sd3"), save_tiny_flux(tmp_path / "flux")
    result = job_result(_STOCK, [sd3, flux, json.dumps(SIZES), str(STEPS)])  # tests/_stock.py: hf_arb blocked
    assert not json.loads((tmp_path / "sd3" / "scheduler" / "scheduler_config.json").read_text())[
        "use_dynamic_shifting"
    ]
    buckets = BucketSet(SIZES)
    for name, got in result.items():
        cfg = ShiftConfig.from_scheduler_config(got["scheduler"])
        assert cfg.use_dynamic_shifting
        mu = bucket_shift_table(buckets, cfg, vae_scale_factor=8, patch_size=2)["mu"]
        for i, (w, h) in enumerate(SIZES):
            run = got["runs"][f"{w}x{h}"]
            assert run["shape"] == [1, h, w, 3] and run["finite"], (name, w, h)
            # The t grid each pipeline feeds set_timesteps: Flux np.linspace(1, 1/N, N); SD3 the scheduler's own.
            grid = np.linspace(1.0, 1 / STEPS, STEPS) if name == "flux" else np.linspace(1000, 1, STEPS) / 1000
            expect = np.asarray(shift_sigmas(grid, mu[i], cfg), np.float32)
            np.testing.assert_allclose(run["sigmas"], expect, rtol=2e-6, err_msg=f"{name} {w}x{h}")
        assert got["runs"]["80x48"]["sigmas"] != got["runs"]["64x64"]["sigmas"]  # different sizes, different shifts
