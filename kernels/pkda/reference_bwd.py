"""PyTorch reference of the PKDA backward, organised by the stages of shared/design/pkda.md.

Explicit math (no autograd), chunk C = 64, any float dtype (fp64 for the oracle tests).
Every stage is one function working on ONE sequence with heads batched in front:
q, k, p, g, G: [H, T, K]; v, Delta, do: [H, T, V]; per-token scalars: [H, T].
`pkda_bwd_reference` has the signature of `kernels.pkda.bwd.pkda_bwd` and loops over the
sequences (dense rows, or cu_seqlens segments).

Chunk form (state h at the chunk start, G = in-chunk inclusive cumsum of g, Gam = exp(G)):
    Akk[r,j] = beta_r sum_d k_r p_j e^{G_r-G_j} (j<r)   Aqk[r,j] = scale sum_d q_r p_j e^{G_r-G_j} (j<=r)
    X = diag(beta) (V - (K*Gam) h)     Delta = (I + Akk)^-1 X
    O = scale (Q*Gam) h + Aqk Delta    h' = diag(Gam_C) h + Kg^T Delta,  Kg = P * e^{G_C - G}

Backward per chunk, dE = dL/dh' (end-of-chunk state gradient):
    bwd.dAv     dAqk_s = scale * tril(dO Delta^T)   (gradient of the UNscaled q.p sum)
                dDelta_loc = Aqk^T dO
    bwd.dhu     dDelta = dDelta_loc + Kg dE
                dL/dh  = Gam_C * dE + scale (Q*Gam)^T dO - W^T dDelta      (reverse over chunks)
    bwd.wy_dqkg dX = (I+Akk)^-T dDelta;  dv = beta dX;  dAkk = -strict_tril(dX Delta^T)
                dq += scale Gam*(dO h^T);  dk += -beta Gam*(dX h^T);  dp += (Delta dE^T)*e^{G_C-G}
                dbeta += rowsum(dX*V) - rowsum((K*Gam)*(dX h^T))
    bwd.intra   dq_r += sum_j dAqk_s[r,j] p_j e^{G_r-G_j};   dkr_r = sum_j dAkk[r,j] p_j e^{G_r-G_j}
                dk += beta dkr;  dbeta += rowsum(k*dkr)
                dp_j += sum_r (dAqk_s[r,j] q_r + dAkk[r,j] beta_r k_r) e^{G_r-G_j}
                dG = q*dq + k*dk - p*dp,  plus at the chunk's last row
                     Gam_C * rowsum_V(h*dE) + sum_r p_r*dp_kg_r;   dg = in-chunk reverse cumsum(dG)
    bwd.atk     (p = k*m(a)): dk += dp*m;  dr = dp*k*m*(-log x)/(1+|r|)^2;  da = dr/(a+eps)
                reverse scan da_t += e^{g_atk_{t+1}} da_{t+1} (+ dat at T);  dc = -sum dr
                dg_atk_t = sum_d da_t e^{g_atk_t} a_{t-1};  dbeta_atk_t = sum_d da_t k_t^2
                dk_t += 2 beta_atk_t k_t da_t;  da_0 = e^{g_atk_1} da_1

e^{G_r-G_j} is always formed from the difference G_r-G_j (masked to j<=r before exp,
so every exponent is <= 0): never as a ratio e^{G_r}/e^{G_j}.
"""
from __future__ import annotations

import math

import torch

CHUNK = 64


def _chunks(T: int):
    return [(s, min(s + CHUNK, T)) for s in range(0, T, CHUNK)]


def pair_decay(G: torch.Tensor, strict: bool = False) -> torch.Tensor:
    """G [H,L,K] -> D [H,L,L,K], D[r,j] = exp(G_r - G_j) for j<=r (j<r if strict), else 0."""
    L = G.shape[1]
    mask = torch.ones(L, L, dtype=torch.bool, device=G.device).tril(-1 if strict else 0)
    diff = G[:, :, None, :] - G[:, None, :, :]
    return torch.exp(torch.where(mask[None, :, :, None], diff, torch.full_like(diff, -math.inf)))


# ----------------------------------------------------------------------------- bwd.recompute
def recompute(q, k, v, g, g_atk, beta_atk, beta, c, scale, x, eps, S0, a0):
    """Forward recompute of one sequence: a, r, m, p (fwd.atk); per chunk G, Akk, Aqk,
    Tinv, W, U (fwd.intra); h (state at each chunk start) and Delta (fwd.h); o (fwd.o)."""
    H, T, K = k.shape
    logx = math.log(x)
    a_all, a = [], a0
    for t in range(T):
        a = torch.exp(g_atk[:, t])[:, None] * a + beta_atk[:, t][:, None] * k[:, t] ** 2
        a_all.append(a)
    a_all = torch.stack(a_all, 1) if T else k.new_zeros(H, 0, K)
    r = torch.log(a_all + eps) - c[:, None, None]
    m = torch.exp(-logx * r / (1 + r.abs()))
    p = k * m
    out = dict(a=a_all, r=r, m=m, p=p, G=torch.zeros_like(g), W=torch.zeros_like(k),
               U=torch.zeros_like(v), Delta=torch.zeros_like(v), o=torch.zeros_like(v),
               Akk=[], Aqk=[], Tinv=[], h=[])
    S = S0
    for s, e in _chunks(T):
        L = e - s
        G = g[:, s:e].cumsum(1)
        Gam = torch.exp(G)
        D = pair_decay(G)
        qc, kc, pc, vc, bc = q[:, s:e], k[:, s:e], p[:, s:e], v[:, s:e], beta[:, s:e]
        eye = torch.eye(L, dtype=k.dtype, device=k.device)
        Akk = bc[:, :, None] * torch.einsum("hrd,hjd,hrjd->hrj", kc, pc, D) * (1 - eye).tril()
        Aqk = scale * torch.einsum("hrd,hjd,hrjd->hrj", qc, pc, D)
        Tinv = torch.linalg.solve_triangular(eye + Akk, eye.expand_as(Akk), upper=False,
                                             unitriangular=True)
        W = Tinv @ (bc[..., None] * kc * Gam)
        U = Tinv @ (bc[..., None] * vc)
        Delta = U - W @ S
        out["o"][:, s:e] = scale * (qc * Gam) @ S + Aqk @ Delta
        out["G"][:, s:e], out["W"][:, s:e], out["U"][:, s:e], out["Delta"][:, s:e] = G, W, U, Delta
        out["Akk"].append(Akk), out["Aqk"].append(Aqk), out["Tinv"].append(Tinv)
        out["h"].append(S)
        Kg = pc * torch.exp(G[:, -1:] - G)
        S = Gam[:, -1, :, None] * S + Kg.transpose(1, 2) @ Delta
    out["S_T"], out["a_T"] = S, a
    return out


# ----------------------------------------------------------------------------- bwd.dAv
def dAv(do, rc, scale):
    """dAqk_s (list of [H,L,L], scaled, causal inclusive) and the local dDelta = Aqk^T dO."""
    T = do.shape[1]
    dAqk, dv_loc = [], torch.zeros_like(do)
    for i, (s, e) in enumerate(_chunks(T)):
        dA = scale * (do[:, s:e] @ rc["Delta"][:, s:e].transpose(1, 2))
        dAqk.append(dA.tril())
        dv_loc[:, s:e] = rc["Aqk"][i].transpose(1, 2) @ do[:, s:e]
    return dAqk, dv_loc


# ----------------------------------------------------------------------------- bwd.dhu
def dhu(q, rc, do, dv_loc, dht, scale):
    """Reverse over chunks: dE[i] = dL/d(state at the END of chunk i), the full dDelta,
    and dL/dS_0."""
    T = do.shape[1]
    ch = _chunks(T)
    dE = torch.zeros_like(rc["h"][0]) if dht is None else dht.clone()
    dE_all = [None] * len(ch)
    dDelta = torch.zeros_like(do)
    for i in reversed(range(len(ch))):
        s, e = ch[i]
        dE_all[i] = dE
        G = rc["G"][:, s:e]
        Kg = rc["p"][:, s:e] * torch.exp(G[:, -1:] - G)
        dD = dv_loc[:, s:e] + Kg @ dE
        dDelta[:, s:e] = dD
        dE = (torch.exp(G[:, -1])[..., None] * dE
              + scale * (q[:, s:e] * torch.exp(G)).transpose(1, 2) @ do[:, s:e]
              - rc["W"][:, s:e].transpose(1, 2) @ dD)
    return dE_all, dDelta, dE


# ----------------------------------------------------------------------------- bwd.wy_dqkg
def wy_dqkg(q, k, v, beta, rc, dE_all, dDelta, do, scale):
    """Inter-chunk / WY part: dq, dk (erase key), dp (state write), dv, dbeta, dAkk (list,
    gradient of Akk incl. beta), and the dG terms of these parts incl. the last-row term."""
    T = do.shape[1]
    dq, dk, dp = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(k)
    dv, dbeta, dG = torch.zeros_like(v), torch.zeros_like(beta), torch.zeros_like(k)
    dAkk = []
    for i, (s, e) in enumerate(_chunks(T)):
        h, dE = rc["h"][i], dE_all[i]
        G = rc["G"][:, s:e]
        Gam = torch.exp(G)
        Dl = rc["Delta"][:, s:e]
        qc, kc, pc, vc, bc = q[:, s:e], k[:, s:e], rc["p"][:, s:e], v[:, s:e], beta[:, s:e]
        dq_c = scale * Gam * (do[:, s:e] @ h.transpose(1, 2))
        dp_c = (Dl @ dE.transpose(1, 2)) * torch.exp(G[:, -1:] - G)
        dX = rc["Tinv"][i].transpose(1, 2) @ dDelta[:, s:e]
        dXh = dX @ h.transpose(1, 2)
        dk_c = -bc[..., None] * Gam * dXh
        dv[:, s:e] = bc[..., None] * dX
        dbeta[:, s:e] = (dX * vc).sum(-1) - (kc * Gam * dXh).sum(-1)
        dAkk.append(-(dX @ Dl.transpose(1, 2)).tril(-1))
        dG_c = qc * dq_c + kc * dk_c - pc * dp_c
        dG_c[:, -1] += Gam[:, -1] * (h * dE).sum(-1) + (pc * dp_c).sum(1)
        dq[:, s:e], dk[:, s:e], dp[:, s:e], dG[:, s:e] = dq_c, dk_c, dp_c, dG_c
    return dict(dq=dq, dk=dk, dp=dp, dv=dv, dbeta=dbeta, dG=dG, dAkk=dAkk)


# ----------------------------------------------------------------------------- bwd.intra
def intra(q, k, beta, rc, dAqk, dAkk):
    """Intra-chunk part from dAqk_s and dAkk: dq, dk, dp, dbeta and their dG terms."""
    T = q.shape[1]
    dq, dk, dp = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(k)
    dbeta, dG = torch.zeros_like(beta), torch.zeros_like(k)
    for i, (s, e) in enumerate(_chunks(T)):
        G = rc["G"][:, s:e]
        D = pair_decay(G)
        qc, kc, pc, bc = q[:, s:e], k[:, s:e], rc["p"][:, s:e], beta[:, s:e]
        dq_c = torch.einsum("hrj,hjd,hrjd->hrd", dAqk[i], pc, D)
        dkr = torch.einsum("hrj,hjd,hrjd->hrd", dAkk[i], pc, D)
        dk_c = bc[..., None] * dkr
        dp_c = (torch.einsum("hrj,hrd,hrjd->hjd", dAqk[i], qc, D)
                + torch.einsum("hrj,hrd,hrjd->hjd", dAkk[i] * bc[..., None], kc, D))
        dq[:, s:e], dk[:, s:e], dp[:, s:e] = dq_c, dk_c, dp_c
        dbeta[:, s:e] = (kc * dkr).sum(-1)
        dG[:, s:e] = qc * dq_c + kc * dk_c - pc * dp_c
    return dict(dq=dq, dk=dk, dp=dp, dbeta=dbeta, dG=dG)


def chunk_reverse_cumsum(dG):
    """dg_t = sum_{s >= t in t's chunk} dG_s."""
    dg = torch.zeros_like(dG)
    for s, e in _chunks(dG.shape[1]):
        dg[:, s:e] = dG[:, s:e].flip(1).cumsum(1).flip(1)
    return dg


# ----------------------------------------------------------------------------- bwd.atk
def atk(k, g_atk, beta_atk, rc, dp, x, eps, a0, dat):
    """dp -> dk (via p = k m and a), dg_atk, dbeta_atk, dc (=dlog_atk_scale, per head),
    da_0. Reverse scan over tokens."""
    H, T, K = k.shape
    logx = math.log(x)
    a, r, m = rc["a"], rc["r"], rc["m"]
    dm = dp * k
    dr = dm * m * (-logx) / (1 + r.abs()) ** 2
    da_dir = dr / (a + eps)
    dk = dp * m
    dg_atk, dbeta_atk = torch.zeros_like(g_atk), torch.zeros_like(beta_atk)
    carry = torch.zeros_like(a0) if dat is None else dat.clone()
    for t in reversed(range(T)):
        da = da_dir[:, t] + carry
        a_prev = a[:, t - 1] if t > 0 else a0
        dg_atk[:, t] = (da * torch.exp(g_atk[:, t])[:, None] * a_prev).sum(-1)
        dbeta_atk[:, t] = (da * k[:, t] ** 2).sum(-1)
        dk[:, t] += 2 * beta_atk[:, t][:, None] * k[:, t] * da
        carry = torch.exp(g_atk[:, t])[:, None] * da
    dc = -dr.sum((1, 2))
    return dict(dk=dk, dg_atk=dg_atk, dbeta_atk=dbeta_atk, dc=dc, da0=carry)


# ----------------------------------------------------------------------------- whole backward
def bwd_sequence(q, k, v, g, g_atk, beta_atk, beta, c, scale, x, eps, S0, a0, do, dht, dat):
    """All stages for one sequence ([H,T,*] layout). Returns a dict of gradients."""
    rc = recompute(q, k, v, g, g_atk, beta_atk, beta, c, scale, x, eps, S0, a0)
    dAqk, dv_loc = dAv(do, rc, scale)
    dE_all, dDelta, dS0 = dhu(q, rc, do, dv_loc, dht, scale)
    wy = wy_dqkg(q, k, v, beta, rc, dE_all, dDelta, do, scale)
    it = intra(q, k, beta, rc, dAqk, wy["dAkk"])
    dp = wy["dp"] + it["dp"]
    dg = chunk_reverse_cumsum(wy["dG"] + it["dG"])
    at = atk(k, g_atk, beta_atk, rc, dp, x, eps, a0, dat)
    return dict(q=wy["dq"] + it["dq"], k=wy["dk"] + it["dk"] + at["dk"], v=wy["dv"], g=dg,
                g_atk=at["dg_atk"], beta_atk=at["dbeta_atk"], beta=wy["dbeta"] + it["dbeta"],
                log_atk_scale=at["dc"], initial_state=dS0, initial_A_state=at["da0"])


def _seq_bounds(B, T, cu_seqlens):
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cs = [int(i) for i in cu_seqlens.tolist()]
    return [(0, cs[n], cs[n + 1]) for n in range(len(cs) - 1)]


def pkda_bwd_reference(q, k, v, g, g_atk, beta_atk, beta, log_atk_scale, scale, x, eps,
                       initial_state, initial_A_state, cu_seqlens, do, dht, dat, saved=None,
                       dtype=None):
    """Same contract as kernels.pkda.bwd.pkda_bwd (q, k already normalised); math in
    `dtype` (default: fp32, or fp64 if q is fp64). Gradients returned in that dtype."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    cd = dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    f = lambda t: None if t is None else t.to(cd)  # noqa: E731
    q, k, v, g, g_atk, beta_atk, beta, do = map(f, (q, k, v, g, g_atk, beta_atk, beta, do))
    c = (torch.full((H,), float(log_atk_scale)) if isinstance(log_atk_scale, (int, float))
         else log_atk_scale).to(cd).reshape(H)
    bounds = _seq_bounds(B, T, cu_seqlens)
    N = len(bounds)
    out = {n: torch.zeros_like(t) for n, t in
           dict(q=q, k=k, v=v, g=g, g_atk=g_atk, beta_atk=beta_atk, beta=beta).items()}
    out["log_atk_scale"] = torch.zeros(H, dtype=cd)
    dS0 = torch.zeros(N, H, K, V, dtype=cd)
    da0 = torch.zeros(N, H, K, dtype=cd)
    tr = lambda t, b, s, e: t[b, s:e].transpose(0, 1)  # [T,H,*] -> [H,T,*]  # noqa: E731
    for n, (b, s, e) in enumerate(bounds):
        S0 = initial_state[n].to(cd) if initial_state is not None else torch.zeros(H, K, V, dtype=cd)
        a0 = initial_A_state[n].to(cd) if initial_A_state is not None else torch.zeros(H, K, dtype=cd)
        args = [tr(t, b, s, e) for t in (q, k, v, g, g_atk, beta_atk, beta)]
        gr = bwd_sequence(*args, c, scale, x, eps, S0, a0, tr(do, b, s, e),
                          None if dht is None else dht[n].to(cd),
                          None if dat is None else dat[n].to(cd))
        for name in ("q", "k", "v", "g", "g_atk", "beta_atk", "beta"):
            out[name][b, s:e] = gr[name].transpose(0, 1)
        out["log_atk_scale"] += gr["log_atk_scale"]
        dS0[n], da0[n] = gr["initial_state"], gr["initial_A_state"]
    out["initial_state"] = dS0 if initial_state is not None else None
    out["initial_A_state"] = da0 if initial_A_state is not None else None
    return out
