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
    assert kw["STORE_FINAL"] is False and args[11] is None and args[12] is None  # ht, at
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
    R.check_recurrent_cu_seqlens("cpu")                            # nothing pending


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
    assert int(err.item()) == R.CU_ERR_PAST_T
    good = {n: (t[:, :4] if n not in ("initial_state", "initial_A_state", "log_atk_scale")
                else t[:1] if n != "log_atk_scale" else t) for n, t in d.items()}
    o_r, S_r, a_r = ref(good, output_final_state=True)
    close(o[:, :4], o_r), close(S[:1], S_r), close(a[:1], a_r)
    assert torch.count_nonzero(o[:, 4:]) == 0
    assert torch.count_nonzero(S[1]) == 0 and torch.count_nonzero(a[1]) == 0
    with pytest.raises(ValueError, match=r"cu_seqlens is invalid \(entry past T"):
        R.check_recurrent_cu_seqlens("cpu")
    R.check_recurrent_cu_seqlens("cpu")   # reset after reporting


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
