"""Argument checks shared by the chunk op and the decode kernel: one wording for one contract."""
from __future__ import annotations

import torch


FLOAT_INPUTS = (torch.bfloat16, torch.float16, torch.float32)


def check_inputs(q, k, v, g, g_atk, beta_atk, beta, max_dim: int, why: str = "") -> tuple[int, int, int, int, int]:
    """The token tensors' types, shapes, dtypes and devices; returns (B, T, H, K, V)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("g_atk", g_atk), ("beta_atk", beta_atk), ("beta", beta)):
        if not torch.is_tensor(t):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D [B,T,H,K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4:
        raise ValueError(f"v must be 4-D [B,T,H,V], got shape {tuple(v.shape)}")
    V = v.shape[-1]
    for name, t, want, dims in (("k", k, (B, T, H, K), "[B,T,H,K]"), ("v", v, (B, T, H, V), "[B,T,H,V]"),
                                ("g", g, (B, T, H, K), "[B,T,H,K]"), ("g_atk", g_atk, (B, T, H), "[B,T,H]"),
                                ("beta_atk", beta_atk, (B, T, H), "[B,T,H]"), ("beta", beta, (B, T, H), "[B,T,H]")):
        if tuple(t.shape) != tuple(want):
            raise ValueError(f"{name} must have shape {dims} = {tuple(want)}, got {tuple(t.shape)}")
    if q.dtype not in FLOAT_INPUTS:
        raise TypeError(f"q must be bf16, fp16 or fp32, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} dtype {t.dtype} disagrees with q dtype {q.dtype}")
    for dim, value, who in (("K", K, "q/k"), ("V", V, "v")):
        if not 1 <= value <= max_dim:
            raise ValueError(f"{dim}={value} is not supported ({who} head dim must be in [1, {max_dim}]{why})")
    for name, t in (("k", k), ("v", v), ("g", g), ("g_atk", g_atk), ("beta_atk", beta_atk), ("beta", beta)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    return B, T, H, K, V


def check_cu_seqlens_meta(cu_seqlens, B: int) -> None:
    """What can be checked without reading the offsets: a 1-D integer tensor, B == 1, 2+ entries."""
    if not torch.is_tensor(cu_seqlens):
        raise TypeError("cu_seqlens must be a 1-D integer torch.Tensor")
    if B != 1:
        raise ValueError(f"cu_seqlens requires B == 1 (packed sequences), got B={B}")
    if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex() \
            or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor, got {cu_seqlens.dtype} "
                         f"of shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must hold at least 2 entries [0, ..., T]")


def check_cu_seqlens_values(cs: list[int], T: int) -> None:
    """The offsets themselves (host copy): start at 0, never decrease, end at or before T."""
    if cs[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {cs[0]}")
    if any(b < a for a, b in zip(cs, cs[1:])):
        raise ValueError("cu_seqlens must be non-decreasing")
    if cs[-1] > T:
        raise ValueError(f"cu_seqlens ends at {cs[-1]}, past T={T}")


def _state(name: str, t, N: int, tail: tuple[int, ...], dims: str, where: str, device) -> None:
    if not torch.is_tensor(t) or t.dim() != len(tail) + 1 or tuple(t.shape[1:]) != tail:
        raise ValueError(f"{name} must have shape {dims} = [{N},{','.join(map(str, tail))}], "
                         f"got {tuple(getattr(t, 'shape', ()))}")
    if t.shape[0] != N:
        raise ValueError(f"{name} holds {t.shape[0]} states but there are {N} sequences ({where})")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be fp32, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")


def check_states(initial_state, initial_A_state, log_atk_scale, N: int, H: int, K: int, V: int,
                 varlen: bool, device=None, transpose_state_layout: bool = False) -> None:
    """Initial states (one per sequence, fp32, on q's device) and log_atk_scale [H]; raises
    ValueError / TypeError naming the argument."""
    where = "len(cu_seqlens)-1" if varlen else "B"
    if initial_state is not None:
        dims, tail = ("[N,H,V,K]", (H, V, K)) if transpose_state_layout else ("[N,H,K,V]", (H, K, V))
        _state("initial_state", initial_state, N, tail, dims, where, device)
    if initial_A_state is not None:
        _state("initial_A_state", initial_A_state, N, (H, K), "[N,H,K]", where, device)
    if torch.is_tensor(log_atk_scale) and log_atk_scale.numel() != H:
        raise ValueError(f"log_atk_scale must have H={H} entries, got shape {tuple(log_atk_scale.shape)}")
