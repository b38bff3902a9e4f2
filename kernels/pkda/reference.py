"""Chunked PyTorch reference of the PKDA forward, organised by the design note's stages.

Pure torch, any float dtype (fp32 or fp64), loops over chunks in Python: slow but plain.
Every function here has a Triton twin in `fwd.py` with the same name minus `ref_` and the
same tensor layouts, so each Triton stage is tested alone against its reference stage:

    ref_fwd_atk    a, m, p (the ATK second moment and the preconditioned key) and the
                   per-channel chunk-local inclusive cumsum G of g
    ref_fwd_intra  Akk (strict), Aqk (inclusive), Tinv = (I + Akk)^-1, W, U
    ref_fwd_h      per-chunk start states h, Delta (= v_new) and the final state
    ref_fwd_o      o

Layouts (the same for dense and varlen input: the token axis is flattened, Ttot = B*T,
and a `ChunkLayout` says where every sequence and chunk lies):
    q, k, p, G, W : [B,T,H,K]      v, U, Delta, o : [B,T,H,V]
    Akk, Aqk, Tinv: [B,T,H,64]     row = token, column = position inside the token's chunk
                                   (entries above the diagonal are 0)
    h             : [NT,H,K,V]     state at the start of every chunk, NT = all chunks of all
                                   sequences, in sequence order

Chunk math (chunk of length L <= 64 starting with state S_0; G_r = sum_{j<=r} g_j):
    Akk[r,j] = beta_r * sum_d k_r[d] p_j[d] exp(G_r[d]-G_j[d])   j <  r
    Aqk[r,j] = scale  * sum_d q_r[d] p_j[d] exp(G_r[d]-G_j[d])   j <= r
    W = Tinv diag(beta) (K * exp(G)),  U = Tinv diag(beta) V
    Delta = U - W S_0,   O = scale (Q * exp(G)) S_0 + Aqk Delta
    S_L = diag(exp(G_L)) S_0 + (P * exp(G_L - G))^T Delta

exp(G_r - G_j) is never formed as exp(G_r) / exp(G_j). Akk and Aqk are computed on 16-token
sub-chunks: for an off-diagonal block (rows in sub-chunk i, columns in sub-chunk j < i) with
the reference point G_ref = G at the first row of sub-chunk i,
    exp(G_r - G_j) = exp(G_r - G_ref) * exp(G_ref - G_j),
and since j < ref <= r both factors have exponents <= 0 (g <= 0): no overflow, and an
underflow of a factor means the exact product underflows too. Diagonal blocks (r, j in the
same sub-chunk) are formed exactly, element by element, from the masked difference.
"""
from __future__ import annotations

import math
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

CHUNK = 64
SUB = 16


@dataclass(frozen=True)
class ChunkLayout:
    """Where sequences and chunks lie in the flattened token axis (Ttot = B*T).

    B, T     : the input's leading dims (B = 1 with cu_seqlens)
    N        : number of sequences (B dense, len(cu_seqlens)-1 varlen)
    bounds   : host tuple of (bos, eos) per sequence, in flattened token indices
    chunks   : host tuple of (n, chunk index inside sequence n, bos of the chunk, length)
    cu       : int32 [N+1] device tensor of sequence starts (dense: 0, T, 2T, ...)
    chunk_indices : int32 [NT, 2] device tensor of (n, chunk index inside n)
    chunk_offsets : int32 [N+1] device tensor: first global chunk of each sequence
    chunk_bounds  : int32 [NT, 2] device tensor of (bos, eos) of every chunk (the backward's)
    covered  : True when the sequences cover every token (dense, or cu_seqlens[-1] == T)

    make_layout hands the same layout to every call of one shape (its cache), so a layout is
    never changed: frozen, and the kernels only read its index tensors.
    """
    B: int
    T: int
    N: int
    bounds: tuple
    chunks: tuple
    cu: torch.Tensor
    chunk_indices: torch.Tensor
    chunk_offsets: torch.Tensor
    chunk_bounds: torch.Tensor
    covered: bool

    @property
    def NT(self) -> int:
        return len(self.chunks)

    @property
    def max_chunks(self) -> int:
        return max([(e - b + CHUNK - 1) // CHUNK for b, e in self.bounds] + [0])

    def index_tensors(self) -> tuple[torch.Tensor, ...]:
        return self.cu, self.chunk_indices, self.chunk_offsets, self.chunk_bounds


# Built layouts, least recently used first, keyed by (B, T, device, host cu_seqlens values or
# None). A pageable host->device copy is a host sync (torch's sync debug mode counts it, and
# the harness then refuses to time the op as a CUDA-graph replay), and rebuilding the index
# tensors every call costs launches or copies; a layout is immutable, so one per shape serves
# every call. Bounded because varlen keys change with every batch of sequences.
LAYOUT_CACHE_SIZE = 256
_LAYOUTS: OrderedDict = OrderedDict()
_LAYOUTS_LOCK = threading.Lock()
INT32_MAX = 2 ** 31 - 1


class _CachedLayout:
    """A cached layout and what its device tensors need beyond the stream that built them."""

    def __init__(self, layout: ChunkLayout, device: torch.device):
        self.layout = layout
        # read inside a CUDA-graph capture: every replay reads these tensors, so the entry is
        # never evicted (evicting would free memory a graph still points at)
        self.captured = False
        self.event, self.streams = None, set()
        if device.type == "cuda":
            # the index tensors are written by kernels (or a copy) queued on this stream;
            # another stream must wait for them before it first reads them
            stream = torch.cuda.current_stream(device)
            self.event = torch.cuda.Event()
            self.event.record(stream)
            self.streams.add(stream.stream_id)

    def ready_on_current_stream(self, device: torch.device) -> None:
        """Orders the current stream after the build, once per stream (a device-side wait, no
        host sync), and tells the allocator that stream reads the tensors (record_stream), so
        an eviction never hands their memory out while that stream may still read it."""
        if self.event is None:
            return
        stream = torch.cuda.current_stream(device)
        if stream.stream_id in self.streams:
            return
        stream.wait_event(self.event)
        for t in self.layout.index_tensors():
            t.record_stream(stream)
        self.streams.add(stream.stream_id)


# Host copies of cu_seqlens tensors, least recently used first, keyed by id(tensor) -> (weak
# reference to it, its stamp, host tuple). Reading a device tensor's values is a host sync,
# which a CUDA-graph capture forbids; a caller that passes the same cu_seqlens object to every
# step (the usual way to drive a varlen op; the harness's calls of one row share theirs)
# needs it read once.
# A few entries: a caller keeps few cu_seqlens tensors alive at once (_LAYOUTS, keyed by
# values, holds many more).
HOST_CU_CACHE_SIZE = 8
_HOST_CU: OrderedDict = OrderedDict()
_HOST_CU_LOCK = threading.Lock()


def _stamp(t: torch.Tensor) -> tuple:
    """What changes when the tensor's values may have: torch bumps _version on every in-place
    write through the tensor or any view of it (they share the counter); a storage swapped in
    by `t.data = ...` leaves _version alone but moves data_ptr."""
    return t._version, t.data_ptr(), t.shape, t.stride()


def host_cu_seqlens(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    """cu_seqlens's values on the host, read back (a host sync for a device tensor) only when
    this tensor object was not read before or may have been written since: the one rule for
    every reader of cu_seqlens (op validation, make_layout). A hit touches no device and no
    tensor data, so it is legal inside a CUDA-graph capture; a miss there raises from tolist()
    as any sync does, and the harness times the op eagerly.

    Limit: only writes torch sees are noticed. A write that bypasses the version counter (a
    raw kernel or a foreign library writing into the tensor's memory, a DLPack alias) leaves
    the stale values in use. Inference tensors have no version counter: never cached."""
    if cu_seqlens.is_inference():
        return tuple(int(i) for i in cu_seqlens.tolist())
    key, stamp = id(cu_seqlens), _stamp(cu_seqlens)
    with _HOST_CU_LOCK:
        entry = _HOST_CU.get(key)
        # the weak reference tells a live tensor from a new one that got a dead one's id
        if entry is not None and entry[0]() is cu_seqlens and entry[1] == stamp:
            _HOST_CU.move_to_end(key)
            return entry[2]
    host = tuple(int(i) for i in cu_seqlens.tolist())
    with _HOST_CU_LOCK:
        _HOST_CU[key] = (weakref.ref(cu_seqlens), stamp, host)
        _HOST_CU.move_to_end(key)
        while len(_HOST_CU) > HOST_CU_CACHE_SIZE:
            _HOST_CU.popitem(last=False)
    return host


def make_layout(B: int, T: int, cu_seqlens: torch.Tensor | None, device,
                host_cu: list | None = None) -> ChunkLayout:
    """The chunk layout of a call, built once per (B, T, device, cu_seqlens values) and then
    reused (no host sync and no launch on a later call of that shape). Varlen takes
    cu_seqlens's values from `host_cu` when the caller holds them, else from host_cu_seqlens
    (a read-back, i.e. a host sync, only for a tensor object not read before or written
    since), and copies its index tensors to the device once per distinct cu_seqlens; dense
    input never syncs: its index tensors are made by device ops.

    Inside a CUDA-graph capture a cached layout is used as it is (torch.cuda.graph synchronises
    the device first, so it is complete) and kept for good; one built there is not cached, as
    its kernels only run at replay."""
    device = torch.device(device)
    cs = None
    if cu_seqlens is not None:
        cs = tuple(int(i) for i in host_cu) if host_cu is not None else host_cu_seqlens(cu_seqlens)
    key = (B, T, device, cs)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    with _LAYOUTS_LOCK:
        entry = _LAYOUTS.get(key)
        if entry is not None:
            _LAYOUTS.move_to_end(key)
            entry.captured = entry.captured or capturing
    if entry is not None:
        if not capturing:  # a capture has no use for an event recorded before it began
            entry.ready_on_current_stream(device)
        return entry.layout
    layout = _build_layout(B, T, cs, device)
    if not capturing:
        with _LAYOUTS_LOCK:
            _LAYOUTS.setdefault(key, _CachedLayout(layout, device))
            over = len(_LAYOUTS) - LAYOUT_CACHE_SIZE
            if over > 0:
                for old in [k for k, e in _LAYOUTS.items() if not e.captured][:over]:
                    del _LAYOUTS[old]
    return layout


def _build_layout(B: int, T: int, cs: tuple | None, device: torch.device) -> ChunkLayout:
    if cs is None:
        bounds = tuple((b * T, (b + 1) * T) for b in range(B))
    else:
        bounds = tuple((cs[n], cs[n + 1]) for n in range(len(cs) - 1))
    chunks, offsets = [], [0]
    for n, (bos, eos) in enumerate(bounds):
        for i, s in enumerate(range(bos, eos, CHUNK)):
            chunks.append((n, i, s, min(CHUNK, eos - s)))
        offsets.append(len(chunks))
    if cs is None:
        index = _dense_index(B, T, device)
    else:
        index = _copied_index(bounds, chunks, offsets, device)
    covered = cs is None or (bool(bounds) and bounds[-1][1] == T)
    return ChunkLayout(B, T, len(bounds), bounds, tuple(chunks), *index, covered)


def _dense_index(B: int, T: int, device: torch.device):
    """cu, chunk_indices, chunk_offsets, chunk_bounds of B sequences of T tokens, made on the
    device by arange and arithmetic: no host->device copy at all."""
    if B * T > INT32_MAX - CHUNK:  # int32 arithmetic (bos + CHUNK) would wrap silently
        raise ValueError(f"B*T = {B * T} tokens exceed the int32 chunk layout")
    NC = (T + CHUNK - 1) // CHUNK  # chunks per sequence
    i32 = dict(dtype=torch.int32, device=device)
    seqs = torch.arange(B + 1, **i32)
    c = torch.arange(B * NC, **i32)
    n, i = c // max(NC, 1), c % max(NC, 1)  # NC = 0 (T = 0): no chunks, nothing divided
    bos = n * T + i * CHUNK
    eos = torch.minimum(bos + CHUNK, (n + 1) * T)
    return seqs * T, torch.stack((n, i), 1), seqs * NC, torch.stack((bos, eos), 1)


def _copied_index(bounds, chunks, offsets, device: torch.device):
    """The same four index tensors of a varlen layout, from the host lists in one host->device
    copy (one sync instead of four); each starts at a multiple of 16 bytes of the buffer, the
    alignment Triton specialises pointer arguments on, as a tensor of its own would."""
    parts = ([b for b, _ in bounds] + [bounds[-1][1] if bounds else 0],
             [v for n, i, _, _ in chunks for v in (n, i)],
             offsets,
             [v for _, _, s, L in chunks for v in (s, s + L)])
    starts, flat = [], []
    for part in parts:
        starts.append(len(flat))
        flat += part + [0] * (-len(part) % 4)
    buf = torch.tensor(flat, dtype=torch.int32).to(device)
    cu, ci, co, cb = (buf[s:s + len(part)] for s, part in zip(starts, parts))
    return cu, ci.view(-1, 2), co, cb.view(-1, 2)


def _flat(t):
    return t.reshape(-1, *t.shape[2:])  # [B,T,H,...] -> [Ttot,H,...]


# ----------------------------------------------------------------------------- fwd.atk
def ref_fwd_atk(k, g, g_atk, beta_atk, log_atk_scale, layout, initial_A_state=None,
                x=1.5, eps=1e-6, compute_dtype=torch.float32):
    """k: normalised [B,T,H,K]. Returns dict(a, m, p, G [B,T,H,K], a_final [N,H,K]).

    Per chunk with Ga = inclusive cumsum of g_atk (scalar per token) and a_in the carried
    state:  a_r = exp(Ga_r) a_in + sum_{j<=r} exp(Ga_r - Ga_j) beta_atk_j k_j^2.
    """
    cd = compute_dtype
    kf, gf = _flat(k).to(cd), _flat(g).to(cd)
    gaf, baf = _flat(g_atk).to(cd), _flat(beta_atk).to(cd)
    H, K = kf.shape[1], kf.shape[2]
    c = log_atk_scale.to(cd).reshape(H) if torch.is_tensor(log_atk_scale) else \
        torch.full((H,), float(log_atk_scale), dtype=cd, device=k.device)
    a = torch.zeros_like(kf)
    G = torch.zeros_like(gf)
    a_final = kf.new_zeros(layout.N, H, K)
    for n, (bos, eos) in enumerate(layout.bounds):
        a_in = initial_A_state[n].to(cd) if initial_A_state is not None else kf.new_zeros(H, K)
        for s in range(bos, eos, CHUNK):
            e = min(s + CHUNK, eos)
            Ga = gaf[s:e].cumsum(0)                                     # [L,H]
            diff = Ga[:, None, :] - Ga[None, :, :]                      # [r,j,H]
            tril = torch.ones(e - s, e - s, dtype=torch.bool, device=k.device).tril()
            Lm = torch.exp(torch.where(tril[:, :, None], diff, torch.full_like(diff, -math.inf)))
            b = baf[s:e, :, None] * kf[s:e] ** 2                        # [L,H,K]
            a[s:e] = torch.exp(Ga)[:, :, None] * a_in + torch.einsum("rjh,jhk->rhk", Lm, b)
            a_in = a[e - 1]
            G[s:e] = gf[s:e].cumsum(0)
        a_final[n] = a_in
    r = torch.log(a + eps) - c[None, :, None]
    m = torch.exp(-math.log(x) * r / (1 + r.abs()))
    p = kf * m
    shp = k.shape
    return dict(a=a.reshape(shp), m=m.reshape(shp), p=p.reshape(shp), G=G.reshape(shp),
                a_final=a_final)


# ----------------------------------------------------------------------------- fwd.intra
def _chunk_A(qc, kc, pc, Gc, bc, scale):
    """One chunk, heads first: qc,kc,pc,Gc [H,L,K], bc [H,L] -> Akk (strict), Aqk [H,L,L]."""
    H, L, K = kc.shape
    Akk = kc.new_zeros(H, L, L)
    Aqk = kc.new_zeros(H, L, L)
    for i0 in range(0, L, SUB):
        i1 = min(i0 + SUB, L)
        # diagonal block: exact, from the masked difference (exponent <= 0)
        diff = Gc[:, i0:i1, None, :] - Gc[:, None, i0:i1, :]          # [H,r,j,K]
        n = i1 - i0
        tril = torch.ones(n, n, dtype=torch.bool, device=kc.device).tril()
        D = torch.exp(torch.where(tril[None, :, :, None], diff, torch.full_like(diff, -math.inf)))
        pj = pc[:, None, i0:i1, :] * D
        Akk[:, i0:i1, i0:i1] = torch.einsum("hrk,hrjk->hrj", kc[:, i0:i1], pj).tril(-1)
        Aqk[:, i0:i1, i0:i1] = torch.einsum("hrk,hrjk->hrj", qc[:, i0:i1], pj)
        # off-diagonal blocks j < i0, reference point = G at the block's first row
        for j0 in range(0, i0, SUB):
            j1 = j0 + SUB
            Gref = Gc[:, i0:i0 + 1]                                      # [H,1,K]
            row = torch.exp(Gc[:, i0:i1] - Gref)                         # <= 1
            col = pc[:, j0:j1] * torch.exp(Gref - Gc[:, j0:j1])          # <= 1 factor
            Akk[:, i0:i1, j0:j1] = (kc[:, i0:i1] * row) @ col.transpose(1, 2)
            Aqk[:, i0:i1, j0:j1] = (qc[:, i0:i1] * row) @ col.transpose(1, 2)
    return bc[:, :, None] * Akk, scale * Aqk


def ref_fwd_intra(q, k, v, p, G, beta, scale, layout, compute_dtype=torch.float32):
    """q, k normalised. Returns dict(Akk, Aqk, Tinv [B,T,H,64], W [B,T,H,K], U [B,T,H,V])."""
    cd = compute_dtype
    qf, kf, vf, pf, Gf = (_flat(t).to(cd) for t in (q, k, v, p, G))
    bf = _flat(beta).to(cd)
    Ttot, H, K = kf.shape
    Akk, Aqk, Tinv = (kf.new_zeros(Ttot, H, CHUNK) for _ in range(3))
    W, U = torch.zeros_like(kf), torch.zeros_like(vf)
    for _, _, s, L in layout.chunks:
        e = s + L
        hf = lambda t: t[s:e].transpose(0, 1)                             # [H,L,...]
        akk, aqk = _chunk_A(hf(qf), hf(kf), hf(pf), hf(Gf), hf(bf), scale)
        eye = torch.eye(L, dtype=cd, device=k.device).expand(H, L, L)
        tinv = torch.linalg.solve_triangular(eye + akk, eye, upper=False, unitriangular=True)
        bcol = hf(bf)[:, :, None]
        W[s:e] = (tinv @ (bcol * hf(kf) * torch.exp(hf(Gf)))).transpose(0, 1)
        U[s:e] = (tinv @ (bcol * hf(vf))).transpose(0, 1)
        Akk[s:e, :, :L] = akk.transpose(0, 1)
        Aqk[s:e, :, :L] = aqk.transpose(0, 1)
        Tinv[s:e, :, :L] = tinv.transpose(0, 1)
    shp = lambda t, like: t.reshape(*like.shape[:3], t.shape[-1])
    return dict(Akk=shp(Akk, k), Aqk=shp(Aqk, k), Tinv=shp(Tinv, k), W=W.reshape(k.shape),
                U=U.reshape(v.shape))


# ----------------------------------------------------------------------------- fwd.h
def ref_fwd_h(W, U, p, G, layout, initial_state=None, compute_dtype=torch.float32):
    """Returns dict(h [NT,H,K,V] chunk start states, Delta [B,T,H,V], final [N,H,K,V])."""
    cd = compute_dtype
    Wf, Uf, pf, Gf = (_flat(t).to(cd) for t in (W, U, p, G))
    Ttot, H, K = Wf.shape
    V = Uf.shape[-1]
    h = Wf.new_zeros(layout.NT, H, K, V)
    Delta = torch.zeros_like(Uf)
    final = Wf.new_zeros(layout.N, H, K, V)
    ci = 0
    for n, (bos, eos) in enumerate(layout.bounds):
        S = initial_state[n].to(cd) if initial_state is not None else Wf.new_zeros(H, K, V)
        for s in range(bos, eos, CHUNK):
            e = min(s + CHUNK, eos)
            h[ci] = S
            ci += 1
            hf = lambda t: t[s:e].transpose(0, 1)
            d = hf(Uf) - hf(Wf) @ S                                       # [H,L,V]
            Delta[s:e] = d.transpose(0, 1)
            Gl = Gf[e - 1]                                                # [H,K]
            kg = hf(pf) * torch.exp(Gl[:, None, :] - hf(Gf))              # exponent <= 0
            S = torch.exp(Gl)[:, :, None] * S + kg.transpose(1, 2) @ d
        final[n] = S
    return dict(h=h, Delta=Delta.reshape(U.shape), final=final)


# ----------------------------------------------------------------------------- fwd.o
def ref_fwd_o(q, G, h, Aqk, Delta, scale, layout, compute_dtype=torch.float32):
    """o [B,T,H,V] = scale (Q*exp(G)) h + Aqk Delta per chunk (zeros outside every sequence)."""
    cd = compute_dtype
    qf, Gf, Af, Df = (_flat(t).to(cd) for t in (q, G, Aqk, Delta))
    o = torch.zeros_like(Df)
    for ci, (_, _, s, L) in enumerate(layout.chunks):
        e = s + L
        hf = lambda t: t[s:e].transpose(0, 1)
        inter = scale * (hf(qf) * torch.exp(hf(Gf))) @ h[ci].to(cd)      # [H,L,V]
        intra = hf(Af)[:, :, :L] @ hf(Df)
        o[s:e] = (inter + intra).transpose(0, 1)
    return o.reshape(Delta.shape)


# ----------------------------------------------------------------------------- all stages
def l2norm_ref(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def ref_pkda_fwd(q, k, v, g, g_atk, beta_atk, beta, scale=None, initial_state=None,
                 initial_A_state=None, output_final_state=False, cu_seqlens=None, x=1.5,
                 eps=1e-6, log_atk_scale=None, compute_dtype=torch.float32):
    """The four stages chained; same contract as chunk_precond_kda (forward only)."""
    B, T, H, K = q.shape
    cd = compute_dtype
    if scale is None:
        scale = K ** -0.5
    if log_atk_scale is None:
        log_atk_scale = torch.full((H,), -0.2, dtype=cd, device=q.device)
    layout = make_layout(B, T, cu_seqlens, q.device)
    qn, kn = l2norm_ref(q.to(cd)), l2norm_ref(k.to(cd))
    atk = ref_fwd_atk(kn, g, g_atk, beta_atk, log_atk_scale, layout, initial_A_state, x, eps, cd)
    intra = ref_fwd_intra(qn, kn, v, atk["p"], atk["G"], beta, scale, layout, cd)
    hs = ref_fwd_h(intra["W"], intra["U"], atk["p"], atk["G"], layout, initial_state, cd)
    o = ref_fwd_o(qn, atk["G"], hs["h"], intra["Aqk"], hs["Delta"], scale, layout, cd)
    if not output_final_state:
        return o.to(v.dtype), None, None
    return o.to(v.dtype), hs["final"], atk["a_final"]
