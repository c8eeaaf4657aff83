"""How numbers read wherever a person reads them: the app's tabs and the report.md files.

One set, so a figure on the page and the same figure in a saved report are written alike. A
missing value (None; for `ms`, also NaN or infinity) reads "–".
"""

from __future__ import annotations

import math

DASH = "–"


def num(x: float | None, digits: int = 1) -> str:
    """Thousands separated, `digits` decimals: 1,234.5."""
    return DASH if x is None else f"{x:,.{digits}f}"


def ms(x: float | None) -> str:
    """Milliseconds: one decimal below 100, none from 100 on (12.3, 1,234)."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return DASH
    return f"{x:,.1f}" if x < 100 else f"{x:,.0f}"


def ratio(x: float | None) -> str:
    """A ratio between two runtimes: 1.23×."""
    return DASH if x is None else f"{x:.2f}×"


def signed(x: float | None) -> str:
    """A difference, its sign always shown: +0.50, -1.25."""
    return DASH if x is None else f"{x:+.2f}"


def prob(x: float | None) -> str:
    """A probability: three decimals, or scientific notation below 0.01 (0.912, 3.10e-04)."""
    return DASH if x is None else f"{x:.3f}" if x >= 0.01 else f"{x:.2e}"
