"""How printed numbers read: a count with its noun in the right number (``1 row``, ``2 rows``) and a percentage
that never shows a negative zero (a crop of ``-1e-17`` from float rounding prints ``0.0%``, not ``-0.0%``)."""

from __future__ import annotations

__all__ = ["count", "percent"]


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun`` in the right number, with thousands separators: ``count(1, "row")`` → ``"1 row"``,
    ``count(1200, "row")`` → ``"1,200 rows"``; ``plural`` for irregular nouns (default ``noun + "s"``)."""
    return f"{n:,} {noun if n == 1 else (plural or noun + 's')}"


def percent(fraction: float, digits: int = 1) -> str:
    """``fraction`` as a percentage with ``digits`` decimals; values that round to zero print unsigned
    (``percent(-1e-17)`` → ``"0.0%"``)."""
    text = f"{100 * fraction:.{digits}f}"
    if text.lstrip("-").strip("0.") == "":  # -0.0, -0.00: float noise around zero
        text = text.lstrip("-")
    return text + "%"
