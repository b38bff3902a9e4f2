"""Triton forward of preconditioned KDA (PKDA): one kernel + one launcher per stage.

Chunk size 64 (16-token sub-chunks inside fwd.intra), FP32 accumulation, bf16 / fp16 / fp32
inputs, K and V each 64, 128 or 256 (K != V allowed), T of any length, dense and varlen. The
math is the design note's chunk form; `reference.py` holds the same stages in PyTorch.

Stage launchers (stable signatures: the backward calls them to recompute). `layout` is a
`reference.ChunkLayout` from `make_layout(B, T, cu_seqlens, device)` (built once per shape
and cached; the kernels only read it). Dense input is handled as packed sequences 0, T, 2T,
... of the flattened token axis, so every kernel has one code path.

    l2norm_fwd(x) -> (y [same shape, x.dtype], rstd [x.shape[:-1]] fp32)
    l2norm_bwd(y, rstd, dy) -> dx [y.shape, dy.dtype]               (stage bwd.l2norm)
    fwd_atk(k, g, g_atk, beta_atk, log_atk_scale, layout, initial_A_state=None, x=1.5,
            eps=1e-6, output_final_state=False, store_a=False, floor_flags=None)
        -> (p [B,T,H,K] k.dtype, G [B,T,H,K] fp32, a [B,T,H,K] fp32 | None,
            a_final [N,H,K] fp32 | None)
        k already L2-normalised; G = chunk-local inclusive cumsum of g; g and g_atk as given
        (their gate floor, GATE_FLOOR, is applied here). floor_flags: None, or an int8 [NT,H,K]
        tensor to fill: 1 where the chunk's K tile of g (the local kernel's) holds an entry
        below the floor or NaN, else 0.
    fwd_intra(q, k, v, p, G, beta, scale, layout, store_akk=False, kg_out=None, qg_out=None)
        -> (Aqk [B,T,H,64] k.dtype, Tinv [B,T,H,64] k.dtype, W [B,T,H,K] k.dtype,
            U [B,T,H,V] v.dtype, Akk [B,T,H,64] fp32 | None)
        Aqk inclusive and scaled; Tinv = (I + Akk)^-1; Akk strict and beta-scaled.
    fwd_wu(k, v, G, beta, Tinv, layout, p=None, kg_out=None, q=None, scale=None, qg_out=None)
        -> (W, U) as fwd_intra's, from a kept Tinv; with kg_out / qg_out also the state
        passes' gated operands P*exp(G_last - G) and scale*Q*exp(G) (gated_k, gated_q)
    fwd_h(W, U, p, G, layout, initial_state=None, output_final_state=False, store_h=True,
          kg=None)
        -> (h [NT,H,K,V] k.dtype | None, Delta [B,T,H,V] v.dtype, S_final [N,H,K,V] fp32 | None)
    fwd_o(q, G, h, Aqk, Delta, scale, layout) -> o [B,T,H,V] v.dtype
    fwd_h_o(W, U, G, kg, qg, Aqk, layout, initial_state=None, output_final_state=False)
        -> (o, S_final): fwd_h and fwd_o in one state walk (K <= 128; kg, qg from fwd_wu),
        no h, no Delta; the forward's path unless it keeps its intermediates
    pkda_fwd(...)  all of the above in order, see its docstring.

Grids are 1-D: the product sequences x heads x tiles sits in grid X (limit 2^31-1),
never in Y or Z (limit 65,535). Under TRITON_INTERPRET=1 each autotuned kernel has exactly
one config (the interpreter cannot benchmark several).
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .ranges import stage_range
from .reference import CHUNK, SUB, ChunkLayout, make_layout

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
SUPPORTED_DIMS = (64, 128, 256)
GRID_X_MAX = 2 ** 31 - 1
GRID_YZ_MAX = 65535
BT = CHUNK
BC = SUB
# precision of the fp32 dots of fwd.intra's diagonal blocks (None: ieee for fp32 inputs,
# tf32 for bf16/fp16 inputs)
DIAG_PREC = None
# Gate floor: g and g_atk entries below -GATE_FLOOR are raised to -GATE_FLOOR where a kernel
# first reads them (fwd.atk, bwd.atk), and their gradients are 0 there (bwd.dg, told where by
# the recompute's fwd.atk, and bwd.atk): the semantics of torch.clamp(min=-GATE_FLOOR) before
# the kernels, without its three extra passes over g (clamp, and the comparison and select of
# its backward: ~0.1 ms a fwd+bwd call at B4_T2048_H16_D128, docs/perf/pkda.md).
# exp(-24) = 3.8e-11 is ~1600x below fp32's half-ulp (2^-24 = 6e-8), so the decayed history it
# keeps is invisible at fp32 precision, while the chunk-local cumulative gates stay small
# enough not to cancel catastrophically.
GATE_FLOOR = 24.0
_FLOOR = tl.constexpr(-GATE_FLOOR)


@triton.jit
def floored(g):
    """g with its entries below -GATE_FLOOR raised to it; NaN stays NaN, as torch.clamp's."""
    return tl.where(g < _FLOOR, _FLOOR, g)


@triton.jit
def above_floor(g):
    """Where floored(g) passes g's gradient through: g >= -GATE_FLOOR (False for NaN, as the
    gradient torch.clamp gives)."""
    return g >= _FLOOR


def _configs(space):
    """space: list of (meta dict, num_warps, num_stages); only the first under the interpreter."""
    cfgs = [triton.Config(dict(meta), num_warps=w, num_stages=s) for meta, w, s in space]
    return cfgs[:1] if INTERPRET else cfgs


def _check_grid(grid):
    x = grid[0]
    if x > GRID_X_MAX or any(d > GRID_YZ_MAX for d in grid[1:]):
        raise ValueError(f"grid {grid} exceeds CUDA limits")
    return grid


# Grid functions (1-D; tested for many sequences x heads).
def grid_atk(N, H, K, BK):
    return _check_grid((N * H * (K // BK), 1, 1))


def grid_intra(NT, H):
    return _check_grid((NT * H, 1, 1))


def grid_h(N, H, V, BV):
    return _check_grid((N * H * (V // BV), 1, 1))


def grid_o(NT, H, V, BV):
    return _check_grid((NT * H * (V // BV), 1, 1))


def grid_l2norm(R, BR):
    return _check_grid((triton.cdiv(R, BR), 1, 1))


def _dot_prec(dtype):
    # fp32 operands: exact fp32 products (IEEE); bf16/fp16 operands ignore it.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_dims(K, V=None):
    if K not in SUPPORTED_DIMS:
        raise ValueError(f"PKDA: K={K} is not supported (K must be one of {SUPPORTED_DIMS})")
    if V is not None and V not in SUPPORTED_DIMS:
        raise ValueError(f"PKDA: V={V} is not supported (V must be one of {SUPPORTED_DIMS})")


# ============================================================================ l2norm
@triton.jit
def pkda_fwd_l2norm_kernel(x, y, rstd, R, eps, D: tl.constexpr, BR: tl.constexpr):
    pid = tl.program_id(0)
    o_r = pid.to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, D)
    m = o_r < R
    ptr = o_r[:, None] * D + o_d[None, :]
    b_x = tl.load(x + ptr, mask=m[:, None], other=0.).to(tl.float32)
    b_r = 1. / tl.sqrt(tl.sum(b_x * b_x, 1) + eps)
    tl.store(y + ptr, (b_x * b_r[:, None]).to(y.dtype.element_ty), mask=m[:, None])
    tl.store(rstd + o_r, b_r, mask=m)


@triton.jit
def pkda_bwd_l2norm_kernel(y, rstd, dy, dx, R, D: tl.constexpr, BR: tl.constexpr):
    # y = x * r, r = (sum x^2 + eps)^-1/2  =>  dx = r * (dy - y * sum(y * dy))
    pid = tl.program_id(0)
    o_r = pid.to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, D)
    m = o_r < R
    ptr = o_r[:, None] * D + o_d[None, :]
    b_y = tl.load(y + ptr, mask=m[:, None], other=0.).to(tl.float32)
    b_dy = tl.load(dy + ptr, mask=m[:, None], other=0.).to(tl.float32)
    b_r = tl.load(rstd + o_r, mask=m, other=0.)
    b_dx = b_r[:, None] * (b_dy - b_y * tl.sum(b_y * b_dy, 1)[:, None])
    tl.store(dx + ptr, b_dx.to(dx.dtype.element_ty), mask=m[:, None])


def l2norm_fwd(x: torch.Tensor, eps: float = 1e-6):
    """y = x / sqrt(sum_D x^2 + eps) over the last dim. Returns (y in x.dtype, rstd fp32)."""
    x = x.contiguous()
    D = x.shape[-1]
    R = x.numel() // D
    y = torch.empty_like(x)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    BR = 16
    if R:
        pkda_fwd_l2norm_kernel[grid_l2norm(R, BR)](x, y, rstd, R, eps, D=D, BR=BR, num_warps=4)
    return y, rstd


def l2norm_bwd(y: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor, out_dtype=None):
    """Gradient w.r.t. x of y = l2norm(x), from y, rstd and dy. dx in out_dtype (dy's)."""
    dy = dy.contiguous()
    D = y.shape[-1]
    R = y.numel() // D
    dx = torch.empty(y.shape, dtype=out_dtype or dy.dtype, device=y.device)
    BR = 16
    if R:
        pkda_bwd_l2norm_kernel[grid_l2norm(R, BR)](y.contiguous(), rstd.contiguous(), dy, dx, R,
                                               D=D, BR=BR, num_warps=4)
    return dx


# ============================================================================ fwd.atk
# Chunk-parallel diagonal scan, three kernels (all inside stage fwd.atk):
#   local: per chunk, Ga = cumsum(g_atk), end_c = sum_j exp(Ga_last - Ga_j) beta_atk_j k_j^2,
#          decay_c = exp(Ga_last); also G = cumsum(g) (chunk-local, per channel)
#   carry: per (sequence, head, K block), a_in of every chunk: a <- decay_c a + end_c
#   out:   per chunk, a_r = exp(Ga_r) a_in + sum_{j<=r} exp(Ga_r - Ga_j) beta_atk_j k_j^2,
#          then r, m, p = k m
def grid_atk_chunks(NT, H, K, BK):
    return _check_grid((NT * H * (K // BK), 1, 1))


@triton.jit
def _chunk_of(cu, chunk_indices, i_c, BT: tl.constexpr):
    i_n = tl.load(chunk_indices + i_c * 2)
    i_t = tl.load(chunk_indices + i_c * 2 + 1).to(tl.int64)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    T0 = bos + i_t * BT
    return i_n, T0, tl.minimum(eos - T0, BT)


@triton.autotune(configs=_configs([({"BK": 32}, 4, 1), ({"BK": 64}, 4, 1)]), key=["H", "K"])
@triton.jit
def pkda_fwd_atk_local_kernel(k, g, g_atk, beta_atk, G, a_end, decay, floor_flags, cu,
                              chunk_indices, H, K: tl.constexpr, BT: tl.constexpr,
                              BK: tl.constexpr, STORE_FLAGS: tl.constexpr):
    NK: tl.constexpr = K // BK
    pid = tl.program_id(0)
    i_k = pid % NK
    i_ch = pid // NK
    i_h = i_ch % H
    i_c = i_ch // H
    i_n, T0, Lc = _chunk_of(cu, chunk_indices, i_c, BT)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_t = o_t < Lc
    rows = T0 + o_t
    ptr = (rows * H + i_h)[:, None] * K + o_k[None, :]
    b_g = tl.load(g + ptr, mask=m_t[:, None], other=0.).to(tl.float32)
    st = i_c.to(tl.int64) * H + i_h
    if STORE_FLAGS:
        # The backward's dg cumsum must zero dg where g is below the floor; reading g again for
        # that is a second pass over it (33 MB at B4_T2048_H16_D128 in bf16) for entries that
        # are rare. This kernel has the tile anyway: one flag for it, so that the cumsum reads
        # g only in the tiles that need it. Stored per column because the cumsum's K tiles
        # need not be this kernel's (BK is autotuned here).
        b_any = tl.max(tl.where(above_floor(b_g), 0, 1).to(tl.int8))
        tl.store(floor_flags + st * K + o_k, tl.full([BK], 0, tl.int8) + b_any)
    b_g = floored(b_g)
    tl.store(G + ptr, tl.cumsum(b_g, 0), mask=m_t[:, None])
    b_k = tl.load(k + ptr, mask=m_t[:, None], other=0.).to(tl.float32)
    b_ga = floored(tl.load(g_atk + rows * H + i_h, mask=m_t, other=0.).to(tl.float32))
    b_ba = tl.load(beta_atk + rows * H + i_h, mask=m_t, other=0.).to(tl.float32)
    b_Ga = tl.cumsum(b_ga, 0)
    b_last = tl.sum(b_ga, 0)
    b_w = tl.where(m_t, tl.exp(tl.where(m_t, b_last - b_Ga, 0.)) * b_ba, 0.)
    tl.store(a_end + st * K + o_k, tl.sum(b_w[:, None] * b_k * b_k, 0))
    if i_k == 0:
        tl.store(decay + st, tl.exp(b_last))


@triton.autotune(configs=_configs([({"BK": 64}, 2, 1)]), key=["H", "K"])
@triton.jit
def pkda_fwd_atk_carry_kernel(a_end, decay, a0, a_fin, cu, chunk_offsets, H, K: tl.constexpr,
                              BT: tl.constexpr, BK: tl.constexpr, HAS_A0: tl.constexpr,
                              STORE_FINAL: tl.constexpr):
    # in place: a_end[c] (local end value of chunk c) becomes a_in[c] (state entering chunk c)
    NK: tl.constexpr = K // BK
    pid = tl.program_id(0)
    i_k = pid % NK
    i_nh = pid // NK
    i_h = i_nh % H
    i_n = i_nh // H
    o_k = i_k * BK + tl.arange(0, BK)
    st = (i_n.to(tl.int64) * H + i_h) * K + o_k
    if HAS_A0:
        b_a = tl.load(a0 + st).to(tl.float32)
    else:
        b_a = tl.zeros([BK], dtype=tl.float32)
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    c1 = tl.load(chunk_offsets + i_n + 1).to(tl.int64)
    for i_t in range(0, c1 - c0):
        off = (c0 + i_t) * H + i_h
        b_e = tl.load(a_end + off * K + o_k)
        b_d = tl.load(decay + off)
        tl.store(a_end + off * K + o_k, b_a)
        b_a = b_d * b_a + b_e
    if STORE_FINAL:
        tl.store(a_fin + st, b_a)


@triton.jit
def decayed_sum(d1, x1, d2, x2):
    """The combine of the linear recurrence y_t = d_t y_(t-1) + x_t as an associative scan: a
    run (d1, x1) followed by a run (d2, x2) is the run (d1 d2, d2 x1 + x2). With reverse=True
    the same combine gives y_t = d_t y_(t+1) + x_t. The ATK moment and its gradient are such
    recurrences along a chunk's 64 rows, with one decay a row."""
    return d1 * d2, x1 * d2 + x2


@triton.autotune(configs=_configs([({"BK": 32}, 4, 1), ({"BK": 64}, 4, 1)]), key=["H", "K"])
@triton.jit
def pkda_fwd_atk_kernel(k, g_atk, beta_atk, c, a_in, p, a_out, cu, chunk_indices, log_x, eps, H,
                        K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                        STORE_A: tl.constexpr):
    NK: tl.constexpr = K // BK
    pid = tl.program_id(0)
    i_k = pid % NK
    i_ch = pid // NK
    i_h = i_ch % H
    i_c = i_ch // H
    i_n, T0, Lc = _chunk_of(cu, chunk_indices, i_c, BT)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_t = o_t < Lc
    rows = T0 + o_t
    ptr = (rows * H + i_h)[:, None] * K + o_k[None, :]
    b_k = tl.load(k + ptr, mask=m_t[:, None], other=0.).to(tl.float32)
    b_ga = floored(tl.load(g_atk + rows * H + i_h, mask=m_t, other=0.).to(tl.float32))
    b_ba = tl.load(beta_atk + rows * H + i_h, mask=m_t, other=0.).to(tl.float32)
    # a_r = exp(ga_r) a_(r-1) + ba_r k_r^2 along the chunk from a_in: a scan over the rows
    # (six combine levels on the [64, BK] tile) instead of a [64, 64] decay matrix (4,096
    # exponentials) times the tile as an IEEE FMA dot, which made this kernel instruction-bound
    # (ncu on an H100: 72 M warp instructions a launch, FMA pipe 47%, 136 registers)
    b_eg = tl.exp(b_ga)
    b_ain = tl.load(a_in + (i_c.to(tl.int64) * H + i_h) * K + o_k)
    b_x = b_ba[:, None] * b_k * b_k + tl.where((o_t == 0)[:, None], b_eg[:, None] * b_ain[None, :], 0.)
    _, b_A = tl.associative_scan((tl.broadcast_to(b_eg[:, None], (BT, BK)), b_x), 0, decayed_sum)
    b_r = tl.log(b_A + eps) - tl.load(c + i_h).to(tl.float32)
    b_m = tl.exp(-log_x * b_r / (1. + tl.abs(b_r)))
    tl.store(p + ptr, (b_k * b_m).to(p.dtype.element_ty), mask=m_t[:, None])
    if STORE_A:
        tl.store(a_out + ptr, b_A, mask=m_t[:, None])


def fwd_atk(k, g, g_atk, beta_atk, log_atk_scale, layout: ChunkLayout, initial_A_state=None,
            x=1.5, eps=1e-6, output_final_state=False, store_a=False, floor_flags=None):
    """Stage fwd.atk. k: L2-normalised [B,T,H,K]. See the module docstring for returns."""
    B, T, H, K = k.shape
    _check_dims(K)
    k, g, g_atk, beta_atk = (t.contiguous() for t in (k, g, g_atk, beta_atk))
    c = log_atk_scale.to(torch.float32).contiguous()
    p = torch.empty_like(k)
    G = torch.empty(k.shape, dtype=torch.float32, device=k.device)
    a = torch.empty_like(G) if store_a else None
    a_fin = torch.empty(layout.N, H, K, dtype=torch.float32, device=k.device) if output_final_state else None
    a0 = initial_A_state.contiguous() if initial_A_state is not None else None
    if layout.N == 0:
        return p, G, a, a_fin
    NT = layout.NT
    a_chunk = torch.empty(NT, H, K, dtype=torch.float32, device=k.device)
    decay = torch.empty(NT, H, dtype=torch.float32, device=k.device)
    if NT:
        pkda_fwd_atk_local_kernel[lambda meta: grid_atk_chunks(NT, H, K, meta["BK"])](
            k, g, g_atk, beta_atk, G, a_chunk, decay,
            floor_flags if floor_flags is not None else decay, layout.cu, layout.chunk_indices,
            H, K=K, BT=BT, STORE_FLAGS=floor_flags is not None)
    pkda_fwd_atk_carry_kernel[lambda meta: grid_atk(layout.N, H, K, meta["BK"])](
        a_chunk, decay, a0, a_fin, layout.cu, layout.chunk_offsets, H, K=K, BT=BT,
        HAS_A0=a0 is not None, STORE_FINAL=output_final_state)
    if NT:
        pkda_fwd_atk_kernel[lambda meta: grid_atk_chunks(NT, H, K, meta["BK"])](
            k, g_atk, beta_atk, c, a_chunk, p, a, layout.cu, layout.chunk_indices, math.log(x),
            eps, H, K=K, BT=BT, STORE_A=store_a)
    return p, G, a, a_fin


# ============================================================================ fwd.intra
@triton.jit
def _tile(ptr, T0, row0, Lc, H, i_h, D: tl.constexpr, BC: tl.constexpr):
    """[BC, D] fp32 rows row0.. of a [Ttot,H,D] tensor inside the chunk starting at T0."""
    o = row0 + tl.arange(0, BC)
    m = o < Lc
    off = ((T0 + o) * H + i_h) * D
    return tl.load(ptr + off[:, None] + tl.arange(0, D)[None, :], mask=m[:, None], other=0.).to(tl.float32)


@triton.jit
def _col(ptr, T0, row0, Lc, H, i_h, BC: tl.constexpr):
    """[BC] fp32 per-token scalars (beta) of rows row0.. of the chunk."""
    o = row0 + tl.arange(0, BC)
    return tl.load(ptr + (T0 + o) * H + i_h, mask=o < Lc, other=0.).to(tl.float32)


@triton.jit
def _store_blk(ptr, blk, T0, Lc, H, i_h, si, sj, BT: tl.constexpr, BC: tl.constexpr):
    """Store a [BC,BC] block at rows si*BC.., columns sj*BC.. of a [Ttot,H,BT] tensor."""
    o = tl.arange(0, BC)
    rows = si * BC + o
    ptrs = ptr + ((T0 + rows) * H + i_h)[:, None] * BT + (sj * BC + o)[None, :]
    tl.store(ptrs, blk.to(ptr.dtype.element_ty), mask=(rows < Lc)[:, None])


@triton.jit
def _store_upper_zeros(ptr, T0, Lc, H, i_h, i_s, BT: tl.constexpr, BC: tl.constexpr):
    """Zeros in the blocks right of the diagonal of sub-chunk row i_s of a [Ttot,H,BT] tensor:
    Aqk and Tinv are read whole (fwd.o, fwd_wu, the backward), so the kernels write their upper
    blocks instead of the host filling both tensors with zeros first (two 32 MB fills at the
    public row)."""
    rows = i_s * BC + tl.arange(0, BC)
    cols = tl.arange(0, BT)
    ptrs = ptr + ((T0 + rows) * H + i_h)[:, None] * BT + cols[None, :]
    mask = (rows < Lc)[:, None] & (cols >= (i_s + 1) * BC)[None, :]
    tl.store(ptrs, tl.zeros([BC, BT], dtype=ptr.dtype.element_ty), mask=mask)


@triton.jit
def _intra_rows(q, k, G, beta, T0, Lc, H, i_h, si: tl.constexpr, K: tl.constexpr,
                BC: tl.constexpr, DT: tl.constexpr):
    """Row operands of sub-chunk si for its off-diagonal blocks, reference point G_ref = G at
    the first row of si: k*exp(G - G_ref), q*exp(G - G_ref) (both <= |k|, |q|), G_ref, beta."""
    o = tl.arange(0, BC)
    m_i = (si * BC + o) < Lc
    ref = tl.minimum(si * BC, Lc - 1)
    b_gr = tl.load(G + ((T0 + ref) * H + i_h) * K + tl.arange(0, K))
    b_Gi = _tile(G, T0, si * BC, Lc, H, i_h, K, BC)
    b_ei = tl.exp(tl.where(m_i[:, None], b_Gi - b_gr[None, :], 0.))
    b_kg = (_tile(k, T0, si * BC, Lc, H, i_h, K, BC) * b_ei).to(DT)
    b_qg = (_tile(q, T0, si * BC, Lc, H, i_h, K, BC) * b_ei).to(DT)
    return b_kg, b_qg, b_gr, _col(beta, T0, si * BC, Lc, H, i_h, BC)


@triton.jit
def _intra_offdiag(b_kg, b_qg, b_gr, b_beta, p, G, T0, Lc, H, i_h, scale, sj: tl.constexpr,
                   K: tl.constexpr, BC: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    # rows in sub-chunk si (operands from _intra_rows), columns in sub-chunk sj < si:
    # exp(G_r - G_j) = exp(G_r - G_ref) * exp(G_ref - G_j), both factors <= 1.
    o = tl.arange(0, BC)
    m_j = (sj * BC + o) < Lc
    b_Gj = _tile(G, T0, sj * BC, Lc, H, i_h, K, BC)
    b_pj = _tile(p, T0, sj * BC, Lc, H, i_h, K, BC)
    b_pg = tl.where(m_j[:, None], b_pj * tl.exp(tl.where(m_j[:, None], b_gr[None, :] - b_Gj, 0.)), 0.)
    b_pgT = tl.trans(b_pg.to(DT))
    b_Akk = tl.dot(b_kg, b_pgT, input_precision=PREC)
    b_Aqk = tl.dot(b_qg, b_pgT, input_precision=PREC)
    return b_Akk * b_beta[:, None], b_Aqk * scale


@triton.jit
def _intra_diag(q, k, p, G, beta, T0, Lc, H, i_h, scale, si: tl.constexpr,
                K: tl.constexpr, BC: tl.constexpr, BKD: tl.constexpr, PREC32: tl.constexpr):
    # rows and columns in the same sub-chunk. Fast path: reference point G_m at the middle
    # row, exp(G_r - G_j) = exp(G_r - G_m) * exp(G_m - G_j), two fp32 tensor-core dots; its
    # exponents are bounded by the gate sum over half a sub-chunk. When that bound exceeds
    # DIAG_MAX_EXP (strong gates), the exact element-wise path runs instead.
    o = tl.arange(0, BC)
    m_i = (si * BC + o) < Lc
    ref = tl.minimum(si * BC + BC // 2, Lc - 1)
    b_gm = tl.load(G + ((T0 + ref) * H + i_h) * K + tl.arange(0, K))
    b_x = tl.where(m_i[:, None], _tile(G, T0, si * BC, Lc, H, i_h, K, BC) - b_gm[None, :], 0.)
    if tl.max(tl.max(tl.abs(b_x), 1), 0) > 40.:
        b_Akk, b_Aqk = _intra_diag_exact(q, k, p, G, beta, T0, Lc, H, i_h, scale, si, K, BC, BKD)
    else:
        b_e = tl.exp(b_x)
        b_pgT = tl.trans(_tile(p, T0, si * BC, Lc, H, i_h, K, BC) * tl.exp(-b_x))
        b_Akk = tl.dot(_tile(k, T0, si * BC, Lc, H, i_h, K, BC) * b_e, b_pgT, input_precision=PREC32)
        b_Aqk = tl.dot(_tile(q, T0, si * BC, Lc, H, i_h, K, BC) * b_e, b_pgT, input_precision=PREC32)
        b_beta = _col(beta, T0, si * BC, Lc, H, i_h, BC)
        b_Akk = tl.where((o[:, None] > o[None, :]) & m_i[:, None], b_Akk * b_beta[:, None], 0.)
        b_Aqk = tl.where((o[:, None] >= o[None, :]) & m_i[:, None], b_Aqk * scale, 0.)
    return b_Akk, b_Aqk


@triton.jit
def _intra_diag_exact(q, k, p, G, beta, T0, Lc, H, i_h, scale, si: tl.constexpr,
                      K: tl.constexpr, BC: tl.constexpr, BKD: tl.constexpr):
    # rows and columns in the same sub-chunk: exact, from the masked difference G_r - G_j
    # (j <= r, exponent <= 0), as a [BC, BC, BKD] broadcast per slice of BKD channels.
    o = tl.arange(0, BC)
    rows = si * BC + o
    m_i = rows < Lc
    base = ((T0 + rows) * H + i_h) * K
    cm = (o[:, None] >= o[None, :]) & m_i[:, None]
    b_Akk = tl.zeros([BC, BC], dtype=tl.float32)
    b_Aqk = tl.zeros([BC, BC], dtype=tl.float32)
    for i_d in range(0, K // BKD):
        ptr = base[:, None] + (i_d * BKD + tl.arange(0, BKD))[None, :]
        b_G = tl.load(G + ptr, mask=m_i[:, None], other=0.)
        b_k = tl.load(k + ptr, mask=m_i[:, None], other=0.).to(tl.float32)
        b_q = tl.load(q + ptr, mask=m_i[:, None], other=0.).to(tl.float32)
        b_p = tl.load(p + ptr, mask=m_i[:, None], other=0.).to(tl.float32)
        b_pe = b_p[None, :, :] * tl.exp(tl.where(cm[:, :, None], b_G[:, None, :] - b_G[None, :, :],
                                                 float("-inf")))
        b_Akk += tl.sum(b_k[:, None, :] * b_pe, 2)
        b_Aqk += tl.sum(b_q[:, None, :] * b_pe, 2)
    b_beta = _col(beta, T0, si * BC, Lc, H, i_h, BC)
    b_Akk = tl.where((o[:, None] > o[None, :]) & m_i[:, None], b_Akk * b_beta[:, None], 0.)
    b_Aqk = tl.where(cm, b_Aqk * scale, 0.)
    return b_Akk, b_Aqk


@triton.jit
def _inv_unit_lower(A, BC: tl.constexpr):
    """(I + A)^-1 for a strictly lower [BC,BC] A, by forward substitution row by row."""
    o = tl.arange(0, BC)
    T = tl.where(o[:, None] == o[None, :], 1., 0.)
    for r in range(1, BC):
        a_r = tl.sum(tl.where(o[:, None] == r, A, 0.), 0)
        t_r = tl.where(o == r, 1., 0.) - tl.sum(a_r[:, None] * T, 0)
        T = tl.where(o[:, None] == r, t_r[None, :], T)
    return T


@triton.jit
def _inv_unit_lower4(A0, A1, A2, A3, BC: tl.constexpr):
    """_inv_unit_lower of four independent blocks in one loop (four independent chains)."""
    o = tl.arange(0, BC)
    T0 = tl.where(o[:, None] == o[None, :], 1., 0.)
    T1 = T0
    T2 = T0
    T3 = T0
    for r in range(1, BC):
        sel = o[:, None] == r
        e_r = tl.where(o == r, 1., 0.)
        t0 = e_r - tl.sum(tl.sum(tl.where(sel, A0, 0.), 0)[:, None] * T0, 0)
        t1 = e_r - tl.sum(tl.sum(tl.where(sel, A1, 0.), 0)[:, None] * T1, 0)
        t2 = e_r - tl.sum(tl.sum(tl.where(sel, A2, 0.), 0)[:, None] * T2, 0)
        t3 = e_r - tl.sum(tl.sum(tl.where(sel, A3, 0.), 0)[:, None] * T3, 0)
        T0 = tl.where(sel, t0[None, :], T0)
        T1 = tl.where(sel, t1[None, :], T1)
        T2 = tl.where(sel, t2[None, :], T2)
        T3 = tl.where(sel, t3[None, :], T3)
    return T0, T1, T2, T3


@triton.jit
def _load_blk(ptr, T0, Lc, H, i_h, si: tl.constexpr, sj: tl.constexpr, BT: tl.constexpr,
              BC: tl.constexpr):
    """The [BC,BC] fp32 block at rows si*BC.., columns sj*BC.. of a [Ttot,H,BT] tensor (rows past
    the chunk's end read as zeros)."""
    o = tl.arange(0, BC)
    rows = si * BC + o
    ptrs = ptr + ((T0 + rows) * H + i_h)[:, None] * BT + (sj * BC + o)[None, :]
    return tl.load(ptrs, mask=(rows < Lc)[:, None], other=0.)


@triton.jit
def _block_inverse(A00, A10, A11, A20, A21, A22, A30, A31, A32, A33, BC: tl.constexpr):
    """(I + A)^-1 of a strictly lower 64x64 A given as its 4x4 lower [BC,BC] blocks:
    T_ii = (I + A_ii)^-1, T_ij = -T_ii sum_{j<=m<i} A_im T_mj (fp32, exact products)."""
    D0, D1, D2, D3 = _inv_unit_lower4(A00, A11, A22, A33, BC)
    T10 = -tl.dot(tl.dot(D1, A10, input_precision="ieee"), D0, input_precision="ieee")
    T21 = -tl.dot(tl.dot(D2, A21, input_precision="ieee"), D1, input_precision="ieee")
    T20 = -tl.dot(D2, tl.dot(A20, D0, input_precision="ieee")
                  + tl.dot(A21, T10, input_precision="ieee"), input_precision="ieee")
    T32 = -tl.dot(tl.dot(D3, A32, input_precision="ieee"), D2, input_precision="ieee")
    T31 = -tl.dot(D3, tl.dot(A31, D1, input_precision="ieee")
                  + tl.dot(A32, T21, input_precision="ieee"), input_precision="ieee")
    T30 = -tl.dot(D3, tl.dot(A30, D0, input_precision="ieee") + tl.dot(A31, T10, input_precision="ieee")
                  + tl.dot(A32, T20, input_precision="ieee"), input_precision="ieee")
    return D0, T10, D1, T20, T21, D2, T30, T31, T32, D3


# fwd.intra in three kernels, as a candidate for issue #3: the single program per (chunk, head)
# that built Akk, Aqk, the solve, W and U serially was 59% of the forward's device time on the
# H200. Here (1) one program per (chunk, head, sub-chunk row) builds that row's blocks of Akk and
# Aqk (4x the programs, a quarter of the chain each), (2) one per (chunk, head) inverts, (3) W and
# U come from fwd_wu, one program per (chunk, head, 64-wide column tile).
@triton.autotune(configs=_configs([({}, 4, 1), ({}, 2, 1)]), key=["H", "K"])
@triton.jit
def pkda_fwd_intra_a_kernel(q, k, p, G, beta, Aqk, Akk, cu, chunk_indices, scale, H,
                            K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKD: tl.constexpr,
                            PREC: tl.constexpr, PREC32: tl.constexpr):
    # one program per (chunk, head, sub-chunk row i): blocks (i, j) for j <= i of Akk and Aqk
    DT: tl.constexpr = k.dtype.element_ty
    pid = tl.program_id(0)
    i_s = pid % 4
    i_ch = pid // 4
    i_h = i_ch % H
    i_c = i_ch // H
    _, T0, Lc = _chunk_of(cu, chunk_indices, i_c, BT)
    # a sub-chunk past a partial chunk's end has no rows (the masks store nothing there)
    _store_upper_zeros(Aqk, T0, Lc, H, i_h, i_s, BT, BC)
    if i_s == 0:
        A, Q = _intra_diag(q, k, p, G, beta, T0, Lc, H, i_h, scale, 0, K, BC, BKD, PREC32)
        _store_blk(Akk, A, T0, Lc, H, i_h, 0, 0, BT, BC)
        _store_blk(Aqk, Q, T0, Lc, H, i_h, 0, 0, BT, BC)
    elif i_s * BC < Lc:
        if i_s == 1:
            A, Q = _intra_diag(q, k, p, G, beta, T0, Lc, H, i_h, scale, 1, K, BC, BKD, PREC32)
            _store_blk(Akk, A, T0, Lc, H, i_h, 1, 1, BT, BC)
            _store_blk(Aqk, Q, T0, Lc, H, i_h, 1, 1, BT, BC)
            kg, qg, gr, bb = _intra_rows(q, k, G, beta, T0, Lc, H, i_h, 1, K, BC, DT)
            A, Q = _intra_offdiag(kg, qg, gr, bb, p, G, T0, Lc, H, i_h, scale, 0, K, BC, DT, PREC)
            _store_blk(Akk, A, T0, Lc, H, i_h, 1, 0, BT, BC)
            _store_blk(Aqk, Q, T0, Lc, H, i_h, 1, 0, BT, BC)
        elif i_s == 2:
            A, Q = _intra_diag(q, k, p, G, beta, T0, Lc, H, i_h, scale, 2, K, BC, BKD, PREC32)
            _store_blk(Akk, A, T0, Lc, H, i_h, 2, 2, BT, BC)
            _store_blk(Aqk, Q, T0, Lc, H, i_h, 2, 2, BT, BC)
            kg, qg, gr, bb = _intra_rows(q, k, G, beta, T0, Lc, H, i_h, 2, K, BC, DT)
            A, Q = _intra_offdiag(kg, qg, gr, bb, p, G, T0, Lc, H, i_h, scale, 0, K, BC, DT, PREC)
            _store_blk(Akk, A, T0, Lc, H, i_h, 2, 0, BT, BC)
            _store_blk(Aqk, Q, T0, Lc, H, i_h, 2, 0, BT, BC)
            A, Q = _intra_offdiag(kg, qg, gr, bb, p, G, T0, Lc, H, i_h, scale, 1, K, BC, DT, PREC)
            _store_blk(Akk, A, T0, Lc, H, i_h, 2, 1, BT, BC)
            _store_blk(Aqk, Q, T0, Lc, H, i_h, 2, 1, BT, BC)
        else:
            A, Q = _intra_diag(q, k, p, G, beta, T0, Lc, H, i_h, scale, 3, K, BC, BKD, PREC32)
            _store_blk(Akk, A, T0, Lc, H, i_h, 3, 3, BT, BC)
            _store_blk(Aqk, Q, T0, Lc, H, i_h, 3, 3, BT, BC)
            kg, qg, gr, bb = _intra_rows(q, k, G, beta, T0, Lc, H, i_h, 3, K, BC, DT)
            A, Q = _intra_offdiag(kg, qg, gr, bb, p, G, T0, Lc, H, i_h, scale, 0, K, BC, DT, PREC)
            _store_blk(Akk, A, T0, Lc, H, i_h, 3, 0, BT, BC)
            _store_blk(Aqk, Q, T0, Lc, H, i_h, 3, 0, BT, BC)
            A, Q = _intra_offdiag(kg, qg, gr, bb, p, G, T0, Lc, H, i_h, scale, 1, K, BC, DT, PREC)
            _store_blk(Akk, A, T0, Lc, H, i_h, 3, 1, BT, BC)
            _store_blk(Aqk, Q, T0, Lc, H, i_h, 3, 1, BT, BC)
            A, Q = _intra_offdiag(kg, qg, gr, bb, p, G, T0, Lc, H, i_h, scale, 2, K, BC, DT, PREC)
            _store_blk(Akk, A, T0, Lc, H, i_h, 3, 2, BT, BC)
            _store_blk(Aqk, Q, T0, Lc, H, i_h, 3, 2, BT, BC)


@triton.autotune(configs=_configs([({}, 4, 1), ({}, 2, 1)]), key=["H"])
@triton.jit
def pkda_fwd_solve_kernel(Akk, Tinv, cu, chunk_indices, H, BT: tl.constexpr, BC: tl.constexpr):
    # one program per (chunk, head): Tinv = (I + Akk)^-1 from Akk's ten lower blocks
    pid = tl.program_id(0)
    i_c = pid // H
    i_h = pid % H
    _, T0, Lc = _chunk_of(cu, chunk_indices, i_c, BT)
    D0, T10, D1, T20, T21, D2, T30, T31, T32, D3 = _block_inverse(
        _load_blk(Akk, T0, Lc, H, i_h, 0, 0, BT, BC), _load_blk(Akk, T0, Lc, H, i_h, 1, 0, BT, BC),
        _load_blk(Akk, T0, Lc, H, i_h, 1, 1, BT, BC), _load_blk(Akk, T0, Lc, H, i_h, 2, 0, BT, BC),
        _load_blk(Akk, T0, Lc, H, i_h, 2, 1, BT, BC), _load_blk(Akk, T0, Lc, H, i_h, 2, 2, BT, BC),
        _load_blk(Akk, T0, Lc, H, i_h, 3, 0, BT, BC), _load_blk(Akk, T0, Lc, H, i_h, 3, 1, BT, BC),
        _load_blk(Akk, T0, Lc, H, i_h, 3, 2, BT, BC), _load_blk(Akk, T0, Lc, H, i_h, 3, 3, BT, BC), BC)
    _store_blk(Tinv, D0, T0, Lc, H, i_h, 0, 0, BT, BC)
    _store_blk(Tinv, T10, T0, Lc, H, i_h, 1, 0, BT, BC)
    _store_blk(Tinv, D1, T0, Lc, H, i_h, 1, 1, BT, BC)
    _store_blk(Tinv, T20, T0, Lc, H, i_h, 2, 0, BT, BC)
    _store_blk(Tinv, T21, T0, Lc, H, i_h, 2, 1, BT, BC)
    _store_blk(Tinv, D2, T0, Lc, H, i_h, 2, 2, BT, BC)
    _store_blk(Tinv, T30, T0, Lc, H, i_h, 3, 0, BT, BC)
    _store_blk(Tinv, T31, T0, Lc, H, i_h, 3, 1, BT, BC)
    _store_blk(Tinv, T32, T0, Lc, H, i_h, 3, 2, BT, BC)
    _store_blk(Tinv, D3, T0, Lc, H, i_h, 3, 3, BT, BC)
    for i_s in tl.static_range(3):
        _store_upper_zeros(Tinv, T0, Lc, H, i_h, i_s, BT, BC)


def grid_intra_a(NT, H):
    return _check_grid((NT * H * (BT // BC), 1, 1))


def fwd_intra(q, k, v, p, G, beta, scale, layout: ChunkLayout, store_akk=False, kg_out=None,
              qg_out=None):
    """Stage fwd.intra. q, k L2-normalised [B,T,H,K]; p from fwd_atk (k.dtype); G fp32.
    kg_out / qg_out: as fwd_wu's (the gated operands of the state passes, written beside W)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    _check_dims(K, V)
    q, k, p, G, beta = (t.contiguous() for t in (q, k, p, G, beta))
    f32 = dict(dtype=torch.float32, device=k.device)
    # Aqk and Tinv are read whole (fwd.o, fwd_wu): the kernels write every row of every chunk,
    # zeros right of the diagonal blocks; tokens outside every sequence (an uncovered varlen
    # tail) are no chunk's, so only then the host zeros them. Both are stored in k's dtype:
    # every reader (fwd.o, fwd_wu, bwd.dAv, bwd.wy_dqkg) rounds them to it before its dot, so
    # rounding once at the store gives the same operands in half the bytes (the op keeps both
    # for the backward). Akk stays FP32: the solve reads it below the diagonal and above the
    # chunk's end
    alloc = torch.empty if layout.covered else torch.zeros
    Aqk = alloc(B, T, H, BT, dtype=k.dtype, device=k.device)
    Tinv = alloc(B, T, H, BT, dtype=k.dtype, device=k.device)
    Akk = (torch.zeros if store_akk else torch.empty)(B, T, H, BT, **f32)
    if layout.NT:
        pkda_fwd_intra_a_kernel[grid_intra_a(layout.NT, H)](
            q, k, p, G, beta, Aqk, Akk, layout.cu, layout.chunk_indices, scale, H,
            K=K, BT=BT, BC=BC, BKD=16, PREC=_dot_prec(k.dtype),
            PREC32=_dot_prec(k.dtype) if DIAG_PREC is None else DIAG_PREC)
        pkda_fwd_solve_kernel[grid_intra(layout.NT, H)](Akk, Tinv, layout.cu, layout.chunk_indices, H,
                                                        BT=BT, BC=BC)
    W, U = fwd_wu(k, v, G, beta, Tinv, layout, p=p, kg_out=kg_out, q=q, scale=scale,
                  qg_out=qg_out)
    return Aqk, Tinv, W, U, (Akk if store_akk else None)


@triton.jit
def gated_k(b_p, b_G, b_gl, m):
    """P * exp(G_last - G) on a chunk's [rows, K] tile, 0 where m is False (rows past the chunk's
    end): the keys the state passes multiply into the state (fwd.h) and its gradient (bwd.dhu).
    fp32 in, fp32 out; written once by fwd.wu (kg_out) or formed in those kernels."""
    return tl.where(m, b_p * tl.exp(tl.where(m, b_gl[None, :] - b_G, 0.)), 0.)


@triton.jit
def gated_q(b_q, b_G, scale, m):
    """scale * Q * exp(G) on a chunk's [rows, K] tile, 0 where m is False: bwd.dhu's queries."""
    return tl.where(m, b_q * tl.exp(b_G) * scale, 0.)


# W and U again from a kept Tinv: what the backward's recompute needs of fwd.intra once the
# forward has kept Aqk and Tinv. The forward's intra kernel builds Akk, Aqk and the 64x64 solve
# serially per (chunk, head) and was 59% of the forward's device time on the H200
# (docs/perf/pkda.md); W = Tinv X and U = Tinv Y are two plain GEMMs per chunk.
@triton.autotune(configs=_configs([({}, 4, 1), ({}, 8, 1)]), key=["H", "K", "V"])
@triton.jit
def pkda_fwd_wu_kernel(k, v, G, beta, Tinv, W, U, p, q, KG, QG, cu, chunk_indices, scale, H,
                       K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                       PREC: tl.constexpr, STORE_KG: tl.constexpr, STORE_QG: tl.constexpr):
    # one program per (chunk, head, 64-wide tile of W's K columns or U's V columns):
    # W = Tinv (beta K*exp(G)), U = Tinv (beta V), the operands rounded as fwd.intra rounds them.
    # When the state passes' gated operands are asked for (KG, QG in k's and q's dtypes, rounded as
    # fwd.h and bwd.dhu round them for their dots), a third group of programs, one per 64-wide tile
    # of K columns, writes them. They are not appended to the W programs: done there, after W's dot
    # (pkda/state-kg), wu's two launches of a fwd+bwd call went from 0.166 to 0.253 ms on the H100,
    # far more than their ~30 us of extra bytes; the W programs' work grew to about 2-3x the U
    # programs', and every program of the kernel took the W branch's registers (offline sm_90 at
    # B4_T2048_H16_D128, 4 warps: 79 -> 125 without qg, 154 with it; 6 -> 4 and 3 blocks an SM). A
    # gated program moves about what a W program moves (in the recompute G's FP32 tile, p and q in,
    # kg and qg out: 48 KB a tile at bf16 against Tinv, k, G in and W out; the forward's, kg alone,
    # 32 KB) with no Tinv load and no dot, and it follows its chunk's W and U programs in the launch
    # order, so its second read of G's tile mostly finds it in L2.
    NK: tl.constexpr = K // BD
    NV: tl.constexpr = V // BD
    NG: tl.constexpr = NK if (STORE_KG or STORE_QG) else 0
    DT: tl.constexpr = k.dtype.element_ty
    pid = tl.program_id(0)
    i_d = pid % (NK + NV + NG)
    i_ch = pid // (NK + NV + NG)
    i_h = i_ch % H
    i_c = i_ch // H
    _, T0, Lc = _chunk_of(cu, chunk_indices, i_c, BT)
    o_t = tl.arange(0, BT)
    m_t = o_t < Lc
    rows = (T0 + o_t) * H + i_h
    if i_d < NK + NV:
        b_T = tl.load(Tinv + rows[:, None] * BT + o_t[None, :], mask=m_t[:, None], other=0.).to(DT)
        b_b = tl.load(beta + rows, mask=m_t, other=0.).to(tl.float32)
        if i_d < NK:
            o_k = i_d * BD + tl.arange(0, BD)
            off = rows[:, None] * K + o_k[None, :]
            b_k = tl.load(k + off, mask=m_t[:, None], other=0.).to(tl.float32)
            b_G = tl.load(G + off, mask=m_t[:, None], other=0.)
            b_x = (b_b[:, None] * b_k * tl.exp(b_G)).to(DT)
            b_w = tl.dot(b_T, b_x, input_precision=PREC)
            tl.store(W + off, b_w.to(W.dtype.element_ty), mask=m_t[:, None])
        else:
            o_v = (i_d - NK) * BD + tl.arange(0, BD)
            off = rows[:, None] * V + o_v[None, :]
            b_y = (b_b[:, None] * tl.load(v + off, mask=m_t[:, None], other=0.).to(tl.float32)).to(DT)
            b_u = tl.dot(b_T, b_y, input_precision=PREC)
            tl.store(U + off, b_u.to(U.dtype.element_ty), mask=m_t[:, None])
    else:
        # gated_k / gated_q: the very helpers fwd.h and bwd.dhu call when they form the operands
        # themselves, on the same loads (masked rows as 0), so the stored tiles are bitwise theirs
        o_k = (i_d - NK - NV) * BD + tl.arange(0, BD)
        off = rows[:, None] * K + o_k[None, :]
        b_G = tl.load(G + off, mask=m_t[:, None], other=0.)
        if STORE_KG:
            b_gl = tl.load(G + ((T0 + Lc - 1) * H + i_h) * K + o_k)
            b_p = tl.load(p + off, mask=m_t[:, None], other=0.).to(tl.float32)
            tl.store(KG + off, gated_k(b_p, b_G, b_gl, m_t[:, None]).to(KG.dtype.element_ty),
                     mask=m_t[:, None])
        if STORE_QG:
            b_q = tl.load(q + off, mask=m_t[:, None], other=0.).to(tl.float32)
            tl.store(QG + off, gated_q(b_q, b_G, scale, m_t[:, None]).to(QG.dtype.element_ty),
                     mask=m_t[:, None])


def grid_wu(NT, H, K, V, BD, gated=False):
    return _check_grid((NT * H * (K // BD + V // BD + (K // BD if gated else 0)), 1, 1))


def fwd_wu(k, v, G, beta, Tinv, layout: ChunkLayout, p=None, kg_out=None, q=None, scale=None,
           qg_out=None):
    """W [B,T,H,K] k.dtype and U [B,T,H,V] (v cast to k.dtype) from a kept Tinv: the W and U
    of fwd_intra without its Akk, Aqk and solve (the backward's recompute, when the forward
    kept Aqk and Tinv). k L2-normalised; G fp32 from fwd_atk.
    With kg_out (and p), also writes the gated keys P*exp(G_last - G) into kg_out [B,T,H,K]
    k.dtype; with qg_out (and q, scale), scale*Q*exp(G) into qg_out [B,T,H,K] q.dtype: the
    operands fwd_h(kg=) and bwd_dhu(kg=, qg=) read instead of forming them."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    _check_dims(K, V)
    k, v, G, beta, Tinv = (t.contiguous() for t in (k, v, G, beta, Tinv))
    if v.dtype != k.dtype:
        v = v.to(k.dtype)
    W = torch.empty_like(k)
    U = torch.empty_like(v)
    for name, out, src, like in (("kg_out", kg_out, p, k), ("qg_out", qg_out, q, q)):
        if out is not None:
            if src is None or (name == "qg_out" and scale is None):
                raise ValueError(f"fwd_wu: {name} needs {'p' if name == 'kg_out' else 'q and scale'}")
            if out.shape != k.shape or out.dtype != like.dtype or not out.is_contiguous():
                raise ValueError(f"fwd_wu: {name} must be a contiguous {tuple(k.shape)} "
                                 f"{like.dtype} tensor, got {tuple(out.shape)} {out.dtype}")
    p = p.contiguous() if kg_out is not None else None
    q = q.contiguous() if qg_out is not None else None
    if layout.NT:
        BD = 64
        gated = kg_out is not None or qg_out is not None
        pkda_fwd_wu_kernel[grid_wu(layout.NT, H, K, V, BD, gated)](
            k, v, G, beta, Tinv, W, U, p, q, kg_out, qg_out, layout.cu, layout.chunk_indices,
            float(scale or 1.), H, K=K, V=V, BT=BT, BD=BD, PREC=_dot_prec(k.dtype),
            STORE_KG=kg_out is not None, STORE_QG=qg_out is not None)
    return W, U


# ============================================================================ fwd.h
@triton.autotune(configs=_configs([({"BV": 32}, 4, 2), ({"BV": 64}, 4, 2), ({"BV": 64}, 8, 2)]),
                 key=["H", "K", "V"])
@triton.jit
def pkda_fwd_h_kernel(w, u, p, G, kg, h0, h, delta, ht, cu, chunk_offsets, H,
                      K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                      HAS_H0: tl.constexpr, STORE_H: tl.constexpr, STORE_FINAL: tl.constexpr,
                      PREC: tl.constexpr, PRE_KG: tl.constexpr):
    # one program per (sequence, head, V block), looping over the sequence's chunks:
    # Delta = U - W S;  S <- diag(exp(G_last)) S + (P * exp(G_last - G))^T Delta
    NV: tl.constexpr = V // BV
    DT: tl.constexpr = w.dtype.element_ty
    pid = tl.program_id(0)
    i_v = pid % NV
    i_nh = pid // NV
    i_h = i_nh % H
    i_n = i_nh // H
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    L = eos - bos
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    kv = o_k[:, None] * V + o_v[None, :]
    st = (i_n.to(tl.int64) * H + i_h) * K * V
    if HAS_H0:
        b_S = tl.load(h0 + st + kv).to(tl.float32)
    else:
        b_S = tl.zeros([K, BV], dtype=tl.float32)
    for i_t in range(0, tl.cdiv(L, BT)):
        if STORE_H:
            tl.store(h + ((c0 + i_t) * H + i_h) * K * V + kv, b_S.to(h.dtype.element_ty))
        pos = i_t * BT + o_t
        m_t = pos < L
        rows = bos + pos
        rk = (rows * H + i_h)[:, None] * K + o_k[None, :]
        rv = (rows * H + i_h)[:, None] * V + o_v[None, :]
        b_w = tl.load(w + rk, mask=m_t[:, None], other=0.)
        b_u = tl.load(u + rv, mask=m_t[:, None], other=0.).to(tl.float32)
        b_d = b_u - tl.dot(b_w, b_S.to(DT), input_precision=PREC)
        tl.store(delta + rv, b_d.to(delta.dtype.element_ty), mask=m_t[:, None])
        last = bos + i_t * BT + tl.minimum(L - i_t * BT, BT) - 1
        b_gl = tl.load(G + (last * H + i_h) * K + o_k)
        if PRE_KG:  # written by fwd.wu: the same values, rounded the same way
            b_kg = tl.load(kg + rk, mask=m_t[:, None], other=0.)
        else:
            b_G = tl.load(G + rk, mask=m_t[:, None], other=0.)
            b_p = tl.load(p + rk, mask=m_t[:, None], other=0.).to(tl.float32)
            b_kg = gated_k(b_p, b_G, b_gl, m_t[:, None]).to(DT)
        b_S = b_S * tl.exp(b_gl)[:, None] + tl.dot(tl.trans(b_kg), b_d.to(DT), input_precision=PREC)
    if STORE_FINAL:
        tl.store(ht + st + kv, b_S)


def fwd_h(W, U, p, G, layout: ChunkLayout, initial_state=None, output_final_state=False,
          store_h=True, kg=None):
    """Stage fwd.h. Returns (h [NT,H,K,V] in W.dtype or None, Delta [B,T,H,V] in U.dtype,
    S_final [N,H,K,V] fp32 or None). No state tensor is allocated unless asked. kg: the gated
    keys fwd_wu(kg_out=) wrote (then p is not read), else formed here from p and G."""
    B, T, H, K = W.shape
    V = U.shape[-1]
    _check_dims(K, V)
    W, U, p, G = (t.contiguous() for t in (W, U, p, G))
    if kg is not None and (kg.shape != W.shape or kg.dtype != W.dtype or not kg.is_contiguous()):
        raise ValueError(f"fwd_h: kg must be a contiguous {tuple(W.shape)} {W.dtype} tensor "
                         f"(fwd_wu's kg_out), got {tuple(kg.shape)} {kg.dtype}")
    h = torch.empty(layout.NT, H, K, V, dtype=W.dtype, device=W.device) if store_h else None
    Delta = torch.empty_like(U)
    ht = torch.empty(layout.N, H, K, V, dtype=torch.float32, device=W.device) if output_final_state else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    if layout.N:
        pkda_fwd_h_kernel[lambda meta: grid_h(layout.N, H, V, meta["BV"])](
            W, U, p, G, kg, h0, h, Delta, ht, layout.cu, layout.chunk_offsets, H,
            K=K, V=V, BT=BT, HAS_H0=h0 is not None, STORE_H=store_h,
            STORE_FINAL=output_final_state, PREC=_dot_prec(W.dtype), PRE_KG=kg is not None)
    return h, Delta, ht


# ============================================================================ fwd.o
@triton.autotune(configs=_configs([({"BV": 64}, 4, 2), ({"BV": 64}, 8, 2), ({"BV": 32}, 4, 2)]),
                 key=["H", "K", "V"])
@triton.jit
def pkda_fwd_o_kernel(q, G, h, Aqk, delta, o, cu, chunk_indices, scale, H,
                      K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                      PREC: tl.constexpr):
    # one program per (chunk, head, V block): O = scale (Q*exp(G)) S_0 + Aqk Delta
    NV: tl.constexpr = V // BV
    DT: tl.constexpr = q.dtype.element_ty
    pid = tl.program_id(0)
    i_v = pid % NV
    i_ch = pid // NV
    i_h = i_ch % H
    i_c = i_ch // H
    _, T0, Lc = _chunk_of(cu, chunk_indices, i_c, BT)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    m_t = o_t < Lc
    rows = (T0 + o_t) * H + i_h
    b_q = tl.load(q + rows[:, None] * K + o_k[None, :], mask=m_t[:, None], other=0.).to(tl.float32)
    b_G = tl.load(G + rows[:, None] * K + o_k[None, :], mask=m_t[:, None], other=0.)
    b_qg = (b_q * tl.exp(b_G) * scale).to(DT)
    b_h = tl.load(h + (i_c.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :])
    b_o = tl.dot(b_qg, b_h.to(DT), input_precision=PREC)
    b_A = tl.load(Aqk + rows[:, None] * BT + o_t[None, :], mask=m_t[:, None], other=0.)
    b_d = tl.load(delta + rows[:, None] * V + o_v[None, :], mask=m_t[:, None], other=0.)
    b_o += tl.dot(b_A.to(DT), b_d.to(DT), input_precision=PREC)
    tl.store(o + rows[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_t[:, None])


def fwd_o(q, G, h, Aqk, Delta, scale, layout: ChunkLayout, out_dtype=None):
    """Stage fwd.o. q L2-normalised; h from fwd_h(store_h=True). o in out_dtype (Delta's)."""
    B, T, H, K = q.shape
    V = Delta.shape[-1]
    _check_dims(K, V)
    q, G, h, Aqk, Delta = (t.contiguous() for t in (q, G, h, Aqk, Delta))
    out_dtype = out_dtype or Delta.dtype
    # tokens outside every sequence (cu_seqlens[-1] < T) are never written: zero them
    o = (torch.empty if layout.covered else torch.zeros)(B, T, H, V, dtype=out_dtype, device=q.device)
    if layout.NT:
        pkda_fwd_o_kernel[lambda meta: grid_o(layout.NT, H, V, meta["BV"])](
            q, G, h, Aqk, Delta, o, layout.cu, layout.chunk_indices, scale, H,
            K=K, V=V, BT=BT, PREC=_dot_prec(q.dtype))
    return o


# ============================================================================ fwd.h with fwd.o
# The forward's o computed inside the state walk (forward only, K <= 128). At chunk t a program
# of pkda_fwd_h_kernel holds S_t, the state entering the chunk, and forms Delta_t; fwd.o's
# product for the program's V tile is o_t = (scale Q*exp(G))_t S_t + Aqk_t Delta_t, two more dots
# on operands the walk has or can read. Done here, the forward stores neither h nor Delta and
# launches no fwd.o.
# Why it may pay (an expectation, not a measurement): at B4_T2048_H16_D128 on an H100, fwd.o takes
# ~0.095 ms and is mostly bytes (it reads h, 67 MB, and G in FP32, 67 MB, besides q, Delta and
# Aqk, and writes o), while fwd.h (~0.13 ms a launch; ncu: one 8-warp block an SM, 12.5%
# occupancy, stalls on long scoreboard and barriers) is latency-bound with idle issue slots, so the
# two independent dots a chunk may hide in its stalls. The risk: they lengthen the serial chunk
# chain (S -> W S -> Delta -> S'), which sets the walk's time.
# The scaled gated queries come from fwd.wu (qg_out, the launch the backward's recompute already
# makes, STORE_QG): gated_q there is fwd.o's expression (scale * q * exp(G), masked rows 0) rounded
# to q's dtype, so the tile is bitwise fwd.o's operand. Forming it here instead would read q and
# the FP32 G tile once a V tile program (4x G's 67 MB at BV 32) and put a [64, K] exponential and
# an FP32 [64, K] tile into the walk: tried offline (sm_90, bf16, B4_T2048_H16_D128, the space
# below), registers and shared memory went from 138 / 133 KB to 234 / 165 KB (BV 32 w4 s2), 222 ->
# 244 (BV 64 w4), 197 -> 215 (BV 64 w8), and BV 32 w4 s1 spilled (195 -> 255, 2 STL / 2 LDL).
# Reading qg costs wu one more read of q and a write of qg (2 x 33.5 MB at the public row) and the
# walk a 16-bit [64, K] tile a chunk.
# Rounding as fwd.o's: S is cast to W's dtype (h's dtype; q, k and v share one dtype, checks.py,
# so W, U, Delta, Aqk, kg and qg are all in it) once and that copy feeds both the W dot and the qg
# dot, as fwd.o dots the stored h; Delta is rounded to that dtype for both the Aqk dot and the state update, as
# fwd.o reads the stored Delta; Aqk is read in its stored dtype; o = qg h, then += Aqk Delta, in
# FP32, stored in o's dtype. Operands are bitwise fwd.o's; only the dots' FP32 accumulation may
# differ in its last bits (another MMA tiling and warp count than fwd.o's config).
# Its launch space: fwd.h's first three entries and a single-stage BV 32 instead of its 3-stage
# one. Offline sm_90 (tools/kernel_resources.py, bf16), registers and shared memory a block: the
# qg and Aqk tiles staged for the next chunk add ~50 KB at K=128 and 2 stages (BV 32 w4: 83 ->
# 133 KB, one block an SM, so the public row's 256 programs would take two waves on 132 SMs; 3
# stages 194 KB); at 1 stage BV 32 takes 30 KB and 195 registers, two blocks an SM, one wave.
# BV 64 (128 programs at the public row, one an SM) stays at 2 stages, 4 and 8 warps as fwd.h's.
# Spill-free at B4_T2048_H16_D128 and B8_T1024_H8_D64 (2 warps spill at BV 32 and are left out).
HO_SPACE = [({"BV": 32}, 4, 2), ({"BV": 64}, 4, 2), ({"BV": 64}, 8, 2), ({"BV": 32}, 4, 1)]


@triton.autotune(configs=_configs(HO_SPACE), key=["H", "K", "V"])
@triton.jit
def pkda_fwd_h_o_kernel(w, u, G, kg, qg, Aqk, h0, o, ht, cu, chunk_offsets, H,
                        K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                        HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr, PREC: tl.constexpr):
    # one program per (sequence, head, V block), looping over the sequence's chunks:
    # Delta = U - W S;  o = QG S + Aqk Delta;  S <- diag(exp(G_last)) S + KG^T Delta
    NV: tl.constexpr = V // BV
    DT: tl.constexpr = w.dtype.element_ty
    pid = tl.program_id(0)
    i_v = pid % NV
    i_nh = pid // NV
    i_h = i_nh % H
    i_n = i_nh // H
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    L = eos - bos
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    kv = o_k[:, None] * V + o_v[None, :]
    st = (i_n.to(tl.int64) * H + i_h) * K * V
    if HAS_H0:
        b_S = tl.load(h0 + st + kv).to(tl.float32)
    else:
        b_S = tl.zeros([K, BV], dtype=tl.float32)
    for i_t in range(0, tl.cdiv(L, BT)):
        pos = i_t * BT + o_t
        m_t = pos < L
        rows = bos + pos
        rk = (rows * H + i_h)[:, None] * K + o_k[None, :]
        rv = (rows * H + i_h)[:, None] * V + o_v[None, :]
        b_Sd = b_S.to(DT)   # what fwd.h would store as h: one copy for both dots with S_t
        b_w = tl.load(w + rk, mask=m_t[:, None], other=0.)
        b_u = tl.load(u + rv, mask=m_t[:, None], other=0.).to(tl.float32)
        b_d = (b_u - tl.dot(b_w, b_Sd, input_precision=PREC)).to(DT)
        last = bos + i_t * BT + tl.minimum(L - i_t * BT, BT) - 1
        b_gl = tl.load(G + (last * H + i_h) * K + o_k)
        b_kg = tl.load(kg + rk, mask=m_t[:, None], other=0.)
        # the state update first: it is the chain the next chunk waits on; o is off that chain
        b_S = b_S * tl.exp(b_gl)[:, None] + tl.dot(tl.trans(b_kg), b_d, input_precision=PREC)
        b_qg = tl.load(qg + rk, mask=m_t[:, None], other=0.)
        b_o = tl.dot(b_qg, b_Sd, input_precision=PREC)
        b_A = tl.load(Aqk + (rows * H + i_h)[:, None] * BT + o_t[None, :], mask=m_t[:, None],
                      other=0.)
        b_o += tl.dot(b_A.to(DT), b_d, input_precision=PREC)
        tl.store(o + rv, b_o.to(o.dtype.element_ty), mask=m_t[:, None])
    if STORE_FINAL:
        tl.store(ht + st + kv, b_S)


def fwd_h_o(W, U, G, kg, qg, Aqk, layout: ChunkLayout, initial_state=None,
            output_final_state=False, out_dtype=None):
    """Stages fwd.h and fwd.o in one walk (the forward at K <= 128, when neither h nor Delta is
    kept). kg, qg: fwd_wu's kg_out and qg_out (the gated keys and the scaled gated queries), Aqk
    from fwd_intra, all in W's dtype. Returns (o [B,T,H,V] in out_dtype (U's), S_final
    [N,H,K,V] fp32 or None): the o of fwd_o on fwd_h's h and Delta, the S_final of fwd_h."""
    B, T, H, K = W.shape
    V = U.shape[-1]
    _check_dims(K, V)
    if K > 128:
        raise ValueError(f"fwd_h_o: K={K} > 128 runs fwd_h's K-block kernel and fwd_o")
    W, U, G, Aqk = (t.contiguous() for t in (W, U, G, Aqk))
    for name, t, shape in (("kg", kg, W.shape), ("qg", qg, W.shape), ("Aqk", Aqk, (B, T, H, BT)),
                           ("U", U, (B, T, H, V))):
        if tuple(t.shape) != tuple(shape) or t.dtype != W.dtype or not t.is_contiguous():
            raise ValueError(f"fwd_h_o: {name} must be a contiguous {tuple(shape)} {W.dtype} "
                             f"tensor, got {tuple(t.shape)} {t.dtype}")
    out_dtype = out_dtype or U.dtype
    # tokens outside every sequence (cu_seqlens[-1] < T) are never written: zero them
    o = (torch.empty if layout.covered else torch.zeros)(B, T, H, V, dtype=out_dtype, device=W.device)
    ht = torch.empty(layout.N, H, K, V, dtype=torch.float32, device=W.device) if output_final_state else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    if layout.N:
        pkda_fwd_h_o_kernel[lambda meta: grid_h(layout.N, H, V, meta["BV"])](
            W, U, G, kg, qg, Aqk, h0, o, ht, layout.cu, layout.chunk_offsets, H,
            K=K, V=V, BT=BT, HAS_H0=h0 is not None, STORE_FINAL=output_final_state,
            PREC=_dot_prec(W.dtype))
    return o, ht


# ============================================================================ all stages


def pkda_fwd(q, k, v, g, g_atk, beta_atk, beta, scale, log_atk_scale, initial_state=None,
             initial_A_state=None, output_final_state=False, cu_seqlens=None, x=1.5, eps=1e-6,
             layout: ChunkLayout | None = None, save_for_backward=False,
             keep_intermediates=False):
    """The whole Triton forward, each stage inside NVTX range `pkda.fwd.<stage>`.

    q, k: RAW (not normalised) [B,T,H,K]; v [B,T,H,V]; g [B,T,H,K]; g_atk, beta_atk, beta
    [B,T,H]; scale float; log_atk_scale [H] tensor; states fp32 or None. Inputs are assumed
    validated (op.py does that). Computation dtype of the stored intermediates: q's dtype
    (v is cast to it when it differs).

    Returns (o [B,T,H,V] v.dtype, S_final [N,H,K,V] fp32 | None, a_final [N,H,K] fp32 | None,
    saved) where saved is None unless save_for_backward, else a dict with
        q_n, k_n   L2-normalised q, k (q.dtype)      q_rstd, k_rstd  [B,T,H] fp32
        layout     the ChunkLayout of this call
        Aqk, Tinv  fwd.intra's [B,T,H,64] fp32 outputs (the backward rebuilds W, U from Tinv
                   with fwd_wu instead of re-running fwd.intra)
    (everything else is recomputed by the backward from the inputs: bwd.recompute).
    With keep_intermediates (and save_for_backward) saved also holds every tensor of
    bwd.RECOMPUTE_KEYS (a, p, G, Aqk, Tinv, W, U, h, Delta) so that the backward can skip
    bwd.recompute (the public op's disable_recompute=True); then fwd_h stores h and Delta and
    fwd_o reads them. Otherwise, at K <= 128, o comes from the state walk itself (fwd_h_o: no h,
    no Delta, no fwd_o launch; fwd_wu also writes qg for it); K > 128 always runs fwd_h + fwd_o.
    """
    B, T, H, K = q.shape
    if layout is None:
        layout = make_layout(B, T, cu_seqlens, q.device)
    with stage_range("pkda.fwd.l2norm"):
        q_n, q_rstd = l2norm_fwd(q)
        k_n, k_rstd = l2norm_fwd(k)
    with stage_range("pkda.fwd.atk"):
        p, G, a, a_fin = fwd_atk(k_n, g, g_atk, beta_atk, log_atk_scale, layout, initial_A_state,
                                 x, eps, output_final_state=output_final_state,
                                 store_a=keep_intermediates)
    # K <= 128: o inside the state walk (fwd_h_o), unless h and Delta are to be kept
    fuse_o = K <= 128 and not keep_intermediates
    with stage_range("pkda.fwd.intra"):
        kg = torch.empty_like(k_n)  # fwd.h's gated keys, written beside W
        qg = torch.empty_like(q_n) if fuse_o else None  # and the fused walk's gated queries
        Aqk, Tinv, W, U, _ = fwd_intra(q_n, k_n, v, p, G, beta, scale, layout, kg_out=kg,
                                       qg_out=qg)
    if fuse_o:
        h = Delta = None
        with stage_range("pkda.fwd.h"):  # fwd.h and fwd.o in one kernel
            o, S_fin = fwd_h_o(W, U, G, kg, qg, Aqk, layout, initial_state, output_final_state,
                               out_dtype=v.dtype)
        del kg, qg
    else:
        with stage_range("pkda.fwd.h"):
            h, Delta, S_fin = fwd_h(W, U, p, G, layout, initial_state, output_final_state, kg=kg)
        del kg
        with stage_range("pkda.fwd.o"):
            o = fwd_o(q_n, G, h, Aqk, Delta, scale, layout, out_dtype=v.dtype)
    saved = None
    if save_for_backward:
        saved = dict(q_n=q_n, k_n=k_n, q_rstd=q_rstd, k_rstd=k_rstd, layout=layout, Aqk=Aqk,
                     Tinv=Tinv)
        if keep_intermediates:
            saved.update(a=a, p=p, G=G, W=W, U=U, h=h, Delta=Delta)
    return o, S_fin, a_fin, saved
