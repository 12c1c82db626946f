"""The VAE's weights fingerprint read from its safetensors files, with no module built: a run from an encoded dataset
checks that its VAE is the one the latents were encoded with before any model loads, and never loads the VAE.

:func:`weights_hash` hashes every tensor of the files (name, dtype, shape and raw bytes, in name order), so two
files holding the same tensors hash alike whatever their order or header metadata; a fine-tuned VAE, another
``--variant`` (fp16 weights) or another ``--pretrained_vae_model_name_or_path`` hash otherwise. It is not
:func:`~hf_arb.train.cache.cache_keys.vae_fingerprint` (that one hashes a loaded module's ``state_dict`` in module
order, which only the module knows): an encoded dataset stores both, ``vae_weights`` and ``vae_files``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
from pathlib import Path

#: diffusers' weights file name (``_add_variant`` puts a variant before the suffix)
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
#: bytes read at a time
CHUNK = 1 << 24


def _variant(name: str, variant: str | None) -> str:
    """diffusers' ``_add_variant``: ``a.b.safetensors`` → ``a.b.<variant>.safetensors``."""
    if not variant:
        return name
    parts = name.split(".")
    return ".".join([*parts[:-1], variant, parts[-1]])


def weight_files(path: str, subfolder: str | None = None, revision: str | None = None,
                 variant: str | None = None) -> list[Path] | None:
    """The safetensors files ``from_pretrained(path, subfolder=..., variant=...)`` reads (one, or the shards of
    its index), downloaded for a Hub id; None where the weights are not safetensors (a ``.bin`` pickle)."""
    folder = Path(path) / (subfolder or "")
    single, index = _variant(WEIGHTS_NAME, variant), _variant(WEIGHTS_NAME + ".index.json", variant)
    if not Path(path).is_dir():
        from huggingface_hub import snapshot_download

        prefix = f"{subfolder}/" if subfolder else ""
        root = Path(snapshot_download(path, revision=revision, allow_patterns=[f"{prefix}{single}", f"{prefix}{index}",
                                                                             f"{prefix}*.safetensors"]))
        folder = root / (subfolder or "")
    if (folder / single).is_file():
        return [folder / single]
    if (folder / index).is_file():
        shards = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    return None


def weights_hash(files: list[Path]) -> str:
    """16 hex digits: SHA-256 over every tensor of the safetensors ``files``, in name order (its name, dtype, shape
    and raw bytes), read in chunks (memory: one chunk)."""
    tensors = []
    for f in files:
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        tensors += [(name, f, 8 + size, meta) for name, meta in header.items() if name != "__metadata__"]
    h = hashlib.sha256()
    for name, f, start, meta in sorted(tensors, key=lambda t: t[0]):
        h.update(json.dumps([name, meta["dtype"], meta["shape"]]).encode())
        begin, end = meta["data_offsets"]
        with open(f, "rb") as fh:
            fh.seek(start + begin)
            left = end - begin
            while left:
                chunk = fh.read(min(CHUNK, left))
                if not chunk:
                    raise ValueError(f"{f} is truncated: tensor {name} ends past the end of the file.")
                h.update(chunk)
                left -= len(chunk)
    return h.hexdigest()[:16]


def vae_files_hash(path: str, subfolder: str | None = None, revision: str | None = None,
                   variant: str | None = None) -> str | None:
    """:func:`weights_hash` of the VAE ``from_pretrained`` would load; None where its weights are not safetensors
    (then only the loaded module can be fingerprinted)."""
    files = weight_files(path, subfolder, revision, variant)
    return weights_hash(files) if files else None


def run_vae_files_hash(args: argparse.Namespace) -> str | None:
    """:func:`vae_files_hash` of the VAE a run's flags name (the family's :meth:`~hf_arb.families.Family.vae_source`:
    ``--pretrained_vae_model_name_or_path``, else the model's ``vae/``)."""
    from hf_arb.families import get_family

    path, sub = get_family(args.family).vae_source(args)
    return vae_files_hash(path, sub, getattr(args, "revision", None), getattr(args, "variant", None))


__all__ = ["run_vae_files_hash", "vae_files_hash", "weight_files", "weights_hash"]
