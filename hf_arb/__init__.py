"""hf_arb: aspect-ratio bucketing for the Hugging Face training stack.

Public names are imported lazily so that ``import hf_arb`` stays fast and does not pull in
torch, datasets or diffusers until a name that needs them is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from .moved import install as _install_moved_paths

_install_moved_paths()  # release 0.1 module paths (hf_arb.tiny, hf_arb.shift, ...) keep working, deprecated

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "BucketSet": "buckets.sets",
    "AssignmentSummary": "buckets.assignment",
    "PRESETS": "buckets.presets",
    "VIDEO_PRESETS": "buckets.presets",
    "read_image_size": "images.sizes",
    "ImageSizeError": "images.sizes",
    "add_bucket_columns": "annotate.map",
    "push_to_hub": "annotate.hub",
    "BucketBatchSampler": "sampling",
    "PackBatchSampler": "packing.sampler",
    "PlanReport": "sampling",
    "plan_epoch": "sampling",
    "prepare_dataloader": "sampling",
    "resume_dataloader": "sampling",
    "BucketedStream": "sampling",
    "StreamReport": "sampling",
    "build_stream_loader": "sampling",
    "fit_to_bucket": "images.fitting",
    "FitResult": "images.fitting",
    "to_tensor": "images.fitting",
    "BucketedImageDataset": "images.dataset",
    "PackedImageDataset": "packing.dataset",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_arb' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from hf_arb.buckets.sets import AssignmentSummary, BucketSet  # noqa: F401 (re-exported lazily, __getattr__)
