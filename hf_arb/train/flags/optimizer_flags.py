"""``--optimizer`` and its ``--prodigy_*`` flags, as diffusers' dreambooth LoRA scripts have them: ``AdamW`` (the
default; ``--use_8bit_adam`` for bitsandbytes' 8-bit AdamW) or ``prodigy`` (the prodigyopt package, an optional
extra: ``pip install prodigyopt``).

Upstream declares the three ``--prodigy_*`` switches ``type=bool``: argparse then reads every non-empty value as True
(``--prodigy_decouple False`` is True there) and only ``""`` as False. Here ``True``/``1`` and ``""`` mean what they
mean upstream, and a value that reads as False to a person (``False``, ``0``, ``no``) is refused in one line naming
the upstream meaning and the fix, so that the same command never trains differently in the two scripts.

Parse-level: nothing here imports torch (the package is looked up, not imported).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
from typing import Any, Callable

from hf_arb.checks import UsageError

__all__ = ["OPTIMIZERS", "PRODIGY_FLAGS", "PRODIGY_INSTALL", "add_optimizer_flags", "check_optimizer_flags",
           "optimizer_name"]

logger = logging.getLogger("train_text_to_image_arb")

#: ``--optimizer`` values (compared case-insensitively, as upstream's ``args.optimizer.lower()``)
OPTIMIZERS = ("adamw", "prodigy")
#: the flags that configure Prodigy, with upstream's defaults
PRODIGY_FLAGS = {"prodigy_beta3": None, "prodigy_decouple": True, "prodigy_use_bias_correction": True,
                 "prodigy_safeguard_warmup": True}
#: what to run where prodigyopt is missing
PRODIGY_INSTALL = "pip install prodigyopt"
#: upstream's warning threshold: Prodigy's learning rate is a multiplier of its own estimate, around 1.0
PRODIGY_LOW_LR = 0.1

_TRUE = ("true", "1", "yes", "on", "t", "y")
_FALSE = ("false", "0", "no", "off", "f", "n", "none")


def add_optimizer_flags(a: Callable[..., Any]) -> None:
    """Add the flags to the parser (``a`` is its ``add_argument``)."""
    a("--optimizer", type=str, default="AdamW",
      help='"AdamW" or "prodigy" (diffusers\' dreambooth scripts\' choices; prodigy needs `pip install prodigyopt`, '
           "and a --learning_rate around 1.0).")
    a("--prodigy_beta3", type=float, default=None,
      help="--optimizer prodigy: coefficient for the step size's running averages (default: sqrt(beta2))."
           + "%(default).0s")
    a("--prodigy_decouple", type=str, default=True,
      help="--optimizer prodigy: AdamW-style decoupled weight decay. As upstream's type=bool: True, or '' for "
           "False.")
    a("--prodigy_use_bias_correction", type=str, default=True,
      help="--optimizer prodigy: Adam's bias correction. As upstream's type=bool: True, or '' for False.")
    a("--prodigy_safeguard_warmup", type=str, default=True,
      help="--optimizer prodigy: remove the lr from the denominator of the D estimate during warm-up. As "
           "upstream's type=bool: True, or '' for False.")


def optimizer_name(args: argparse.Namespace) -> str:
    """``adamw`` or ``prodigy`` (lower case)."""
    return str(getattr(args, "optimizer", "AdamW")).lower()


def _upstream_bool(flag: str, value: Any) -> bool:
    """``type=bool`` as upstream reads it, for the values a person reads the same way; others refused."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text == "":
        return False
    if text in _TRUE:
        return True
    if text in _FALSE:
        raise UsageError(f"--{flag} {value}: diffusers' scripts declare it type=bool, which reads every non-empty "
                         f"value as True, so this command means True there. Pass --{flag} '' for False, or drop it "
                         "for True.")
    raise UsageError(f"--{flag} {value!r}: pass True, or '' for False (upstream's type=bool).")


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules: not importable
        return False


def _warn_once(message: str, *values: Any) -> None:
    if int(os.environ.get("RANK", "0") or 0) == 0:  # parsing runs on every rank
        logger.warning(message, *values)


def check_optimizer_flags(args: argparse.Namespace) -> None:
    """``--optimizer`` is AdamW or prodigy; the ``--prodigy_*`` flags are read as upstream reads them and configure
    prodigy only; prodigy needs prodigyopt and excludes ``--use_8bit_adam``. Warns, as upstream, about a Prodigy
    learning rate <= 0.1 and a ``--text_encoder_lr`` that Prodigy does not use."""
    name = optimizer_name(args)
    if name not in OPTIMIZERS:
        raise UsageError(f"--optimizer {args.optimizer}: the optimizers are AdamW and prodigy (diffusers' dreambooth "
                         "scripts fall back to AdamW with a warning). Pass --optimizer AdamW or --optimizer prodigy.")
    for flag in ("prodigy_decouple", "prodigy_use_bias_correction", "prodigy_safeguard_warmup"):
        setattr(args, flag, _upstream_bool(flag, getattr(args, flag)))
    if name != "prodigy":
        for flag, default in PRODIGY_FLAGS.items():
            if getattr(args, flag) != default:
                shown = getattr(args, flag)
                raise UsageError(f"--{flag} {shown if shown is not False else repr('')} has no effect in this run: it "
                                 f"configures --optimizer prodigy, and this run trains with {args.optimizer}. Add "
                                 f"--optimizer prodigy, or drop --{flag}.")
        return
    if args.use_8bit_adam:
        raise UsageError("--use_8bit_adam is bitsandbytes' 8-bit AdamW, and --optimizer prodigy is another optimizer "
                         "(diffusers' scripts ignore --use_8bit_adam then): drop one of them.")
    if not _installed("prodigyopt"):
        raise UsageError(f"--optimizer prodigy needs the prodigyopt package: {PRODIGY_INSTALL} (or pip install "
                         "'hf_arb[prodigy]').")
    if args.learning_rate <= PRODIGY_LOW_LR:
        _warn_once("--learning_rate %g with --optimizer prodigy: Prodigy estimates the step size itself and the "
                   "learning rate multiplies it; diffusers' scripts warn that around 1.0 is generally better.",
                   args.learning_rate)
    if getattr(args, "train_text_encoder", False) and getattr(args, "text_encoder_lr", None) is not None:
        _warn_once("--text_encoder_lr %g with --optimizer prodigy: Prodigy uses --learning_rate %g for the text "
                   "encoders too, as diffusers' scripts do.", args.text_encoder_lr, args.learning_rate)
