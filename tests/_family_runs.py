"""Shared by the per-family test files (tests/test_family_*.py): the tiny training runs of one family and the
check that its outputs load and generate in stock diffusers without hf_arb."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from _stock import job_result
from _train_fixtures import FLOW
from test_train import run_script


def family_runs(model: str, images: str, root: Path) -> dict[str, Any]:
    """One process each: a full fine-tune (4 steps, checkpoint at 2) and its resume from checkpoint-2 in a new
    folder; LoRA with validation at three buckets, and LoRA from cached prompt embeddings and latents."""
    base = ["--pretrained_model_name_or_path", model, "--train_data_dir", images, *FLOW, "--random_flip"]
    full = [*base, "--full_finetune", "--learning_rate", "1e-3", "--max_train_steps", "4", "--checkpointing_steps",
            "2", "--weighting_scheme", "logit_normal"]
    lora = [*base, "--rank", "4", "--learning_rate", "2e-2", "--max_train_steps", "3", "--checkpointing_steps", "100"]
    runs = {"full": full, "lora": [*lora, "--validation_prompts", "a cat", "--num_validation_images", "1",
                                   "--num_validation_inference_steps", "2"],
            "lora_cached": [*lora, "--cache_text_embeddings", "--cache_latents"]}
    out: dict[str, Any] = {}
    for name, argv in runs.items():
        stats = run_script([*argv, "--output_dir", str(root / name)])
        out[name] = {"dir": str(root / name), "stats": json.loads(json.dumps(stats, default=str))}
    shutil.copytree(root / "full" / "checkpoint-2", root / "resumed" / "checkpoint-2")
    stats = run_script([*full, "--output_dir", str(root / "resumed"), "--resume_from_checkpoint", "latest"])
    out["resumed"] = {"dir": str(root / "resumed"), "stats": json.loads(json.dumps(stats, default=str))}
    return out


def family_ddp_result(batch: dict[str, Any], name: str) -> dict[str, Any]:
    """A family's 2-process full fine-tune (4 steps, checkpoint at 2) and its resume from checkpoint-2 in a new
    folder, as the shared 2-process batch ran them (``ddp_batch``, tests/_train_fixtures.py ``batch_runs``)."""
    from _train_fixtures import batch_result

    return {kind: {"dir": batch_result(batch, f"{name}-{kind}")["out"],
                   "stats": batch_result(batch, f"{name}-{kind}")["stats"]} for kind in ("full", "resumed")}


def check_edit_ddp_resume(batch: dict[str, Any], name: str, base_model: str) -> Path:
    """An edit model's 2-process full fine-tune in the shared batch (4 steps, checkpoint at 2, ``--bucket_leftover
    fill``): both ranks train one composite bucket per step, a non-square one among them; the run resumed from
    checkpoint-2 in a new folder replays each rank's steps, rows and losses and ends on the same transformer weights
    (max abs diff < 1e-6), which differ from the base model's. Returns the full run's folder."""
    from test_train import read_trace

    run = family_ddp_result(batch, name)
    full, resumed = Path(run["full"]["dir"]), Path(run["resumed"]["dir"])
    r0, r1 = read_trace(full, 0), read_trace(full, 1)
    assert run["full"]["stats"]["num_processes"] == 2 and [t["step"] for t in r0] == [0, 1, 2, 3]
    assert [t["bucket"] for t in r0] == [t["bucket"] for t in r1] and any(t["shape"][2] != t["shape"][3] for t in r0)
    for rank in (0, 1):
        tail = [(t["step"], t["rows"], t["loss"]) for t in read_trace(full, rank) if t["step"] >= 2]
        assert [(t["step"], t["rows"], t["loss"]) for t in read_trace(resumed, rank)] == tail
    a, b = transformer_weights(full), transformer_weights(resumed)
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    base = transformer_weights(Path(base_model))
    assert max(float((a[k] - base[k].to(a[k].dtype)).abs().max()) for k in a) > 0  # it trained
    return full


def transformer_weights(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "transformer" / "diffusion_pytorch_model.safetensors"))


STOCK = r"""
import json, sys
sys.modules["hf_arb"] = None
import numpy as np, torch
results = {}
for name, code in json.loads(sys.argv[1]).items():
    scope = {}
    exec(code, scope)  # the model card's snippet
    pipe = scope["pipe"]
    def gen():
        return pipe("a wide photo", height=48, width=80, num_inference_steps=2, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images
    a = gen()
    r = {"cls": type(pipe).__name__, "shape": list(a.shape), "finite": bool(np.isfinite(a).all())}
    if "load_lora_weights" in code:
        pipe.unload_lora_weights()
        r["lora_changes_output"] = float(np.abs(a - gen()).max())
    results[name] = r
    del pipe, scope
print("RESULT" + json.dumps(results))
"""


def card_code(folder: Path) -> str:
    """The model card's loading snippet (no GPU line, no generation line)."""
    card = (folder / "README.md").read_text()
    block = card.split("## Use", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    return "\n".join(line for line in block.splitlines() if '"cuda"' not in line and not line.startswith("image ="))


def stock_generate(folders: dict[str, Path]) -> dict[str, Any]:
    """Run each folder's model-card snippet in the stock interpreter, where ``import hf_arb`` fails (tests/_stock.py),
    and generate an 80 x 48 image; returns per name ``{"cls", "shape", "finite"[, "lora_changes_output"]}``."""
    codes = {name: card_code(folder) for name, folder in folders.items()}
    assert all("hf_arb" not in c for c in codes.values())
    return job_result(STOCK, [json.dumps(codes)])
