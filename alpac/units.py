"""How figures are printed for people: SI prefixes."""

from __future__ import annotations


def si(x: float) -> str:
    """1.5e9 -> '1.5 G' (the unit follows: f'{si(b)}B')."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} "


def duration(seconds: float) -> str:
    """0.0123 -> '12.3 ms'."""
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"
