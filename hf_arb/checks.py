"""Argument checks shared by the pure planners (epoch plan, pack planner): one message style for every one."""

from __future__ import annotations

from typing import Any

import numpy as np


def check_positive(name: str, value: Any) -> int:
    """``value`` as an int >= 1, or a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    return int(value)


def check_nonneg(name: str, value: Any) -> int:
    """``value`` as an int >= 0, or a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"`{name}` must be a non-negative integer, got {value!r}.")
    return int(value)
