"""tools/h200_pack.sh: what a device call sends back stays inside the device's limits (8 files,
16 MiB each, 64 MiB together) and holds the one experiment's records a resume or a publish reads."""
from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

import pytest

PACK = Path(__file__).resolve().parents[1] / "tools" / "h200_pack.sh"
MiB = 1024 * 1024


def _write(root: Path, rel: str, data: bytes) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)


@pytest.fixture
def machine(tmp_path):
    """A device checkout's results root after two experiments ran on one machine."""
    r = tmp_path / "repo"
    _write(r, "results/profile/exp-a/runs/h100/samples.jsonl", b'{"t": 1}\n' * 1000)
    _write(r, "results/profile/exp-a/freeze.json", b"{}")
    _write(r, "results/profile/exp-a/freeze/f1/run1/fixtures/case.safetensors", os.urandom(3 * MiB))
    _write(r, "results/profile/exp-a/verify/v1/fixtures/case.safetensors", os.urandom(3 * MiB))
    _write(r, "results/profile/exp-a/worktrees/candidate/x.py", b"x = 1\n")
    _write(r, "results/reports/exp-a/h100/report.json", b"{}")
    _write(r, "results/profile/exp-b/freeze/f2/run1/fixtures/big.safetensors", os.urandom(20 * MiB))
    _write(r, "results/profile/exp-b/runs/h100/samples.jsonl", b"{}\n")
    _write(r, "results/profile/triton-cache/k1/kernel.cubin", os.urandom(30 * MiB))   # incompressible
    _write(r, "results/profile/triton-cache/k1/kernel.autotune.json", b'{"configs": []}')
    _write(r, "results/bench-base/repo.bundle", b"bundle")
    (tmp_path / "out").mkdir()
    return r, tmp_path / "out"


def _pack(repo: Path, call: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f". {PACK}; {call}"], cwd=repo, capture_output=True, text=True)


def _members(out: Path, prefix: str) -> list[str]:
    pieces = sorted(out.glob(prefix + "*"))
    joined = out.parent / "joined.tgz"
    joined.write_bytes(b"".join(p.read_bytes() for p in pieces))
    with tarfile.open(joined) as tar:
        return tar.getnames()


def test_state_holds_only_its_experiment_and_fits_the_room(machine):
    repo, out = machine
    res = _pack(repo, f"pack_state exp-a {out} 7 {64 * MiB}")
    assert res.returncode == 0, res.stdout + res.stderr
    pieces = sorted(out.glob("state.tgz.*"))
    assert 1 <= len(pieces) <= 4 and all(p.stat().st_size <= 15 * MiB for p in pieces)
    names = _members(out, "state.tgz.")
    assert "results/profile/exp-a/runs/h100/samples.jsonl" in names
    assert "results/reports/exp-a/h100/report.json" in names and "results/bench-base/repo.bundle" in names
    assert "results/profile/triton-cache/k1/kernel.cubin" in names   # it fits whole: 30 MiB in 2 pieces
    assert not any("exp-b" in n or n.endswith(".safetensors") or "worktrees" in n for n in names), names


def test_state_drops_the_triton_binaries_when_tight_and_sends_nothing_when_it_cannot_fit(machine):
    repo, out = machine
    res = _pack(repo, f"pack_state exp-a {out} 7 {16 * MiB}")   # one piece of room
    assert res.returncode == 0, res.stdout + res.stderr
    names = _members(out, "state.tgz.")
    assert len(list(out.glob("state.tgz.*"))) == 1
    assert "results/profile/triton-cache/k1/kernel.autotune.json" in names
    assert "results/profile/triton-cache/k1/kernel.cubin" not in names
    for p in out.glob("state.tgz.*"):
        p.unlink()
    res = _pack(repo, f"pack_state exp-a {out} 0 {64 * MiB}")
    assert res.returncode == 1 and "STATE DOES NOT FIT" in res.stdout
    assert not list(out.iterdir())


def test_records_are_the_experiments_own_and_leave_big_ncu_reports_behind(machine):
    repo, out = machine
    _write(repo, "results/profile/exp-a/runs/h100/ncu/small.ncu-rep", b"ncu" * 100)
    res = _pack(repo, f"pack_records exp-a {out}")
    assert res.returncode == 0, res.stdout + res.stderr
    names = _members(out, "records.tgz")
    assert "results/profile/exp-a/runs/h100/ncu/small.ncu-rep" in names
    assert not any("exp-b" in n or "triton-cache" in n or n.endswith(".safetensors") for n in names), names
    _write(repo, "results/profile/exp-a/runs/h100/ncu/big.ncu-rep", os.urandom(16 * MiB))
    res = _pack(repo, f"pack_records exp-a {out}")
    assert res.returncode == 0, res.stdout + res.stderr
    names = _members(out, "records.tgz")
    assert (out / "records.tgz").stat().st_size <= 15 * MiB
    assert "results/profile/exp-a/runs/h100/samples.jsonl" in names
    assert not any(n.endswith(".ncu-rep") for n in names)
