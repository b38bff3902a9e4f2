"""Backward of preconditioned KDA (PKDA), Triton kernels + launchers, chunk 64.

Interface (agreed with kernels/pkda/op.py; the op does the L2-norm backward itself)
-----------------------------------------------------------------------------------

    pkda_bwd(q, k, v, g, g_atk, beta_atk, beta, log_atk_scale, scale, x, eps,
             initial_state, initial_A_state, cu_seqlens, do, dht, dat, saved=None)
        -> dict(q=, k=, v=, g=, g_atk=, beta_atk=, beta=, log_atk_scale=,
                initial_state=, initial_A_state=)

Arguments (same layout as the forward, B=1 when cu_seqlens is given):
    q, k            [B,T,H,K]  ALREADY L2-normalised over K (any float dtype)
    v               [B,T,H,V]
    g               [B,T,H,K]  per-channel log decay (natural log, <= 0), NOT cumsummed
    g_atk           [B,T,H]    scalar log decay of the ATK second moment
    beta_atk, beta  [B,T,H]
    log_atk_scale   [H]        c_h
    scale, x, eps   python floats (scale already resolved, x > 1)
    initial_state   [N,H,K,V] fp32 or None (zeros)
    initial_A_state [N,H,K]   fp32 or None (zeros)
    cu_seqlens      [N+1] int (torch.long/int32) or None (dense: N = B)
    do              [B,T,H,V]  gradient of o
    dht             [N,H,K,V] or None   gradient of the final state S_T
    dat             [N,H,K]   or None   gradient of the final A state a_T
    saved           optional dict from the forward; ignored today (everything
                    is recomputed from the inputs: stage bwd.recompute)

Returns a dict of FP32 gradients, same shapes as the matching inputs:
    q, k (w.r.t. the normalised q, k), v, g, g_atk, beta_atk, beta, log_atk_scale [H],
    initial_state [N,H,K,V] (None if initial_state is None),
    initial_A_state [N,H,K] (None if initial_A_state is None).
The caller casts to the input dtypes.

Semantics: gradients of  sum(o*do) + sum(S_T*dht) + sum(a_T*dat)  for the recurrence
of shared/design/pkda.md (a_t, r_t, m_t, p_t = k_t m_t, S_t, o_t = S_t^T (scale q_t)).

Stages (each inside NVTX range ``pkda.bwd.<stage>``): recompute, dAv, dhu, wy_dqkg,
intra, atk.  ``bwd.dAv`` + ``bwd.intra`` (+ beta reduction) sit behind one seam,
``_dAv_and_intra``, whose schedule is chosen by ``daqk_schedule`` ("materialised" by
default).
"""
