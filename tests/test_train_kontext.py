"""Flux.1 Kontext edit LoRA (issue #26): a tiny 1-process LoRA run on before/after pairs with
``--reference_image_column``, whose LoRA loads in the stock ``FluxKontextPipeline`` and edits a non-square image."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest
import torch
from _stock import job_result
from _train_fixtures import FLOW
from test_train import read_trace, run_script

import train_text_to_image_arb as script
from hf_arb import BucketSet
from hf_arb.annotate.map import add_bucket_columns
from hf_arb.families import detect_family, get_family
from hf_arb.families.flux import latent_image_ids
from hf_arb.families.flux_kontext import reference_tokens


@pytest.fixture(scope="module")
def kontext_assets(family_assets) -> dict[str, str]:
    """The tiny Kontext pipeline and its before/after pairs (tests/conftest.py ``family_assets``, built once)."""
    return {"model": family_assets["kontext"], "pairs": family_assets["pairs"]}


def test_kontext_is_detected_before_flux(kontext_assets) -> None:
    assert detect_family(kontext_assets["model"]) == "flux-kontext"
    fam = get_family("flux-kontext")
    assert fam.pipeline_class_name == "FluxKontextPipeline" and fam.supports_references


def test_reference_tokens_are_the_pipelines(kontext_assets) -> None:
    """The tokens and ids training appends equal FluxKontextPipeline.prepare_latents' image latents and ids."""
    from diffusers import FluxKontextPipeline

    pipe = FluxKontextPipeline.from_pretrained(kontext_assets["model"])
    pixels = torch.rand(2, 3, 48, 80) * 2 - 1
    tokens, ids = reference_tokens(pipe.vae, [pixels], "cpu", torch.float32)
    _, image_latents, latent_ids, image_ids = pipe.prepare_latents(
        pixels, 2, pipe.transformer.config.in_channels // 4, 48, 80, torch.float32, torch.device("cpu"),
        torch.Generator().manual_seed(0))
    torch.testing.assert_close(tokens, image_latents)
    torch.testing.assert_close(ids, image_ids)
    assert (ids[:, 0] == 1).all() and torch.equal(latent_ids, latent_image_ids(6, 10))


def test_reference_flags_are_checked(kontext_assets, tmp_path) -> None:
    from hf_arb.testing.tiny_flow import save_tiny_flux

    flux = save_tiny_flux(tmp_path / "flux")
    base = ["--dataset_name", kontext_assets["pairs"], "--output_dir", str(tmp_path / "o"), *FLOW,
            "--max_train_steps", "1", "--rank", "4"]
    with pytest.raises(script.UsageError, match="takes no reference image"):
        script.main(["--pretrained_model_name_or_path", flux, *base, "--reference_image_column", "before"])
    with pytest.raises(script.UsageError, match="--reference_policy own has no effect in this run"):
        script.main(["--pretrained_model_name_or_path", kontext_assets["model"], *base, "--reference_policy", "own"])
    annotated = tmp_path / "strict-pairs"
    add_bucket_columns(datasets.load_from_disk(kontext_assets["pairs"]), BucketSet.from_budget(64, step=16),
                       reference_columns=["before"], show_summary=False).save_to_disk(str(annotated))
    argv = ["--pretrained_model_name_or_path", kontext_assets["model"], *base, "--reference_image_column", "before"]
    argv[argv.index("--dataset_name") + 1] = str(annotated)
    with pytest.raises(script.UsageError, match="annotated under strict"):
        script.main([*argv, "--reference_policy", "own"])
    with pytest.raises(script.UsageError, match="annotated without these reference columns"):
        script.main([*argv[:-1], "text"])  # a column the annotation has no reference columns for


@pytest.fixture(scope="module")
def kontext_lora(kontext_assets, tmp_path_factory) -> dict[str, Any]:
    import hf_arb.families.flux_kontext as kontext

    out = tmp_path_factory.mktemp("kontext-lora") / "run"
    seen: list[tuple[int, ...]] = []

    def counting(vae, references, device, dtype):  # what the loss receives, step by step
        seen.append(tuple(r.shape for r in references)[0])
        return reference_tokens(vae, references, device, dtype)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kontext, "reference_tokens", counting)
        stats = run_script(["--pretrained_model_name_or_path", kontext_assets["model"], "--dataset_name",
                            kontext_assets["pairs"], "--reference_image_column", "before", *FLOW, "--rank", "4",
                            "--learning_rate", "2e-2", "--max_train_steps", "4", "--checkpointing_steps", "2",
                            "--bucket_leftover", "fill", "--output_dir", str(out)])
    return {"dir": out, "stats": stats, "reference_shapes": seen, "argv_model": kontext_assets["model"]}


@pytest.mark.slow
def test_kontext_lora_trains_on_pairs_with_stacked_references(kontext_lora) -> None:
    stats = kontext_lora["stats"]
    assert stats["global_step"] == 4 and np.isfinite(stats["losses"]).all()
    trace = read_trace(kontext_lora["dir"], 0)
    assert any(t["shape"][2] != t["shape"][3] for t in trace)  # a non-square bucket was trained
    shapes = kontext_lora["reference_shapes"]
    assert len(shapes) == 4 and all(s[0] == 2 for s in shapes)  # every step's loss saw a stacked reference batch
    for t, s in zip(trace, shapes):  # strict: the reference takes the target's bucket
        assert list(s[2:]) == t["shape"][2:], (s, t["shape"])
    from safetensors.torch import load_file

    weights = load_file(str(kontext_lora["dir"] / "pytorch_lora_weights.safetensors"))
    assert weights and all(k.startswith("transformer.") and ".lora_" in k for k in weights)


@pytest.mark.slow
def test_cond_image_column_is_upstreams_name_for_the_reference_column(kontext_assets, kontext_lora, tmp_path) -> None:
    """train_dreambooth_lora_flux_kontext.py's --cond_image_column trains exactly the --reference_image_column run
    (issue 35): the same losses, step by step."""
    stats = run_script(["--pretrained_model_name_or_path", kontext_assets["model"], "--dataset_name",
                        kontext_assets["pairs"], "--cond_image_column", "before", *FLOW, "--rank", "4",
                        "--learning_rate", "2e-2", "--max_train_steps", "4", "--checkpointing_steps", "2",
                        "--bucket_leftover", "fill", "--output_dir", str(tmp_path / "cond")])
    assert stats["losses"] == kontext_lora["stats"]["losses"] and len(stats["losses"]) == 4


STOCK = r"""
import json, sys
sys.modules["hf_arb"] = None
import numpy as np, torch
from PIL import Image
from diffusers import FluxKontextPipeline
pipe = FluxKontextPipeline.from_pretrained(sys.argv[1])
image = Image.fromarray((np.random.default_rng(0).random((48, 80, 3)) * 255).astype("uint8"))
def edit():
    return pipe(image=image, prompt="make it colourful", height=48, width=80, num_inference_steps=2, output_type="np",
                max_area=48 * 80, _auto_resize=False, generator=torch.Generator().manual_seed(0)).images
a = edit()
pipe.load_lora_weights(sys.argv[2])
b = edit()
print("RESULT" + json.dumps({"shape": list(b.shape), "finite": bool(np.isfinite(b).all()),
                             "changed": float(np.abs(a - b).max())}))
"""


@pytest.mark.slow
def test_kontext_lora_edits_a_non_square_image_in_stock_diffusers(kontext_assets, kontext_lora) -> None:
    result = job_result(STOCK, [kontext_assets["model"], str(kontext_lora["dir"])])  # tests/_stock.py: hf_arb blocked
    assert result["shape"] == [1, 48, 80, 3] and result["finite"]
    assert result["changed"] > 0  # the LoRA changes the edit


def test_the_reference_conditions_the_prediction(kontext_assets) -> None:
    """The target's prediction keeps its shape and changes with the reference (its tokens are attended to)."""
    from diffusers import FluxKontextPipeline

    pipe = FluxKontextPipeline.from_pretrained(kontext_assets["model"])
    fam = get_family("flux-kontext")
    options = fam.options(pipe.scheduler.config, pipe.transformer, max_sequence_length=16)
    embeds, pooled = fam.encode_prompts([pipe.tokenizer, pipe.tokenizer_2], [pipe.text_encoder, pipe.text_encoder_2],
                                        ["make it red"] * 2, torch.device("cpu"), 16)
    g = torch.Generator().manual_seed(0)
    noisy = torch.randn(2, 16, 6, 10, generator=g)
    sigmas = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        plain = fam.predict(pipe.transformer, noisy, sigmas, embeds, pooled, options)
        refs = [torch.rand(2, 3, 64, 32, generator=g) * 2 - 1]
        a = fam.predict(pipe.transformer, noisy, sigmas, embeds, pooled, options,
                        references=reference_tokens(pipe.vae, refs, "cpu", torch.float32))
        b = fam.predict(pipe.transformer, noisy, sigmas, embeds, pooled, options,
                        references=reference_tokens(pipe.vae, [-refs[0]], "cpu", torch.float32))
    assert a.shape == plain.shape == noisy.shape
    assert not torch.allclose(a, plain) and not torch.allclose(a, b)


@pytest.mark.slow
def test_own_policy_trains_references_at_their_own_bucket(kontext_assets, tmp_path) -> None:
    """--reference_policy own: the narrower references stack at their own (narrower) bucket, not the target's."""
    import hf_arb.families.flux_kontext as kontext

    seen: list[tuple[tuple[int, ...], ...]] = []

    def counting(vae, references, device, dtype):
        seen.append(tuple(tuple(r.shape) for r in references))
        return reference_tokens(vae, references, device, dtype)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kontext, "reference_tokens", counting)
        stats = run_script(["--pretrained_model_name_or_path", kontext_assets["model"], "--dataset_name",
                            kontext_assets["pairs"], "--reference_image_column", "before", "--reference_policy",
                            "own", *FLOW, "--rank", "4", "--max_train_steps", "6", "--checkpointing_steps", "100",
                            "--bucket_leftover", "fill", "--output_dir", str(tmp_path / "own")])
    trace = read_trace(tmp_path / "own", 0)
    assert stats["global_step"] == 6 and len(seen) == 6
    assert any(list(s[0][2:]) != t["shape"][2:] for s, t in zip(seen, trace))  # a reference bucket of its own


@pytest.mark.slow
def test_kontext_lora_resumes_exactly(kontext_assets, kontext_lora, tmp_path) -> None:
    """Resumed from checkpoint-2, the run draws the same composite batches and reaches the same losses and LoRA."""
    import shutil

    from safetensors.torch import load_file

    out, resumed = kontext_lora["dir"], tmp_path / "resumed"
    shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
    run_script(["--pretrained_model_name_or_path", kontext_assets["model"], "--dataset_name", kontext_assets["pairs"],
                "--reference_image_column", "before", *FLOW, "--rank", "4", "--learning_rate", "2e-2",
                "--max_train_steps", "4", "--checkpointing_steps", "2", "--bucket_leftover", "fill",
                "--output_dir", str(resumed), "--resume_from_checkpoint", "latest"])
    tail = [t for t in read_trace(out, 0) if t["step"] >= 2]
    assert [(t["rows"], t["loss"]) for t in read_trace(resumed, 0)] == [(t["rows"], t["loss"]) for t in tail]
    a = load_file(str(out / "pytorch_lora_weights.safetensors"))
    b = load_file(str(resumed / "pytorch_lora_weights.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_kontext_lora_on_two_processes_keeps_ranks_in_one_composite_bucket(ddp_batch) -> None:
    from _train_fixtures import batch_result

    run = batch_result(ddp_batch, "family-kontext")  # the shared 2-process batch (tests/_train_fixtures.py)
    out, stats = Path(run["out"]), run["stats"]
    r0, r1 = read_trace(out, 0), read_trace(out, 1)
    assert stats["global_step"] == 3 and [t["step"] for t in r0] == [t["step"] for t in r1] == [0, 1, 2]
    assert [t["bucket"] for t in r0] == [t["bucket"] for t in r1]  # the composite id, the same on both ranks
    assert [t["shape"] for t in r0] == [t["shape"] for t in r1]
    for a, b in zip(r0, r1):
        assert not set(a["rows"]) & set(b["rows"])


@pytest.mark.slow
def test_kontext_cached_latents_match_the_on_the_fly_run(kontext_assets, kontext_lora, tmp_path) -> None:
    """--cache_latents with a reference column: the target's and the reference's posteriors come from the cache
    (keys with each one's own crop), the batches and losses are the on-the-fly run's, and a second run reuses all."""
    import hf_arb.families.flux_kontext as kontext

    argv = ["--pretrained_model_name_or_path", kontext_assets["model"], "--dataset_name", kontext_assets["pairs"],
            "--reference_image_column", "before", *FLOW, "--rank", "4", "--learning_rate", "2e-2",
            "--max_train_steps", "4", "--checkpointing_steps", "2", "--bucket_leftover", "fill", "--cache_latents",
            "--latent_cache_dir", str(tmp_path / "cache"), "--output_dir", str(tmp_path / "cached")]
    from _family_runs import check_cached_edit_runs

    check_cached_edit_runs(kontext, "reference_tokens", argv, kontext_lora, tmp_path)  # the loss reads the cache


@pytest.mark.slow
def test_kontext_cached_latents_on_two_processes(ddp_batch) -> None:
    """Two processes share the target and reference encoding; the second run reuses every entry (both runs in the
    shared 2-process batch, tests/_train_fixtures.py)."""
    from _train_fixtures import batch_result

    run, again = batch_result(ddp_batch, "family-kontext-cached"), batch_result(ddp_batch,
                                                                                "family-kontext-cached-again")
    first, second = run["stats"], again["stats"]
    r0, r1 = read_trace(Path(run["out"]), 0), read_trace(Path(run["out"]), 1)
    assert first["global_step"] == 3 and [t["bucket"] for t in r0] == [t["bucket"] for t in r1]
    assert first["latents_encoded"] > 0 and np.isfinite(first["losses"]).all()
    assert second["latents_encoded"] == 0 and second["latents_reused"] == first["latents_encoded"]
    np.testing.assert_allclose(second["losses"], first["losses"], rtol=1e-6)


@pytest.mark.slow
def test_own_policy_cached_latents_match_the_on_the_fly_run(kontext_assets, tmp_path) -> None:
    """--reference_policy own: the references' own buckets and crops are in their cache keys; same losses."""
    argv = ["--pretrained_model_name_or_path", kontext_assets["model"], "--dataset_name", kontext_assets["pairs"],
            "--reference_image_column", "before", "--reference_policy", "own", *FLOW, "--rank", "4",
            "--max_train_steps", "4", "--checkpointing_steps", "100", "--bucket_leftover", "fill"]
    fly = run_script([*argv, "--output_dir", str(tmp_path / "fly")])
    cached = run_script([*argv, "--cache_latents", "--output_dir", str(tmp_path / "cached")])
    assert [t["rows"] for t in read_trace(tmp_path / "cached", 0)] == [t["rows"] for t in read_trace(tmp_path / "fly",
                                                                                                       0)]
    np.testing.assert_allclose(cached["losses"], fly["losses"], rtol=2e-3)  # float16 cache
