"""A chain of square matmuls with a known extra-work knob: the instrument's own test case.

    matmul_chain(x, w, n=50) = x @ w @ w ... (n times)

`SYNTH_EXTRA_MATMULS` (read at import, default 0) adds that many more products of the same shape
whose results are dropped: each adds exactly 1/n of the work and one more kernel launch, and the
output does not change. So an env-only candidate with SYNTH_EXTRA_MATMULS=1 at n=50 is a known +2%
slowdown (on a compute-bound row in arithmetic, on a launch-bound row in launches), and one with 0 is
the baseline itself: what an instrument must read as 0.980x and as 1.000x.
"""
from __future__ import annotations

import os

import torch


def _extra_from_env() -> int:
    raw = os.environ.get("SYNTH_EXTRA_MATMULS", "0")
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"SYNTH_EXTRA_MATMULS must be a non-negative integer, got {raw!r}") from None
    if n < 0:
        raise ValueError(f"SYNTH_EXTRA_MATMULS must be a non-negative integer, got {n}")
    return n


EXTRA_MATMULS = _extra_from_env()


def matmul_chain(x: torch.Tensor, w: torch.Tensor, n: int = 50) -> torch.Tensor:
    """x [T, N] @ w [N, N], n times; plus EXTRA_MATMULS dropped products of the same size."""
    if x.dim() != 2 or w.dim() != 2 or w.shape[0] != w.shape[1] or x.shape[1] != w.shape[0]:
        raise ValueError(f"matmul_chain needs x [T, N] and w [N, N], got x {tuple(x.shape)}, w {tuple(w.shape)}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    y = x
    for _ in range(n):
        y = y @ w
    for _ in range(EXTRA_MATMULS):
        x @ w  # the extra work: same shape and cost as one step of the chain, result dropped
    return y
