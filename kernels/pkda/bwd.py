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
    saved           optional dict from the forward. If it holds every tensor of
                    RECOMPUTE_KEYS (a, p, G, Aqk, Tinv, W, U, h, Delta in the forward's
                    layouts) they are reused; otherwise stage bwd.recompute rebuilds them
                    with the forward's Triton stage launchers (from a kept Aqk and Tinv,
                    W and U come from fwd_wu instead of a second fwd.intra). A `layout`
                    in it (the forward's ChunkLayout) is used instead of building one.

Returns a dict of gradients, same shapes as the matching inputs:
    q, k (w.r.t. the normalised q, k), v, g, g_atk, beta_atk, beta, log_atk_scale [H],
    initial_state [N,H,K,V] (None if initial_state is None),
    initial_A_state [N,H,K] (None if initial_A_state is None);
v's and g's in v's and g's dtypes (their last kernel rounds them once, as a cast would, and the
two largest casts of the call are gone), the rest in FP32. The caller casts to the input dtypes.

Semantics: gradients of  sum(o*do) + sum(S_T*dht) + sum(a_T*dat)  for the recurrence
of shared/design/pkda.md (a_t, r_t, m_t, p_t = k_t m_t, S_t, o_t = S_t^T (scale q_t)).

Stages (each inside NVTX range ``pkda.bwd.<stage>``, opened inside pkda_bwd so they sit
on the thread that launches the kernels) and their kernels:

    recompute  the forward's fwd_atk / fwd_wu (or fwd_intra) / fwd_h launchers (kernels/pkda/fwd.py)
    dAv        pkda_bwd_dAv_kernel        dAqk_s = scale*tril(dO Delta^T) FP32 [B,T,H,64],
                                          dv_loc = Aqk^T dO                  grid (NT, H)
    dhu        pkda_bwd_dhu_kernel        reverse over chunks: dE per chunk, dDelta, dS0
               K > 128: pkda_bwd_dhu_kblocks_kernel (dE in K blocks)        grid (N*H, NV)
    wy_dqkg    pkda_bwd_wy_dqkg_kernel    inter-chunk dq/dk/dp/dG, dv, dbeta, dAkk FP32
                                                                             grid (NT, H)
    intra      pkda_bwd_intra_kernel      + pkda_bwd_beta_reduce_kernel      grid (NT*4, H, NK)
               pkda_bwd_dg_cumsum_kernel  dg = in-chunk reverse cumsum of dG
    atk        pkda_bwd_atk_kernel        dp -> dk, dg_atk, dbeta_atk, dc, da0  grid (N*H*NK,)
(NT = chunks of all sequences, N = sequences; products sit in grid X only.)

The dAqk seam: ``bwd.dAv`` + ``bwd.intra`` (+ the beta reduction) are one replaceable unit,
``_dAv_and_intra(schedule) -> (producer, consumer)``, the schedule chosen by
``daqk_schedule(device, dtype, K, V)``:
    "materialised" (default, the baseline): pkda_bwd_dAv_kernel writes dAqk; the intra
        grid has an NK dimension; dbeta via [NK,B,T,H] partials + pkda_bwd_beta_reduce_kernel.
    "onchip" (the design note's candidate; only with PKDA_DAQK_ONCHIP=1 and the guard):
        pkda_bwd_dv_only_kernel (no dAqk tensor), pkda_bwd_intra_onchip_kernel per
        (chunk x 16-token sub-chunk, head) recomputing the [16,64] row / [64,16] column
        fragments of dAqk_s (+ the [16,16] diagonal block) from dO and Delta, K tiles looped
        inside, dbeta written once per token. dAkk stays materialised; no atomics.
Both schedules share the gate placement, masks and FP32 accumulation: the onchip kernel through
_intra_tile (fragments in registers), the materialised one through _intra_blocks (sub-chunk by
sub-chunk from memory); both end in _intra_diag.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .fwd import decayed_sum, gated_k, gated_q
from .ranges import stage_range

# Globals read inside @triton.jit kernels must be tl.constexpr on a real GPU (the interpreter
# accepts plain ints and hid this); host code uses the plain-int twins CHUNK / N_SUB.
CHUNK, SUB = 64, 16
N_SUB = CHUNK // SUB
BT = tl.constexpr(CHUNK)  # chunk
BC = tl.constexpr(SUB)    # sub-chunk (local reference point for the pairwise gates)
NC = tl.constexpr(N_SUB)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _configs(cands):
    """Tiny autotune spaces; exactly one config under the interpreter (it cannot bench)."""
    cands = [triton.Config({}, num_warps=w, num_stages=s) for w, s in cands]
    return cands[:1] if INTERPRET else cands


def _ints_from_env(name: str, default: tuple[int, ...], allowed: tuple[int, ...], what: str,
                   example: str, env=None) -> tuple[int, ...]:
    """A comma-separated list of ints from env var `name`, each one of `allowed`, or `default`."""
    env = os.environ if env is None else env
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        values = tuple(int(w) for w in text.split(","))
    except ValueError:
        values = ()
    if not values or any(w not in allowed for w in values):
        raise ValueError(f"{name}={text!r}: expected a comma-separated list of {what} from "
                         f"{', '.join(map(str, allowed))} (e.g. '{example}')")
    return values


def warps_from_env(name: str, default: tuple[int, ...], env=None) -> tuple[int, ...]:
    """The warp counts of one kernel's autotune space: env var `name` ("8,4") or `default`.
    Read once, when this module is imported, so an experiment can try another space as an
    env-only candidate (same commit, different environment) without a code change."""
    return _ints_from_env(name, default, (1, 2, 4, 8, 16), "warp counts", "8,4", env)


def stages_from_env(name: str, default: tuple[int, ...], env=None) -> tuple[int, ...]:
    """The software-pipelining stages of one kernel's autotune space ("1,2"), as warps_from_env."""
    return _ints_from_env(name, default, (1, 2, 3, 4), "stage counts", "1,2", env)


def tile_from_env(name: str, default: int, allowed=(16, 32, 64), env=None) -> int:
    """One kernel's tile width: env var `name` ("32") or `default`, read once at import like
    warps_from_env, so a tile size is an env-only candidate too."""
    env = os.environ if env is None else env
    text = env.get(name, "").strip()
    if not text:
        return default
    if text not in {str(a) for a in allowed}:
        raise ValueError(f"{name}={text!r}: expected one of {', '.join(map(str, allowed))}")
    return int(text)


# the K tile of bwd.intra: every [64, BK] operand tile of a program is FP32, so the tile width is
# the kernel's register lever (more programs, each fragment of dAqk / dAkk read once more per tile)
INTRA_BK = tile_from_env("PKDA_BWD_INTRA_BK", 64)


def _dot_dtype(dtype: torch.dtype):
    """Operand dtype of tl.dot: fp16/bf16 inputs feed tensor cores in their own dtype;
    fp32 inputs use IEEE fp32 dots."""
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}.get(dtype, tl.float32)


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _chunk_bounds(chunks, i_c):
    bos = tl.load(chunks + 2 * i_c).to(tl.int64)
    eos = tl.load(chunks + 2 * i_c + 1).to(tl.int64)
    return bos, eos


# =============================================================================================
# bwd.dAv (materialised): dAqk_s = scale * tril(dO Delta^T) -> FP32 [T,H,64];  dv_loc = Aqk^T dO
# =============================================================================================
@triton.autotune(configs=_configs([(4, 2), (8, 2)]), key=["H", "V", "DT"])
@triton.jit
def pkda_bwd_dAv_kernel(do, Delta, Aqk, dAqk, dv_loc, chunks, scale,
                        H: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                        DT: tl.constexpr, PREC: tl.constexpr, WRITE_DA: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, eos = _chunk_bounds(chunks, i_c)
    L = eos - bos
    o_t = tl.arange(0, BT)
    m_t = o_t < L
    rows = bos + o_t
    m_A = m_t[:, None] & m_t[None, :]
    b_A = tl.load(Aqk + (rows[:, None] * H + i_h) * BT + o_t[None, :], mask=m_A, other=0.)
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_tv = (rows[:, None] * H + i_h) * V + o_v[None, :]
        b_do = tl.load(do + p_tv, mask=m_tv, other=0.)
        if WRITE_DA:
            b_dl = tl.load(Delta + p_tv, mask=m_tv, other=0.)
            b_dA += tl.dot(b_do.to(DT), tl.trans(b_dl).to(DT), input_precision=PREC)
        b_dv = tl.dot(tl.trans(b_A).to(DT), b_do.to(DT), input_precision=PREC)
        tl.store(dv_loc + p_tv, b_dv, mask=m_tv)
    if WRITE_DA:
        keep = m_A & (o_t[:, None] >= o_t[None, :])
        b_dA = tl.where(keep, b_dA * scale, 0.)
        tl.store(dAqk + (rows[:, None] * H + i_h) * BT + o_t[None, :], b_dA, mask=m_t[:, None])


# =============================================================================================
# bwd.dhu: reverse over the chunks of one sequence; dE (end-of-chunk state grads), dDelta, dS0
# =============================================================================================
@triton.autotune(configs=_configs([(4, 1), (8, 1)]), key=["H", "K", "V", "DT"])
@triton.jit
def pkda_bwd_dhu_kernel(q, p, G, kg, qg, W, do, dv_loc, dht, dE_all, dDelta, dS0, cu, chunk_off,
                        scale, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
                        USE_DHT: tl.constexpr, PRE_GATED: tl.constexpr):
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    coff = tl.load(chunk_off + i_n).to(tl.int64)
    NT = tl.cdiv(eos - bos, BT)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    p_kv = o_k[:, None] * V + o_v[None, :]
    if USE_DHT:
        b_dE = tl.load(dht + i_nh.to(tl.int64) * K * V + p_kv, mask=m_kv, other=0.).to(tl.float32)
    else:
        b_dE = tl.zeros([BK, BV], dtype=tl.float32)
    for i in range(NT):
        i_t = NT - 1 - i
        cbos = bos + i_t * BT
        L = tl.minimum(eos - cbos, BT)
        tl.store(dE_all + ((coff + i_t) * H + i_h) * K * V + p_kv,
                 b_dE.to(dE_all.dtype.element_ty), mask=m_kv)
        rows = cbos + o_t
        m_t = o_t < L
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        p_tk = (rows[:, None] * H + i_h) * K + o_k[None, :]
        p_tv = (rows[:, None] * H + i_h) * V + o_v[None, :]
        b_Gl = tl.load(G + ((cbos + L - 1) * H + i_h) * K + o_k, mask=m_k, other=0.).to(tl.float32)
        if PRE_GATED:  # written by fwd.wu in the recompute: the same values, rounded the same way
            b_kg = tl.load(kg + p_tk, mask=m_tk, other=0.)
            b_qg = tl.load(qg + p_tk, mask=m_tk, other=0.)
        else:
            b_G = tl.load(G + p_tk, mask=m_tk, other=0.).to(tl.float32)
            b_p = tl.load(p + p_tk, mask=m_tk, other=0.).to(tl.float32)
            b_kg = gated_k(b_p, b_G, b_Gl, m_tk).to(DT)
            b_q = tl.load(q + p_tk, mask=m_tk, other=0.).to(tl.float32)
            b_qg = gated_q(b_q, b_G, scale, m_tk).to(DT)
        b_dD = (tl.load(dv_loc + p_tv, mask=m_tv, other=0.)
                + tl.dot(b_kg, b_dE.to(DT), input_precision=PREC))
        tl.store(dDelta + p_tv, b_dD.to(dDelta.dtype.element_ty), mask=m_tv)
        b_w = tl.load(W + p_tk, mask=m_tk, other=0.)
        b_do = tl.load(do + p_tv, mask=m_tv, other=0.)
        b_dE = (b_dE * tl.exp(b_Gl)[:, None]
                + tl.dot(tl.trans(b_qg), b_do.to(DT), input_precision=PREC)
                - tl.dot(tl.trans(b_w).to(DT), b_dD.to(DT), input_precision=PREC))
    tl.store(dS0 + i_nh.to(tl.int64) * K * V + p_kv, b_dE, mask=m_kv)


def _meta_configs(space):
    """As _configs, for spaces whose configs set meta-parameters too: (meta dict, warps, stages)."""
    cands = [triton.Config(dict(meta), num_warps=w, num_stages=s) for meta, w, s in space]
    return cands[:1] if INTERPRET else cands


# bwd.dhu at K > 128: at K=V=256 the kernel above spills in every config (offline sm_90 compile:
# dE [K, BV] and the [64, K] FP32 tiles of G, p, q, W live at once). This one holds dE as 64-row
# K blocks (cdiv(K, 64) of them, at most four; the last one masked when 64 does not divide K) and
# reads G, p, q, W 64 columns at a time, so no [64, K] FP32 tile is live. The same split measured
# neutral or slower at K=128 (branch pkda/dhu-kblocks, 207df80), so bwd_dhu runs it only for
# K > 128 and every smaller K keeps the kernel above. Outputs, their dtypes and the rounding are
# the kernel above's: each tl.dot takes the same operands cast to DT, dDelta's dot is accumulated
# over the K blocks in FP32 as the full-K dot accumulates over K (the FP32 sums' order may differ
# in the last bits), dE and dDelta are stored in their buffers' dtype (q's), dS0 in FP32, and dE
# is carried in FP32.
# The space, offline sm_90 compile at K=V=256: all four spill-free (167-253 registers; BV 64 at
# 4 warps spills and is left out); 1 stage as the kernel above, since 2 stages would ask for
# 289-338 KB of shared memory a block, more than an SM has.
# BV 32 at 8 warps is left out: on an H100 (Triton 3.6, 2026-12-08) it raised "an illegal memory
# access" in bf16 at K=V=256 (B1 T130 H2; each config forced alone under CUDA_LAUNCH_BLOCKING=1:
# the other three ran, and all four ran in FP32), so autotuning it killed the process. The same
# masks and offsets serve every config, which points at the compiled bf16 dot layout of that
# config rather than at an index; not pinned down further.
DHU_KBLOCKS_SPACE = [({"BV": 16}, 4, 1), ({"BV": 32}, 4, 1), ({"BV": 64}, 8, 1)]
DHU_KBLOCK = 64   # rows of one K block of dE


@triton.jit
def _dhu_block_tk(rows, i_h, H: tl.constexpr, K: tl.constexpr, j: tl.constexpr, BKB: tl.constexpr):
    """Offsets of K block j's columns of a [T, H, K] tensor at rows, and the block's K mask."""
    o_k = j * BKB + tl.arange(0, BKB)
    return (rows[:, None] * H + i_h) * K + o_k[None, :], o_k, o_k < K


@triton.jit
def _dhu_block_kgE(p, G, kg, b_dE, b_acc, rows, m_t, last, i_h, H: tl.constexpr,
                   K: tl.constexpr, j: tl.constexpr, BKB: tl.constexpr, DT: tl.constexpr,
                   PREC: tl.constexpr, PRE_GATED: tl.constexpr):
    """b_acc + (p * exp(G_last - G))[:, block j] @ dE[block j]: dDelta's state term accumulated one
    K block at a time, [BT, BV] FP32. The gated keys' block j read from kg (PRE_GATED: fwd_wu's
    kg_out, as pkda_bwd_dhu_kernel reads it) or formed with gated_k, the same values rounded the
    same way."""
    p_tk, o_k, m_k = _dhu_block_tk(rows, i_h, H, K, j, BKB)
    m_tk = m_t[:, None] & m_k[None, :]
    if PRE_GATED:
        b_kg = tl.load(kg + p_tk, mask=m_tk, other=0.)
    else:
        b_G = tl.load(G + p_tk, mask=m_tk, other=0.).to(tl.float32)
        b_Gl = tl.load(G + (last * H + i_h) * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_p = tl.load(p + p_tk, mask=m_tk, other=0.).to(tl.float32)
        b_kg = gated_k(b_p, b_G, b_Gl, m_tk).to(DT)
    return tl.dot(b_kg, b_dE.to(DT), acc=b_acc, input_precision=PREC)


@triton.jit
def _dhu_block_step(q, G, qg, W, b_dE, b_do, b_dD, rows, m_t, last, i_h, scale,
                    H: tl.constexpr, K: tl.constexpr, j: tl.constexpr, BKB: tl.constexpr,
                    DT: tl.constexpr, PREC: tl.constexpr, PRE_GATED: tl.constexpr):
    """Block j of dE carried one chunk back: dE exp(G_last) + (q exp(G) scale)^T dO - W^T dDelta,
    b_do and b_dD already in the dots' dtype. The gated queries' block j read from qg
    (PRE_GATED: fwd_wu's qg_out) or formed with gated_q; G read at the chunk's last row either
    way."""
    p_tk, o_k, m_k = _dhu_block_tk(rows, i_h, H, K, j, BKB)
    m_tk = m_t[:, None] & m_k[None, :]
    b_Gl = tl.load(G + (last * H + i_h) * K + o_k, mask=m_k, other=0.).to(tl.float32)
    if PRE_GATED:
        b_qg = tl.load(qg + p_tk, mask=m_tk, other=0.)
    else:
        b_G = tl.load(G + p_tk, mask=m_tk, other=0.).to(tl.float32)
        b_q = tl.load(q + p_tk, mask=m_tk, other=0.).to(tl.float32)
        b_qg = gated_q(b_q, b_G, scale, m_tk).to(DT)
    b_w = tl.load(W + p_tk, mask=m_tk, other=0.)
    return (b_dE * tl.exp(b_Gl)[:, None]
            + tl.dot(tl.trans(b_qg), b_do, input_precision=PREC)
            - tl.dot(tl.trans(b_w).to(DT), b_dD, input_precision=PREC))


@triton.jit
def _dhu_block_kv(o_v, m_v, K: tl.constexpr, V: tl.constexpr, j: tl.constexpr, BKB: tl.constexpr):
    """Offsets and mask of K block j of a [K, V] state, columns o_v."""
    o_k = j * BKB + tl.arange(0, BKB)
    return o_k[:, None] * V + o_v[None, :], (o_k < K)[:, None] & m_v[None, :]


@triton.jit
def _dhu_block_load(dht, base, o_v, m_v, K: tl.constexpr, V: tl.constexpr, j: tl.constexpr,
                    BKB: tl.constexpr, BV: tl.constexpr, USE_DHT: tl.constexpr):
    if USE_DHT:
        p_kv, m_kv = _dhu_block_kv(o_v, m_v, K, V, j, BKB)
        return tl.load(dht + base + p_kv, mask=m_kv, other=0.).to(tl.float32)
    else:
        return tl.zeros([BKB, BV], dtype=tl.float32)


@triton.jit
def _dhu_block_store(out, base, b_dE, o_v, m_v, K: tl.constexpr, V: tl.constexpr, j: tl.constexpr,
                     BKB: tl.constexpr):
    p_kv, m_kv = _dhu_block_kv(o_v, m_v, K, V, j, BKB)
    tl.store(out + base + p_kv, b_dE.to(out.dtype.element_ty), mask=m_kv)


@triton.autotune(configs=_meta_configs(DHU_KBLOCKS_SPACE), key=["H", "K", "V", "DT"])
@triton.jit
def pkda_bwd_dhu_kblocks_kernel(q, p, G, kg, qg, W, do, dv_loc, dht, dE_all, dDelta, dS0, cu,
                                chunk_off, scale, H: tl.constexpr, K: tl.constexpr,
                                V: tl.constexpr, BKB: tl.constexpr, BV: tl.constexpr,
                                DT: tl.constexpr, PREC: tl.constexpr, USE_DHT: tl.constexpr,
                                PRE_GATED: tl.constexpr):
    # pkda_bwd_dhu_kernel's reverse pass, block by block of dE's rows
    NKB: tl.constexpr = (K + BKB - 1) // BKB
    tl.static_assert(NKB <= 4, "K must fit in 4 K blocks")
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    coff = tl.load(chunk_off + i_n).to(tl.int64)
    NT = tl.cdiv(eos - bos, BT)
    o_t = tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    s0 = i_nh.to(tl.int64) * K * V
    b_dE0 = _dhu_block_load(dht, s0, o_v, m_v, K, V, 0, BKB, BV, USE_DHT)
    if NKB > 1:
        b_dE1 = _dhu_block_load(dht, s0, o_v, m_v, K, V, 1, BKB, BV, USE_DHT)
    if NKB > 2:
        b_dE2 = _dhu_block_load(dht, s0, o_v, m_v, K, V, 2, BKB, BV, USE_DHT)
    if NKB > 3:
        b_dE3 = _dhu_block_load(dht, s0, o_v, m_v, K, V, 3, BKB, BV, USE_DHT)
    for i in range(NT):
        i_t = NT - 1 - i
        cbos = bos + i_t * BT
        L = tl.minimum(eos - cbos, BT)
        last = cbos + L - 1
        sc = ((coff + i_t) * H + i_h) * K * V
        _dhu_block_store(dE_all, sc, b_dE0, o_v, m_v, K, V, 0, BKB)
        if NKB > 1:
            _dhu_block_store(dE_all, sc, b_dE1, o_v, m_v, K, V, 1, BKB)
        if NKB > 2:
            _dhu_block_store(dE_all, sc, b_dE2, o_v, m_v, K, V, 2, BKB)
        if NKB > 3:
            _dhu_block_store(dE_all, sc, b_dE3, o_v, m_v, K, V, 3, BKB)
        rows = cbos + o_t
        m_t = o_t < L
        m_tv = m_t[:, None] & m_v[None, :]
        p_tv = (rows[:, None] * H + i_h) * V + o_v[None, :]
        b_kgE = tl.zeros([BT, BV], dtype=tl.float32)
        b_kgE = _dhu_block_kgE(p, G, kg, b_dE0, b_kgE, rows, m_t, last, i_h, H, K, 0, BKB,
                               DT, PREC, PRE_GATED)
        if NKB > 1:
            b_kgE = _dhu_block_kgE(p, G, kg, b_dE1, b_kgE, rows, m_t, last, i_h, H, K, 1, BKB,
                                   DT, PREC, PRE_GATED)
        if NKB > 2:
            b_kgE = _dhu_block_kgE(p, G, kg, b_dE2, b_kgE, rows, m_t, last, i_h, H, K, 2, BKB,
                                   DT, PREC, PRE_GATED)
        if NKB > 3:
            b_kgE = _dhu_block_kgE(p, G, kg, b_dE3, b_kgE, rows, m_t, last, i_h, H, K, 3, BKB,
                                   DT, PREC, PRE_GATED)
        b_dD = tl.load(dv_loc + p_tv, mask=m_tv, other=0.) + b_kgE
        tl.store(dDelta + p_tv, b_dD.to(dDelta.dtype.element_ty), mask=m_tv)
        # every block's update reads dO and dDelta as dot operands only
        b_dD = b_dD.to(DT)
        b_do = tl.load(do + p_tv, mask=m_tv, other=0.).to(DT)
        b_dE0 = _dhu_block_step(q, G, qg, W, b_dE0, b_do, b_dD, rows, m_t, last, i_h, scale,
                                H, K, 0, BKB, DT, PREC, PRE_GATED)
        if NKB > 1:
            b_dE1 = _dhu_block_step(q, G, qg, W, b_dE1, b_do, b_dD, rows, m_t, last, i_h, scale,
                                    H, K, 1, BKB, DT, PREC, PRE_GATED)
        if NKB > 2:
            b_dE2 = _dhu_block_step(q, G, qg, W, b_dE2, b_do, b_dD, rows, m_t, last, i_h, scale,
                                    H, K, 2, BKB, DT, PREC, PRE_GATED)
        if NKB > 3:
            b_dE3 = _dhu_block_step(q, G, qg, W, b_dE3, b_do, b_dD, rows, m_t, last, i_h, scale,
                                    H, K, 3, BKB, DT, PREC, PRE_GATED)
    _dhu_block_store(dS0, s0, b_dE0, o_v, m_v, K, V, 0, BKB)
    if NKB > 1:
        _dhu_block_store(dS0, s0, b_dE1, o_v, m_v, K, V, 1, BKB)
    if NKB > 2:
        _dhu_block_store(dS0, s0, b_dE2, o_v, m_v, K, V, 2, BKB)
    if NKB > 3:
        _dhu_block_store(dS0, s0, b_dE3, o_v, m_v, K, V, 3, BKB)


# =============================================================================================
# bwd.wy_dqkg: inter-chunk dq/dk/dp, dv, dbeta (WY part), dAkk, dG of these parts
# =============================================================================================
@triton.autotune(configs=_configs([(4, 2), (8, 2)]), key=["H", "K", "V", "DT"])
@triton.jit
def pkda_bwd_wy_dqkg_kernel(q, k, v, p, G, beta, Tinv, h_all, dE_all, Delta, dDelta, do,
                            dq, dk, dp, dG, dv, dbeta, dAkk, chunks, scale,
                            H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                            BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr,
                            PREC: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, eos = _chunk_bounds(chunks, i_c)
    L = eos - bos
    o_t = tl.arange(0, BT)
    m_t = o_t < L
    rows = bos + o_t
    m_A = m_t[:, None] & m_t[None, :]
    b_Ti = tl.load(Tinv + (rows[:, None] * H + i_h) * BT + o_t[None, :], mask=m_A, other=0.)
    b_beta = tl.load(beta + rows * H + i_h, mask=m_t, other=0.).to(tl.float32)
    # part 1 (once per chunk): dX = Tinv^T dDelta -> dv, dAkk, dbeta (V part)
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_tv = (rows[:, None] * H + i_h) * V + o_v[None, :]
        b_dD = tl.load(dDelta + p_tv, mask=m_tv, other=0.)
        b_dX = tl.dot(tl.trans(b_Ti).to(DT), b_dD.to(DT), input_precision=PREC)
        b_dl = tl.load(Delta + p_tv, mask=m_tv, other=0.)
        b_dA += tl.dot(b_dX.to(DT), tl.trans(b_dl).to(DT), input_precision=PREC)
        b_v = tl.load(v + p_tv, mask=m_tv, other=0.).to(tl.float32)
        b_db += tl.sum(b_dX * b_v, axis=1)
        tl.store(dv + p_tv, (b_dX * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_tv)
    keep = m_A & (o_t[:, None] > o_t[None, :])
    tl.store(dAkk + (rows[:, None] * H + i_h) * BT + o_t[None, :], tl.where(keep, -b_dA, 0.),
             mask=m_t[:, None])
    # part 2 (per K tile): dq = scale Gam (dO h^T); dp = (Delta dE^T) e^{G_C-G};
    #                      dk = -beta Gam (dX h^T)
    h_base = (i_c.to(tl.int64) * H + i_h) * K * V
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        p_tk = (rows[:, None] * H + i_h) * K + o_k[None, :]
        b_dq = tl.zeros([BT, BK], dtype=tl.float32)
        b_dkg = tl.zeros([BT, BK], dtype=tl.float32)
        b_dXh = tl.zeros([BT, BK], dtype=tl.float32)
        b_hdE = tl.zeros([BK], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            m_tv = m_t[:, None] & m_v[None, :]
            p_tv = (rows[:, None] * H + i_h) * V + o_v[None, :]
            m_kv = m_k[:, None] & m_v[None, :]
            p_kv = h_base + o_k[:, None] * V + o_v[None, :]
            b_h = tl.load(h_all + p_kv, mask=m_kv, other=0.).to(tl.float32)
            b_dE = tl.load(dE_all + p_kv, mask=m_kv, other=0.).to(tl.float32)
            b_dD = tl.load(dDelta + p_tv, mask=m_tv, other=0.)
            b_dX = tl.dot(tl.trans(b_Ti).to(DT), b_dD.to(DT), input_precision=PREC)
            b_do = tl.load(do + p_tv, mask=m_tv, other=0.)
            b_dq += tl.dot(b_do.to(DT), tl.trans(b_h).to(DT), input_precision=PREC)
            b_dl = tl.load(Delta + p_tv, mask=m_tv, other=0.)
            b_dkg += tl.dot(b_dl.to(DT), tl.trans(b_dE).to(DT), input_precision=PREC)
            b_dXh += tl.dot(b_dX.to(DT), tl.trans(b_h).to(DT), input_precision=PREC)
            b_hdE += tl.sum(b_h * b_dE, axis=1)
        b_G = tl.load(G + p_tk, mask=m_tk, other=0.).to(tl.float32)
        b_Gl = tl.load(G + ((eos - 1) * H + i_h) * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_q = tl.load(q + p_tk, mask=m_tk, other=0.).to(tl.float32)
        b_k = tl.load(k + p_tk, mask=m_tk, other=0.).to(tl.float32)
        b_p = tl.load(p + p_tk, mask=m_tk, other=0.).to(tl.float32)
        b_gam = tl.where(m_tk, tl.exp(b_G), 0.)
        b_dq = scale * b_gam * b_dq
        b_dpk = tl.where(m_tk, b_dkg * tl.exp(b_Gl[None, :] - b_G), 0.)
        b_kgam = b_k * b_gam
        b_dk = -b_beta[:, None] * b_gam * b_dXh
        b_db -= tl.sum(b_kgam * b_dXh, axis=1)
        b_dG = b_q * b_dq + b_k * b_dk - b_p * b_dpk
        b_last = tl.exp(b_Gl) * b_hdE + tl.sum(b_p * b_dpk, axis=0)
        b_dG += tl.where((o_t == L - 1)[:, None], b_last[None, :], 0.)
        tl.store(dq + p_tk, b_dq, mask=m_tk)
        tl.store(dk + p_tk, b_dk, mask=m_tk)
        tl.store(dp + p_tk, b_dpk, mask=m_tk)
        tl.store(dG + p_tk, b_dG, mask=m_tk)
    tl.store(dbeta + rows * H + i_h, b_db, mask=m_t)


# =============================================================================================
# bwd.intra (materialised): one program per (chunk x 16-token sub-chunk, head, K tile).
# Rows I of the sub-chunk: dq, dk from the row fragment dAqk[I, :], dAkk[I, :]; dp of the
# tokens I from the column fragments dAqk[:, I], dAkk[:, I]. Adds onto the wy_dqkg outputs
# in place; dbeta via NK-sized partials (reduced by pkda_bwd_beta_reduce_kernel).
# =============================================================================================
@triton.jit
def _intra_tile(q, k, p, G, beta, b_Aq_row, b_Ak_row, b_Aq_col, b_Ak_col, b_Aq_d, b_Ak_d,
                dAqk, dAkk, DIAG_FROM_MEM: tl.constexpr, bos, L, i_s, i_h, o_k, m_k,
                H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
                PREC: tl.constexpr):
    """dq, dkr (= dk / beta) and dp of the sub-chunk's 16 tokens for one K tile, from the
    fragments (all FP32, zero outside the causal mask):
        b_Aq_row, b_Ak_row [BC, BT]  rows I of dAqk_s / dAkk (row fragment)
        b_Aq_col, b_Ak_col [BT, BC]  columns I (column fragment)
        b_Aq_d, b_Ak_d     [BC, BC]  the diagonal block [I, I] (unused with DIAG_FROM_MEM:
                                     its rows / columns are then read from dAqk, dAkk)
    Off-diagonal sub-chunks use one local reference point (exponents <= 0 on both sides);
    the diagonal block is done token by token with exact differences, masked before exp."""
    o_i = tl.arange(0, BC)
    o_t = tl.arange(0, BT)
    I0 = i_s * BC
    ti = I0 + o_i
    m_i = ti < L
    m_ik = m_i[:, None] & m_k[None, :]
    p_ik = ((bos + ti)[:, None] * H + i_h) * K + o_k[None, :]
    b_G = tl.load(G + p_ik, mask=m_ik, other=0.).to(tl.float32)
    m_tk = (o_t < L)[:, None] & m_k[None, :]
    p_tk = ((bos + o_t)[:, None] * H + i_h) * K + o_k[None, :]
    b_Ga = tl.load(G + p_tk, mask=m_tk, other=0.).to(tl.float32)
    # ---- row fragment, columns j < I0: reference point G_{I0}
    b_Gr = tl.load(G + ((bos + I0) * H + i_h) * K + o_k, mask=m_k, other=0.).to(tl.float32)
    m_j = (o_t < I0)[:, None] & m_k[None, :]
    b_pa = tl.load(p + p_tk, mask=m_j, other=0.).to(tl.float32)
    b_pg = tl.where(m_j, b_pa * tl.exp(tl.where(m_j, b_Gr[None, :] - b_Ga, 0.)), 0.)
    # masked rows load G = 0: mask inside exp too, or it overflows (harmless but noisy)
    b_e = tl.where(m_ik, tl.exp(tl.where(m_ik, b_G - b_Gr[None, :], 0.)), 0.)
    b_dq = tl.dot(b_Aq_row.to(DT), b_pg.to(DT), input_precision=PREC) * b_e
    b_dkr = tl.dot(b_Ak_row.to(DT), b_pg.to(DT), input_precision=PREC) * b_e
    # ---- column fragment, rows r > i_last: reference point G_{i_last}
    i_last = tl.minimum(I0 + BC, L) - 1
    b_Gc = tl.load(G + ((bos + i_last) * H + i_h) * K + o_k, mask=m_k, other=0.).to(tl.float32)
    m_r = (o_t > i_last) & (o_t < L)
    m_rk = m_r[:, None] & m_k[None, :]
    b_gr = tl.where(m_rk, tl.exp(tl.where(m_rk, b_Ga - b_Gc[None, :], 0.)), 0.)
    b_qa = tl.load(q + p_tk, mask=m_rk, other=0.).to(tl.float32) * b_gr
    b_ba = tl.load(beta + (bos + o_t) * H + i_h, mask=m_r, other=0.).to(tl.float32)
    b_ka = tl.load(k + p_tk, mask=m_rk, other=0.).to(tl.float32) * b_gr * b_ba[:, None]
    b_dp = (tl.dot(tl.trans(b_Aq_col).to(DT), b_qa.to(DT), input_precision=PREC)
            + tl.dot(tl.trans(b_Ak_col).to(DT), b_ka.to(DT), input_precision=PREC))
    b_dp *= tl.where(m_ik, tl.exp(b_Gc[None, :] - b_G), 0.)
    return _intra_diag(q, k, p, G, beta, b_G, b_dq, b_dkr, b_dp, b_Aq_d, b_Ak_d, dAqk, dAkk,
                       DIAG_FROM_MEM, bos, L, i_s, i_h, o_k, m_k, H, K)


@triton.jit
def _intra_blocks(q, k, p, G, beta, dAqk, dAkk, bos, L, i_s, i_h, o_k, m_k,
                  H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
                  PREC: tl.constexpr):
    """_intra_tile of the materialised schedule with the same reference points, masks and
    results, sub-chunk by sub-chunk: the rows part loops over the earlier sub-chunks, the
    columns part over the later ones, each a [BC, BK] operand tile and a [BC, BC] block of
    dAqk / dAkk read from memory. Only the sub-chunks the causal mask keeps are loaded and
    exponentiated (3 of [BC, BK] in a full chunk, against 8 for two [BT, BK] tiles), and no
    [BT, BK] FP32 tile is live (those spilled at K=V=128)."""
    o_i = tl.arange(0, BC)
    I0 = i_s * BC
    ti = I0 + o_i
    m_i = ti < L
    m_ik = m_i[:, None] & m_k[None, :]
    p_ik = ((bos + ti)[:, None] * H + i_h) * K + o_k[None, :]
    b_G = tl.load(G + p_ik, mask=m_ik, other=0.).to(tl.float32)
    # ---- rows I against the earlier sub-chunks (columns j < I0): reference point G_{I0}
    b_Gr = tl.load(G + ((bos + I0) * H + i_h) * K + o_k, mask=m_k, other=0.).to(tl.float32)
    b_dq = tl.zeros([BC, BK], dtype=tl.float32)
    b_dkr = tl.zeros([BC, BK], dtype=tl.float32)
    for j_s in range(0, i_s):
        tj = j_s * BC + o_i                                      # every tj < I0 < L
        p_jk = ((bos + tj)[:, None] * H + i_h) * K + o_k[None, :]
        m_jk = (tj < I0)[:, None] & m_k[None, :]
        b_Gj = tl.load(G + p_jk, mask=m_jk, other=0.).to(tl.float32)
        b_pj = tl.load(p + p_jk, mask=m_jk, other=0.).to(tl.float32)
        b_pg = tl.where(m_jk, b_pj * tl.exp(tl.where(m_jk, b_Gr[None, :] - b_Gj, 0.)), 0.)
        p_a = ((bos + ti)[:, None] * H + i_h) * BT + tj[None, :]  # dA[I, J]
        m_a = m_i[:, None] & (tj < I0)[None, :]
        b_aq = tl.load(dAqk + p_a, mask=m_a, other=0.)
        b_ak = tl.load(dAkk + p_a, mask=m_a, other=0.)
        b_dq += tl.dot(b_aq.to(DT), b_pg.to(DT), input_precision=PREC)
        b_dkr += tl.dot(b_ak.to(DT), b_pg.to(DT), input_precision=PREC)
    # masked rows load G = 0: mask inside exp too, or it overflows (harmless but noisy)
    b_e = tl.where(m_ik, tl.exp(tl.where(m_ik, b_G - b_Gr[None, :], 0.)), 0.)
    b_dq *= b_e
    b_dkr *= b_e
    # ---- tokens I against the later sub-chunks (rows r > i_last): reference point G_{i_last}
    i_last = tl.minimum(I0 + BC, L) - 1
    b_Gc = tl.load(G + ((bos + i_last) * H + i_h) * K + o_k, mask=m_k, other=0.).to(tl.float32)
    b_dp = tl.zeros([BC, BK], dtype=tl.float32)
    for r_s in range(i_s + 1, tl.cdiv(L, BC)):
        tr = r_s * BC + o_i                                      # every tr > i_last
        m_r = tr < L
        m_rk = m_r[:, None] & m_k[None, :]
        p_rk = ((bos + tr)[:, None] * H + i_h) * K + o_k[None, :]
        b_Gj = tl.load(G + p_rk, mask=m_rk, other=0.).to(tl.float32)
        b_gr = tl.where(m_rk, tl.exp(tl.where(m_rk, b_Gj - b_Gc[None, :], 0.)), 0.)
        b_qa = tl.load(q + p_rk, mask=m_rk, other=0.).to(tl.float32) * b_gr
        b_ba = tl.load(beta + (bos + tr) * H + i_h, mask=m_r, other=0.).to(tl.float32)
        b_ka = tl.load(k + p_rk, mask=m_rk, other=0.).to(tl.float32) * b_gr * b_ba[:, None]
        p_a = ((bos + tr)[:, None] * H + i_h) * BT + ti[None, :]  # dA[R, I]
        m_a = m_r[:, None] & m_i[None, :]
        b_aq = tl.load(dAqk + p_a, mask=m_a, other=0.)
        b_ak = tl.load(dAkk + p_a, mask=m_a, other=0.)
        b_dp += (tl.dot(tl.trans(b_aq).to(DT), b_qa.to(DT), input_precision=PREC)
                 + tl.dot(tl.trans(b_ak).to(DT), b_ka.to(DT), input_precision=PREC))
    b_dp *= tl.where(m_ik, tl.exp(b_Gc[None, :] - b_G), 0.)
    # the diagonal block's rows and columns come from memory (b_dq stands in for the unused
    # on-chip block arguments)
    return _intra_diag(q, k, p, G, beta, b_G, b_dq, b_dkr, b_dp, b_dq, b_dq, dAqk, dAkk,
                       True, bos, L, i_s, i_h, o_k, m_k, H, K)


@triton.jit
def _intra_diag(q, k, p, G, beta, b_G, b_dq, b_dkr, b_dp, b_Aq_d, b_Ak_d, dAqk, dAkk,
                DIAG_FROM_MEM: tl.constexpr, bos, L, i_s, i_h, o_k, m_k,
                H: tl.constexpr, K: tl.constexpr):
    """Adds the diagonal block [I, I] onto dq, dkr, dp, token by token with exact differences,
    masked before exp; its rows / columns from b_Aq_d, b_Ak_d or, with DIAG_FROM_MEM, from
    dAqk, dAkk."""
    o_i = tl.arange(0, BC)
    I0 = i_s * BC
    ti = I0 + o_i
    m_i = ti < L
    m_ik = m_i[:, None] & m_k[None, :]
    # ---- token s of the sub-chunk is column s (rows part) and row s (cols part)
    for s in range(0, BC):
        v_s = I0 + s < L
        p_sk = ((bos + I0 + s) * H + i_h) * K + o_k
        m_sk = m_k & v_s
        b_ps = tl.load(p + p_sk, mask=m_sk, other=0.).to(tl.float32)
        b_qs = tl.load(q + p_sk, mask=m_sk, other=0.).to(tl.float32)
        b_ks = tl.load(k + p_sk, mask=m_sk, other=0.).to(tl.float32)
        b_Gs = tl.load(G + p_sk, mask=m_sk, other=0.).to(tl.float32)
        b_bs = tl.load(beta + (bos + I0 + s) * H + i_h, mask=v_s, other=0.).to(tl.float32)
        if DIAG_FROM_MEM:   # materialised: read column s and row s of the block from HBM
            p_c = ((bos + ti) * H + i_h) * BT + I0 + s
            p_r = ((bos + I0 + s) * H + i_h) * BT + ti
            b_aq_c = tl.load(dAqk + p_c, mask=m_i & v_s, other=0.)    # dAqk[I, s]
            b_ak_c = tl.load(dAkk + p_c, mask=m_i & v_s, other=0.)
            b_aq_r = tl.load(dAqk + p_r, mask=m_i & v_s, other=0.)    # dAqk[s, I]
            b_ak_r = tl.load(dAkk + p_r, mask=m_i & v_s, other=0.)
        else:               # on chip: extract them from the [16,16] diagonal block
            sel_c = o_i[None, :] == s
            sel_r = o_i[:, None] == s
            b_aq_c = tl.sum(tl.where(sel_c, b_Aq_d, 0.), axis=1)
            b_ak_c = tl.sum(tl.where(sel_c, b_Ak_d, 0.), axis=1)
            b_aq_r = tl.sum(tl.where(sel_r, b_Aq_d, 0.), axis=0)
            b_ak_r = tl.sum(tl.where(sel_r, b_Ak_d, 0.), axis=0)
        # rows r >= s take exp(G_r - G_s), rows r <= s exp(G_s - G_r): one exp of d or -d by
        # side serves both (they meet at r = s, where both are 1), half the diagonal's exps
        lo = (o_i >= s)[:, None]
        m_d = m_ik & v_s
        b_d = b_G - b_Gs[None, :]
        b_x = tl.where(m_d, tl.exp(tl.where(m_d, tl.where(lo, b_d, -b_d), 0.)), 0.)
        e_lo = tl.where(lo, b_x, 0.)
        b_dq += b_aq_c[:, None] * b_ps[None, :] * e_lo
        b_dkr += b_ak_c[:, None] * b_ps[None, :] * e_lo
        e_up = tl.where((o_i <= s)[:, None], b_x, 0.)
        b_dp += (b_aq_r[:, None] * b_qs[None, :] + b_ak_r[:, None] * (b_bs * b_ks)[None, :]) * e_up
    return b_dq, b_dkr, b_dp


@triton.jit
def _load_frags(dAqk, dAkk, bos, L, i_s, i_h, H: tl.constexpr, LOAD_AQ: tl.constexpr,
                LOAD_DIAG: tl.constexpr):
    """Row / column / diagonal fragments of the materialised dAkk (and dAqk if LOAD_AQ),
    zero outside the causal masks the consumer expects (row: j < I0; col: r > i_last)."""
    o_i = tl.arange(0, BC)
    o_t = tl.arange(0, BT)
    I0 = i_s * BC
    ti = I0 + o_i
    m_i = ti < L
    i_last = tl.minimum(I0 + BC, L) - 1
    m_row = m_i[:, None] & (o_t < I0)[None, :]
    p_row = ((bos + ti)[:, None] * H + i_h) * BT + o_t[None, :]
    m_col = ((o_t > i_last) & (o_t < L))[:, None] & m_i[None, :]
    p_col = ((bos + o_t)[:, None] * H + i_h) * BT + ti[None, :]
    m_d = m_i[:, None] & m_i[None, :]
    p_d = ((bos + ti)[:, None] * H + i_h) * BT + ti[None, :]
    b_Ak_row = tl.load(dAkk + p_row, mask=m_row, other=0.)
    b_Ak_col = tl.load(dAkk + p_col, mask=m_col, other=0.)
    if LOAD_DIAG:
        b_Ak_d = tl.load(dAkk + p_d, mask=m_d, other=0.)
    else:
        b_Ak_d = tl.zeros([BC, BC], dtype=tl.float32)
    if LOAD_AQ:
        b_Aq_row = tl.load(dAqk + p_row, mask=m_row, other=0.)
        b_Aq_col = tl.load(dAqk + p_col, mask=m_col, other=0.)
        b_Aq_d = tl.load(dAqk + p_d, mask=m_d & LOAD_DIAG, other=0.)
    else:
        b_Aq_row = tl.zeros([BC, BT], dtype=tl.float32)
        b_Aq_col = tl.zeros([BT, BC], dtype=tl.float32)
        b_Aq_d = tl.zeros([BC, BC], dtype=tl.float32)
    return b_Aq_row, b_Ak_row, b_Aq_col, b_Ak_col, b_Aq_d, b_Ak_d


@triton.jit
def _intra_epilogue(q, k, p, beta, dq, dk, dp, dG, b_dq, b_dkr, b_dp, bos, L, i_s, i_h, o_k, m_k,
                    H: tl.constexpr, K: tl.constexpr):
    """Adds the intra parts onto dq/dk/dp/dG (in place) and returns sum_d k*dkr (dbeta part)."""
    o_i = tl.arange(0, BC)
    ti = i_s * BC + o_i
    m_i = ti < L
    rows_i = bos + ti
    m_ik = m_i[:, None] & m_k[None, :]
    p_ik = (rows_i[:, None] * H + i_h) * K + o_k[None, :]
    b_q = tl.load(q + p_ik, mask=m_ik, other=0.).to(tl.float32)
    b_k = tl.load(k + p_ik, mask=m_ik, other=0.).to(tl.float32)
    b_p = tl.load(p + p_ik, mask=m_ik, other=0.).to(tl.float32)
    b_b = tl.load(beta + rows_i * H + i_h, mask=m_i, other=0.).to(tl.float32)
    b_dk = b_b[:, None] * b_dkr
    tl.store(dq + p_ik, tl.load(dq + p_ik, mask=m_ik, other=0.) + b_dq, mask=m_ik)
    tl.store(dk + p_ik, tl.load(dk + p_ik, mask=m_ik, other=0.) + b_dk, mask=m_ik)
    tl.store(dp + p_ik, tl.load(dp + p_ik, mask=m_ik, other=0.) + b_dp, mask=m_ik)
    b_dG = b_q * b_dq + b_k * b_dk - b_p * b_dp
    tl.store(dG + p_ik, tl.load(dG + p_ik, mask=m_ik, other=0.) + b_dG, mask=m_ik)
    return tl.sum(b_k * b_dkr, axis=1)


# intra adds onto dq/dk/dp/dG in place: autotune benchmarking must restore them after each run
# (sub-chunk by sub-chunk since 7b56399: at B4_T2048_H16_D128 on an H100 the autotuner takes 4
# warps, 128 registers a thread, no spill, ncu 2026-12-07; before it, 2 warps at 255 registers
# and ~204 MB of local loads a call. PKDA_BWD_INTRA_WARPS / _STAGES try other spaces)
@triton.autotune(configs=_configs([(w, st) for w in warps_from_env("PKDA_BWD_INTRA_WARPS", (4, 2))
                                   for st in stages_from_env("PKDA_BWD_INTRA_STAGES", (1,))]),
                 key=["H", "K", "DT"], restore_value=["dq", "dk", "dp", "dG"])
@triton.jit
def pkda_bwd_intra_kernel(q, k, p, G, beta, dAqk, dAkk, dq, dk, dp, dG, dbeta_part, chunks, TT,
                          H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
                          PREC: tl.constexpr):
    i_x, i_h, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_c, i_s = i_x // NC, i_x % NC
    bos, eos = _chunk_bounds(chunks, i_c)
    L = eos - bos
    if i_s * BC < L:
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_dq, b_dkr, b_dp = _intra_blocks(q, k, p, G, beta, dAqk, dAkk, bos, L, i_s, i_h,
                                          o_k, m_k, H, K, BK, DT, PREC)
        b_db = _intra_epilogue(q, k, p, beta, dq, dk, dp, dG, b_dq, b_dkr, b_dp, bos, L, i_s,
                               i_h, o_k, m_k, H, K)
        o_i = tl.arange(0, BC)
        rows_i = bos + i_s * BC + o_i
        tl.store(dbeta_part + (i_k * TT + rows_i) * H + i_h, b_db, mask=(i_s * BC + o_i) < L)


# =============================================================================================
# The candidate schedule ("onchip", design note "The candidate: on-chip dAqk"):
#   bwd.dAv   -> pkda_bwd_dv_only_kernel: dv_loc = Aqk^T dO only (no dAqk tensor)
#   bwd.intra -> pkda_bwd_intra_onchip_kernel: one program per (chunk x sub-chunk, head);
#                the [16,64] row and [64,16] column fragments of dAqk_s (and the [16,16]
#                diagonal block) are recomputed in FP32 from dO and Delta, the K tiles are
#                looped inside the program, dbeta is accumulated over that loop and written
#                once per token (no NK partials, no reduction kernel). dAkk stays materialised.
# =============================================================================================
@triton.autotune(configs=_configs([(4, 2), (8, 2)]), key=["H", "V", "DT"])
@triton.jit
def pkda_bwd_dv_only_kernel(do, Aqk, dv_loc, chunks, H: tl.constexpr, V: tl.constexpr,
                            BV: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, eos = _chunk_bounds(chunks, i_c)
    L = eos - bos
    o_t = tl.arange(0, BT)
    m_t = o_t < L
    rows = bos + o_t
    b_A = tl.load(Aqk + (rows[:, None] * H + i_h) * BT + o_t[None, :],
                  mask=m_t[:, None] & m_t[None, :], other=0.)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_tv = (rows[:, None] * H + i_h) * V + o_v[None, :]
        b_do = tl.load(do + p_tv, mask=m_tv, other=0.)
        b_dv = tl.dot(tl.trans(b_A).to(DT), b_do.to(DT), input_precision=PREC)
        tl.store(dv_loc + p_tv, b_dv, mask=m_tv)


@triton.autotune(configs=_configs([(4, 1), (8, 1)]), key=["H", "K", "V", "DT"],
                 restore_value=["dq", "dk", "dp", "dG", "dbeta"])
@triton.jit
def pkda_bwd_intra_onchip_kernel(q, k, p, G, beta, do, Delta, dAkk, dq, dk, dp, dG, dbeta,
                                 chunks, scale,
                                 H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                                 BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr,
                                 PREC: tl.constexpr):
    i_x, i_h = tl.program_id(0), tl.program_id(1)
    i_c, i_s = i_x // NC, i_x % NC
    bos, eos = _chunk_bounds(chunks, i_c)
    L = eos - bos
    if i_s * BC < L:
        o_i = tl.arange(0, BC)
        o_t = tl.arange(0, BT)
        I0 = i_s * BC
        ti = I0 + o_i
        m_i = ti < L
        m_t = o_t < L
        i_last = tl.minimum(I0 + BC, L) - 1
        # ---- dAqk_s fragments on chip, FP32, same mask and scale as bwd.dAv
        b_Aq_row = tl.zeros([BC, BT], dtype=tl.float32)
        b_Aq_col = tl.zeros([BT, BC], dtype=tl.float32)
        b_Aq_d = tl.zeros([BC, BC], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            p_iv = ((bos + ti)[:, None] * H + i_h) * V + o_v[None, :]
            p_tv = ((bos + o_t)[:, None] * H + i_h) * V + o_v[None, :]
            b_doi = tl.load(do + p_iv, mask=m_i[:, None] & m_v[None, :], other=0.).to(DT)
            b_dli = tl.load(Delta + p_iv, mask=m_i[:, None] & m_v[None, :], other=0.).to(DT)
            b_doa = tl.load(do + p_tv, mask=m_t[:, None] & m_v[None, :], other=0.).to(DT)
            b_dla = tl.load(Delta + p_tv, mask=m_t[:, None] & m_v[None, :], other=0.).to(DT)
            b_Aq_row += tl.dot(b_doi, tl.trans(b_dla), input_precision=PREC)
            b_Aq_col += tl.dot(b_doa, tl.trans(b_dli), input_precision=PREC)
            b_Aq_d += tl.dot(b_doi, tl.trans(b_dli), input_precision=PREC)
        b_Aq_row = tl.where(m_i[:, None] & (o_t < I0)[None, :], b_Aq_row * scale, 0.)
        b_Aq_col = tl.where(((o_t > i_last) & m_t)[:, None] & m_i[None, :], b_Aq_col * scale, 0.)
        b_Aq_d = tl.where(m_i[:, None] & m_i[None, :] & (o_i[:, None] >= o_i[None, :]),
                          b_Aq_d * scale, 0.)
        _, b_Ak_row, _, b_Ak_col, _, b_Ak_d = _load_frags(dAkk, dAkk, bos, L, i_s, i_h, H,
                                                          False, True)
        # ---- every K tile inside the program; dbeta accumulated over it
        b_db = tl.zeros([BC], dtype=tl.float32)
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            b_dq, b_dkr, b_dp = _intra_tile(q, k, p, G, beta, b_Aq_row, b_Ak_row, b_Aq_col,
                                            b_Ak_col, b_Aq_d, b_Ak_d, dAkk, dAkk, False, bos, L,
                                            i_s, i_h, o_k, m_k, H, K, BK, DT, PREC)
            b_db += _intra_epilogue(q, k, p, beta, dq, dk, dp, dG, b_dq, b_dkr, b_dp, bos, L,
                                    i_s, i_h, o_k, m_k, H, K)
        p_b = (bos + ti) * H + i_h
        tl.store(dbeta + p_b, tl.load(dbeta + p_b, mask=m_i, other=0.) + b_db, mask=m_i)


@triton.jit
def pkda_bwd_beta_reduce_kernel(dbeta, dbeta_part, n, NK: tl.constexpr, BLOCK: tl.constexpr):
    """dbeta += sum over the NK partials (materialised schedule only)."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    acc = tl.load(dbeta + o, mask=m, other=0.)
    for i_k in range(NK):
        acc += tl.load(dbeta_part + i_k * n + o, mask=m, other=0.)
    tl.store(dbeta + o, acc, mask=m)


@triton.jit
def pkda_bwd_dg_cumsum_kernel(dG, dg, chunks, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """dg = in-chunk reverse cumsum of dG (G is the in-chunk inclusive cumsum of g)."""
    i_c, i_h, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos = _chunk_bounds(chunks, i_c)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m = (o_t < eos - bos)[:, None] & (o_k < K)[None, :]
    ptr = ((bos + o_t)[:, None] * H + i_h) * K + o_k[None, :]
    b = tl.load(dG + ptr, mask=m, other=0.)
    tl.store(dg + ptr, tl.cumsum(b, axis=0, reverse=True).to(dg.dtype.element_ty), mask=m)


# =============================================================================================
# bwd.atk: dp -> dk (p = k m(a)), dg_atk, dbeta_atk, dlog_atk_scale, da_0.
# One program per (sequence, head, K tile), reverse over its chunks; in-chunk, the reverse
# recurrence as an associative scan over the chunk's rows (fwd.decayed_sum). Measured on an
# H100 (docs/perf/pkda.md, 2026-12-07): the chunk-parallel form (pkda/atk-bwd-chunks, three
# launches) was slower at the public row (0.300 -> 0.450 ms with the decay matrix, 0.291 ms with
# the scan); this kernel keeps one launch and a serial walk of latency ~= its chunks.
# =============================================================================================
@triton.jit
def pkda_bwd_atk_kernel(k, a, g_atk, beta_atk, c, dp, dk, a0, dat, dga_part, dba_part, dc_part,
                        da0, cu, TT, logx, eps,
                        H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                        USE_A0: tl.constexpr, USE_DAT: tl.constexpr):
    """One program per (sequence x head x K tile): every channel's a_t is its own scan, so
    K splits freely; dg_atk / dbeta_atk (sums over K) go to per-K-tile partials."""
    NK: tl.constexpr = (K + BK - 1) // BK
    i_x = tl.program_id(0)
    i_nh, i_k = i_x // NK, i_x % NK
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    NT = tl.cdiv(eos - bos, BT)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    b_c = tl.load(c + i_h).to(tl.float32)
    if USE_DAT:
        b_carry = tl.load(dat + i_nh.to(tl.int64) * K + o_k, mask=m_k, other=0.).to(tl.float32)
    else:
        b_carry = tl.zeros([BK], dtype=tl.float32)
    if USE_A0:
        b_a0 = tl.load(a0 + i_nh.to(tl.int64) * K + o_k, mask=m_k, other=0.).to(tl.float32)
    else:
        b_a0 = tl.zeros([BK], dtype=tl.float32)
    b_dc = tl.zeros([BK], dtype=tl.float32)
    for i in range(NT):
        i_t = NT - 1 - i
        cbos = bos + i_t * BT
        L = tl.minimum(eos - cbos, BT)
        rows = cbos + o_t
        m_t = o_t < L
        m_tk = m_t[:, None] & m_k[None, :]
        p_tk = (rows[:, None] * H + i_h) * K + o_k[None, :]
        b_a = tl.load(a + p_tk, mask=m_tk, other=0.).to(tl.float32)
        b_k = tl.load(k + p_tk, mask=m_tk, other=0.).to(tl.float32)
        b_dp = tl.load(dp + p_tk, mask=m_tk, other=0.)
        b_r = tl.log(b_a + eps) - b_c
        b_ar = tl.abs(b_r) + 1.
        b_m = tl.exp(-logx * b_r / b_ar)
        b_dr = tl.where(m_tk, b_dp * b_k * b_m * (-logx) / (b_ar * b_ar), 0.)
        b_dc -= tl.sum(b_dr, axis=0)
        b_dad = b_dr / (b_a + eps)
        b_ga = tl.load(g_atk + rows * H + i_h, mask=m_t, other=0.).to(tl.float32)
        b_Ga = tl.cumsum(b_ga, axis=0)
        b_Gl = tl.sum(b_ga, axis=0)
        # in-chunk: da_r = dad_r + exp(ga_(r+1)) da_(r+1), a reverse scan over the rows (each
        # row carries the decay of the row after it; rows past L hold dad = 0), instead of a
        # [64, 64] masked decay matrix as an IEEE FMA dot; then the later chunks' carry,
        # decayed to each row
        b_dnext = tl.exp(tl.load(g_atk + (rows + 1) * H + i_h, mask=(o_t + 1) < L,
                                 other=0.).to(tl.float32))
        _, b_da = tl.associative_scan((tl.broadcast_to(b_dnext[:, None], (BT, BK)), b_dad), 0,
                                      decayed_sum, reverse=True)
        b_da += tl.exp(b_Gl - b_Ga)[:, None] * b_carry[None, :]
        m_prev = m_tk & (rows > bos)[:, None]
        b_ap = tl.load(a + p_tk - H * K, mask=m_prev, other=0.).to(tl.float32)
        b_ap += tl.where((rows == bos)[:, None] & m_k[None, :], b_a0[None, :], 0.)
        b_eg = tl.exp(b_ga)
        b_ba = tl.load(beta_atk + rows * H + i_h, mask=m_t, other=0.).to(tl.float32)
        b_dk = (tl.load(dk + p_tk, mask=m_tk, other=0.) + b_dp * b_m
                + 2. * b_ba[:, None] * b_k * b_da)
        tl.store(dk + p_tk, b_dk, mask=m_tk)
        p_part = (i_k * TT + rows) * H + i_h
        tl.store(dga_part + p_part, tl.sum(b_da * b_eg[:, None] * b_ap, axis=1), mask=m_t)
        tl.store(dba_part + p_part, tl.sum(b_da * b_k * b_k, axis=1), mask=m_t)
        b_carry = tl.sum(tl.where((o_t == 0)[:, None], b_da * b_eg[:, None], 0.), axis=0)
    tl.store(da0 + i_nh.to(tl.int64) * K + o_k, b_carry, mask=m_k)
    tl.store(dc_part + i_x, tl.sum(b_dc, axis=0))


# =============================================================================================
# Host side: layout, stage launchers, the dAqk schedule seam, pkda_bwd
# =============================================================================================
def _layout(B, T, cu_seqlens, device):
    """make_layout's (cached per shape; its chunk_bounds are the (bos, eos) the kernels read)."""
    from .reference import make_layout
    return make_layout(B, T, cu_seqlens, device)


def _new(shape, like, covered, dtype=torch.float32):
    """Output buffers: tokens outside every sequence (varlen tail) must read 0."""
    return (torch.empty if covered else torch.zeros)(shape, dtype=dtype, device=like.device)


def _bk(K):
    return min(64, triton.next_power_of_2(K))


def bwd_dAv(do, Delta, Aqk, scale, lay, write_dA=True):
    """bwd.dAv. Returns (dAqk_s FP32 [B,T,H,64] or None, dv_loc FP32 [B,T,H,V])."""
    B, T, H, V = do.shape
    dv_loc = _new(do.shape, do, lay.covered)
    dAqk = _new((B, T, H, CHUNK), do, lay.covered) if write_dA else dv_loc
    if lay.NT:
        pkda_bwd_dAv_kernel[(lay.NT, H)](do, Delta, Aqk, dAqk, dv_loc, lay.chunk_bounds, scale,
                                         H=H, V=V, BV=min(64, triton.next_power_of_2(V)),
                                         DT=_dot_dtype(do.dtype), PREC=_prec(do.dtype),
                                         WRITE_DA=write_dA)
    return (dAqk if write_dA else None), dv_loc


def bwd_dhu(q, p, G, W, do, dv_loc, dht, scale, lay, kg=None, qg=None):
    """bwd.dhu. Returns (dE_all [NT,H,K,V], dDelta [B,T,H,V]) in q's dtype and dS0 [N,H,K,V]
    in FP32 (K <= 128: pkda_bwd_dhu_kernel; 128 < K <= 256: pkda_bwd_dhu_kblocks_kernel). Both
    kernels carry dE in FP32 across chunks; what they store is read by bwd.wy_dqkg as tl.dot
    operands (cast to q's dtype there anyway) and, for dE, in dG's last-row term sum_v h dE (h
    is stored in q's dtype too): half the bytes of FP32 at bf16, both written once and read up
    to 1 + K/64 times.
    kg, qg: the gated operands fwd_wu(kg_out=, qg_out=) wrote (then p and q are not read; G
    only at each chunk's last row), else formed here from p, q and G; either kernel."""
    B, T, H, K = q.shape
    V = do.shape[-1]
    dE_all = q.new_empty((lay.NT, H, K, V))
    dDelta = _new(do.shape, do, lay.covered, dtype=q.dtype)
    dS0 = q.new_empty((lay.N, H, K, V), dtype=torch.float32)
    if (kg is None) != (qg is None):
        raise ValueError("bwd_dhu: kg and qg come together (fwd_wu's kg_out and qg_out)")
    for name, t in (("kg", kg), ("qg", qg)):
        if t is not None and (t.shape != q.shape or t.dtype != q.dtype or not t.is_contiguous()):
            raise ValueError(f"bwd_dhu: {name} must be a contiguous {tuple(q.shape)} {q.dtype} "
                             f"tensor, got {tuple(t.shape)} {t.dtype}")
    if K > 4 * DHU_KBLOCK:
        raise ValueError(f"bwd.dhu holds dE as at most 4 blocks of {DHU_KBLOCK} rows: "
                         f"K={K} > {4 * DHU_KBLOCK}")
    if lay.N and K > 128:
        pkda_bwd_dhu_kblocks_kernel[lambda meta: (lay.N * H, triton.cdiv(V, meta["BV"]))](
            q, p, G, kg, qg, W, do, dv_loc, dht if dht is not None else dS0, dE_all, dDelta,
            dS0, lay.cu, lay.chunk_offsets, scale, H=H, K=K, V=V, BKB=DHU_KBLOCK,
            DT=_dot_dtype(q.dtype), PREC=_prec(q.dtype), USE_DHT=dht is not None,
            PRE_GATED=kg is not None)
    elif lay.N:
        BK = triton.next_power_of_2(K)
        BV = min(64 if BK <= 128 else 32, triton.next_power_of_2(V))
        pkda_bwd_dhu_kernel[(lay.N * H, triton.cdiv(V, BV))](
            q, p, G, kg, qg, W, do, dv_loc, dht if dht is not None else dS0, dE_all, dDelta,
            dS0, lay.cu, lay.chunk_offsets, scale, H=H, K=K, V=V, BK=BK, BV=BV,
            DT=_dot_dtype(q.dtype), PREC=_prec(q.dtype), USE_DHT=dht is not None,
            PRE_GATED=kg is not None)
    return dE_all, dDelta, dS0


def bwd_wy_dqkg(q, k, v, p, G, beta, Tinv, h, dE_all, Delta, dDelta, do, scale, lay):
    """bwd.wy_dqkg. Returns dict(dq, dk, dp, dG [B,T,H,K], dv [B,T,H,V], dbeta [B,T,H],
    dAkk [B,T,H,64]) (inter-chunk / WY parts only) in FP32 but dv, which is final here, in
    v's dtype."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    out = dict(dq=_new(q.shape, q, lay.covered), dk=_new(q.shape, q, lay.covered),
               dp=_new(q.shape, q, lay.covered), dG=_new(q.shape, q, lay.covered),
               dv=_new(v.shape, v, lay.covered, dtype=v.dtype),
               dbeta=_new(beta.shape, beta, lay.covered),
               dAkk=_new((B, T, H, CHUNK), q, lay.covered))
    if lay.NT:
        pkda_bwd_wy_dqkg_kernel[(lay.NT, H)](
            q, k, v, p, G, beta, Tinv, h, dE_all, Delta, dDelta, do,
            out["dq"], out["dk"], out["dp"], out["dG"], out["dv"], out["dbeta"], out["dAkk"],
            lay.chunk_bounds, scale, H=H, K=K, V=V, BK=_bk(K),
            BV=min(64, triton.next_power_of_2(V)), DT=_dot_dtype(q.dtype), PREC=_prec(q.dtype))
    return out


def bwd_intra(q, k, p, G, beta, dAqk, dAkk, grads, lay):
    """bwd.intra (materialised): adds the intra-chunk parts onto grads' dq/dk/dp/dG in place,
    dbeta through NK partials and pkda_bwd_beta_reduce_kernel."""
    B, T, H, K = q.shape
    BK = min(INTRA_BK, _bk(K))
    NK = triton.cdiv(K, BK)
    TT = B * T
    part = _new((NK, B, T, H), q, lay.covered)
    if lay.NT:
        pkda_bwd_intra_kernel[(lay.NT * N_SUB, H, NK)](
            q, k, p, G, beta, dAqk, dAkk, grads["dq"], grads["dk"], grads["dp"], grads["dG"],
            part, lay.chunk_bounds, TT, H=H, K=K, BK=BK, DT=_dot_dtype(q.dtype),
            PREC=_prec(q.dtype))
        n = TT * H
        BLOCK = 1024
        pkda_bwd_beta_reduce_kernel[(triton.cdiv(n, BLOCK),)](grads["dbeta"], part, n, NK=NK,
                                                               BLOCK=BLOCK)
    return grads


def bwd_dg(dG, lay, dtype=torch.float32):
    """dg = in-chunk reverse cumsum of dG, in `dtype`."""
    B, T, H, K = dG.shape
    dg = _new(dG.shape, dG, lay.covered, dtype=dtype)
    BK = _bk(K)
    if lay.NT:
        pkda_bwd_dg_cumsum_kernel[(lay.NT, H, triton.cdiv(K, BK))](dG, dg, lay.chunk_bounds,
                                                                   H=H, K=K, BK=BK)
    return dg


def bwd_atk(k, a, g_atk, beta_atk, c, dp, dk, initial_A_state, dat, x, eps, lay):
    """bwd.atk: finishes dk in place; returns dict(dg_atk, dbeta_atk, dc [H], da0 [N,H,K])."""
    B, T, H, K = k.shape
    BK = min(32, triton.next_power_of_2(K))
    NK = triton.cdiv(K, BK)
    dga = _new((NK, B, T, H), k, lay.covered)
    dba = _new((NK, B, T, H), k, lay.covered)
    dc_part = k.new_zeros((lay.N, H, NK), dtype=torch.float32)
    da0 = k.new_zeros((lay.N, H, K), dtype=torch.float32)
    if lay.N:
        # not autotuned: it updates dk in place
        pkda_bwd_atk_kernel[(lay.N * H * NK,)](
            k, a, g_atk, beta_atk, c, dp, dk,
            initial_A_state if initial_A_state is not None else da0,
            dat if dat is not None else da0, dga, dba, dc_part, da0, lay.cu, B * T,
            math.log(x), eps, H=H, K=K, BK=BK,
            USE_A0=initial_A_state is not None, USE_DAT=dat is not None, num_warps=4)
    return dict(dg_atk=dga.sum(0), dbeta_atk=dba.sum(0), dc=dc_part.sum((0, 2)), da0=da0)


RECOMPUTE_KEYS = ("a", "p", "G", "Aqk", "Tinv", "W", "U", "h", "Delta")
# what the op's forward keeps without disable_recompute: fwd.intra's solve outputs
KEPT_BY_DEFAULT = ("Aqk", "Tinv")


def bwd_recompute(q, k, v, g, g_atk, beta_atk, beta, c, scale, x, eps, initial_state,
                  initial_A_state, lay, saved=None):
    """bwd.recompute: a, p, G (fwd.atk), Aqk, Tinv, W, U (fwd.intra), h, Delta (fwd.h), with
    the forward's own Triton stage launchers. Tensors present in `saved` are reused: all of
    RECOMPUTE_KEYS skips the stage; Aqk and Tinv alone (KEPT_BY_DEFAULT) replace fwd.intra by
    fwd_wu (W, U from Tinv)."""
    saved = saved or {}
    if all(saved.get(n) is not None for n in RECOMPUTE_KEYS):
        return {n: saved[n] for n in RECOMPUTE_KEYS}
    from . import fwd
    p, G, a, _ = fwd.fwd_atk(k, g, g_atk, beta_atk, c, lay, initial_A_state, x=x, eps=eps,
                             store_a=True)
    # the state passes' gated operands (fwd_h, bwd_dhu), written beside W
    gated = dict(kg_out=torch.empty_like(k), qg_out=torch.empty_like(q))
    if all(saved.get(n) is not None for n in KEPT_BY_DEFAULT):
        Aqk, Tinv = saved["Aqk"], saved["Tinv"]
        W, U = fwd.fwd_wu(k, v, G, beta, Tinv, lay, p=p, q=q, scale=scale, **gated)
    else:
        Aqk, Tinv, W, U, _ = fwd.fwd_intra(q, k, v, p, G, beta, scale, lay, **gated)
    h, Delta, _ = fwd.fwd_h(W, U, p, G, lay, initial_state, kg=gated["kg_out"])
    return dict(a=a, p=p, G=G, Aqk=Aqk, Tinv=Tinv, W=W, U=U, h=h, Delta=Delta,
                kg=gated["kg_out"], qg=gated["qg_out"])


# ---------------------------------------------------------------------------- the dAqk seam
ONCHIP_CAPABILITIES = {(9, 0)}


def daqk_schedule(device, dtype, K, V, env=None) -> str:
    """Which schedule of bwd.dAv + bwd.intra runs: "materialised" (default) or "onchip".
    On only with PKDA_DAQK_ONCHIP=1 AND the guard: a CUDA device whose capability is in
    ONCHIP_CAPABILITIES with fp16/bf16 inputs, or the Triton interpreter (fp32 allowed for
    tests); and K, V <= 128."""
    env = os.environ if env is None else env
    if env.get("PKDA_DAQK_ONCHIP", "0") != "1":
        return "materialised"
    if K > 128 or V > 128:
        return "materialised"
    device = torch.device(device)
    interp = env.get("TRITON_INTERPRET", "0") == "1"
    if interp:
        ok_dtype = dtype in (torch.float16, torch.bfloat16, torch.float32)
        return "onchip" if ok_dtype else "materialised"
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return "materialised"
    cap = torch.cuda.get_device_capability(device)  # device without index: the current one
    return "onchip" if tuple(cap) in ONCHIP_CAPABILITIES else "materialised"


def _dav_materialised(ctx):
    ctx["dAqk"], dv_loc = bwd_dAv(ctx["do"], ctx["Delta"], ctx["Aqk"], ctx["scale"], ctx["lay"])
    return dv_loc


def _intra_materialised(ctx, grads):
    return bwd_intra(ctx["q"], ctx["k"], ctx["p"], ctx["G"], ctx["beta"], ctx["dAqk"],
                     grads["dAkk"], grads, ctx["lay"])


def _dAv_and_intra(schedule):
    """THE seam: (producer, consumer) of the dAqk schedule. producer(ctx) -> dv_loc (and
    whatever it hands the consumer in ctx); consumer(ctx, grads) adds the intra-chunk
    dq/dk/dp/dG in place and finishes grads["dbeta"]."""
    if schedule == "materialised":
        return _dav_materialised, _intra_materialised
    if schedule == "onchip":
        return _dav_onchip, _intra_onchip
    raise ValueError(schedule)


def _flatc(t):
    return None if t is None else t.contiguous()


def pkda_bwd(q, k, v, g, g_atk, beta_atk, beta, log_atk_scale, scale, x, eps,
             initial_state, initial_A_state, cu_seqlens, do, dht, dat, saved=None,
             schedule=None):
    """See the module docstring. `schedule` overrides daqk_schedule (tests)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, g_atk, beta_atk, beta, do = map(_flatc, (q, k, v, g, g_atk, beta_atk, beta, do))
    dht, dat = _flatc(dht), _flatc(dat)
    S0 = None if initial_state is None else initial_state.float().contiguous()
    a0 = None if initial_A_state is None else initial_A_state.float().contiguous()
    if torch.is_tensor(log_atk_scale):
        c = log_atk_scale.float().reshape(H).contiguous()
    else:
        c = torch.full((H,), float(log_atk_scale), dtype=torch.float32, device=q.device)
    # the forward's layout when it is handed over: building it again would look cu_seqlens's
    # values up again (varlen; a read-back unless reference.host_cu_seqlens still holds them)
    lay = saved.get("layout") if saved else None
    if lay is None:
        lay = _layout(B, T, cu_seqlens, q.device)
    if schedule is None:
        schedule = daqk_schedule(q.device, q.dtype, K, V)
    produce, consume = _dAv_and_intra(schedule)

    with stage_range("pkda.bwd.recompute"):
        rc = bwd_recompute(q, k, v, g, g_atk, beta_atk, beta, c, scale, x, eps, S0, a0, lay, saved)
    # dhu's operands only (absent when the forward kept everything): freed after it
    kg, qg = rc.pop("kg", None), rc.pop("qg", None)
    ctx = dict(rc, q=q, k=k, beta=beta, do=do, scale=scale, lay=lay)
    with stage_range("pkda.bwd.dAv"):
        dv_loc = produce(ctx)
    with stage_range("pkda.bwd.dhu"):
        dE_all, dDelta, dS0 = bwd_dhu(q, rc["p"], rc["G"], rc["W"], do, dv_loc, dht, scale, lay,
                                      kg=kg, qg=qg)
    del kg, qg
    with stage_range("pkda.bwd.wy_dqkg"):
        grads = bwd_wy_dqkg(q, k, v, rc["p"], rc["G"], beta, rc["Tinv"], rc["h"], dE_all,
                            rc["Delta"], dDelta, do, scale, lay)
    with stage_range("pkda.bwd.intra"):
        grads = consume(ctx, grads)
        dg = bwd_dg(grads["dG"], lay, g.dtype)
    with stage_range("pkda.bwd.atk"):
        at = bwd_atk(k, rc["a"], g_atk, beta_atk, c, grads["dp"], grads["dk"], a0, dat, x, eps,
                     lay)
    return dict(q=grads["dq"], k=grads["dk"], v=grads["dv"], g=dg, g_atk=at["dg_atk"],
                beta_atk=at["dbeta_atk"], beta=grads["dbeta"], log_atk_scale=at["dc"],
                initial_state=dS0 if initial_state is not None else None,
                initial_A_state=at["da0"] if initial_A_state is not None else None)


def _dav_onchip(ctx):
    """bwd.dAv of the candidate: the lean dv-only producer."""
    do, lay = ctx["do"], ctx["lay"]
    B, T, H, V = do.shape
    dv_loc = _new(do.shape, do, lay.covered)
    if lay.NT:
        pkda_bwd_dv_only_kernel[(lay.NT, H)](do, ctx["Aqk"], dv_loc, lay.chunk_bounds, H=H, V=V,
                                             BV=min(64, triton.next_power_of_2(V)),
                                             DT=_dot_dtype(do.dtype), PREC=_prec(do.dtype))
    return dv_loc


def _intra_onchip(ctx, grads):
    """bwd.intra of the candidate: dAqk fragments recomputed on chip, K loop inside."""
    q, lay, do = ctx["q"], ctx["lay"], ctx["do"]
    B, T, H, K = q.shape
    V = do.shape[-1]
    if lay.NT:
        pkda_bwd_intra_onchip_kernel[(lay.NT * N_SUB, H)](
            q, ctx["k"], ctx["p"], ctx["G"], ctx["beta"], do, ctx["Delta"], grads["dAkk"],
            grads["dq"], grads["dk"], grads["dp"], grads["dG"], grads["dbeta"], lay.chunk_bounds,
            ctx["scale"], H=H, K=K, V=V, BK=_bk(K), BV=min(64, triton.next_power_of_2(V)),
            DT=_dot_dtype(q.dtype), PREC=_prec(q.dtype))
    return grads
