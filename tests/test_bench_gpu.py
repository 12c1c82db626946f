"""benchmarks/bench_gpu.py (issue 40): its full-size configs are the published architectures, and the whole script
runs on the CPU with tiny configs (``--device cpu --tiny``), so it never rots before someone has a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_gpu  # noqa: E402

#: parameters of the published checkpoints' denoisers (their safetensors' element counts): the model cards say
#: SD 1.5 ~860 M, SDXL 2.6 B, Flux.1-dev 12 B, Qwen-Image 20 B
PUBLISHED = {"sd15": 859_520_964, "sdxl": 2_567_463_684, "flux1_dev": 11_901_408_320, "qwen_image": 20_430_401_088}


def test_full_size_configs_build_the_published_architectures():
    specs = {s["name"]: s for s in bench_gpu.load_specs(tiny=False)}
    assert set(specs) == set(PUBLISHED)
    for name, spec in specs.items():
        n = bench_gpu.count_parameters(spec)  # built on the meta device: no memory
        assert n == PUBLISHED[name] == spec["published_parameters"], (name, n)
    sdxl, flux, qwen = specs["sdxl"]["config"], specs["flux1_dev"]["config"], specs["qwen_image"]["config"]
    assert sdxl["transformer_layers_per_block"] == [1, 2, 10] and sdxl["block_out_channels"] == [320, 640, 1280]
    assert sdxl["cross_attention_dim"] == 2048 and bench_gpu.text_dims(specs["sdxl"]) == (77, 2048, 1280)
    assert (flux["num_layers"], flux["num_single_layers"]) == (19, 38)
    assert flux["num_attention_heads"] * flux["attention_head_dim"] == 3072 and flux["guidance_embeds"]
    assert qwen["num_layers"] == 60 and qwen["num_attention_heads"] * qwen["attention_head_dim"] == 3072
    assert bench_gpu.text_dims(specs["flux1_dev"]) == (512, 4096, 768)


def test_tiny_configs_keep_each_architecture_and_shrink_it():
    full = {s["name"]: s for s in bench_gpu.load_specs(tiny=False)}
    for spec in bench_gpu.load_specs(tiny=True):
        assert spec["model_class"] == full[spec["name"]]["model_class"]
        assert bench_gpu.count_parameters(spec) < 2_000_000


def test_preset_shapes_are_the_largest_median_and_square_of_one_budget():
    for spec in bench_gpu.load_specs(tiny=False):
        shapes = bench_gpu.preset_shapes(spec, tiny=False)
        (lw, lh), (mw, mh), (s, s2) = shapes["largest"], shapes["median"], shapes["square"]
        assert s == s2 and lw * lh >= mw * mh and lw * lh <= s * s * 1.1 and max(lw, lh) > s


def test_batch_table_is_linear_in_the_batch_with_headroom():
    # 10 GiB at batch 1, +4 GiB per image: a 24 GiB card (21.6 usable) takes 3, an 80 GiB one 16
    table = bench_gpu.batch_table(10.0, 14.0)
    assert table == {"24": 3, "48": 9, "80": 16, "141": 30}
    assert bench_gpu.batch_table(30.0, 40.0)["24"] == 0


@pytest.mark.slow
def test_the_script_runs_end_to_end_on_the_cpu_with_tiny_configs(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--device", "cpu", "--tiny", "--models",
         "sd15,flux1_dev", "--families", "sd", "--jobs", "2", "--out", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["tiny"] and result["device"] == "cpu" and result["environment"]["torch"]
    # smoke: the tiny SD run against its CPU reference, and its resume from checkpoint-2, equal
    smoke = result["smoke"]
    assert [(c["family"], c["case"], c["ok"]) for c in smoke["cases"]] == [("sd", "fp32", True), ("sd", "resume", True)]
    assert smoke["failed"] == [] and smoke["cases"][1]["max_weight_diff"] == 0.0
    # on the CPU the fp32 case is its reference's run, run once (its distance to itself is 0 by construction, not
    # asserted); the resume case above compares a second process's steps with it exactly
    assert len(smoke["cases"][0]["losses"]) == 3 and smoke["cases"][0]["same_as"] == "sd-ref-cpu"
    # models: each step through hf_arb's adapter and diffusers' step, at every bucket, finite
    models = result["models"]
    assert set(models) == {"sd15", "flux1_dev"}
    for entry in models.values():
        assert "error" not in entry, entry
        steps = [(s["impl"], s["bucket"], s["batch"]) for s in entry["steps"]]
        assert steps == [("hf_arb", "largest", 1), ("hf_arb", "median", 1), ("hf_arb", "square", 1),
                         ("diffusers", "square", 1), ("hf_arb", "largest", 2)]
        assert all(s["finite"] and s["step_s"] > 0 for s in entry["steps"])
        assert entry["lora_parameters"] > 0 and entry["parameters"] > entry["lora_parameters"]
    # loader: both paths measured, and the share of a step the GPU would wait for them
    loader = result["loader"]
    assert loader["decode_fit"]["images"] > 0 and loader["cached_latents"]["images_per_s"] > 0
    assert set(loader["gpu_wait_share"]) == {"SD 1.5 UNet", "Flux.1-dev transformer"}
    # the docs table renders from the file
    table = bench_gpu.markdown(result)
    assert "| SD 1.5 UNet |" in table and "diffusers" in table and "2 of 2 cases passed" in table
