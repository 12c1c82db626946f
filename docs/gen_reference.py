"""Generate docs/api.md (every public name, from the code), docs/cli.md (every command's --help), the
presets table in docs/buckets.md (every preset, built from the code) and the option table of docs/annotate.md
(every option of ``hf-arb annotate``, from its parser).

Usage: ``python docs/gen_reference.py`` (``tests/test_docs.py`` checks the committed files are current).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: module → the how-to page that explains it
MODULES: dict[str, str] = {
    "hf_arb.buckets.sets": "buckets.md",
    "hf_arb.buckets.assignment": "buckets.md",
    "hf_arb.buckets.presets": "buckets.md",
    "hf_arb.buckets.preset_sources": "buckets.md",
    "hf_arb.buckets.matching": "buckets.md",
    "hf_arb.buckets.stored": "buckets.md",
    "hf_arb.buckets.family_tables": "buckets.md",
    "hf_arb.buckets.resolve": "buckets.md",
    "hf_arb.buckets.fit": "report.md#fitted-buckets",
    "hf_arb.annotate.report": "report.md",
    "hf_arb.annotate.report_html": "report.md",
    "hf_arb.cli.app": "cli.md",
    "hf_arb.cli.report": "report.md",
    "hf_arb.cli.encode": "encode.md",
    "hf_arb.cli.tier_stats": "tiers.md#rows-per-tier-hf-arb-stats",
    "hf_arb.flag_parser": "cli.md",
    "hf_arb.images.sizes": "annotate.md",
    "hf_arb.annotate.map": "annotate.md",
    "hf_arb.annotate.core": "annotate.md",
    "hf_arb.annotate.summary": "annotate.md",
    "hf_arb.images.values": "annotate.md",
    "hf_arb.annotate.hub": "annotate.md",
    "hf_arb.annotate.plot": "annotate.md",
    "hf_arb.buckets.schema": "annotate.md",
    "hf_arb.buckets.references": "edit.md",
    "hf_arb.annotate.references": "edit.md",
    "hf_arb.sampling.composite": "edit.md",
    "hf_arb.sampling.pairing": "training.md",
    "hf_arb.images.references": "edit.md",
    "hf_arb.families.flux_kontext": "edit.md",
    "hf_arb.families.qwenimage_edit": "edit.md#train-a-qwen-image-edit-lora",
    "hf_arb.families.qwen_processor": "edit.md#train-a-qwen-image-edit-lora",
    "hf_arb.families.qwenimage_edit_plus": "edit.md#train-a-qwen-image-edit-lora",
    "hf_arb.families.flux2_refs": "edit.md#flux2-with-reference-images",
    "hf_arb.checks": "sampler.md",
    "hf_arb.annotate.arrow_batch": "web_scale.md",
    "hf_arb.annotate.engines.ray": "web_scale.md",
    "hf_arb.annotate.engines.spark": "web_scale.md",
    "hf_arb.cli.engines": "web_scale.md",
    "hf_arb.rng": "imaging.md",
    "hf_arb.sampling.planning.plan": "sampler.md",
    "hf_arb.sampling.planning.layout": "sampler.md",
    "hf_arb.sampling.planning.sync": "sampler.md",
    "hf_arb.sampling.planning.feistel": "sampler.md",
    "hf_arb.sampling.planning.index": "sampler.md",
    "hf_arb.sampling.planning.report": "sampler.md",
    "hf_arb.sampling.planning.shares": "training.md#several-datasets",
    "hf_arb.sampling.resume.state": "sampler.md",
    "hf_arb.sampling.inputs": "sampler.md",
    "hf_arb.sampling.rank": "sampler.md",
    "hf_arb.sampling.sampler": "sampler.md",
    "hf_arb.sampling.accelerate": "sampler.md",
    "hf_arb.sampling.resume.restore": "sampler.md#the-first-pass-after-a-restore",
    "hf_arb.sampling.resume.cursor": "sampler.md#the-first-pass-after-a-restore",
    "hf_arb.sampling.world": "sampler.md",
    "hf_arb.sampling.planning.batch_sizes": "sampler.md#a-batch-size-per-bucket-pixel-budget",
    "hf_arb.sampling.planning.ragged": "sampler.md#a-batch-size-per-bucket-pixel-budget",
    "hf_arb.images.geometry": "imaging.md",
    "hf_arb.sampling.streaming.plan": "sampler.md#streaming",
    "hf_arb.sampling.streaming.buffer": "sampler.md#streaming",
    "hf_arb.sampling.streaming.stream": "sampler.md#streaming",
    "hf_arb.sampling.streaming.collate": "sampler.md#streaming",
    "hf_arb.sampling.tiered.plan": "tiers.md",
    "hf_arb.sampling.tiered.schedule": "tiers.md#schedules",
    "hf_arb.sampling.tiered.files": "tiers.md#memory-and-speed",
    "hf_arb.sampling.tiered.draw": "tiers.md#random-onetrainer",
    "hf_arb.sampling.tiered.state": "tiers.md#in-a-training-loop",
    "hf_arb.sampling.tiered.report": "tiers.md",
    "hf_arb.sampling.tiered.sampler": "tiers.md",
    "hf_arb.sampling.tiered.stream": "tiers.md#with-streaming",
    "hf_arb.sampling.tiered.stream_draw": "tiers.md#with-streaming",
    "hf_arb.images.fitting": "imaging.md",
    "hf_arb.images.dataset": "imaging.md",
    "hf_arb.train.cache.latents": "training.md",
    "hf_arb.train.cache.latent_dataset": "training.md",
    "hf_arb.images.collate": "imaging.md",
    "hf_arb.video.metadata": "video.md",
    "hf_arb.video.arrow_batch": "video.md",
    "hf_arb.video.frames": "video.md",
    "hf_arb.annotate.clips": "video.md",
    "hf_arb.buckets.frames": "video.md",
    "hf_arb.video.temporal": "video.md#frames",
    "hf_arb.video.bad_clips": "video.md#bad-clips",
    "hf_arb.video.decode": "video.md#decoding-only-the-planned-frames",
    "hf_arb.video.dataset": "video.md#train",
    "hf_arb.train.checkpointing": "training.md",
    "hf_arb.train.flags.args": "training.md",
    "hf_arb.train.flags.arg_checks": "training.md",
    "hf_arb.train.environment": "training.md",
    "hf_arb.train.sources": "code_map.md#the-data-sources",
    "hf_arb.train.sources.base": "code_map.md#the-data-sources",
    "hf_arb.train.sources.bucketed": "code_map.md#the-data-sources",
    "hf_arb.train.sources.packed": "packing.md",
    "hf_arb.train.sources.streamed": "sampler.md#streaming",
    "hf_arb.train.sources.reports": "training.md",
    "hf_arb.train.sources.dataset": "training.md",
    "hf_arb.train.sources.loaders": "training.md",
    "hf_arb.train.sources.multi": "training.md#several-datasets",
    "hf_arb.train.flags.dataset_config": "training.md#several-datasets",
    "hf_arb.train.schedule": "training.md",
    "hf_arb.train.sources.stream": "training.md",
    "hf_arb.train.cache.caches": "training.md",
    "hf_arb.train.cache.cache_keys": "training.md",
    "hf_arb.train.encoded": "encode.md",
    "hf_arb.train.encoded.fingerprint": "encode.md#the-fingerprint",
    "hf_arb.train.encoded.shards": "encode.md",
    "hf_arb.train.encoded.encode": "encode.md",
    "hf_arb.train.encoded.from_cache": "encode.md#from-an-existing-latent-cache",
    "hf_arb.train.encoded.reader": "encode.md",
    "hf_arb.train.encoded.weights": "encode.md#the-fingerprint",
    "hf_arb.train.sources.encoded": "encode.md",
    "hf_arb.train.sources.encoded_stream": "encode.md#streaming",
    "hf_arb.train.sources.clips": "video.md#train",
    "hf_arb.train.models": "training.md",
    "hf_arb.train.progress": "training.md",
    "hf_arb.train.flags.resume_flags": "training.md",
    "hf_arb.train.signals": "training.md#stopping-ctrl-c-and-sigterm",
    "hf_arb.train.flags.upstream_flags": "training.md",
    "hf_arb.train.flags.prior_flags": "training.md",
    "hf_arb.train.flags.versions": "training.md",
    "hf_arb.train.flags.quant_flags": "training.md#quantized-training",
    "hf_arb.train.flags.video_flags": "video.md#train",
    "hf_arb.train.quantization": "training.md#quantized-training",
    "hf_arb.train.captions": "training.md#captions",
    "hf_arb.train.flags.caption_flags": "training.md#captions",
    "hf_arb.train.flags.optimizer_flags": "training.md#optimizer-prodigy",
    "hf_arb.train.outputs": "training.md",
    "hf_arb.train.videos": "video.md#validation",
    "hf_arb.train.files": "training.md",
    "hf_arb.train.sources.tiers": "tiers.md",
    "hf_arb.train.sources.masks": "training.md#masked-loss",
    "hf_arb.train.sources.masks.data": "training.md#masked-loss",
    "hf_arb.train.flags.mask_flags": "training.md#masked-loss",
    "hf_arb.images.masks": "training.md#masked-loss",
    "hf_arb.families.loss_mask": "training.md#masked-loss",
    "hf_arb.train.sources.prior.pairs": "training.md#prior-preservation",
    "hf_arb.train.sources.prior.class_images": "training.md#prior-preservation",
    "hf_arb.images.bad_images": "training.md",
    "hf_arb.families.conditioning": "training.md",
    "hf_arb.families.shift": "flow.md",
    "hf_arb.train.lora": "training.md",
    "hf_arb.moved": "api.md#moved-paths",
    "hf_arb.logs": "training.md",
    "hf_arb.wording": "code_map.md",
    "hf_arb.lazy": "code_map.md",
    "hf_arb.families": "code_map.md#where-to-add-things",
    "hf_arb.families.base": "code_map.md#where-to-add-things",
    "hf_arb.families.unet": "training.md",
    "hf_arb.families.unet_loss": "training.md",
    "hf_arb.families.sample_weights": "training.md",
    "hf_arb.families.sd": "training.md",
    "hf_arb.families.sdxl": "training.md",
    "hf_arb.families.flow_family": "training.md#sd3--sd35",
    "hf_arb.families.flux2": "training.md#flux2-dev-and-klein",
    "hf_arb.families.flux2_text": "training.md#flux2-dev-and-klein",
    "hf_arb.testing.tiny_flux2": "training.md#flux2-dev-and-klein",
    "hf_arb.families.flow": "training.md#per-bucket-resolution-shift",
    "hf_arb.families.sd3": "training.md#sd3--sd35",
    "hf_arb.families.flux": "training.md#flux1",
    "hf_arb.families.qwenimage": "training.md#qwen-image",
    "hf_arb.families.zimage": "training.md#z-image",
    "hf_arb.families.wan": "video.md#wan-model-side",
    "hf_arb.families.video_family": "video.md#wan-model-side",
    "hf_arb.families.ltx": "video.md#ltx-video",
    "hf_arb.families.hunyuan_video15": "video.md#hunyuanvideo-15-model-side",
    "hf_arb.packing.family": "packing.md#training-with-packing",
    "hf_arb.families.sd_pipeline": "training.md",
    "hf_arb.testing.tiny": "training.md",
    "hf_arb.testing.tiny_flow": "flow.md",
    "hf_arb.testing.tiny_text": "training.md",
    "hf_arb.testing.tiny_qwen": "training.md#qwen-image",
    "hf_arb.testing.tiny_zimage": "training.md#z-image",
    "hf_arb.testing.clips": "video.md",
    "hf_arb.testing.tiny_wan": "video.md#wan-model-side",
    "hf_arb.testing.tiny_ltx": "video.md#ltx-video",
    "hf_arb.testing.tiny_hunyuan_video": "video.md#hunyuanvideo-15-model-side",
    "hf_arb.packing.plan": "packing.md",
    "hf_arb.packing.layout": "packing.md",
    "hf_arb.packing.model": "packing.md",
    "hf_arb.packing.attention": "packing.md",
    "hf_arb.packing.sampler": "packing.md#the-data-path",
    "hf_arb.packing.tier_sampler": "tiers.md#with-packing",
    "hf_arb.packing.dataset": "packing.md#the-data-path",
    "hf_arb.packing.loss": "packing.md#the-packed-loss",
}


def public_names(module: Any) -> list[str]:
    """``module.__all__`` if it has one, else the functions and classes it defines without a leading underscore."""
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, obj in vars(module).items() if not n.startswith("_")
                 and (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == module.__name__]
    return sorted(names)


def summary(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.split("\n\n")[0].replace("\n", " ").strip() or "(no docstring)"


def signature(name: str, obj: Any) -> str:
    try:
        return f"{name}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        return name


def _drop_self(sig: str) -> str:
    for first in ("self", "cls"):
        sig = sig.replace(f"({first}, ", "(").replace(f"({first})", "()")
    return sig


def document(name: str, obj: Any) -> list[str]:
    if inspect.isclass(obj):
        lines = [f"### `{name}`", "", f"```python\nclass {signature(name, obj)}\n```", "", summary(obj), ""]
        members = [(n, m) for n, m in vars(obj).items() if not n.startswith("_")
                   and (inspect.isfunction(m) or isinstance(m, (property, classmethod, staticmethod)))]
        if members:
            lines += ["| member | what |", "|---|---|"]
            for n, m in members:
                target = m.__func__ if isinstance(m, (classmethod, staticmethod)) else m
                shown = n if isinstance(m, property) else _drop_self(signature(n, target)).replace("|", "\\|")
                lines.append(f"| `{shown}` | {summary(target.fget if isinstance(m, property) else target)} |")
            lines.append("")
        return lines
    if callable(obj):
        return [f"### `{name}`", "", f"```python\n{signature(name, obj)}\n```", "", summary(obj), ""]
    return [f"### `{name}`", "", f"`{obj!r}`"[:300], ""]


def api_md() -> str:
    import hf_arb

    out = [
        "# Python API reference",
        "",
        "Generated from the code by `python docs/gen_reference.py`; the how-to pages explain each part.",
        "",
        "Top-level names (`from hf_arb import ...`): "
        + ", ".join(f"`{n}`" for n in hf_arb.__all__ if n != "__version__")
        + ".",
        "",
    ]
    from hf_arb.moved import MOVED

    out += ["## Moved paths", "",
            "Release 0.2 moved the modules into stage folders ([the code map](code_map.md)), split "
            "`hf_arb.sampling` into concept subfolders (`planning/`, `tiered/`, `streaming/`, `resume/`) and moved the "
            "training data modules into the data sources, `hf_arb.train.sources`. "
            "Each old path below still imports — the same module object, with a `DeprecationWarning` naming the new "
            "path — for release 0.2 only (:mod:`hf_arb.moved`). **Deprecated**: import the new path.", "",
            "| old path (deprecated) | new path |", "|---|---|"]
    out += [f"| `{old}` | `{new}` |" for old, new in MOVED.items()] + [
        "| `hf_arb.sampling.PackBatchSampler` | `hf_arb.packing.PackBatchSampler` |", ""]
    for modname, page in MODULES.items():
        module = importlib.import_module(modname)
        out += [f"## `{modname}`", "", summary(module), "", f"How-to: [{page}]({page}).", ""]
        for name in public_names(module):
            out += document(name, getattr(module, name))
    return "\n".join(out).rstrip() + "\n"


def _help(argv: list[str]) -> str:
    env = {**os.environ, "COLUMNS": "100"}
    return subprocess.run(argv, capture_output=True, text=True, check=True, cwd=ROOT, env=env).stdout.rstrip()


def cli_md() -> str:
    from hf_arb.cli import commands

    out = ["# Command-line reference", "", "Generated by `python docs/gen_reference.py` from each command's `--help`.",
           ""]
    for cmd in ["--help", *(f"{c} --help" for c in commands())]:
        title = "hf-arb" if cmd == "--help" else f"hf-arb {cmd.split()[0]}"
        out += [f"## `{title}`", "", "```text", _help([sys.executable, "-m", "hf_arb", *cmd.split()]), "```", ""]
    out += ["## `train_text_to_image_arb.py`", "",
            "Launch with `accelerate launch` or `torchrun`; see [Training](training.md) for commands.", "",
            "```text", _help([sys.executable, "train_text_to_image_arb.py", "--help"]), "```", ""]
    return "\n".join(out).rstrip() + "\n"


PRESETS_BEGIN, PRESETS_END = "<!-- presets table: generated by docs/gen_reference.py -->", "<!-- end presets table -->"


def presets_md() -> str:
    """The table of every bucket preset (:func:`hf_arb.buckets.preset_sources.presets_markdown`) between its markers."""
    from hf_arb.buckets.preset_sources import presets_markdown

    return f"{PRESETS_BEGIN}\n{presets_markdown()}\n{PRESETS_END}"


def buckets_md(current: str) -> str:
    """docs/buckets.md with its generated presets table replaced."""
    a, b = current.index(PRESETS_BEGIN), current.index(PRESETS_END) + len(PRESETS_END)
    return current[:a] + presets_md() + current[b:]


VIDEO_BEGIN, VIDEO_END = ("<!-- video presets table: generated by docs/gen_reference.py -->",
                          "<!-- end video presets table -->")


def video_md(current: str) -> str:
    """docs/video.md with its generated video presets table
    (:func:`hf_arb.buckets.preset_sources.video_presets_markdown`) replaced."""
    from hf_arb.buckets.preset_sources import video_presets_markdown

    a, b = current.index(VIDEO_BEGIN), current.index(VIDEO_END) + len(VIDEO_END)
    return current[:a] + f"{VIDEO_BEGIN}\n{video_presets_markdown()}\n{VIDEO_END}" + current[b:]


OPTIONS_BEGIN, OPTIONS_END = ("<!-- annotate options: generated by docs/gen_reference.py -->",
                              "<!-- end annotate options -->")


def options_markdown(command: str) -> str:
    """A ``| option | meaning |`` table of every option of ``hf-arb COMMAND``: its choices and help, from the parser."""
    from hf_arb.cli import commands

    parser = argparse.ArgumentParser(prog=f"hf-arb {command}")
    commands()[command][1](parser)
    rows = ["| option | meaning |", "|---|---|"]
    for action in parser._actions:  # argparse has no public list of a parser's actions
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        if action.choices is not None:
            value = " " + "\\|".join(str(c) for c in action.choices)
        elif action.nargs == 0:
            value = ""
        else:
            metavar = action.metavar or action.dest.upper()
            value = " " + (" ".join(metavar) if isinstance(metavar, tuple) else metavar)
        meaning = " ".join((action.help or "").replace("%(default)s", str(action.default)).split())
        rows.append(f"| `{' / '.join(action.option_strings)}{value}` | {meaning.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)


def annotate_md(current: str) -> str:
    """docs/annotate.md with its generated option table replaced."""
    a, b = current.index(OPTIONS_BEGIN), current.index(OPTIONS_END) + len(OPTIONS_END)
    return current[:a] + f"{OPTIONS_BEGIN}\n{options_markdown('annotate')}\n{OPTIONS_END}" + current[b:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--check", action="store_true", help="exit 1 if the committed files differ from the generated ones")
    args = p.parse_args()
    stale = []
    buckets, annotate, video = ROOT / "docs" / "buckets.md", ROOT / "docs" / "annotate.md", ROOT / "docs" / "video.md"
    for path, text in ((ROOT / "docs" / "api.md", api_md()), (ROOT / "docs" / "cli.md", cli_md()),
                       (buckets, buckets_md(buckets.read_text())), (annotate, annotate_md(annotate.read_text())),
                       (video, video_md(video.read_text()))):
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"stale: {', '.join(stale)}; run python docs/gen_reference.py", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
