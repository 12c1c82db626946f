"""hf_arb: aspect-ratio bucketing for the Hugging Face training stack.

Public names are imported lazily so that ``import hf_arb`` stays fast and does not pull in
torch, datasets or diffusers until a name that needs them is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "BucketSet": "buckets",
    "AssignmentSummary": "assignment",
    "PRESETS": "presets",
    "read_image_size": "sizes",
    "ImageSizeError": "sizes",
    "add_bucket_columns": "annotate",
    "push_to_hub": "hub",
    "BucketBatchSampler": "sampling",
    "PackBatchSampler": "sampling",
    "PlanReport": "sampling",
    "plan_epoch": "sampling",
    "prepare_dataloader": "sampling",
    "resume_dataloader": "sampling",
    "BucketedStream": "sampling",
    "StreamReport": "sampling",
    "build_stream_loader": "sampling",
    "fit_to_bucket": "imaging",
    "FitResult": "imaging",
    "to_tensor": "imaging",
    "BucketedImageDataset": "data",
    "PackedImageDataset": "packed_data",
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
    from .buckets import AssignmentSummary, BucketSet
