"""Inputs factory for kernels.synthetic.matmul_chain (loaded by file path: imports nothing of ours).

shape dict: T (rows of x) and N (the square matmul size). x ~ randn [T, N],
w ~ randn [N, N] / sqrt(N) (each product keeps the expected norm, so 50 of them stay finite in bf16),
drawn on the CPU from `seed` in fp32, then cast and moved.
"""
from __future__ import annotations

import torch


def make_inputs(shape: dict, mode: str, dtype, device, seed: int) -> dict:
    if mode != "fwd":
        raise ValueError(f"matmul_chain is measured forward only, got mode {mode!r}")
    T, N = int(shape["T"]), int(shape["N"])
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, N, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(N, N, generator=g) / N ** 0.5).to(device=device, dtype=dtype)
    return {"args": (), "kwargs": {"x": x, "w": w}, "grad_inputs": []}


def shape_problem(shape: dict) -> str | None:
    for dim in ("T", "N"):
        if int(shape.get(dim, 0)) < 1:
            return f"{dim} must be >= 1"
    return None
