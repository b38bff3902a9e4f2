"""PKDA ops without host syncs: the harness times an op as a CUDA-graph replay only when one
call runs under torch.cuda.set_sync_debug_mode("error"), and a pageable host->device copy of
the chunk layout (torch.tensor(...).to(device), every call) made every chunk_precond_kda row
fall back to eager timing. Here, on the CPU, every call from kernels/pkda code that would move
data between host and device, or read a device value on the host, is recorded by its
arguments (the device is the CPU here, so a real copy cannot be seen): dense calls must make
none after the first call of a shape (none at all in fact: the dense layout is made by device
ops); varlen makes exactly one, reading cu_seqlens back. The cached layout must give the
same bits as a fresh one and never change."""
import dataclasses
import os
import sys
from collections import OrderedDict
from contextlib import contextmanager

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch.nn.functional as F

import kernels.pkda
from kernels.pkda import chunk_precond_kda, reference
from kernels.pkda.recurrent import fused_recurrent_precond_kda

PKDA_DIR = os.path.dirname(os.path.abspath(kernels.pkda.__file__)) + os.sep


def make(B, T, H=1, K=64, V=64, seed=0, states=False, N=None):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    d = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, V), g=F.logsigmoid(r(B, T, H, K)),
             g_atk=F.logsigmoid(r(B, T, H)), beta_atk=torch.sigmoid(r(B, T, H)),
             beta=torch.sigmoid(r(B, T, H)))
    if states:
        N = B if N is None else N
        d.update(initial_state=0.1 * r(N, H, K, V), initial_A_state=torch.rand(N, H, K, generator=gen))
    return d


def fwd_bwd(d, **kw):
    """Forward + backward on fresh leaves; returns every output and gradient by name."""
    leaves = {n: t.clone().requires_grad_(True) for n, t in d.items()}
    outs = chunk_precond_kda(**leaves, **kw)
    gen = torch.Generator().manual_seed(1)
    sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs if o is not None).backward()
    res = {f"out{i}": o.detach() for i, o in enumerate(outs) if o is not None}
    res.update({"d" + n: t.grad for n, t in leaves.items()})
    return res


# ---------------------------------------------------------------------------- the watch
def _names_a_device(args, kwargs):
    """Tensor.to(...) with a device (or a tensor, whose device it takes): a copy between host
    and device on a GPU, a no-op here. A dtype alone is not."""
    return "device" in kwargs or any(
        isinstance(a, (torch.device, str, torch.Tensor)) or (isinstance(a, int) and not isinstance(a, bool))
        for a in args)


# (owner, name, when a call counts: None = always, else a predicate on (args, kwargs))
WATCHED = [
    (torch, "tensor", None), (torch, "as_tensor", None), (torch, "from_numpy", None),
    (torch, "full", lambda a, kw: torch.is_tensor(kw.get("fill_value", a[1] if len(a) > 1 else None))),
    (torch.Tensor, "to", lambda a, kw: _names_a_device(a[1:], kw)),
    (torch.Tensor, "cuda", None), (torch.Tensor, "cpu", None), (torch.Tensor, "numpy", None),
    (torch.Tensor, "tolist", None), (torch.Tensor, "item", None),
    (torch.Tensor, "__bool__", None), (torch.Tensor, "__float__", None),
    (torch.Tensor, "__int__", None), (torch.Tensor, "__index__", None),
]


@contextmanager
def watch(monkeypatch):
    """Yields a list that collects 'name (file:line)' for every watched call made directly by
    kernels/pkda code (Triton's interpreter and torch itself move tensors around on their own;
    only the op's own calls are what a GPU run would sync on). Every tensor the op touches is
    treated as a device tensor, as it is on a GPU."""
    seen = []

    def wrap(owner, name, counts):
        orig = getattr(owner, name)

        def watched(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(PKDA_DIR) and (counts is None or counts(args, kwargs)):
                seen.append(f"{name} ({os.path.relpath(caller, PKDA_DIR)}:{sys._getframe(1).f_lineno})")
            return orig(*args, **kwargs)
        return watched

    with monkeypatch.context() as m:
        for owner, name, counts in WATCHED:
            m.setattr(owner, name, wrap(owner, name, counts))
        yield seen


def test_watch_sees_a_host_copy(monkeypatch):
    """The watch itself: the host->device copies the layout used to make every call."""
    with watch(monkeypatch) as seen:
        reference._copied_index(((0, 70),), [(0, 0, 0, 64), (0, 1, 64, 6)], [0, 2], torch.device("cpu"))
        torch.tensor([1.0]).to("cpu")  # not from kernels/pkda: not counted
    assert [s.split(" ")[0] for s in seen] == ["tensor", "to"]


# ---------------------------------------------------------------------------- no syncs
@pytest.mark.parametrize("kw", [{}, dict(states=True, output_final_state=True, disable_recompute=True)],
                         ids=["plain", "states-final-keep"])
def test_dense_chunk_op_no_host_sync_after_first_call(monkeypatch, kw):
    kw = dict(kw)
    d = make(2, 70, states=kw.pop("states", False))
    fwd_bwd(d, **kw)  # warm-up: the first call of the shape may build (and cache) its layout
    with watch(monkeypatch) as seen:
        fwd_bwd(d, **kw)
    assert seen == [], f"the dense forward + backward would sync with the host: {seen}"


def test_dense_first_call_makes_no_host_copy(monkeypatch):
    """Even a cold cache: the dense layout's index tensors are made on the device."""
    monkeypatch.setattr(reference, "_LAYOUTS", OrderedDict())
    with watch(monkeypatch) as seen:
        fwd_bwd(make(1, 70))
    assert seen == []
    with torch.inference_mode(), watch(monkeypatch) as seen:
        chunk_precond_kda(**make(2, 40), return_intermediate_states=True)
    assert seen == []


def test_dense_recurrent_op_no_host_sync(monkeypatch):
    d = make(2, 5, states=True)
    with torch.no_grad():
        fused_recurrent_precond_kda(**d, output_final_state=True)
        with watch(monkeypatch) as seen:
            fused_recurrent_precond_kda(**d, output_final_state=True)
    assert seen == []


def test_varlen_reads_cu_seqlens_back_once(monkeypatch):
    """The documented one: validation's cu_seqlens.tolist() feeds the layout; the backward
    reuses the forward's layout, and a repeated cu_seqlens copies nothing to the device."""
    d = make(1, 150, states=True, N=3)
    cu = torch.tensor([0, 40, 40, 140])
    fwd_bwd(d, cu_seqlens=cu, output_final_state=True)
    with watch(monkeypatch) as seen:
        fwd_bwd(d, cu_seqlens=cu, output_final_state=True)
    assert [s.split(" (")[0] for s in seen] == ["tolist"], seen
    assert seen[0].startswith("tolist (op.py:")


# ---------------------------------------------------------------------------- same bits
def test_cached_layout_gives_the_bits_of_a_fresh_one(monkeypatch):
    monkeypatch.setattr(reference, "_LAYOUTS", OrderedDict())
    d = make(2, 70, states=True)
    kw = dict(output_final_state=True)
    fresh = fwd_bwd(d, **kw)
    assert len(reference._LAYOUTS) == 1
    cached = fwd_bwd(d, **kw)
    assert len(reference._LAYOUTS) == 1
    assert fresh.keys() == cached.keys()
    for name in fresh:
        assert torch.equal(fresh[name], cached[name]), name


def _host_index(lay):
    """The index tensors as the layout used to build them every call: from its host tuples."""
    i32 = dict(dtype=torch.int32)
    return (torch.tensor([b for b, _ in lay.bounds] + [lay.bounds[-1][1] if lay.bounds else 0], **i32),
            torch.tensor([(n, i) for n, i, _, _ in lay.chunks], **i32).reshape(-1, 2),
            torch.tensor([0] + [sum(1 for c in lay.chunks if c[0] <= n) for n in range(lay.N)], **i32),
            torch.tensor([(s, s + L) for _, _, s, L in lay.chunks], **i32).reshape(-1, 2))


@pytest.mark.parametrize("B,T,cu", [(1, 1, None), (3, 63, None), (2, 64, None), (3, 65, None),
                                    (2, 200, None), (2, 0, None), (0, 5, None),
                                    (1, 150, [0, 40, 40, 140]), (1, 64, [0, 64]), (1, 9, [0, 0])])
def test_layout_index_tensors_match_the_host_tuples(monkeypatch, B, T, cu):
    monkeypatch.setattr(reference, "_LAYOUTS", OrderedDict())
    lay = reference.make_layout(B, T, None if cu is None else torch.tensor(cu), "cpu")
    assert [(c[0], c[1]) for c in lay.chunks] == sorted((c[0], c[1]) for c in lay.chunks)
    for got, want in zip(lay.index_tensors(), _host_index(lay)):
        assert got.dtype == torch.int32 and got.shape == want.shape and torch.equal(got, want)
        assert got.is_contiguous() and got.data_ptr() % 16 == 0


def test_cached_layout_is_never_changed(monkeypatch):
    monkeypatch.setattr(reference, "_LAYOUTS", OrderedDict())
    d = make(2, 70)
    fwd_bwd(d)
    (entry,) = reference._LAYOUTS.values()
    lay = entry.layout
    versions = [t._version for t in lay.index_tensors()]
    values = [t.clone() for t in lay.index_tensors()]
    fwd_bwd(d)
    assert reference.make_layout(2, 70, None, "cpu") is lay
    assert [t._version for t in lay.index_tensors()] == versions
    assert all(torch.equal(t, v) for t, v in zip(lay.index_tensors(), values))
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.cu = values[0]


def test_layout_cache_is_bounded_and_keeps_captured_entries(monkeypatch):
    monkeypatch.setattr(reference, "_LAYOUTS", OrderedDict())
    monkeypatch.setattr(reference, "LAYOUT_CACHE_SIZE", 3)
    first = reference.make_layout(1, 1, None, "cpu")
    reference._LAYOUTS[(1, 1, torch.device("cpu"), None)].captured = True  # a graph reads it
    lays = [reference.make_layout(1, T, None, "cpu") for T in range(2, 7)]
    assert [k[1] for k in reference._LAYOUTS] == [1, 5, 6]  # the captured one, then the newest
    assert reference.make_layout(1, 1, None, "cpu") is first
    assert reference.make_layout(1, 6, None, "cpu") is lays[-1]
    assert reference.make_layout(1, 2, None, "cpu") is not lays[0]  # evicted, built again
    assert len(reference._LAYOUTS) == 3
