"""kernels/pkda/layer.py: the PKDA layer and two-layer model around the real op (Triton interpreter,
fp32), loaded by file path as the harness loads it. Small on purpose: 2 shared cores."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kernels.pkda import chunk_precond_kda, naive_recurrent_precond_kda

ROOT = Path(__file__).resolve().parent.parent
LAYER = ROOT / "kernels" / "pkda" / "layer.py"
CFG = {"vocab": 32, "hidden": 64, "heads": 2, "head_dim": 64}


def load_layer():
    spec = importlib.util.spec_from_file_location("_pkda_layer_by_path", LAYER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


L = load_layer()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def model(attn=chunk_precond_kda, seed=0, **cfg):
    torch.manual_seed(seed)
    return L.build_model({**CFG, **cfg}, attn)


def test_layer_loads_by_path_without_the_kernels_package():
    code = (f"import importlib.util, sys; s = importlib.util.spec_from_file_location('m', {str(LAYER)!r}); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
            "assert not any(k == 'kernels' or k.startswith('kernels.') for k in sys.modules), 'kernels imported'; "
            "md = m.build_model({'vocab': 8, 'hidden': 64, 'heads': 1, 'head_dim': 64}, lambda *a, **k: a[2]); "
            "print(len(md.blocks))")
    res = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ""})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "2"  # two layers by default


def test_layer_projections_and_parameters():
    m = model()
    attn = m.blocks[0].attn
    assert attn.g_proj.out_features == 2 * 64 and attn.g_atk_proj.out_features == 2
    assert attn.b_proj.out_features == 2 and attn.b_atk_proj.out_features == 2
    assert torch.equal(attn.log_atk_scale.detach(), torch.full((2,), -0.2))
    seen = {}

    def spy(q, k, v, g, g_atk, beta_atk, beta, **kw):
        seen.update(q=q, g=g, g_atk=g_atk, beta=beta, beta_atk=beta_atk, **kw)
        return v, None, None

    m2 = model(attn=spy)
    m2(torch.zeros(1, 8, dtype=torch.long))
    assert seen["q"].shape == (1, 8, 2, 64) and seen["g"].shape == (1, 8, 2, 64) and seen["g_atk"].shape == (1, 8, 2)
    assert (seen["g"] <= 0).all() and (seen["g_atk"] <= 0).all()  # logsigmoid decays
    assert ((seen["beta"] > 0) & (seen["beta"] < 1)).all() and ((seen["beta_atk"] > 0) & (seen["beta_atk"] < 1)).all()
    assert seen["log_atk_scale"] is m2.blocks[-1].attn.log_atk_scale and seen["cu_seqlens"] is None


def test_varlen_cu_seqlens_boundaries_every_context_len():
    assert L.varlen_cu_seqlens(2048, 2048).tolist() == [0, 2048]
    assert L.varlen_cu_seqlens(200, 64).tolist() == [0, 64, 128, 192, 200]
    ids, lab = torch.arange(8).view(2, 4), torch.arange(1, 9).view(2, 4)
    pi, pl, cu = L.pack_varlen(ids, lab, 4)
    assert pi.tolist() == [list(range(8))] and pl.tolist() == [list(range(1, 9))] and cu.tolist() == [0, 4, 8]
    with pytest.raises(ValueError):
        L.varlen_cu_seqlens(8, 0)


def test_tiny_model_trains_with_decreasing_loss_and_matches_the_naive_op():
    seq = torch.arange(65) % 8  # a repeating sequence
    ids, lab = seq[:-1][None], seq[1:][None]
    losses = {}
    for name, attn in (("triton", chunk_precond_kda), ("naive", naive_recurrent_precond_kda)):
        m = model(attn)
        opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
        losses[name] = []
        for _ in range(4):
            opt.zero_grad()
            loss = m(ids, labels=lab)
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    tl = losses["triton"]
    assert all(torch.isfinite(torch.tensor(tl)))
    assert all(b < a for a, b in zip(tl, tl[1:])), tl  # strictly decreasing
    assert tl[-1] < tl[0] - 0.3, tl
    # the same training through the fp32 recurrent oracle: the Triton op's gradients train the same model
    assert tl == pytest.approx(losses["naive"], rel=1e-4, abs=1e-5), (tl, losses["naive"])


def test_varlen_one_document_equals_dense():
    m = model()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 32, (1, 65), generator=g)
    ids, lab = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        dense = m(ids, labels=lab)
        pi, pl, cu = L.pack_varlen(ids, lab, 64)
        assert cu.tolist() == [0, 64]
        varlen = m(pi, labels=pl, cu_seqlens=cu)
    assert varlen.item() == pytest.approx(dense.item(), rel=1e-6, abs=1e-6)


def test_varlen_several_documents_equal_separate_batch_rows():
    m = model()
    g = torch.Generator().manual_seed(2)
    ids, lab = torch.randint(0, 32, (2, 64), generator=g), torch.randint(0, 32, (2, 64), generator=g)
    # a ragged split too: documents of 40 and 24 tokens from one 64-token row
    with torch.no_grad():
        rows = m(ids, labels=lab)
        pi, pl, cu = L.pack_varlen(ids, lab, 64)
        assert cu.tolist() == [0, 64, 128]
        packed = m(pi, labels=pl, cu_seqlens=cu)
        assert packed.item() == pytest.approx(rows.item(), rel=1e-5, abs=1e-6)
        r = ids[:1]
        l = lab[:1]
        cu2 = torch.tensor([0, 40, 64], dtype=torch.int32)
        ragged = m(r, labels=l, cu_seqlens=cu2, )
        a = torch.nn.functional.cross_entropy(m(r[:, :40]).reshape(-1, 32), l[:, :40].reshape(-1), reduction="sum")
        b = torch.nn.functional.cross_entropy(m(r[:, 40:]).reshape(-1, 32), l[:, 40:].reshape(-1), reduction="sum")
        assert ragged.item() == pytest.approx(((a + b) / 64).item(), rel=1e-5, abs=1e-6)


def test_first_step_losses_of_two_identical_sides_agree_exactly():
    from harness.training import train_steps

    row = {"name": "r", "model_file": str(LAYER), "model_fn": "build_model", **CFG, "layers": 2, "dtype": "float32",
           "B": 1, "T": 64, "varlen": True, "context_len": 32, "lr": 1e-3, "weight_decay": 0.0, "optimizer": "adamw",
           "warmup_steps": 1, "steps": 0, "seed": 3}
    a = train_steps(row, chunk_precond_kda, "cpu", lambda *x: None)
    b = train_steps(row, chunk_precond_kda, "cpu", lambda *x: None)
    assert a["first_loss"] == b["first_loss"] and torch.isfinite(torch.tensor(a["first_loss"]))
