"""Quantized training (issue 35): ``--do_fp8_training`` (torchao FP8, runs on the CPU too) and
``--bnb_quantization_config_path`` (bitsandbytes QLoRA; diffusers' quantizer needs a GPU), with upstream's meaning
(diffusers' train_dreambooth_lora_flux2 / _qwen_image / _z_image scripts): upstream's FP8 module filter, the JSON
config → ``BitsAndBytesConfig`` with the mixed-precision compute dtype, the transformer's ``from_pretrained`` keywords
reaching every flow family's loader, LoRA on a quantized transformer keeping its dtypes, and every refusal in one
line before a model loads. Slow: FP8 LoRA and full fine-tune runs whose outputs load in stock diffusers; on a CUDA
machine with bitsandbytes, a QLoRA run."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import warnings
from pathlib import Path

import pytest
import torch
from _stock import job_result
from _train_fixtures import FLOW
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_train import run_script

import train_text_to_image_arb as script
from hf_arb.families import get_family
from hf_arb.train import quantization
from hf_arb.train.flags import quant_flags

SD, FLUX, KLEIN, QWEN = "m", "black-forest-labs/FLUX.1-dev", "black-forest-labs/FLUX.2-klein-4B", "Qwen/Qwen-Image"
#: upstream's README config (README_hidream.md): 4-bit NF4
NF4 = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed")


def parse(model: str, *extra: str):
    mode = [] if any(f in extra for f in ("--rank", "--full_finetune")) else ["--rank", "4"]
    return script.parse_args(["--pretrained_model_name_or_path", model, "--train_data_dir", "d", "--report_to", "none",
                              *mode, *extra])


@pytest.fixture
def nf4(tmp_path) -> str:
    path = tmp_path / "nf4.json"
    path.write_text(json.dumps(NF4))
    return str(path)


@pytest.fixture
def cuda(monkeypatch):
    """A CUDA machine as the flag checks see it (nothing loads on the device here)."""
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100")


def _installed(monkeypatch, **present: bool) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (real("json") if present[name] else None) if name in present
                        else real(name, *a))


# ------------------------------------------------------------------------------------------ FP8: upstream's filter
NAMES = ["proj_out", "x_embedder", "transformer_blocks.0.proj_out", "single_transformer_blocks.0.attn.to_out"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 80), st.integers(1, 80), st.sampled_from(NAMES))
def test_the_fp8_filter_is_upstreams_rule(fan_in, fan_out, fqn):
    """Not the output projection (the top-level ``proj_out`` only), not a linear layer with a side that is not a
    multiple of 16; anything else converts (torchao itself converts only linear layers)."""
    linear = torch.nn.Linear(fan_in, fan_out)
    expected = fqn != "proj_out" and fan_in % 16 == 0 and fan_out % 16 == 0
    assert quantization.fp8_module_filter(linear, fqn) is expected
    assert quantization.fp8_module_filter(torch.nn.LayerNorm(4), fqn) is (fqn != "proj_out")


@needs_torchao
def test_fp8_converts_the_filtered_linear_layers_and_keeps_every_name(family_assets):
    transformer = get_family("flux2_klein").load(family_assets["flux2_klein"]).transformer
    names = {n: (m.in_features, m.out_features) for n, m in transformer.named_modules()
             if type(m) is torch.nn.Linear}
    keys = set(transformer.state_dict())
    line = quantization.quantize_transformer(argparse.Namespace(do_fp8_training=True), transformer)
    plain = {n for n, m in transformer.named_modules() if type(m) is torch.nn.Linear}
    converted = {n for n, m in transformer.named_modules() if n in names and type(m) is not torch.nn.Linear}
    assert plain == {n for n, (i, o) in names.items() if n == "proj_out" or i % 16 or o % 16} == {"proj_out"}
    assert converted == set(names) - {"proj_out"}
    assert all(isinstance(transformer.get_submodule(n), torch.nn.Linear) for n in converted)  # peft's LoRA wraps it
    assert set(transformer.state_dict()) == keys  # the saved LoRA / transformer loads in stock diffusers
    assert line.startswith(f"FP8 training (torchao): {len(converted)} of the transformer's {len(names)} linear")


# ------------------------------------------------------------------------------------------ bitsandbytes: the config
def test_the_json_becomes_bitsandbytes_arguments_with_the_mixed_precision_compute_dtype(caplog):
    """Upstream: ``bnb_4bit_compute_dtype = weight_dtype`` for 4-bit (the file's own value is replaced, and said)."""
    assert quantization.bnb_config_kwargs(NF4, torch.bfloat16) == {**NF4, "bnb_4bit_compute_dtype": torch.bfloat16}
    assert quantization.bnb_config_kwargs({"load_in_8bit": True}, torch.bfloat16) == {"load_in_8bit": True}
    with caplog.at_level(logging.WARNING, logger="train_text_to_image_arb"):
        out = quantization.bnb_config_kwargs({**NF4, "bnb_4bit_compute_dtype": "float16"}, torch.bfloat16)
    assert out["bnb_4bit_compute_dtype"] == torch.bfloat16
    assert "bnb_4bit_compute_dtype float16 in --bnb_quantization_config_path is replaced by the mixed-precision " \
           "dtype bfloat16" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="train_text_to_image_arb"):
        quantization.bnb_config_kwargs({**NF4, "bnb_4bit_compute_dtype": "bfloat16"}, torch.bfloat16)
    assert caplog.records == []


def test_the_transformer_loads_with_a_bitsandbytes_config_and_the_weight_dtype(tmp_path, nf4):
    eight = tmp_path / "int8.json"
    eight.write_text('{"load_in_8bit": true, "llm_int8_threshold": 5.0}')
    kw = quantization.transformer_load_kwargs(argparse.Namespace(bnb_quantization_config_path=str(eight)), None)
    config = kw["quantization_config"]
    assert type(config).__name__ == "BitsAndBytesConfig" and config.load_in_8bit and not config.load_in_4bit
    assert config.llm_int8_threshold == 5.0 and kw["torch_dtype"] == torch.float32
    assert quantization.transformer_load_kwargs(argparse.Namespace(bnb_quantization_config_path=None), None) == {}
    if importlib.util.find_spec("bitsandbytes"):  # diffusers reads bitsandbytes' version for a 4-bit config
        kw = quantization.transformer_load_kwargs(argparse.Namespace(bnb_quantization_config_path=nf4),
                                                  torch.bfloat16)
        config = kw["quantization_config"]
        assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4"
        assert config.bnb_4bit_compute_dtype == torch.bfloat16 == kw["torch_dtype"]


@pytest.mark.parametrize("text, message", [
    (None, "cannot read it"),
    ("{load_in_4bit: true}", "not valid JSON (Expecting property name enclosed in double quotes at line 1"),
    ('[{"load_in_4bit": true}]', "holds a JSON list, not an object of BitsAndBytesConfig arguments"),
    ('{"load_in_4bits": true}', "BitsAndBytesConfig takes no 'load_in_4bits' (it takes load_in_8bit, load_in_4bit"),
    ('{"bnb_4bit_quant_type": "nf4"}', "sets neither of load_in_4bit and load_in_8bit to true"),
    ('{"load_in_4bit": true, "load_in_8bit": true}', "sets both of load_in_4bit and load_in_8bit to true"),
])
def test_a_bad_config_file_is_named_with_its_fix(tmp_path, text, message):
    path = tmp_path / "q.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(script.UsageError) as err:
        quant_flags.read_bnb_config(path)
    assert str(err.value).startswith(f"--bnb_quantization_config_path {path}: ") and message in str(err.value)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------ loading quantized
#: every flow family's own loader (the others inherit one of these)
LOADERS = [("flux2_klein", "family"), ("qwen", "family"), ("qwen_edit", "family"), ("zimage", "family"),
           ("flux", "flow"), ("sd3", "flow")]


@pytest.mark.parametrize("name, where", LOADERS)
def test_the_transformers_from_pretrained_keywords_reach_every_loader(name, where, request):
    assets = request.getfixturevalue(f"{where}_assets")
    family = get_family({"qwen": "qwenimage", "qwen_edit": "qwenimage-edit"}.get(name, name))
    parts = family.load(assets[name], transformer_kw={"torch_dtype": torch.bfloat16})
    assert parts.transformer.dtype == torch.bfloat16  # the keywords reached the transformer ...
    assert {p.dtype for p in parts.text_encoders[0].parameters()} == {torch.float32}  # ... and only it


@needs_torchao
def test_lora_on_a_quantized_transformer_keeps_its_dtypes(family_assets):
    """QLoRA: a quantized model refuses any dtype cast (diffusers raises), so the adapters go on as it loaded. A
    torchao int8 config stands in for bitsandbytes here: diffusers' bitsandbytes quantizer needs a GPU."""
    from diffusers import TorchAoConfig
    from torchao.quantization import Int8WeightOnlyConfig

    from hf_arb.train.lora import add_lora

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = TorchAoConfig(Int8WeightOnlyConfig())
        transformer = get_family("flux2_klein").load(family_assets["flux2_klein"], transformer_kw={
            "quantization_config": config, "torch_dtype": torch.bfloat16}).transformer
    assert transformer.is_quantized
    params = add_lora(transformer, rank=4, target_modules=["to_q", "to_k"], dtype=torch.float32)
    assert params and {p.dtype for p in params} == {torch.float32} and transformer.dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------ refusals, one line each
def test_fp8_is_accepted_on_the_cpu_and_refused_where_it_cannot_run(monkeypatch, cuda):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    if importlib.util.find_spec("torchao"):
        assert parse(KLEIN, "--do_fp8_training").do_fp8_training
        assert parse(QWEN, "--full_finetune", "--learning_rate", "1e-5", "--do_fp8_training").do_fp8_training
    monkeypatch.delenv("ACCELERATE_USE_CPU")
    _installed(monkeypatch, torchao=True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    with pytest.raises(script.UsageError, match=r"^--do_fp8_training trains with FP8 matmuls, which need a GPU of "
                                                r"compute capability 8\.9 or newer .*NVIDIA A100 is 8\.0\. Drop "
                                                r"--do_fp8_training\.$"):
        parse(KLEIN, "--do_fp8_training")
    _installed(monkeypatch, torchao=False)
    with pytest.raises(script.UsageError, match=r"^--do_fp8_training needs torchao, which is not installed: pip "
                                                r"install torchao"):
        parse(KLEIN, "--do_fp8_training")


def test_bitsandbytes_is_refused_on_the_cpu_naming_the_gpu(monkeypatch, nf4):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    with pytest.raises(script.UsageError, match=rf"^--bnb_quantization_config_path {nf4} loads the transformer "
                                                r"4/8-bit with bitsandbytes, and diffusers' bitsandbytes quantizer "
                                                r"needs a CUDA GPU; this machine has none\. Drop "):
        parse(KLEIN, "--bnb_quantization_config_path", nf4)


def test_bitsandbytes_on_a_gpu_needs_the_library_and_a_good_file(monkeypatch, cuda, nf4, tmp_path):
    _installed(monkeypatch, bitsandbytes=False)
    with pytest.raises(script.UsageError, match=r"needs bitsandbytes, which is not installed: pip install "
                                                r"bitsandbytes"):
        parse(KLEIN, "--bnb_quantization_config_path", nf4)
    _installed(monkeypatch, bitsandbytes=True)
    assert parse(KLEIN, "--bnb_quantization_config_path", nf4).bnb_quantization_config_path == nf4
    with pytest.raises(script.UsageError, match="cannot read it"):  # before any model loads
        parse(KLEIN, "--bnb_quantization_config_path", str(tmp_path / "missing.json"))


@pytest.mark.parametrize("model, extra, message", [
    (KLEIN, ["--do_fp8_training", "--bnb_quantization_config_path", "q.json"],
     "^--do_fp8_training and --bnb_quantization_config_path are two ways of quantizing the transformer"),
    (SD, ["--do_fp8_training"], r"^--do_fp8_training quantizes a diffusion transformer .*SD trains a UNet\. Drop "
                                r"--do_fp8_training\.$"),
    (SD, ["--bnb_quantization_config_path", "q.json"], "^--bnb_quantization_config_path q.json quantizes a diffusion "
                                                       "transformer"),
    (FLUX, ["--full_finetune", "--learning_rate", "1e-5", "--bnb_quantization_config_path", "q.json"],
     "quantized weights cannot be fine-tuned: train LoRA on it \\(QLoRA\\) with --rank N"),
])
def test_a_quantization_flag_that_cannot_apply_is_refused(cuda, model, extra, message):
    with pytest.raises(script.UsageError, match=message) as err:
        parse(model, *extra)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------ slow: real runs
ARGS = [*FLOW[:FLOW.index("--max_sequence_length")], "--max_sequence_length", "48",
        *FLOW[FLOW.index("--max_sequence_length") + 2:]]

STOCK = r"""
import json, sys
sys.modules["hf_arb"] = None
import numpy as np, torch, diffusers
results = {}
for name, (cls, folder, base) in json.loads(sys.argv[1]).items():
    pipe = getattr(diffusers, cls).from_pretrained(base or folder)
    r = {"linear": sorted({type(m).__name__ for m in pipe.transformer.modules() if isinstance(m, torch.nn.Linear)})}
    if base:  # (weight_name: diffusers 0.37, the floor, guesses no file name offline)
        pipe.load_lora_weights(folder, weight_name="pytorch_lora_weights.safetensors")
    def gen():
        return pipe(prompt="a wide photo", height=48, width=80, num_inference_steps=2, output_type="np",
                    max_sequence_length=48, generator=torch.Generator().manual_seed(0)).images
    a = gen()
    r.update(shape=list(a.shape), finite=bool(np.isfinite(a).all()))
    if base:
        pipe.unload_lora_weights()
        r["lora_changes_output"] = float(np.abs(a - gen()).max())
    results[name] = r
print("RESULT" + json.dumps(results))
"""


@pytest.fixture(scope="module")
def fp8_runs(family_assets, tmp_path_factory) -> dict[str, dict]:
    """Klein: FP8 LoRA (3 steps) and FP8 full fine-tune (3 steps, checkpoint at 2)."""
    root = tmp_path_factory.mktemp("fp8")
    base = ["--pretrained_model_name_or_path", family_assets["flux2_klein"], "--train_data_dir",
            family_assets["images"], *ARGS, "--max_train_steps", "3", "--checkpointing_steps", "2",
            "--do_fp8_training"]
    out = {}
    for name, mode in (("lora", ["--rank", "4", "--learning_rate", "2e-2"]),
                       ("full", ["--full_finetune", "--learning_rate", "1e-3"])):
        stats = run_script([*base, *mode, "--output_dir", str(root / name)])
        out[name] = {"dir": str(root / name), "losses": stats["losses"]}
    return out


@pytest.mark.slow
@needs_torchao
def test_fp8_lora_and_full_fine_tune_train_and_load_in_stock_diffusers(fp8_runs, family_assets):
    from safetensors.torch import load_file

    for name, run in fp8_runs.items():
        assert len(run["losses"]) == 3 and all(0 < x < 10 for x in run["losses"]), name
    lora = load_file(str(Path(fp8_runs["lora"]["dir"]) / "pytorch_lora_weights.safetensors"))
    assert lora and all(k.startswith("transformer.") and ".lora_" in k for k in lora)
    assert (Path(fp8_runs["full"]["dir"]) / "checkpoint-2" / "transformer").is_dir()
    for run in fp8_runs.values():  # the card says so, as upstream's ("Quant training? FP8 TorchAO")
        assert "* quantized training: FP8 (torchao)" in (Path(run["dir"]) / "README.md").read_text()
    jobs = {"lora": ("Flux2KleinPipeline", fp8_runs["lora"]["dir"], family_assets["flux2_klein"]),
            "full": ("Flux2KleinPipeline", fp8_runs["full"]["dir"], None)}
    results = job_result(STOCK, [json.dumps(jobs)])  # hf_arb and torchao's layers absent: plain Linear
    for key, r in results.items():
        assert r["shape"] == [1, 48, 80, 3] and r["finite"] and r["linear"] == ["Linear"], key
    assert results["lora"]["lora_changes_output"] > 0


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("bitsandbytes") is None,
                    reason="QLoRA: diffusers' bitsandbytes quantizer needs a CUDA GPU and bitsandbytes")
def test_qlora_trains_on_a_4bit_transformer_and_loads_in_stock_diffusers(family_assets, tmp_path, nf4):
    out = tmp_path / "qlora"
    stats = run_script(["--pretrained_model_name_or_path", family_assets["flux2_klein"], "--train_data_dir",
                        family_assets["images"], *ARGS, "--rank", "4", "--learning_rate", "2e-2", "--max_train_steps",
                        "3", "--checkpointing_steps", "2", "--mixed_precision", "bf16",
                        "--bnb_quantization_config_path", nf4, "--output_dir", str(out)])
    assert len(stats["losses"]) == 3 and all(0 < x < 10 for x in stats["losses"])
    assert (out / "checkpoint-2" / "pytorch_lora_weights.safetensors").is_file()
    assert "* quantized training: bitsandbytes" in (out / "README.md").read_text()
    jobs = {"lora": ("Flux2KleinPipeline", str(out), family_assets["flux2_klein"])}
    result = job_result(STOCK, [json.dumps(jobs)])["lora"]
    assert result["finite"] and result["lora_changes_output"] > 0
