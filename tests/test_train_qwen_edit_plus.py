"""Qwen-Image-Edit-Plus (issue #26): detection, the prompt (picture prefixes, condition-size images through the
vision tower) and the latent tokens of several references equal ``QwenImageEditPlusPipeline``'s, and (slow) a tiny
LoRA run on two reference columns at their own buckets (``--reference_policy own``) whose LoRA loads in the stock
Plus pipeline and edits from two images, and a 2-process full fine-tune that resumes exactly."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
from _stock import job_result
from test_train import read_trace
from test_train_qwen_edit import STOCK

from hf_arb.families import detect_family, get_family
from hf_arb.families.qwenimage_edit import encode_edit_prompts, reference_latent_tokens, to_uint8_images
from hf_arb.families.qwenimage_edit_plus import condition_images, plus_texts


@pytest.fixture(scope="module")
def plus_assets(family_assets) -> dict[str, str]:
    """The tiny Qwen-Image-Edit-Plus and the two-reference pairs (tests/conftest.py ``family_assets``)."""
    return {"model": family_assets["qwen_edit_plus"], "pairs": family_assets["pairs2"]}


@pytest.fixture(scope="module")
def pipe(plus_assets):
    from diffusers import QwenImageEditPlusPipeline

    from hf_arb.testing.tiny_qwen import load_qwen2_vl_processor

    return QwenImageEditPlusPipeline.from_pretrained(plus_assets["model"],
                                                     processor=load_qwen2_vl_processor(plus_assets["model"]))


def test_plus_is_detected_before_edit(plus_assets) -> None:
    assert detect_family(plus_assets["model"]) == "qwenimage-edit-plus"
    assert detect_family("Qwen/Qwen-Image-Edit-2509") == "qwenimage-edit-plus"
    assert detect_family("Qwen/Qwen-Image-Edit") == "qwenimage-edit"
    assert get_family("qwenimage-edit-plus").max_references is None


def test_prompt_and_reference_tokens_are_the_pipelines(pipe) -> None:
    """Sample by sample, our batched prompt embeddings equal encode_prompt(caption, image=[condition images]);
    the references' latent tokens equal prepare_latents' image_latents."""
    fam = get_family("qwenimage-edit-plus")
    g = torch.Generator().manual_seed(0)
    refs = [torch.randint(0, 256, (2, 3, 48, 80), generator=g).float() / 127.5 - 1,
            torch.randint(0, 256, (2, 3, 64, 32), generator=g).float() / 127.5 - 1]
    captions = ["make it red", "put the cat of picture 2 into picture 1"]
    texts, images = fam.prompt_inputs(captions, refs)
    assert texts == plus_texts(captions, 2) and [im.size for im in images[:2]] == [(480, 288), (256, 544)]
    embeds, mask = encode_edit_prompts(pipe.processor.tokenizer, pipe.processor.image_processor, pipe.text_encoder,
                                       texts, images, "cpu")
    for i, caption in enumerate(captions):
        sample = condition_images([to_uint8_images(r)[i] for r in refs])
        ref, _ = pipe.encode_prompt([caption], image=sample, device="cpu")
        n = int(mask[i].sum())
        assert n == ref.shape[1]
        torch.testing.assert_close(embeds[i, :n], ref[0], rtol=1e-4, atol=1e-5)
    tokens = torch.cat([reference_latent_tokens(pipe.vae, r)[0] for r in refs], dim=1)
    _, theirs = pipe.prepare_latents([r.unsqueeze(2) for r in refs], 2, 16, 48, 80, torch.float32,
                                     torch.device("cpu"), g)
    torch.testing.assert_close(tokens, theirs)


@pytest.fixture(scope="module")
def plus_lora(plus_assets, tmp_path_factory) -> dict[str, Any]:
    """A 4-step LoRA on two reference columns under ``--reference_policy own`` (the Plus pipeline takes input
    images of any size: each reference keeps its own bucket); the strict policy trains in the 2-process run."""
    from test_train_qwen_edit import own_policy_run

    return own_policy_run(plus_assets["model"], plus_assets["pairs"], tmp_path_factory.mktemp("qwen-plus-lora") / "run",
                          ["before", "style"])


@pytest.mark.slow
def test_plus_lora_trains_on_two_reference_columns_at_their_own_buckets(plus_lora) -> None:
    from test_train_qwen_edit import assert_own_buckets

    assert any(t["shape"][2] != t["shape"][3] for t in plus_lora["trace"])
    assert_own_buckets(plus_lora)
    assert any(a != b for a, b in plus_lora["shapes"])  # the two columns at different shapes in one step


@pytest.mark.slow
def test_plus_lora_edits_from_two_images_in_stock_diffusers(plus_assets, plus_lora) -> None:
    script = (STOCK.replace("QwenImageEditPipeline", "QwenImageEditPlusPipeline")
              .replace("pipe(image=image,", "pipe(image=[image, image.rotate(90, expand=True)],"))
    result = job_result(script, [plus_assets["model"], str(plus_lora["dir"])])  # tests/_stock.py: hf_arb blocked
    assert result["shape"] == [1, 48, 80, 3] and result["finite"] and result["changed"] > 0


@pytest.mark.slow
def test_plus_full_finetune_on_two_processes_resumes_exactly(ddp_batch, plus_assets) -> None:
    """Full fine-tune on two reference columns, 2 processes (the shared batch): both ranks train one composite
    bucket per step (3 rows a shape, --bucket_leftover fill), and a resume from checkpoint-2 in a new folder ends
    on the same weights;
    the saved pipeline names the stock processor class."""
    from _family_runs import check_edit_ddp_resume

    full = check_edit_ddp_resume(ddp_batch, "family-qwen-edit-plus", plus_assets["model"])
    index = json.loads((full / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPlusPipeline"
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]


@pytest.mark.slow
def test_plus_cached_latents_at_own_buckets_match_the_on_the_fly_run(plus_assets, plus_lora, tmp_path) -> None:
    """--cache_latents on two reference columns at their own buckets: the same batches as the on-the-fly LoRA, its
    losses within the float16 cache's tolerance (each reference's own crop is in its cache key)."""
    from test_train import run_script
    from test_train_qwen_edit import own_argv

    stats = run_script([*own_argv(plus_assets["model"], plus_assets["pairs"], tmp_path / "cached", ["before", "style"]),
                        "--cache_latents"])
    assert stats["latents_encoded"] > 0
    assert [t["rows"] for t in read_trace(tmp_path / "cached", 0)] == [t["rows"] for t in plus_lora["trace"]]
    np.testing.assert_allclose(stats["losses"], plus_lora["stats"]["losses"], rtol=2e-3)  # float16 cache
