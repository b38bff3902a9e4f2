"""PKDA forward: naive oracle, chunk reference, Triton forward stages (CPU interpreter, fp32)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels.pkda.naive import naive_recurrent_precond_kda

ROOT = Path(__file__).resolve().parents[1]


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make(B, T, H, K, V, seed=0, dtype=torch.float32, states=False, N=None):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    d = dict(
        q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, V),
        g=F.logsigmoid(r(B, T, H, K)), g_atk=F.logsigmoid(r(B, T, H)),
        beta_atk=torch.sigmoid(r(B, T, H)), beta=torch.sigmoid(r(B, T, H)),
        log_atk_scale=r(H),
    )
    d = {k: t.to(dtype) if k != "log_atk_scale" else t for k, t in d.items()}
    if states:
        N = B if N is None else N
        d["initial_state"] = r(N, H, K, V)
        d["initial_A_state"] = torch.rand(N, H, K, generator=gen)
    return d


def simple_loop_fp64(q, k, v, g, g_atk, beta_atk, beta, log_atk_scale, initial_state=None,
                     initial_A_state=None, x=1.5, eps=1e-6):
    """An independent scalar-index loop in fp64 (per b, h, t), written from the design note."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g = (t.double() for t in (q, k, v, g))
    g_atk, beta_atk, beta, c = (t.double() for t in (g_atk, beta_atk, beta, log_atk_scale))
    o = torch.zeros(B, T, H, V, dtype=torch.float64)
    Sf = torch.zeros(B, H, K, V, dtype=torch.float64)
    af = torch.zeros(B, H, K, dtype=torch.float64)
    scale = 1 / math.sqrt(K)
    for b in range(B):
        for h in range(H):
            S = initial_state[b, h].double().clone() if initial_state is not None else torch.zeros(K, V, dtype=torch.float64)
            a = initial_A_state[b, h].double().clone() if initial_A_state is not None else torch.zeros(K, dtype=torch.float64)
            for t in range(T):
                qt = q[b, t, h] / torch.sqrt((q[b, t, h] ** 2).sum() + 1e-6)
                kt = k[b, t, h] / torch.sqrt((k[b, t, h] ** 2).sum() + 1e-6)
                a = math.exp(g_atk[b, t, h]) * a + beta_atk[b, t, h] * kt ** 2
                r = torch.log(a + eps) - c[h]
                m = torch.exp(-math.log(x) * r / (1 + r.abs()))
                p = kt * m
                S = torch.exp(g[b, t, h])[:, None] * S
                delta = beta[b, t, h] * (v[b, t, h] - S.T @ kt)
                S = S + torch.outer(p, delta)
                o[b, t, h] = S.T @ (scale * qt)
            Sf[b, h], af[b, h] = S, a
    return o, Sf, af


# ---------------------------------------------------------------- naive oracle
def test_naive_matches_independent_fp64_loop():
    d = make(2, 37, 2, 8, 12, seed=1, states=True)
    ref = simple_loop_fp64(**d)
    # fp64 math: o is rounded to v's dtype (fp32), the finals stay fp64
    for cd, tol_o, tol_s in ((torch.float64, 1e-7, 1e-12), (torch.float32, 1e-5, 1e-5)):
        o, S, a = naive_recurrent_precond_kda(**d, output_final_state=True, compute_dtype=cd)
        assert o.dtype == torch.float32
        assert rel(o, ref[0]) < tol_o and rel(S, ref[1]) < tol_s and rel(a, ref[2]) < tol_s


def test_naive_no_final_state_and_dtype():
    d = make(1, 5, 1, 4, 4, dtype=torch.bfloat16)
    o, S, a = naive_recurrent_precond_kda(**d)
    assert o.dtype == torch.bfloat16 and S is None and a is None


def test_naive_varlen_equals_one_by_one():
    B, H, K, V = 1, 2, 8, 6
    lens = [5, 0, 17, 3]
    T = sum(lens)
    d = make(B, T, H, K, V, seed=2, states=True, N=len(lens))
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    o, S, a = naive_recurrent_precond_kda(**d, cu_seqlens=cu, output_final_state=True,
                                          compute_dtype=torch.float64)
    for n in range(len(lens)):
        sl = slice(int(cu[n]), int(cu[n + 1]))
        one = {k: (t[:, sl] if t.dim() >= 3 and k not in ("initial_state", "initial_A_state") else t)
               for k, t in d.items()}
        one["initial_state"] = d["initial_state"][n:n + 1]
        one["initial_A_state"] = d["initial_A_state"][n:n + 1]
        o1, S1, a1 = naive_recurrent_precond_kda(**one, output_final_state=True,
                                                 compute_dtype=torch.float64)
        assert torch.allclose(o[:, sl], o1, atol=1e-6)
        assert torch.allclose(S[n], S1[0].to(S.dtype), atol=1e-6)
        assert torch.allclose(a[n], a1[0].to(a.dtype), atol=1e-6)


def test_naive_is_differentiable():
    d = make(1, 6, 1, 4, 4, seed=3, dtype=torch.float64, states=True)
    d = {k: t.double().requires_grad_(True) for k, t in d.items()}
    fn = lambda *xs: naive_recurrent_precond_kda(*xs[:7], log_atk_scale=xs[7], initial_state=xs[8],
                                                  initial_A_state=xs[9], output_final_state=True,
                                                  compute_dtype=torch.float64)
    names = ["q", "k", "v", "g", "g_atk", "beta_atk", "beta", "log_atk_scale", "initial_state", "initial_A_state"]
    assert torch.autograd.gradcheck(lambda *xs: sum(r.sum() for r in fn(*xs)), [d[n] for n in names])


# ---------------------------------------------------------------- inputs factory
def _inputs_module():
    spec = importlib.util.spec_from_file_location("pkda_inputs", ROOT / "experiments/inputs/pkda.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_inputs_factory_dense_and_varlen():
    m = _inputs_module()
    a = m.make_inputs({"B": 2, "T": 9, "H": 3, "K": 64, "V": 128}, "fwdbwd", torch.float32, "cpu", 7)
    b = m.make_inputs({"B": 2, "T": 9, "H": 3, "K": 64, "V": 128}, "fwdbwd", torch.float32, "cpu", 7)
    assert a["args"] == () and set(a["grad_inputs"]) <= set(a["kwargs"])
    for n in a["grad_inputs"]:
        assert a["kwargs"][n].requires_grad and torch.equal(a["kwargs"][n], b["kwargs"][n])
    kw = a["kwargs"]
    assert kw["q"].shape == (2, 9, 3, 64) and kw["v"].shape == (2, 9, 3, 128)
    assert kw["g"].shape == (2, 9, 3, 64) and kw["g_atk"].shape == (2, 9, 3)
    assert kw["log_atk_scale"].dtype == torch.float32 and kw["log_atk_scale"].shape == (3,)
    assert (kw["g"] <= 0).all() and (kw["beta"] > 0).all() and (kw["beta"] < 1).all()
    c = m.make_inputs({"seqlens": [3, 5], "H": 1, "D": 64}, "fwd", torch.bfloat16, "cpu", 0)
    assert c["grad_inputs"] == [] and c["kwargs"]["q"].dtype == torch.bfloat16
    assert c["kwargs"]["cu_seqlens"].tolist() == [0, 3, 8] and c["kwargs"]["cu_seqlens"].dtype == torch.int32
    assert not any(t.requires_grad for t in c["kwargs"].values() if torch.is_tensor(t))
    # runs through the oracle
    naive_recurrent_precond_kda(**{k: v for k, v in a["kwargs"].items()})


def test_inputs_factory_shape_problem():
    m = _inputs_module()
    assert m.shape_problem({"B": 4, "T": 2048, "H": 16, "D": 128}) is None
    assert m.shape_problem({"B": 1, "T": 64, "H": 2, "K": 64, "V": 128}) is None
    assert m.shape_problem({"B": 8, "T": 2048, "H": 32, "D": 256}) is None  # the registered D256 row
    assert "K=257" in m.shape_problem({"B": 8, "T": 2048, "H": 32, "D": 257})
    assert m.shape_problem({"B": 8, "T": 2048, "H": 32, "K": 64, "V": 32}) is None  # padded
    assert m.shape_problem({"B": 1, "T": 63, "H": 2, "K": 60, "V": 100}) is None
    assert m.shape_problem({"B": 8, "T": 2048, "H": 32, "K": 64, "V": 129}) is None  # padded to 256
    assert "V=300" in m.shape_problem({"B": 8, "T": 2048, "H": 32, "K": 64, "V": 300})
    with pytest.raises(ValueError, match="K=512"):
        m.make_inputs({"B": 1, "T": 4, "H": 1, "D": 512}, "fwd", torch.float32, "cpu", 0)
    assert "kernels" not in (ROOT / "experiments/inputs/pkda.py").read_text().split('"""')[-1]


# ---------------------------------------------------------------- chunk reference
from kernels.pkda import fwd as F_
from kernels.pkda import reference as R


def test_reference_matches_naive_fp64():
    # strong gates (cumulative G down to about -150 in a chunk) and a partial chunk
    d = make(2, 150, 2, 16, 24, seed=4, dtype=torch.float64, states=True)
    d["g"] = d["g"] * 3
    d = {k: t.double() for k, t in d.items()}
    n = naive_recurrent_precond_kda(**d, output_final_state=True, compute_dtype=torch.float64)
    r = R.ref_pkda_fwd(**d, output_final_state=True, compute_dtype=torch.float64)
    for a, b in zip(r, n):
        assert rel(a, b) < 1e-12
    cu = torch.tensor([0, 20, 20, 150, 171, 300])
    flat = {k: (t.reshape(1, 300, *t.shape[2:]) if t.dim() >= 3 and t.shape[:2] == (2, 150) else t)
            for k, t in d.items() if k not in ("initial_state", "initial_A_state")}
    st = dict(initial_state=torch.randn(5, 2, 16, 24, dtype=torch.float64),
              initial_A_state=torch.rand(5, 2, 16, dtype=torch.float64))
    n = naive_recurrent_precond_kda(**flat, **st, cu_seqlens=cu, output_final_state=True,
                                    compute_dtype=torch.float64)
    r = R.ref_pkda_fwd(**flat, **st, cu_seqlens=cu, output_final_state=True, compute_dtype=torch.float64)
    for a, b in zip(r, n):
        assert rel(a, b) < 1e-12


# ---------------------------------------------------------------- Triton stages (interpreter)
@pytest.fixture(scope="module")
def stages():
    """One dense case, K != V, T not a multiple of 64, initial states: every Triton stage
    run alone on the reference's inputs and compared with the reference stage."""
    B, T, H, K, V = 1, 100, 1, 64, 128
    d = make(B, T, H, K, V, seed=5, states=True)
    lay = R.make_layout(B, T, None, "cpu")
    qn, q_rstd = F_.l2norm_fwd(d["q"])
    kn, _ = F_.l2norm_fwd(d["k"])
    out = dict(d=d, lay=lay, qn=qn, kn=kn, q_rstd=q_rstd, scale=K ** -0.5)
    out["atk"] = F_.fwd_atk(kn, d["g"], d["g_atk"], d["beta_atk"], d["log_atk_scale"], lay,
                            d["initial_A_state"], output_final_state=True, store_a=True)
    out["ref_atk"] = R.ref_fwd_atk(kn, d["g"], d["g_atk"], d["beta_atk"], d["log_atk_scale"], lay,
                                   d["initial_A_state"])
    ra = out["ref_atk"]
    out["intra"] = F_.fwd_intra(qn, kn, d["v"], ra["p"], ra["G"], d["beta"], out["scale"], lay,
                                store_akk=True)
    out["ref_intra"] = R.ref_fwd_intra(qn, kn, d["v"], ra["p"], ra["G"], d["beta"], out["scale"], lay)
    ri = out["ref_intra"]
    out["h"] = F_.fwd_h(ri["W"], ri["U"], ra["p"], ra["G"], lay, d["initial_state"],
                        output_final_state=True)
    out["ref_h"] = R.ref_fwd_h(ri["W"], ri["U"], ra["p"], ra["G"], lay, d["initial_state"])
    rh = out["ref_h"]
    out["o"] = F_.fwd_o(qn, ra["G"], rh["h"], ri["Aqk"], rh["Delta"], out["scale"], lay)
    out["ref_o"] = R.ref_fwd_o(qn, ra["G"], rh["h"], ri["Aqk"], rh["Delta"], out["scale"], lay)
    # the Triton stages chained, end to end
    p, G, _, a_fin = out["atk"]
    Aqk, _, W, U, _ = out["intra"]
    h, Delta, S_fin = F_.fwd_h(W, U, p, G, lay, d["initial_state"], output_final_state=True)
    out["chain"] = (F_.fwd_o(qn, G, h, Aqk, Delta, out["scale"], lay), S_fin, a_fin)
    return out


def test_l2norm_fwd_bwd():
    x = torch.randn(3, 5, 2, 64)
    y, rstd = F_.l2norm_fwd(x)
    assert rel(y, R.l2norm_ref(x)) < 1e-6
    xr = x.clone().requires_grad_(True)
    dy = torch.randn_like(x)
    R.l2norm_ref(xr).backward(dy)
    assert rel(F_.l2norm_bwd(y, rstd, dy), xr.grad) < 1e-5


def test_stage_atk(stages):
    p, G, a, a_fin = stages["atk"]
    r = stages["ref_atk"]
    assert rel(p, r["p"]) < 1e-5 and rel(G, r["G"]) < 1e-6
    assert rel(a, r["a"]) < 1e-5 and rel(a_fin, r["a_final"]) < 1e-5


def test_stage_intra(stages):
    Aqk, Tinv, W, U, Akk = stages["intra"]
    r = stages["ref_intra"]
    for got, name in ((Aqk, "Aqk"), (Tinv, "Tinv"), (Akk, "Akk"), (W, "W"), (U, "U")):
        assert rel(got, r[name]) < 1e-5, name
    # structure: Akk strictly lower, Aqk and Tinv lower with a unit diagonal on Tinv
    c = torch.arange(64)
    pos = torch.arange(100) % 64
    assert (Akk[0, :, 0][c[None, :] >= pos[:, None]] == 0).all()
    assert (Aqk[0, :, 0][c[None, :] > pos[:, None]] == 0).all()
    assert torch.allclose(Tinv[0, torch.arange(100), 0, pos], torch.ones(100))


def test_stage_h(stages):
    h, Delta, S_fin = stages["h"]
    r = stages["ref_h"]
    assert rel(h, r["h"]) < 1e-5 and rel(Delta, r["Delta"]) < 1e-5 and rel(S_fin, r["final"]) < 1e-5


def test_stage_o(stages):
    assert rel(stages["o"], stages["ref_o"]) < 1e-5


def test_triton_forward_matches_naive(stages):
    d = stages["d"]
    o, S, a = naive_recurrent_precond_kda(**d, output_final_state=True, compute_dtype=torch.float64)
    got = stages["chain"]
    # a wrong sign or a missing term moves these by O(1); fp32 rounding by ~1e-6
    assert rel(got[0], o) < 1e-5 and rel(got[1], S) < 1e-5 and rel(got[2], a) < 1e-5


def test_op_varlen_matches_naive_and_no_state_allocated():
    from kernels.pkda import chunk_precond_kda
    H, K, V = 1, 64, 64
    cu = torch.tensor([0, 20, 20, 90], dtype=torch.int32)
    d = make(1, 90, H, K, V, seed=6, states=True, N=3)
    o, S, a = chunk_precond_kda(**d, cu_seqlens=cu, output_final_state=True)
    n = naive_recurrent_precond_kda(**d, cu_seqlens=cu, output_final_state=True,
                                    compute_dtype=torch.float64)
    assert rel(o, n[0]) < 1e-5 and rel(S, n[1]) < 1e-5 and rel(a, n[2]) < 1e-5
    # the empty sequence keeps its initial states
    assert torch.allclose(S[1], d["initial_state"][1]) and torch.allclose(a[1], d["initial_A_state"][1])


def test_no_final_state_is_allocated(monkeypatch):
    # fwd_h / fwd_atk with output_final_state=False allocate no state tensor
    lay = R.make_layout(1, 8, None, "cpu")
    W = torch.zeros(1, 8, 1, 64)
    h, Delta, S = F_.fwd_h(W, torch.zeros(1, 8, 1, 64), W, W, lay, store_h=False)
    assert h is None and S is None
    _, _, a, af = F_.fwd_atk(W, W, torch.zeros(1, 8, 1), torch.zeros(1, 8, 1), torch.zeros(1), lay)
    assert a is None and af is None


# ---------------------------------------------------------------- grids
def test_grids_keep_y_z_small_for_many_sequences_x_heads():
    N, H = 200_000, 96  # 19.2M sequence-heads: far past 65,535
    for grid in (F_.grid_atk(N, H, 128, 32), F_.grid_h(N, H, 128, 32),
                 F_.grid_intra(N * 2, H), F_.grid_o(N * 2, H, 128, 32), F_.grid_l2norm(N * H, 16)):
        assert len(grid) == 3 and grid[1] <= 65535 and grid[2] <= 65535
        assert grid[0] <= 2 ** 31 - 1
    assert F_.grid_intra(N * 2, H)[0] == N * 2 * H
    with pytest.raises(ValueError, match="exceeds CUDA limits"):
        F_.grid_o(2 ** 30, 4, 128, 64)


def test_stage_wu_from_kept_tinv(stages):
    """fwd_wu rebuilds fwd.intra's W and U from its Tinv (the backward's recompute when the
    forward kept Aqk and Tinv): K != V, a partial last chunk."""
    d, lay, kn = stages["d"], stages["lay"], stages["kn"]
    ra = stages["ref_atk"]
    _, Tinv, W, U, _ = stages["intra"]
    W2, U2 = F_.fwd_wu(kn, d["v"], ra["G"], d["beta"], Tinv, lay)
    assert W2.shape == W.shape and U2.shape == U.shape
    assert rel(W2, W) < 1e-6 and rel(U2, U) < 1e-6
    r = stages["ref_intra"]
    assert rel(W2, r["W"]) < 1e-5 and rel(U2, r["U"]) < 1e-5


def test_stage_wu_varlen_and_grid():
    """Varlen with an empty and a partial sequence; the grid is 1-D whatever N x H."""
    B, T, H, K, V = 1, 150, 2, 128, 64
    cu = torch.tensor([0, 37, 37, 150])
    d = make(B, T, H, K, V, seed=11)
    lay = R.make_layout(B, T, cu, "cpu")
    qn, kn = R.l2norm_ref(d["q"]), R.l2norm_ref(d["k"])
    ra = R.ref_fwd_atk(kn, d["g"], d["g_atk"], d["beta_atk"], d["log_atk_scale"], lay)
    Aqk, Tinv, W, U, _ = F_.fwd_intra(qn, kn, d["v"], ra["p"], ra["G"], d["beta"], 0.1, lay)
    W2, U2 = F_.fwd_wu(kn, d["v"], ra["G"], d["beta"], Tinv, lay)
    assert rel(W2, W) < 1e-6 and rel(U2, U) < 1e-6
    assert F_.grid_wu(10 ** 6, 64, 128, 256, 64) == (10 ** 6 * 64 * 6, 1, 1)
    # the gated operands' programs: one more group of K tiles
    assert F_.grid_wu(10 ** 6, 64, 128, 256, 64, gated=True) == (10 ** 6 * 64 * 8, 1, 1)
    with pytest.raises(ValueError, match="exceeds CUDA limits"):
        F_.grid_wu(2 ** 28, 4, 128, 128, 64)


@pytest.mark.parametrize("cu", [None, [0, 37, 37, 150]], ids=["dense_T100", "varlen"])
def test_stage_intra_writes_every_element(monkeypatch, cu):
    """Aqk and Tinv come from torch.empty when every token is in a sequence: the kernels must
    write each element, zeros right of the diagonal blocks included. Fresh buffers read NaN
    here, so any element left unwritten shows in the comparison with the reference."""
    B, T, H, K, V = (1, 100, 2, 64, 64) if cu is None else (1, 150, 2, 64, 64)
    cu_t = None if cu is None else torch.tensor(cu)
    d = make(B, T, H, K, V, seed=12)
    lay = R.make_layout(B, T, cu_t, "cpu")
    assert lay.covered
    qn, kn = R.l2norm_ref(d["q"]), R.l2norm_ref(d["k"])
    ra = R.ref_fwd_atk(kn, d["g"], d["g_atk"], d["beta_atk"], d["log_atk_scale"], lay)
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    Aqk, Tinv, W, U, _ = F_.fwd_intra(qn, kn, d["v"], ra["p"], ra["G"], d["beta"], 0.125, lay)
    monkeypatch.undo()
    ref = R.ref_fwd_intra(qn, kn, d["v"], ra["p"], ra["G"], d["beta"], 0.125, lay)
    for t, name in ((Aqk, "Aqk"), (Tinv, "Tinv"), (W, "W"), (U, "U")):
        assert torch.isfinite(t).all(), name
        assert rel(t, ref[name]) < 1e-5, name


def test_stage_intra_strong_gates_exact_path():
    """Gates strong enough that the diagonal blocks' middle-reference bound is exceeded:
    the kernel falls back to the exact element-wise path; still matches the reference."""
    B, T, H, K, V = 1, 64, 1, 64, 64
    d = make(B, T, H, K, V, seed=8)
    d["g"] = d["g"] * 20  # per-token log decays down to about -100
    lay = R.make_layout(B, T, None, "cpu")
    qn, kn = R.l2norm_ref(d["q"]), R.l2norm_ref(d["k"])
    ra = R.ref_fwd_atk(kn, d["g"], d["g_atk"], d["beta_atk"], d["log_atk_scale"], lay)
    assert ra["G"].min() < -200
    got = F_.fwd_intra(qn, kn, d["v"], ra["p"], ra["G"], d["beta"], 0.125, lay, store_akk=True)
    ref = R.ref_fwd_intra(qn, kn, d["v"], ra["p"], ra["G"], d["beta"], 0.125, lay)
    for t, name in zip(got, ("Aqk", "Tinv", "W", "U", "Akk")):
        assert torch.isfinite(t).all(), name
        assert rel(t, ref[name]) < 1e-5, name


# ---------------------------------------------------------------- fwd.h with fwd.o (the forward's walk)
def _h_o_case(varlen, with_h0):
    """The fused walk's inputs from the Triton stages before it (fwd_atk, then fwd_intra writing
    kg and qg as the forward does), K != V. Dense: two sequences of 100 tokens (a partial last
    chunk). Varlen: 37, 0 and 91 tokens of T=170, so rows 128.. are in no sequence: W, U, kg and
    qg hold NaN there (as an unwritten buffer may), Aqk zeros (the op's allocation for an
    uncovered tail); a load past the last sequence's end (its partial second chunk) reads NaN
    there. Mild gates (about -5 a chunk): the state carried into a chunk, and the initial state,
    weigh on o."""
    B, T, H, K, V = (1, 170, 2, 128, 64) if varlen else (2, 100, 2, 64, 128)
    cu = torch.tensor([0, 37, 37, 128]) if varlen else None
    d = make(B, T, H, K, V, seed=21, states=True, N=3 if varlen else None)
    d["g"] = d["g"] * 0.1
    lay = R.make_layout(B, T, cu, "cpu")
    qn, kn = R.l2norm_ref(d["q"]), R.l2norm_ref(d["k"])
    scale = K ** -0.5
    p, G, _, _ = F_.fwd_atk(kn, d["g"], d["g_atk"], d["beta_atk"], d["log_atk_scale"], lay)
    kg, qg = torch.empty_like(kn), torch.empty_like(qn)
    Aqk, _, W, U, _ = F_.fwd_intra(qn, kn, d["v"], p, G, d["beta"], scale, lay, kg_out=kg, qg_out=qg)
    if varlen:
        assert not lay.covered and (Aqk[:, 128:] == 0).all()
        for t in (W, U, kg, qg):
            t[:, 128:] = float("nan")
    h0 = d["initial_state"] if with_h0 else None
    return dict(lay=lay, qn=qn, p=p, G=G, kg=kg, qg=qg, Aqk=Aqk, W=W, U=U, h0=h0, scale=scale)


def _guarded_alloc(mp, shape):
    """torch.empty / torch.zeros give a tensor of `shape` as the front half of a buffer whose back
    half (the guard) holds NaN, and torch.empty's front half NaN too; returns the guards. A store
    past the tensor's end lands in its guard; an element never written stays NaN."""
    guards = []
    for name in ("empty", "zeros"):
        real = getattr(torch, name)

        def alloc(*size, real=real, name=name, **kw):
            dims = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else size
            if tuple(dims) != tuple(shape):
                return real(*size, **kw)
            n = math.prod(dims)
            buf = real(2 * n, **kw).fill_(float("nan"))
            if name == "zeros":
                buf[:n] = 0
            guards.append(buf[n:])
            return buf[:n].view(dims)
        mp.setattr(torch, name, alloc)
    return guards


@pytest.mark.parametrize("with_h0", [False, True], ids=["no_h0", "h0"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense_K64_V128", "varlen_K128_V64_empty"])
def test_stage_h_o_is_fwd_h_then_fwd_o(varlen, with_h0, monkeypatch):
    """fwd_h_o (o inside the state walk, the forward's path at K <= 128) gives the o of fwd_h
    then fwd_o on the same inputs, and fwd_h's final state; and both match the reference stages.
    The o of every chunk depends on the state entering it, on Aqk Delta, and on the masked loads
    and stores at the sequences' ends: o's buffer is followed by a NaN guard that a store past
    its end would overwrite (the dense case's last partial chunk), and in the dense case (every
    token in a sequence, o from torch.empty) every element must be written."""
    c = _h_o_case(varlen, with_h0)
    lay = c["lay"]
    shape = c["U"].shape
    with monkeypatch.context() as mp:
        guards = _guarded_alloc(mp, shape)
        o, S_fin = F_.fwd_h_o(c["W"], c["U"], c["G"], c["kg"], c["qg"], c["Aqk"], lay, c["h0"],
                              output_final_state=True)
    assert len(guards) == 1 and torch.isnan(guards[0]).all()  # o alone has that shape
    h, Delta, S_ref = F_.fwd_h(c["W"], c["U"], c["p"], c["G"], lay, c["h0"], output_final_state=True,
                               kg=c["kg"])
    o_ref = F_.fwd_o(c["qn"], c["G"], h, c["Aqk"], Delta, c["scale"], lay)
    assert o.shape == o_ref.shape and o.dtype == o_ref.dtype and S_fin.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(S_fin).all()
    assert rel(o, o_ref) < 1e-6 and rel(S_fin, S_ref) < 1e-6
    # the reference stages (fp32 PyTorch) on the same W, U, p, G, Aqk
    rh = R.ref_fwd_h(c["W"], c["U"], c["p"], c["G"], lay, c["h0"])
    ro = R.ref_fwd_o(c["qn"], c["G"], rh["h"], c["Aqk"], rh["Delta"], c["scale"], lay)
    n = 128 if varlen else o.shape[1]
    assert rel(o[:, :n], ro[:, :n]) < 1e-5 and rel(S_fin, rh["final"]) < 1e-5
    if varlen:
        assert (o[:, 128:] == 0).all()  # tokens in no sequence: zeros, as fwd_o leaves them
        want = c["h0"][1] if with_h0 else torch.zeros_like(S_fin[1])
        assert torch.equal(S_fin[1], want)  # the empty sequence keeps its initial state
    # without a final state none is allocated
    _, none = F_.fwd_h_o(c["W"], c["U"], c["G"], c["kg"], c["qg"], c["Aqk"], lay, c["h0"])
    assert none is None


def _h_o_launches(monkeypatch):
    """Record which of fwd_h, fwd_o, fwd_h_o pkda_fwd calls (each still runs)."""
    calls = []
    for name in ("fwd_h", "fwd_o", "fwd_h_o"):
        real = getattr(F_, name)
        monkeypatch.setattr(F_, name, lambda *a, real=real, name=name, **kw: (calls.append(name), real(*a, **kw))[1])
    return calls


@pytest.mark.parametrize("with_h0", [False, True], ids=["no_h0", "h0"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense_K64_V128", "varlen_K128_V64_empty"])
def test_forward_fuses_o_into_the_walk_and_matches_the_unfused_path(varlen, with_h0, monkeypatch):
    """pkda_fwd runs fwd_h_o at K <= 128 unless it keeps its intermediates (then fwd_h stores h
    and Delta and fwd_o reads them, as before): the two paths give the same o and final states,
    and both the naive recurrence's."""
    B, T, H, K, V = (1, 170, 2, 128, 64) if varlen else (2, 100, 2, 64, 128)
    cu = torch.tensor([0, 37, 37, 128], dtype=torch.int32) if varlen else None
    d = make(B, T, H, K, V, seed=22, states=True, N=3 if varlen else None)
    d["g"] = d["g"] * 0.1
    if not with_h0:
        d.pop("initial_state")
    args = {n: d.get(n) for n in ("q", "k", "v", "g", "g_atk", "beta_atk", "beta")}
    kw = dict(scale=K ** -0.5, log_atk_scale=d["log_atk_scale"], initial_state=d.get("initial_state"),
              initial_A_state=d["initial_A_state"], output_final_state=True, cu_seqlens=cu)
    calls = _h_o_launches(monkeypatch)
    fused = F_.pkda_fwd(**args, **kw)
    assert calls == ["fwd_h_o"]
    del calls[:]
    unfused = F_.pkda_fwd(**args, **kw, save_for_backward=True, keep_intermediates=True)
    assert calls == ["fwd_h", "fwd_o"]
    assert unfused[3]["h"] is not None and unfused[3]["Delta"] is not None
    for got, want in zip(fused[:3], unfused[:3]):
        assert rel(got, want) < 1e-6
    n = naive_recurrent_precond_kda(**d, cu_seqlens=cu, output_final_state=True,
                                    compute_dtype=torch.float64)
    for got, want in zip(fused[:3], n):
        assert rel(got, want) < 1e-5
    if varlen:
        assert (fused[0][:, 128:] == 0).all()


def test_forward_keeps_fwd_h_and_fwd_o_above_K_128(monkeypatch):
    """K > 128 (256) runs fwd_h and fwd_o: fwd_h_o refuses it."""
    d = make(1, 64, 1, 256, 64, seed=23)
    calls = _h_o_launches(monkeypatch)
    F_.pkda_fwd(**{n: d[n] for n in ("q", "k", "v", "g", "g_atk", "beta_atk", "beta")}, scale=0.0625,
                log_atk_scale=d["log_atk_scale"])
    assert calls == ["fwd_h", "fwd_o"]
    W = torch.zeros(1, 64, 1, 256)
    with pytest.raises(ValueError, match="K=256 > 128"):
        F_.fwd_h_o(W, torch.zeros(1, 64, 1, 64), W, W, W, torch.zeros(1, 64, 1, 64),
                   R.make_layout(1, 64, None, "cpu"))


@pytest.mark.parametrize("i", range(len(F_.HO_SPACE)))
def test_stage_h_o_in_every_config_of_its_space(i, monkeypatch):
    """The interpreter runs only a space's first config: each of fwd_h_o's configs (its V tile)
    is made the only one in turn, on the varlen case (an empty sequence, an uncovered tail)."""
    import triton

    meta, warps, n_stages = F_.HO_SPACE[i]
    monkeypatch.setattr(F_.pkda_fwd_h_o_kernel, "configs",
                        [triton.Config(dict(meta), num_warps=warps, num_stages=n_stages)])
    c = _h_o_case(True, True)
    lay = c["lay"]
    o, S_fin = F_.fwd_h_o(c["W"], c["U"], c["G"], c["kg"], c["qg"], c["Aqk"], lay, c["h0"],
                          output_final_state=True)
    h, Delta, S_ref = F_.fwd_h(c["W"], c["U"], c["p"], c["G"], lay, c["h0"], output_final_state=True,
                               kg=c["kg"])
    o_ref = F_.fwd_o(c["qn"], c["G"], h, c["Aqk"], Delta, c["scale"], lay)
    assert torch.isfinite(o).all() and rel(o, o_ref) < 1e-6 and rel(S_fin, S_ref) < 1e-6
