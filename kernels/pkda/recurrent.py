"""Fused recurrent PKDA for decode and inference prefill (forward only).

    fused_recurrent_precond_kda(q, k, v, g, g_atk, beta_atk, beta, A_log=None, dt_bias=None,
                                scale=None, initial_state=None, initial_A_state=None,
                                output_final_state=False, use_qk_l2norm_in_kernel=True,
                                use_gate_in_kernel=False, lower_bound=None, cu_seqlens=None,
                                transpose_state_layout=False, x=1.5, eps=1e-6,
                                log_atk_scale=None, *, ssm_state_indices=None,
                                num_accepted_tokens=None) -> (o, final_state, final_A_state)

The public op's signature (fla-core 0.6.0 and fla at the seed baseline: same positions, same
defaults). The public op also swallows unknown keywords through **kwargs, among them
ssm_state_indices and num_accepted_tokens, which it never passes to its kernel; here those
two are implemented (below) and any other keyword raises TypeError naming it.

Same math as `chunk_precond_kda` (and the oracle `naive_recurrent_precond_kda`):
q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K] natural-log per-channel decay; g_atk, beta_atk,
beta [B,T,HV]; HV = H, or a multiple of H (grouped value heads: value head j reads q and k
of head j // (HV/H), as the public kernel does); initial_state [N,HV,K,V] fp32 ([N,HV,V,K]
with transpose_state_layout, as is final_state); initial_A_state [N,HV,K] fp32; cu_seqlens
[N+1] integer with B == 1 (N packed sequences; empty sequences allowed: their state passes
through unchanged, bit for bit); log_atk_scale [HV] tensor, a float, or None (-0.2); scale
defaults to K^-1/2; scale, x > 0, eps > 0 finite real numbers.
  use_qk_l2norm_in_kernel  True (default): q and k are L2-normalised over K inside
                          (x * rsqrt(sum x^2 + 1e-6), as the chunk op); False: used as given.
  use_gate_in_kernel      g is the raw gate input; the log decay is, per value head h and
                          channel d, -exp(A_log_h) softplus(g + dt_bias_{h,d}), or with
                          lower_bound, lower_bound sigmoid(exp(A_log_h) (g + dt_bias_{h,d}))
                          (A_log [HV] required, dt_bias [HV*K] optional), computed in the
                          kernel in fp32.
Returns o [B,T,HV,V] in v.dtype (with cu_seqlens, tokens past cu_seqlens[-1] belong to no
sequence and are zero), final_state and final_A_state fp32, or None for both unless
output_final_state: then no state tensor is allocated and the kernel's state stores are
compiled out (constexpr STORE_FINAL).

State pools (serving engines' decode; continuous batching and speculative decoding):
  ssm_state_indices [N] or [N,S] integer: initial_state [P,HV,K,V] and initial_A_state
    [P,HV,K] are then pools of P slots (both required, fp32, contiguous) that are read and
    updated IN PLACE, and returned as final_state and final_A_state whatever
    output_final_state says.
    [N]: sequence n starts from slot idx[n] and its final state is written back to idx[n].
    [N,S]: sequence n starts from slot idx[n, 0] and the state after its token t is written
      to slot idx[n, t] (S >= its length), as the public kernel's in-place mode does.
      (For one token per sequence both forms are the public kernel's; with a 1-D index and
      longer sequences the public kernel writes token t's state to idx[n + t], i.e. into
      other sequences' slots, which is not reproduced.)
  num_accepted_tokens [N] integer in [1, S] (needs a 2-D index): sequence n starts from slot
    idx[n, num_accepted_tokens[n] - 1] (the last accepted draft token's state).
  Slots used by different sequences must be distinct (each sequence's state is read and
  written by its own programs, in no defined order against other sequences').
  The A-state of every sequence is copied out of its pool slot by a small kernel before the
  main one: the main kernel's value-block programs all read the A-state and only block 0
  writes it, so reading it from the pool in place would race with that write.

Kernel: one program per (sequence, value head, value block of BV columns), all in grid X
(limit 2^31-1; Y and Z stay 1, never sequences x heads there). It scans the sequence's
tokens one by one with the state S [K, BV] and the A-state a [K] in registers, FP32 math
whatever the input dtype. Each value-block program recomputes the (cheap, [K]-sized)
a/m/p chain; only the program of value block 0 stores the A-state. K and V may be any size
up to 256 (padded to a power of two and masked), K != V allowed.

Inference only: when grad mode is on and any tensor input requires grad, it raises
ValueError pointing at `chunk_precond_kda` (the differentiable chunk op) instead of silently
detaching. Under torch.no_grad / inference_mode, parameters with requires_grad are accepted.

Index validation (cu_seqlens, ssm_state_indices, num_accepted_tokens; the mechanism and its
limits):
  * Metadata checks always run on the host (tensor, dims, integer dtype, entry counts, B == 1
    for cu_seqlens, on q's device or the CPU). They read no values.
  * Value checks on the host (cu_seqlens starts at 0, is non-decreasing, ends <= T; slots in
    [0, P); num_accepted_tokens in [1, S]; no sequence longer than S with a 2-D index) run
    when the tensors can be read without a device sync, i.e. when they live on the CPU (they
    are then copied to q's device). A device-resident index is not read by the host (no sync
    per call).
  * A device-side guard is always compiled in (plain arithmetic, not `tl.device_assert`,
    which Triton compiles out unless TRITON_DEBUG): every program loads its bos/eos and slots,
    flags the sequence invalid unless 0 <= bos <= eos <= T (and bos == 0 for the first
    sequence) and every slot it reads or writes lies in the pools, clamps, and an invalid
    sequence processes no token (no read or write of q/k/v/g/o rows, no state written; its
    final state, without pools, is zero). Every adjacent pair of cu_seqlens entries is
    checked by some program, so every violation of the contract is caught. The violation is
    recorded (atomic OR of a bit code: 1 nonzero start, 2 negative entry, 4 decreasing,
    8 past T, 16 slot outside the pools, 32 num_accepted_tokens out of range, 64 a sequence
    longer than its row of slots) into a sticky per-device int32 error flag.
  * Outside CUDA-graph capture, a launch with an index not validated on the host reads that
    flag afterwards (one 4-byte device->host sync) and raises ValueError naming the
    argument; the flag is reset when it is reported.
  * Inside CUDA-graph capture nothing is read on the host and nothing can raise at replay:
    the guard keeps the replay memory-safe (no out-of-bounds access) and the flag records the
    violation; call `check_recurrent_indices(device)` after a replay to raise, or the next
    eager launch with a device-resident index raises (the message says the violation may
    come from an earlier graph replay). The flag is shared by all launches on a device, so
    with several streams in flight a violation cannot be pinned to one launch.
  * After a violation the outputs are meaningless (o rows of skipped sequences stay zero;
    with decreasing offsets, valid neighbours may overlap and write the same rows); only
    memory safety and the report are guaranteed. The guard trusts the tensors' metadata
    (numel, dtype, device): an index must really hold numel entries.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .checks import (check_cu_seqlens_meta, check_cu_seqlens_values, check_gate_params,
                     check_index_device, check_inputs, check_scalars, check_states, real_scalar)

L2NORM_EPS = 1e-6          # eps of the q/k L2 normalisation (the chunk op's)
MAX_DIM = 256              # K and V: any size up to this (masked to the next power of two)
GRID_X_MAX = 2 ** 31 - 1
GRID_YZ_MAX = 65535
# the device guard's bit codes (written as literals in the kernels), what each names
ERR_CU_START, ERR_CU_NEGATIVE, ERR_CU_DECREASING, ERR_CU_PAST_T = 1, 2, 4, 8
ERR_SLOT, ERR_ACCEPTED, ERR_SLOTS_SHORT = 16, 32, 64
ERR_CODES = ((ERR_CU_START, "cu_seqlens", "first entry is not 0"),
             (ERR_CU_NEGATIVE, "cu_seqlens", "negative entry"),
             (ERR_CU_DECREASING, "cu_seqlens", "decreasing entries"),
             (ERR_CU_PAST_T, "cu_seqlens", "entry past T (the token capacity)"),
             (ERR_SLOT, "ssm_state_indices", "slot outside the state pools [0, P)"),
             (ERR_ACCEPTED, "num_accepted_tokens", "entry outside [1, slots per sequence]"),
             (ERR_SLOTS_SHORT, "ssm_state_indices", "a sequence has more tokens than its row of slots"))
GATE_NONE, GATE_SOFTPLUS, GATE_SIGMOID = 0, 1, 2      # the kernel's GATE: how g becomes a log decay
SLOTS_NONE, SLOTS_PER_SEQUENCE, SLOTS_PER_TOKEN = 0, 1, 2  # its SLOTS: 1-D or 2-D ssm_state_indices
_GRAD_NAMES = ("q", "k", "v", "g", "g_atk", "beta_atk", "beta", "initial_state",
               "initial_A_state", "log_atk_scale", "A_log", "dt_bias")


def block_v(V: int) -> int:
    """Value-block width: 32 columns (fewer for V < 32): S is [K, BV] fp32 in registers."""
    return min(32, triton.next_power_of_2(V))


def grid_recurrent(N: int, H: int, V: int, BV: int):
    """1-D grid: sequences x (value) heads x value blocks all in X; Y and Z are always 1."""
    grid = (N * H * triton.cdiv(V, BV), 1, 1)
    if grid[0] > GRID_X_MAX:
        raise ValueError(f"fused_recurrent_precond_kda: {N} sequences x {H} heads x "
                         f"{triton.cdiv(V, BV)} value blocks exceed the CUDA grid-X limit")
    assert grid[1] <= GRID_YZ_MAX and grid[2] <= GRID_YZ_MAX
    return grid


# ---------------------------------------------------------------- device error flag
_ERR_FLAGS: dict = {}


def _err_flag(device: torch.device) -> torch.Tensor:
    """The sticky per-device int32 error flag (created zeroed on first use)."""
    key = str(device)
    flag = _ERR_FLAGS.get(key)
    if flag is None:
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        _ERR_FLAGS[key] = flag
    return flag


def describe_violation(code: int) -> str:
    """'cu_seqlens is invalid (decreasing entries); ssm_state_indices is invalid (...)'."""
    by_arg: dict[str, list[str]] = {}
    for bit, arg, what in ERR_CODES:
        if code & bit:
            by_arg.setdefault(arg, []).append(what)
    return "; ".join(f"{arg} is invalid ({', '.join(whats)})" for arg, whats in by_arg.items()) \
        or f"an index input is invalid (code {code})"


def check_recurrent_indices(device=None) -> None:
    """Raise ValueError if a fused recurrent launch on `device` met an invalid cu_seqlens,
    ssm_state_indices or num_accepted_tokens since the last check (e.g. during a CUDA-graph
    replay), and reset the flag. Syncs the device."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    flag = _ERR_FLAGS.get(str(torch.device(device)))
    if flag is None:
        return
    code = int(flag.item())
    if code:
        flag.zero_()
        raise ValueError(
            f"{describe_violation(code)}: fused_recurrent_precond_kda's device guard skipped the "
            f"offending sequences (their outputs are zero / meaningless, no pool slot written). "
            f"cu_seqlens must start at 0, be non-decreasing and end at <= T; slots must lie in "
            f"[0, P) and num_accepted_tokens in [1, S]. The violation may come from this launch "
            f"or an earlier CUDA-graph replay since the last check.")


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _host_readable(t: torch.Tensor) -> bool:
    """Whether the host may read an index tensor's values without a device sync."""
    return t.device.type == "cpu"


# ---------------------------------------------------------------- kernels
@triton.jit
def _softplus(x):
    # log(1 + e^x); past 20 it equals x to fp32 precision, and e^x must not overflow
    return tl.where(x > 20., x, tl.log(1. + tl.exp(tl.minimum(x, 20.))))


@triton.jit
def _slot_in(slots, accepted, i_n, NS, P, SPEC: tl.constexpr):
    """The pool slot sequence i_n starts from (0 when invalid) and its guard code."""
    row = i_n.to(tl.int64) * NS
    if SPEC:
        acc = tl.load(accepted + i_n).to(tl.int64)
        code = tl.where((acc < 1) | (acc > NS), 32, 0)
        j0 = tl.minimum(tl.maximum(acc - 1, 0), NS - 1)
    else:
        code = tl.zeros([], tl.int32)
        j0 = 0
    s = tl.load(slots + row + j0).to(tl.int64)
    bad = (s < 0) | (s >= P)
    return tl.where(bad, 0, s), code | tl.where(bad, 16, 0)


@triton.jit
def pkda_recurrent_gather_a_kernel(pool_a, slots, accepted, a0, NS, P, HV, K: tl.constexpr,
                                   BK: tl.constexpr, SPEC: tl.constexpr):
    # one program per (sequence, value head): the A-state it starts from, out of the pool
    # (zeros for an invalid slot; the main kernel flags and skips that sequence)
    pid = tl.program_id(0)
    i_hv = pid % HV
    i_n = pid // HV
    s_in, code = _slot_in(slots, accepted, i_n, NS, P, SPEC)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_a = tl.load(pool_a + (s_in * HV + i_hv) * K + o_k, mask=m_k & (code == 0), other=0.)
    tl.store(a0 + (i_n.to(tl.int64) * HV + i_hv) * K + o_k, b_a, mask=m_k)


@triton.jit
def pkda_fused_recurrent_kernel(
        q, k, v, g, g_atk, beta_atk, beta, c, A_log, dt_bias, h0, a0, o, ht, at, cu, slots,
        accepted, err, T, H, HV, NS, P, scale, log_x, eps, l2_eps, lower_bound,
        K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
        IS_VARLEN: tl.constexpr, HAS_S0: tl.constexpr, HAS_A0: tl.constexpr,
        STORE_FINAL: tl.constexpr, L2NORM_QK: tl.constexpr, GATE: tl.constexpr,
        HAS_DT_BIAS: tl.constexpr, TRANSPOSE_STATE: tl.constexpr, SLOTS: tl.constexpr,
        SPEC: tl.constexpr, GUARDED: tl.constexpr):
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0)
    i_v = pid % NV
    i_nh = pid // NV
    i_hv = i_nh % HV
    i_n = i_nh // HV
    i_h = i_hv // (HV // H)        # grouped value heads share q and k
    T64 = tl.zeros([], tl.int64) + T  # T may be specialised to a constexpr
    code = tl.zeros([], tl.int32)
    if IS_VARLEN:
        # always-on guard: validate, clamp, skip (never tl.device_assert: compiled out)
        bos_raw = tl.load(cu + i_n).to(tl.int64)
        eos_raw = tl.load(cu + i_n + 1).to(tl.int64)
        code = code | tl.where((i_n == 0) & (bos_raw != 0), 1, 0)
        code = code | tl.where((bos_raw < 0) | (eos_raw < 0), 2, 0)
        code = code | tl.where(eos_raw < bos_raw, 4, 0)
        code = code | tl.where((bos_raw > T64) | (eos_raw > T64), 8, 0)
        bos = tl.minimum(tl.maximum(bos_raw, 0), T64)
        eos = tl.minimum(tl.maximum(eos_raw, bos), T64)
    else:
        bos = i_n.to(tl.int64) * T64
        eos = bos + T64
    s_in = tl.zeros([], tl.int64)
    if SLOTS > 0:
        s_in, c_in = _slot_in(slots, accepted, i_n, NS, P, SPEC)
        code = code | c_in
        if SLOTS == 2:
            # a slot per token: every slot this sequence writes is checked before any write
            code = code | tl.where(eos - bos > NS, 64, 0)
            for t in range(0, tl.minimum(eos - bos, NS)):
                s_t = tl.load(slots + i_n.to(tl.int64) * NS + t).to(tl.int64)
                code = code | tl.where((s_t < 0) | (s_t >= P), 16, 0)
    ok = code == 0
    if GUARDED:
        tl.atomic_or(err, code, mask=code != 0)
    eos = tl.where(ok, eos, bos)
    L = (eos - bos).to(tl.int32)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    # S is [BK, BV] in registers either way; transpose_state_layout only changes its addresses
    if TRANSPOSE_STATE:
        kv = o_v[None, :] * K + o_k[:, None]
    else:
        kv = o_k[:, None] * V + o_v[None, :]
    nh = i_n.to(tl.int64) * HV + i_hv
    if SLOTS > 0:
        st_in = (s_in * HV + i_hv) * K * V
    else:
        st_in = nh * K * V
    if HAS_S0:
        b_S = tl.load(h0 + st_in + kv, mask=m_kv & ok, other=0.).to(tl.float32)
    else:
        b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_A0:
        b_a = tl.load(a0 + nh * K + o_k, mask=m_k & ok, other=0.).to(tl.float32)
    else:
        b_a = tl.zeros([BK], dtype=tl.float32)
    b_c = tl.load(c + i_hv).to(tl.float32)
    if GATE > 0:
        b_A = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        if HAS_DT_BIAS:
            b_bias = tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.).to(tl.float32)
        else:
            b_bias = tl.zeros([BK], dtype=tl.float32)

    for t in range(0, L):
        row = bos + t
        r_qk = row * H + i_h
        r_v = row * HV + i_hv
        b_q = tl.load(q + r_qk * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_k = tl.load(k + r_qk * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_g = tl.load(g + r_v * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_v = tl.load(v + r_v * V + o_v, mask=m_v, other=0.).to(tl.float32)
        b_ga = tl.load(g_atk + r_v).to(tl.float32)
        b_ba = tl.load(beta_atk + r_v).to(tl.float32)
        b_be = tl.load(beta + r_v).to(tl.float32)
        if L2NORM_QK:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, 0) + l2_eps)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, 0) + l2_eps)
        b_q = b_q * scale
        if GATE == 1:
            b_g = -b_A * _softplus(b_g + b_bias)
        elif GATE == 2:
            b_g = lower_bound * tl.sigmoid(b_A * (b_g + b_bias))
        # A-state, squash, preconditioned key
        b_a = tl.exp(b_ga) * b_a + b_ba * (b_k * b_k)
        b_r = tl.log(b_a + eps) - b_c
        b_p = b_k * tl.exp(-log_x * b_r / (1. + tl.abs(b_r)))
        # S' = diag(exp g) S; erase with k, write with p
        b_S = b_S * tl.exp(b_g)[:, None]
        b_d = b_be * (b_v - tl.sum(b_S * b_k[:, None], 0))
        b_S = b_S + b_p[:, None] * b_d[None, :]
        b_o = tl.sum(b_S * b_q[:, None], 0)
        tl.store(o + r_v * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        if SLOTS == 2:
            s_t = tl.load(slots + i_n.to(tl.int64) * NS + t).to(tl.int64)
            tl.store(ht + (s_t * HV + i_hv) * K * V + kv, b_S, mask=m_kv)
            tl.store(at + (s_t * HV + i_hv) * K + o_k, b_a, mask=m_k & (i_v == 0))

    if SLOTS == 1:
        tl.store(ht + st_in + kv, b_S, mask=m_kv & ok)
        tl.store(at + (s_in * HV + i_hv) * K + o_k, b_a, mask=m_k & ok & (i_v == 0))
    if STORE_FINAL:
        tl.store(ht + nh * K * V + kv, b_S, mask=m_kv)
        tl.store(at + nh * K + o_k, b_a, mask=m_k & (i_v == 0))


# ---------------------------------------------------------------- host side
def _reject_grad(tensors):
    if not torch.is_grad_enabled():
        return
    for name, t in zip(_GRAD_NAMES, tensors):
        if torch.is_tensor(t) and t.requires_grad:
            raise ValueError(
                f"fused_recurrent_precond_kda is inference-only (no backward) but {name} "
                f"requires grad: use chunk_precond_kda for training, or call this under "
                f"torch.no_grad() / torch.inference_mode()")


def _is_index(t) -> bool:
    return torch.is_tensor(t) and not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _check_slots(slots, accepted, N: int, P: int, lengths: list[int] | None, device,
                 where: str) -> bool:
    """ssm_state_indices / num_accepted_tokens: metadata always, values when host-readable.
    lengths: every sequence's token count when known on the host. Returns whether every value
    check ran on the host."""
    if not _is_index(slots) or slots.dim() not in (1, 2):
        raise ValueError(f"ssm_state_indices must be an integer tensor [N] or [N,S], got "
                         f"{getattr(slots, 'dtype', type(slots).__name__)} of shape "
                         f"{tuple(getattr(slots, 'shape', ()))}")
    check_index_device("ssm_state_indices", slots, device)
    if slots.shape[0] != N:
        raise ValueError(f"ssm_state_indices has {slots.shape[0]} rows but there are {N} "
                         f"sequences ({where})")
    S = slots.shape[1] if slots.dim() == 2 else 1
    if S == 0:
        raise ValueError("ssm_state_indices [N,S] needs S >= 1 slots per sequence")
    if accepted is not None:
        if slots.dim() != 2:
            raise ValueError("num_accepted_tokens needs a 2-D ssm_state_indices [N,S] (a slot "
                             "per token)")
        if not _is_index(accepted) or tuple(accepted.shape) != (N,):
            raise ValueError(f"num_accepted_tokens must be an integer tensor [N] = [{N}], got "
                             f"{getattr(accepted, 'dtype', type(accepted).__name__)} of shape "
                             f"{tuple(getattr(accepted, 'shape', ()))}")
        check_index_device("num_accepted_tokens", accepted, device)
    host_checked = _host_readable(slots) and (accepted is None or _host_readable(accepted))
    if _host_readable(slots) and slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= P:
            raise ValueError(f"ssm_state_indices holds slot {lo if lo < 0 else hi}, outside the "
                             f"state pools' [0, P={P})")
    if accepted is not None and _host_readable(accepted) and accepted.numel():
        lo, hi = int(accepted.min()), int(accepted.max())
        if lo < 1 or hi > S:
            raise ValueError(f"num_accepted_tokens holds {lo if lo < 1 else hi}, outside [1, S={S}] "
                             f"(S = slots per sequence in ssm_state_indices)")
    if slots.dim() == 2:
        if lengths is None:
            host_checked = False
        elif lengths and max(lengths) > S:
            n = max(range(len(lengths)), key=lengths.__getitem__)
            raise ValueError(f"sequence {n} has {lengths[n]} tokens but ssm_state_indices has "
                             f"S={S} slots per sequence (one per token)")
    return host_checked


def _validate(q, k, v, g, g_atk, beta_atk, beta, initial_state, initial_A_state, cu_seqlens,
              log_atk_scale, transpose_state_layout, slots, accepted):
    """Metadata checks (no device sync). Returns (N, HV, host_checked): host_checked is False
    when an index's values were left to the device guard."""
    B, T, H, K, V, HV = check_inputs(q, k, v, g, g_atk, beta_atk, beta, MAX_DIM, grouped_values=True)

    host_checked = True
    lengths = None
    if cu_seqlens is not None:
        check_cu_seqlens_meta(cu_seqlens, B, q.device)
        if _host_readable(cu_seqlens):
            cs = cu_seqlens.tolist()
            check_cu_seqlens_values(cs, T)
            lengths = [b - a for a, b in zip(cs, cs[1:])]
        else:
            host_checked = False
        N = cu_seqlens.numel() - 1
    else:
        N = B
        lengths = [T] * B
    pool = slots is not None
    if accepted is not None and not pool:
        raise ValueError("num_accepted_tokens needs ssm_state_indices (it picks a slot of each "
                         "sequence's row)")
    check_states(initial_state, initial_A_state, log_atk_scale, N, HV, K, V, varlen=cu_seqlens is not None,
                 device=q.device, transpose_state_layout=transpose_state_layout, pool=pool)
    if pool:
        where = "len(cu_seqlens)-1" if cu_seqlens is not None else "B"
        host_checked &= _check_slots(slots, accepted, N, initial_state.shape[0], lengths, q.device, where)
    return N, HV, host_checked


def fused_recurrent_fwd(q, k, v, g, g_atk, beta_atk, beta, scale, c, initial_state,
                        initial_A_state, output_final_state, cu_seqlens, N, x, eps, *,
                        use_qk_l2norm=True, A_log=None, dt_bias=None, lower_bound=None,
                        transpose_state_layout=False, slots=None, accepted=None):
    """Launcher (inputs already validated). c: fp32 [HV]. Gate in kernel when A_log is given.
    Returns (o, S_T | None, a_T | None, err flag | None). Allocates final states only when
    output_final_state; with slots (state pools) the pools are updated in place and returned."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev = q.device
    q, k, v, g, g_atk, beta_atk, beta = (t.contiguous() for t in (q, k, v, g, g_atk, beta_atk,
                                                                   beta))
    varlen, pool = cu_seqlens is not None, slots is not None
    store_final = bool(output_final_state) and not pool
    # a guarded sequence that is skipped writes no o row: those (and tokens past
    # cu_seqlens[-1]) stay zero
    o = torch.zeros_like(v) if varlen or pool else torch.empty_like(v)
    ht = at = cu = err = None
    h0 = initial_state.contiguous() if initial_state is not None else None
    a0 = initial_A_state.contiguous() if initial_A_state is not None else None
    if store_final:
        shape = (N, HV, V, K) if transpose_state_layout else (N, HV, K, V)
        ht = torch.empty(shape, dtype=torch.float32, device=dev)
        at = torch.empty(N, HV, K, dtype=torch.float32, device=dev)
    if varlen:
        cu = cu_seqlens.to(dev).contiguous()
    NS, P = 1, 0
    if pool:
        ht, at = initial_state, initial_A_state        # updated in place
        slots = slots.to(dev).contiguous()
        accepted = accepted.to(dev).contiguous() if accepted is not None else None
        NS, P = (slots.shape[1] if slots.dim() == 2 else 1), initial_state.shape[0]
    if varlen or pool:
        err = _err_flag(dev)
    if N == 0 or HV == 0:
        return o, ht, at, err
    BK = triton.next_power_of_2(K)
    if pool:
        a0 = torch.empty(N, HV, K, dtype=torch.float32, device=dev)
        pkda_recurrent_gather_a_kernel[(N * HV,)](initial_A_state, slots, accepted, a0, NS, P, HV,
                                                   K=K, BK=BK, SPEC=accepted is not None)
    gate = GATE_NONE if A_log is None else GATE_SOFTPLUS if lower_bound is None else GATE_SIGMOID
    A_log = A_log.reshape(-1).contiguous() if A_log is not None else None
    dt_bias = dt_bias.reshape(-1).contiguous() if dt_bias is not None else None
    BV = block_v(V)
    pkda_fused_recurrent_kernel[grid_recurrent(N, HV, V, BV)](
        q, k, v, g, g_atk, beta_atk, beta, c, A_log, dt_bias, h0, a0, o, ht, at, cu, slots,
        accepted, err, T, H, HV, NS, P, float(scale), math.log(x), float(eps), L2NORM_EPS,
        0. if lower_bound is None else float(lower_bound),
        K=K, V=V, BK=BK, BV=BV, IS_VARLEN=varlen, HAS_S0=h0 is not None, HAS_A0=a0 is not None,
        STORE_FINAL=store_final, L2NORM_QK=bool(use_qk_l2norm), GATE=gate,
        HAS_DT_BIAS=dt_bias is not None, TRANSPOSE_STATE=bool(transpose_state_layout),
        SLOTS=(SLOTS_NONE if not pool else SLOTS_PER_TOKEN if slots.dim() == 2 else SLOTS_PER_SEQUENCE),
        SPEC=accepted is not None, GUARDED=err is not None,
        num_warps=4 if K * BV >= 4096 else 2, num_stages=1)
    return o, ht, at, err


def fused_recurrent_precond_kda(q, k, v, g, g_atk, beta_atk, beta, A_log=None, dt_bias=None,
                                scale=None, initial_state=None, initial_A_state=None,
                                output_final_state=False, use_qk_l2norm_in_kernel=True,
                                use_gate_in_kernel=False, lower_bound=None, cu_seqlens=None,
                                transpose_state_layout=False, x=1.5, eps=1e-6,
                                log_atk_scale=None, *, ssm_state_indices=None,
                                num_accepted_tokens=None):
    """Preconditioned KDA, token-serial fused Triton kernel (decode / inference prefill).

    Arguments and returns as documented in the module docstring (the public op's signature;
    shapes and math as `chunk_precond_kda`, plus grouped value heads and state pools), which
    also documents how index inputs are validated, on the host and on the device, and the
    limits of that under CUDA-graph capture. Forward only: inputs requiring grad (with grad
    mode on) raise ValueError pointing at `chunk_precond_kda`.
    Returns (o [B,T,HV,V] in v.dtype, final_state fp32 | None, final_A_state [N,HV,K] fp32 |
    None); with ssm_state_indices, the two pools (updated in place).
    """
    _reject_grad((q, k, v, g, g_atk, beta_atk, beta, initial_state, initial_A_state,
                  log_atk_scale, A_log, dt_bias))
    N, HV, host_checked = _validate(q, k, v, g, g_atk, beta_atk, beta, initial_state,
                                    initial_A_state, cu_seqlens, log_atk_scale,
                                    transpose_state_layout, ssm_state_indices,
                                    num_accepted_tokens)
    K = q.shape[3]
    scale, x, eps = check_scalars(K ** -0.5 if scale is None else scale, x, eps, lower_bound)
    if use_gate_in_kernel:
        check_gate_params(A_log, dt_bias, HV, K, q.device)
    if log_atk_scale is None:
        log_atk_scale = -0.2
    if torch.is_tensor(log_atk_scale):
        c = log_atk_scale.detach().to(device=q.device, dtype=torch.float32).reshape(HV)
    else:
        c = torch.full((HV,), real_scalar("log_atk_scale", log_atk_scale), dtype=torch.float32,
                       device=q.device)
    o, ht, at, err = fused_recurrent_fwd(
        q, k, v, g, g_atk, beta_atk, beta, scale, c.contiguous(), initial_state,
        initial_A_state, output_final_state, cu_seqlens, N, x, eps,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        A_log=A_log.detach() if use_gate_in_kernel else None,
        dt_bias=dt_bias.detach() if use_gate_in_kernel and dt_bias is not None else None,
        lower_bound=lower_bound, transpose_state_layout=transpose_state_layout,
        slots=ssm_state_indices, accepted=num_accepted_tokens)
    if err is not None and not host_checked and not _capturing(q.device):
        check_recurrent_indices(q.device)
    return o, ht, at
