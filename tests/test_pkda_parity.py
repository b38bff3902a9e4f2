"""PKDA public-contract parity (issue #11 item 1) under the interpreter, fp32 vs the naive
recurrence in fp64 (outputs, finals and every gradient through fp64 autograd of naive):
head dims that are not 64/128, transposed state layout, extreme gates, the in-kernel gate
(A_log, dt_bias, lower_bound, safe_gate), disable_recompute, gradients from the finals."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch.nn.functional as F

from kernels.pkda import chunk_precond_kda, naive_recurrent_precond_kda


def make(B, T, H, K, V, seed=0, states=True, N=None):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    N = B if N is None else N
    d = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, V), g=F.logsigmoid(r(B, T, H, K)),
             g_atk=F.logsigmoid(r(B, T, H)), beta_atk=torch.sigmoid(r(B, T, H)),
             beta=torch.sigmoid(r(B, T, H)), log_atk_scale=r(H))
    if states:
        d.update(initial_state=r(N, H, K, V), initial_A_state=torch.rand(N, H, K, generator=gen))
    return d


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def run_both(d, kw=None, weights=(1, 1, 1), seed=7, tol=1e-4, naive_kw=None):
    """Forward + backward of op (fp32) and naive (fp64) on the same leaves; loss =
    sum_i w_i * <out_i, R_i> with random R_i. Asserts outputs and every leaf gradient agree
    to `tol` relative (norm-wise). Returns (op leaves, op outputs)."""
    kw = dict(kw or {})
    gen = torch.Generator().manual_seed(seed)
    leaves = {n: t.clone().requires_grad_(True) for n, t in d.items()}
    outs = chunk_precond_kda(**leaves, output_final_state=True, **kw)
    R = [torch.randn(t.shape, generator=gen) for t in outs]
    sum(w * (o * r).sum() for w, o, r in zip(weights, outs, R) if w).backward()
    ref = {n: t.double().requires_grad_(True) for n, t in d.items()}
    nkw = {k: v for k, v in kw.items() if k not in ("safe_gate", "disable_recompute")}
    nkw.update(naive_kw or {})
    routs = naive_recurrent_precond_kda(**ref, output_final_state=True,
                                        compute_dtype=torch.float64, **nkw)
    sum(w * (o * r.double()).sum() for w, o, r in zip(weights, routs, R) if w).backward()
    for name, got, want in zip(("o", "final_state", "final_A_state"), outs, routs):
        assert got.shape == want.shape, name
        assert rel(got, want) < tol, (name, rel(got, want))
    for n in leaves:
        g, w = leaves[n].grad, ref[n].grad
        if w is None:  # not connected to the loss in naive (q when only the finals count)
            w = torch.zeros_like(d[n], dtype=torch.float64)
        assert g is not None and g.shape == d[n].shape and g.dtype == d[n].dtype, n
        assert torch.isfinite(g).all(), n
        # + 1e-7 absolute: log_atk_scale's gradient is a sum with heavy cancellation (it can
        # be ~2e-4 while fp32 naive itself is off by ~2e-4 relative); still far below any
        # sign or missing-term error.
        err = (g.double() - w).norm().item()
        assert err <= tol * w.norm().item() + 1e-7, (n, err, w.norm().item())
    return leaves, outs


# ------------------------------------------------------------------ 1. head dims
@pytest.mark.parametrize("B,T,H,K,V", [(1, 63, 2, 60, 60), (1, 40, 1, 100, 100),
                                       (2, 20, 1, 64, 100), (1, 30, 1, 100, 48)],
                         ids=["K60V60T63", "K100V100", "K64V100", "K100V48"])
def test_head_dims_padded_exact(B, T, H, K, V):
    run_both(make(B, T, H, K, V, seed=K + V))


def test_head_dims_varlen():
    d = make(1, 50, 1, 60, 36, seed=5, N=3)
    run_both(d, dict(cu_seqlens=torch.tensor([0, 7, 31, 50], dtype=torch.int32)))


@pytest.mark.parametrize("B,T,H,K,V", [(1, 20, 1, 256, 256), (1, 24, 1, 200, 160), (1, 18, 1, 129, 64)],
                         ids=["K256V256", "K200V160", "K129V64"])
def test_head_dims_up_to_256(B, T, H, K, V):
    # the kernels' third size: 256 itself, and dims in (128, 256) zero-padded to it
    run_both(make(B, T, H, K, V, seed=K + V))


def test_head_dims_above_256_refused():
    d = make(1, 4, 1, 64, 64, states=False)
    with pytest.raises(ValueError, match=r"K=300 is not supported .*\[1, 256\]"):
        chunk_precond_kda(**dict(d, q=torch.zeros(1, 4, 1, 300), k=torch.zeros(1, 4, 1, 300),
                                 g=torch.zeros(1, 4, 1, 300)))
    with pytest.raises(ValueError, match=r"V=257 is not supported"):
        chunk_precond_kda(**dict(d, v=torch.zeros(1, 4, 1, 257)))


# ------------------------------------------------------------------ 2. transposed states
def test_transpose_state_layout():
    K, V = 64, 48
    d = make(1, 40, 1, K, V, seed=11, N=2)
    d["initial_state"] = d["initial_state"].transpose(-1, -2).contiguous()  # [N,H,V,K]
    kw = dict(transpose_state_layout=True, cu_seqlens=torch.tensor([0, 17, 40]))
    _, (o, S, a) = run_both(d, kw)
    assert S.shape == (2, 1, V, K)
    # the same call without the flag, with the state given/returned as [K,V]
    d2 = dict(d, initial_state=d["initial_state"].transpose(-1, -2).contiguous())
    o2, S2, _ = chunk_precond_kda(**d2, output_final_state=True, cu_seqlens=kw["cu_seqlens"])
    assert torch.equal(o, o2) and torch.equal(S, S2.transpose(-1, -2))
    with pytest.raises(ValueError, match=r"initial_state must have shape \[N,H,V,K\]"):
        chunk_precond_kda(**d2, transpose_state_layout=True, cu_seqlens=kw["cu_seqlens"])


# ------------------------------------------------------------------ 3. extreme gates
def test_extreme_gates():
    """-1000 in masked channels of g (as the public tests do), in every channel of a run of
    tokens (state reset mid-chunk), and in g_atk; gradients must stay finite and exact."""
    d = make(1, 80, 1, 64, 64, seed=2)
    d["g"][..., 10:20] = -1000.
    d["g"][:, 30:40] = -1000.
    d["g_atk"][:, 5:9] = -1000.
    d["g"][:, 70, :, 0] = float("-inf")
    run_both(d, tol=2e-5)


@pytest.mark.parametrize("disable_recompute", [False, True])
def test_gate_floor_is_the_clamp(disable_recompute):
    """The kernels apply the gate floor themselves (fwd.GATE_FLOOR): the op on raw gates must
    give exactly what it gives on gates clamped by torch.clamp beforehand, outputs and every
    gradient (the floor's gradient is 0 below -24, passed through at -24 itself). The dg
    cumsum learns where from the recompute's fwd.atk flags, or reads g (disable_recompute:
    no recompute); chunk 1 of head 1 has no low gate, its tile is not read."""
    from kernels.pkda.fwd import GATE_FLOOR
    d = make(1, 80, 2, 64, 64, seed=4)
    d["g"][0, 3:9, 0, :5] = -1000.
    d["g"][0, 40, 1, :] = float("-inf")
    d["g"][0, 41, 1, 7] = -GATE_FLOOR
    d["g"][0, 63, 1, 2] = -25.
    d["g"][0, 70, 0, 60:] = -50.
    d["g_atk"][0, 12:15, 1] = -30.
    d["g_atk"][0, 50, 0] = -GATE_FLOOR
    gen = torch.Generator().manual_seed(5)
    results = []
    for clamp_first in (False, True):
        leaves = {n: t.clone().requires_grad_(True) for n, t in d.items()}
        args = dict(leaves)
        if clamp_first:
            args["g"] = leaves["g"].clamp(min=-GATE_FLOOR)
            args["g_atk"] = leaves["g_atk"].clamp(min=-GATE_FLOOR)
        outs = chunk_precond_kda(**args, output_final_state=True,
                                 disable_recompute=disable_recompute)
        if not results:
            R = [torch.randn(t.shape, generator=gen) for t in outs]
        sum((o * r).sum() for o, r in zip(outs, R)).backward()
        results.append((outs, {n: t.grad for n, t in leaves.items()}))
    (outs, grads), (c_outs, c_grads) = results
    for o, c in zip(outs, c_outs):
        assert torch.equal(o, c)
    for n in grads:
        assert torch.equal(grads[n], c_grads[n]), n
    below = d["g"] < -GATE_FLOOR
    assert (grads["g"][below] == 0).all() and (grads["g"][~below] != 0).all()
    assert (grads["g_atk"][d["g_atk"] < -GATE_FLOOR] == 0).all()
    assert grads["g_atk"][0, 50, 0] != 0 and grads["g"][0, 41, 1, 7] != 0


def test_extreme_gates_padded_dims():
    d = make(1, 40, 1, 60, 60, seed=3)
    d["g"][..., :6] = -1000.
    d["g_atk"][:, 20] = -1000.
    run_both(d, tol=2e-5)


# ------------------------------------------------------------------ 4. in-kernel gate
@pytest.mark.parametrize("lower_bound,safe_gate,dt_shape", [(None, False, "HK"), (-5.0, True, "H,K"),
                                                            (-3.0, False, None)],
                         ids=["softplus", "lower_bound_safe", "lower_bound_no_bias"])
def test_gate_in_kernel(lower_bound, safe_gate, dt_shape):
    B, T, H, K, V = 1, 40, 2, 60, 64
    d = make(B, T, H, K, V, seed=13)
    gen = torch.Generator().manual_seed(17)
    d["g"] = torch.randn(B, T, H, K, generator=gen) * 2  # raw gate input, both signs
    d["A_log"] = torch.randn(H, generator=gen) * 0.5
    if dt_shape == "HK":
        d["dt_bias"] = torch.randn(H * K, generator=gen)
    elif dt_shape == "H,K":
        d["dt_bias"] = torch.randn(H, K, generator=gen)
    kw = dict(use_gate_in_kernel=True, lower_bound=lower_bound, safe_gate=safe_gate)
    leaves, _ = run_both(d, kw)
    assert leaves["A_log"].grad.abs().sum() > 0


def test_gate_in_kernel_errors():
    d = make(1, 8, 2, 64, 64, states=False)
    with pytest.raises(ValueError, match=r"needs A_log"):
        chunk_precond_kda(**d, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match=r"dt_bias must be a float tensor of H\*K=128"):
        chunk_precond_kda(**d, use_gate_in_kernel=True, A_log=torch.zeros(2), dt_bias=torch.zeros(3))
    with pytest.raises(ValueError, match=r"lower_bound must be given"):
        chunk_precond_kda(**d, use_gate_in_kernel=True, A_log=torch.zeros(2), safe_gate=True)
    with pytest.raises(ValueError, match=r"safe range \[-5, 0\)"):
        chunk_precond_kda(**d, use_gate_in_kernel=True, A_log=torch.zeros(2), safe_gate=True,
                          lower_bound=-6.0)
    with pytest.raises(NotImplementedError, match="cp_context"):
        chunk_precond_kda(**d, cp_context=object())


def test_safe_gate_pre_gated_is_a_hint():
    """safe_gate with a pre-computed gate in [lower_bound, 0): same result as without."""
    d = make(1, 30, 1, 64, 64, seed=21, states=False)
    d["g"] = -5 * torch.sigmoid(torch.randn(d["g"].shape, generator=torch.Generator().manual_seed(1)))
    o1, _, _ = chunk_precond_kda(**d)
    o2, _, _ = chunk_precond_kda(**d, safe_gate=True, lower_bound=-5.0)
    assert torch.equal(o1, o2)


# ------------------------------------------------------------------ 5. disable_recompute
def test_disable_recompute_same_gradients():
    d = make(1, 70, 1, 64, 64, seed=23, N=2)
    cu = torch.tensor([0, 30, 70])
    res = []
    for flag in (False, True):
        leaves = {n: t.clone().requires_grad_(True) for n, t in d.items()}
        outs = chunk_precond_kda(**leaves, output_final_state=True, cu_seqlens=cu,
                                 disable_recompute=flag)
        gen = torch.Generator().manual_seed(5)
        sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs).backward()
        res.append((outs, {n: t.grad for n, t in leaves.items()}))
    for a, b in zip(res[0][0], res[1][0]):
        assert torch.equal(a, b)
    # by default the backward rebuilds W and U from the kept Tinv with fwd_wu (one 64-wide dot
    # where fwd.intra sums 16-wide blocks): equal up to fp32 summation order
    for n in d:
        torch.testing.assert_close(res[0][1][n], res[1][1][n], rtol=1e-5, atol=1e-6, msg=n)
    run_both(d, dict(cu_seqlens=cu, disable_recompute=True))


def test_backward_reuses_the_forwards_solve(monkeypatch):
    """Without disable_recompute the forward keeps Aqk and Tinv and the backward never runs
    fwd.intra again (its W and U come from fwd_wu); with it, neither runs."""
    from kernels.pkda import fwd as F_
    d = make(1, 70, 1, 64, 64, seed=24, N=2)
    calls = []
    for name in ("fwd_intra", "fwd_wu"):
        real = getattr(F_, name)
        monkeypatch.setattr(F_, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    for flag, want in ((False, ["fwd_wu"]), (True, [])):
        leaves = {n: t.clone().requires_grad_(True) for n, t in d.items()}
        o, _, _ = chunk_precond_kda(**leaves, cu_seqlens=torch.tensor([0, 30, 70]),
                                    disable_recompute=flag)
        assert calls.count("fwd_intra") == 1, calls
        calls.clear()
        o.sum().backward()  # what the backward launches of the two
        assert calls == want, (flag, calls)
        calls.clear()


# ------------------------------------------------------------------ 6. gradients from the finals
@pytest.mark.parametrize("weights", [(0, 1, 0), (0, 0, 1), (0, 1, 1)], ids=["dht", "dat", "both"])
def test_final_state_gradients(weights):
    """Loss on final_state / final_A_state only (do = None in the backward)."""
    d = make(1, 70, 1, 64, 64, seed=29)
    run_both(d, weights=weights)


def test_final_state_gradients_transposed_padded():
    d = make(1, 40, 1, 60, 40, seed=31)
    d["initial_state"] = d["initial_state"].transpose(-1, -2).contiguous()
    run_both(d, dict(transpose_state_layout=True), weights=(0, 1, 1))
