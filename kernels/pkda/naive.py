"""Token-by-token recurrence of preconditioned KDA (PKDA): the frozen oracle.

This is the definition of ../../shared/design/pkda.md written out literally, one token at a
time, in `compute_dtype` (fp32 by default, fp64 for a tighter oracle) whatever the input
dtype. It is deliberately small: no chunking, no tricks. It is differentiable through
torch autograd (no in-place updates of tensors that carry gradients), so running it in fp64
also gives a gradient oracle.

Per batch row / sequence and head, after L2-normalising q and k over K:

    a_t = exp(g_atk_t) a_{t-1} + beta_atk_t (k_t * k_t)
    r_t = log(a_t + eps) - c_h                       (c = log_atk_scale, default -0.2)
    m_t = exp(-log(x) r_t / (1 + |r_t|))
    p_t = k_t * m_t
    S'  = diag(exp(g_t)) S_{t-1}
    S_t = S' + beta_t p_t (v_t - S'^T k_t)^T
    o_t = S_t^T (scale q_t)
"""
from __future__ import annotations

import math

import torch

# eps of the L2 normalisation of q and k (fixed, as in the public op; distinct from `eps`).
L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum_K x^2 + eps) over the last dim, in x's dtype."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _recurrence(q, k, v, g, g_atk, beta_atk, beta, scale, S, a, c, logx, eps):
    """One sequence batch: q,k [B,T,H,K], v [B,T,H,V], g [B,T,H,K], scalars [B,T,H];
    S [B,H,K,V], a [B,H,K], c [H]. Returns o [B,T,H,V], S_T, a_T (all compute dtype)."""
    T = q.shape[1]
    outs = []
    for t in range(T):
        k_t = k[:, t]                                            # [B,H,K]
        a = torch.exp(g_atk[:, t])[..., None] * a + beta_atk[:, t][..., None] * (k_t * k_t)
        r = torch.log(a + eps) - c[None, :, None]
        m = torch.exp(-logx * r / (1 + r.abs()))
        p = k_t * m
        S = torch.exp(g[:, t])[..., None] * S                    # S' = diag(exp(g_t)) S
        pred = torch.einsum("bhk,bhkv->bhv", k_t, S)             # S'^T k_t
        delta = beta[:, t][..., None] * (v[:, t] - pred)
        S = S + p[..., :, None] * delta[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", scale * q[:, t], S))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o, S, a


def naive_recurrent_precond_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    g_atk: torch.Tensor,
    beta_atk: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    initial_A_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    x: float = 1.5,
    eps: float = 1e-6,
    log_atk_scale: torch.Tensor | float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    transpose_state_layout: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
):
    """Reference PKDA, same contract as `chunk_precond_kda`.

    q, k [B,T,H,K]; v [B,T,H,V]; g [B,T,H,K]; g_atk, beta_atk, beta [B,T,H];
    initial_state [N,H,K,V], initial_A_state [N,H,K] (N = B, or len(cu_seqlens)-1 with B=1);
    log_atk_scale: tensor [H], a float, or None (-0.2). q and k are L2-normalised over K here.
    Returns (o [B,T,H,V] in v.dtype, final_state [N,H,K,V] fp32 or None,
    final_A_state [N,H,K] fp32 or None). With `compute_dtype=torch.float64` the finals are
    returned in fp64 (the oracle's precision) rather than rounded to fp32.

    Added modes (defaults leave the above unchanged):
    transpose_state_layout: initial_state and final_state are [N,H,V,K] (S transposed).
    use_gate_in_kernel: g is the raw gate input and the log decay used is, per head h and
    channel d (dt_bias [H*K] or [H,K], optional, 0 when None; A_log [H]):
        -exp(A_log[h]) * softplus(g + dt_bias[h,d])                    lower_bound None
        lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h,d]))      otherwise
    """
    if use_gate_in_kernel:
        Hh, Kk = g.shape[-2:]
        u = g.to(compute_dtype)
        if dt_bias is not None:
            u = u + dt_bias.to(compute_dtype).reshape(Hh, Kk)
        decay_rate = torch.exp(A_log.to(compute_dtype).reshape(Hh, 1))
        if lower_bound is None:
            g = -decay_rate * torch.nn.functional.softplus(u)
        else:
            g = lower_bound * torch.sigmoid(decay_rate * u)
    if transpose_state_layout and initial_state is not None:
        initial_state = initial_state.transpose(-1, -2)
    B, T, H, K = q.shape
    V = v.shape[-1]
    cd = compute_dtype
    dev = q.device
    out_dtype = v.dtype
    if scale is None:
        scale = K ** -0.5
    if log_atk_scale is None:
        log_atk_scale = -0.2
    if isinstance(log_atk_scale, (int, float)):
        c = torch.full((H,), float(log_atk_scale), dtype=cd, device=dev)
    else:
        c = log_atk_scale.to(cd).reshape(H)
    logx = math.log(x)

    q, k = l2norm(q.to(cd)), l2norm(k.to(cd))
    v, g, g_atk, beta_atk, beta = (t.to(cd) for t in (v, g, g_atk, beta_atk, beta))

    if cu_seqlens is None:
        bounds = [(b, 0, T) for b in range(B)]
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens needs B == 1 (packed sequences), got B={B}")
        cs = [int(i) for i in cu_seqlens.tolist()]
        bounds = [(0, cs[n], cs[n + 1]) for n in range(len(cs) - 1)]
    N = len(bounds)

    o_parts, S_fin, a_fin = [], [], []
    for n, (b, bos, eos) in enumerate(bounds):
        S0 = (initial_state[n].to(cd) if initial_state is not None
              else torch.zeros(H, K, V, dtype=cd, device=dev))[None]
        a0 = (initial_A_state[n].to(cd) if initial_A_state is not None
              else torch.zeros(H, K, dtype=cd, device=dev))[None]
        sl = (slice(b, b + 1), slice(bos, eos))
        o_n, S_n, a_n = _recurrence(q[sl], k[sl], v[sl], g[sl], g_atk[sl], beta_atk[sl],
                                    beta[sl], scale, S0, a0, c, logx, eps)
        o_parts.append(o_n)
        S_fin.append(S_n[0])
        a_fin.append(a_n[0])

    if cu_seqlens is None:
        o = torch.cat(o_parts, dim=0)
    else:
        o = torch.cat(o_parts, dim=1) if o_parts else v.new_zeros(1, 0, H, V)
        if o.shape[1] < T:  # tokens past cu_seqlens[-1] belong to no sequence: zeros
            o = torch.cat([o, o.new_zeros(1, T - o.shape[1], H, V)], dim=1)
    o = o.to(out_dtype)
    if not output_final_state:
        return o, None, None
    fin_dtype = torch.float64 if cd == torch.float64 else torch.float32
    S_out = torch.stack(S_fin).to(fin_dtype)
    if transpose_state_layout:
        S_out = S_out.transpose(-1, -2)
    return o, S_out, torch.stack(a_fin).to(fin_dtype)
