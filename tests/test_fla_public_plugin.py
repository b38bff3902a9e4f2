"""tools/fla_public_plugin.py: the per-test summary, whose allocations count as ours, and (where
an fla bundle and einops are at hand) a real run of fla's test file against our ops."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tool_module import load_tool

ROOT = Path(__file__).resolve().parent.parent
plugin = load_tool("fla_public_plugin")

FILE = "tests/ops/test_precond_kda.py::"


def result(tid, when, outcome, reason="", duration=1.0):
    return {"event": "result", "id": FILE + tid, "when": when, "outcome": outcome,
            "duration": duration, "reason": reason}


def test_summary_outcomes(tmp_path):
    # a collect-only pass lists four tests; two shards report on three of them
    collect = tmp_path / "collect.jsonl"
    collect.write_text(json.dumps({"event": "collected", "ids": [FILE + t for t in ("a", "b", "c", "d")],
                                   "ops": {"m.chunk_precond_kda": "kernels.pkda.op.chunk_precond_kda"},
                                   "poison_ours": True}) + "\n")
    shard = tmp_path / "shard-0.jsonl"
    shard.write_text("\n".join(json.dumps(r) for r in [
        {"event": "collected", "ids": [FILE + "a", FILE + "b"], "ops": {}, "poison_ours": True},
        result("a", "call", "passed", duration=2.5),
        {"event": "warning", "id": FILE + "a", "message": "dA diff: 0.1 ratio: 0.004"},
        result("b", "call", "failed", "AssertionError: dq diff: 0.3 ratio: 0.02"),
        result("c", "call", "passed"),
        result("c", "teardown", "failed", "RuntimeError: CUDA error"),
    ]) + "\n")
    text = plugin.summarise([str(collect), str(shard)])
    lines = text.splitlines()
    assert lines[0] == ("fla public PKDA tests against kernels.pkda: 4 collected; "
                        "1 error, 1 failed, 1 not run, 1 passed")
    assert "m.chunk_precond_kda = kernels.pkda.op.chunk_precond_kda" in lines[2]
    body = "\n".join(lines[4:])
    assert f"passed       2.5 s  {FILE}a\n           warning: dA diff: 0.1 ratio: 0.004" in body
    assert f"failed       1.0 s  {FILE}b\n           AssertionError: dq diff: 0.3 ratio: 0.02" in body
    assert f"error        2.0 s  {FILE}c\n           teardown: RuntimeError: CUDA error" in body
    assert f"not run      0.0 s  {FILE}d" in body


def test_allocations_of_ours_only():
    # a call made from a kernels.pkda module counts as ours; one from a test module stops the
    # walk before any kernels.pkda frame above it; anything else is not ours
    def module(name, src):
        scope = {"__name__": name, "plugin": plugin}
        exec(src, scope)
        return scope
    ours = module("kernels.pkda.probe", "def alloc():\n    return plugin._allocation_in_ours()\n")
    assert ours["alloc"]() is True
    test_mod = module("test_precond_kda", "def run(f):\n    return plugin._allocation_in_ours()\n")
    wrapper = module("kernels.pkda.caller", "def call(g):\n    return g(None)\n")
    assert wrapper["call"](test_mod["run"]) is False
    assert module("fla.ops.x", "def alloc():\n    return plugin._allocation_in_ours()\n")["alloc"]() is False


FLA_BUNDLE = ROOT.parent / "shared" / "data" / "fla-seed-27967b97.bundle"


@pytest.mark.slow
@pytest.mark.skipif(not FLA_BUNDLE.exists() or importlib.util.find_spec("einops") is None,
                    reason="needs ../shared/data/fla-seed-27967b97.bundle and einops (fla's dependency)")
def test_fla_test_file_runs_against_ours(tmp_path):
    fla = tmp_path / "fla"
    subprocess.run(["git", "clone", "-q", "-b", "seed-baseline", str(FLA_BUNDLE), str(fla)], check=True)
    report = tmp_path / "r.jsonl"
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(fla), str(ROOT), str(ROOT / "tools"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/ops/test_precond_kda.py", "-p", "fla_public_plugin",
                           "--fla-device-cpu", "--fla-report", str(report), "-q", "-p", "no:cacheprovider",
                           "-k", "test_fused_recurrent and B1-T64"], cwd=fla, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = plugin.summarise([str(report)])
    assert text.splitlines()[0] == "fla public PKDA tests against kernels.pkda: 2 collected; 2 passed"
    assert "test_precond_kda.fused_recurrent_precond_kda = kernels.pkda.recurrent.fused_recurrent_precond_kda" in text
    assert "test_precond_kda.naive_recurrent_precond_kda = fla.ops.precond_kda.naive.naive_recurrent_precond_kda" in text
    assert "NaN poisoning extended to kernels.pkda: [True]" in text
