"""Profile first (harness/profile.py): stage attribution of the baseline and the Amdahl pre-gate, on
CPU, with a synthetic op whose stages have known costs, in a real temporary git repository.

The op runs `record_function("stage_a")` around three matmuls and "stage_b" around one matmul of
the same size, forward and backward, plus one more matmul in "other_work" that no stage claims:
stage_a should cost about three times stage_b, and the unclaimed work must show up as unassigned.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import git
import pytest

from harness import profile as P
from harness.profile_worker import OverlapError, attribute, run_profile
from harness.spec import AmdahlGate, load_experiment

ROOT = Path(__file__).resolve().parent.parent
# timing: the module's CPU profile (stage and endpoint times, shares, bounds) must be consistent;
# ci/test.sh runs it alone, after the parallel rest (another worker's load put a stage's wall time
# above its endpoint's, 2026-12-07)
pytestmark = pytest.mark.timing
N = 384  # rows and width of every matmul

STAGE_OP = '''\
import torch
from torch.profiler import record_function

A_MATMULS = {a}


class _Staged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        with record_function("stage_a"):
            a = x
            for _ in range(A_MATMULS):
                a = a @ w
        with record_function("stage_b"):
            b = x @ w
        with record_function("other_work"):
            c = x @ w
        ctx.save_for_backward(w)
        return a + b + c

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        wt = w.t().contiguous()
        with record_function("stage_a"):
            ga = g
            for _ in range(A_MATMULS):
                ga = ga @ wt
        with record_function("stage_b"):
            gb = g @ wt
        with record_function("other_work"):
            gc = g @ wt
        return ga + gb + gc, None


def op(x, w):
    return _Staged.apply(x, w)
'''

INPUTS = '''\
import torch


def make_inputs(shape, mode, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    rows, d = shape["B"] * shape["T"], shape["K"]
    x = torch.randn(rows, d, generator=g, dtype=dtype).to(device).requires_grad_(mode == "fwdbwd")
    w = (torch.randn(d, d, generator=g, dtype=dtype) / d ** 0.5).to(device)
    return {"args": (), "kwargs": {"x": x, "w": w}, "grad_inputs": ["x"] if mode == "fwdbwd" else []}
'''

# 4 bytes x tokens x K x 8: 4.5 MiB a pass at N=384, written once and read once
REMOVABLE = "{name: scratch, bytes: '4*tokens*K*8', passes: 2}"


class StageRepo:
    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True)
        self.repo = git.Repo.init(root, initial_branch="main")
        with self.repo.config_writer() as cw:
            cw.set_value("user", "name", "test")
            cw.set_value("user", "email", "test@example.invalid")
        (root / ".gitignore").write_text("profile/\nexperiments/\n")
        self.baseline_sha = self._commit(a=3, message="baseline: stage_a = 3 matmuls")
        # a candidate with a different stage_a: the profile must never measure it
        self.repo.git.checkout("-b", "cand")
        self._commit(a=1, message="candidate: stage_a = 1 matmul")
        self.repo.git.checkout("main")
        (root / "experiments").mkdir()
        (root / "experiments" / "inputs.py").write_text(INPUTS)

    def _commit(self, a: int, message: str) -> str:
        (self.root / "stageop.py").write_text(STAGE_OP.format(a=a))
        self.repo.index.add(["stageop.py", ".gitignore"])
        return self.repo.index.commit(message).hexsha

    def experiment(self, name: str, stages: str, gate: str, removable: str = REMOVABLE, iters: int = 7) -> Path:
        text = textwrap.dedent(f"""\
            name: {name}
            target:
              op: stageop:op
              inputs: inputs.py:make_inputs
            baseline:
              ref: {self.baseline_sha}
            candidate:
              ref: cand
            modes: [fwdbwd]
            dtype: float32
            warmup: 2
            shapes:
              - {{name: small, B: 1, T: {N}, H: 1, K: {N}, V: {N}}}
            """) + "stages:\n" + textwrap.indent(textwrap.dedent(stages), "  ") + textwrap.dedent(f"""\
            profile:
              rows: [small]
              iters: {iters}
              removable: [{removable}]
            gates:
              - {gate}
            """)
        path = self.root / "experiments" / f"{name}.yaml"
        path.write_text(text)
        return path


STAGES_AB = """\
stage_a: {baseline: ['^stage_a$'], candidate: ['^stage_a$']}
stage_b: {baseline: ['^stage_b$'], candidate: ['^stage_b$']}
"""
LOW_GATE = "{kind: amdahl, name: pre, stage: stage_a, row: small, min_share: 0.05, min_bound: 1.0001, denominator: device}"


def harness(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HARNESS_CPU_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "harness", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """One real `harness profile` run of the baseline: (repo, experiment path, record, CLI result)."""
    repo = StageRepo(tmp_path_factory.mktemp("profile") / "repo")
    exp = repo.experiment("staged", STAGES_AB, LOW_GATE)
    res = harness("profile", exp, "--profile-root", repo.root / "profile", "--cpu", cwd=repo.root)
    [path] = list((repo.root / "profile" / "staged" / "profile").glob("*/profile.json"))
    return repo, exp, json.loads(path.read_text()), res


def _row(record: dict, name: str = "small/fwdbwd") -> dict:
    return next(r for r in record["rows"] if r["row"] == name)


def test_cli_writes_the_record_prints_the_table_and_passes(measured):
    repo, _, record, res = measured
    assert res.returncode == 0, res.stdout + res.stderr
    assert "stage_a" in res.stdout and "amdahl pre-gate" in res.stdout and "PASS" in res.stdout
    assert record["gate"]["status"] == "PASS" and not record["errors"]
    # the untouched baseline, from its own worktree, not the candidate branch
    assert record["sha"] == repo.baseline_sha
    assert Path(record["op_file"]).resolve().is_relative_to(Path(record["worktree"]).resolve())
    assert [r["row"] for r in record["rows"]] == ["small/fwdbwd"]


def test_stage_shares_follow_the_work(measured):
    _, _, record, _ = measured
    row = _row(record)
    a, b = row["stages"]["stage_a"], row["stages"]["stage_b"]
    assert a["kernels"] > 0 and b["kernels"] > 0
    for d in ("wall", "device"):  # 6 matmuls against 2, under both denominators
        ratio = a[f"share_{d}"] / b[f"share_{d}"]
        assert 1.7 < ratio < 5.5, (d, ratio, row["stages"])  # 3x the work; CPU timing under CI load is loose
    assert 0.45 < a["share_device"] < 0.8, row["stages"]
    # the device denominator is the sum of every kernel: stages + unassigned account for it, call by
    # call, so exactly in means (the medians, device_total_ms and a stage's ms, need not add up: one
    # slow CPU call parted them by 17%); a kernel's ms is its mean over the calls
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    mean_total = mean(row["device_total_samples_ms"])
    unassigned = sum(k["ms"] for k in row["unassigned"])
    assert mean(a["samples_ms"]) + mean(b["samples_ms"]) + unassigned == pytest.approx(mean_total, rel=1e-6)
    assert sum(k["ms"] for k in row["kernels"]) == pytest.approx(mean_total, rel=1e-6)
    assert set(row["stage_share_device"]) == {"stage_a", "stage_b", "unassigned"}
    assert set(row["stage_share_wall"]) == {"stage_a", "stage_b", "unassigned", "host/gaps"}


def test_unassigned_work_is_listed_not_dropped(measured):
    _, _, record, _ = measured
    row = _row(record)
    names = {k["name"] for k in row["unassigned"]}
    assert "other_work" in names  # the range no stage claims
    other = [k for k in row["kernels"] if k["stage"] is None]
    assert {k["name"] for k in other} == names
    # the matmuls inside other_work are unassigned too (their innermost matching name is none)
    assert row["unassigned_ms"] > 0.5 * row["stages"]["stage_b"]["ms"], (row["unassigned_ms"], row["stages"])
    # aten::mm runs in every stage: listed once per stage it ran in, with launches per call
    mm = [k for k in row["kernels"] if k["name"] == "aten::mm"]
    assert {k["stage"] for k in mm} == {"stage_a", "stage_b", None}
    assert next(k for k in mm if k["stage"] == "stage_a")["launches"] == pytest.approx(6)
    assert next(k for k in mm if k["stage"] == "stage_b")["launches"] == pytest.approx(2)


def test_removable_traffic_and_bounds(measured):
    _, _, record, _ = measured
    row = _row(record)
    bw = record["copy_bandwidth"]["bytes_per_s"]
    assert bw > 1e8
    [rem] = row["removable"]
    assert rem["bytes_per_pass"] == 4 * N * N * 8 and rem["bytes"] == 2 * 4 * N * N * 8
    assert rem["floor_ms"] == pytest.approx(rem["bytes"] / bw * 1e3)
    g = record["gate"]["numbers"]
    assert g["denominator"] == "device" and g["other_denominator"] == "wall"
    removed = min(rem["floor_ms"], g["stage_ms"])
    for d, T in (("wall", row["endpoint_ms"]), ("device", row["device_total_ms"])):
        assert g[f"share_{d}"] == pytest.approx(g["stage_ms"] / T)
        assert g[f"bound_removable_{d}"] == pytest.approx(T / (T - removed))
        assert g[f"bound_stage_{d}"] == pytest.approx(T / (T - g["stage_ms"]))
        assert g[f"bound_stage_{d}"] >= g[f"bound_removable_{d}"] > 1
    assert g["share"] == g["share_device"] and g["bound"] == g["bound_removable_device"]
    assert "device" in record["gate"]["reason"] and "wall" in record["gate"]["reason"]


def _gate(share: float, bound: float, denominator: str = "device") -> AmdahlGate:
    return AmdahlGate(kind="amdahl", name="g", stage="stage_a", row="small", min_share=share, min_bound=bound,
                      denominator=denominator)


def test_gate_passes_and_fails_either_side_of_the_measured_share(measured):
    _, _, record, _ = measured
    row = _row(record)
    n = record["gate"]["numbers"]
    for d in ("device", "wall"):
        share, bound = n[f"share_{d}"], n[f"bound_removable_{d}"]
        ok_bound = 1 + (bound - 1) / 2
        assert P.amdahl_verdict(_gate(share * 0.9, ok_bound, d), row, True)["status"] == "PASS"
        low = P.amdahl_verdict(_gate(min(0.99, share * 1.1), ok_bound, d), row, True)
        assert low["status"] == "FAIL" and "share" in low["reason"] and "terminal NO-GO" in low["reason"]
        # the share suffices but the removable part cannot buy the bound
        assert P.amdahl_verdict(_gate(share * 0.9, 1 + (bound - 1) * 2, d), row, True)["status"] == "FAIL"
    # which denominator decides: a threshold between the two shares passes one and fails the other
    sw, sd = n["share_wall"], n["share_device"]
    if abs(sw - sd) > 0.02:
        mid = (sw + sd) / 2
        hi_d, lo_d = ("device", "wall") if sd > sw else ("wall", "device")
        assert P.amdahl_verdict(_gate(mid, 1.0001, hi_d), row, True)["status"] == "PASS"
        assert P.amdahl_verdict(_gate(mid, 1.0001, lo_d), row, True)["status"] == "FAIL"
    # without a declared removable part the whole stage's (looser) bound is gated
    whole = P.amdahl_verdict(_gate(0.05, n["bound_stage_device"] * 0.99), row, False)
    assert whole["status"] == "PASS" and whole["numbers"]["bound_kind"] == "whole stage"
    assert P.exit_code({"errors": [], "gate": {"status": "FAIL"}}) == 1


def test_stage_that_matches_nothing_is_an_error_naming_it(measured):
    """The worker's real attribution, run in this process (a second CLI run would cost a minute of
    imports on a loaded CPU) on the baseline worktree the CLI made, with one stage nothing runs."""
    repo, _, record, _ = measured
    exp = repo.experiment("ghost", STAGES_AB + "ghost_stage: {baseline: ['^never_runs$'], candidate: ['x']}\n",
                          LOW_GATE, iters=1)
    loaded = load_experiment(exp)
    job = P.build_job(loaded, record["worktree"], repo.root / "unused.json", cpu_mode=True)
    saved_path = list(sys.path)
    try:
        raw = run_profile({**job, "warmup": 1})
    finally:
        sys.path[:] = saved_path
        sys.modules.pop("stageop", None)
    rec = P.build_record(loaded, raw, cpu_mode=True)
    [err] = rec["errors"]
    assert err["kind"] == "stage_unmatched" and err["stage"] == "ghost_stage"
    assert rec["gate"]["status"] is None and "ghost_stage" in rec["gate"]["reason"]
    assert rec["stage_visible"] == {"stage_a": True, "stage_b": True, "ghost_stage": False}
    assert P.exit_code(rec) == 2


def test_a_kernel_matching_two_stages_is_an_error_naming_both():
    patterns = {"first": ["^stage_"], "second": ["_a$"], "third": ["^zzz$"]}
    with pytest.raises(OverlapError) as e:
        attribute(["aten::mm", "stage_a"], patterns)
    assert "first" in str(e.value) and "second" in str(e.value) and "third" not in str(e.value)
    # the innermost matching name decides: a kernel named for one stage inside another's range
    assert attribute(["zzz", "stage_a"], patterns) == "third"
    assert attribute(["aten::mm", "outer"], patterns) is None


def _raw(stage_kernels: dict[str, float], unassigned: float, wall: float = 10.0) -> dict:
    kernels = [{"name": f"k_{s}", "stage": s, "ms": ms, "launches": 1.0} for s, ms in stage_kernels.items() if ms]
    kernels.append({"name": "k_other", "stage": None, "ms": unassigned, "launches": 1.0})
    dev = sum(stage_kernels.values()) + unassigned
    return {"rows": [{"shape": "small", "mode": "fwdbwd", "shape_dims": {"name": "small", "B": 1, "T": N, "H": 1,
                                                                       "K": N, "V": N},
                      "endpoint_samples_ms": [wall], "device_total_samples_ms": [dev],
                      "stage_samples_ms": {s: [ms] for s, ms in stage_kernels.items()},
                      "unassigned_samples_ms": [unassigned], "kernels": kernels}],
            "errors": [], "copy_bandwidth": {"bytes_per_s": 1e12}}


def test_wall_and_device_denominators_decide_differently(measured):
    """The H200 situation: a stage 28.6% of device time is 19.2% of the wall-clock endpoint."""
    _, exp, _, _ = measured
    loaded = load_experiment(exp)
    raw = _raw({"stage_a": 0.978, "stage_b": 0.5}, unassigned=3.418 - 0.978 - 0.5, wall=5.093)
    for denominator, status in (("device", "PASS"), ("wall", "FAIL")):
        v = P.amdahl_verdict(_gate(0.20, 1.0001, denominator), P.build_record(loaded, raw, False)["rows"][0], True)
        assert v["status"] == status, v
        assert v["numbers"]["share_device"] == pytest.approx(0.978 / 3.418)
        assert v["numbers"]["share_wall"] == pytest.approx(0.978 / 5.093)


def test_stages_invisible_on_cpu_leave_the_gate_undecided(measured):
    _, exp, _, _ = measured
    loaded = load_experiment(exp)
    raw = _raw({"stage_a": 0.0, "stage_b": 0.0}, unassigned=2.0)
    cpu = P.build_record(loaded, raw, cpu_mode=True)
    assert not cpu["errors"] and cpu["notes"] and cpu["gate"]["status"] is None
    assert P.exit_code(cpu) == 3
    gpu = P.build_record(loaded, raw, cpu_mode=False)  # on GPU the same is an error per stage
    assert {e["stage"] for e in gpu["errors"]} == {"stage_a", "stage_b"} and P.exit_code(gpu) == 2
    json.dumps(gpu, allow_nan=False)


def test_unbounded_and_bad_removable_expressions(measured):
    _, exp, _, _ = measured
    loaded = load_experiment(exp)
    row = P.build_record(loaded, _raw({"stage_a": 5.0, "stage_b": 1.0}, 0.0, wall=6.0), False)["rows"][0]
    v = P.amdahl_verdict(_gate(0.5, 2.0), {**row, "removable_floor_ms": 1e6}, True)  # floor > everything
    assert v["numbers"]["removable_capped_at_stage"] is True and v["status"] == "PASS"
    assert math.isclose(v["numbers"]["bound"], 6.0 / 1.0)
    v = P.amdahl_verdict(_gate(0.5, 2.0), {**row, "stages": {**row["stages"], "stage_a": {**row["stages"]["stage_a"],
                                                                                          "ms": 6.0}}}, False)
    assert v["numbers"]["bound"] is None and v["numbers"]["bound_unbounded"] is True and v["status"] == "PASS"
    json.dumps(v, allow_nan=False)


def test_a_rerendered_run_keeps_its_failed_pregate_as_terminal():
    """`harness report` re-renders from records: a run that failed its pre-gate (and measured
    anyway) must stay NO-GO with the same reason the run itself gave, not just its FAIL gates."""
    from harness.analyse import _terminal_reason
    from harness.profile import pregate_terminal

    failed = {"gate": {"status": "FAIL", "reason": "bound 1.003x < 1.1x"}}
    assert pregate_terminal(failed, cpu_mode=False) == "Amdahl pre-gate failed: bound 1.003x < 1.1x"
    assert pregate_terminal(failed, cpu_mode=True) is None  # CPU timings decide nothing
    assert pregate_terminal({"gate": {"status": "PASS"}}, cpu_mode=False) is None
    assert pregate_terminal(None, cpu_mode=False) is None
    run = {"run_id": "r", "cpu_mode": False, "revisions": {"baseline": {"sha": "a" * 40}}}
    assert _terminal_reason({"profile": failed}, [], {}, run, None) == pregate_terminal(failed, False)
    assert _terminal_reason({"profile": failed}, [], {}, {**run, "cpu_mode": True}, None) is None
