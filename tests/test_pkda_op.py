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
    ("x nan", lambda d: d.update(x=float("nan")), ValueError, r"x must be finite, got nan"),
    ("x inf", lambda d: d.update(x=float("inf")), ValueError, r"x must be finite, got inf"),
    ("eps -1", lambda d: d.update(eps=-1.0), ValueError, r"eps must be > 0 .*got -1.0"),
    ("eps 0", lambda d: d.update(eps=0), ValueError, r"eps must be > 0"),
    ("scale nan", lambda d: d.update(scale=float("nan")), ValueError, r"scale must be finite, got nan"),
    ("scale tensor", lambda d: d.update(scale=torch.tensor(0.1)), TypeError, r"scale must be a real number, got Tensor"),
    ("scale str", lambda d: d.update(scale="0.1"), TypeError, r"scale must be a real number, got str"),
    ("log_atk_scale inf", lambda d: d.update(log_atk_scale=float("-inf")), ValueError, r"log_atk_scale must be finite"),
    ("lower_bound nan", lambda d: d.update(lower_bound=float("nan")), ValueError, r"lower_bound must be finite"),
    ("unknown keyword", lambda d: d.update(use_beta_headwise=True), TypeError,
     r"unexpected keyword argument 'use_beta_headwise'"),
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
    ("meta", {}, torch.tensor([0, 8], device="meta"), ValueError,
     r"cu_seqlens is on meta but q is on cpu: it must be on q's device or the CPU"),
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


# The public op's parameters (fla-core 0.6.0 and fla at the seed baseline) in order; it reads
# A_log and dt_bias from **kwargs, and the public tests pass use_qk_l2norm_in_kernel there.
PUBLIC_PARAMS = ["q", "k", "v", "g", "g_atk", "beta_atk", "beta", "scale", "initial_state",
                 "initial_A_state", "output_final_state", "use_gate_in_kernel", "safe_gate",
                 "lower_bound", "cu_seqlens", "cu_seqlens_cpu", "chunk_indices", "cp_context",
                 "transpose_state_layout", "x", "eps", "log_atk_scale", "solve_tril_precision",
                 "disable_recompute", "return_intermediate_states"]


def test_signature_is_the_public_one():
    import inspect
    params = inspect.signature(chunk_precond_kda).parameters
    assert [n for n, p in params.items() if p.kind == p.POSITIONAL_OR_KEYWORD] == PUBLIC_PARAMS
    assert [n for n, p in params.items() if p.kind == p.KEYWORD_ONLY] == \
        ["A_log", "dt_bias", "use_qk_l2norm_in_kernel"]
    assert not any(p.kind == p.VAR_KEYWORD for p in params.values())


def test_qk_l2norm_keyword_always_normalises():
    # as the public op: accepted, and q, k are L2-normalised whatever it says
    d = make(B=1, T=9, H=2, seed=6)
    o_true, _, _ = chunk_precond_kda(**d, use_qk_l2norm_in_kernel=True)
    o_false, _, _ = chunk_precond_kda(**d, use_qk_l2norm_in_kernel=False)
    assert torch.equal(o_true, o_false)
    n, _, _ = naive_recurrent_precond_kda(**d, compute_dtype=torch.float64)
    assert ((o_false.double() - n).norm() / n.norm()).item() < 1e-5


@pytest.mark.parametrize("K,V,transpose,cu", [(40, 24, True, None), (64, 64, False, [0, 66, 66, 80])])
def test_return_intermediate_states(K, V, transpose, cu):
    # h[:, i] is the state entering chunk i (64 tokens each), as the naive recurrence computes
    # it over the tokens before that chunk; in k's dtype, [B,NT,H,K,V] or [B,NT,H,V,K]
    B = 2 if cu is None else 1
    T = 70 if cu is None else 80
    d = make(B=B, T=T, H=2, K=K, V=V, seed=8)
    gen = torch.Generator().manual_seed(10)
    N = B if cu is None else len(cu) - 1
    S0 = torch.randn(N, 2, K, V, generator=gen)
    cu_t = None if cu is None else torch.tensor(cu)
    with torch.inference_mode():
        o, S, a, h = chunk_precond_kda(**d, initial_state=S0.transpose(-1, -2) if transpose else S0,
                                       output_final_state=True, transpose_state_layout=transpose,
                                       cu_seqlens=cu_t, return_intermediate_states=True)
        o2, S2, a2 = chunk_precond_kda(**d, initial_state=S0.transpose(-1, -2) if transpose else S0,
                                       output_final_state=True, transpose_state_layout=transpose,
                                       cu_seqlens=cu_t)
    assert torch.equal(o, o2) and torch.equal(S, S2) and torch.equal(a, a2)
    bounds = [(b, 0, T) for b in range(B)] if cu is None else [(0, cu[n], cu[n + 1]) for n in range(N)]
    starts = [(b, n, bos + 64 * i) for n, (b, bos, eos) in enumerate(bounds) for i in range(-(-(eos - bos) // 64))]
    assert h.shape == ((B, len(starts) // B, 2, V, K) if transpose else (B, len(starts) // B, 2, K, V))
    assert h.dtype == d["k"].dtype
    for j, (b, n, start) in enumerate(starts):
        bos = bounds[n][1]
        part = {m: t[b:b + 1, bos:start] for m, t in d.items()}
        _, S_r, _ = naive_recurrent_precond_kda(**part, initial_state=S0[n:n + 1], output_final_state=True,
                                                compute_dtype=torch.float64)
        got = h[b, j % (len(starts) // B)] if cu is None else h[0, j]
        got = got.transpose(-1, -2) if transpose else got
        assert ((got.double() - S_r[0]).norm() / S_r[0].norm()).item() < 1e-5, (b, n, start)


def test_return_intermediate_states_needs_inference_mode():
    with pytest.raises(ValueError, match=r"return_intermediate_states=True is for inference: call it inside torch.inference_mode"):
        chunk_precond_kda(**make(), return_intermediate_states=True)
    with torch.inference_mode(), pytest.raises(ValueError, match=r"needs disable_recompute=False"):
        chunk_precond_kda(**make(), return_intermediate_states=True, disable_recompute=True)
