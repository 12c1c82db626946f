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
    """The model card's loading snippet (no device line, no generation line; tests/test_card_code.py runs it whole)."""
    card = (folder / "README.md").read_text()
    block = card.split("## Use", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    lines = block.splitlines()
    return "\n".join(lines[:next(i for i, line in enumerate(lines) if line.startswith("device, dtype ="))])


def stock_generate(folders: dict[str, Path]) -> dict[str, Any]:
    """Run each folder's model-card snippet in the stock interpreter, where ``import hf_arb`` fails (tests/_stock.py),
    and generate an 80 x 48 image; returns per name ``{"cls", "shape", "finite"[, "lora_changes_output"]}``."""
    codes = {name: card_code(folder) for name, folder in folders.items()}
    assert all("hf_arb" not in c for c in codes.values())
    return job_result(STOCK, [json.dumps(codes)])


# ------------------------------------------------------------------------------------------- shared checks
# What the per-family files (test_family_qwenimage.py, test_family_zimage.py) assert on their ``family_runs`` and
# ``family_ddp_result`` runs: the same properties for every family, with the family's name, pipeline class and
# start-up shift line.
def check_full_resume(runs: dict[str, Any], family: str, pipeline_class: str, shift_line: str) -> None:
    """The 1-process full fine-tune trains a non-square bucket; its resume from checkpoint-2 replays steps 2-3 (rows
    and losses) to the same weights (max abs diff < 1e-6), which steps 3-4 changed; the log names the family and
    its shift, and the saved pipeline is ``pipeline_class``."""
    import numpy as np
    import torch
    from test_train import read_trace

    full, resumed = Path(runs["full"]["dir"]), Path(runs["resumed"]["dir"])
    trace = read_trace(full, 0)
    assert [t["step"] for t in trace] == [0, 1, 2, 3]
    assert any(t["shape"][2] != t["shape"][3] for t in trace)  # a non-square bucket was trained
    again = read_trace(resumed, 0)
    assert [(t["step"], t["rows"]) for t in again] == [(t["step"], t["rows"]) for t in trace if t["step"] >= 2]
    np.testing.assert_allclose([t["loss"] for t in again], [t["loss"] for t in trace[2:]], rtol=1e-6)
    a, b, ckpt = transformer_weights(full), transformer_weights(resumed), transformer_weights(full / "checkpoint-2")
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    assert any(not torch.equal(ckpt[k], a[k]) for k in a)  # steps 3-4 changed the weights
    stats = runs["full"]["stats"]
    assert stats["family"] == family and shift_line in stats["log"]
    assert json.loads((full / "model_index.json").read_text())["_class_name"] == pipeline_class


def check_cached_lora(runs: dict[str, Any]) -> None:
    """The LoRA from cached prompt embeddings and latents trains the on-the-fly LoRA's rows, its losses within the
    float16 latent cache's tolerance."""
    import numpy as np
    from test_train import read_trace

    fly, cached = runs["lora"], runs["lora_cached"]
    assert cached["stats"]["latents_encoded"] == 20
    assert [t["rows"] for t in read_trace(Path(cached["dir"]), 0)] == [t["rows"] for t in
                                                                       read_trace(Path(fly["dir"]), 0)]
    np.testing.assert_allclose(cached["stats"]["losses"], fly["stats"]["losses"], rtol=2e-3)  # float16 latent cache


def check_lora_targets_and_validation(runs: dict[str, Any]) -> None:
    """The LoRA adapts the transformer's attention projections, and validation drew its three buckets."""
    from PIL import Image
    from safetensors.torch import load_file

    weights = load_file(str(Path(runs["lora"]["dir"]) / "pytorch_lora_weights.safetensors"))
    assert weights and all(k.startswith("transformer.") and ".lora_" in k for k in weights)
    assert {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in weights} >= {"to_q", "to_k", "to_v"}
    grid = Path(runs["lora"]["dir"]) / "validation" / "final-000003.png"
    assert Image.open(grid).size == (48 + 64 + 80, 80)  # portrait, square, landscape buckets side by side


def check_stock_outputs(runs: dict[str, Any], pipeline_class: str) -> None:
    """The full fine-tune and the LoRA, trained at 80x48 among others, load with their cards' code where hf_arb
    cannot be imported and generate an 80 x 48 image; the LoRA changes the output."""
    from test_train import read_trace

    folders = {"full": Path(runs["full"]["dir"]), "lora": Path(runs["lora"]["dir"])}
    assert "80x48" in {t["label"] for t in read_trace(folders["full"], 0) + read_trace(folders["lora"], 0)}
    results = stock_generate(folders)
    for name, r in results.items():
        assert r["cls"] == pipeline_class and r["shape"] == [1, 48, 80, 3] and r["finite"], name
    assert results["lora"]["lora_changes_output"] > 0


def check_ddp_resume(ddp: dict[str, Any]) -> None:
    """The 2-process full run: both ranks train the same bucket at every step with disjoint rows (a non-square one
    among them); the resume from checkpoint-2 replays each rank's rows to the same weights (max abs diff < 1e-6)."""
    from test_train import read_trace

    full, resumed = Path(ddp["full"]["dir"]), Path(ddp["resumed"]["dir"])
    r0, r1 = read_trace(full, 0), read_trace(full, 1)
    assert [t["step"] for t in r0] == [t["step"] for t in r1] == [0, 1, 2, 3]
    assert [t["label"] for t in r0] == [t["label"] for t in r1]
    assert any(t["shape"][2] != t["shape"][3] for t in r0)
    assert all(not set(a["rows"]) & set(b["rows"]) for a, b in zip(r0, r1))
    assert ddp["full"]["stats"]["num_processes"] == 2
    for rank in (0, 1):
        tail = [(t["step"], t["rows"]) for t in read_trace(full, rank) if t["step"] >= 2]
        assert [(t["step"], t["rows"]) for t in read_trace(resumed, rank)] == tail
    a, b = transformer_weights(full), transformer_weights(resumed)
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6


def check_cached_edit_runs(module: Any, encoder: str, argv: list[str], fly: dict[str, Any], out: Path) -> None:
    """An edit model's ``--cache_latents`` run (``argv``, writing to ``out / "cached"``) against its on-the-fly LoRA
    ``fly`` (``{"dir", "stats"}``): the loss never encodes a reference (``module.encoder`` fails the test if called),
    the batches (rows, bucket) are the on-the-fly run's and the losses within the float16 cache's tolerance; a second
    run on the same cache (``out / "again"``) encodes nothing, calls no VAE and repeats the losses."""
    import numpy as np
    import pytest
    from test_train import read_trace, run_script

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, encoder, lambda *a, **k: pytest.fail("encoded a reference"))
        first = run_script(argv)
    assert first["latents_encoded"] > 0 and first["latents_reused"] == 0
    keys = ["rows", "bucket"]
    assert [[t[k] for k in keys] for t in read_trace(out / "cached", 0)] == [
        [t[k] for k in keys] for t in read_trace(Path(fly["dir"]), 0)]
    np.testing.assert_allclose(first["losses"], fly["stats"]["losses"], rtol=2e-3)  # float16 cache
    argv = list(argv)
    argv[argv.index("--output_dir") + 1] = str(out / "again")
    second = run_script(argv)
    assert second["latents_encoded"] == 0 and second["latents_reused"] == first["latents_encoded"]
    assert second["vae_encode_calls"] == 0  # neither target nor reference was encoded again
    np.testing.assert_allclose(second["losses"], first["losses"], rtol=1e-6)
