"""`harness bench EXP`: the interleaved blocks alone (no freeze, verify, profile or ncu), then the
report of what they measured; resumable like `harness run`. Not logged as an attempt."""
from __future__ import annotations

from harness.commands.run import add_common, run


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure the interleaved blocks only (no oracle, profile or ncu), then report")
    add_common(p)
    p.add_argument("--quiet", action="store_true", help="plain progress lines (also HARNESS_QUIET=1)")
    p.set_defaults(func=run, bench_only=True)
