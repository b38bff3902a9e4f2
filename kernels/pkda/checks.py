"""Argument checks shared by the chunk op and the decode kernel: one wording for one contract."""
from __future__ import annotations

import torch


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
