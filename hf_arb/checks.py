"""Argument checks shared by the pure planners (epoch plan, pack planner) and the bucket tables (a resolution that is
a side, not a pixel count): one message style for every one."""

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


#: The largest bucket side any supported model family trains at (SANA's 4096-px tables, with 2x headroom).
MAX_RESOLUTION = 8192


def check_resolution(value: int | None, flag: str = "resolution") -> None:
    """Refuse a resolution that is a pixel count or beyond any model (``flag``: how the caller names the value).

    ``--resolution`` is the *side* of the pixel budget (1024 means about 1024² pixels). A value above
    :data:`MAX_RESOLUTION` is refused before any work; one of at least 128² is called what it most likely is, a pixel
    count, with the side to pass instead. Raises ``ValueError`` whose message names ``flag``.
    """
    if value is None or int(value) <= MAX_RESOLUTION:
        return
    shown = f"{flag} {value}" if flag.startswith("-") else f"{flag}={value}"
    use = f"{flag} 1024" if flag.startswith("-") else f"{flag}=1024"
    if int(value) >= 128 * 128:
        side = int(value) ** 0.5
        exact = f"{int(side)}²" if int(side) ** 2 == int(value) else f"about {side:.0f}²"
        raise ValueError(f"{shown} looks like a pixel count ({exact}); pass the side, e.g. {use} for about 1024² "
                         f"pixels per bucket.")
    raise ValueError(f"{shown} is beyond the largest side any supported model trains at ({MAX_RESOLUTION}); pass the "
                     f"side of the pixel budget, e.g. {use}.")


class UsageError(ValueError):
    """A mistake in the command line or the data it names: the training script reports it as one ``error:`` line,
    no traceback. Raised by every floor that checks what a user asked for (families, train)."""


class UsageFileError(UsageError, FileNotFoundError):
    """A file or folder named on the command line does not exist."""
