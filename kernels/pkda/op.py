"""Public PKDA op: `chunk_precond_kda`, same contract as fla-core 0.6.0's public op.

    chunk_precond_kda(q, k, v, g, g_atk, beta_atk, beta, scale=None, initial_state=None,
                      initial_A_state=None, output_final_state=False, cu_seqlens=None,
                      x=1.5, eps=1e-6, log_atk_scale=None) -> (o, final_state, final_A_state)

q, k are L2-normalised over K inside (stage fwd.l2norm / bwd.l2norm); gates are natural-log
decays; scale defaults to K^-1/2 and log_atk_scale to a tensor of -0.2 per head. The finals
are None unless output_final_state (no state tensor is then allocated or written).
Differentiable w.r.t. q, k, v, g, g_atk, beta_atk, beta, log_atk_scale, initial_state and
initial_A_state through `PKDAFunction`, whose backward calls `kernels.pkda.bwd.pkda_bwd`.
Every stage runs inside an NVTX range `pkda.fwd.<stage>` / `pkda.bwd.<stage>` opened inside
the Function's forward / backward, i.e. on the thread that launches its kernels.
"""
from __future__ import annotations

import torch

try:
    import nvtx
except ImportError:  # pragma: no cover - nvtx is a declared dependency; keep the op usable
    import contextlib

    class nvtx:  # noqa: N801
        annotate = staticmethod(lambda name: contextlib.nullcontext())

from .fwd import SUPPORTED_DIMS, l2norm_bwd, pkda_fwd
from .reference import make_layout

FLOAT_INPUTS = (torch.bfloat16, torch.float16, torch.float32)


def _shape(name, t, want, dims):
    if tuple(t.shape) != tuple(want):
        raise ValueError(f"{name} must have shape {dims} = {tuple(want)}, got {tuple(t.shape)}")


def validate(q, k, v, g, g_atk, beta_atk, beta, initial_state, initial_A_state, cu_seqlens,
             log_atk_scale):
    """Raises ValueError / TypeError naming the offending argument.
    Returns cu_seqlens as a host list (None when dense): the call's only host sync."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("g_atk", g_atk),
                    ("beta_atk", beta_atk), ("beta", beta)):
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
    _shape("k", k, (B, T, H, K), "[B,T,H,K]")
    _shape("v", v, (B, T, H, V), "[B,T,H,V]")
    _shape("g", g, (B, T, H, K), "[B,T,H,K]")
    for name, t in (("g_atk", g_atk), ("beta_atk", beta_atk), ("beta", beta)):
        _shape(name, t, (B, T, H), "[B,T,H]")
    if q.dtype not in FLOAT_INPUTS:
        raise TypeError(f"q must be bf16, fp16 or fp32, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} dtype {t.dtype} disagrees with q dtype {q.dtype}")
    if K not in SUPPORTED_DIMS:
        raise ValueError(f"K={K} is not supported (q/k head dim must be one of {SUPPORTED_DIMS})")
    if V not in SUPPORTED_DIMS:
        raise ValueError(f"V={V} is not supported (v head dim must be one of {SUPPORTED_DIMS})")
    for name, t in (("k", k), ("v", v), ("g", g), ("g_atk", g_atk), ("beta_atk", beta_atk),
                    ("beta", beta)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")

    if cu_seqlens is not None:
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
        cs = cu_seqlens.tolist()
        if cs[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {cs[0]}")
        if any(b < a for a, b in zip(cs, cs[1:])):
            raise ValueError("cu_seqlens must be non-decreasing")
        if cs[-1] > T:
            raise ValueError(f"cu_seqlens ends at {cs[-1]}, past T={T}")
        N = len(cs) - 1
    else:
        N, cs = B, None

    where = "len(cu_seqlens)-1" if cu_seqlens is not None else "B"
    if initial_state is not None:
        if not torch.is_tensor(initial_state) or initial_state.dim() != 4 \
                or tuple(initial_state.shape[1:]) != (H, K, V):
            raise ValueError(f"initial_state must have shape [N,H,K,V] = [{N},{H},{K},{V}], got "
                             f"{tuple(getattr(initial_state, 'shape', ()))}")
        if initial_state.shape[0] != N:
            raise ValueError(f"initial_state holds {initial_state.shape[0]} states but there are "
                             f"{N} sequences ({where})")
        if initial_state.dtype != torch.float32:
            raise TypeError(f"initial_state must be fp32, got {initial_state.dtype}")
    if initial_A_state is not None:
        if not torch.is_tensor(initial_A_state) or initial_A_state.dim() != 3 \
                or tuple(initial_A_state.shape[1:]) != (H, K):
            raise ValueError(f"initial_A_state must have shape [N,H,K] = [{N},{H},{K}], got "
                             f"{tuple(getattr(initial_A_state, 'shape', ()))}")
        if initial_A_state.shape[0] != N:
            raise ValueError(f"initial_A_state holds {initial_A_state.shape[0]} states but there "
                             f"are {N} sequences ({where})")
        if initial_A_state.dtype != torch.float32:
            raise TypeError(f"initial_A_state must be fp32, got {initial_A_state.dtype}")
    if torch.is_tensor(log_atk_scale) and log_atk_scale.numel() != H:
        raise ValueError(f"log_atk_scale must have H={H} entries, got shape "
                         f"{tuple(log_atk_scale.shape)}")
    return cs


class PKDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, g_atk, beta_atk, beta, log_atk_scale, initial_state,
                initial_A_state, scale, output_final_state, cu_seqlens, x, eps, host_cu):
        B, T, H, K = q.shape
        layout = make_layout(B, T, cu_seqlens, q.device, host_cu=host_cu)
        c = log_atk_scale.to(torch.float32).reshape(H).contiguous()
        o, S_fin, a_fin, saved = pkda_fwd(
            q, k, v, g, g_atk, beta_atk, beta, scale, c, initial_state, initial_A_state,
            output_final_state, cu_seqlens, x, eps, layout=layout, save_for_backward=True)
        ctx.save_for_backward(saved["q_n"], saved["k_n"], saved["q_rstd"], saved["k_rstd"], v, g,
                              g_atk, beta_atk, beta, c, initial_state, initial_A_state, cu_seqlens)
        ctx.meta = dict(scale=scale, x=x, eps=eps, lsc_dtype=log_atk_scale.dtype,
                        lsc_shape=log_atk_scale.shape,
                        dtypes=[t.dtype for t in (q, k, v, g, g_atk, beta_atk, beta)])
        ctx.set_materialize_grads(False)
        return o, S_fin, a_fin

    @staticmethod
    def backward(ctx, do, dht, dat):
        from .bwd import pkda_bwd
        (q_n, k_n, q_rstd, k_rstd, v, g, g_atk, beta_atk, beta, c, S0, a0,
         cu_seqlens) = ctx.saved_tensors
        m = ctx.meta
        if do is None:
            do = torch.zeros_like(v)
        gr = pkda_bwd(q_n, k_n, v, g, g_atk, beta_atk, beta, c, m["scale"], m["x"], m["eps"],
                      S0, a0, cu_seqlens, do, dht, dat)
        dts = m["dtypes"]
        with nvtx.annotate("pkda.bwd.l2norm"):
            dq = l2norm_bwd(q_n, q_rstd, gr["q"], out_dtype=dts[0])
            dk = l2norm_bwd(k_n, k_rstd, gr["k"], out_dtype=dts[1])
        cast = lambda t, dt: None if t is None else t.to(dt)
        dc = cast(gr["log_atk_scale"], m["lsc_dtype"])
        dc = None if dc is None else dc.reshape(m["lsc_shape"])
        return (dq, dk, cast(gr["v"], dts[2]), cast(gr["g"], dts[3]), cast(gr["g_atk"], dts[4]),
                cast(gr["beta_atk"], dts[5]), cast(gr["beta"], dts[6]), dc,
                cast(gr["initial_state"], torch.float32), cast(gr["initial_A_state"], torch.float32),
                None, None, None, None, None, None)


def chunk_precond_kda(q, k, v, g, g_atk, beta_atk, beta, scale=None, initial_state=None,
                      initial_A_state=None, output_final_state=False, cu_seqlens=None, x=1.5,
                      eps=1e-6, log_atk_scale=None):
    """Preconditioned KDA, chunked Triton implementation. See the module docstring.

    q, k [B,T,H,K]; v [B,T,H,V]; g [B,T,H,K]; g_atk, beta_atk, beta [B,T,H]; K, V in {64, 128};
    initial_state [N,H,K,V] fp32; initial_A_state [N,H,K] fp32; cu_seqlens [N+1] integer
    (B must be 1); log_atk_scale [H] tensor (or a float, or None for -0.2).
    Returns (o [B,T,H,V] in v.dtype, final_state [N,H,K,V] fp32 | None,
    final_A_state [N,H,K] fp32 | None).
    """
    host_cu = validate(q, k, v, g, g_atk, beta_atk, beta, initial_state, initial_A_state,
                       cu_seqlens, log_atk_scale)
    H, K = q.shape[2], q.shape[3]
    if scale is None:
        scale = K ** -0.5
    if log_atk_scale is None:
        log_atk_scale = -0.2
    if not torch.is_tensor(log_atk_scale):
        log_atk_scale = torch.full((H,), float(log_atk_scale), dtype=torch.float32, device=q.device)
    if x <= 0:
        raise ValueError(f"x must be > 0 (the squash spans [1/x, x]), got {x}")
    return PKDAFunction.apply(q, k, v, g, g_atk, beta_atk, beta, log_atk_scale, initial_state,
                              initial_A_state, float(scale), bool(output_final_state), cu_seqlens,
                              float(x), float(eps), host_cu)
