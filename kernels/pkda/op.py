"""Public PKDA op: `chunk_precond_kda`, same contract as fla-core 0.6.0's public op.

    chunk_precond_kda(q, k, v, g, g_atk, beta_atk, beta, scale=None, initial_state=None,
                      initial_A_state=None, output_final_state=False, use_gate_in_kernel=False,
                      safe_gate=False, lower_bound=None, cu_seqlens=None, cu_seqlens_cpu=None,
                      chunk_indices=None, cp_context=None, transpose_state_layout=False, x=1.5,
                      eps=1e-6, log_atk_scale=None, solve_tril_precision=None,
                      disable_recompute=False, return_intermediate_states=False, *,
                      A_log=None, dt_bias=None, use_qk_l2norm_in_kernel=True)
        -> (o, final_state, final_A_state), or (o, final_state, final_A_state, h) with
           return_intermediate_states

Every keyword of the public op is accepted (the public one also swallows any unknown
keyword through **kwargs; this one raises TypeError naming it). Scalars (scale, x, eps,
lower_bound, a float log_atk_scale) must be finite real numbers, x > 0, eps > 0.

q, k are L2-normalised over K inside (stage fwd.l2norm / bwd.l2norm); gates are natural-log
decays; scale defaults to K^-1/2 and log_atk_scale to a tensor of -0.2 per head. The finals
are None unless output_final_state (no state tensor is then allocated or written).
Differentiable w.r.t. q, k, v, g, g_atk, beta_atk, beta, log_atk_scale, initial_state,
initial_A_state (and A_log, dt_bias with use_gate_in_kernel) through `PKDAFunction`, whose
backward calls `kernels.pkda.bwd.pkda_bwd`; gradients also flow from final_state and
final_A_state (dht, dat). Every stage runs inside an NVTX range `pkda.fwd.<stage>` /
`pkda.bwd.<stage>` opened inside the Function's forward / backward, i.e. on the thread that
launches its kernels. See `chunk_precond_kda` for what is done in PyTorch around the kernels
(head-dim padding, state transposition, the in-kernel gate, the gate floor).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .checks import (check_cu_seqlens_meta, check_cu_seqlens_values, check_gate_params, check_inputs,
                     check_scalars, check_states, real_scalar)
from .ranges import stage_range
from .fwd import SUPPORTED_DIMS, l2norm_bwd, pkda_fwd
from .reference import host_cu_seqlens, make_layout

# Head dims the kernels take; any K, V in [1, MAX_DIM] is zero-padded up to the next one.
MAX_DIM = max(SUPPORTED_DIMS)


def kernel_dim(D):
    """The head dim the kernels run at for a user head dim D <= MAX_DIM."""
    return next(s for s in SUPPORTED_DIMS if s >= D)


def validate(q, k, v, g, g_atk, beta_atk, beta, initial_state, initial_A_state, cu_seqlens,
             log_atk_scale, transpose_state_layout=False):
    """Raises ValueError / TypeError naming the offending argument.
    Returns cu_seqlens's values as a host tuple (None when dense), from
    reference.host_cu_seqlens: the call's only host sync, and none when the same tensor
    object was read before and not written since. The value checks run on every call (on the
    host copy, no sync): T may differ between calls with one cu_seqlens.
    With transpose_state_layout, initial_state is expected as [N,H,V,K]."""
    B, T, H, K, V, _ = check_inputs(q, k, v, g, g_atk, beta_atk, beta, MAX_DIM)

    if cu_seqlens is not None:
        check_cu_seqlens_meta(cu_seqlens, B, q.device)
        cs = host_cu_seqlens(cu_seqlens)
        check_cu_seqlens_values(cs, T)
        N = len(cs) - 1
    else:
        N, cs = B, None

    check_states(initial_state, initial_A_state, log_atk_scale, N, H, K, V, varlen=cu_seqlens is not None,
                 device=q.device, transpose_state_layout=transpose_state_layout)
    return cs


class PKDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, g_atk, beta_atk, beta, log_atk_scale, initial_state,
                initial_A_state, scale, output_final_state, cu_seqlens, x, eps, host_cu,
                disable_recompute=False):
        B, T, H, K = q.shape
        layout = make_layout(B, T, cu_seqlens, q.device, host_cu=host_cu)
        c = log_atk_scale.to(torch.float32).reshape(H).contiguous()
        o, S_fin, a_fin, saved = pkda_fwd(
            q, k, v, g, g_atk, beta_atk, beta, scale, c, initial_state, initial_A_state,
            output_final_state, cu_seqlens, x, eps, layout=layout, save_for_backward=True,
            keep_intermediates=disable_recompute)
        from .bwd import KEPT_BY_DEFAULT, RECOMPUTE_KEYS
        # Aqk and Tinv (the 64x64 solve) are always kept: the backward then rebuilds W and U
        # with two GEMMs instead of re-running fwd.intra; disable_recompute keeps everything
        kept_keys = RECOMPUTE_KEYS if disable_recompute else KEPT_BY_DEFAULT
        ctx.save_for_backward(saved["q_n"], saved["k_n"], saved["q_rstd"], saved["k_rstd"], v, g,
                              g_atk, beta_atk, beta, c, initial_state, initial_A_state, cu_seqlens,
                              *(saved[n] for n in kept_keys))
        # the layout goes to the backward too: rebuilding it there would look cu_seqlens's
        # values up again (varlen; a read-back unless reference.host_cu_seqlens still holds them)
        ctx.meta = dict(scale=scale, x=x, eps=eps, lsc_dtype=log_atk_scale.dtype,
                        lsc_shape=log_atk_scale.shape, kept_keys=kept_keys, layout=layout,
                        dtypes=[t.dtype for t in (q, k, v, g, g_atk, beta_atk, beta)])
        ctx.set_materialize_grads(False)
        return o, S_fin, a_fin

    @staticmethod
    def backward(ctx, do, dht, dat):
        from .bwd import pkda_bwd
        (q_n, k_n, q_rstd, k_rstd, v, g, g_atk, beta_atk, beta, c, S0, a0,
         cu_seqlens) = ctx.saved_tensors[:13]
        m = ctx.meta
        saved = dict(zip(m["kept_keys"], ctx.saved_tensors[13:]), layout=m["layout"])
        if do is None:
            do = torch.zeros_like(v)
        gr = pkda_bwd(q_n, k_n, v, g, g_atk, beta_atk, beta, c, m["scale"], m["x"], m["eps"],
                      S0, a0, cu_seqlens, do, dht, dat, saved=saved)
        dts = m["dtypes"]
        with stage_range("pkda.bwd.l2norm"):
            dq = l2norm_bwd(q_n, q_rstd, gr["q"], out_dtype=dts[0])
            dk = l2norm_bwd(k_n, k_rstd, gr["k"], out_dtype=dts[1])
        cast = lambda t, dt: None if t is None else t.to(dt)
        dc = cast(gr["log_atk_scale"], m["lsc_dtype"])
        dc = None if dc is None else dc.reshape(m["lsc_shape"])
        return (dq, dk, cast(gr["v"], dts[2]), cast(gr["g"], dts[3]), cast(gr["g_atk"], dts[4]),
                cast(gr["beta_atk"], dts[5]), cast(gr["beta"], dts[6]), dc,
                cast(gr["initial_state"], torch.float32), cast(gr["initial_A_state"], torch.float32),
                None, None, None, None, None, None, None)


def kda_gate(g, A_log, dt_bias=None, lower_bound=None):
    """The public op's in-kernel gate (use_gate_in_kernel=True), in PyTorch and fp32:
        lower_bound is None:  -exp(A_log_h) * softplus(g + dt_bias_{h,k})
        otherwise:            lower_bound * sigmoid(exp(A_log_h) * (g + dt_bias_{h,k}))
    g [B,T,H,K]; A_log [H] (any shape of H elements); dt_bias [H*K] or [H,K] or None.
    Returns the log decay [B,T,H,K] fp32, differentiable w.r.t. g, A_log and dt_bias."""
    H, K = g.shape[-2:]
    s = g.float()
    if dt_bias is not None:
        s = s + dt_bias.float().reshape(H, K)
    A = A_log.float().reshape(H, 1).exp()
    if lower_bound is None:
        return -A * F.softplus(s)
    return lower_bound * torch.sigmoid(A * s)


def chunk_precond_kda(q, k, v, g, g_atk, beta_atk, beta, scale=None, initial_state=None,
                      initial_A_state=None, output_final_state=False, use_gate_in_kernel=False,
                      safe_gate=False, lower_bound=None, cu_seqlens=None, cu_seqlens_cpu=None,
                      chunk_indices=None, cp_context=None, transpose_state_layout=False, x=1.5,
                      eps=1e-6, log_atk_scale=None, solve_tril_precision=None,
                      disable_recompute=False, return_intermediate_states=False, *, A_log=None,
                      dt_bias=None, use_qk_l2norm_in_kernel=True):
    """Preconditioned KDA, chunked Triton implementation. See the module docstring.

    q, k [B,T,H,K]; v [B,T,H,V]; g [B,T,H,K]; g_atk, beta_atk, beta [B,T,H]; K, V any size in
    [1, 256] (K != V allowed); initial_state fp32 [N,H,K,V] ([N,H,V,K] with
    transpose_state_layout); initial_A_state [N,H,K] fp32; cu_seqlens [N+1] integer on q's
    device or the CPU (B must be 1); log_atk_scale [H] tensor (or a float, or None for -0.2);
    scale (default K^-1/2), x > 0 and eps > 0 finite real numbers.
    Returns (o [B,T,H,V] in v.dtype, final_state fp32 | None (same layout as initial_state),
    final_A_state [N,H,K] fp32 | None).

    The keywords are the public op's (fla-core 0.6.0 and fla at the seed baseline), which
    takes A_log and dt_bias through **kwargs and ignores any other; here every keyword is
    named, so a misspelt or foreign one raises TypeError naming it. As there:
      use_gate_in_kernel  g is the raw gate input: the log decay is kda_gate(g, A_log, dt_bias,
                          lower_bound) (A_log [H] required, dt_bias [H*K] optional; gradients
                          reach both). Here it is computed in PyTorch (fp32) before the kernels,
                          not fused into them.
      lower_bound         only used by the in-kernel gate (its sigmoid form); with safe_gate and
                          use_gate_in_kernel it must lie in [-5, 0), as the public op demands.
      safe_gate           a promise that gates lie in [lower_bound, 0) which lets the public
                          kernels take a faster path; these kernels bound every exponent for
                          any gate, so it is validated as above and changes nothing else.
      transpose_state_layout  initial and final states are [N,H,V,K] (transposed here; the
                          kernels keep [K,V]).
      disable_recompute   keep the forward's intermediates (a, p, G, Aqk, Tinv, W, U, h,
                          Delta) for the backward instead of recomputing them: same kernels,
                          same gradients, more memory.
      return_intermediate_states  inference only (inside torch.inference_mode(), with
                          disable_recompute=False, as the public op asserts): returns a 4th
                          output h [B,NT,H,K,V] ([B,NT,H,V,K] with transpose_state_layout;
                          B=1 and NT = all chunks of all sequences with cu_seqlens), the state
                          entering each 64-token chunk, in k's dtype.
      use_qk_l2norm_in_kernel  accepted for calls written for the public op's signature and
                          ignored, as there: q and k are always L2-normalised.
      cu_seqlens_cpu, chunk_indices, solve_tril_precision  accepted and unused (hints; the
                          op derives its own chunk layout, and its triangular solve is fp32).
      cp_context          not supported, as in the public op (NotImplementedError).

    Done in PyTorch around the kernels (autograd differentiates through it):
      * K or V not in {64, 128, 256}: q, k, g (and the K side of the states) are zero-padded to
        the next of 64 / 128 / 256, v (and the V side) likewise, and the outputs sliced back. This is
        exact: a zero channel of k adds nothing to |k|^2 (l2norm unchanged), keeps its ATK
        moment a at 0 (a_0 padded with 0), so p = k*m is 0 there whatever m is; with S_0's padded
        rows 0, those rows of S stay 0 (decay times 0 plus p*delta = 0) and contribute nothing
        to S'^T k or S^T q. A zero column of v gives delta = 0 - S'^T k = 0 in that column, so
        it stays 0 and o's padded columns are 0. Gradients w.r.t. the real entries are the
        same for the same reason (every path through a padded channel is multiplied by a zero
        of k, p, q or a); gradients of the padding are dropped by the slice.
      * the gate floor: g and g_atk are clamped to >= -GATE_FLOOR (-24; fwd.GATE_FLOOR, applied
        inside the kernels where they first read the gates). The kernels work on
        chunk-local cumulative sums of the gates; one -1000 entry would put every later
        cumulative sum of its chunk near -1000, where fp32 keeps only ~1e-4 of the small
        differences exp(G_r - G_j) needs (a 1e-3 relative error was measured). A decay
        exp(-24) = 3.8e-11 instead of exp(-1000) changes results far below fp32 resolution;
        the clamp's gradient is 0 below the floor, where the true one is < 4e-11 relative.
    """
    if cp_context is not None:
        raise NotImplementedError("cp_context (context parallelism) is not supported by this "
                                  "chunk_precond_kda")
    if return_intermediate_states:
        if not torch.is_inference_mode_enabled():
            raise ValueError("return_intermediate_states=True is for inference: call it inside "
                             "torch.inference_mode() (it bypasses autograd)")
        if disable_recompute:
            raise ValueError("return_intermediate_states=True needs disable_recompute=False")
    host_cu = validate(q, k, v, g, g_atk, beta_atk, beta, initial_state, initial_A_state,
                       cu_seqlens, log_atk_scale, transpose_state_layout)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale, x, eps = check_scalars(K ** -0.5 if scale is None else scale, x, eps, lower_bound)
    if log_atk_scale is None:
        log_atk_scale = -0.2
    if not torch.is_tensor(log_atk_scale):
        log_atk_scale = torch.full((H,), real_scalar("log_atk_scale", log_atk_scale),
                                   dtype=torch.float32, device=q.device)
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise ValueError("lower_bound must be given when safe_gate=True and "
                             "use_gate_in_kernel=True")
        if not -5 <= lower_bound < 0:
            raise ValueError(f"lower_bound must lie in the safe range [-5, 0), got {lower_bound}")
    if use_gate_in_kernel:
        check_gate_params(A_log, dt_bias, H, K, q.device)
        g = kda_gate(g, A_log, dt_bias, lower_bound)

    S0 = initial_state
    if S0 is not None and transpose_state_layout:
        S0 = S0.transpose(-1, -2)
    Kp, Vp = kernel_dim(K), kernel_dim(V)
    if Kp != K:
        q, k, g = (F.pad(t, (0, Kp - K)) for t in (q, k, g))
        if initial_A_state is not None:
            initial_A_state = F.pad(initial_A_state, (0, Kp - K))
    if Vp != V:
        v = F.pad(v, (0, Vp - V))
    if S0 is not None:
        S0 = F.pad(S0, (0, Vp - V, 0, Kp - K)) if (Kp, Vp) != (K, V) else S0
        S0 = S0.contiguous()

    unpad_state = lambda t: _unpad_state(t, K, V, transpose_state_layout)
    if return_intermediate_states:
        layout = make_layout(B, T, cu_seqlens, q.device, host_cu=host_cu)
        c = log_atk_scale.to(torch.float32).reshape(H).contiguous()
        # keep_intermediates is the forward's one way to hand out h (it also keeps a, W, U, ...)
        o, S, a, saved = pkda_fwd(q, k, v, g, g_atk, beta_atk, beta, scale, c, S0,
                                  initial_A_state, bool(output_final_state), cu_seqlens, x, eps,
                                  layout=layout, save_for_backward=True, keep_intermediates=True)
        NT = layout.NT // B  # dense: every row has the same chunks; varlen: B = 1
        h = unpad_state(saved["h"].reshape(B, NT, H, Kp, Vp))
    else:
        o, S, a = PKDAFunction.apply(q, k, v, g, g_atk, beta_atk, beta, log_atk_scale, S0,
                                     initial_A_state, scale, bool(output_final_state),
                                     cu_seqlens, x, eps, host_cu, bool(disable_recompute))
    if Vp != V:
        o = o[..., :V]
    if S is not None:
        S = unpad_state(S)
    if a is not None and Kp != K:
        a = a[..., :K].contiguous()
    if return_intermediate_states:
        return o, S, a, h
    return o, S, a


def _unpad_state(S, K, V, transpose_state_layout):
    """A kernel-layout state [..., Kp, Vp] back to the caller's [..., K, V] (or [..., V, K])."""
    if tuple(S.shape[-2:]) != (K, V):
        S = S[..., :K, :V]
    if transpose_state_layout:
        S = S.transpose(-1, -2)
    return S if S.is_contiguous() else S.contiguous()
