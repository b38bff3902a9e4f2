"""PKDA ops without host syncs: the harness times an op as a CUDA-graph replay only when one
call runs under torch.cuda.set_sync_debug_mode("error"), and a pageable host->device copy of
the chunk layout (torch.tensor(...).to(device), every call) made every chunk_precond_kda row
fall back to eager timing. Here, on the CPU, every call from kernels/pkda code that would move
data between host and device, or read a device value on the host, is recorded by its
arguments (the device is the CPU here, so a real copy cannot be seen): dense calls must make
none after the first call of a shape (none at all in fact: the dense layout is made by device
ops); varlen makes exactly one, reading cu_seqlens back, when its cu_seqlens tensor object was
not read before or was written since, and none when the same unchanged object comes again.
The cached layout must give the same bits as a fresh one and never change."""
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


def _moves(seen):
    return [s.split(" (")[0] for s in seen]


CU, CU_NEW = [0, 40, 40, 140], [0, 30, 90, 150]  # T = 150


def _varlen(cu, **kw):
    return fwd_bwd(make(1, 150, states=True, N=3), cu_seqlens=cu, output_final_state=True, **kw)


def _warm_layouts():
    """Make the layouts' one host->device copy each, so the watch sees only cu_seqlens reads."""
    for cu in (CU, CU_NEW):
        reference.make_layout(1, 150, torch.tensor(cu), "cpu")


def _same_bits(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_varlen_same_cu_seqlens_object_reads_nothing_back(monkeypatch):
    """The harness's case: every step passes one cu_seqlens tensor. Its first call reads it
    back once (validation's read feeds the layout, the backward reuses the forward's layout);
    a repeat reads nothing (it may then be captured as a CUDA graph) and gives the same bits."""
    monkeypatch.setattr(reference, "_HOST_CU", OrderedDict())
    _warm_layouts()
    cu = torch.tensor(CU)
    with watch(monkeypatch) as seen:
        first = _varlen(cu)
    assert _moves(seen) == ["tolist"], seen
    assert seen[0].startswith("tolist (reference.py:"), seen
    with watch(monkeypatch) as seen:
        again = _varlen(cu)
    assert seen == [], f"a repeated cu_seqlens tensor was read back again: {seen}"
    _same_bits(first, again)


def test_varlen_equal_values_in_another_tensor_read_back_once(monkeypatch):
    """The cache knows tensor objects, not values: an equal new tensor is read back once (a
    repeated cu_seqlens values copies nothing to the device: the layout is cached by value),
    and it does not push the first tensor out."""
    monkeypatch.setattr(reference, "_HOST_CU", OrderedDict())
    cu = torch.tensor(CU)
    first = _varlen(cu)
    with watch(monkeypatch) as seen:
        other = _varlen(torch.tensor(CU))
    assert _moves(seen) == ["tolist"], seen
    _same_bits(first, other)
    with watch(monkeypatch) as seen:
        _varlen(cu)
    assert seen == [], seen


def _set_values(cu, how, values):
    if how == "copy_":
        cu.copy_(torch.tensor(values))
    elif how == "setitem":
        for i, v in enumerate(values):
            cu[i] = v
    elif how == "view":  # a write through a view bumps the version counter the base shares
        cu[1:].copy_(torch.tensor(values[1:]))
    elif how == "data":  # a swapped storage leaves _version alone; data_ptr changes
        cu.data = torch.tensor(values)
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["copy_", "setitem", "view", "data"])
def test_varlen_written_cu_seqlens_is_read_back(monkeypatch, how):
    """A cached tensor written in place (through it, a view of it, or its .data) is read back
    once on its next call, which then runs on the new offsets: the same bits as a fresh
    tensor holding them, not the old offsets' results."""
    monkeypatch.setattr(reference, "_HOST_CU", OrderedDict())
    _warm_layouts()
    cu = torch.tensor(CU)
    old = _varlen(cu)
    with watch(monkeypatch) as seen:
        assert reference.host_cu_seqlens(cu) == tuple(CU)
    assert seen == [], seen  # cached before the write
    _set_values(cu, how, CU_NEW)
    with watch(monkeypatch) as seen:
        got = _varlen(cu)
    assert _moves(seen) == ["tolist"], seen
    _same_bits(got, _varlen(torch.tensor(CU_NEW)))
    assert not torch.equal(got["out0"], old["out0"])


@pytest.mark.parametrize("values,T,match", [
    ([0, 40, 30, 140], 150, "non-decreasing"),
    ([0, 40, 40, 160], 150, "past T=150"),
    ([5, 40, 40, 140], 150, "must start at 0"),
    (CU, 100, "past T=100"),  # unchanged tensor, a shorter T: checked again, still no read
])
def test_varlen_cached_cu_seqlens_is_checked_every_call(monkeypatch, values, T, match):
    """Invalid offsets in a tensor that passed before are refused (written: read back and
    checked; unchanged: checked on its host copy against this call's T, with no read-back),
    and stay refused while the tensor is unchanged."""
    monkeypatch.setattr(reference, "_HOST_CU", OrderedDict())
    cu = torch.tensor(CU)
    with torch.no_grad():
        chunk_precond_kda(**make(1, 150), cu_seqlens=cu)
        if values != CU:
            cu.copy_(torch.tensor(values))
        want = [] if values == CU else ["tolist"]
        with watch(monkeypatch) as seen, pytest.raises(ValueError, match=match):
            chunk_precond_kda(**make(1, T), cu_seqlens=cu)
        assert _moves(seen) == want, seen
        with watch(monkeypatch) as seen, pytest.raises(ValueError, match=match):
            chunk_precond_kda(**make(1, T), cu_seqlens=cu)
        assert seen == [], seen


def test_host_cu_cache_is_bounded_lru(monkeypatch):
    monkeypatch.setattr(reference, "_HOST_CU", OrderedDict())
    monkeypatch.setattr(reference, "HOST_CU_CACHE_SIZE", 2)
    a, b, c = (torch.tensor([0, n]) for n in (1, 2, 3))
    for t in (a, b, a, c):  # b is the least recently used when c comes
        reference.host_cu_seqlens(t)
    assert len(reference._HOST_CU) == 2
    with watch(monkeypatch) as seen:
        assert reference.host_cu_seqlens(a) == (0, 1)
        assert reference.host_cu_seqlens(c) == (0, 3)
    assert seen == []
    with watch(monkeypatch) as seen:
        assert reference.host_cu_seqlens(b) == (0, 2)
    assert _moves(seen) == ["tolist"]


def test_host_cu_cache_misses_a_dead_tensors_reused_id(monkeypatch):
    """An entry left by a dead tensor whose id a new tensor got (same stamp even) is not the
    new tensor's: its weak reference is dead."""
    monkeypatch.setattr(reference, "_HOST_CU", OrderedDict())
    dead = torch.tensor([0])
    ref = reference.weakref.ref(dead)
    del dead
    assert ref() is None
    t = torch.tensor([0, 7])
    reference._HOST_CU[id(t)] = (ref, reference._stamp(t), (0, 99))
    with watch(monkeypatch) as seen:
        assert reference.host_cu_seqlens(t) == (0, 7)
    assert _moves(seen) == ["tolist"]


def test_host_cu_cache_skips_inference_tensors(monkeypatch):
    """They have no version counter, so a write could not be seen: read on every call."""
    monkeypatch.setattr(reference, "_HOST_CU", OrderedDict())
    with torch.inference_mode():
        t = torch.tensor([0, 5])
        with watch(monkeypatch) as seen:
            reference.host_cu_seqlens(t)
            t[1] = 6
            assert reference.host_cu_seqlens(t) == (0, 6)
    assert _moves(seen) == ["tolist", "tolist"]
    assert len(reference._HOST_CU) == 0


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
