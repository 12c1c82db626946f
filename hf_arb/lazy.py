"""A module imported on first attribute access, so that ``--help``, argument errors and model-family detection
answer before torch (seconds to import) is loaded: ``torch = LazyModule("torch")``."""

from __future__ import annotations

import importlib
from typing import Any


class LazyModule:
    """Stands in for ``import NAME`` until an attribute is read; then it is the real module's attribute."""

    def __init__(self, name: str) -> None:
        self.module_name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self.module_name), attr)

    def __repr__(self) -> str:
        return f"<lazy module {self.module_name!r}>"
