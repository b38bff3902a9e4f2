"""Fused recurrent PKDA for decode and inference prefill (forward only).

    fused_recurrent_precond_kda(q, k, v, g, g_atk, beta_atk, beta, scale=None,
                                initial_state=None, initial_A_state=None,
                                output_final_state=False, cu_seqlens=None, x=1.5, eps=1e-6,
                                log_atk_scale=None) -> (o, final_state, final_A_state)

Same contract as `chunk_precond_kda` (and the oracle `naive_recurrent_precond_kda`):
q, k [B,T,H,K]; v [B,T,H,V]; g [B,T,H,K] natural-log per-channel decay; g_atk, beta_atk,
beta [B,T,H]; initial_state [N,H,K,V] fp32; initial_A_state [N,H,K] fp32; cu_seqlens [N+1]
integer with B == 1 (N packed sequences; empty sequences allowed: their state passes through
unchanged, bit for bit); log_atk_scale [H] tensor, a float, or None (-0.2); scale defaults to
K^-1/2. q and k are L2-normalised over K inside (x * rsqrt(sum x^2 + 1e-6), as the chunk op).
Returns o [B,T,H,V] in v.dtype (with cu_seqlens, tokens past cu_seqlens[-1] belong to no
sequence and are zero), final_state [N,H,K,V] fp32 and final_A_state [N,H,K] fp32, or None
for both unless output_final_state: then no state tensor is allocated and the kernel's state
stores are compiled out (constexpr STORE_FINAL).

Kernel: one program per (sequence, head, value block of BV columns), all in grid X (limit
2^31-1; Y and Z stay 1, never sequences x heads there). It scans the sequence's tokens one by
one with the state S [K, BV] and the A-state a [K] in registers, FP32 math whatever the input
dtype. Each value-block program recomputes the (cheap, [K]-sized) a/m/p chain; only the
program of value block 0 stores final_A_state. K and V may be any size up to 256 (padded to
a power of two and masked), K != V allowed.

Inference only: when grad mode is on and any tensor input requires grad, it raises
ValueError pointing at `chunk_precond_kda` (the differentiable chunk op) instead of silently
detaching. Under torch.no_grad / inference_mode, parameters with requires_grad are accepted.

cu_seqlens validation (the mechanism and its limits):
  * Metadata checks always run on the host (tensor, 1-D, integer dtype, >= 2 entries, B == 1,
    N = numel - 1 matches the initial states). They read no values.
  * Value checks on the host (starts at 0, non-decreasing, last <= T) run when cu_seqlens
    can be read without a device sync, i.e. when it lives on the CPU (it is then copied to
    q's device). A device-resident cu_seqlens is not read by the host (no sync per call).
  * A device-side guard is always compiled in (it is plain arithmetic, not
    `tl.device_assert`, which Triton compiles out unless TRITON_DEBUG): every program loads
    its bos/eos, flags the sequence invalid unless 0 <= bos <= eos <= T (and bos == 0 for
    the first sequence), clamps both into [0, T], and an invalid sequence processes no token
    (no read or write of q/k/v/g/o rows) and gets a zero final state. Every adjacent pair of
    entries is checked by some program, so every violation of the contract is caught. The
    violation is recorded (atomic OR of a bit code: 1 nonzero start, 2 negative entry,
    4 decreasing, 8 past T) into a sticky per-device int32 error flag.
  * Outside CUDA-graph capture, a launch whose cu_seqlens was not validated on the host reads
    that flag afterwards (one 4-byte device->host sync) and raises ValueError naming
    cu_seqlens; the flag is reset when it is reported.
  * Inside CUDA-graph capture nothing is read on the host and nothing can raise at replay:
    the guard keeps the replay memory-safe (no out-of-bounds access) and the flag records the
    violation; call `check_recurrent_cu_seqlens(device)` after a replay to raise, or the next
    eager launch with a device-resident cu_seqlens raises (the message says the violation may
    come from an earlier graph replay). The flag is shared by all launches on a device, so
    with several streams in flight a violation cannot be pinned to one launch.
  * After a violation the outputs are meaningless (o rows of skipped sequences stay zero;
    with decreasing offsets, valid neighbours may overlap and write the same rows); only
    memory safety and the report are guaranteed. The guard trusts the tensor's metadata
    (numel, dtype, device): cu_seqlens must really hold numel entries.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .checks import check_cu_seqlens_meta, check_cu_seqlens_values, check_inputs, check_states

L2NORM_EPS = 1e-6          # eps of the q/k L2 normalisation (the chunk op's)
MAX_DIM = 256              # K and V: any size up to this (masked to the next power of two)
GRID_X_MAX = 2 ** 31 - 1
GRID_YZ_MAX = 65535
CU_ERR_NONZERO_START = 1
CU_ERR_NEGATIVE = 2
CU_ERR_DECREASING = 4
CU_ERR_PAST_T = 8
_ERR_NAMES = ((CU_ERR_NONZERO_START, "first entry is not 0"),
              (CU_ERR_NEGATIVE, "negative entry"),
              (CU_ERR_DECREASING, "decreasing entries"),
              (CU_ERR_PAST_T, "entry past T (the token capacity)"))
_GRAD_NAMES = ("q", "k", "v", "g", "g_atk", "beta_atk", "beta", "initial_state",
               "initial_A_state", "log_atk_scale")


def block_v(V: int) -> int:
    """Value-block width: 32 columns (fewer for V < 32): S is [K, BV] fp32 in registers."""
    return min(32, triton.next_power_of_2(V))


def grid_recurrent(N: int, H: int, V: int, BV: int):
    """1-D grid: sequences x heads x value blocks all in X; Y and Z are always 1."""
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


def _describe(code: int) -> str:
    return ", ".join(name for bit, name in _ERR_NAMES if code & bit) or f"code {code}"


def check_recurrent_cu_seqlens(device=None) -> None:
    """Raise ValueError if a fused recurrent launch on `device` met an invalid cu_seqlens since
    the last check (e.g. during a CUDA-graph replay), and reset the flag. Syncs the device."""
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
            f"cu_seqlens is invalid ({_describe(code)}): fused_recurrent_precond_kda's device "
            f"guard skipped the offending sequences (their outputs are zero / meaningless). "
            f"cu_seqlens must start at 0, be non-decreasing and end at <= T. The violation "
            f"may come from this launch or an earlier CUDA-graph replay since the last check.")


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _host_readable(cu: torch.Tensor) -> bool:
    """Whether the host may read cu_seqlens' values without a device sync."""
    return cu.device.type == "cpu"


# ---------------------------------------------------------------- kernel
@triton.jit
def pkda_fused_recurrent_kernel(
        q, k, v, g, g_atk, beta_atk, beta, c, h0, a0, o, ht, at, cu, err,
        T, H, scale, log_x, eps, l2_eps,
        K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
        IS_VARLEN: tl.constexpr, HAS_S0: tl.constexpr, HAS_A0: tl.constexpr,
        STORE_FINAL: tl.constexpr):
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0)
    i_v = pid % NV
    i_nh = pid // NV
    i_h = i_nh % H
    i_n = i_nh // H
    T64 = tl.zeros([], tl.int64) + T  # T may be specialised to a constexpr
    if IS_VARLEN:
        # always-on guard: validate, clamp, skip (never tl.device_assert: compiled out)
        bos_raw = tl.load(cu + i_n).to(tl.int64)
        eos_raw = tl.load(cu + i_n + 1).to(tl.int64)
        code = tl.where((i_n == 0) & (bos_raw != 0), 1, 0)
        code = code | tl.where((bos_raw < 0) | (eos_raw < 0), 2, 0)
        code = code | tl.where(eos_raw < bos_raw, 4, 0)
        code = code | tl.where((bos_raw > T64) | (eos_raw > T64), 8, 0)
        bad = code != 0
        ok = code == 0
        tl.atomic_or(err, code, mask=bad)
        bos = tl.minimum(tl.maximum(bos_raw, 0), T64)
        eos = tl.minimum(tl.maximum(eos_raw, bos), T64)
        eos = tl.where(ok, eos, bos)
    else:
        ok = i_n >= 0  # always True
        bos = i_n.to(tl.int64) * T64
        eos = bos + T64
    L = (eos - bos).to(tl.int32)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    nh = i_n.to(tl.int64) * H + i_h
    p_s = nh * K * V + o_k[:, None] * V + o_v[None, :]
    p_a = nh * K + o_k
    if HAS_S0:
        b_S = tl.load(h0 + p_s, mask=m_kv & ok, other=0.).to(tl.float32)
    else:
        b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_A0:
        b_a = tl.load(a0 + p_a, mask=m_k & ok, other=0.).to(tl.float32)
    else:
        b_a = tl.zeros([BK], dtype=tl.float32)
    b_c = tl.load(c + i_h).to(tl.float32)

    for t in range(0, L):
        row = bos + t
        r_h = row * H + i_h
        b_q = tl.load(q + r_h * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_k = tl.load(k + r_h * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_g = tl.load(g + r_h * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_v = tl.load(v + r_h * V + o_v, mask=m_v, other=0.).to(tl.float32)
        b_ga = tl.load(g_atk + r_h).to(tl.float32)
        b_ba = tl.load(beta_atk + r_h).to(tl.float32)
        b_be = tl.load(beta + r_h).to(tl.float32)
        b_q = b_q * (scale / tl.sqrt(tl.sum(b_q * b_q, 0) + l2_eps))
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, 0) + l2_eps)
        # A-state, squash, preconditioned key
        b_a = tl.exp(b_ga) * b_a + b_ba * (b_k * b_k)
        b_r = tl.log(b_a + eps) - b_c
        b_p = b_k * tl.exp(-log_x * b_r / (1. + tl.abs(b_r)))
        # S' = diag(exp g) S; erase with k, write with p
        b_S = b_S * tl.exp(b_g)[:, None]
        b_d = b_be * (b_v - tl.sum(b_S * b_k[:, None], 0))
        b_S = b_S + b_p[:, None] * b_d[None, :]
        b_o = tl.sum(b_S * b_q[:, None], 0)
        tl.store(o + r_h * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)

    if STORE_FINAL:
        tl.store(ht + p_s, b_S, mask=m_kv)
        tl.store(at + p_a, b_a, mask=m_k & (i_v == 0))


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


def _validate(q, k, v, g, g_atk, beta_atk, beta, initial_state, initial_A_state, cu_seqlens,
              log_atk_scale):
    """Metadata checks (no device sync). Returns (N, host_checked)."""
    B, T, H, K, V = check_inputs(q, k, v, g, g_atk, beta_atk, beta, MAX_DIM)

    host_checked = False
    if cu_seqlens is not None:
        check_cu_seqlens_meta(cu_seqlens, B)
        if cu_seqlens.device != q.device and cu_seqlens.device.type != "cpu":
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {q.device}")
        if _host_readable(cu_seqlens):
            check_cu_seqlens_values(cu_seqlens.tolist(), T)
            host_checked = True
        N = cu_seqlens.numel() - 1
    else:
        N = B

    check_states(initial_state, initial_A_state, log_atk_scale, N, H, K, V, varlen=cu_seqlens is not None,
                 device=q.device)
    return N, host_checked


def fused_recurrent_fwd(q, k, v, g, g_atk, beta_atk, beta, scale, c, initial_state,
                        initial_A_state, output_final_state, cu_seqlens, N, x, eps):
    """Launcher (inputs already validated). c: fp32 [H]. Returns (o, S_T | None, a_T | None,
    err flag | None). Allocates final states only when output_final_state."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    q, k, v, g, g_atk, beta_atk, beta = (t.contiguous() for t in (q, k, v, g, g_atk, beta_atk,
                                                                   beta))
    h0 = initial_state.contiguous() if initial_state is not None else None
    a0 = initial_A_state.contiguous() if initial_A_state is not None else None
    varlen = cu_seqlens is not None
    # varlen: tokens past cu_seqlens[-1] (and of sequences the guard skips) stay zero
    o = torch.zeros_like(v) if varlen else torch.empty_like(v)
    ht = at = None
    if output_final_state:
        ht = torch.empty(N, H, K, V, dtype=torch.float32, device=dev)
        at = torch.empty(N, H, K, dtype=torch.float32, device=dev)
    cu = err = None
    if varlen:
        cu = cu_seqlens.to(dev).contiguous()
        err = _err_flag(dev)
    if N == 0 or H == 0:
        return o, ht, at, err
    BV = block_v(V)
    pkda_fused_recurrent_kernel[grid_recurrent(N, H, V, BV)](
        q, k, v, g, g_atk, beta_atk, beta, c, h0, a0, o, ht, at, cu, err,
        T, H, float(scale), math.log(x), float(eps), L2NORM_EPS,
        K=K, V=V, BK=triton.next_power_of_2(K), BV=BV, IS_VARLEN=varlen,
        HAS_S0=h0 is not None, HAS_A0=a0 is not None, STORE_FINAL=bool(output_final_state),
        num_warps=4 if K * BV >= 4096 else 2, num_stages=1)
    return o, ht, at, err


def fused_recurrent_precond_kda(q, k, v, g, g_atk, beta_atk, beta, scale=None,
                                initial_state=None, initial_A_state=None,
                                output_final_state=False, cu_seqlens=None, x=1.5, eps=1e-6,
                                log_atk_scale=None):
    """Preconditioned KDA, token-serial fused Triton kernel (decode / inference prefill).

    Shapes and semantics as `chunk_precond_kda` (see the module docstring, which also
    documents how cu_seqlens is validated, on the host and on the device, and the limits of
    that under CUDA-graph capture). Forward only: inputs requiring grad (with grad mode on)
    raise ValueError pointing at `chunk_precond_kda`.
    Returns (o [B,T,H,V] in v.dtype, final_state [N,H,K,V] fp32 | None,
    final_A_state [N,H,K] fp32 | None).
    """
    _reject_grad((q, k, v, g, g_atk, beta_atk, beta, initial_state, initial_A_state,
                  log_atk_scale))
    N, host_checked = _validate(q, k, v, g, g_atk, beta_atk, beta, initial_state,
                                initial_A_state, cu_seqlens, log_atk_scale)
    H, K = q.shape[2], q.shape[3]
    if scale is None:
        scale = K ** -0.5
    if not x > 0:
        raise ValueError(f"x must be > 0 (the squash spans [1/x, x]), got {x}")
    if log_atk_scale is None:
        log_atk_scale = -0.2
    if torch.is_tensor(log_atk_scale):
        c = log_atk_scale.detach().to(device=q.device, dtype=torch.float32).reshape(H)
    else:
        c = torch.full((H,), float(log_atk_scale), dtype=torch.float32, device=q.device)
    o, ht, at, err = fused_recurrent_fwd(
        q, k, v, g, g_atk, beta_atk, beta, scale, c.contiguous(), initial_state,
        initial_A_state, output_final_state, cu_seqlens, N, x, eps)
    if err is not None and not host_checked and not _capturing(q.device):
        check_recurrent_cu_seqlens(q.device)
    return o, ht, at
