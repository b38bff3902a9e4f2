"""Inputs factory for the PKDA op (`chunk_precond_kda`), loaded by the harness by file path.

Self-contained on purpose: it must not import `kernels` (the harness loads it from its own
checkout while the op under test may come from another one).

shape dict: {"H", "K", "V"} plus either {"B", "T"} (dense) or {"seqlens": [..]} (varlen:
packed into B=1 with an int32 `cu_seqlens`). "D" is accepted as K = V = D.
Inputs follow the design note's "Registered shapes" paragraph: q, k, v ~ randn;
g = logsigmoid(randn) [B,T,H,K]; beta, beta_atk = sigmoid(randn) [B,T,H];
g_atk = logsigmoid(randn) [B,T,H]; log_atk_scale ~ randn [H] in fp32; x = 1.5.
Everything is drawn on the CPU from one torch.Generator seeded with `seed`, in fp32,
then cast to `dtype` and moved to `device`, so a (shape, seed) pair gives the same values
on every machine.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# chunk_precond_kda takes any head dim in [1, MAX_DIM] (others than 64/128/256 are zero-padded
# to the next of them inside the op; 256 since 2026-12-03, commits before that refuse > 128).
MAX_DIM = 256
MODES = ("fwd", "fwdbwd")
# Tensors that receive gradients in mode "fwdbwd" (every differentiable tensor input).
GRAD_NAMES = ["q", "k", "v", "g", "g_atk", "beta_atk", "beta", "log_atk_scale"]


def _dims(shape: dict):
    H = int(shape["H"])
    K = int(shape.get("K", shape.get("D", 0)))
    V = int(shape.get("V", shape.get("D", 0)))
    if "seqlens" in shape:
        seqlens = [int(s) for s in shape["seqlens"]]
        B, T = 1, sum(seqlens)
    else:
        seqlens = None
        B, T = int(shape["B"]), int(shape["T"])
    return B, T, H, K, V, seqlens


def shape_problem(shape: dict) -> str | None:
    """Why `chunk_precond_kda` cannot take this shape, or None if it can."""
    try:
        B, T, H, K, V, seqlens = _dims(shape)
    except KeyError as e:
        return f"shape lacks {e.args[0]!r} (needs H, K, V (or D) and B, T or seqlens)"
    except (TypeError, ValueError) as e:
        return f"shape has a non-integer field: {e}"
    if not 1 <= K <= MAX_DIM:
        return f"K={K} is not supported (supported: 1..{MAX_DIM})"
    if not 1 <= V <= MAX_DIM:
        return f"V={V} is not supported (supported: 1..{MAX_DIM})"
    if H < 1 or B < 1:
        return f"H and B must be >= 1, got H={H}, B={B}"
    if seqlens is not None:
        if not seqlens:
            return "seqlens is empty"
        if any(s < 0 for s in seqlens):
            return f"seqlens has a negative length: {seqlens}"
    if T < 1:
        return f"T must be >= 1, got T={T}"
    return None


def make_inputs(shape: dict, mode: str, dtype: torch.dtype, device: str, seed: int) -> dict:
    """{"args": (), "kwargs": {...}, "grad_inputs": [...]} for chunk_precond_kda(**kwargs)."""
    problem = shape_problem(shape)
    if problem is not None:
        raise ValueError(f"pkda inputs: {problem}")
    if mode not in MODES:
        raise ValueError(f"pkda inputs: mode must be one of {MODES}, got {mode!r}")
    B, T, H, K, V, seqlens = _dims(shape)
    gen = torch.Generator(device="cpu").manual_seed(int(seed))

    def randn(*size):
        return torch.randn(*size, generator=gen, dtype=torch.float32)

    cpu = {
        "q": randn(B, T, H, K),
        "k": randn(B, T, H, K),
        "v": randn(B, T, H, V),
        "g": F.logsigmoid(randn(B, T, H, K)),
        "g_atk": F.logsigmoid(randn(B, T, H)),
        "beta_atk": torch.sigmoid(randn(B, T, H)),
        "beta": torch.sigmoid(randn(B, T, H)),
    }
    log_atk_scale = randn(H)  # stays fp32
    need_grad = mode == "fwdbwd"
    kwargs = {}
    for name, t in cpu.items():
        kwargs[name] = t.to(dtype).to(device).requires_grad_(need_grad)
    kwargs["log_atk_scale"] = log_atk_scale.to(device).requires_grad_(need_grad)
    kwargs["x"] = 1.5
    if seqlens is not None:
        cu = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(seqlens, dtype=torch.int64), 0).to(torch.int32)
        kwargs["cu_seqlens"] = cu.to(device)
    return {"args": (), "kwargs": kwargs, "grad_inputs": list(GRAD_NAMES) if need_grad else []}
