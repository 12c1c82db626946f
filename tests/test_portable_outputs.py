"""Output folders load in plain diffusers, in a process where ``import hf_arb`` fails.

A ``--resolution_conditioning`` model carries its own pipeline file (diffusers' custom-pipeline convention) and
its model card's snippet is what the test runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_train import COMMON, _clean_accelerate_state, assets, run_script  # noqa: F401

from hf_arb.conditioning import resolution_class_labels, sdxl_time_ids
from hf_arb.pipeline_sd_resolution import conditioning_dim, embed_time_ids

#: Runs in a fresh interpreter: hf_arb blocked, then the model card's load line, then generation.
BLOCKED = r"""
import json, sys
sys.modules["hf_arb"] = None  # any `import hf_arb` now raises ImportError
try:
    import hf_arb
    raise SystemExit("hf_arb is importable")
except ImportError:
    pass
import numpy as np, torch
from diffusers import DiffusionPipeline
load_line = sys.argv[1]
exec(load_line)  # the model card's line: DiffusionPipeline.from_pretrained(folder, custom_pipeline=folder, ...)
def gen(**kw):
    return pipe("a wide photo", height=48, width=80, num_inference_steps=2, output_type="np",
                generator=torch.Generator().manual_seed(0), **kw).images
a, b = gen(), gen(original_size=(96, 32))
print(json.dumps({"cls": type(pipe).__name__, "module": type(pipe).__module__, "shape": list(a.shape),
                  "finite": bool(np.isfinite(a).all()), "size_matters": float(np.abs(a - b).max())}))
"""


def test_standalone_pipeline_embeds_like_hf_arb_conditioning():
    ids = sdxl_time_ids([[768, 512], [300, 1200]], [[0, 0], [10, 20]], [[768, 512], [256, 1024]])
    torch.testing.assert_close(embed_time_ids(ids, 16), resolution_class_labels(ids, 16))


def test_standalone_pipeline_file_imports_only_torch_and_diffusers():
    import ast

    import hf_arb.pipeline_sd_resolution as module

    tree = ast.parse(Path(module.__file__).read_text())
    roots = {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    roots |= {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert roots <= {"__future__", "math", "collections", "typing", "torch", "diffusers"}, roots


@pytest.fixture(scope="module")
def conditioned(assets, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("conditioned")
    run_script(["--pretrained_model_name_or_path", assets["sd"], "--train_data_dir", assets["images"],
                "--output_dir", str(out), *COMMON, "--resolution_conditioning", "--resolution_embed_dim", "16",
                "--max_train_steps", "2", "--checkpointing_steps", "100", "--learning_rate", "1e-2"])
    return out


@pytest.mark.slow
@pytest.mark.xdist_group("portable")
def test_resolution_conditioned_model_generates_without_hf_arb(conditioned):
    out = conditioned
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionResolutionPipeline" and (out / "pipeline.py").is_file()
    card = (out / "README.md").read_text()
    load_line = f'pipe = DiffusionPipeline.from_pretrained("{out}", custom_pipeline="{out}", trust_remote_code=True)'
    assert load_line in card and "import hf_arb" not in card and "from hf_arb" not in card
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run([sys.executable, "-c", BLOCKED, load_line], capture_output=True, text=True, env=env,
                          timeout=300, cwd="/")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["cls"] == "StableDiffusionResolutionPipeline" and "hf_arb" not in result["module"]
    assert result["shape"] == [1, 48, 80, 3] and result["finite"]
    assert result["size_matters"] > 0  # the folder's pipeline feeds the trained size conditioning


@pytest.mark.slow
@pytest.mark.xdist_group("portable")
def test_conditioned_folder_still_loads_with_hf_arbs_class(conditioned):
    from hf_arb.conditioning import StableDiffusionResolutionPipeline

    pipe = StableDiffusionResolutionPipeline.from_pretrained(conditioned)
    assert type(pipe) is StableDiffusionResolutionPipeline and conditioning_dim(pipe.unet) == 16
