"""Training rows (issue #9): spec fields and cross-references, the worker's training records, the
training gate's first-step-loss check, the report's training rows, and an end-to-end harness run in
a temporary git repository with a plain-torch op of the PKDA signature."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from harness import analyse, gates as G
from harness.measure.sides import BenchSettings, training_job_row
from harness.records import append_jsonl, load_blocks
from harness.spec import Experiment, SpecError, load_experiment
from harness.stats import Series
from harness.training import run_training_rows

ROOT = Path(__file__).resolve().parent.parent
LAYER = ROOT / "kernels" / "pkda" / "layer.py"
INPUTS = ROOT / "experiments" / "inputs" / "pkda.py"

# a plain-torch op with chunk_precond_kda's signature: causal, gated by beta, respects cu_seqlens;
# WORK repeats the scores (the knob a candidate turns); SHIFT moves the output (a forward change)
PKOP = '''\
import torch
import torch.nn.functional as F

WORK = {work}
SHIFT = {shift}


def attn(q, k, v, g, g_atk, beta_atk, beta, scale=None, initial_state=None, initial_A_state=None,
         output_final_state=False, cu_seqlens=None, x=1.5, eps=1e-6, log_atk_scale=None):
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    qn, kn = F.normalize(q.float(), dim=-1), F.normalize(k.float(), dim=-1)
    seg = torch.zeros(T, dtype=torch.long, device=q.device)
    if cu_seqlens is not None:
        for i in range(1, len(cu_seqlens) - 1):
            seg[int(cu_seqlens[i]):] += 1
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=q.device)) & (seg[:, None] == seg[None, :])
    lsc = torch.zeros(H, device=q.device) if log_atk_scale is None else log_atk_scale.float()
    for _ in range(WORK):
        s = torch.einsum("bthk,bshk->bhts", qn * scale, kn) * torch.exp(lsc)[None, :, None, None]
    s = s * (beta.float() * torch.sigmoid(beta_atk.float()) * torch.exp(g_atk.float())).permute(0, 2, 1)[:, :, None, :]
    s = s + 0.01 * g.float().mean(-1).permute(0, 2, 1)[:, :, None, :]
    s = s.masked_fill(~mask, 0.0)
    o = torch.einsum("bhts,bshv->bthv", s, v.float()) + SHIFT
    return o.to(v.dtype), None, None
'''

ROW = {"name": "dense", "model": "layer.py:build_model", "hidden": 64, "heads": 1, "head_dim": 64, "vocab": 32,
       "B": 1, "T": 64, "warmup_steps": 1, "steps": 3, "lr": 1e-2}
VARLEN = {**ROW, "name": "varlen", "varlen": True, "context_len": 32}
GATE = {"name": "train", "kind": "training", "rows": ["dense", "varlen"], "neutral_margin": 0.02,
        "min_best_speedup": 1.05}


def exp_dict(**extra):
    data = {"name": "t", "target": {"op": "pkg.mod:fn", "inputs": "inputs.py:make"},
            "baseline": {"ref": "abcdef1"}, "candidate": {"ref": "cand"}, "modes": ["fwdbwd"],
            "shapes": [{"name": "s", "B": 1, "T": 64, "H": 1, "K": 64, "V": 64}],
            "gates": [GATE], "training": [ROW, VARLEN]}
    data.update(extra)
    return data


# --- spec --------------------------------------------------------------------------------------

def test_spec_training_rows_and_cross_references():
    exp = Experiment.model_validate(exp_dict())
    assert [t.name for t in exp.training] == ["dense", "varlen"]
    t = exp.training[1]
    assert (t.varlen, t.context_len, t.optimizer, t.layers, t.dtype, t.tokens) == (True, 32, "adamw", 2, "bfloat16", 64)
    with pytest.raises(ValueError, match="names training rows \\['nope'\\]"):
        Experiment.model_validate(exp_dict(gates=[{**GATE, "rows": ["dense", "nope"]}]))
    with pytest.raises(ValueError, match="needs context_len"):
        Experiment.model_validate(exp_dict(training=[{**VARLEN, "context_len": None}]))
    with pytest.raises(ValueError, match="varlen rows only"):
        Experiment.model_validate(exp_dict(training=[{**ROW, "context_len": 64}], gates=[{**GATE, "rows": ["dense"]}]))
    with pytest.raises(ValueError, match="training row names must be unique"):
        Experiment.model_validate(exp_dict(training=[ROW, ROW], gates=[{**GATE, "rows": ["dense"]}]))
    cpu = {"shapes": [{"name": "s", "B": 1, "T": 64, "H": 1, "K": 64, "V": 64}], "training": [{**ROW, "name": "other"}]}
    with pytest.raises(ValueError, match="cpu.training"):
        Experiment.model_validate(exp_dict(cpu=cpu))


def test_cpu_settings_train_the_cpu_rows_only_in_fp32(tmp_path):
    """A cpu profile's training rows stand in for the rows of the same names, and a CPU run trains
    only those (a row left out would run GPU-sized under the interpreter); without any, the declared
    rows, in fp32."""
    shapes = [{"name": "s", "B": 1, "T": 64, "H": 1, "K": 64, "V": 64}]
    exp = Experiment.model_validate(exp_dict(cpu={"shapes": shapes, "training": [{**ROW, "T": 32}]}))
    loaded = type("L", (), {"exp": exp})()
    gpu, cpu_s = BenchSettings.for_machine(loaded, False), BenchSettings.for_machine(loaded, True)
    assert [(t.name, t.T, t.dtype) for t in gpu.training] == [("dense", 64, "bfloat16"), ("varlen", 64, "bfloat16")]
    assert [(t.name, t.T, t.dtype) for t in cpu_s.training] == [("dense", 32, "float32")]
    assert cpu_s.to_json()["training"][0]["T"] == 32
    plain = type("L", (), {"exp": Experiment.model_validate(exp_dict(cpu={"shapes": shapes}))})()
    assert [(t.name, t.T, t.dtype) for t in BenchSettings.for_machine(plain, True).training] == [
        ("dense", 64, "float32"), ("varlen", 64, "float32")]


def test_missing_model_file_is_a_spec_error(tmp_path):
    (tmp_path / ".git").mkdir()
    shutil.copy(INPUTS, tmp_path / "inputs.py")
    data = exp_dict(target={"op": "kernels.pkda:chunk_precond_kda", "inputs": "inputs.py:make_inputs"})
    import yaml

    (tmp_path / "e.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(SpecError, match=r"training\[0\].model.*does not exist"):
        load_experiment(tmp_path / "e.yaml")


# --- the worker's records ----------------------------------------------------------------------

def _job_rows(tmp_path, rows=(ROW, VARLEN)):
    names = [r["name"] for r in rows]
    exp = Experiment.model_validate(exp_dict(training=list(rows), gates=[{**GATE, "rows": names}]))
    loaded = type("L", (), {"model_file": lambda self, r: LAYER})()
    return [training_job_row(loaded, t) for t in exp.training]


def _run_rows(tmp_path, side, block, op, rows=(ROW, VARLEN)):
    samples = tmp_path / "samples.jsonl"
    base = {"block": block, "side": side, "attempt": f"a{block}"}
    emit = lambda kind, **f: append_jsonl(samples, {"type": kind, **base, **f})  # noqa: E731
    emit("block_start", t=None, host="h", pid=0, gpu=None)
    torch.set_num_threads(1)
    run_training_rows({"training": _job_rows(tmp_path, rows)}, emit, op, "cpu")
    emit("block_end", t=None, status="ok", error=None, gpu=None)
    return samples


def _plain_attn(work=1, shift=0.0):
    ns: dict = {}
    exec(PKOP.format(work=work, shift=shift), ns)
    return ns["attn"]


def test_identical_sides_record_equal_first_losses_and_finite_steps(tmp_path):
    attn = _plain_attn()
    samples = _run_rows(tmp_path, "baseline", 0, attn)
    _run_rows(tmp_path, "candidate", 1, attn)
    blocks = load_blocks(samples)
    assert [b.status for b in blocks] == ["ok", "ok"]
    for b in blocks:
        assert set(b.train_rows) == {"dense", "varlen"}
        assert len(b.train_ms["dense"]) == ROW["steps"]  # timed steps only
        assert len(b.train_losses["dense"]) == ROW["warmup_steps"] + ROW["steps"]  # every step's loss
        assert b.train_tokens["varlen"] == 64
        assert b.train_rows["dense"]["peak_bytes"] is None  # no CPU peak
        assert b.train_rows["varlen"]["config"]["context_len"] == 32
    # same seed, same data, same op: the first-step losses agree exactly, on both rows
    for row in ("dense", "varlen"):
        assert blocks[0].train_rows[row]["first_loss"] == blocks[1].train_rows[row]["first_loss"]
    # the first-step loss is ln(vocab) or so at init, and the loss falls on a fixed batch
    first = blocks[0].train_losses["dense"]
    assert abs(first[0] - torch.log(torch.tensor(32.0)).item()) < 0.3
    assert first[-1] < first[0]
    dense = G.worker_series(blocks, lambda w: w.train_ms.get("dense"))
    assert [len(b) for b in dense.per_pair("base")] == [3] and [len(c) for c in dense.per_pair("cand")] == [3]


def test_non_finite_loss_is_a_row_failure(tmp_path):
    samples = _run_rows(tmp_path, "baseline", 0, _plain_attn(shift="float('nan')"), rows=(ROW,))
    [b] = load_blocks(samples)
    assert b.status == "ok" and "dense" not in b.train_rows
    assert b.failures and b.failures[0]["mode"] == "train" and "non-finite loss" in b.failures[0]["error"]


# --- the training gate's first-step loss -----------------------------------------------------

def test_first_step_loss_mismatch_fails_the_training_gate_with_numbers():
    exp = Experiment.model_validate(exp_dict())
    fast = Series.from_blocks([[2.0] * 5] * 3, [[2.0 / 1.3] * 5] * 3)
    same = {"dense": ([3.4] * 3, [3.4] * 3), "varlen": ([3.5] * 3, [3.5] * 3)}
    ev = G.Evidence(training={"dense": fast, "varlen": fast}, training_first_loss=same)
    r = G.evaluate_gate(exp.gates[0], ev, exp=exp)
    assert r.status == "PASS" and r.numbers["first_loss_status"] == "PASS", r.reason
    off = {**same, "varlen": ([3.5] * 3, [3.6] * 3)}
    r = G.evaluate_gate(exp.gates[0], G.Evidence(training={"dense": fast, "varlen": fast}, training_first_loss=off),
                        exp=exp)
    assert r.status == "FAIL" and r.numbers["first_loss_status"] == "FAIL"
    fl = r.numbers["rows"]["varlen"]["first_loss"]
    assert fl["status"] == "FAIL" and fl["rtol"] == 1e-3 and fl["max_rel_diff"] == pytest.approx(0.1 / 3.5)
    assert "varlen: first-step loss baseline 3.5" in r.reason and "3.6" in r.reason
    # missing first-step losses: never PASS
    r = G.evaluate_gate(exp.gates[0], G.Evidence(training={"dense": fast, "varlen": fast}), exp=exp)
    assert r.numbers["first_loss_status"] == "INCONCLUSIVE" and r.status != "PASS"
    # within the row's tolerance
    loose = Experiment.model_validate(exp_dict(training=[ROW, {**VARLEN, "first_loss_rtol": 0.05}]))
    r = G.evaluate_gate(loose.gates[0], G.Evidence(training={"dense": fast, "varlen": fast},
                                                   training_first_loss=off), exp=loose)
    assert r.numbers["first_loss_status"] == "PASS"


def test_training_row_failure_blocks_a_pass():
    exp = Experiment.model_validate(exp_dict())
    fast = Series.from_blocks([[2.0] * 5] * 3, [[2.0 / 1.3] * 5] * 3)
    same = {"dense": ([3.4] * 3, [3.4] * 3), "varlen": ([3.5] * 3, [3.5] * 3)}
    ok = G.evaluate_gate(exp.gates[0], G.Evidence(training={"dense": fast, "varlen": fast},
                                                  training_first_loss=same), exp=exp)
    bad = G.evaluate_gate(exp.gates[0], G.Evidence(
        training={"dense": fast, "varlen": fast}, training_first_loss=same,
        training_failures={"varlen": [{"block": 1, "side": "candidate", "shape": "varlen", "mode": "train",
                                       "error": "FloatingPointError: non-finite loss"}]}), exp=exp)
    assert ok.status == "PASS", ok.reason  # faster is neutral, and 1.3x >= 1.05x
    assert bad.status != "PASS" and "non-finite loss" in bad.reason


# --- end to end ----------------------------------------------------------------------------------

def test_harness_run_with_training_rows_reports_them(temp_repo):
    repo = temp_repo
    # a baseline with the PKDA-signature op, and a candidate doing the same work in a new commit
    repo.baseline_sha = repo.commit_op(4, "baseline: pkop", extra={"pkop.py": PKOP.format(work=1, shift=0.0)})
    repo.branch("same", work=4, message="candidate: pkop, same work", extra={"pkop.py": PKOP.format(work=1, shift=0.0)})
    shutil.copy(LAYER, repo.root / "experiments" / "layer.py")
    shutil.copy(INPUTS, repo.root / "experiments" / "pkda_inputs.py")
    training = "".join(f"  - {json.dumps(r)}\n" for r in (ROW, VARLEN))
    exp = repo.experiment(
        "train-e2e", "same", "- " + json.dumps({**GATE, "neutral_margin": 0.5, "min_best_speedup": 0.5}) + "\n",
        samples=2, shapes="  - {name: op64, B: 1, T: 64, H: 1, K: 64, V: 64}\n",
        extra="training:\n" + training)
    text = exp.read_text().replace("op: op:op", "op: pkop:attn").replace("inputs.py:make_inputs",
                                                                           "pkda_inputs.py:make_inputs")
    exp.write_text(text)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HARNESS_CPU_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "harness", "run", str(exp), "--profile-root", str(repo.root / "profile"),
                          "--reports-root", str(repo.root / "reports")], cwd=repo.root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode in (0, 1, 3), res.stdout + res.stderr
    [report_json] = list((repo.root / "reports" / "train-e2e").glob("*/report.json"))
    report = json.loads(report_json.read_text())
    html = (report_json.parent / "index.html").read_text()
    rows = {t["name"]: t for t in report["training"]}
    assert set(rows) == {"dense", "varlen"}
    for name, t in rows.items():
        # 3 worker pairs x 4 rounds (whole cycles of side orders) x the row's timed steps a burst
        assert t["baseline"]["n"] == 3 * 4 * ROW["steps"] and t["candidate"]["n"] == 3 * 4 * ROW["steps"], name
        assert t["blocks"] == {"baseline": 3, "candidate": 3}
        assert t["speedup"]["point"] is not None and t["speedup"]["lo"] is not None
        assert t["tokens_per_step"] == 64 and t["tokens_per_s"]["baseline"] > 0
        assert t["first_loss"]["status"] == "PASS" and t["first_loss"]["max_abs_diff"] == 0.0
        assert len(t["first_loss"]["baseline"]) == 3 and not t["failures"]
        assert t["config"]["dtype"] == "float32"  # forced on CPU
    assert rows["varlen"]["mode"] == "varlen" and rows["varlen"]["config"]["context_len"] == 32
    gate = next(g for g in report["gates"] if g["kind"] == "training")
    assert gate["numbers"]["first_loss_status"] == "PASS"
    assert set(gate["numbers"]["rows"]) == {"dense", "varlen"}
    assert 'id="training-table"' in html and 'id="training-speedup-table"' in html and "varlen" in html
    assert html.count("ran at B1 T64, 2 layers, hidden 64, 1x64 heads") == 2 * 3  # each row, both tables
