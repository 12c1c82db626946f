"""Lines that must run as printed (issue #34, item 6): every family's model card code and the run's last line ("Saved
to …: load it with …") run exactly as printed where ``import hf_arb`` fails and torchvision is missing (this
machine), and the card's generation comes out at the size it asks for (a trained bucket, one with rows).

The code comes from one place, the family adapter (:meth:`hf_arb.families.Family.card_code` and
:meth:`~hf_arb.families.Family.saved_message`). The slow test reads the outputs of runs other files make anyway (the
shared 2-process batch, tests/_train_fixtures.py, and test_family_flux2.py's runs for Flux.2 [dev]); it covers every
built-in family, so a new family without a case fails here.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from pathlib import Path
from typing import Any

import pytest
from _stock import job_result
from _train_fixtures import GROUP, batch_result
from test_family_flux2 import assets  # noqa: F401  (the fixture `runs` asks for, by this name)
from test_family_flux2 import runs as flux2_runs  # noqa: F401
from test_family_wan import wan_assets, wan_runs  # noqa: F401  (wan_runs asks for wan_assets by this name)

from hf_arb.families import family_names, get_family

#: family -> the shared runs whose outputs are checked (batch run names; "flux2:" / "wan:" name test_family_flux2's
#: and test_family_wan's runs):
#: a full fine-tune or a LoRA of each family, plus the other kinds of card code (SD's own pipeline file with
#: --resolution_conditioning, SDXL's LoRA on the text encoders, Flux.2 with reference images)
RUNS = {
    "sd": ["broken-ddp", "sd-conditioned"],
    "sdxl": ["sdxl-te-lora-full"],
    "sd3": ["flow-sd3-full"],
    "flux": ["flow-flux-full"],
    "flux2": ["flux2:flux2-lora"],
    "flux2_klein": ["family-flux2-klein", "family-flux2-refs-full"],
    "flux-kontext": ["family-kontext"],
    "qwenimage": ["family-qwen-full"],
    "zimage": ["family-zimage-full"],
    "qwenimage-edit": ["family-qwen-edit"],
    "qwenimage-edit-plus": ["family-qwen-edit-plus-full"],
    "wan": ["wan:lora"],
    "ltx": ["clips-ltx-full"],
    "hunyuan_video15": ["clips-hyv"],
}

#: the card's generation line: an image, or a video family's frames (written to an MP4 on the next line)
CALL = re.compile(r"^(?:image|frames) = pipe\((.*)\)\.(?:images|frames)\[0\]", re.M)


def card_block(folder: Path) -> str:
    """The model card's "Use" code block, as printed."""
    card = (folder / "README.md").read_text()
    return card.split("## Use", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


def saved_code(log: str, out: str) -> str:
    """The code of the run's last line ``Saved to OUT: load it with …``, as printed: the rest of the line, or the
    fenced block after ``…load it with:``."""
    head = f"Saved to {out}: load it with"
    assert log.count(head) == 1, f"{head!r} printed {log.count(head)} times"
    rest = log.split(head, 1)[1]
    if rest.startswith(" "):
        return rest[1:].split("\n", 1)[0]
    assert rest.startswith(":\n```python\n"), rest[:200]
    return rest[len(":\n```python\n"):].split("\n```", 1)[0]


#: the lines a model card adds to the run's last line's code before its device and generation lines (imports of
#: torch, PIL and ``export_to_video``; blank lines)
CARD_ONLY = frozenset({"import torch", "from PIL import Image", "from diffusers.utils import export_to_video", ""})


def card_opens_with(card: str, saved: str) -> bool:
    """Whether the card's code, apart from :data:`CARD_ONLY` lines, opens with the statements of ``saved`` (the run's
    last line: its ``; ``-joined statements, or the lines of its fenced block) in order: running the card then runs
    the last line's code as printed, and with nothing but imports between its statements."""
    lines = saved.split("\n") if "\n" in saved else saved.split("; ")
    lines = [line for line in lines if line not in CARD_ONLY]
    return [line for line in card.splitlines() if line not in CARD_ONLY][:len(lines)] == lines


def requested_size(card: str) -> tuple[int, int]:
    """(width, height) the card's generation asks for."""
    call = CALL.search(card)
    assert call, card
    kw = dict(re.findall(r"\b(height|width)=(\d+)", call.group(1)))
    return int(kw["width"]), int(kw["height"])


#: the start-up table's header (:func:`hf_arb.train.sources.reports.bucketed_report`): bucket, aspect[, frames],
#: rows[, batch]
TABLE_HEADER = re.compile(r"^ +bucket +aspect( +frames)? +rows( +batch)?$", re.M)


def trained_sizes(log: str) -> set[tuple[int, int]] | None:
    """(width, height) of the buckets with rows in the run's start-up table (the rows the card picks among), or None
    where the log has no such table (a packed, tiered or streamed run)."""
    head = TABLE_HEADER.search(log)
    if head is None:
        return None
    rows_at = 3 + bool(head.group(1))  # w, h, aspect[, frames], rows
    block = log[head.end():log.index("\nskipped: ", head.end())].strip("\n")
    sizes = set()
    for line in block.split("\n"):
        cells = line.replace(" x ", " ").split()
        if int(cells[rows_at].replace(",", "")):
            sizes.add((int(cells[0]), int(cells[1])))
    return sizes


def input_files(card: str) -> list[str]:
    """The image files the card opens (the input images of an edit model), in the order it names them."""
    return re.findall(r'Image\.open\("([^"]+)"\)', card)


def fake_args(lora: bool, refs: list[str] | None = None, **kw: Any) -> argparse.Namespace:
    return argparse.Namespace(lora=lora, pretrained_model_name_or_path="org/base-model", reference_image_column=refs,
                              resolution_conditioning=False, **kw)


# ------------------------------------------------------------------------------------------- fast: the text
@pytest.mark.parametrize("name", family_names())
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_card_code_is_one_python_program_that_asks_for_a_trained_bucket(name: str, lora: bool) -> None:
    """Every family's card code parses, names no hf_arb, runs on a GPU or a CPU (no bare ``"cuda"``), generates at
    the shape it is given; the run's last line holds the same loading code; an edit model is handed its input
    image(s), one file per reference column."""
    family = get_family(name)
    refs = ["before", "style"] if family.image_argument == "list" else ["before"] if family.image_argument else None
    args = fake_args(lora, refs)
    card = "\n".join(family.card_code(args, "me/out", (208, 304)))
    ast.parse(card)
    assert "hf_arb" not in card and 'pipe.to("cuda"' not in card
    assert requested_size(card) == (208, 304)
    load = family.load_code(args, "me/out")
    assert all(line in card.splitlines() for line in load)
    message = family.saved_message(args, "me/out")
    code = saved_code(message + "\n", "me/out")
    ast.parse(code)
    assert code.splitlines() == load or code.split("; ") == load
    # the card runs the last line's statements as printed (the slow test then runs the card alone for both)
    assert card_opens_with(card, code) and not card_opens_with(card, code.replace("from_pretrained(", "f(", 1))
    call = CALL.search(card).group(1)
    if family.image_argument == "one":
        assert call.startswith('image=Image.open("before.jpg"), ')
    elif family.image_argument == "list":
        assert call.startswith('image=[Image.open("before.jpg"), Image.open("style.jpg")], ')
    if lora:
        assert 'from_pretrained("org/base-model"' in card and ('pipe.load_lora_weights("me/out")' in card or (
            'pipe.transformer.load_lora_adapter("me/out"' in card  # HunyuanVideo 1.5: no load_lora_weights
            and not hasattr(family.pipeline_class(), "load_lora_weights")))


def test_kontext_asks_for_its_max_area_and_qwen_edit_builds_its_processor() -> None:
    """Stock FluxKontextPipeline rescales its output to max_area (default 1024²): the card passes width x height.
    Qwen-Image-Edit's stock load needs torchvision: the card builds the image-only processor with public APIs."""
    kontext = "\n".join(get_family("flux-kontext").card_code(fake_args(True, ["before"]), "me/out", (208, 304)))
    assert "max_area=63232" in CALL.search(kontext).group(1)
    for name in ("qwenimage-edit", "qwenimage-edit-plus"):
        family = get_family(name)
        load = "\n".join(family.load_code(fake_args(True, ["before"]), "me/out"))
        assert "class ImageOnlyProcessor(Qwen2VLProcessor):" in load and "processor=processor" in load
        assert 'from_pretrained("org/base-model", subfolder="processor")' in load
        assert family.saved_message(fake_args(False, ["before"]), "me/out").startswith(
            "Saved to me/out: load it with:\n```python\nfrom diffusers import ")


def test_trained_sizes_reads_the_start_up_table(capsys) -> None:
    """The start-up table as the script prints it (a clip table, per-bucket batch sizes): the sizes with rows."""
    from types import SimpleNamespace

    import datasets

    from hf_arb.buckets.sets import BucketSet
    from hf_arb.train.sources.reports import bucketed_report

    buckets = BucketSet([(64, 96, 1), (80, 80, 1), (64, 64, 5), (96, 64, 5), (48, 80, 9)])
    for sizes in (None, {0: 2, 2: 1}):
        source = SimpleNamespace(
            args=argparse.Namespace(train_batch_size=1, gradient_accumulation_steps=1, video_token_budget=64),
            buckets=buckets, ds=datasets.Dataset.from_dict({"bucket": [0, 2, 2, -1, 4] + [1] * 1200}),
            sampler=SimpleNamespace(report=lambda: "sampler", batch_sizes=sizes, per_rank_batch_size=2),
            family_report=None)
        bucketed_report(SimpleNamespace(is_main_process=True, num_processes=1), source,
                        SimpleNamespace(num_train_epochs=1, max_train_steps=3),
                        SimpleNamespace(family=SimpleNamespace(title="Wan")))
        log = "warmup\n" + capsys.readouterr().out
        assert trained_sizes(log) == {(64, 96), (80, 80), (64, 64), (48, 80)}  # not 96x64 (no rows)
    assert trained_sizes("a streamed run\n") is None


# ------------------------------------------------------------------------------------------- slow: as printed
#: Runs in the stock interpreter (tests/_stock.py: hf_arb blocked; no torchvision here): for each output, the
#: card's code as printed, in a folder holding the input images it opens, then the run's last line as printed
#: (``saved``; None where the card opens with its statements, :func:`card_opens_with`: the card's run ran them, and
#: its ``pipe`` is theirs).
STOCK = r"""
import json, os, sys
results = {}
for name, job in json.loads(sys.argv[1]).items():
    here = os.getcwd()
    os.chdir(job["inputs"])  # the user's folder: the input images the card opens
    try:
        card, saved = {}, {}
        exec(compile(job["card"], f"<{name} card>", "exec"), card)
        if job["saved"] is None:
            saved = card
        else:
            exec(compile(job["saved"], f"<{name} last line>", "exec"), saved)
    finally:
        os.chdir(here)
    pipe = saved["pipe"]
    adapters = (pipe.get_active_adapters() if hasattr(pipe, "get_active_adapters")  # else: the transformer's own
                else list(getattr(getattr(pipe, "transformer", None), "peft_config", None) or []))
    if "image" in card:
        size, video = list(card["image"].size), None
    else:  # a video family: frames (F, H, W, 3), written to the MP4 the card names, in the user's folder
        frames = card["frames"]  # (F, H, W, 3) numpy (Wan's default output_type) or a list of PIL frames (LTX's)
        size = list(frames[0].size) if isinstance(frames, list) else [frames.shape[2], frames.shape[1]]
        video = os.path.join(job["inputs"], "video.mp4")
    results[name] = {"size": size, "cls": type(card["pipe"]).__name__,
                     "mp4": None if video is None else os.path.getsize(video),
                     "saved_cls": type(pipe).__name__, "adapters": list(adapters),
                     "module": type(pipe).__module__}
    del card, saved, pipe
print("RESULT" + json.dumps(results))
"""


@pytest.fixture(scope="module")
def outputs(ddp_batch, flux2_runs, wan_runs) -> dict[str, dict[str, Any]]:  # noqa: F811
    """run name -> ``{"family", "out", "log"}`` for every run in :data:`RUNS`."""
    found = {}
    for family, names in RUNS.items():
        for name in names:
            if name.startswith(("flux2:", "wan:")):
                run = (flux2_runs if name.startswith("flux2:") else wan_runs)[name.split(":", 1)[1]]
                found[name] = {"family": family, "out": Path(run["dir"]), "log": run["log"]}
            else:
                run = batch_result(ddp_batch, name)
                found[name] = {"family": family, "out": run["out"], "log": run["stats"]["log"]}
    return found


@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
def test_every_familys_card_and_last_line_run_as_printed_without_hf_arb(outputs, tmp_path) -> None:
    from _photos import PHOTOS, photo

    from hf_arb.buckets.sets import BucketSet

    assert set(RUNS) == set(family_names()), "add a run of every family to RUNS"
    jobs, expected = {}, {}
    for name, run in outputs.items():
        family, out = get_family(run["family"]), run["out"]
        card = card_block(out)
        folder = tmp_path / name
        folder.mkdir()
        # the user's photos, not at the bucket's size (Flux.2 takes >= 64 px)
        for i, file in enumerate(input_files(card)):
            photo(list(PHOTOS)[i], (120, 88)).convert("RGB").save(folder / file)
        saved = saved_code(run["log"], str(out))
        assert "hf_arb" not in card + saved
        jobs[name] = {"card": card, "saved": None if card_opens_with(card, saved) else saved, "inputs": str(folder)}
        size = requested_size(card)
        buckets = BucketSet.from_dict(json.loads((out / "hf_arb_buckets.json").read_text()))
        assert list(size) in buckets.resolutions[:, :2].tolist(), (name, size)  # a trained bucket (clips: W, H, F)
        trained = trained_sizes(run["log"])
        assert trained is None or size in trained, (name, size, trained)  # one with rows (the start-up table)
        assert size[0] != size[1], name  # non-square: a rescaling pipeline would show
        expected[name] = {"size": list(size), "cls": family.pipeline_class_name, "lora": '.load_lora_weights(' in card
                          or '.load_lora_adapter(' in card}
    results = job_result(STOCK, [json.dumps(jobs)], timeout=900)
    for name, want in expected.items():
        got = results[name]
        assert got["size"] == want["size"], (name, got, want)  # the size the card asks for
        assert "hf_arb" not in got["module"], name
        if name == "sd-conditioned":  # the folder's own pipeline.py (diffusers' custom-pipeline mechanism)
            assert got["cls"] == got["saved_cls"] == "StableDiffusionResolutionPipeline"
        else:
            assert got["cls"] == got["saved_cls"] == want["cls"], name
        assert bool(got["adapters"]) == want["lora"], name
        assert (got["mp4"] is not None) == (CALL.search(card_block(outputs[name]["out"])).group(0).startswith(
            "frames")), name  # a video family's card writes its MP4
        assert got["mp4"] is None or got["mp4"] > 0, name
    assert {n for n, r in outputs.items() if r["family"] in ("flux-kontext", "qwenimage-edit")} <= {
        n for n in jobs if input_files(jobs[n]["card"])}  # the edit models were handed their input image
