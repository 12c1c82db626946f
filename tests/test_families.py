"""The model-family registry and adapters: detection without torch, the adapters' answers, and a family registered
from this test module that trains through the unchanged script (issue #25: adding a family edits no script)."""

from __future__ import annotations

import importlib
import json
import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _train_fixtures import SD_BASE
from test_train import run_script, script

import hf_arb.families as families
from hf_arb.families import FLOW_FAMILIES, Family, detect_family, family_names, get_family, register_family
from hf_arb.families.base import unregister_family
from hf_arb.families.sd import SDFamily

ROOT = Path(__file__).resolve().parent.parent


def test_builtin_families_are_detected_from_their_files_and_hub_names(train_assets, flow_assets):
    assert family_names()[-1] == "sd"  # the fallback is asked last
    assert detect_family(train_assets["sd"]) == "sd" and detect_family(train_assets["sdxl"]) == "sdxl"
    assert detect_family(flow_assets["sd3"]) == "sd3" and detect_family(flow_assets["flux"]) == "flux"
    assert detect_family("stabilityai/stable-diffusion-xl-base-1.0") == "sdxl"
    assert detect_family("black-forest-labs/FLUX.1-schnell") == "flux"
    assert detect_family("some-org/unknown-model") == "sd"
    assert {get_family(n).denoiser_name for n in FLOW_FAMILIES} == {"transformer"}


def test_flow_families_are_the_registered_flow_adapters():
    """FLOW_FAMILIES is derived from the registry (each adapter's objective), not kept by hand: it holds every
    flow-matching adapter (the edit models too), a plugin's as soon as it registers, and no UNet family."""
    from hf_arb.families import flow_families
    from hf_arb.families.flow_family import FlowFamily
    from hf_arb.families.sd3 import SD3Family

    flow = {n for n in family_names() if isinstance(get_family(n), FlowFamily)}
    assert set(FLOW_FAMILIES) == flow >= {"qwenimage-edit", "qwenimage-edit-plus", "flux-kontext", "sd3"}
    assert {get_family(n).objective for n in family_names()} == {"flow", "noise"}

    class PluginFlow(SD3Family):
        name = "sd3-plugin"

    register_family(PluginFlow)
    try:
        assert "sd3-plugin" in flow_families() and "sd3-plugin" in families.FLOW_FAMILIES
    finally:
        unregister_family("sd3-plugin")
    assert "sd3-plugin" not in flow_families()


#: each tiny builder of hf_arb.testing (name, keyword arguments), the fixture and key of its saved model, and its family
BUILDERS = [("save_tiny_sd", {}, "train_assets", "sd", "sd"), ("save_tiny_sdxl", {}, "train_assets", "sdxl", "sdxl"),
            ("save_tiny_sd3", {}, "flow_assets", "sd3", "sd3"), ("save_tiny_flux", {}, "flow_assets", "flux", "flux"),
            ("save_tiny_flux_kontext", {}, "family_assets", "kontext", "flux-kontext"),
            ("save_tiny_flux2", {}, "family_assets", "flux2", "flux2"),
            ("save_tiny_flux2", {"klein": True}, "family_assets", "flux2_klein", "flux2_klein"),
            ("save_tiny_qwenimage", {}, "family_assets", "qwen", "qwenimage"),
            ("save_tiny_qwenimage_edit", {}, "family_assets", "qwen_edit", "qwenimage-edit"),
            ("save_tiny_qwenimage_edit", {"plus": True}, "family_assets", "qwen_edit_plus", "qwenimage-edit-plus"),
            ("save_tiny_zimage", {}, "family_assets", "zimage", "zimage"),
            ("save_tiny_wan", {}, "family_assets", "wan", "wan"), ("save_tiny_ltx", {}, "family_assets", "ltx", "ltx"),
            ("save_tiny_hunyuan_video", {}, "family_assets", "hyv", "hunyuan_video15")]
#: Hub ids and the family each means
HUB_IDS = {"stabilityai/stable-diffusion-xl-base-1.0": "sdxl", "runwayml/stable-diffusion-v1-5": "sd",
           "stabilityai/stable-diffusion-3.5-large": "sd3", "black-forest-labs/FLUX.1-dev": "flux",
           "black-forest-labs/FLUX.1-Kontext-dev": "flux-kontext", "black-forest-labs/FLUX.2-dev": "flux2",
           "black-forest-labs/FLUX.2-klein-4B": "flux2_klein", "Qwen/Qwen-Image": "qwenimage",
           "Qwen/Qwen-Image-Edit": "qwenimage-edit", "Qwen/Qwen-Image-Edit-2509": "qwenimage-edit-plus",
           "Qwen/Qwen-Image-Edit-2511": "qwenimage-edit-plus", "Tongyi-MAI/Z-Image-Turbo": "zimage",
           "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": "wan", "Wan-AI/Wan2.2-TI2V-5B-Diffusers": "wan",
           "Lightricks/LTX-Video": "ltx", "hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v": "hunyuan_video15"}


def test_every_builder_is_detected_as_exactly_its_family_whatever_the_order(request, monkeypatch):
    """Detection does not depend on BUILTIN_MODULES' order: for the saved model of every tiny builder in
    hf_arb.testing and for the Hub ids, exactly one built-in family (or none, for the SD fallback) claims it."""
    import inspect

    import hf_arb.testing as testing
    from hf_arb.families import base
    from hf_arb.families.base import claiming_families

    builders = {name for info in pkgutil.iter_modules(testing.__path__)
                for name, fn in inspect.getmembers(importlib.import_module(f"hf_arb.testing.{info.name}"),
                                                   inspect.isfunction)
                if name.startswith("save_tiny_") and name != "save_tiny_imagefolder"}
    assert builders == {b[0] for b in BUILDERS}, "add the new builder to BUILDERS"
    fallback = family_names()[-1]
    seen = set()
    for builder, kwargs, fixture, key, family in BUILDERS:
        path = request.getfixturevalue(fixture)[key]
        assert claiming_families(path) == ([] if family == fallback else [family]), (builder, kwargs)
        assert detect_family(path) == family
        seen.add(family)
    for hub_id, family in HUB_IDS.items():
        assert claiming_families(hub_id) == ([] if family == fallback else [family]), hub_id
        assert detect_family(hub_id) == family
    assert seen == set(family_names()) == set(HUB_IDS.values())  # every built-in family has a builder
    order = base.BUILTIN_MODULES
    monkeypatch.setattr(base, "BUILTIN_MODULES", (*order[-2::-1], order[-1]))  # reversed, the fallback still last
    assert family_names() != list(reversed(family_names()))
    assert [detect_family(request.getfixturevalue(b[2])[b[3]]) for b in BUILDERS] == [b[4] for b in BUILDERS]
    assert [detect_family(hub_id) for hub_id in HUB_IDS] == list(HUB_IDS.values())


def test_detection_and_flag_defaults_do_not_import_torch(train_assets):
    """--help, flag errors and family detection answer before torch (seconds to import) is loaded."""
    code = ("import sys; from hf_arb.families import detect_family, get_family; "
            f"f = get_family(detect_family({train_assets['sdxl']!r})); print(f.name, f.defaults(False)['resolution']); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["sdxl", "1024"]


def test_unknown_family_and_bad_registration_are_refused():
    known = ", ".join(family_names())  # every registered family, the fallback last
    assert known.startswith("sd3, flux2_klein, flux2, ") and known.endswith(", wan, ltx, hunyuan_video15, sdxl, sd")
    with pytest.raises(ValueError, match=f"Unknown model family 'nope'; known: {re.escape(known)}\\."):
        get_family("nope")
    with pytest.raises(TypeError, match="Family subclass with a `name`"):
        register_family(type("Nameless", (Family,), {}))
    with pytest.raises(TypeError, match="Family subclass"):
        register_family(dict)  # type: ignore[arg-type]


def test_every_family_refuses_the_other_objectives_flags():
    for name in family_names():
        family = get_family(name)
        assert family.refused_flags, name
        assert not set(family.refused_flags) & {"train_batch_size", "learning_rate", "resolution"}, name
    assert "snr_gamma" in get_family("flux").refused_flags and "weighting_scheme" in get_family("sdxl").refused_flags


MARKER = "HF_ARB_TEST_FAMILY"


class CountingSD(SDFamily):
    """A family defined outside hf_arb: SD with its own detection rule, card tag and a loss that counts calls."""

    name = "sd-counting"
    card_tags = ("sd-counting-test",)
    losses: list[float] = []

    @classmethod
    def detect(cls, path: str) -> bool:
        return (Path(path) / MARKER).exists()

    def training_loss(self, args: Any, models: Any, denoiser: Any, batch: Any, text: Any, generator: Any,
                      dtype: Any) -> Any:
        loss = super().training_loss(args, models, denoiser, batch, text, generator, dtype)
        CountingSD.losses.append(float(loss.detach()))
        return loss


@pytest.mark.slow
def test_a_family_registered_from_a_test_module_trains_through_the_script(train_assets, tmp_path):
    """Registering an adapter is all it takes: the script detects it, asks it for the loss and the card, and the
    output loads in stock diffusers."""
    from diffusers import StableDiffusionPipeline

    model = tmp_path / "model"
    shutil.copytree(train_assets["sd"], model)
    (model / MARKER).write_text("")
    register_family(CountingSD)
    CountingSD.losses.clear()
    try:
        assert detect_family(str(model)) == "sd-counting" and detect_family(train_assets["sd"]) == "sd"
        out = tmp_path / "out"
        stats = run_script(["--pretrained_model_name_or_path", str(model), "--train_data_dir", train_assets["images"],
                            "--output_dir", str(out), *SD_BASE, "--max_train_steps", "2", "--full_finetune"])
    finally:
        unregister_family("sd-counting")
    assert stats["family"] == "sd-counting" and stats["global_step"] == 2
    assert CountingSD.losses == pytest.approx(stats["losses"])  # the script asked this adapter for every loss
    card = (out / "README.md").read_text()
    assert "- sd-counting-test" in card and "StableDiffusionPipeline" in card
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == "StableDiffusionPipeline"
    pipe = StableDiffusionPipeline.from_pretrained(out)
    image = pipe("a photo", height=64, width=48, num_inference_steps=1, output_type="np").images[0]
    assert image.shape == (64, 48, 3)
    assert "sd-counting" not in family_names()


def test_the_script_never_names_a_family():
    """No family name, and no family-specific attribute, appears in the script or in train/: it asks the adapter."""
    import ast

    names = set(family_names()) | {"sd1", "sd2", "xl"}
    sources = [ROOT / "train_text_to_image_arb.py", *sorted((ROOT / "hf_arb" / "train").glob("*.py"))]
    hits = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.lower() in names:
                hits.append(f"{path.name}:{node.lineno} {node.value!r}")
            if isinstance(node, ast.Attribute) and node.attr in ("sdxl", "flow", "flow_options"):
                hits.append(f"{path.name}:{node.lineno} .{node.attr}")
    assert not hits, hits
    assert len((ROOT / "train_text_to_image_arb.py").read_text().splitlines()) <= 900
    assert script.main.__module__ == "train_text_to_image_arb"


def test_guidance_scale_on_a_transformer_without_guidance_is_refused(flow_assets, tmp_path):
    """SD3 (and Flux.1-schnell) take no guidance input: --guidance_scale there would be silently ignored (#24)."""
    base = ["--train_data_dir", str(tmp_path), "--output_dir", str(tmp_path / "out"), "--report_to", "none"]
    args = script.parse_args(["--pretrained_model_name_or_path", flow_assets["sd3"], *base, "--guidance_scale", "2"])
    with pytest.raises(script.UsageError,
                       match="--guidance_scale 2.0: .* takes no guidance input .* Drop --guidance_scale"):
        get_family(args.family).load_models(args)
    args = script.parse_args(["--pretrained_model_name_or_path", flow_assets["flux"], *base, "--guidance_scale", "2"])
    assert get_family(args.family).load_models(args).options.guidance_scale == 2.0  # Flux.1-dev's tiny twin takes it


@pytest.mark.slow
def test_validation_under_bf16_mixed_precision_generates(flow_assets, tmp_path):
    """Validation under --mixed_precision bf16 ran the float32 scheduler latents into bf16 weights and crashed
    ('Input type (float) and bias type (c10::BFloat16)'); it runs under autocast now, as diffusers' scripts do."""
    from _train_fixtures import FLOW

    out = tmp_path / "out"
    stats = run_script(["--pretrained_model_name_or_path", flow_assets["flux"], "--train_data_dir",
                        flow_assets["images"],
                        "--output_dir", str(out), *FLOW, "--max_train_steps", "1", "--full_finetune",
                        "--mixed_precision", "bf16", "--validation_prompts", "a cat",
                        "--num_validation_inference_steps", "1"])
    assert stats["mixed_precision"] == "bf16" and stats["validation_images"]
    assert all(Path(p).is_file() for p in stats["validation_images"])
