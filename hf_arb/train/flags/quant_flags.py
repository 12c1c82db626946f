"""``--do_fp8_training`` and ``--bnb_quantization_config_path``: the quantized training of diffusers' Flux.2, Qwen-Image
and Z-Image dreambooth LoRA scripts (issue 35), checked before any model loads.

- ``--do_fp8_training``: the transformer's linear layers train with FP8 matmuls (torchao's
  ``convert_to_float8_training``, upstream's module filter: :func:`hf_arb.train.quantization.fp8_module_filter`).
  It runs where torch's ``_scaled_mm`` runs: a CUDA GPU of compute capability 8.9 or newer, and the CPU.
- ``--bnb_quantization_config_path FILE``: a JSON object of ``diffusers.BitsAndBytesConfig`` arguments (e.g.
  ``{"load_in_4bit": true, "bnb_4bit_quant_type": "nf4"}``); the transformer loads 4/8-bit with bitsandbytes and
  LoRA trains on it (QLoRA). diffusers' bitsandbytes quantizer needs a GPU (CUDA or XPU; 4-bit also MPS).

A missing library is refused naming what to ``pip install``; a run where the flag cannot work (a UNet family, a full
fine-tune of 4-bit weights, no GPU for bitsandbytes, a GPU without FP8) is refused in one line saying why.
Parse-level: torch is imported only when one of the flags is given.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from hf_arb.checks import UsageError

__all__ = ["BNB_EXAMPLE", "FP8_MIN_CAPABILITY", "QUANT_INSTALL", "check_quantization_flags", "read_bnb_config"]

#: what to install for each library (the ``quant`` extra has both)
QUANT_INSTALL = {"torchao": "pip install torchao  (or pip install 'hf_arb[quant]')",
                 "bitsandbytes": "pip install bitsandbytes  (or pip install 'hf_arb[quant]')"}
#: the config of upstream's READMEs: 4-bit NF4 (QLoRA)
BNB_EXAMPLE = '{"load_in_4bit": true, "bnb_4bit_quant_type": "nf4"}'
#: FP8 tensor cores: torch's ``_scaled_mm`` on CUDA needs compute capability 8.9 (Ada) or newer
FP8_MIN_CAPABILITY = (8, 9)


def check_quantization_flags(args: argparse.Namespace) -> None:
    """Refuse, in one line, a quantization flag that cannot work in this run (see the module docstring)."""
    fp8, path = bool(getattr(args, "do_fp8_training", False)), getattr(args, "bnb_quantization_config_path", None)
    if not fp8 and path is None:
        return
    if fp8 and path is not None:  # upstream: "Both ... cannot be passed."
        raise UsageError("--do_fp8_training and --bnb_quantization_config_path are two ways of quantizing the "
                         "transformer, and upstream's scripts refuse both at once: pass one of them.")
    flag = "--do_fp8_training" if fp8 else f"--bnb_quantization_config_path {path}"
    from hf_arb.families import get_family

    family = get_family(args.family)
    if family.objective != "flow":
        raise UsageError(f"{flag} quantizes a diffusion transformer (upstream: the Flux.2, Qwen-Image and Z-Image "
                         f"LoRA scripts); {family.title} trains a UNet. Drop {flag.split()[0]}.")
    if fp8:
        _need("--do_fp8_training", "torchao")
        _check_fp8_device()
        return
    if not getattr(args, "lora", False):
        raise UsageError(f"{flag} loads the transformer 4/8-bit, and quantized weights cannot be fine-tuned: train "
                         "LoRA on it (QLoRA) with --rank N, as upstream's LoRA scripts, or drop the flag.")
    if not _gpu_for_bnb():
        raise UsageError(f"{flag} loads the transformer 4/8-bit with bitsandbytes, and diffusers' bitsandbytes "
                         "quantizer needs a CUDA GPU; this machine has none. Drop --bnb_quantization_config_path "
                         "(LoRA trains the same adapters on the unquantized transformer).")
    _need("--bnb_quantization_config_path", "bitsandbytes")
    read_bnb_config(path)


def read_bnb_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON object of ``BitsAndBytesConfig`` arguments in ``path``, checked: a readable JSON object that turns
    on exactly one of ``load_in_4bit`` / ``load_in_8bit`` (else it would quantize nothing), no key that
    ``BitsAndBytesConfig`` does not take (diffusers only warns and drops it). Raises :class:`UsageError` naming the
    file and the fix."""
    flag = f"--bnb_quantization_config_path {path}"
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise UsageError(f"{flag}: cannot read it ({err.strerror or err}). Pass a JSON file such as {BNB_EXAMPLE}.") \
            from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise UsageError(f"{flag}: not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}).") from None
    if not isinstance(config, dict):
        raise UsageError(f"{flag}: holds a JSON {type(config).__name__}, not an object of BitsAndBytesConfig "
                         f"arguments such as {BNB_EXAMPLE}.")
    unknown = sorted(set(config) - set(bnb_config_keys()))
    if unknown:
        raise UsageError(f"{flag}: BitsAndBytesConfig takes no {', '.join(map(repr, unknown))} (it takes "
                         f"{', '.join(bnb_config_keys())}).")
    bits = [k for k in ("load_in_4bit", "load_in_8bit") if config.get(k) is True]
    if len(bits) != 1:
        what = "both" if bits else "neither"
        raise UsageError(f"{flag}: sets {what} of load_in_4bit and load_in_8bit to true; set one (4-bit NF4: "
                         f"{BNB_EXAMPLE}).")
    return config


def bnb_config_keys() -> tuple[str, ...]:
    """The arguments ``diffusers.BitsAndBytesConfig`` takes, read from its signature."""
    import inspect

    from diffusers import BitsAndBytesConfig

    params = inspect.signature(BitsAndBytesConfig.__init__).parameters.values()
    return tuple(p.name for p in params if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD)


def _need(flag: str, module: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise UsageError(f"{flag} needs {module}, which is not installed: {QUANT_INSTALL[module]}.")


def _forced_cpu() -> bool:
    """``ACCELERATE_USE_CPU`` (as the launchers set it): the run is on the CPU whatever the machine has."""
    return os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")


def _on_cpu() -> bool:
    """The run is on the CPU: :func:`_forced_cpu` or no CUDA device."""
    if _forced_cpu():
        return True
    import torch

    return not torch.cuda.is_available()


def _gpu_for_bnb() -> bool:
    """Where diffusers' bitsandbytes quantizer validates (``validate_environment``): CUDA or XPU, unless the run is
    forced onto the CPU."""
    if not _on_cpu():
        return True
    import torch

    xpu = getattr(torch, "xpu", None)
    return not _forced_cpu() and bool(xpu is not None and xpu.is_available())


def _check_fp8_device() -> None:
    """On CUDA, FP8 matmuls need compute capability 8.9+; the CPU runs them (torch's CPU ``_scaled_mm``)."""
    if _on_cpu():
        return
    import torch

    capability = torch.cuda.get_device_capability()
    if tuple(capability) < FP8_MIN_CAPABILITY:
        raise UsageError(f"--do_fp8_training trains with FP8 matmuls, which need a GPU of compute capability "
                         f"{'.'.join(map(str, FP8_MIN_CAPABILITY))} or newer (Ada, Hopper, Blackwell); "
                         f"{torch.cuda.get_device_name()} is {capability[0]}.{capability[1]}. Drop --do_fp8_training.")
