"""Qwen-Image-Edit LoRA (issue #26): detection before Qwen-Image, the prompt embeddings (the reference through the
vision tower) and reference latent tokens equal to ``QwenImageEditPipeline``'s, and (slow) a tiny 1-process LoRA run
on before/after pairs whose LoRA loads in the stock edit pipeline and edits a non-square image, resumed exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _stock import job_result
from _train_fixtures import FLOW
from test_train import read_trace, run_script

import train_text_to_image_arb as script
from hf_arb.families import detect_family, get_family
from hf_arb.families.qwenimage_edit import edit_texts, encode_edit_prompts, reference_latent_tokens, to_uint8_images


@pytest.fixture(scope="module")
def edit_assets(family_assets) -> dict[str, str]:
    """The tiny Qwen-Image-Edit pipeline and the before/after pairs (tests/conftest.py ``family_assets``)."""
    return {"model": family_assets["qwen_edit"], "pairs": family_assets["pairs"]}


@pytest.fixture(scope="module")
def pipe(edit_assets):
    from diffusers import QwenImageEditPipeline

    from hf_arb.testing.tiny_qwen import load_qwen2_vl_processor

    return QwenImageEditPipeline.from_pretrained(edit_assets["model"],
                                                 processor=load_qwen2_vl_processor(edit_assets["model"]))


def test_qwen_edit_is_detected_before_qwenimage(edit_assets) -> None:
    assert detect_family(edit_assets["model"]) == "qwenimage-edit"
    assert detect_family("Qwen/Qwen-Image-Edit") == "qwenimage-edit"
    assert detect_family("Qwen/Qwen-Image") == "qwenimage"
    fam = get_family("qwenimage-edit")
    assert fam.pipeline_class_name == "QwenImageEditPipeline" and fam.supports_references


def test_prompt_embeddings_and_reference_tokens_are_the_pipelines(pipe) -> None:
    """The reference goes through the vision tower in the prompt exactly as encode_prompt(image=...) does, and its
    latent tokens equal prepare_latents' image_latents."""
    fam = get_family("qwenimage-edit")
    tokenizer, image_processor = pipe.processor.tokenizer, pipe.processor.image_processor
    pixels = (torch.randint(0, 256, (2, 3, 48, 80)).float() / 127.5 - 1)
    images = to_uint8_images(pixels)
    assert torch.equal(torch.from_numpy(np.array(images[1])).permute(2, 0, 1).float() / 127.5 - 1, pixels[1])
    captions = ["make it red", "turn the cat around and make the sky a deep blue"]
    embeds, mask = encode_edit_prompts(tokenizer, image_processor, pipe.text_encoder, edit_texts(captions), images,
                                       "cpu")
    ref, ref_mask = pipe.encode_prompt(captions, image=images, device="cpu")
    n = int(mask.sum(1).max())
    assert ref_mask is not None and torch.equal(mask[:, :n], ref_mask)
    torch.testing.assert_close(embeds[:, :n], ref)
    alone, _ = pipe.encode_prompt(captions[:1], image=images[:1], device="cpu")
    assert alone.shape[1] > 16  # the image's vision tokens are in the prompt
    other, _ = encode_edit_prompts(tokenizer, image_processor, pipe.text_encoder, edit_texts(captions),
                                   to_uint8_images(-pixels), "cpu")
    assert not torch.allclose(other, embeds)  # the embeddings see the image
    tokens, shape = reference_latent_tokens(pipe.vae, pixels)
    _, image_latents = pipe.prepare_latents(pixels.unsqueeze(2), 2, 16, 48, 80, torch.float32, torch.device("cpu"),
                                            torch.Generator().manual_seed(0))
    torch.testing.assert_close(tokens, image_latents)
    assert shape == (1, 3, 5)
    assert fam.vae_scale_factor(pipe.vae) == 8


def test_the_processor_is_a_public_qwen2_vl_processor(pipe, edit_assets) -> None:
    """hf_arb's processor is a Qwen2VLProcessor built through its public constructor (no video processor, so no
    torchvision): its output is edit_prompt_inputs', and the saved pipeline names the stock class."""
    from transformers import Qwen2VLProcessor

    from hf_arb.families.qwenimage_edit import edit_prompt_inputs

    proc = pipe.processor
    assert isinstance(proc, Qwen2VLProcessor) and type(proc).get_attributes() == ["image_processor", "tokenizer"]
    images = to_uint8_images(torch.rand(2, 3, 48, 80) * 2 - 1)
    texts = edit_texts(["make it red", "a much longer caption for the second image"])
    theirs = proc(text=texts, images=images, padding=True, return_tensors="pt")
    ours = edit_prompt_inputs(proc.tokenizer, proc.image_processor, texts, images)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    index = json.loads((Path(edit_assets["model"]) / "model_index.json").read_text())
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]


def test_the_prediction_is_the_pipelines_transformer_call(pipe) -> None:
    """predict(references=...) = the pipeline's transformer call on [target, image] tokens, cut to the target."""
    from hf_arb.families.flux import pack_latents, unpack_latents

    fam = get_family("qwenimage-edit")
    options = fam.options(pipe.scheduler.config, pipe.transformer)
    pixels = torch.rand(2, 3, 64, 32) * 2 - 1
    images = to_uint8_images(pixels)
    embeds, mask = encode_edit_prompts(pipe.processor.tokenizer, pipe.processor.image_processor, pipe.text_encoder,
                                       edit_texts(["make it red", "blue"]), images, "cpu")
    noisy, sigmas = torch.randn(2, 16, 6, 10), torch.tensor([0.3, 0.8])
    tokens, shape = reference_latent_tokens(pipe.vae, pixels)
    with torch.no_grad():
        ours = fam.predict(pipe.transformer, noisy, sigmas, embeds, mask, options, references=(tokens, [shape]))
        ref, ref_mask = pipe.encode_prompt(["make it red", "blue"], image=images, device="cpu")
        theirs = pipe.transformer(hidden_states=torch.cat([pack_latents(noisy), tokens], 1), timestep=sigmas,
                                  encoder_hidden_states=ref, encoder_hidden_states_mask=ref_mask,
                                  img_shapes=[[(1, 3, 5), (1, 4, 2)]] * 2, return_dict=False)[0]
        plain = fam.predict(pipe.transformer, noisy, sigmas, embeds, mask, options)
    assert shape == (1, 4, 2)
    torch.testing.assert_close(ours, unpack_latents(theirs[:, :15], 6, 10))
    assert not torch.allclose(ours, plain)


def test_edit_flags_are_checked(edit_assets, tmp_path) -> None:
    base = ["--pretrained_model_name_or_path", edit_assets["model"], "--dataset_name", edit_assets["pairs"],
            "--output_dir", str(tmp_path / "o"), *FLOW, "--max_train_steps", "1", "--rank", "4"]
    with pytest.raises(script.UsageError, match="Qwen-Image-Edit trains on input images: add --reference_image_column"):
        script.parse_args(base)
    with pytest.raises(script.UsageError, match="Qwen-Image-Edit edits one input image, got 2 reference columns"):
        script.parse_args([*base, "--reference_image_column", "before", "--reference_image_column", "text"])
    with pytest.raises(script.UsageError, match="--cache_text_embeddings: Qwen-Image-Edit's prompt embeddings"):
        script.parse_args([*base, "--reference_image_column", "before", "--cache_text_embeddings"])
    script.parse_args([*base, "--reference_image_column", "before", "--cache_latents"])  # accepted
    with pytest.raises(script.UsageError) as err:  # composite ids are per bucket set, not per (tier, bucket) yet
        script.parse_args([*base, "--reference_image_column", "before", "--resolution", "32,64"])
    assert "--reference_image_column is not supported with several tiers (--resolution 32,64)" in str(err.value)
    assert "\n" not in str(err.value)


EDIT_ARGS = [*FLOW, "--rank", "4", "--learning_rate", "2e-2", "--max_train_steps", "4", "--checkpointing_steps", "2",
             "--bucket_leftover", "fill", "--reference_image_column", "before"]


@pytest.fixture(scope="module")
def edit_lora(edit_assets, tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("qwen-edit-lora") / "run"
    stats = run_script(["--pretrained_model_name_or_path", edit_assets["model"], "--dataset_name",
                        edit_assets["pairs"], *EDIT_ARGS, "--output_dir", str(out)])
    return {"dir": out, "stats": stats}


@pytest.mark.slow
def test_qwen_edit_lora_trains_on_pairs(edit_lora) -> None:
    stats = edit_lora["stats"]
    assert stats["global_step"] == 4 and np.isfinite(stats["losses"]).all()
    trace = read_trace(edit_lora["dir"], 0)
    assert any(t["shape"][2] != t["shape"][3] for t in trace)  # a non-square bucket was trained
    from safetensors.torch import load_file

    weights = load_file(str(edit_lora["dir"] / "pytorch_lora_weights.safetensors"))
    assert weights and all(k.startswith("transformer.") and ".lora_" in k for k in weights)


STOCK = r"""
import json, sys
sys.modules["hf_arb"] = None
import numpy as np, torch
from PIL import Image
from diffusers import QwenImageEditPipeline
from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen2VLProcessor
folder = sys.argv[1] + "/processor"
tok, images = AutoTokenizer.from_pretrained(folder), Qwen2VLImageProcessorPil.from_pretrained(folder)
class ImageOnly(Qwen2VLProcessor):  # no torchvision: a Qwen2VLProcessor without a video processor (public API)
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None):
        super().__init__(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)
try:
    processor = Qwen2VLProcessor.from_pretrained(folder)  # transformers with torchvision
except Exception:
    processor = ImageOnly(image_processor=images, tokenizer=tok)
pipe = QwenImageEditPipeline.from_pretrained(sys.argv[1], processor=processor)
image = Image.fromarray((np.random.default_rng(0).random((48, 80, 3)) * 255).astype("uint8"))
def edit():
    return pipe(image=image, prompt="make it colourful", height=48, width=80, num_inference_steps=2,
                output_type="np", generator=torch.Generator().manual_seed(0)).images
a = edit()
changed = []
for lora in sys.argv[2:]:  # each LoRA alone: load, edit, unload
    pipe.load_lora_weights(lora)
    b = edit()
    changed.append(float(np.abs(a - b).max()))
    pipe.unload_lora_weights()
print("RESULT" + json.dumps({"shape": list(b.shape), "finite": bool(np.isfinite(b).all()),
                             "changed": min(changed)}))
"""
#: the LoRA part of STOCK (a full fine-tune's test replaces it)
STOCK_LORAS = STOCK[STOCK.index("changed = []"):STOCK.index('print("RESULT"')]


@pytest.mark.slow
def test_qwen_edit_lora_edits_a_non_square_image_in_stock_diffusers(edit_assets, edit_lora, own_lora) -> None:
    """The strict and the --reference_policy own LoRAs each load in the stock pipeline (one interpreter) and
    change its edit of a non-square image."""
    result = job_result(STOCK, [edit_assets["model"], str(edit_lora["dir"]), str(own_lora["dir"])])  # hf_arb blocked
    assert result["shape"] == [1, 48, 80, 3] and result["finite"]
    assert result["changed"] > 0  # each LoRA changes the edit


def own_argv(model: str, pairs: str, out: Path, columns: list[str]) -> list[str]:
    """A 4-step LoRA with ``--reference_policy own`` on ``columns``."""
    argv = ["--pretrained_model_name_or_path", model, "--dataset_name", pairs, *FLOW, "--rank", "4", "--learning_rate",
            "2e-2", "--max_train_steps", "4", "--checkpointing_steps", "100", "--bucket_leftover", "fill",
            "--reference_policy", "own", "--output_dir", str(out)]
    for c in columns:
        argv += ["--reference_image_column", c]
    return argv


def own_policy_run(model: str, pairs: str, out: Path, columns: list[str]) -> dict[str, Any]:
    """A 4-step LoRA with ``--reference_policy own``, recording each step's reference pixel shapes (the tensors the
    loss stacks: a batch mixing reference shapes could not be stacked) and the rows they came with."""
    import hf_arb.families.qwenimage_edit as edit

    seen: list[tuple[int, ...]] = []
    real = edit.reference_latent_tokens

    def recording(vae, pixels):
        seen.append(tuple(pixels.shape))
        return real(vae, pixels)

    argv = own_argv(model, pairs, out, columns)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(edit, "reference_latent_tokens", recording)
        stats = run_script(argv)
    trace = read_trace(out, 0)
    r = len(columns)
    steps = [seen[i * r:(i + 1) * r] for i in range(len(trace))]
    assert stats["global_step"] == 4 and len(seen) == 4 * r and np.isfinite(stats["losses"]).all()
    return {"dir": out, "stats": stats, "trace": trace, "shapes": steps}


def assert_own_buckets(run: dict[str, Any]) -> None:
    """Each row's references always come at one shape (their own bucket), and at least one differs from the
    target's bucket (under strict every reference takes the target's)."""
    per_row: dict[int, set[tuple[tuple[int, ...], ...]]] = {}
    for t, shapes in zip(run["trace"], run["shapes"]):
        assert all(s[0] == t["shape"][0] for s in shapes)  # the whole batch in one tensor per column
        for row in t["rows"]:
            per_row.setdefault(row, set()).add(tuple(s[2:] for s in shapes))
    assert all(len(v) == 1 for v in per_row.values())
    assert any(list(s[2:]) != t["shape"][2:] for t, shapes in zip(run["trace"], run["shapes"]) for s in shapes)


@pytest.fixture(scope="module")
def own_lora(edit_assets, tmp_path_factory) -> dict[str, Any]:
    return own_policy_run(edit_assets["model"], edit_assets["pairs"], tmp_path_factory.mktemp("qwen-edit-own") / "run",
                          ["before"])


@pytest.mark.slow
def test_own_policy_trains_qwen_edit_references_at_their_own_bucket(own_lora) -> None:
    """--reference_policy own on Qwen-Image-Edit: the narrower references stack at their own bucket, never mixed in
    a batch (the stock pipeline's edit with this LoRA: test_qwen_edit_lora_edits_a_non_square_image_...)."""
    assert_own_buckets(own_lora)


@pytest.mark.slow
def test_qwen_edit_lora_resumes_exactly(edit_assets, edit_lora, tmp_path) -> None:
    import shutil

    from safetensors.torch import load_file

    out, resumed = edit_lora["dir"], tmp_path / "resumed"
    shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
    run_script(["--pretrained_model_name_or_path", edit_assets["model"], "--dataset_name", edit_assets["pairs"],
                *EDIT_ARGS, "--output_dir", str(resumed), "--resume_from_checkpoint", "latest"])
    tail = [t for t in read_trace(out, 0) if t["step"] >= 2]
    assert [(t["rows"], t["loss"]) for t in read_trace(resumed, 0)] == [(t["rows"], t["loss"]) for t in tail]
    a = load_file(str(out / "pytorch_lora_weights.safetensors"))
    b = load_file(str(resumed / "pytorch_lora_weights.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_qwen_edit_cached_latents_match_the_on_the_fly_run(edit_assets, edit_lora, tmp_path) -> None:
    """--cache_latents: the target's and the reference's posteriors come from the cache (the VAE never encodes a
    reference in the loss), the text encoder still sees the reference pixels; batches and losses are the on-the-fly
    run's within the float16 cache's tolerance, and a second run on the same cache encodes nothing."""
    import hf_arb.families.qwenimage_edit as edit

    argv = ["--pretrained_model_name_or_path", edit_assets["model"], "--dataset_name", edit_assets["pairs"],
            *EDIT_ARGS, "--cache_latents", "--latent_cache_dir", str(tmp_path / "cache"), "--output_dir",
            str(tmp_path / "cached")]
    from _family_runs import check_cached_edit_runs

    check_cached_edit_runs(edit, "reference_latent_tokens", argv, edit_lora, tmp_path)


@pytest.mark.slow
def test_qwen_edit_lora_on_two_processes_keeps_ranks_in_one_composite_bucket(ddp_batch) -> None:
    from _train_fixtures import batch_result

    run = batch_result(ddp_batch, "family-qwen-edit")  # the shared 2-process batch (tests/_train_fixtures.py)
    out, stats = Path(run["out"]), run["stats"]
    r0, r1 = read_trace(out, 0), read_trace(out, 1)
    assert stats["global_step"] == 3 and [t["step"] for t in r0] == [t["step"] for t in r1] == [0, 1, 2]
    assert [t["bucket"] for t in r0] == [t["bucket"] for t in r1]
    assert [t["shape"] for t in r0] == [t["shape"] for t in r1]
    assert np.isfinite(stats["losses"]).all()
    for a, b in zip(r0, r1):
        assert not set(a["rows"]) & set(b["rows"])


@pytest.mark.slow
def test_qwen_edit_full_finetune_saves_a_pipeline_stock_diffusers_edits_with(edit_assets, tmp_path) -> None:
    """--full_finetune: the saved QwenImageEditPipeline (processor folder included) loads without hf_arb; its
    transformer differs from the base one and edits a non-square image."""
    out = tmp_path / "full"
    args = list(EDIT_ARGS)
    del args[args.index("--rank"):args.index("--rank") + 2]
    args[args.index("--learning_rate") + 1] = "1e-3"
    stats = run_script(["--pretrained_model_name_or_path", edit_assets["model"], "--dataset_name",
                        edit_assets["pairs"], *args, "--full_finetune", "--output_dir", str(out)])
    assert stats["global_step"] == 4 and (out / "processor" / "preprocessor_config.json").is_file()
    script = STOCK.replace("a = edit()\n" + STOCK_LORAS,
                           "b = edit()\nbase = QwenImageEditPipeline.from_pretrained(sys.argv[2], processor=processor)"
                           "\npipe = base\na = edit()\nchanged = [float(np.abs(a - b).max())]\n")
    assert script != STOCK  # the LoRA part was replaced
    result = job_result(script, [str(out), edit_assets["model"]])  # tests/_stock.py: hf_arb blocked
    assert result["shape"] == [1, 48, 80, 3] and result["finite"] and result["changed"] > 0
