"""harness/cli.py and harness/errors.py: exit codes (0 GO, 1 NO-GO, 3 INCONCLUSIVE, 2 bad input,
4 harness error), one-line messages naming what to fix and the log, `--help` on the standard
library alone, run ids that are names, reasons stored and echoed without control characters."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness.cli import main
from harness.records import completed_blocks

ROOT = Path(__file__).resolve().parent.parent
SPEEDUP = "- {kind: speedup, name: endpoint, row: small, mode: fwd, threshold: 1.25}\n"


def harness(*args, cwd: Path, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=timeout)


def roots(repo) -> list:
    return ["--profile-root", repo.root / "profile", "--reports-root", repo.root / "reports"]


def test_help_works_with_only_the_standard_library(tmp_path):
    """Every third-party import fails, as on a machine with only the core install: `harness --help`
    still lists every command."""
    blocker = textwrap.dedent("""\
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {"yaml", "pydantic", "git", "jinja2", "rich", "numpy", "scipy",
                                          "torch", "triton", "matplotlib", "nvtx", "safetensors"}:
                    raise ImportError(f"{name} is not installed (blocked by the test)")
        sys.meta_path.insert(0, Block())
        sys.argv = ["harness", "--help"]
        import runpy
        runpy.run_module("harness", run_name="__main__")
        """)
    res = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert res.returncode == 0, res.stderr
    for command in ("validate", "run", "report", "compare", "submit", "status", "cancel", "slurm-env"):
        assert f"\n    {command}" in res.stdout
    assert "run the whole protocol of an experiment" in res.stdout


def test_every_command_still_parses_its_own_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "--help"])
    assert e.value.code == 0 and "--measure-anyway" in capsys.readouterr().out


def test_unexpected_error_exits_4_with_one_line_and_the_traceback_in_a_log(tmp_path, monkeypatch, capsys):
    import harness.cli as cli
    import harness.commands.validate as validate

    def broken(args):
        return {}["no such key"]

    monkeypatch.setattr(validate, "run", broken)
    monkeypatch.setattr(cli, "HARNESS_ROOT", tmp_path)
    assert main(["validate", "x.yaml"]) == 4
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("harness error: KeyError: 'no such key' (an unexpected error: a harness bug or a broken "
                          "environment; report it with the log) (traceback: ")
    log = Path(err.rsplit("(traceback: ", 1)[1].rstrip(")"))
    assert log.parent == tmp_path / "profile" / "logs"
    text = log.read_text()
    assert text.startswith("harness validate x.yaml") and "Traceback" in text and "def broken" not in text
    assert "return {}[\"no such key\"]" in text


def test_bad_input_exits_2_with_the_message_alone(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "missing.yaml")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'missing.yaml'}: <top>: no such experiment file\n"


def test_disk_full_exits_4_naming_the_file(temp_repo):
    """/dev/full answers every write with ENOSPC: the attempt log is put there."""
    exp = temp_repo.experiment("full", "main", SPEEDUP)
    log = temp_repo.root / "profile" / "full" / "attempts.jsonl"
    log.parent.mkdir(parents=True)
    log.symlink_to("/dev/full")
    res = harness("attempts", exp, "--profile-root", temp_repo.root / "profile", "--reopen", "try again",
                  cwd=temp_repo.root)
    assert res.returncode == 4, res.stdout + res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith(f"harness error: No space left on device: {log}: the disk is full: free space there, "
                           "then resume (every record already written is kept) (traceback: ")
    assert "Traceback" not in res.stderr


def test_a_folder_where_the_attempt_log_belongs_exits_4_saying_so(temp_repo):
    exp = temp_repo.experiment("dirlog", "main", SPEEDUP)
    log = temp_repo.root / "profile" / "dirlog" / "attempts.jsonl"
    log.mkdir(parents=True)
    res = harness("attempts", exp, "--profile-root", temp_repo.root / "profile", "--reopen", "x", cwd=temp_repo.root)
    assert res.returncode == 4
    assert f"Is a directory: {log}: a folder stands where a file belongs: move it away" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("run_id", ["../../../../x", "/abs/path", "a/b", ".hidden", "x\ny"])
def test_run_id_that_is_a_path_is_refused(temp_repo, tmp_path, run_id):
    exp = temp_repo.experiment("ids", "main", SPEEDUP)
    res = harness("run", exp, "--run-id", run_id, *roots(temp_repo), cwd=temp_repo.root, timeout=120)
    assert res.returncode == 2
    assert f"--run-id {run_id!r}: a run id is a name, not a path" in res.stderr
    assert not (temp_repo.root / "profile").exists()  # nothing written anywhere


def test_reopen_reason_is_stored_and_echoed_without_control_characters(temp_repo):
    exp = temp_repo.experiment("esc", "main", SPEEDUP)
    reason = "retry\x1b[2J\x1b]0;pwned\x07 after\x00 the\r\nfix\x7f"
    res = harness("attempts", exp, "--profile-root", temp_repo.root / "profile", "--reopen", reason.replace("\x00", ""),
                  cwd=temp_repo.root)
    assert res.returncode == 0, res.stderr
    assert "reopened esc: retry after the fix\n" in res.stdout
    assert "\x1b" not in res.stdout and "\x07" not in res.stdout and "\r" not in res.stdout
    [entry] = [json.loads(line) for line in (temp_repo.root / "profile" / "esc" / "attempts.jsonl").read_text().splitlines()]
    assert entry["reason"] == "retry after the fix"


def _tmpfs(path: Path, size: str):
    path.mkdir(parents=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem to fill here (root with CAP_SYS_ADMIN needed): {res.stderr.strip()}")


def test_disk_full_mid_run_exits_4_and_a_resume_loses_nothing(temp_repo):
    """The profile root on a 16 MB filesystem, filled up once block 1 is complete."""
    profile = temp_repo.root / "small-disk"
    _tmpfs(profile, "16m")
    try:
        temp_repo.branch("fast", work=2)
        exp = temp_repo.experiment("full-disk", "fast", SPEEDUP, blocks=3, samples=3, engine="blocks")
        samples = profile / "full-disk" / "runs" / "r1" / "samples.jsonl"
        proc = subprocess.Popen([sys.executable, "-m", "harness", "run", str(exp), "--run-id", "r1", "--profile-root",
                                 str(profile), "--reports-root", str(temp_repo.root / "reports")],
                                cwd=temp_repo.root, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while not [b for b in completed_blocks(samples, []) if b.index >= 1] and time.monotonic() < deadline:
            time.sleep(0.05)
        filler = profile / "filler"
        with filler.open("wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError as e:
                assert e.errno == errno.ENOSPC
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 4, out + err
        line = err.strip().splitlines()[-1]
        assert line.startswith("harness error: No space left on device: ") and "the disk is full" in line, err
        assert f"then resume: harness run {exp} --resume --run-id r1 --profile-root {profile} --reports-root " in line
        assert "Traceback" not in err
        before = {b.index: (b.attempt, b.samples) for b in completed_blocks(samples)}
        assert before and len(before) < 6

        filler.unlink()
        res = harness("run", exp, "--resume", "--run-id", "r1", "--profile-root", profile, "--reports-root",
                      temp_repo.root / "reports", cwd=temp_repo.root)
        assert res.returncode in (0, 1, 3), res.stdout + res.stderr
        after = {b.index: (b.attempt, b.samples) for b in completed_blocks(samples)}
        assert sorted(after) == list(range(6))
        assert all(after[i] == before[i] for i in before)  # every block measured before the disk filled is kept
    finally:
        subprocess.run(["umount", "-l", str(profile)], capture_output=True)
        shutil.rmtree(profile, ignore_errors=True)
