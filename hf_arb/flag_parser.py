"""An argparse parser whose "unrecognized arguments" error suggests the flag's twin or its nearest spelling.

The same option is spelled differently by ``hf-arb`` (``--preset``, ``--step``, dashes) and by
``train_text_to_image_arb.py`` (``--bucket_preset``, ``--bucket_step``, underscores, as diffusers' scripts). A user
moving a flag from one to the other gets argparse's error plus one sentence naming the spelling this command takes;
a mistyped flag (``--train_batch_szie``) gets the nearest one this command takes (difflib). A parser with many flags
prints a one-line usage on errors (the training script's full usage is ~130 lines): ``--help`` lists them.
"""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Iterable
from typing import Any, NoReturn

#: hf-arb's spelling → the training script's, where they differ by more than dashes vs underscores
CLI_TO_SCRIPT = {"--preset": "--bucket_preset", "--step": "--bucket_step", "--metric": "--bucket_metric",
                 "--min-side": "--bucket_min_side", "--max-side": "--bucket_max_side",
                 "--leftover": "--bucket_leftover", "--batch-size": "--train_batch_size"}
SCRIPT_TO_CLI = {v: k for k, v in CLI_TO_SCRIPT.items()}


def twin(flag: str, known: Iterable[str]) -> str | None:
    """The flag among ``known`` that ``flag`` (an unknown option, maybe ``--x=value``) stands for, or None."""
    name = flag.partition("=")[0]
    if not name.startswith("--"):
        return None
    known = set(known)
    dashed, underscored = "--" + name[2:].replace("_", "-"), "--" + name[2:].replace("-", "_")
    for cand in (CLI_TO_SCRIPT.get(name), SCRIPT_TO_CLI.get(name), dashed, underscored,
                 CLI_TO_SCRIPT.get(dashed), SCRIPT_TO_CLI.get(underscored)):
        if cand is not None and cand != name and cand in known:
            return cand
    return None


#: a usage longer than this many lines is said in one line on errors (``--help`` still prints it in full)
SHORT_USAGE_LINES = 6


class FlagParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` that remembers its option strings and, on unrecognized arguments, names the twin
    of each one it knows (``--preset: this command spells it --bucket_preset``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.flags: set[str] = set()  # before super().__init__, which adds -h/--help
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        self.flags.update(action.option_strings)
        return action

    def twin_hints(self, unknown: Iterable[str]) -> list[str]:
        """One hint per unknown option whose twin this parser takes."""
        return [f"{u.partition('=')[0]}: this command spells it {t}" for u in unknown if (t := twin(u, self.flags))]

    def nearest_hints(self, unknown: Iterable[str]) -> list[str]:
        """One hint per unknown option without a twin whose spelling is close to one this parser takes."""
        hints = []
        for u in unknown:
            name = u.partition("=")[0]
            if not name.startswith("--") or twin(u, self.flags):
                continue
            norm = {f.replace("-", "_"): f for f in self.flags if f.startswith("--")}  # dashes or underscores alike
            close = difflib.get_close_matches(name.replace("-", "_"), list(norm), n=1, cutoff=0.75)
            if close:
                hints.append(f"{name}: did you mean {norm[close[0]]}?")
        return hints

    def error(self, message: str) -> NoReturn:
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            unknown = message[len(prefix):].split()
            hints = self.twin_hints(unknown) + self.nearest_hints(unknown)
            if hints:
                message = f"{message} ({'; '.join(hints)})"
        usage = self.format_usage()
        if usage.count("\n") > SHORT_USAGE_LINES:  # a wall of flags hides the one line that matters
            usage = f"usage: {self.prog} [options] (--help lists them)\n"
        self.exit(2, f"{usage}{self.prog}: error: {message}\n")


#: Python parameter names (BucketSet, add_bucket_columns) → the flags that set them, for messages phrased in flags
FLAG_NAMES = {"resolution": "--resolution", "step": "--step", "max_aspect_error": "--max-aspect-error",
              "min_side": "--min-side", "max_side": "--max-side", "metric": "--metric",
              "aspect_range": "--aspect-range", "image_column": "--image-column", "width_column": "--width-column",
              "height_column": "--height-column", "max_upscale": "--max-upscale", "min_size": "--min-size",
              "batch_size": "--batch-size", "num_proc": "--num-proc"}


_PARAM = re.compile(r"`(\w+)`|\b(\w+)=(\.\.\.)?")


def in_flags(message: str, names: dict[str, str] | None = None) -> str:
    """A library error message with its parameter names replaced by flags.

    With ``names`` (``{text: replacement}``, e.g. the training script's own flag names), each text is replaced as
    it is. Without, this CLI's :data:`FLAG_NAMES`: `` `step` `` → ``--step``, ``image_column=...`` →
    ``--image-column``, ``width_column='w'`` → ``--width-column 'w'``.
    """
    if names is not None:
        for name, flag in names.items():
            message = message.replace(name, flag)
        return message

    def flag(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in FLAG_NAMES:
            return m.group(0)
        return FLAG_NAMES[name] if m.group(1) or m.group(3) else FLAG_NAMES[name] + " "

    return re.sub(r"(--[\w-]+) \(\1\)", r"\1", _PARAM.sub(flag, message))  # "`step` (--step)" said once
