"""Every output folder loads in plain diffusers, in a process where ``import hf_arb`` fails, with the code its
model card shows: a stock SD pipeline, a LoRA file, and a ``--resolution_conditioning`` model (which carries its
own pipeline file, diffusers' custom-pipeline convention)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import test_fault_train
import test_train
import test_train_dreambooth
import test_train_lora
import torch
from _stock import run_job

from hf_arb.families.conditioning import resolution_class_labels, sdxl_time_ids
from hf_arb.families.sd_pipeline import conditioning_dim, embed_time_ids

#: Runs in the stock interpreter (tests/_stock.py): hf_arb blocked, then each card's code (minus the CUDA line), then
#: generation.
BLOCKED = r"""
import json, sys
sys.modules["hf_arb"] = None  # any `import hf_arb` now raises ImportError
try:
    import hf_arb
    raise SystemExit("hf_arb is importable")
except ImportError:
    pass
import numpy as np, torch
results = {}
for name, code in json.loads(sys.argv[1]).items():
    scope = {}
    exec(code, scope)  # the model card's snippet: imports and the lines that load `pipe`
    pipe = scope["pipe"]
    def gen(**kw):
        return pipe("a wide photo", height=48, width=80, num_inference_steps=2, output_type="np",
                    generator=torch.Generator().manual_seed(0), **kw).images
    a = gen()
    extra = {"size_matters": float(np.abs(a - gen(original_size=(96, 32))).max())} if name == "conditioned" else {}
    adapters = pipe.get_active_adapters() if hasattr(pipe, "get_active_adapters") else []
    scales = sorted({s for m in pipe.unet.modules() if isinstance(getattr(m, "scaling", None), dict)
                     for s in m.scaling.values()})  # a LoRA layer's alpha / r, as load_lora_weights rebuilt it
    results[name] = {"cls": type(pipe).__name__, "module": type(pipe).__module__, "shape": list(a.shape),
                     "finite": bool(np.isfinite(a).all()), "adapters": list(adapters), "scales": scales, **extra}
print(json.dumps(results))
"""

assets = test_train.assets  # the session's tiny models and images
_clean_accelerate_state = test_train._clean_accelerate_state
# the runs whose output folders these tests load (built once per test run, whichever file asks first)
ddp_runs = test_train.ddp_runs
sd_lora = test_train_lora.sd_lora
sd_lora_alpha = test_train_dreambooth.sd_lora_alpha
ckpt_run, fault_assets = test_fault_train.ckpt_run, test_fault_train.fault_assets


def test_standalone_pipeline_embeds_like_hf_arb_conditioning():
    ids = sdxl_time_ids([[768, 512], [300, 1200]], [[0, 0], [10, 20]], [[768, 512], [256, 1024]])
    torch.testing.assert_close(embed_time_ids(ids, 16), resolution_class_labels(ids, 16))


def test_standalone_pipeline_file_imports_only_torch_and_diffusers():
    import ast

    import hf_arb.families.sd_pipeline as module

    tree = ast.parse(Path(module.__file__).read_text())
    roots = {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    roots |= {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert roots <= {"__future__", "math", "collections", "typing", "torch", "diffusers"}, roots


@pytest.fixture(scope="module")
def outputs(ckpt_run, sd_lora, sd_lora_alpha, ddp_runs) -> dict[str, Path]:
    """Four outputs of runs other files make anyway (shared artifacts, tests/conftest.py): a stock SD pipeline
    (test_fault_train's 4-step run), an SD LoRA file (test_train_lora's README command), one trained with
    --rank 4 --lora_alpha 8 (test_train_dreambooth) and a resolution-conditioned SD pipeline (test_train's 2-process
    run)."""
    return {"stock": ckpt_run, "lora": sd_lora["out"], "lora_alpha": sd_lora_alpha, "conditioned": ddp_runs["full"]}


def card_code(folder: Path) -> str:
    """The model card's Python block without its device line and its generation (tests/test_card_code.py runs it
    whole)."""
    card = (folder / "README.md").read_text()
    block = card.split("## Use", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    lines = block.splitlines()
    return "\n".join(lines[:next(i for i, line in enumerate(lines) if line.startswith("device, dtype ="))])


@pytest.mark.slow
@pytest.mark.xdist_group("portable")
def test_every_output_loads_with_its_card_code_without_hf_arb(outputs):
    codes = {name: card_code(folder) for name, folder in outputs.items()}
    for code in codes.values():
        assert "hf_arb" not in code
    assert f'custom_pipeline="{outputs["conditioned"]}", trust_remote_code=True' in codes["conditioned"]
    assert f'pipe.load_lora_weights("{outputs["lora"]}")' in codes["lora"]
    assert (outputs["conditioned"] / "pipeline.py").is_file()
    assert json.loads((outputs["conditioned"] / "model_index.json").read_text())["_class_name"] == \
        "StableDiffusionResolutionPipeline"
    out = run_job(BLOCKED, [json.dumps(codes)])  # the stock interpreter, hf_arb blocked (tests/_stock.py)
    results: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    for name, r in results.items():
        assert r["shape"] == [1, 48, 80, 3] and r["finite"], name  # non-square generation
        assert "hf_arb" not in r["module"], name
    assert results["stock"]["cls"] == "StableDiffusionPipeline"
    assert results["lora"]["cls"] == "StableDiffusionPipeline" and results["lora"]["adapters"]
    # the strength it was trained with: alpha = rank (scale 1) by default, --rank 4 --lora_alpha 8 loads at 2
    assert results["lora"]["scales"] == [1.0] and results["lora_alpha"]["scales"] == [2.0]
    assert results["stock"]["scales"] == []
    assert results["conditioned"]["cls"] == "StableDiffusionResolutionPipeline"
    assert results["conditioned"]["size_matters"] > 0  # the folder's pipeline feeds the trained size conditioning


@pytest.mark.slow
@pytest.mark.xdist_group("portable")
def test_conditioned_folder_still_loads_with_hf_arbs_class(outputs):
    from hf_arb.families.conditioning import StableDiffusionResolutionPipeline

    pipe = StableDiffusionResolutionPipeline.from_pretrained(outputs["conditioned"])
    assert type(pipe) is StableDiffusionResolutionPipeline and conditioning_dim(pipe.unet) == 16
