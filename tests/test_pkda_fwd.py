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
    assert "K=256" in m.shape_problem({"B": 8, "T": 2048, "H": 32, "D": 256})
    assert "V=32" in m.shape_problem({"B": 8, "T": 2048, "H": 32, "K": 64, "V": 32})
    with pytest.raises(ValueError, match="K=256"):
        m.make_inputs({"B": 1, "T": 4, "H": 1, "D": 256}, "fwd", torch.float32, "cpu", 0)
    assert "kernels" not in (ROOT / "experiments/inputs/pkda.py").read_text().split('"""')[-1]
