"""The frozen oracle of experiments/fla-*.yaml: fla's own naive reference, adapted to the op's call.

fla's `naive_recurrent_precond_kda` (fla/ops/precond_kda/naive.py, a frozen path) takes q and k as
they are, while `chunk_precond_kda` always L2-normalises them first, and it has no `cu_seqlens`.
This adapter (named by `fixtures.reference`, frozen by its SHA-256 in the BENCH_BASE manifest) does
what fla's own tests do around it: it L2-normalises q and k, and runs a varlen batch one sequence
at a time. The inputs stay what the op gets; gradients flow through the normalisation, so dq and dk
are the op's. It runs inside the oracle worker after the side's worktree is first on sys.path, so
`fla` below is the baseline's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_precond_kda_l2norm(q, k, v, g, g_atk, beta_atk, beta, log_atk_scale=None, x=1.5, cu_seqlens=None,
                             scale=None):
    from fla.ops.precond_kda.naive import naive_recurrent_precond_kda

    q, k = F.normalize(q.float(), p=2, dim=-1), F.normalize(k.float(), p=2, dim=-1)

    def one(lo: int, hi: int):
        o, _, _ = naive_recurrent_precond_kda(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], g_atk[:, lo:hi],
                                              beta_atk[:, lo:hi], beta[:, lo:hi], scale=scale, x=x,
                                              log_atk_scale=log_atk_scale)
        return o

    if cu_seqlens is None:
        return one(0, q.shape[1]), None, None
    bounds = cu_seqlens.tolist()
    return torch.cat([one(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])], dim=1), None, None
