"""Qwen-Image-Edit-Plus (issue #26): detection, the prompt (picture prefixes, condition-size images through the
vision tower) and the latent tokens of several references equal ``QwenImageEditPlusPipeline``'s, and (slow) a tiny
LoRA run on two reference columns whose LoRA loads in the stock Plus pipeline and edits from two images."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from _stock import job_result
from _train_fixtures import FLOW
from test_train import read_trace, run_script
from test_train_flux2_refs import two_reference_pairs
from test_train_qwen_edit import STOCK

from hf_arb.families import detect_family, get_family
from hf_arb.families.qwenimage_edit import encode_edit_prompts, reference_latent_tokens, to_uint8_images
from hf_arb.families.qwenimage_edit_plus import condition_images, plus_texts


@pytest.fixture(scope="module")
def plus_assets(tmp_path_factory) -> dict[str, str]:
    from hf_arb.testing.tiny_qwen import save_tiny_qwenimage_edit

    root = tmp_path_factory.mktemp("qwen-edit-plus")
    return {"model": save_tiny_qwenimage_edit(root / "tiny-plus", plus=True), "pairs": two_reference_pairs(root)}


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


ARGV = [*FLOW, "--rank", "4", "--learning_rate", "2e-2", "--max_train_steps", "4", "--checkpointing_steps", "100",
        "--bucket_leftover", "fill", "--reference_image_column", "before", "--reference_image_column", "style"]


@pytest.fixture(scope="module")
def plus_lora(plus_assets, tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("qwen-plus-lora") / "run"
    stats = run_script(["--pretrained_model_name_or_path", plus_assets["model"], "--dataset_name",
                        plus_assets["pairs"], *ARGV, "--output_dir", str(out)])
    return {"dir": out, "stats": stats}


@pytest.mark.slow
def test_plus_lora_trains_on_two_reference_columns(plus_lora) -> None:
    assert plus_lora["stats"]["global_step"] == 4 and np.isfinite(plus_lora["stats"]["losses"]).all()
    assert any(t["shape"][2] != t["shape"][3] for t in read_trace(plus_lora["dir"], 0))


@pytest.mark.slow
def test_plus_lora_edits_from_two_images_in_stock_diffusers(plus_assets, plus_lora) -> None:
    script = (STOCK.replace("QwenImageEditPipeline", "QwenImageEditPlusPipeline")
              .replace("pipe(image=image,", "pipe(image=[image, image.rotate(90, expand=True)],"))
    result = job_result(script, [plus_assets["model"], str(plus_lora["dir"])])  # tests/_stock.py: hf_arb blocked
    assert result["shape"] == [1, 48, 80, 3] and result["finite"] and result["changed"] > 0
