"""harness/gates.py: each gate reaching PASS / FAIL / INCONCLUSIVE on constructed blocks, the verdict,
and evidence built from block records."""
import numpy as np
import pytest

from harness import records
from harness.gates import (Evidence, ExprError, GateResult, PhaseVerdict, RowEvidence, eval_bytes_expr,
                           evaluate_gate, evaluate_gates, evidence_from_blocks, shape_dims, verdict)
from harness.records import Block
from harness.spec import Experiment
from harness.stats import Series

SHAPES = [
    {"name": "dense", "B": 2, "T": 130, "H": 4, "K": 128, "V": 64},
    {"name": "ragged", "seqlens": [100, 28, 64], "H": 4, "K": 64, "V": 64},
]


def make_exp(gates, modes=("fwdbwd",), **extra):
    data = {
        "name": "t", "target": {"op": "pkg.mod:fn", "inputs": "inputs.py:make"},
        "baseline": {"ref": "abcdef1"}, "candidate": {"ref": "cand"},
        "modes": list(modes), "shapes": SHAPES, "gates": gates, **extra,
    }
    return Experiment.model_validate(data)


def paired(ratios, base_ms=2.0, n=10):
    """Baseline blocks of constant time; candidate block i is baseline / ratios[i] (speedup ratios[i])."""
    base = [[base_ms] * n for _ in ratios]
    cand = [[base_ms / r] * n for r in ratios]
    return base, cand


def ev_with(rows=None, **kw):
    return Evidence(rows={k: RowEvidence.from_blocks(b, c) for k, (b, c) in (rows or {}).items()}, **kw)


def one(gate_dict, ev, **extra):
    exp = make_exp([gate_dict], **extra)
    return evaluate_gate(exp.gates[0], ev, exp=exp)


# --- speedup -----------------------------------------------------------------------------------

SPREAD = [1.8, 2.0, 2.2, 1.9, 2.1]  # per-pair speedups: interval roughly [1.88, 2.12]


@pytest.mark.parametrize("threshold,status", [(1.5, "PASS"), (2.0, "INCONCLUSIVE"), (2.5, "FAIL")])
def test_speedup_gate(threshold, status):
    ev = ev_with({("dense", "fwdbwd"): paired(SPREAD)})
    r = one({"name": "g", "kind": "speedup", "row": "dense", "threshold": threshold}, ev)
    assert r.status == status, r.reason
    assert r.numbers["threshold"] == threshold
    assert r.numbers["lo"] < 2.0 < r.numbers["hi"]
    assert r.numbers["n_base_blocks"] == 5 and r.numbers["n_cand_blocks"] == 5
    assert r.rows == ["dense/fwdbwd"]


def test_stage_speedup_reads_stage_samples():
    ev = ev_with({("dense", "fwdbwd"): paired([1.0] * 5)})
    ev.stages[("dense", "fwdbwd", "intra")] = Series.from_blocks(*paired([3.0] * 5))
    exp = make_exp([{"name": "s", "kind": "speedup", "row": "dense", "stage": "intra", "threshold": 2.5}],
                   stages={"intra": {"baseline": ["a"], "candidate": ["b"]}})
    r = evaluate_gate(exp.gates[0], ev, exp=exp)
    assert r.status == "PASS" and r.numbers["point"] == pytest.approx(3.0)
    del ev.stages[("dense", "fwdbwd", "intra")]
    assert evaluate_gate(exp.gates[0], ev, exp=exp).status == "INCONCLUSIVE"


def test_missing_row_or_side_is_inconclusive_not_pass():
    gate = {"name": "g", "kind": "speedup", "row": "dense", "threshold": 0.1}
    r = one(gate, ev_with({}))
    assert r.status == "INCONCLUSIVE" and "dense/fwdbwd" in r.reason
    base, _ = paired([3.0] * 5)
    r = one(gate, ev_with({("dense", "fwdbwd"): (base, [])}))
    assert r.status == "INCONCLUSIVE" and "dense/fwdbwd" in r.reason and "candidate" in r.reason


def test_row_with_a_failed_block_cannot_pass():
    ev = ev_with({("dense", "fwdbwd"): paired([3.0] * 4)})
    ev.rows[("dense", "fwdbwd")].failures.append({"block": 3, "side": "candidate", "error": "OOM"})
    r = one({"name": "g", "kind": "speedup", "row": "dense", "threshold": 1.0}, ev)
    assert r.status == "INCONCLUSIVE" and "OOM" in r.reason
    r = one({"name": "g", "kind": "speedup", "row": "dense", "threshold": 5.0}, ev)
    assert r.status == "FAIL"  # clear evidence against still fails
    assert "first in block 3 (candidate)" in r.reason


def test_a_lockstep_failure_names_the_worker_and_its_pair():
    ev = ev_with({("dense", "fwdbwd"): paired([3.0] * 4)})
    ev.rows[("dense", "fwdbwd")].failures.append({"block": 6, "pair": 2, "side": "candidate", "shape": "dense",
                                                   "mode": "fwdbwd", "error": "OutOfMemoryError"})
    r = one({"name": "g", "kind": "speedup", "row": "dense", "threshold": 1.0}, ev)
    assert "first in worker 6 of pair 2 (dense/fwdbwd, candidate): OutOfMemoryError" in r.reason


def test_one_block_pair_is_inconclusive():
    ev = ev_with({("dense", "fwdbwd"): paired([3.0])})
    r = one({"name": "g", "kind": "speedup", "row": "dense", "threshold": 1.0}, ev)
    assert r.status == "INCONCLUSIVE" and r.numbers["lo"] is None and r.numbers["point"] == pytest.approx(3.0)


# --- geomean -----------------------------------------------------------------------------------

@pytest.mark.parametrize("threshold,status", [(3.5, "PASS"), (4.0, "INCONCLUSIVE"), (4.5, "FAIL")])
def test_geomean_gate(threshold, status):
    ev = ev_with({("dense", "fwdbwd"): paired([r * 2 for r in [0.9, 1.0, 1.1, 0.95, 1.05]]),
                  ("ragged", "fwdbwd"): paired([8.0] * 5)})
    r = one({"name": "g", "kind": "geomean", "rows": ["dense", "ragged"], "threshold": threshold}, ev)
    assert r.status == status, r.reason
    # the geometric mean over rows of each row's geometric mean over pairs
    dense = np.exp(np.mean(np.log([r * 2 for r in [0.9, 1.0, 1.1, 0.95, 1.05]])))
    assert r.numbers["point"] == pytest.approx(np.sqrt(dense * 8.0))
    assert r.numbers["rows"]["ragged/fwdbwd"]["point"] == pytest.approx(8.0)


def test_geomean_missing_row_inconclusive():
    ev = ev_with({("dense", "fwdbwd"): paired([9.0] * 5)})
    r = one({"name": "g", "kind": "geomean", "rows": ["dense", "ragged"], "threshold": 1.0}, ev)
    assert r.status == "INCONCLUSIVE" and "ragged/fwdbwd" in r.reason


# --- non-regression ----------------------------------------------------------------------------

NR = {"name": "nr", "kind": "non_regression", "rows": ["dense"], "modes": ["fwdbwd"], "margin": 0.02}


def slowdowns(ratios):
    """Candidate time / baseline time per pair."""
    return paired([1 / r for r in ratios])


@pytest.mark.parametrize("ratios,status", [
    ([0.99, 1.0, 1.01, 1.0, 0.995], "PASS"),
    ([0.98, 1.0, 1.04, 1.01, 1.03], "INCONCLUSIVE"),
    ([1.09, 1.10, 1.11, 1.10, 1.10], "FAIL"),
])
def test_non_regression_gate(ratios, status):
    r = one(NR, ev_with({("dense", "fwdbwd"): slowdowns(ratios)}))
    assert r.status == status, r.reason
    row = r.numbers["rows"]["dense/fwdbwd"]
    assert row["lo"] <= row["point"] <= row["hi"] and r.numbers["limit"] == pytest.approx(1.02)


def test_non_regression_noise_floor_rule():
    rows = {("dense", "fwdbwd"): slowdowns([0.99, 1.0, 1.01, 1.0, 0.995])}
    # no A/A control and no A/A run: the baseline's own spread between pairs (0 here) is the floor
    spread = one(NR, ev_with(rows))
    assert spread.status == "PASS", spread.reason
    assert "spread between worker pairs" in spread.numbers["rows"]["dense/fwdbwd"]["noise_source"]
    quiet = one(NR, ev_with(rows, aa_noise=0.005))
    assert quiet.status == "PASS" and quiet.numbers["rows"]["dense/fwdbwd"]["noise"] == 0.005
    noisy = one(NR, ev_with(rows, aa_noise=0.05))
    assert noisy.status == "INCONCLUSIVE" and "not below the margin" in noisy.reason
    # a regression whose whole interval is beyond the margin and that noise still fails
    bad = one(NR, ev_with({("dense", "fwdbwd"): slowdowns([1.2] * 5)}, aa_noise=0.05))
    assert bad.status == "FAIL"


def test_non_regression_passes_only_when_the_aa_control_resolves_the_margin():
    """The lockstep engine's A/A control (the baseline twin in every round): PASS needs its interval's
    largest deviation from 1.0 below the margin; a regression must also exceed it to FAIL."""
    from harness.stats import Round

    def row(slowdown, control_offsets):
        series = Series()
        for pair, off in enumerate(control_offsets):
            for r in range(4):
                base = [1.0 + 0.001 * r] * 3
                series.add(pair, Round(base, [x * slowdown for x in base], [x * off for x in base]))
        return Evidence(rows={("dense", "fwdbwd"): RowEvidence({"graph": series}, primary="graph")})

    tight = one(NR, row(1.0, [1.001, 0.999, 1.0]))
    assert tight.status == "PASS", tight.reason
    assert "A/A control" in tight.numbers["rows"]["dense/fwdbwd"]["noise_source"]
    loose = one(NR, row(1.0, [1.03, 0.97, 1.05]))  # identical code lands up to 5% apart: 2% is unresolved
    assert loose.status == "INCONCLUSIVE" and "not below the margin" in loose.reason
    assert one(NR, row(1.10, [1.001, 0.999, 1.0])).status == "FAIL"
    assert one(NR, row(1.03, [1.03, 0.97, 1.05])).status == "INCONCLUSIVE"  # beyond margin, not beyond noise


def test_non_regression_all_rows_and_only_measured_modes():
    gate = {"name": "nr", "kind": "non_regression", "margin": 0.02}  # rows all, modes fwd+fwdbwd
    good = slowdowns([1.0] * 5)
    r = one(gate, ev_with({("dense", "fwdbwd"): good, ("ragged", "fwdbwd"): good}))
    assert r.status == "PASS" and r.rows == ["dense/fwdbwd", "ragged/fwdbwd"]
    assert r.numbers["modes_not_measured"] == ["fwd"]
    r = one(gate, ev_with({("dense", "fwdbwd"): good}))
    assert r.status == "INCONCLUSIVE" and "ragged/fwdbwd" in r.reason
    r = one(gate, ev_with({("dense", "fwdbwd"): good, ("ragged", "fwdbwd"): slowdowns([1.5] * 5)}))
    assert r.status == "FAIL" and "ragged/fwdbwd" in r.reason


# --- peak allocation ---------------------------------------------------------------------------

def test_shape_dims_dense_and_varlen():
    exp = make_exp([NR])
    assert shape_dims(exp.shape("dense")) == {"B": 2, "T": 130, "H": 4, "K": 128, "V": 64, "tokens": 260,
                                              "NK": 2, "NT": 3}
    # varlen: packed into B=1; NT counts chunks per sequence: 2 + 1 + 1
    assert shape_dims(exp.shape("ragged")) == {"B": 1, "T": 192, "H": 4, "K": 64, "V": 64, "tokens": 192,
                                               "NK": 1, "NT": 4}


def test_bytes_expression_evaluation():
    dims = {"B": 2, "T": 130, "H": 4, "K": 128, "V": 64, "tokens": 260, "NK": 2, "NT": 3}
    assert eval_bytes_expr("4*tokens*H*64", dims) == 4 * 260 * 4 * 64
    assert eval_bytes_expr("B*NT*H*(K+V)/2 - 1", dims) == 2 * 3 * 4 * 192 / 2 - 1
    assert eval_bytes_expr("-NK + 1.5e3", dims) == 1498.0


@pytest.mark.parametrize("bad", ["__import__('os')", "__import__(os).getcwd()", "2**10", "x + 1",
                                 "B.__class__", "[1, 2]", "K if B else V", "T // 2", "open(T)", "1 +", "B / 0"])
def test_bytes_expression_rejects_anything_else(bad):
    with pytest.raises(ExprError):
        eval_bytes_expr(bad, {"B": 2, "T": 130, "H": 4, "K": 128, "V": 64, "tokens": 260, "NK": 2, "NT": 3})


PEAK = {"name": "p", "kind": "peak_alloc", "rows": ["dense", "ragged"], "min_reduction_bytes": "4*tokens*H*64"}


def peak_ev(dense=(1_000_000, 600_000), ragged=(1_000_000, 700_000)):
    ev = ev_with({("dense", "fwdbwd"): paired([1.0] * 3), ("ragged", "fwdbwd"): paired([1.0] * 3)})
    for key, (b, c) in ((("dense", "fwdbwd"), dense), (("ragged", "fwdbwd"), ragged)):
        ev.rows[key].base_peak, ev.rows[key].cand_peak = b, c
    return ev


def test_peak_alloc_pass_fail_inconclusive():
    # required: dense 4*260*4*64 = 266240 B, ragged 4*192*4*64 = 196608 B
    r = one(PEAK, peak_ev())
    assert r.status == "PASS", r.reason
    assert r.numbers["rows"]["dense/fwdbwd"]["min_reduction_bytes"] == 266240
    assert r.numbers["rows"]["ragged/fwdbwd"]["reduction"] == 300_000
    assert one(PEAK, peak_ev(dense=(1_000_000, 900_000))).status == "FAIL"
    # exactly the required reduction passes (>=)
    assert one(PEAK, peak_ev(ragged=(1_000_000, 1_000_000 - 196608))).status == "PASS"
    r = one(PEAK, peak_ev(ragged=(1_000_000, None)))
    assert r.status == "INCONCLUSIVE" and "ragged/fwdbwd" in r.reason
    r = one(PEAK, Evidence())  # a CPU run: no peaks at all
    assert r.status == "INCONCLUSIVE"


def test_peak_alloc_with_a_forbidden_expression_is_never_pass():
    bad = "__import__(os).getcwd()"
    with pytest.raises(Exception, match="Call is not allowed"):  # the schema refuses it at load
        make_exp([dict(PEAK, min_reduction_bytes=bad)])
    # and should a gate object carry it anyway, the evaluator still never runs it
    exp = make_exp([PEAK])
    gate = exp.gates[0].model_copy(update={"min_reduction_bytes": bad})
    r = evaluate_gate(gate, peak_ev(), exp=exp)
    assert r.status == "INCONCLUSIVE" and "not allowed" in r.reason


# --- evidence gates ----------------------------------------------------------------------------

PHASE_GATES = {
    "correctness": ({"name": "c", "kind": "correctness"},
                    {"fixtures": {"reference": "ref.mod:fn", "cases": ["fx"], "rtol": 1e-3, "atol": 1e-4},
                     "fixture_shapes": [{"name": "fx", "B": 1, "T": 64, "H": 1, "K": 64, "V": 64}]}),
    "frozen_paths": ({"name": "f", "kind": "frozen_paths"}, {}),
    "amdahl": ({"name": "a", "kind": "amdahl", "stage": "intra", "row": "dense", "min_share": 0.3, "min_bound": 1.2},
               {"profile": {"rows": ["dense"]}, "stages": {"intra": {"baseline": ["a"], "candidate": ["b"]}}}),
    "ncu": ({"name": "n", "kind": "ncu", "row": "dense",
             "expect": [{"stage": "intra", "metric": "dram__bytes", "relation": "lower_by_at_least", "value": 0.2}]},
            {"stages": {"intra": {"baseline": ["a"], "candidate": ["b"]}}}),
}


@pytest.mark.parametrize("kind", sorted(PHASE_GATES))
def test_evidence_gates_follow_their_phase(kind):
    gate, extra = PHASE_GATES[kind]
    r = one(gate, Evidence(phases={kind: PhaseVerdict("PASS", "all good", {"max_err": 1e-6})}), **extra)
    assert (r.status, r.reason, r.numbers) == ("PASS", "all good", {"max_err": 1e-6})
    r = one(gate, Evidence(phases={kind: PhaseVerdict("FAIL", "mismatch", {})}), **extra)
    assert r.status == "FAIL" and r.reason == "mismatch"
    r = one(gate, Evidence(phases={kind: PhaseVerdict(None, "no GPU", {})}), **extra)
    assert r.status == "INCONCLUSIVE" and "no GPU" in r.reason
    r = one(gate, Evidence(), **extra)
    assert r.status == "INCONCLUSIVE" and "missing" in r.reason


def test_phase_verdict_from_record():
    pv = PhaseVerdict.from_json({"status": "FAIL", "reason": "r", "numbers": {"x": 1}})
    assert (pv.status, pv.reason, pv.numbers) == ("FAIL", "r", {"x": 1})
    assert PhaseVerdict.from_json(None) is None


# --- training ----------------------------------------------------------------------------------

TRAIN = {"name": "tr", "kind": "training", "rows": ["step_small", "step_big"], "neutral_margin": 0.02,
         "min_best_speedup": 1.2}
# the training rows the gate names must be declared (spec cross-reference)
TRAIN_ROWS = [{"name": n, "model": "layer.py:build_model", "hidden": 64, "heads": 1, "head_dim": 64, "vocab": 32,
               "B": 1, "T": 64} for n in ("step_small", "step_big")]
SAME_FIRST = {"step_small": ([2.5] * 5, [2.5] * 5), "step_big": ([3.1] * 5, [3.1] * 5)}


def train_ev(training, first=SAME_FIRST, **kw):
    return Evidence(training={k: Series.from_blocks(*v) for k, v in training.items()}, training_first_loss=first, **kw)


def test_training_gate():
    neutral, fast = paired([1.0, 1.005, 0.999, 1.0, 1.0]), paired([1.3, 1.32, 1.31, 1.29, 1.3])
    r = one(TRAIN, train_ev({"step_small": neutral, "step_big": fast}), training=TRAIN_ROWS)
    assert r.status == "PASS", r.reason
    assert r.numbers["rows"]["step_big"]["speedup_lo"] >= 1.2
    # nothing reaches the best speedup: every upper bound below 1.2
    r = one(TRAIN, train_ev({"step_small": neutral, "step_big": paired([1.05] * 5)}), training=TRAIN_ROWS)
    assert r.status == "FAIL" and r.numbers["best_speedup_status"] == "FAIL"
    # a row regresses beyond the neutral margin
    r = one(TRAIN, train_ev({"step_small": paired([0.9] * 5), "step_big": fast}), training=TRAIN_ROWS)
    assert r.status == "FAIL" and r.numbers["neutral_status"] == "FAIL"
    # a row straddling the best-speedup threshold and nothing else reaching it
    r = one(TRAIN, train_ev({"step_small": neutral, "step_big": paired([1.1, 1.3, 1.2, 1.25, 1.15])}),
            training=TRAIN_ROWS)
    assert r.status == "INCONCLUSIVE"
    r = one(TRAIN, train_ev({"step_big": fast}), training=TRAIN_ROWS)
    assert r.status == "INCONCLUSIVE" and "step_small" in r.reason


# --- verdict -----------------------------------------------------------------------------------

def _r(status):
    return GateResult("g", "speedup", status, "", {}, [])


def test_verdict_rules():
    assert verdict([_r("PASS"), _r("PASS")]) == "GO"
    assert verdict([_r("PASS"), _r("FAIL"), _r("INCONCLUSIVE")]) == "NO-GO"
    assert verdict([_r("PASS"), _r("INCONCLUSIVE")]) == "INCONCLUSIVE"
    assert verdict([]) == "INCONCLUSIVE"
    assert verdict([_r("PASS")], terminal="baseline is red") == "NO-GO"
    assert verdict([_r("INCONCLUSIVE")], terminal="STOPPED") == "NO-GO"


def test_evaluate_gates_end_to_end():
    exp = make_exp([{"name": "sp", "kind": "speedup", "row": "dense", "threshold": 1.5}, NR, PEAK])
    ev = peak_ev()
    ev.rows[("dense", "fwdbwd")].series["eager"] = Series.from_blocks(*paired(SPREAD))
    results = evaluate_gates(exp, ev)
    assert [r.name for r in results] == ["sp", "nr", "p"]
    assert [r.status for r in results] == ["PASS", "PASS", "PASS"]
    assert verdict(results) == "GO"
    assert results[0].to_json()["numbers"]["threshold"] == 1.5
    ev.rows[("dense", "fwdbwd")].cand_peak = 999_000
    results = evaluate_gates(exp, ev)
    assert [r.status for r in results] == ["PASS", "PASS", "FAIL"]
    assert verdict(results) == "NO-GO"


# --- evidence from block records ---------------------------------------------------------------

def _block(index, side, ms, status="ok", peak=None, failures=(), stage=None):
    b = Block(index=index, side=side, attempt=f"{index}-0", status=status)
    if ms is not None:
        b.samples[("dense", "fwdbwd")] = list(ms)
        b.samples[("ragged", "fwdbwd")] = [m * 2 for m in ms]
    if peak is not None:
        b.peaks[("dense", "fwdbwd")] = peak
    if stage is not None:
        b.stage_samples[("dense", "fwdbwd", "intra")] = list(stage)
    b.failures = list(failures)
    return b


def test_evidence_from_blocks_orders_pairs_and_keeps_failures():
    exp = make_exp([NR])
    blocks = [  # given out of order on purpose
        _block(3, "baseline", [2.2] * 3, peak=900, stage=[1.0]),
        _block(0, "baseline", [2.0] * 3, peak=1000, stage=[1.1]),
        _block(1, "candidate", [1.0] * 3, peak=500, stage=[0.5]),
        _block(2, "candidate", [1.1] * 3, peak=600, stage=[0.6]),
        _block(4, "baseline", None, status="failed"),
        _block(5, "candidate", [1.2] * 3, failures=[{"shape": "ragged", "mode": "fwdbwd", "error": "OOM"}]),
        _block(6, "candidate", [9.9] * 3, status="running"),  # never finished: not data
    ]
    blocks[5].samples.pop(("ragged", "fwdbwd"))
    ev = evidence_from_blocks(exp, blocks)
    dense = ev.rows[("dense", "fwdbwd")]
    # pairs by position among the ok blocks that have the row: the first two of each side
    assert dense.series["eager"].per_pair("base") == [[2.0] * 3, [2.2] * 3]
    assert dense.series["eager"].per_pair("cand") == [[1.0] * 3, [1.1] * 3]
    assert (dense.base_peak, dense.cand_peak) == (1000, 600)
    assert dense.shape_dims["NT"] == 3
    ragged = ev.rows[("ragged", "fwdbwd")]
    assert ragged.series["eager"].per_pair("cand") == [[2.0] * 3, [2.2] * 3]
    assert [f["error"] for f in ragged.failures] == ["block failed", "OOM"]
    assert [f["block"] for f in dense.failures] == [4]
    intra = ev.stages[("dense", "fwdbwd", "intra")]
    assert (intra.per_pair("base"), intra.per_pair("cand")) == ([[1.1], [1.0]], [[0.5], [0.6]])
    assert len(ev.failures) == 2


def test_evidence_from_samples_jsonl(tmp_path):
    path = tmp_path / "samples.jsonl"
    rng = np.random.default_rng(0)
    for block, side in enumerate(["baseline", "candidate", "candidate", "baseline", "baseline", "candidate"]):
        att = f"{block}-a"
        records.append_jsonl(path, {"type": "block_start", "block": block, "side": side, "attempt": att})
        for shape, scale in (("dense", 1.0), ("ragged", 0.5)):
            ms = (2.0 if side == "baseline" else 1.0) * scale
            for i in range(8):
                records.append_jsonl(path, {"type": "sample", "block": block, "side": side, "attempt": att,
                                            "shape": shape, "mode": "fwdbwd", "i": i,
                                            "ms": ms * (1 + 0.01 * rng.standard_normal())})
            records.append_jsonl(path, {"type": "peak", "block": block, "side": side, "attempt": att,
                                        "shape": shape, "mode": "fwdbwd",
                                        "bytes": 2_000_000 if side == "baseline" else 1_000_000})
        records.append_jsonl(path, {"type": "block_end", "block": block, "side": side, "attempt": att,
                                    "status": "ok"})
    exp = make_exp([{"name": "sp", "kind": "speedup", "row": "dense", "threshold": 1.8},
                    {"name": "geo", "kind": "geomean", "rows": ["dense", "ragged"], "threshold": 1.8},
                    {"name": "nr", "kind": "non_regression", "margin": 0.02}, PEAK])
    ev = evidence_from_blocks(exp, records.completed_blocks(path))
    results = evaluate_gates(exp, ev)
    assert [r.status for r in results] == ["PASS", "PASS", "PASS", "PASS"], [r.reason for r in results]
    assert verdict(results) == "GO"
    # the same run with the A/A noise floor wider than the margin is not GO
    ev.aa_noise = 0.03
    assert verdict(evaluate_gates(exp, ev)) == "INCONCLUSIVE"


def test_non_regression_fails_only_outside_the_baselines_own_noise():
    from harness.gates import Evidence, RowEvidence

    gate = {"name": "nr", "kind": "non_regression", "rows": ["dense"], "modes": ["fwd"], "margin": 0.02}

    def ev(base_medians, slowdown):
        base = [[m * f for f in (0.999, 1.0, 1.001)] for m in base_medians]
        cand = [[x * slowdown for x in b] for b in base]
        return Evidence(rows={("dense", "fwd"): RowEvidence.from_blocks(base, cand)})

    # a 4% regression with blocks that agree to 0.5%: outside noise -> FAIL
    r = one(gate, ev([10.0, 10.05, 9.95], 1.04), modes=["fwd"])
    assert r.status == "FAIL" and "beyond its noise" in r.reason
    # the same 4% when the baseline's own blocks spread by +-6%: within noise -> INCONCLUSIVE, never FAIL
    r = one(gate, ev([10.0, 10.6, 9.4], 1.04), modes=["fwd"])
    assert r.status == "INCONCLUSIVE" and "within noise" in r.reason
    assert abs(r.numbers["rows"]["dense/fwd"]["noise"] - 0.06) < 0.005


# --- basis: device -------------------------------------------------------------------------------
# The H200 pattern that motivated it (reports/pkda-keep-solve/h200): a launch-bound row whose wall
# medians move +-20% between fresh processes while its summed kernel time moves < 0.5%.
WALL_NOISY = ([[5.9] * 10, [6.4] * 10, [6.2] * 10], [[6.3] * 10, [5.6] * 10, [6.2] * 10])
DEVICE_CLEAR = ([[4.71] * 3, [4.70] * 3, [4.72] * 3], [[4.14] * 3, [4.13] * 3, [4.15] * 3])


def device_ev(wall, device, key=("dense", "fwdbwd")):
    return Evidence(rows={key: RowEvidence.from_blocks(*wall, *device)})


def test_speedup_and_geomean_on_device_time():
    ev = device_ev(WALL_NOISY, DEVICE_CLEAR)
    wall = one({"name": "g", "kind": "speedup", "row": "dense", "threshold": 1.08}, ev)
    dev = one({"name": "g", "kind": "speedup", "row": "dense", "threshold": 1.08, "basis": "device"}, ev,
              stage_iters=3)
    assert wall.status == "INCONCLUSIVE" and dev.status == "PASS", (wall.reason, dev.reason)
    assert dev.numbers["basis"] == "device" and 1.13 < dev.numbers["point"] < 1.15
    assert "(device)" in dev.reason and dev.rows == ["dense/fwdbwd"]
    geo = one({"name": "g", "kind": "geomean", "rows": ["dense"], "threshold": 1.05, "basis": "device"}, ev,
              stage_iters=3)
    assert geo.status == "PASS" and geo.numbers["basis"] == "device"
    # a threshold above the device speedup FAILs on device time as it would on wall time
    assert one({"name": "g", "kind": "speedup", "row": "dense", "threshold": 1.25, "basis": "device"}, ev,
               stage_iters=3).status == "FAIL"


def test_non_regression_on_device_time_ignores_the_wall_aa_floor():
    same = ([[1.079] * 3, [1.080] * 3, [1.078] * 3], [[1.081] * 3, [1.082] * 3, [1.080] * 3])
    ev = device_ev(WALL_NOISY, same, key=("dense", "fwd"))
    ev.aa_noise = 0.05  # a wall-clock floor wider than the margin: wall can never PASS
    gate = {"name": "nr", "kind": "non_regression", "rows": ["dense"], "modes": ["fwd"], "margin": 0.02}
    assert one(gate, ev, modes=["fwd"]).status == "INCONCLUSIVE"
    r = one({**gate, "basis": "device"}, ev, modes=["fwd"], stage_iters=3)
    assert r.status == "PASS", r.reason
    assert "spread between worker pairs" in r.numbers["rows"]["dense/fwd"]["noise_source"]
    slower = ([[1.08] * 3] * 3, [[1.20] * 3] * 3)
    r = one({**gate, "basis": "device"}, device_ev(WALL_NOISY, slower, key=("dense", "fwd")), modes=["fwd"],
            stage_iters=3)
    assert r.status == "FAIL", r.reason


def test_device_gate_without_profiled_calls_is_inconclusive():
    ev = device_ev(WALL_NOISY, ([], []))
    r = one({"name": "g", "kind": "speedup", "row": "dense", "threshold": 1.0, "basis": "device"}, ev,
            stage_iters=3)
    assert r.status == "INCONCLUSIVE" and "no measurements" in r.reason


def test_device_samples_from_records_and_the_kernel_table_fallback(tmp_path):
    """`device` lines give one value per profiled call; a block written before them (its kernel
    table only) gives its mean per call."""
    path = tmp_path / "samples.jsonl"
    for block, side in enumerate(["baseline", "candidate", "candidate", "baseline"]):
        att, key = f"{block}-a", {"shape": "dense", "mode": "fwdbwd"}
        ms = 2.0 if side == "baseline" else 1.0
        records.append_jsonl(path, {"type": "block_start", "block": block, "side": side, "attempt": att})
        records.append_jsonl(path, {"type": "sample", "block": block, "side": side, "attempt": att, **key,
                                    "i": 0, "ms": ms + 5})
        if block < 2:
            for i, f in enumerate((0.99, 1.01)):
                records.append_jsonl(path, {"type": "device", "block": block, "side": side, "attempt": att,
                                            **key, "i": i, "ms": ms * f})
        records.append_jsonl(path, {"type": "kernels", "block": block, "side": side, "attempt": att, **key,
                                    "iters": 2, "kernels": {"a": [ms * 1.5, 2], "b": [ms * 0.5, 2]}})
        records.append_jsonl(path, {"type": "block_end", "block": block, "side": side, "attempt": att,
                                    "status": "ok"})
    blocks = records.completed_blocks(path)
    assert blocks[0].device_ms(("dense", "fwdbwd")) == [2.0 * 0.99, 2.0 * 1.01]
    assert blocks[3].device_ms(("dense", "fwdbwd")) == [2.0]  # (3.0 + 1.0) / 2 iterations
    assert blocks[3].device_ms(("dense", "fwd")) == []
    ev = evidence_from_blocks(make_exp([NR]), blocks)
    device = ev.rows[("dense", "fwdbwd")].series["device"]
    assert device.per_pair("base") == [[1.98, 2.02], [2.0]] and device.per_pair("cand") == [[0.99, 1.01], [1.0]]
