"""Argument checks shared by the chunk op and the decode kernel: one wording for one contract."""
from __future__ import annotations

import math
import numbers

import torch


FLOAT_INPUTS = (torch.bfloat16, torch.float16, torch.float32)


def check_inputs(q, k, v, g, g_atk, beta_atk, beta, max_dim: int, why: str = "",
                 grouped_values: bool = False) -> tuple[int, int, int, int, int, int]:
    """The token tensors' types, shapes, dtypes and devices; returns (B, T, H, K, V, HV).

    HV is v's head count: H unless grouped_values (grouped value heads, "GVA": v, g, g_atk,
    beta_atk, beta then have HV heads, a multiple of q's and k's H)."""
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
    HV, hv = H, "H"
    if grouped_values and tuple(v.shape[:2]) == (B, T) and v.shape[2] != H:
        HV, hv = v.shape[2], "HV"
        if H == 0 or HV % H:
            raise ValueError(f"v has {HV} heads, not a multiple of q's H={H} (grouped value heads "
                             f"need HV = H * group)")
    for name, t, want, dims in (("k", k, (B, T, H, K), "[B,T,H,K]"), ("v", v, (B, T, HV, V), f"[B,T,{hv},V]"),
                                ("g", g, (B, T, HV, K), f"[B,T,{hv},K]"), ("g_atk", g_atk, (B, T, HV), f"[B,T,{hv}]"),
                                ("beta_atk", beta_atk, (B, T, HV), f"[B,T,{hv}]"),
                                ("beta", beta, (B, T, HV), f"[B,T,{hv}]")):
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
    return B, T, H, K, V, HV


def real_scalar(name: str, value) -> float:
    """A finite real number (a Python or NumPy int/float, not a bool or a tensor), as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def check_scalars(scale, x, eps, lower_bound=None) -> tuple[float, float, float]:
    """The op's scalar arguments; returns (scale, x, eps) as floats. A non-finite x or eps, or
    eps <= 0, would turn every output into NaN without an error; scale must be given (the
    caller fills in its K^-1/2 default first)."""
    scale = real_scalar("scale", scale)
    x = real_scalar("x", x)
    if x <= 0:
        raise ValueError(f"x must be > 0 (the squash spans [1/x, x]), got {x}")
    eps = real_scalar("eps", eps)
    if eps <= 0:
        # log(a + eps) of an A-state channel that is still 0 (no key mass yet, or a zero-padded
        # head dim) must stay finite
        raise ValueError(f"eps must be > 0 (the A-state is read as log(a + eps) and a may be 0), got {eps}")
    if lower_bound is not None:
        real_scalar("lower_bound", lower_bound)
    return scale, x, eps


def check_cu_seqlens_meta(cu_seqlens, B: int, device) -> None:
    """What can be checked without reading the offsets: a 1-D integer tensor on q's device
    (or the CPU), B == 1, 2+ entries."""
    if not torch.is_tensor(cu_seqlens):
        raise TypeError("cu_seqlens must be a 1-D integer torch.Tensor")
    check_index_device("cu_seqlens", cu_seqlens, device)
    if B != 1:
        raise ValueError(f"cu_seqlens requires B == 1 (packed sequences), got B={B}")
    if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex() \
            or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor, got {cu_seqlens.dtype} "
                         f"of shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must hold at least 2 entries [0, ..., T]")


def check_gate_params(A_log, dt_bias, H: int, K: int, device) -> None:
    """use_gate_in_kernel's parameters: A_log, H floats (any shape); dt_bias None or H*K floats
    ([H*K] or [H,K]); both on q's device."""
    if not torch.is_tensor(A_log) or A_log.numel() != H or not A_log.is_floating_point():
        raise ValueError(f"use_gate_in_kernel=True needs A_log, a float tensor of H={H} "
                         f"entries, got {getattr(A_log, 'shape', A_log)}")
    if dt_bias is not None and (not torch.is_tensor(dt_bias) or dt_bias.numel() != H * K
                                or not dt_bias.is_floating_point()):
        raise ValueError(f"dt_bias must be a float tensor of H*K={H * K} entries ([H*K] or "
                         f"[H,K]), got {getattr(dt_bias, 'shape', dt_bias)}")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but q is on {device}")


def check_index_device(name: str, t: torch.Tensor, device) -> None:
    """Index tensors (cu_seqlens, state slots) live on q's device or on the CPU (read there by
    the host and copied over); anything else (another GPU, the meta device) is refused."""
    if t.device != device and t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device} but q is on {device}: it must be on q's "
                         f"device or the CPU")


def check_cu_seqlens_values(cs: list[int], T: int) -> None:
    """The offsets themselves (host copy): start at 0, never decrease, end at or before T."""
    if cs[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {cs[0]}")
    if any(b < a for a, b in zip(cs, cs[1:])):
        raise ValueError("cu_seqlens must be non-decreasing")
    if cs[-1] > T:
        raise ValueError(f"cu_seqlens ends at {cs[-1]}, past T={T}")


def _state(name: str, t, N: int | None, tail: tuple[int, ...], dims: str, where: str, device) -> None:
    lead = dims[1]  # N (one state per sequence) or P (a pool of states)
    if not torch.is_tensor(t) or t.dim() != len(tail) + 1 or tuple(t.shape[1:]) != tail:
        raise ValueError(f"{name} must have shape {dims} = [{N if N is not None else lead},"
                         f"{','.join(map(str, tail))}], got {tuple(getattr(t, 'shape', ()))}")
    if N is not None and t.shape[0] != N:
        raise ValueError(f"{name} holds {t.shape[0]} states but there are {N} sequences ({where})")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be fp32, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")


def check_states(initial_state, initial_A_state, log_atk_scale, N: int, H: int, K: int, V: int,
                 varlen: bool, device=None, transpose_state_layout: bool = False,
                 pool: bool = False) -> None:
    """Initial states (one per sequence, fp32, on q's device) and log_atk_scale [H]; raises
    ValueError / TypeError naming the argument. With pool, the states are state pools
    [P,H,K,V] and [P,H,K] indexed by slot (any P >= 1, the same for both, both given,
    contiguous: they are updated in place)."""
    where = "len(cu_seqlens)-1" if varlen else "B"
    lead, count = ("P", None) if pool else ("N", N)
    if pool:
        if initial_state is None or initial_A_state is None:
            raise ValueError("ssm_state_indices needs both state pools: initial_state [P,H,K,V] and "
                             "initial_A_state [P,H,K], indexed by slot and updated in place")
    if initial_state is not None:
        dims, tail = (f"[{lead},H,V,K]", (H, V, K)) if transpose_state_layout else (f"[{lead},H,K,V]", (H, K, V))
        _state("initial_state", initial_state, count, tail, dims, where, device)
    if initial_A_state is not None:
        _state("initial_A_state", initial_A_state, count, (H, K), f"[{lead},H,K]", where, device)
    if pool:
        if initial_state.shape[0] != initial_A_state.shape[0] or initial_state.shape[0] == 0:
            raise ValueError(f"the state pools must hold the same number P >= 1 of slots: "
                             f"initial_state holds {initial_state.shape[0]}, initial_A_state "
                             f"{initial_A_state.shape[0]}")
        for name, t in (("initial_state", initial_state), ("initial_A_state", initial_A_state)):
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous when ssm_state_indices is given "
                                 f"(the pool is updated in place)")
    if torch.is_tensor(log_atk_scale) and log_atk_scale.numel() != H:
        raise ValueError(f"log_atk_scale must have H={H} entries, got shape {tuple(log_atk_scale.shape)}")
