"""What an encoded dataset was encoded with: a small JSON dict derived from the run's flags and model folder, and
the comparison that refuses a run whose flags or model differ (one line naming the field and both values)."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

from hf_arb.checks import UsageError

#: bumped when the layout of the tables changes; a reader refuses another version
FORMAT_VERSION = 1
#: the file beside the shards that holds the fingerprint (the card's YAML repeats it)
INFO_FILE = "hf_arb_encoded.json"
#: the fields compared before any model loads, with the flag a user changes to match each
FLAG_OF = {"format_version": "re-encode with this hf_arb (hf-arb encode)",
           "family": "--pretrained_model_name_or_path", "model": "--pretrained_model_name_or_path / --revision",
           "vae": "--pretrained_vae_model_name_or_path", "buckets": "--resolution / --bucket_preset / the bucket flags",
           "fit": "--center_crop / --random_flip / --image_interpolation_mode / --seed",
           "variants": "--latent_cache_variants / --num_train_epochs", "text_dtype": "--mixed_precision",
           "vae_files": "--pretrained_vae_model_name_or_path / --variant (the VAE's weights)"}


def _hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def component_configs(path: str, revision: str | None = None) -> dict[str, str]:
    """``{component: config hash}`` of a diffusers folder's VAE and text encoders (``model_index.json``'s
    ``vae`` and ``text_encoder*`` entries), read from the folder or, for a Hub id, downloaded (a few KB each)."""

    def read(name: str) -> bytes:
        local = Path(path) / name
        if Path(path).is_dir():
            return local.read_bytes()
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(path, name, revision=revision)).read_bytes()

    index = json.loads(read("model_index.json"))
    parts = sorted(k for k in index if k == "vae" or k.startswith("text_encoder"))
    found = {}
    for part in parts:
        if index[part] is None or index[part][0] is None:
            continue
        config = json.loads(read(f"{part}/config.json"))
        found[part] = _hash(json.dumps({k: v for k, v in config.items() if not k.startswith("_")},
                                       sort_keys=True).encode())
    return found


def vae_config_hash(path: str) -> str:
    """Config hash of a standalone VAE folder or Hub id (``--pretrained_vae_model_name_or_path``)."""
    local = Path(path) / "config.json"
    if not local.exists():
        from huggingface_hub import hf_hub_download

        local = Path(hf_hub_download(path, "config.json"))
    config = json.loads(local.read_text())
    return _hash(json.dumps({k: v for k, v in config.items() if not k.startswith("_")}, sort_keys=True).encode())


def fit_policy(args: argparse.Namespace) -> dict[str, Any]:
    """How images are fitted to their bucket; the seed only where the crops or flips are drawn from it."""
    fit: dict[str, Any] = {"center_crop": bool(args.center_crop), "random_flip": bool(args.random_flip),
                           "interpolation": str(args.image_interpolation_mode)}
    if not fit["center_crop"] or fit["random_flip"]:
        fit["seed"] = int(args.seed)
    return fit


def run_fingerprint(args: argparse.Namespace, buckets: Any, *, variants: int | None = None) -> dict[str, Any]:
    """The fingerprint of a run's flags and model (``variants``: known once the schedule is; None leaves it out)."""
    models = component_configs(args.pretrained_model_name_or_path, getattr(args, "revision", None))
    vae = models.pop("vae", None)
    if getattr(args, "pretrained_vae_model_name_or_path", None):
        vae = vae_config_hash(args.pretrained_vae_model_name_or_path)
    found = {"format_version": FORMAT_VERSION, "family": args.family, "model": models, "vae": vae,
             "buckets": json.loads(buckets.to_json()), "fit": fit_policy(args), "text_dtype": "float32"}
    if variants is not None:
        found["variants"] = int(variants)
    return found


def mismatches(stored: dict[str, Any], run: dict[str, Any]) -> list[str]:
    """``"field: encoded A, this run B"`` for each field of ``run`` that ``stored`` holds otherwise."""
    return [f"{k}: encoded {json.dumps(stored.get(k), sort_keys=True)}, this run {json.dumps(v, sort_keys=True)}"
            for k, v in run.items() if stored.get(k) != v]


def check_fingerprint(stored: dict[str, Any], run: dict[str, Any], where: str) -> None:
    """Refuse (:class:`UsageError`, one line) an encoded dataset ``where`` whose fingerprint differs from the run's."""
    bad = mismatches(stored, run)
    if not bad:
        return
    field = bad[0].split(":")[0]
    more = f" (and {len(bad) - 1} more field(s): {', '.join(b.split(':')[0] for b in bad[1:])})" if len(bad) > 1 else ""
    raise UsageError(f"--encoded_dataset {where} does not match this run's {field} ({bad[0]}){more}: pass the flags "
                     f"it was encoded with ({FLAG_OF.get(field, field)}), or encode again with this run's flags "
                     f"(hf-arb encode OUT -- <the training flags>).")


__all__ = ["FORMAT_VERSION", "INFO_FILE", "check_fingerprint", "component_configs", "fit_policy", "mismatches",
           "run_fingerprint", "vae_config_hash"]
