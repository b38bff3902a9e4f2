"""Numbers as people read them: every number leaves with its unit (report page, terminal,
markdown, JUnit all format through here, so a value reads the same everywhere)."""
from __future__ import annotations

import math

UNIT_SUFFIXES = (("_ms", "ms"), ("_bytes", "B"), ("_mhz", "MHz"), ("_c", "°C"), ("_w", "W"), ("_s", "s"))


def fmt_num(v, digits: int = 4) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    a = abs(v)
    if a != 0 and (a >= 1e5 or a < 1e-3):
        return f"{v:.{digits - 1}e}"
    return f"{v:.{digits}g}" if a < 1000 else f"{v:,.1f}"


def fmt_ms(v) -> str:
    return "n/a" if v is None else f"{fmt_num(v)} ms"


def fmt_bytes(v, signed: bool = False) -> str:
    if v is None:
        return "n/a"
    v = int(v)
    sign = "+" if signed and v > 0 else ("-" if v < 0 else "")
    a = abs(v)
    human = ""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if a >= size:
            human = f" ({sign}{a / size:.2f} {unit})"
            break
    return f"{sign}{a:,} B{human}"


def fmt_x(v) -> str:
    return "n/a" if v is None else f"{v:.3f}x"


def fmt_ci(d: dict | None) -> str:
    if not d or d.get("lo") is None or d.get("hi") is None:
        return "no interval"
    return f"[{d['lo']:.3f}x, {d['hi']:.3f}x]"


def fmt_p(v) -> str:
    if v is None:
        return "n/a"
    return f"{v:.2g}" if v >= 1e-4 else "< 1e-4"


def fmt_pct(v, signed: bool = True) -> str:
    if v is None:
        return "n/a"
    return f"{v * 100:+.2f}%" if signed else f"{v * 100:.1f}%"


def fmt_field(v, key: str = "") -> str:
    """A value of a phase record or gate numbers, with the unit its key's suffix names."""
    if isinstance(v, str) or v is None:
        return "n/a" if v is None else v
    key = str(key)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if key.endswith("_bytes") or key in ("bytes", "base_peak", "cand_peak", "reduction", "min_reduction_bytes"):
            return fmt_bytes(v, signed=key == "reduction")
        for suffix, unit in UNIT_SUFFIXES:
            if key.endswith(suffix):
                return f"{fmt_num(v)} {unit}"
        if key.endswith(("share", "fraction")):
            return fmt_pct(v, signed=False)
    return fmt_num(v) if isinstance(v, (int, float)) else str(v)


def fmt_speedup(iv: dict | None) -> str:
    """A speedup with its interval: `0.927x [0.849, 1.007]` (`n/a` without a point)."""
    if not iv or iv.get("point") is None:
        return "n/a"
    if iv.get("lo") is None or iv.get("hi") is None:
        return f"{iv['point']:.3f}x (no interval)"
    return f"{iv['point']:.3f}x [{iv['lo']:.3f}, {iv['hi']:.3f}]"


def fmt_spread(median, p10, p90) -> str:
    """A time per call in ms with its p10-p90 spread: `5.596 (5.512-5.701)`."""
    if median is None:
        return "n/a"
    if p10 is None or p90 is None:
        return fmt_num(median)
    return f"{fmt_num(median)} ({fmt_num(p10)}-{fmt_num(p90)})"
