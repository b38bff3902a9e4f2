"""A red baseline stays terminal after the experiment's oracle is edited, and freeze says why."""
from __future__ import annotations

import json

from harness import fixtures
from oracle_repo import OP_WRONG, OracleRepo, frozen, quiet


def test_pass_record_keeps_the_contract_it_froze_under(tmp_path_factory):
    r, loaded, revisions, rec = frozen(tmp_path_factory)
    assert rec.contract == fixtures.contract_of(loaded, rec.device)
    assert fixtures.load_freeze(r.profile, "toy").contract == rec.contract


def test_relaxed_oracle_after_a_red_baseline_is_named_and_not_rerun(tmp_path):
    r = OracleRepo(tmp_path, op_src=OP_WRONG)
    loaded = r.experiment(rtol=1e-5)
    revisions = r.resolve(loaded)
    red = fixtures.freeze(loaded, revisions, r.profile, device="cpu", recheck=True, log=quiet)
    assert red.terminal and red.contract == fixtures.contract_of(loaded, "cpu")
    stamps = sorted((r.profile / "toy" / "freeze").iterdir())

    # the same oracle: today's single line, nothing about a change
    log: list[str] = []
    fixtures.freeze(loaded, revisions, r.profile, device="cpu", recheck=True, log=log.append)
    assert len(log) == 1 and "already a terminal NO-GO" in log[0], log

    # rtol relaxed in the experiment file: still the red record, no worker run, the change named
    relaxed = r.experiment(rtol=1e-2)
    log = []
    again = fixtures.freeze(relaxed, r.resolve(relaxed), r.profile, device="cpu", recheck=True, log=log.append)
    assert again.terminal and again.created == red.created
    assert sorted((r.profile / "toy" / "freeze").iterdir()) == stamps
    assert len(log) == 2 and "already a terminal NO-GO" in log[0], log
    assert "rtol: red under 1e-05, experiment now 0.01" in log[1] and "atol" not in log[1], log
    assert "not permission to relax the oracle" in log[1] and "baseline.ref" in log[1]

    # a record written before FreezeRecord had `contract` loads with None and keeps today's message
    path = fixtures.freeze_path(r.profile, "toy")
    old = json.loads(path.read_text())
    del old["contract"]
    path.write_text(json.dumps(old))
    assert fixtures.load_freeze(r.profile, "toy").contract is None
    log = []
    again = fixtures.freeze(relaxed, r.resolve(relaxed), r.profile, device="cpu", recheck=True, log=log.append)
    assert again.terminal and again.created == red.created and len(log) == 1, log


def test_a_cpu_freeze_under_other_fp32_arithmetic_is_not_reused(tmp_path):
    """Whether the CPU gate emulated TF32 dots is not in the manifest (the fixtures do not depend on
    it) but decides what the gate could pass: a record made the other way is checked again."""
    r = OracleRepo(tmp_path)
    loaded = r.experiment()
    revisions = r.resolve(loaded)
    rec = fixtures.freeze(loaded, revisions, r.profile, device="cpu", recheck=True, log=quiet)
    assert rec.contract["emulate_tf32"] is True and fixtures.contract_of(loaded, "cuda")["emulate_tf32"] is None
    log: list[str] = []
    fixtures.freeze(loaded, revisions, r.profile, device="cpu", log=log.append)
    assert any("reusing" in m for m in log), log

    path = fixtures.freeze_path(r.profile, "toy")
    for edit in (lambda d: d["contract"].update(emulate_tf32=False), lambda d: d.pop("contract")):
        record = json.loads(path.read_text())
        edit(record)
        path.write_text(json.dumps(record))
        log = []
        again = fixtures.freeze(loaded, revisions, r.profile, device="cpu", log=log.append)
        assert not any("reusing" in m for m in log) and again.status == "PASS", log
        assert again.contract["emulate_tf32"] is True and again.bench_base_sha == rec.bench_base_sha
