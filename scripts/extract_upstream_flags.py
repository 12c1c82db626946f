#!/usr/bin/env python
"""Write tests/fixtures/upstream_flags.json (diffusers' four text-to-image scripts) or, with --dreambooth,
upstream_dreambooth_flags.json (every dreambooth script of the families we claim): their argparse flags.

The training script promises the command line of diffusers' ``examples/text_to_image`` scripts. This reads the
four scripts' ``parse_args`` *statically* (``ast``; the scripts import torchvision and are never executed) and
records, per script, every ``parser.add_argument("--flag", ...)`` with its default, type, action and choices.
``tests/test_train.py`` asserts that our parser accepts every one of them.

Usage (against a local diffusers checkout, or a bare git mirror plus a revision):

    python scripts/extract_upstream_flags.py --diffusers_dir ~/src/diffusers
    python scripts/extract_upstream_flags.py --git_dir /path/to/diffusers.git --revision HEAD
    python scripts/extract_upstream_flags.py --git_dir /path/to/diffusers.git --dreambooth   # the dreambooth LoRA ones
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
from pathlib import Path
from typing import Any

SCRIPTS = (
    "train_text_to_image.py",
    "train_text_to_image_sdxl.py",
    "train_text_to_image_lora.py",
    "train_text_to_image_lora_sdxl.py",
)
FOLDER = "examples/text_to_image"
OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "upstream_flags.json"
#: --dreambooth: every dreambooth script (full and LoRA) of a family the training script claims, whose flags it also
#: takes (tests/test_train_dreambooth.py, tests/test_upstream_scripts.py). The img2img Flux.2 scripts are Flux.2's
#: edit mode (--cond_image_column); HiDream, Lumina2, Sana, Krea2, Ideogram4 and Flax are families we do not claim.
DREAMBOOTH_SCRIPTS = (
    "train_dreambooth.py", "train_dreambooth_lora.py", "train_dreambooth_lora_sdxl.py",
    "train_dreambooth_sd3.py", "train_dreambooth_lora_sd3.py", "train_dreambooth_flux.py",
    "train_dreambooth_lora_flux.py",
    "train_dreambooth_lora_flux_kontext.py", "train_dreambooth_lora_flux2.py", "train_dreambooth_lora_flux2_klein.py",
    "train_dreambooth_lora_flux2_img2img.py", "train_dreambooth_lora_flux2_klein_img2img.py",
    "train_dreambooth_lora_qwen_image.py", "train_dreambooth_lora_z_image.py",
)
DREAMBOOTH_FOLDER = "examples/dreambooth"
DREAMBOOTH_OUT = OUT.with_name("upstream_dreambooth_flags.json")


def _value(node: ast.expr | None, source: str) -> Any:
    """A literal's value; a non-literal expression is kept as its source text in ``{"expr": ...}``."""
    if node is None:
        return None
    try:
        return ast.literal_eval(node)
    except ValueError:
        return {"expr": ast.get_source_segment(source, node)}


def flags_of(source: str) -> dict[str, dict[str, Any]]:
    """``{flag name without dashes: {"default", "type", "action", "choices", "required"}}`` of one script."""
    out: dict[str, dict[str, Any]] = {}
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument" and node.args):
            continue
        name = _value(node.args[0], source)
        if not (isinstance(name, str) and name.startswith("--")):
            continue
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        action = _value(kw.get("action"), source)
        default = _value(kw["default"], source) if "default" in kw else (False if action == "store_true" else None)
        typ = kw.get("type")
        out[name[2:]] = {
            "default": default,
            "type": typ.id if isinstance(typ, ast.Name) else None,
            "action": action,
            "choices": _value(kw.get("choices"), source),
            "required": bool(_value(kw.get("required"), source)),
            "nargs": _value(kw.get("nargs"), source),
        }
    return out


def read_sources(diffusers_dir: str | None, git_dir: str | None, revision: str, scripts: tuple[str, ...] = SCRIPTS,
                 folder: str = FOLDER) -> tuple[dict[str, str], dict[str, str]]:
    """The scripts' text, and where they came from (commit and diffusers version when known)."""
    texts, origin = {}, {}
    if git_dir:
        def show(path: str) -> str:
            return subprocess.run(["git", "--git-dir", git_dir, "show", f"{revision}:{path}"], check=True,
                                  capture_output=True, text=True).stdout

        texts = {s: show(f"{folder}/{s}") for s in scripts}
        commit = subprocess.run(["git", "--git-dir", git_dir, "rev-parse", revision], check=True,
                                capture_output=True, text=True).stdout.strip()
        init = show("src/diffusers/__init__.py")
        origin["commit"] = commit
    else:
        root = Path(diffusers_dir or ".")
        texts = {s: (root / folder / s).read_text() for s in scripts}
        init = (root / "src" / "diffusers" / "__init__.py").read_text()
    for line in init.splitlines():
        if line.startswith("__version__"):
            origin["diffusers_version"] = line.split("=")[1].strip().strip('"')
    return texts, origin


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--diffusers_dir", help="A diffusers source checkout (its examples/text_to_image is read).")
    p.add_argument("--git_dir", help="A (bare) diffusers git directory, read with `git show`.")
    p.add_argument("--revision", default="HEAD", help="Revision to read with --git_dir.")
    p.add_argument("--dreambooth", action="store_true",
                   help=f"Read {DREAMBOOTH_FOLDER}'s {', '.join(DREAMBOOTH_SCRIPTS)} instead (default --out: "
                        f"{DREAMBOOTH_OUT.name}).")
    p.add_argument("--out", default=None, help=f"Where the JSON goes (default: {OUT.name} or {DREAMBOOTH_OUT.name}).")
    args = p.parse_args(argv)
    if not args.diffusers_dir and not args.git_dir:
        p.error("pass --diffusers_dir or --git_dir")
    scripts, folder = (DREAMBOOTH_SCRIPTS, DREAMBOOTH_FOLDER) if args.dreambooth else (SCRIPTS, FOLDER)
    args.out = args.out or str(DREAMBOOTH_OUT if args.dreambooth else OUT)
    texts, origin = read_sources(args.diffusers_dir, args.git_dir, args.revision, scripts, folder)
    data = {"source": {"repo": "huggingface/diffusers", "folder": folder, **origin},
            "scripts": {s: flags_of(t) for s, t in texts.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    print(f"{args.out}: " + ", ".join(f"{s} {len(f)} flags" for s, f in data["scripts"].items()))


if __name__ == "__main__":
    main()
