"""The installed library versions against the tested set (issue 35), checked at start-up before any model loads.

- A package outside the range CI tests (:data:`TESTED`: the lowest set, ``constraints-min.txt``, to the pinned set,
  ``constraints.txt``; ``tests/test_versions.py`` keeps the three equal) gets one warning naming it.
- A feature that cannot work with the installed versions is refused in one line naming the version to install
  (:data:`BROKEN`): transformers 5.24 needs peft >= 0.22 (not released) for ``text_encoder.add_adapter``, so
  ``--train_text_encoder`` LoRA fails there; pyproject excludes that transformers, but an older install or a manual
  upgrade can still meet it. peft >= 0.19 refuses an installed torchao older than 0.16 whenever it adds an adapter
  ("Found an incompatible version of torchao"), so every LoRA run fails there; the ``quant`` extra asks for 0.16+.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from dataclasses import dataclass, field
from importlib import metadata
from typing import Callable

from hf_arb.checks import UsageError

__all__ = ["BROKEN", "BrokenPair", "TESTED", "check_versions", "installed", "parse_version"]

logger = logging.getLogger("train_text_to_image_arb")

#: package → (lowest tested: constraints-min.txt, highest tested: constraints.txt)
TESTED: dict[str, tuple[str, str]] = {
    "torch": ("2.13.0", "2.13.0"),
    "diffusers": ("0.37.0", "0.42.1"),
    "transformers": ("5.5.0", "5.23.0"),
    "peft": ("0.18.0", "0.21.2"),
    "accelerate": ("1.0.0", "1.15.0"),
    "datasets": ("3.0.0", "5.2.0"),
    "huggingface_hub": ("1.5.0", "2.4.0"),
    "torchao": ("0.16.0", "0.18.0"),  # --do_fp8_training (the quant and test extras); absent: nothing to say
}


def parse_version(text: str) -> tuple[int, ...]:
    """``"5.24.0.dev0"`` → ``(5, 24, 0)``: the leading numeric release parts (enough to compare releases)."""
    out = []
    for part in text.split("+")[0].split("."):
        digits = re.match(r"\d+", part)
        if not digits:
            break
        out.append(int(digits[0]))
        if digits[0] != part:  # "0rc1": a pre-release of 0
            break
    return tuple(out)


def installed(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _at_least(version: str | None, floor: str) -> bool:
    return version is not None and parse_version(version) >= parse_version(floor)


@dataclass(frozen=True)
class BrokenPair:
    """A feature that the installed versions can break: ``used(args)`` says whether the run uses it,
    ``broken(version_of)`` whether the installed versions break it, ``fix`` (with ``{package}`` fields) what to do."""

    feature: str
    used: Callable[[argparse.Namespace], bool] = field(repr=False)
    broken: Callable[[Callable[[str], str | None]], bool] = field(repr=False)
    fix: str


#: the features the installed versions can break, each with its fix
BROKEN: list[BrokenPair] = [
    BrokenPair("--train_text_encoder (text-encoder LoRA through transformers' add_adapter)",
               lambda args: bool(getattr(args, "lora", False) and getattr(args, "train_text_encoder", False)),
               lambda v: _at_least(v("transformers"), "5.24.0") and not _at_least(v("peft"), "0.22.0"),
               "transformers {transformers} needs peft >= 0.22 for it, and peft {peft} is installed (0.22 is not "
               "released): pip install 'transformers<5.24'"),
    BrokenPair("LoRA (peft checks the installed torchao whenever it adds an adapter)",
               lambda args: bool(getattr(args, "lora", False)),
               lambda v: v("torchao") is not None and not _at_least(v("torchao"), "0.16.0")
               and _at_least(v("peft"), "0.19.0"),
               "peft {peft} needs torchao >= 0.16 whenever torchao is installed, and torchao {torchao} is: "
               "pip install 'torchao>=0.16' (or pip uninstall torchao)"),
]


def check_versions(args: argparse.Namespace, version_of: Callable[[str], str | None] | None = None) -> list[str]:
    """Refuse a feature the installed versions break (:data:`BROKEN`), then warn once (main process) for each
    package outside :data:`TESTED`. Returns the warnings said. ``version_of``: package → version (default
    :func:`installed`)."""
    version_of = version_of or installed
    versions = {p: version_of(p) for p in {*TESTED, "transformers", "peft"}}
    for pair in BROKEN:
        if pair.used(args) and pair.broken(version_of):
            raise UsageError(f"{pair.feature} cannot work with the installed versions: "
                             + pair.fix.format(**{k: v or "(none)" for k, v in versions.items()}) + ".")
    said = []
    for package, (low, high) in TESTED.items():
        version = versions[package]
        if version is None:
            continue
        if not parse_version(low) <= parse_version(version) <= parse_version(high):
            said.append(f"{package} {version} is outside the versions this release is tested with ({low} to {high}); "
                        f"if something fails, pip install '{package}>={low},<={high}'.")
    if int(os.environ.get("RANK", "0") or 0) == 0:
        for line in said:
            logger.warning(line)
    return said
