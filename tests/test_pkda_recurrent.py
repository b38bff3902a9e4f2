"""Fused recurrent PKDA (decode / inference prefill): CPU interpreter, fp32, vs the naive oracle."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch.nn.functional as F

import kernels.pkda as pkda
from kernels.pkda import recurrent as R
from kernels.pkda.naive import naive_recurrent_precond_kda
from kernels.pkda.recurrent import fused_recurrent_precond_kda


def make(B, T, H, K, V, seed=0, states=False, N=None):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    d = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, V),
             g=F.logsigmoid(r(B, T, H, K)), g_atk=F.logsigmoid(r(B, T, H)),
             beta_atk=torch.sigmoid(r(B, T, H)), beta=torch.sigmoid(r(B, T, H)),
             log_atk_scale=r(H))
    if states:
        N = B if N is None else N
        d["initial_state"] = r(N, H, K, V)
        d["initial_A_state"] = torch.rand(N, H, K, generator=gen)
    return d


def ref(d, **kw):
    return naive_recurrent_precond_kda(**d, compute_dtype=torch.float64, **kw)


def close(a, b, tol=2e-5):
    a, b = a.double(), b.double()
    err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
    assert err < tol, err


class KernelSpy:
    """Wraps the Triton kernel to record each launch's grid and arguments."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append((grid, args, kw))
            return self.kernel[grid](*args, **kw)
        return launch


@pytest.fixture
def spy(monkeypatch):
    s = KernelSpy(R.pkda_fused_recurrent_kernel)
    monkeypatch.setattr(R, "pkda_fused_recurrent_kernel", s)
    return s


# ---------------------------------------------------------------- correctness
@pytest.mark.parametrize("K,V,states", [(64, 128, True), (128, 64, False)])
def test_dense_matches_naive(K, V, states):
    d = make(2, 6, 2, K, V, seed=K + V, states=states)
    o, S, a = fused_recurrent_precond_kda(**d, output_final_state=True)
    o_r, S_r, a_r = ref(d, output_final_state=True)
    assert o.dtype == torch.float32 and o.shape == d["v"].shape
    assert S.shape == (2, 2, K, V) and a.shape == (2, 2, K)
    assert S.dtype == a.dtype == torch.float32
    close(o, o_r), close(S, S_r), close(a, a_r)


def test_varlen_empty_sequences_and_tail():
    K, V, H = 64, 32, 2
    lens = [0, 4, 0, 5, 0]
    T = sum(lens) + 2                      # two tail tokens past cu_seqlens[-1]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    d = make(1, T, H, K, V, seed=7, states=True, N=len(lens))
    o, S, a = fused_recurrent_precond_kda(**d, cu_seqlens=cu, output_final_state=True)
    o_r, S_r, a_r = ref(d, cu_seqlens=cu, output_final_state=True)
    assert S.shape == (5, H, K, V) and a.shape == (5, H, K)
    close(o, o_r), close(S, S_r), close(a, a_r)
    assert torch.count_nonzero(o[:, -2:]) == 0          # tail belongs to no sequence
    for n in (0, 2, 4):                                  # empty: passes through bit for bit
        assert torch.equal(S[n], d["initial_state"][n])
        assert torch.equal(a[n], d["initial_A_state"][n])
    # a different initial state changes only its own sequence
    d2 = dict(d, initial_state=d["initial_state"].clone())
    d2["initial_state"][1] += 1
    o2, _, _ = fused_recurrent_precond_kda(**d2, cu_seqlens=cu)
    assert not torch.allclose(o2[:, 0:4], o[:, 0:4])
    assert torch.equal(o2[:, 4:], o[:, 4:])


def test_varlen_without_initial_states_and_odd_dims():
    # K, V not powers of two (masked), int64 offsets, no initial states, fused == naive
    K, V, H = 12, 20, 3
    cu = torch.tensor([0, 3, 3, 9], dtype=torch.int64)
    d = make(1, 9, H, K, V, seed=3)
    o, S, a = fused_recurrent_precond_kda(**d, cu_seqlens=cu, output_final_state=True,
                                          scale=0.3, x=2.0, eps=1e-4)
    o_r, S_r, a_r = ref(d, cu_seqlens=cu, output_final_state=True, scale=0.3, x=2.0, eps=1e-4)
    close(o, o_r), close(S, S_r), close(a, a_r)
    assert torch.count_nonzero(S[1]) == 0 and torch.count_nonzero(a[1]) == 0


def test_log_atk_scale_float_default_and_decode_step():
    # T=1 decode step from a carried state equals the same token processed at the end
    K, V, H = 64, 32, 1
    d = make(1, 5, H, K, V, seed=11, states=True)
    d["log_atk_scale"] = None
    _, S4, a4 = fused_recurrent_precond_kda(**{n: (t[:, :4] if t is not None and t.dim() >= 3
                                                   and n not in ("initial_state", "initial_A_state")
                                                   else t) for n, t in d.items()},
                                            output_final_state=True)
    step = {n: (t[:, 4:] if t is not None and t.dim() >= 3
                and n not in ("initial_state", "initial_A_state") else t) for n, t in d.items()}
    o1, _, _ = fused_recurrent_precond_kda(**dict(step, initial_state=S4, initial_A_state=a4))
    o_r, _, _ = ref(dict(d, log_atk_scale=-0.2))
    close(o1[:, 0], o_r[:, 4])


# ---------------------------------------------------------------- no final state unless asked
def test_no_final_state_allocated_or_stored(spy, monkeypatch):
    K, V, H, N = 64, 32, 2, 3
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    d = make(1, 5, H, K, V, seed=5, states=True, N=N)
    shapes = []
    for fn in ("empty", "zeros", "empty_like", "zeros_like", "full"):
        orig = getattr(torch, fn)

        def rec(*a, _orig=orig, **kw):
            out = _orig(*a, **kw)
            shapes.append(tuple(out.shape))
            return out
        monkeypatch.setattr(torch, fn, rec)
    o, S, a = fused_recurrent_precond_kda(**d, cu_seqlens=cu)
    assert S is None and a is None
    assert (N, H, K, V) not in shapes and (N, H, K) not in shapes, shapes
    (_, args, kw), = spy.calls
    assert kw["STORE_FINAL"] is False and args[13] is None and args[14] is None  # ht, at
    # the same call asking for the finals does allocate them
    shapes.clear()
    fused_recurrent_precond_kda(**d, cu_seqlens=cu, output_final_state=True)
    assert (N, H, K, V) in shapes and (N, H, K) in shapes
    assert spy.calls[-1][2]["STORE_FINAL"] is True
    o_r, _, _ = ref(d, cu_seqlens=cu)
    monkeypatch.undo()
    close(o, o_r)


# ---------------------------------------------------------------- cu_seqlens abuse
BAD_CU = [
    ("negative", [0, -2, 8], r"cu_seqlens must be non-decreasing", "negative entry"),
    ("decreasing", [0, 5, 3, 8], r"cu_seqlens must be non-decreasing", "decreasing"),
    ("nonzero start", [1, 4, 8], r"cu_seqlens must start at 0, got 1", "first entry is not 0"),
    ("past T", [0, 4, 9], r"cu_seqlens ends at 9, past T=8", "past T"),
]


@pytest.mark.parametrize("name,cu,host_msg,dev_msg", BAD_CU, ids=[b[0] for b in BAD_CU])
def test_cu_seqlens_abuse_host_check(name, cu, host_msg, dev_msg, spy):
    d = make(1, 8, 1, 16, 8)
    with pytest.raises(ValueError, match=host_msg):
        fused_recurrent_precond_kda(**d, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    assert spy.calls == []              # rejected before any launch


@pytest.mark.parametrize("name,cu,host_msg,dev_msg", BAD_CU, ids=[b[0] for b in BAD_CU])
def test_cu_seqlens_abuse_device_guard(name, cu, host_msg, dev_msg, spy, monkeypatch):
    # as for a device-resident cu_seqlens: no host read, the kernel's guard must catch it
    monkeypatch.setattr(R, "_host_readable", lambda t: False)
    d = make(1, 8, 1, 16, 8)
    with pytest.raises(ValueError, match=rf"cu_seqlens is invalid \(.*{dev_msg}"):
        fused_recurrent_precond_kda(**d, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    assert len(spy.calls) == 1
    assert int(R._err_flag(torch.device("cpu")).item()) == 0      # reported, then reset
    R.check_recurrent_indices("cpu")                            # nothing pending


def test_device_guard_skips_only_invalid_sequences():
    # the launcher alone, as under graph capture: no host check, no raise, flag recorded;
    # the valid sequence is exact, the out-of-capacity one is skipped with a zero state
    K, V, H = 16, 8, 2
    d = make(1, 8, H, K, V, seed=9, states=True, N=2)
    cu = torch.tensor([0, 4, 100], dtype=torch.int32)
    c = d["log_atk_scale"].float()
    o, S, a, err = R.fused_recurrent_fwd(d["q"], d["k"], d["v"], d["g"], d["g_atk"],
                                         d["beta_atk"], d["beta"], K ** -0.5, c,
                                         d["initial_state"], d["initial_A_state"], True, cu, 2,
                                         1.5, 1e-6)
    assert int(err.item()) == R.ERR_CU_PAST_T
    good = {n: (t[:, :4] if n not in ("initial_state", "initial_A_state", "log_atk_scale")
                else t[:1] if n != "log_atk_scale" else t) for n, t in d.items()}
    o_r, S_r, a_r = ref(good, output_final_state=True)
    close(o[:, :4], o_r), close(S[:1], S_r), close(a[:1], a_r)
    assert torch.count_nonzero(o[:, 4:]) == 0
    assert torch.count_nonzero(S[1]) == 0 and torch.count_nonzero(a[1]) == 0
    with pytest.raises(ValueError, match=r"cu_seqlens is invalid \(entry past T"):
        R.check_recurrent_indices("cpu")
    R.check_recurrent_indices("cpu")   # reset after reporting


@pytest.mark.parametrize("cu,exc,match", [
    ([0, 8], TypeError, r"cu_seqlens must be a 1-D integer torch.Tensor"),
    (torch.tensor([0.0, 8.0]), ValueError, r"cu_seqlens must be a 1-D integer tensor"),
    (torch.tensor([[0, 8]]), ValueError, r"cu_seqlens must be a 1-D integer tensor"),
    (torch.tensor([0]), ValueError, r"cu_seqlens must hold at least 2 entries"),
])
def test_cu_seqlens_metadata(cu, exc, match):
    with pytest.raises(exc, match=match):
        fused_recurrent_precond_kda(**make(1, 8, 1, 16, 8), cu_seqlens=cu)


def test_cu_seqlens_needs_b1_and_state_count():
    with pytest.raises(ValueError, match=r"cu_seqlens requires B == 1"):
        fused_recurrent_precond_kda(**make(2, 8, 1, 16, 8), cu_seqlens=torch.tensor([0, 8]))
    d = make(1, 8, 1, 16, 8, states=True, N=1)
    with pytest.raises(ValueError, match=r"there are 2 sequences \(len\(cu_seqlens\)-1\)"):
        fused_recurrent_precond_kda(**d, cu_seqlens=torch.tensor([0, 3, 8]))


# ---------------------------------------------------------------- inference only
@pytest.mark.parametrize("name", ["q", "v", "beta", "log_atk_scale", "initial_state"])
def test_rejects_grad_inputs(name, spy):
    d = make(1, 4, 1, 16, 8, states=True)
    d[name] = d[name].clone().requires_grad_(True)
    with pytest.raises((ValueError, RuntimeError), match=rf"{name} requires grad.*chunk_precond_kda"):
        fused_recurrent_precond_kda(**d)
    assert spy.calls == []
    with torch.no_grad():                 # inference with parameters: accepted
        o, _, _ = fused_recurrent_precond_kda(**d)
    assert not o.requires_grad


def test_other_validation():
    d = make(1, 4, 1, 16, 8)
    with pytest.raises(ValueError, match=r"K=512 is not supported"):
        fused_recurrent_precond_kda(**make(1, 2, 1, 512, 8))
    with pytest.raises(ValueError, match=r"x must be > 0"):
        fused_recurrent_precond_kda(**d, x=0.0)
    with pytest.raises(TypeError, match=r"k dtype torch.float64 disagrees"):
        fused_recurrent_precond_kda(**dict(d, k=d["k"].double()))


# ---------------------------------------------------------------- grid
def test_grid_keeps_y_z_at_one():
    for N, H, V in ((5000, 32, 128), (70000, 1, 64), (1, 1, 20)):
        grid = R.grid_recurrent(N, H, V, R.block_v(V))
        assert grid[1:] == (1, 1)
        assert grid[0] == N * H * -(-V // R.block_v(V))
    assert R.grid_recurrent(5000, 32, 128, 32) == (5000 * 32 * 4, 1, 1)
    with pytest.raises(ValueError, match=r"grid-X limit"):
        R.grid_recurrent(2 ** 26, 64, 128, 32)


def test_launch_uses_1d_grid(spy):
    d = make(1, 3, 2, 16, 40)
    fused_recurrent_precond_kda(**d, cu_seqlens=torch.tensor([0, 1, 1, 3]))
    (grid, _, _), = spy.calls
    assert grid == (3 * 2 * 2, 1, 1)      # N=3, H=2, V=40 -> 2 blocks of 32


def test_package_export():
    assert pkda.fused_recurrent_precond_kda is fused_recurrent_precond_kda
    assert "fused_recurrent_precond_kda" in pkda.__all__


# ---------------------------------------------------------------- the public contract
# The public op's parameters in order (fla-core 0.6.0 and fla at the seed baseline), and the
# two keywords it swallows through **kwargs that this op implements.
PUBLIC_PARAMS = ["q", "k", "v", "g", "g_atk", "beta_atk", "beta", "A_log", "dt_bias", "scale",
                 "initial_state", "initial_A_state", "output_final_state",
                 "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "lower_bound", "cu_seqlens",
                 "transpose_state_layout", "x", "eps", "log_atk_scale"]


def test_signature_is_the_public_one():
    import inspect
    params = inspect.signature(fused_recurrent_precond_kda).parameters
    positional = [n for n, p in params.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    keyword_only = [n for n, p in params.items() if p.kind == p.KEYWORD_ONLY]
    assert positional == PUBLIC_PARAMS
    assert keyword_only == ["ssm_state_indices", "num_accepted_tokens"]
    assert params["use_qk_l2norm_in_kernel"].default is True
    assert not any(p.kind == p.VAR_KEYWORD for p in params.values())


def test_unknown_keyword_is_refused(spy):
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'inplace_final_state'"):
        fused_recurrent_precond_kda(**make(1, 2, 1, 16, 8), inplace_final_state=True)
    assert spy.calls == []


def test_positional_call_in_public_order():
    d = make(1, 3, 2, 16, 8, seed=21, states=True)
    args = [d[n] for n in ("q", "k", "v", "g", "g_atk", "beta_atk", "beta")]
    o, S, a = fused_recurrent_precond_kda(*args, None, None, 0.5, d["initial_state"],
                                          d["initial_A_state"], True)
    o_r, S_r, a_r = ref(dict(d, log_atk_scale=None), scale=0.5, output_final_state=True)
    close(o, o_r), close(S, S_r), close(a, a_r)


def test_without_qk_l2norm(monkeypatch):
    # False: q and k are used as given; the oracle with its normalisation taken out agrees,
    # and on unnormalised inputs the result really differs from the normalising default
    d = make(2, 5, 2, 16, 8, seed=22, states=True)
    d["q"], d["k"] = d["q"] * 0.3, F.normalize(d["k"], dim=-1) * 0.7
    o, S, a = fused_recurrent_precond_kda(**d, use_qk_l2norm_in_kernel=False, output_final_state=True)
    o_n, _, _ = fused_recurrent_precond_kda(**d)
    import kernels.pkda.naive as naive
    monkeypatch.setattr(naive, "l2norm", lambda t: t)
    o_r, S_r, a_r = ref(d, output_final_state=True)
    close(o, o_r), close(S, S_r), close(a, a_r)
    assert (o - o_n).abs().max() > 0.1 * o_n.abs().max()


@pytest.mark.parametrize("lower_bound,bias", [(None, True), (None, False), (-5.0, True)])
def test_gate_in_kernel(lower_bound, bias):
    H, K = 2, 16
    d = make(1, 6, H, K, 8, seed=23, states=True)
    gen = torch.Generator().manual_seed(24)
    d["g"] = torch.randn(1, 6, H, K, generator=gen) * 15     # raw gate input, past softplus' 20
    gate = dict(A_log=torch.randn(H, generator=gen), lower_bound=lower_bound,
                dt_bias=torch.randn(H * K, generator=gen) if bias else None)
    o, S, a = fused_recurrent_precond_kda(**d, **gate, use_gate_in_kernel=True, output_final_state=True)
    o_r, S_r, a_r = ref(d, **gate, use_gate_in_kernel=True, output_final_state=True)
    close(o, o_r), close(S, S_r), close(a, a_r)
    with pytest.raises(ValueError, match=r"use_gate_in_kernel=True needs A_log, a float tensor of H=2"):
        fused_recurrent_precond_kda(**d, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match=r"dt_bias must be a float tensor of H\*K=32 entries"):
        fused_recurrent_precond_kda(**d, use_gate_in_kernel=True, A_log=gate["A_log"],
                                    dt_bias=torch.zeros(5))


def test_transpose_state_layout():
    K, V = 16, 40
    d = make(2, 5, 2, K, V, seed=25, states=True)
    d["initial_state"] = d["initial_state"].transpose(-1, -2).contiguous()   # [N,H,V,K]
    o, S, a = fused_recurrent_precond_kda(**d, transpose_state_layout=True, output_final_state=True)
    o_r, S_r, a_r = ref(d, transpose_state_layout=True, output_final_state=True)
    assert S.shape == (2, 2, V, K)
    close(o, o_r), close(S, S_r), close(a, a_r)
    with pytest.raises(ValueError, match=r"initial_state must have shape \[N,H,V,K\]"):
        fused_recurrent_precond_kda(**dict(d, initial_state=d["initial_state"].transpose(-1, -2)),
                                    transpose_state_layout=True)


def test_grouped_value_heads():
    # HV = 3 H: value head j reads q, k of head j // 3 (the oracle with q, k repeated agrees)
    B, T, H, HV, K, V = 1, 4, 2, 6, 16, 8
    d = make(B, T, HV, K, V, seed=26, states=True)
    gen = torch.Generator().manual_seed(27)
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    o, S, a = fused_recurrent_precond_kda(**dict(d, q=q, k=k), output_final_state=True)
    rep = dict(d, q=q.repeat_interleave(3, dim=2), k=k.repeat_interleave(3, dim=2))
    o_r, S_r, a_r = ref(rep, output_final_state=True)
    assert o.shape == (B, T, HV, V) and S.shape == (B, HV, K, V) and a.shape == (B, HV, K)
    close(o, o_r), close(S, S_r), close(a, a_r)
    with pytest.raises(ValueError, match=r"v has 3 heads, not a multiple of q's H=2"):
        fused_recurrent_precond_kda(**dict(make(1, 4, 2, K, V), v=torch.zeros(1, 4, 3, V)))
    with pytest.raises(ValueError, match=r"beta must have shape \[B,T,HV\] = \(1, 4, 6\)"):
        fused_recurrent_precond_kda(**dict(d, q=q, k=k, beta=d["beta"][:, :, :2]))


# ---------------------------------------------------------------- state pools
def pool_case(lens, P, seed, H=2, K=16, V=8):
    """Packed sequences of the given lengths, state pools of P slots (distinct values)."""
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    d = make(1, sum(lens), H, K, V, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    pools = dict(initial_state=torch.randn(P, H, K, V, generator=gen),
                 initial_A_state=torch.rand(P, H, K, generator=gen))
    return d, cu, pools


def seq_ref(d, cu, n, S0, a0, upto=None):
    """The oracle on sequence n (its first `upto` tokens) from the states S0, a0."""
    bos, eos = int(cu[n]), int(cu[n + 1]) if upto is None else int(cu[n]) + upto
    part = {m: (t[:, bos:eos] if m != "log_atk_scale" else t) for m, t in d.items()}
    return ref(dict(part, initial_state=S0[None], initial_A_state=a0[None]), output_final_state=True)


def test_pool_one_slot_per_sequence():
    d, cu, pools = pool_case([1, 3, 0, 1], P=6, seed=30)
    slots = torch.tensor([4, 0, 5, 2])
    before = {n: t.clone() for n, t in pools.items()}
    o, S, a = fused_recurrent_precond_kda(**d, **pools, cu_seqlens=cu, ssm_state_indices=slots)
    assert S is pools["initial_state"] and a is pools["initial_A_state"]     # in place
    for n, s in enumerate(slots.tolist()):
        o_r, S_r, a_r = seq_ref(d, cu, n, before["initial_state"][s], before["initial_A_state"][s])
        close(o[:, int(cu[n]):int(cu[n + 1])], o_r) if cu[n + 1] > cu[n] else None
        close(S[s], S_r[0]), close(a[s], a_r[0])
    for s in (1, 3):                                                           # untouched slots
        assert torch.equal(S[s], before["initial_state"][s]) and torch.equal(a[s], before["initial_A_state"][s])


@pytest.mark.parametrize("spec", [False, True])
def test_pool_slot_per_token(spec):
    # [N,S] slots: start from idx[n, 0] (or idx[n, accepted-1]); the state after token t goes
    # to idx[n, t]; dense B=2 rows of 3 tokens, S=4 slots per sequence
    H, K, V, P = 2, 16, 8, 10
    d = make(2, 3, H, K, V, seed=31)
    gen = torch.Generator().manual_seed(32)
    pools = dict(initial_state=torch.randn(P, H, K, V, generator=gen),
                 initial_A_state=torch.rand(P, H, K, generator=gen))
    before = {n: t.clone() for n, t in pools.items()}
    slots = torch.tensor([[7, 1, 2, 9], [3, 4, 5, 6]], dtype=torch.int32)
    accepted = torch.tensor([4, 2]) if spec else None
    o, S, a = fused_recurrent_precond_kda(**d, **pools, ssm_state_indices=slots,
                                          num_accepted_tokens=accepted)
    for n in range(2):
        s0 = int(slots[n, int(accepted[n]) - 1]) if spec else int(slots[n, 0])
        row = {m: (t[n:n + 1] if m != "log_atk_scale" else t) for m, t in d.items()}
        for t in range(3):
            part = {m: (x[:, :t + 1] if m != "log_atk_scale" else x) for m, x in row.items()}
            o_r, S_r, a_r = ref(dict(part, initial_state=before["initial_state"][s0][None],
                                     initial_A_state=before["initial_A_state"][s0][None]),
                                output_final_state=True)
            s_t = int(slots[n, t])
            close(S[s_t], S_r[0]), close(a[s_t], a_r[0])
        close(o[n:n + 1], o_r)
    for s in (9, 6, 0, 8):        # never written (with spec, slot 9 is read, not written)
        assert torch.equal(S[s], before["initial_state"][s]), s


def test_pool_transposed_grouped_and_gated():
    # the pool path with every other option at once: [P,HV,V,K] pools, HV = 2 H, in-kernel gate
    H, HV, K, V, P = 1, 2, 16, 8, 3
    d = make(1, 2, HV, K, V, seed=33)
    gen = torch.Generator().manual_seed(34)
    q, k = torch.randn(1, 2, H, K, generator=gen), torch.randn(1, 2, H, K, generator=gen)
    gate = dict(A_log=torch.randn(HV, generator=gen), dt_bias=torch.randn(HV * K, generator=gen))
    S_pool = torch.randn(P, HV, V, K, generator=gen)
    a_pool = torch.rand(P, HV, K, generator=gen)
    S0, a0 = S_pool[2].clone(), a_pool[2].clone()
    o, _, _ = fused_recurrent_precond_kda(**dict(d, q=q, k=k), **gate, use_gate_in_kernel=True,
                                          initial_state=S_pool, initial_A_state=a_pool,
                                          transpose_state_layout=True, cu_seqlens=torch.tensor([0, 2]),
                                          ssm_state_indices=torch.tensor([2]))
    rep = dict(d, q=q.repeat_interleave(2, dim=2), k=k.repeat_interleave(2, dim=2))
    o_r, S_r, a_r = ref(rep, **gate, use_gate_in_kernel=True, initial_state=S0[None],
                        initial_A_state=a0[None], transpose_state_layout=True, output_final_state=True)
    close(o, o_r), close(S_pool[2], S_r[0]), close(a_pool[2], a_r[0])


POOL_ERRORS = [
    ("slot past P", dict(ssm_state_indices=torch.tensor([0, 4])), ValueError,
     r"ssm_state_indices holds slot 4, outside the state pools' \[0, P=4\)"),
    ("negative slot", dict(ssm_state_indices=torch.tensor([-1, 0])), ValueError,
     r"ssm_state_indices holds slot -1"),
    ("rows", dict(ssm_state_indices=torch.tensor([0, 1, 2])), ValueError,
     r"ssm_state_indices has 3 rows but there are 2 sequences"),
    ("float", dict(ssm_state_indices=torch.tensor([0.0, 1.0])), ValueError,
     r"ssm_state_indices must be an integer tensor \[N\] or \[N,S\]"),
    ("too few slots", dict(ssm_state_indices=torch.tensor([[0, 1], [2, 3]])), ValueError,
     r"sequence 1 has 3 tokens but ssm_state_indices has S=2 slots per sequence"),
    ("accepted 1-D", dict(ssm_state_indices=torch.tensor([0, 1]), num_accepted_tokens=torch.tensor([1, 1])),
     ValueError, r"num_accepted_tokens needs a 2-D ssm_state_indices"),
    ("accepted 0", dict(ssm_state_indices=torch.tensor([[0, 1, 2], [3, 0, 1]]), num_accepted_tokens=torch.tensor([0, 1])),
     ValueError, r"num_accepted_tokens holds 0, outside \[1, S=3\]"),
    ("accepted alone", dict(num_accepted_tokens=torch.tensor([1, 1])), ValueError,
     r"num_accepted_tokens needs ssm_state_indices"),
    ("no A pool", dict(ssm_state_indices=torch.tensor([0, 1]), initial_A_state=None), ValueError,
     r"ssm_state_indices needs both state pools"),
    ("pool sizes", dict(ssm_state_indices=torch.tensor([0, 1]), initial_A_state=torch.rand(3, 1, 16)),
     ValueError, r"the state pools must hold the same number P >= 1 of slots"),
    ("strided pool", dict(ssm_state_indices=torch.tensor([0, 1]),
                          initial_state=torch.zeros(4, 1, 8, 16).transpose(-1, -2)),
     ValueError, r"initial_state must be contiguous when ssm_state_indices is given"),
    ("meta slots", dict(ssm_state_indices=torch.tensor([0, 1], device="meta")), ValueError,
     r"ssm_state_indices is on meta but q is on cpu: it must be on q's device or the CPU"),
]


@pytest.mark.parametrize("name,over,exc,match", POOL_ERRORS, ids=[e[0] for e in POOL_ERRORS])
def test_pool_errors(name, over, exc, match, spy):
    d = make(1, 4, 1, 16, 8)
    pools = dict(initial_state=torch.zeros(4, 1, 16, 8), initial_A_state=torch.zeros(4, 1, 16))
    with pytest.raises(exc, match=match):
        fused_recurrent_precond_kda(**d, **dict(pools, **over), cu_seqlens=torch.tensor([0, 1, 4]))
    assert spy.calls == []


@pytest.mark.parametrize("slots,accepted,msg", [
    ([[0, 1, 2], [3, 9, 1]], None, r"ssm_state_indices is invalid \(slot outside the state pools"),
    ([[0, 1], [3, 2]], None, r"ssm_state_indices is invalid \(a sequence has more tokens than its row"),
    ([[0, 1, 2], [3, 2, 1]], [1, 4], r"num_accepted_tokens is invalid \(entry outside \[1, slots"),
])
def test_pool_device_guard(slots, accepted, msg, monkeypatch):
    # device-resident indices: the kernel's guard skips the bad sequence, writes no slot of it,
    # processes the good one, and the launch raises naming the argument
    monkeypatch.setattr(R, "_host_readable", lambda t: False)
    d, cu, pools = pool_case([1, 3], P=5, seed=35, H=1)
    before = {n: t.clone() for n, t in pools.items()}
    with pytest.raises(ValueError, match=msg):
        fused_recurrent_precond_kda(**d, **pools, cu_seqlens=cu, ssm_state_indices=torch.tensor(slots),
                                    num_accepted_tokens=None if accepted is None else torch.tensor(accepted))
    R.check_recurrent_indices("cpu")                                   # reported, then reset
    _, S_r, a_r = seq_ref(d, cu, 0, before["initial_state"][0], before["initial_A_state"][0])
    close(pools["initial_state"][0], S_r[0]), close(pools["initial_A_state"][0], a_r[0])
    for s in (2, 3, 4):                      # sequence 1's slots: nothing written
        assert torch.equal(pools["initial_state"][s], before["initial_state"][s]), s
        assert torch.equal(pools["initial_A_state"][s], before["initial_A_state"][s]), s


# ---------------------------------------------------------------- scalars and devices
@pytest.mark.parametrize("over,exc,match", [
    (dict(x=float("nan")), ValueError, r"x must be finite, got nan"),
    (dict(x=float("inf")), ValueError, r"x must be finite, got inf"),
    (dict(x=-1.0), ValueError, r"x must be > 0"),
    (dict(eps=-1.0), ValueError, r"eps must be > 0 .*got -1.0"),
    (dict(eps=0.0), ValueError, r"eps must be > 0"),
    (dict(eps=float("nan")), ValueError, r"eps must be finite"),
    (dict(scale=float("inf")), ValueError, r"scale must be finite, got inf"),
    (dict(scale=torch.tensor(0.5)), TypeError, r"scale must be a real number, got Tensor"),
    (dict(scale=True), TypeError, r"scale must be a real number, got bool"),
    (dict(lower_bound=float("-inf")), ValueError, r"lower_bound must be finite"),
    (dict(log_atk_scale=float("nan")), ValueError, r"log_atk_scale must be finite"),
])
def test_scalar_arguments(over, exc, match, spy):
    with pytest.raises(exc, match=match):
        fused_recurrent_precond_kda(**dict(make(1, 2, 1, 16, 8), **over))
    assert spy.calls == []


def test_cu_seqlens_on_meta_device():
    with pytest.raises(ValueError, match=r"cu_seqlens is on meta but q is on cpu: it must be on q's device or the CPU"):
        fused_recurrent_precond_kda(**make(1, 4, 1, 16, 8), cu_seqlens=torch.tensor([0, 4], device="meta"))


# ---------------------------------------------------------------- compiled, not interpreted
COMPILE_FOR_SM90 = r'''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.pkda import recurrent as R

def compile_for_sm90(kernel, types, constexprs):
    names = list(kernel.arg_names)
    consts = {n: v for n, v in constexprs.items()}
    sig = {n: ("constexpr" if n in consts else types.get(n, "*fp32")) for n in names}
    src = ASTSource(kernel, sig, {(names.index(n),): v for n, v in consts.items()})
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=1))

ints = dict(T="i32", H="i32", HV="i32", NS="i32", P="i32", scale="fp32", log_x="fp32", eps="fp32",
            l2_eps="fp32", lower_bound="fp32", q="*bf16", k="*bf16", v="*bf16", o="*bf16",
            cu="*i32", slots="*i64", accepted="*i32", err="*i32")
flags = ("IS_VARLEN", "HAS_S0", "HAS_A0", "STORE_FINAL", "L2NORM_QK", "HAS_DT_BIAS", "TRANSPOSE_STATE", "SPEC", "GUARDED")
none_unless = dict(IS_VARLEN="cu", HAS_S0="h0", HAS_DT_BIAS="dt_bias", SPEC="accepted", GUARDED="err")
for on, gate, slots in ((set(flags) - {"TRANSPOSE_STATE", "SPEC", "HAS_DT_BIAS"}, 0, 0),
                        ({"L2NORM_QK", "HAS_DT_BIAS", "TRANSPOSE_STATE"}, 1, 0),
                        ({"IS_VARLEN", "HAS_S0", "HAS_A0", "L2NORM_QK", "GUARDED"}, 2, 1),
                        ({"HAS_S0", "HAS_A0", "L2NORM_QK", "HAS_DT_BIAS", "TRANSPOSE_STATE", "SPEC", "GUARDED"}, 1, 2)):
    c = dict(K=100, V=100, BK=128, BV=32, GATE=gate, SLOTS=slots, **{f: f in on for f in flags})
    c.update({ptr: None for flag, ptr in none_unless.items() if flag not in on})
    if "HAS_A0" not in on:
        c["a0"] = None
    if gate == 0:
        c["A_log"] = None
    if slots == 0:
        c["slots"] = None
        if "STORE_FINAL" not in on:
            c["ht"] = c["at"] = None
    compile_for_sm90(R.pkda_fused_recurrent_kernel, ints, c)
    print("compiled", sorted(on), gate, slots)
for spec in (True, False):
    compile_for_sm90(R.pkda_recurrent_gather_a_kernel, ints,
                     dict(K=60, BK=64, SPEC=spec, **({} if spec else {"accepted": None})))
print("compiled gather")
'''


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    # the interpreter never compiles: Triton's compiler (and its bundled ptxas) builds the
    # kernels for an H200 (sm_90) here, without a GPU, in a process without TRITON_INTERPRET
    import subprocess
    import sys
    from pathlib import Path
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("compiled ") == 5, proc.stdout
