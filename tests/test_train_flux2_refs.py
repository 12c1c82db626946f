"""Flux.2 with reference images (issue #26): the reference tokens and ids equal ``Flux2KleinPipeline``'s for
``image=[...]`` (several references of different sizes), and (slow) a tiny LoRA run on two reference columns whose
LoRA loads in the stock pipeline and edits a non-square image, with ``--cache_latents`` matching the on-the-fly run."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from _stock import job_result
from _train_fixtures import two_reference_pairs
from test_family_flux2 import ARGS
from test_train import read_trace, run_script

from hf_arb.families import get_family
from hf_arb.families.flux2 import normalize_latents, patchify
from hf_arb.families.flux2_refs import reference_tokens

__all__ = ["two_reference_pairs"]  # test_train_qwen_edit_plus.py's import (tests/_train_fixtures.py builds it)


@pytest.fixture(scope="module")
def refs_assets(family_assets) -> dict[str, str]:
    """The tiny Flux.2 klein and the two-reference pairs (tests/conftest.py ``family_assets``)."""
    return {"model": family_assets["flux2_klein"], "pairs": family_assets["pairs2"]}


def test_flux2_takes_references(refs_assets) -> None:
    assert get_family("flux2_klein").supports_references and get_family("flux2").supports_references


def test_reference_tokens_are_the_pipelines(refs_assets) -> None:
    """Two references of different sizes: tokens and ids equal Flux2KleinPipeline.prepare_image_latents'."""
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline.from_pretrained(refs_assets["model"])
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(1, 3, 48, 80, generator=g) * 2 - 1, torch.rand(1, 3, 64, 32, generator=g) * 2 - 1
    to_model = lambda mode: normalize_latents(patchify(mode), pipe.vae)  # noqa: E731
    tokens, ids = reference_tokens(pipe.vae, [a.repeat(2, 1, 1, 1), b.repeat(2, 1, 1, 1)], to_model, "cpu",
                                   torch.float32)
    theirs, their_ids = pipe.prepare_image_latents([a, b], 2, g, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(tokens, theirs)
    assert torch.equal(ids, their_ids)
    assert ids[0, :15, 0].eq(10).all() and ids[0, 15:, 0].eq(20).all()  # 3x5 then 4x2 tokens


ARGV = [*ARGS, "--rank", "4", "--learning_rate", "2e-2", "--max_train_steps", "4", "--checkpointing_steps", "100",
        "--bucket_leftover", "fill", "--reference_image_column", "before", "--reference_image_column", "style"]


@pytest.fixture(scope="module")
def refs_lora(refs_assets, tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("flux2-refs-lora") / "run"
    stats = run_script(["--pretrained_model_name_or_path", refs_assets["model"], "--dataset_name",
                        refs_assets["pairs"], *ARGV, "--output_dir", str(out)])
    return {"dir": out, "stats": stats}


@pytest.mark.slow
def test_flux2_lora_trains_on_two_reference_columns(refs_lora) -> None:
    stats = refs_lora["stats"]
    assert stats["global_step"] == 4 and np.isfinite(stats["losses"]).all()
    assert any(t["shape"][2] != t["shape"][3] for t in read_trace(refs_lora["dir"], 0))


STOCK = r"""
import json, sys
sys.modules["hf_arb"] = None
import numpy as np, torch
from PIL import Image
from diffusers import Flux2KleinPipeline
pipe = Flux2KleinPipeline.from_pretrained(sys.argv[1])
rng = np.random.default_rng(0)
images = [Image.fromarray((rng.random((64, 96, 3)) * 255).astype("uint8")),  # the pipeline's minimum side is 64
          Image.fromarray((rng.random((96, 64, 3)) * 255).astype("uint8"))]
def edit():
    return pipe(image=images, prompt="make it colourful", height=48, width=80, num_inference_steps=2,
                max_sequence_length=48, output_type="np", generator=torch.Generator().manual_seed(0)).images
a = edit()
pipe.load_lora_weights(sys.argv[2])
b = edit()
print("RESULT" + json.dumps({"shape": list(b.shape), "finite": bool(np.isfinite(b).all()),
                             "changed": float(np.abs(a - b).max())}))
"""


@pytest.mark.slow
def test_flux2_lora_edits_with_two_references_in_stock_diffusers(refs_assets, refs_lora) -> None:
    result = job_result(STOCK, [refs_assets["model"], str(refs_lora["dir"])])  # tests/_stock.py: hf_arb blocked
    assert result["shape"] == [1, 48, 80, 3] and result["finite"] and result["changed"] > 0


@pytest.mark.slow
def test_flux2_cached_reference_latents_match_the_on_the_fly_run(refs_assets, refs_lora, tmp_path) -> None:
    stats = run_script(["--pretrained_model_name_or_path", refs_assets["model"], "--dataset_name",
                        refs_assets["pairs"], *ARGV, "--cache_latents", "--output_dir", str(tmp_path / "cached")])
    assert stats["latents_encoded"] > 0
    assert [t["rows"] for t in read_trace(tmp_path / "cached", 0)] == [t["rows"] for t in
                                                                         read_trace(refs_lora["dir"], 0)]
    np.testing.assert_allclose(stats["losses"], refs_lora["stats"]["losses"], rtol=2e-3)  # float16 cache


@pytest.mark.slow
def test_flux2_with_references_on_two_processes_resumes_exactly(ddp_batch, refs_assets) -> None:
    """Full fine-tune on two reference columns, 2 processes (the shared batch): both ranks train one composite
    bucket per step (3 rows a shape, --bucket_leftover fill), and a resume from checkpoint-2 in a new folder ends
    on the same weights."""
    from _family_runs import check_edit_ddp_resume

    check_edit_ddp_resume(ddp_batch, "family-flux2-refs", refs_assets["model"])
