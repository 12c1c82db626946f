"""Version ranges (issue 35): pyproject's lower bounds are constraints-min.txt's pins, the tested range at start-up
(hf_arb.train.flags.versions.TESTED) spans constraints-min.txt to constraints.txt, the broken transformers/peft pair is
excluded, and a run refuses a feature the installed versions break (before any model loads, naming the version to
install) and warns once for a package outside the tested range."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

import train_text_to_image_arb as script
from hf_arb.train.flags import versions

ROOT = Path(__file__).resolve().parents[1]


def pins(name: str) -> dict[str, str]:
    lines = (ROOT / name).read_text().splitlines()
    return {m[1].lower().replace("-", "_"): m[2] for line in lines if (m := re.match(r"^([\w.-]+)==([\w.+]+)", line))}


def requirements() -> dict[str, str]:
    """The direct requirements and the quant extra's (--do_fp8_training, --bnb_quantization_config_path)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = [*project["dependencies"], *project["optional-dependencies"]["quant"]]
    return {re.match(r"[\w-]+", d)[0].lower().replace("-", "_"): d for d in deps}


def test_the_tested_range_is_the_two_constraint_files():
    low, high = pins("constraints-min.txt"), pins("constraints.txt")
    assert versions.TESTED == {p: (low[p], high[p]) for p in versions.TESTED}


def test_the_lower_bounds_are_the_lowest_set():
    """Every direct requirement's floor is pinned in constraints-min.txt (torch: its lowest wheel here, see the
    file's header), and nothing else is."""
    reqs, low = requirements(), pins("constraints-min.txt")
    assert set(low) == set(reqs)
    for name, spec in reqs.items():
        floor = re.search(r">=([\w.]+)", spec)[1]
        if name != "torch":
            assert versions.parse_version(low[name])[:len(versions.parse_version(floor))] == \
                versions.parse_version(floor), (name, spec, low[name])
    assert "<5.24" in reqs["transformers"]  # peft 0.22 is not released: transformers 5.24 breaks text-encoder LoRA
    assert reqs["torchao"] == "torchao>=0.16"  # peft >= 0.19 refuses an older torchao for every LoRA run
    test_extra = tomllib_project()["optional-dependencies"]["test"]
    assert "torchao>=0.16" in test_extra  # the FP8 runs are tested on the CPU


def tomllib_project() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def args_of(*extra: str):
    return script.parse_args(["--pretrained_model_name_or_path", "m", "--train_data_dir", "d", "--report_to", "none",
                              *extra])


def fake(**installed: str):
    tested = {p: high for p, (_, high) in versions.TESTED.items()}
    return lambda p: {**tested, **installed}.get(p)


def test_text_encoder_lora_is_refused_with_the_broken_pair_naming_what_to_install():
    te = args_of("--rank", "4", "--train_text_encoder")
    with pytest.raises(script.UsageError) as err:
        versions.check_versions(te, fake(transformers="5.24.0", peft="0.21.2"))
    message = str(err.value)
    assert message.startswith("--train_text_encoder") and "\n" not in message
    assert "transformers 5.24.0 needs peft >= 0.22" in message and "pip install 'transformers<5.24'" in message
    versions.check_versions(args_of("--rank", "4"), fake(transformers="5.24.0", peft="0.21.2"))  # no encoder LoRA
    versions.check_versions(te, fake(transformers="5.24.0", peft="0.22.0"))  # the pair that works
    assert versions.check_versions(te, fake()) == []


def test_lora_is_refused_with_a_torchao_that_peft_refuses_naming_what_to_install():
    """peft >= 0.19 raises "Found an incompatible version of torchao" in every add_adapter when torchao < 0.16 is
    installed (peft 0.18 accepted 0.4+); a run says so before any model loads."""
    lora = args_of("--rank", "4")
    with pytest.raises(script.UsageError) as err:
        versions.check_versions(lora, fake(peft="0.19.0", torchao="0.15.0"))
    message = str(err.value)
    assert message.startswith("LoRA (peft checks the installed torchao") and "\n" not in message
    assert "pip install 'torchao>=0.16'" in message and "torchao 0.15.0" in message
    for fine in (fake(peft="0.18.0", torchao="0.15.0"), fake(peft="0.21.2", torchao="0.16.0"),
                 lambda p: None if p == "torchao" else fake()(p)):
        versions.check_versions(lora, fine)
    versions.check_versions(args_of("--full_finetune", "--learning_rate", "1e-5"), fake(peft="0.21.2",
                                                                                         torchao="0.15.0"))


def test_the_check_runs_at_start_up_before_any_model(monkeypatch, tmp_path):
    monkeypatch.setattr(versions, "installed", fake(transformers="5.24.0", peft="0.21.2"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_index.json").write_text("{}")
    args = script.parse_args(["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(tmp_path),
                              "--report_to", "none", "--rank", "4", "--train_text_encoder"])
    with pytest.raises(script.UsageError, match="pip install 'transformers<5.24'"):
        script.check_environment(args)


def test_a_package_outside_the_tested_range_warns_once_naming_it(caplog, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    args = args_of("--rank", "4")
    with caplog.at_level(logging.WARNING, logger="train_text_to_image_arb"):
        said = versions.check_versions(args, fake(diffusers="0.36.0", torch="2.13.0+cpu"))
    assert len(said) == 1 and said[0].startswith("diffusers 0.36.0 is outside the versions this release is tested "
                                                 "with (0.37.0 to 0.42.1)")
    assert [r.getMessage() for r in caplog.records] == said
    caplog.clear()
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level(logging.WARNING, logger="train_text_to_image_arb"):
        versions.check_versions(args, fake(diffusers="0.36.0"))
    assert caplog.records == []


def test_version_parsing():
    assert versions.parse_version("5.24.0.dev0") == (5, 24, 0)
    assert versions.parse_version("2.13.0+cpu") == (2, 13, 0)
    assert versions.parse_version("0.22.0rc1") == (0, 22, 0)
