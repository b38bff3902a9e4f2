"""PKDA public op: input validation (every error and its message) and autograd wiring."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch.nn.functional as F

from kernels.pkda import chunk_precond_kda, naive_recurrent_precond_kda


def make(B=1, T=8, H=2, K=64, V=64, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    return dict(q=r(B, T, H, K).to(dtype), k=r(B, T, H, K).to(dtype), v=r(B, T, H, V).to(dtype),
                g=F.logsigmoid(r(B, T, H, K)), g_atk=F.logsigmoid(r(B, T, H)),
                beta_atk=torch.sigmoid(r(B, T, H)), beta=torch.sigmoid(r(B, T, H)))


CASES = [
    ("k shape", lambda d: d.update(k=d["k"][:, :4]), ValueError, r"k must have shape \[B,T,H,K\]"),
    ("v shape", lambda d: d.update(v=d["v"][:, :, :1]), ValueError, r"v must have shape"),
    ("g shape", lambda d: d.update(g=d["g"][..., :32]), ValueError, r"g must have shape"),
    ("g_atk shape", lambda d: d.update(g_atk=d["g_atk"][:, :3]), ValueError, r"g_atk must have shape"),
    ("beta_atk shape", lambda d: d.update(beta_atk=d["beta_atk"][None]), ValueError, r"beta_atk must have shape"),
    ("beta shape", lambda d: d.update(beta=d["beta"][..., None]), ValueError, r"beta must have shape"),
    ("q 3-D", lambda d: d.update(q=d["q"][0]), ValueError, r"q must be 4-D"),
    ("k dtype", lambda d: d.update(k=d["k"].half()), TypeError, r"k dtype torch.float16 disagrees with q"),
    ("v dtype", lambda d: d.update(v=d["v"].double()), TypeError, r"v dtype torch.float64 disagrees"),
    ("q fp64", lambda d: d.update(q=d["q"].double(), k=d["k"].double(), v=d["v"].double()),
     TypeError, r"q must be bf16, fp16 or fp32"),
    ("int g", lambda d: d.update(g=d["g"].int()), TypeError, r"g must be a floating-point tensor"),
    ("K=257", lambda d: d.update(q=torch.zeros(1, 8, 2, 257), k=torch.zeros(1, 8, 2, 257),
                                 g=torch.zeros(1, 8, 2, 257)), ValueError, r"K=257 is not supported"),
    ("K=512", lambda d: d.update(q=torch.zeros(1, 8, 2, 512), k=torch.zeros(1, 8, 2, 512),
                                 g=torch.zeros(1, 8, 2, 512)), ValueError, r"K=512 is not supported"),
    ("V=257", lambda d: d.update(v=torch.zeros(1, 8, 2, 257)), ValueError, r"V=257 is not supported"),
    ("log_atk_scale", lambda d: d.update(log_atk_scale=torch.zeros(3)), ValueError,
     r"log_atk_scale must have H=2 entries"),
    ("x", lambda d: d.update(x=0.0), ValueError, r"x must be > 0"),
]


@pytest.mark.parametrize("name,mutate,exc,match", CASES, ids=[c[0] for c in CASES])
def test_validation_errors(name, mutate, exc, match):
    d = make()
    mutate(d)
    with pytest.raises(exc, match=match):
        chunk_precond_kda(**d)


CU_CASES = [
    ("B != 1", dict(B=2), torch.tensor([0, 8]), ValueError, r"cu_seqlens requires B == 1"),
    ("float", {}, torch.tensor([0.0, 8.0]), ValueError, r"cu_seqlens must be a 1-D integer tensor"),
    ("2-D", {}, torch.tensor([[0, 8]]), ValueError, r"cu_seqlens must be a 1-D integer tensor"),
    ("not 0", {}, torch.tensor([1, 8]), ValueError, r"cu_seqlens must start at 0"),
    ("decreasing", {}, torch.tensor([0, 5, 3, 8]), ValueError, r"cu_seqlens must be non-decreasing"),
    ("past T", {}, torch.tensor([0, 4, 9]), ValueError, r"cu_seqlens ends at 9, past T=8"),
    ("too short", {}, torch.tensor([0]), ValueError, r"at least 2 entries"),
    ("list", {}, [0, 8], TypeError, r"cu_seqlens must be a 1-D integer torch.Tensor"),
]


@pytest.mark.parametrize("name,shape,cu,exc,match", CU_CASES, ids=[c[0] for c in CU_CASES])
def test_cu_seqlens_errors(name, shape, cu, exc, match):
    with pytest.raises(exc, match=match):
        chunk_precond_kda(**make(**shape), cu_seqlens=cu)


def test_initial_state_errors():
    d = make(B=2)
    H, K, V = 2, 64, 64
    with pytest.raises(ValueError, match=r"initial_state holds 1 states but there are 2 sequences \(B\)"):
        chunk_precond_kda(**d, initial_state=torch.zeros(1, H, K, V))
    with pytest.raises(TypeError, match=r"initial_state must be fp32, got torch.bfloat16"):
        chunk_precond_kda(**d, initial_state=torch.zeros(2, H, K, V, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"initial_state must have shape \[N,H,K,V\]"):
        chunk_precond_kda(**d, initial_state=torch.zeros(2, H, K, 32))
    with pytest.raises(ValueError, match=r"initial_A_state holds 3 states but there are 2"):
        chunk_precond_kda(**d, initial_A_state=torch.zeros(3, H, K))
    with pytest.raises(TypeError, match=r"initial_A_state must be fp32, got torch.float16"):
        chunk_precond_kda(**d, initial_A_state=torch.zeros(2, H, K, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"initial_A_state must have shape \[N,H,K\]"):
        chunk_precond_kda(**d, initial_A_state=torch.zeros(2, H))
    dv = make()
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"there are 2 sequences \(len\(cu_seqlens\)-1\)"):
        chunk_precond_kda(**dv, cu_seqlens=cu, initial_state=torch.zeros(1, H, K, V))


def test_op_gradients_match_fp64_naive():
    """Every gradient (q, k, v, g, g_atk, beta_atk, beta, log_atk_scale, both initial states)
    through the autograd Function, vs fp64 autograd of the naive recurrence."""
    B, T, H, K, V = 1, 40, 1, 64, 64
    d = make(B, T, H, K, V, seed=3)
    gen = torch.Generator().manual_seed(9)
    d.update(log_atk_scale=torch.randn(H, generator=gen), initial_state=torch.randn(B, H, K, V, generator=gen),
             initial_A_state=torch.rand(B, H, K, generator=gen))
    leaves = {k: t.clone().requires_grad_(True) for k, t in d.items()}
    o, S, a = chunk_precond_kda(**leaves, output_final_state=True)
    assert o.dtype == torch.float32 and S.dtype == torch.float32 and a.shape == (B, H, K)
    w = [torch.randn(t.shape, generator=gen) for t in (o, S, a)]
    sum((x * y).sum() for x, y in zip((o, S, a), w)).backward()
    ref = {k: t.double().requires_grad_(True) for k, t in d.items()}
    on, Sn, an = naive_recurrent_precond_kda(**ref, output_final_state=True, compute_dtype=torch.float64)
    sum((x * y.double()).sum() for x, y in zip((on, Sn, an), w)).backward()
    for name in leaves:
        got, want = leaves[name].grad.double(), ref[name].grad
        assert leaves[name].grad.dtype == d[name].dtype, name
        assert ((got - want).norm() / want.norm()).item() < 1e-4, name


def test_op_defaults_and_no_final_state():
    d = make(B=1, T=5, H=1)
    o, S, a = chunk_precond_kda(**d)
    assert S is None and a is None and o.shape == (1, 5, 1, 64)
    n, _, _ = naive_recurrent_precond_kda(**d, compute_dtype=torch.float64)
    assert ((o.double() - n).norm() / n.norm()).item() < 1e-5


def test_op_fp16_empty_and_uncovered_tail():
    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()
    d = make(B=1, T=70, H=1, dtype=torch.float16, seed=4)
    o, S, a = chunk_precond_kda(**d, output_final_state=True)
    n = naive_recurrent_precond_kda(**d, output_final_state=True, compute_dtype=torch.float64)
    assert o.dtype == torch.float16 and rel(o, n[0]) < 3e-3 and rel(S, n[1]) < 3e-3 and rel(a, n[2]) < 3e-3
    # T = 0: outputs empty, finals = initial states
    d = make(B=2, T=0, H=1)
    S0 = torch.randn(2, 1, 64, 64)
    o, S, a = chunk_precond_kda(**d, output_final_state=True, initial_state=S0)
    assert o.shape == (2, 0, 1, 64) and torch.equal(S, S0) and (a == 0).all()
    # cu_seqlens ending before T: tokens past the last sequence are zeros
    d = make(B=1, T=10, H=1)
    cu = torch.tensor([0, 3, 6])
    o, S, _ = chunk_precond_kda(**d, output_final_state=True, cu_seqlens=cu)
    n = naive_recurrent_precond_kda(**d, output_final_state=True, cu_seqlens=cu, compute_dtype=torch.float64)
    assert rel(o, n[0]) < 1e-5 and (o[0, 6:] == 0).all() and rel(S, n[1]) < 1e-5
