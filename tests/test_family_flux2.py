"""Flux.2 (dev: Flux2Pipeline, klein: Flux2KleinPipeline) through train_text_to_image_arb.py: detection apart from
Flux.1 (both directions), prompt encoding and latents equal to the stock pipelines', each bucket's ``mu`` equal
bit for bit to the pipeline's, the bucket step of the latent packing, and (slow) tiny runs: full fine-tune and
LoRA, an exact resume, cached prompt embeddings, validation images, and every output loaded and sampled at a non-square
trained bucket by stock diffusers without hf_arb.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _stock import job_result
from _train_fixtures import FLOW
from test_train import read_trace, run_script, script

from hf_arb.families import detect_family, get_family
from hf_arb.families.flux import FluxFamily
from hf_arb.families.flux2 import (
    Flux2DevFamily,
    Flux2KleinFamily,
    empirical_mu,
    latent_ids,
    normalize_latents,
    pack,
    patchify,
    text_ids,
    unpack,
    unpatchify,
)

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("flux2", "flux2_klein")


#: the tiny runs: FLOW's batches and buckets, 48 text tokens (the tiny chat templates + a caption fit)
ARGS = [*FLOW[:FLOW.index("--max_sequence_length")], "--max_sequence_length", "48",
        *FLOW[FLOW.index("--max_sequence_length") + 2:]]


def _pipeline_class(name: str) -> Any:
    import diffusers

    return getattr(diffusers, get_family(name).pipeline_class_name)


@pytest.fixture(scope="module")
def assets(family_assets) -> dict[str, str]:
    """The tiny Flux.2 pipelines of tests/conftest.py ``family_assets`` (shared with the 2-process batch)."""
    return family_assets


def _folder(root: Path, name: str, class_name: str, sub: str = "") -> str:
    folder = root / name
    (folder / sub).mkdir(parents=True, exist_ok=True)
    (folder / sub / ("config.json" if sub else "model_index.json")).write_text(json.dumps({"_class_name": class_name}))
    return str(folder)


# ------------------------------------------------------------------------------------------ fast: detection
def test_flux2_and_flux1_are_told_apart_in_both_directions(tmp_path):
    f2 = _folder(tmp_path, "a", "Flux2Pipeline")
    klein = _folder(tmp_path, "b", "Flux2KleinPipeline")
    f1 = _folder(tmp_path, "c", "FluxPipeline")
    kontext = _folder(tmp_path, "d", "FluxKontextPipeline")
    f2_transformer = _folder(tmp_path, "e", "Flux2Transformer2DModel", "transformer")
    f1_transformer = _folder(tmp_path, "f", "FluxTransformer2DModel", "transformer")
    assert [detect_family(p) for p in (f2, klein, f1, kontext, f2_transformer, f1_transformer)] == \
        ["flux2", "flux2_klein", "flux", "flux-kontext", "flux2", "flux"]  # Kontext: its own adapter, asked first
    for path in (f2, klein, f2_transformer, "black-forest-labs/FLUX.2-dev", "black-forest-labs/FLUX.2-klein-4B",
                 "someone/flux2-klein-base-9b-lora"):
        assert not FluxFamily.detect(path), path  # Flux.1's adapter alone never claims a Flux.2 checkpoint
    for path in (f1, kontext, f1_transformer, "black-forest-labs/FLUX.1-dev", "black-forest-labs/FLUX.1-schnell"):
        assert not Flux2DevFamily.detect(path) and not Flux2KleinFamily.detect(path), path
        assert FluxFamily.detect(path), path
    assert not Flux2DevFamily.detect(klein) and not Flux2KleinFamily.detect(f2)
    assert detect_family("black-forest-labs/FLUX.2-dev") == "flux2"
    assert detect_family("black-forest-labs/FLUX.2-klein-base-9B") == "flux2_klein"
    assert detect_family("black-forest-labs/FLUX.1-dev") == "flux"


def test_detection_does_not_import_torch(tmp_path):
    path = _folder(tmp_path, "a", "Flux2KleinPipeline")
    code = ("import sys; from hf_arb.families import detect_family, get_family; "
            f"f = get_family(detect_family({path!r})); print(f.name, f.title, f.defaults(True)['output_dir']); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "flux2_klein Flux.2 [klein] flux2_klein-model-finetuned-lora"


@pytest.mark.parametrize("flag, message", [
    (["--train_text_encoder"], "--train_text_encoder: Flux.2 .* stays frozen"),
    (["--packing"], "--packing is implemented for SD3 / Flux.1, not yet for Flux.2"),
    (["--snr_gamma", "5"], "--snr_gamma applies to SD 1.x/2.x/SDXL UNets, but .* is Flux.2"),
])
def test_flags_that_do_not_apply_are_refused_by_name(tmp_path, flag, message):
    path = _folder(tmp_path, "a", "Flux2Pipeline")
    with pytest.raises(script.UsageError, match=message):
        script.parse_args(["--pretrained_model_name_or_path", path, "--train_data_dir", "d", "--rank", "4", *flag])


def test_lora_targets_are_diffusers_flux2_defaults(tmp_path):
    args = script.parse_args(["--pretrained_model_name_or_path", _folder(tmp_path, "a", "Flux2KleinPipeline"),
                              "--train_data_dir", "d", "--rank", "4"])
    klein = get_family("flux2_klein").lora_targets(args)
    assert klein[:5] == ["to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj"]
    assert klein[-1] == "single_transformer_blocks.23.attn.to_out" and len(klein) == 5 + 24
    assert get_family("flux2").lora_targets(args)[-1] == "single_transformer_blocks.47.attn.to_out"
    args.lora_blocks = "0,3"
    assert get_family("flux2").lora_targets(args) == [f"transformer_blocks.{b}.attn.{m}" for b in (0, 3)
                                                      for m in ("to_k", "to_q", "to_v", "to_out.0")]


# ------------------------------------------------------------------------------------------ fast: parts
def test_tensor_layouts_round_trip():
    x = torch.randn(2, 4, 6, 10)
    assert patchify(x).shape == (2, 16, 3, 5) and torch.equal(unpatchify(patchify(x)), x)
    assert torch.equal(patchify(x)[0, 4 * 1 + 2 * 1 + 0, 2, 3], x[0, 1, 2 * 2 + 1, 2 * 3])  # channel, row, col
    assert torch.equal(unpack(pack(x), 6, 10), x) and pack(x).shape == (2, 60, 4)
    ids = latent_ids(2, 3, 5)
    assert ids.shape == (2, 15, 4) and ids[0, 7].tolist() == [0, 1, 2, 0]
    assert text_ids(1, 4)[0].tolist() == [[0, 0, 0, i] for i in range(4)]
    with pytest.raises(ValueError, match="not even"):
        patchify(torch.zeros(1, 4, 5, 6))


@pytest.mark.parametrize("name", VARIANTS)
def test_prompt_encoding_and_latents_equal_the_stock_pipelines(assets, name):
    family = get_family(name)
    pipe = _pipeline_class(name).from_pretrained(assets[name])
    captions = ["a red fox in the snow", "two cats, 3 dogs!"]
    embeds, pooled = family.encode_prompts([pipe.tokenizer], [pipe.text_encoder], captions, torch.device("cpu"), 40)
    ref, ref_ids = pipe.encode_prompt(captions, device="cpu", max_sequence_length=40)
    assert pooled is None and embeds.shape == (2, 40, 48)  # 3 stacked layers x 16 features
    assert torch.equal(embeds, ref) and torch.equal(text_ids(2, 40), ref_ids)
    alone, _ = family.encode_prompts([pipe.tokenizer], [pipe.text_encoder], captions[1:], torch.device("cpu"), 40)
    torch.testing.assert_close(alone[0], embeds[1], rtol=0, atol=1e-6)  # cacheable: a caption alone = in a batch
    # packing and ids: the pipeline's public prepare_latents draws the same noise and packs it (80 x 48 pixels)
    packed, ids = pipe.prepare_latents(2, 4, 48, 80, torch.float32, "cpu", torch.Generator().manual_seed(3))
    x = torch.randn(2, 16, 3, 5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(pack(x), packed) and torch.equal(latent_ids(2, 3, 5), ids)
    # the model space of an image: VAE mode, 2x2 patchify, batch-norm statistics (prepare_image_latents)
    image = torch.rand(1, 3, 48, 80, generator=torch.Generator().manual_seed(1)) * 2 - 1
    stock, _ = pipe.prepare_image_latents([image], 1, None, "cpu", torch.float32)
    with torch.no_grad():
        ours = pack(normalize_latents(patchify(pipe.vae.encode(image).latent_dist.mean), pipe.vae))
    assert float(pipe.vae.bn.running_mean.abs().max()) > 0  # the tiny VAE's statistics are not the identity
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-6)


SIZES = [(80, 48), (48, 96), (1344, 768), (768, 1344), (1024, 1024), (2048, 1152), (1152, 2048)]  # (width, height)


def test_each_buckets_mu_is_the_pipelines_bit_for_bit(assets):
    """mu per bucket = compute_empirical_mu on the pipeline's own image_seq_len; training sigmas = its scheduler's."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    family = get_family("flux2_klein")
    pipe = _pipeline_class("flux2_klein").from_pretrained(assets["flux2_klein"])
    sched = FlowMatchEulerDiscreteScheduler.from_pretrained(assets["flux2_klein"], subfolder="scheduler")
    options = family.options(sched.config, pipe.transformer)
    assert options.by_resolution and options.token_patch == 2 and not options.guidance_embeds
    steps = family.mu_reference_steps
    assert steps == 50  # the pipelines' default num_inference_steps
    t = np.linspace(1.0, 1 / 8, 8)
    for w, h in SIZES:
        seq = pipe.prepare_latents(1, 4, h, w, torch.float32, "cpu", torch.Generator().manual_seed(0))[0].shape[1]
        mu = compute_empirical_mu(image_seq_len=seq, num_steps=steps)
        assert family.bucket_mu(w, h) == mu and empirical_mu(seq, steps) == mu, (w, h)
        sched.set_timesteps(sigmas=t, mu=mu)
        ours = family.batch_sigmas(torch.tensor(t, dtype=torch.float32), (h // 16, w // 16), options)
        torch.testing.assert_close(ours, sched.sigmas[:-1], rtol=1e-6, atol=1e-7, msg=f"{w}x{h}")
    assert family.bucket_mu(1344, 768) != family.bucket_mu(1024, 1024)  # mu does depend on the bucket
    static = family.options(sched.config, pipe.transformer, shift_by_resolution=False)
    ts = torch.rand(16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(family.batch_sigmas(ts, (3, 5), static), ts)  # unshifted, as diffusers' script


def test_bucket_step_follows_the_latent_packing(assets, tmp_path):
    argv = ["--pretrained_model_name_or_path", assets["flux2_klein"], "--train_data_dir", assets["images"],
            "--output_dir", str(tmp_path), *ARGS, "--full_finetune", "--max_train_steps", "1"]
    argv[argv.index("--bucket_step") + 1] = "8"  # buckets like 56x72: latents 7x9 cannot be patchified
    with pytest.raises(script.UsageError, match=r"not divisible by 16 .*For this Flux.2 \[klein\] model: "
                                                r"--bucket_step 16"):
        script.main(argv)


# ------------------------------------------------------------------------------------------ slow: tiny runs
def _runs(assets: dict[str, str], root: Path) -> dict[str, Any]:
    """Per variant: a full fine-tune (4 steps, checkpoint at 2), its resume from checkpoint-2, and a LoRA run with
    cached prompt embeddings (dev: with validation); klein also the LoRA run without that cache, and one with cached
    latents too."""
    out: dict[str, Any] = {}

    def run(key: str, argv: list[str]) -> None:
        stats = run_script(argv)
        out[key] = {"dir": argv[argv.index("--output_dir") + 1], "log": stats["log"], "losses": stats["losses"]}

    for name in VARIANTS:
        base = ["--pretrained_model_name_or_path", assets[name], "--train_data_dir", assets["images"], *ARGS]
        full = [*base, "--full_finetune", "--learning_rate", "1e-3", "--max_train_steps", "4",
                "--checkpointing_steps", "2", "--weighting_scheme", "logit_normal"]
        run(f"{name}-full", [*full, "--output_dir", str(root / f"{name}-full")])
        resumed = root / f"{name}-resumed"
        shutil.copytree(root / f"{name}-full" / "checkpoint-2", resumed / "checkpoint-2")
        run(f"{name}-resumed", [*full, "--output_dir", str(resumed), "--resume_from_checkpoint", "latest"])
        lora = [*base, "--rank", "4", "--learning_rate", "2e-2", "--max_train_steps", "3", "--checkpointing_steps",
                "100"]
        validation = ["--validation_prompts", "a cat", "--num_validation_images", "1",
                      "--num_validation_inference_steps", "1"] if name == "flux2" else []
        run(f"{name}-lora", [*lora, "--cache_text_embeddings", *validation, "--output_dir",
                             str(root / f"{name}-lora")])
        if name == "flux2_klein":
            run(f"{name}-lora-nocache", [*lora, "--output_dir", str(root / f"{name}-lora-nocache")])
            run(f"{name}-lora-latents", [*lora, "--cache_text_embeddings", "--cache_latents", "--output_dir",
                                         str(root / f"{name}-lora-latents")])
    return out


@pytest.fixture(scope="module")
def runs(assets, shared_artifact) -> dict[str, Any]:
    return shared_artifact("flux2-runs", lambda root: _runs(assets, root))


def _weights(folder: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "transformer" / "diffusion_pytorch_model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("name", VARIANTS)
def test_full_fine_tune_trains_non_square_buckets_and_resumes_exactly(runs, name):
    full, resumed = runs[f"{name}-full"], runs[f"{name}-resumed"]
    trace = read_trace(Path(full["dir"]), 0)
    assert [t["step"] for t in trace] == [0, 1, 2, 3]
    assert any(t["shape"][2] != t["shape"][3] for t in trace)  # a non-square bucket was trained
    again = read_trace(Path(resumed["dir"]), 0)
    assert [(t["step"], t["rows"], t["loss"]) for t in again] == [(t["step"], t["rows"], t["loss"])
                                                                  for t in trace if t["step"] >= 2]
    a, b = _weights(full["dir"]), _weights(resumed["dir"])
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    ckpt = _weights(Path(full["dir"]) / "checkpoint-2")
    assert any(not torch.equal(ckpt[k], a[k]) for k in a)  # steps 3-4 did change the weights
    index = json.loads((Path(full["dir"]) / "model_index.json").read_text())
    assert index["_class_name"] == get_family(name).pipeline_class_name


@pytest.mark.slow
@pytest.mark.parametrize("name", VARIANTS)
def test_startup_report_shows_each_buckets_pipeline_mu(runs, name):
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    log = runs[f"{name}-full"]["log"]
    assert "Resolution shift: per bucket (mu = the Flux.2" in log
    rows = [line.split() for line in log.split("sigma(0.5)", 1)[1].splitlines()[1:10]]
    for _, w, h, seq, mu, _ in rows:
        assert int(seq) == (int(h) // 16) * (int(w) // 16)
        assert abs(float(mu) - compute_empirical_mu(int(seq), 50)) < 1e-4


@pytest.mark.slow
def test_lora_targets_validation_and_the_caches(runs):
    from PIL import Image
    from safetensors.torch import load_file

    for name in VARIANTS:
        weights = load_file(str(Path(runs[f"{name}-lora"]["dir"]) / "pytorch_lora_weights.safetensors"))
        assert weights and all(k.startswith("transformer.") and ".lora_" in k for k in weights), name
        assert any("to_qkv_mlp_proj" in k for k in weights) and any("single_transformer_blocks.0.attn.to_out" in k
                                                                    for k in weights), name
    grid = Path(runs["flux2-lora"]["dir"]) / "validation" / "final-000003.png"
    assert Image.open(grid).size == (48 + 64 + 80, 80)  # the stock pipeline at portrait, square, landscape buckets
    cached, fresh = runs["flux2_klein-lora"], runs["flux2_klein-lora-nocache"]
    np.testing.assert_allclose(cached["losses"], fresh["losses"], rtol=1e-5)  # memoised embeddings = fresh ones
    latents = runs["flux2_klein-lora-latents"]  # the posterior cached (float16) instead of encoded each step
    assert [t["rows"] for t in read_trace(Path(latents["dir"]), 0)] == [t["rows"] for t in
                                                                        read_trace(Path(cached["dir"]), 0)]
    np.testing.assert_allclose(latents["losses"], cached["losses"], rtol=2e-3)


STOCK = r"""
import json, sys
sys.modules["hf_arb"] = None
import numpy as np, torch, diffusers
results = {}
for name, (cls, folder, base) in json.loads(sys.argv[1]).items():
    pipe = getattr(diffusers, cls).from_pretrained(base or folder)
    if base:
        pipe.load_lora_weights(folder)
    def gen():
        return pipe(prompt="a wide photo", height=48, width=80, num_inference_steps=2, output_type="np",
                    max_sequence_length=48, generator=torch.Generator().manual_seed(0)).images
    a = gen()
    r = {"cls": type(pipe).__name__, "shape": list(a.shape), "finite": bool(np.isfinite(a).all())}
    if base:
        pipe.unload_lora_weights()
        r["lora_changes_output"] = float(np.abs(a - gen()).max())
    results[name] = r
print("RESULT" + json.dumps(results))
"""


@pytest.mark.slow
def test_outputs_load_and_generate_in_stock_diffusers_without_hf_arb(assets, runs):
    jobs = {}
    for name in VARIANTS:
        cls = get_family(name).pipeline_class_name
        jobs[name] = (cls, runs[f"{name}-full"]["dir"], None)
        jobs[f"{name}-lora"] = (cls, runs[f"{name}-lora"]["dir"], assets[name])
        card = (Path(runs[f"{name}-lora"]["dir"]) / "README.md").read_text()
        assert f"{cls}.from_pretrained" in card and "load_lora_weights" in card and "import hf_arb" not in card
    results = job_result(STOCK, [json.dumps(jobs)])  # tests/_stock.py: hf_arb blocked
    for key, r in results.items():
        assert r["shape"] == [1, 48, 80, 3] and r["finite"], key  # 80 x 48: a trained non-square bucket
        assert r["cls"] == jobs[key][0], key
    assert results["flux2-lora"]["lora_changes_output"] > 0 and results["flux2_klein-lora"]["lora_changes_output"] > 0


# ------------------------------------------------------------------------------------------ slow: 2 processes
@pytest.fixture(scope="module")
def ddp_run(ddp_batch) -> dict[str, Any]:
    """Klein on 2 processes, from the shared 2-process batch (tests/_train_fixtures.py)."""
    from _train_fixtures import batch_result

    run = batch_result(ddp_batch, "family-flux2-klein")
    return {"dir": run["out"], "num_processes": run["stats"]["num_processes"], "family": run["stats"]["family"]}


@pytest.mark.slow
def test_two_processes_train_the_same_bucket_at_every_step(ddp_run):
    out = Path(ddp_run["dir"])
    r0, r1 = read_trace(out, 0), read_trace(out, 1)
    assert [t["step"] for t in r0] == [t["step"] for t in r1] == [0, 1, 2]
    assert [t["bucket"] for t in r0] == [t["bucket"] for t in r1]
    assert [t["shape"] for t in r0] == [t["shape"] for t in r1]
    for a, b in zip(r0, r1):
        assert not set(a["rows"]) & set(b["rows"])  # each rank its own rows
    assert ddp_run["num_processes"] == 2 and ddp_run["family"] == "flux2_klein"
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == "Flux2KleinPipeline"
