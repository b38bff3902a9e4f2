"""pytest plugin: fla's public PKDA test file, unmodified, against this repository's two ops.

    PYTHONPATH=<fla clone>:<this repo>:<this repo>/tools \
        python3 -m pytest <fla clone>/tests/ops/test_precond_kda.py -p fla_public_plugin \
        --fla-report results.jsonl

Before any conftest or test module is imported it replaces `chunk_precond_kda` and
`fused_recurrent_precond_kda` in `fla.ops.precond_kda` (where the test module imports them
from; in `fla.ops` too, should it export them) by `kernels.pkda`'s. Everything else stays
fla's: the test file, its naive reference (`fla.ops.precond_kda.naive`), `assert_close` and
its tolerances, `fused_kda_gate`, and tests/conftest.py with its NaN-poisoning of
torch.empty / empty_like / Tensor.new_empty. That poisoning only covers allocations made by
modules named `fla...`; it is extended to allocations made by `kernels.pkda` (unless
--fla-no-poison-ours), so a kernel of ours that reads memory it never wrote fails as fla's
would. After collection it checks that every collected test module holds our two ops (a
usage error otherwise) and says which callables it ended up with.

--fla-report PATH appends JSON lines as the run goes (so a killed run still leaves what
finished): one `collected` line (test ids, the ops in use), then per test phase a `result`
line, and a `warning` line per warning a test raised (fla's assert_close(..., warning=True)
warns instead of failing). `python3 tools/fla_public_plugin.py summarise REPORT...` prints
the summary of the reports of one or more runs (shards).

--fla-device-cpu is for a dry run on a machine without a GPU only: fla.utils picks
device 'cuda' from Triton's driver even under TRITON_INTERPRET, so the tests would place
their tensors on a CUDA device; this makes it 'cpu' (and conftest's synchronize torch.cpu's).
"""
from __future__ import annotations

import json
import os
import sys
import time

import pytest

OPS = ("chunk_precond_kda", "fused_recurrent_precond_kda")
OURS_PREFIX = "kernels.pkda"

_state = {"report": None, "poison_ours": True, "ours": {}, "poisoned": []}


def pytest_addoption(parser):
    group = parser.getgroup("fla_public", "fla's public PKDA tests against kernels.pkda")
    group.addoption("--fla-report", default=None, help="append JSON lines (collected, results, warnings) here")
    group.addoption("--fla-no-poison-ours", action="store_true",
                    help="do not extend conftest's NaN poisoning to kernels.pkda's allocations")
    group.addoption("--fla-device-cpu", action="store_true",
                    help="CPU dry run: set fla.utils.device to 'cpu' (never on a GPU machine)")


def _write(record: dict) -> None:
    if _state["report"]:
        with open(_state["report"], "a") as f:
            f.write(json.dumps(record) + "\n")


def _qualname(fn) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def swap_public_ops() -> dict:
    """Put kernels.pkda's two ops where fla's test module imports them from; returns them."""
    import fla.ops
    import fla.ops.precond_kda as public
    import kernels.pkda as pkda
    ours = {name: getattr(pkda, name) for name in OPS}
    for module in (public, fla.ops):
        for name, fn in ours.items():
            if module is public or hasattr(module, name):
                setattr(module, name, fn)
    return ours


def _use_cpu_device() -> None:
    import torch
    import fla.utils
    fla.utils.device = "cpu"
    fla.utils.device_torch_lib = torch.cpu


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    # runs before tests/conftest.py and the test module are imported
    ns = early_config.known_args_namespace
    _state["report"] = ns.fla_report
    _state["poison_ours"] = not ns.fla_no_poison_ours
    if ns.fla_device_cpu:
        _use_cpu_device()
    _state["ours"] = swap_public_ops()



def _allocation_in_ours() -> bool:
    """Whether the allocating call comes from kernels.pkda (before any test frame)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith(OURS_PREFIX):
            return True
        if "test_" in name.rsplit(".", 1)[-1]:
            return False
        frame = frame.f_back
    return False


def pytest_plugin_registered(plugin, manager):
    # fla's conftest decides whom to poison with its module-level _is_called_from_fla
    decide = getattr(plugin, "_is_called_from_fla", None)
    if decide is None or not _state["poison_ours"] or getattr(decide, "extended_to_ours", False):
        return

    def called_from_fla_or_ours():
        return decide() or _allocation_in_ours()
    called_from_fla_or_ours.extended_to_ours = True
    plugin._is_called_from_fla = called_from_fla_or_ours
    _state["poisoned"].append(getattr(plugin, "__file__", repr(plugin)))


def pytest_collection_finish(session):
    ours = _state["ours"]
    modules = {item.module for item in session.items if getattr(item, "module", None) is not None}
    used = {}
    for module in modules:
        for name, fn in ours.items():
            got = getattr(module, name, None)
            if got is not None and got is not fn:
                raise pytest.UsageError(
                    f"{module.__name__}.{name} is {_qualname(got)}, not ours ({_qualname(fn)}): "
                    f"the swap did not take effect")
            if got is not None:
                used[f"{module.__name__}.{name}"] = _qualname(got)
        naive = getattr(module, "naive_recurrent_precond_kda", None)
        if naive is not None:
            used[f"{module.__name__}.naive_recurrent_precond_kda"] = _qualname(naive)
    poisoned = bool(_state["poisoned"])
    line = (f"fla_public_plugin: {len(session.items)} tests; ops in use: "
            + ", ".join(f"{k} = {v}" for k, v in sorted(used.items()))
            + f"; NaN poisoning extended to {OURS_PREFIX}: {poisoned}")
    session.config.get_terminal_writer().line(line)
    _write({"event": "collected", "ids": [item.nodeid for item in session.items], "ops": used,
            "poison_ours": poisoned, "time": time.time(),
            "env": {k: os.environ.get(k) for k in ("FLA_CI_ENV", "TRITON_INTERPRET", "TRITON_CACHE_DIR")}})


def _reason(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message.strip().splitlines()[0][:400]
    text = str(report.longrepr or "").strip().splitlines()
    return text[-1][:400] if text else ""


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        _write({"event": "result", "id": report.nodeid, "when": report.when, "outcome": report.outcome,
                "duration": round(report.duration, 3),
                "reason": _reason(report) if report.outcome != "passed" else ""})


def pytest_warning_recorded(warning_message, when, nodeid, location):
    if nodeid:
        _write({"event": "warning", "id": nodeid, "message": str(warning_message.message)[:400]})


# ---------------------------------------------------------------- summary of one or more runs
def final_outcomes(records: list[dict]) -> tuple[list[str], dict[str, dict]]:
    """Test ids collected (in order) and per test its outcome: 'error' when setup or teardown
    failed, else the call's outcome ('passed', 'failed', 'skipped'), with reason and duration."""
    collected, results = [], {}
    for r in records:
        if r["event"] == "collected":
            collected += [i for i in r["ids"] if i not in collected]
        elif r["event"] == "result":
            res = results.setdefault(r["id"], {"outcome": None, "reason": "", "duration": 0.0, "warnings": []})
            res["duration"] += r["duration"]
            if r["when"] == "call":
                res["outcome"] = res["outcome"] if res["outcome"] == "error" else r["outcome"]
                res["reason"] = res["reason"] or r["reason"]
            elif r["outcome"] != "passed" and r["outcome"] != "skipped":
                res["outcome"], res["reason"] = "error", f"{r['when']}: {r['reason']}"
            elif r["outcome"] == "skipped" and res["outcome"] is None:
                res["outcome"], res["reason"] = "skipped", r["reason"]
        elif r["event"] == "warning":
            results.setdefault(r["id"], {"outcome": None, "reason": "", "duration": 0.0, "warnings": []})
            results[r["id"]]["warnings"].append(r["message"])
    return collected, results


def summarise(reports: list[str]) -> str:
    records, ops, poisoned = [], {}, set()
    for path in reports:
        with open(path) as f:
            for line in f:
                if line.strip():
                    records.append(json.loads(line))
    for r in records:
        if r["event"] == "collected":
            ops.update(r["ops"])
            poisoned.add(r["poison_ours"])
    collected, results = final_outcomes(records)
    counts: dict[str, int] = {}
    for tid in collected:
        outcome = (results.get(tid) or {}).get("outcome") or "not run"
        counts[outcome] = counts.get(outcome, 0) + 1
    lines = [f"fla public PKDA tests against kernels.pkda: {len(collected)} collected; "
             + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())),
             f"NaN poisoning extended to kernels.pkda: {sorted(poisoned)}",
             "ops in use: " + "; ".join(f"{k} = {v}" for k, v in sorted(ops.items())), ""]
    for tid in collected:
        res = results.get(tid) or {}
        outcome = res.get("outcome") or "not run"
        row = f"{outcome:8s} {res.get('duration', 0.0):7.1f} s  {tid}"
        if res.get("reason"):
            row += f"\n           {res['reason']}"
        for w in res.get("warnings", []):
            row += f"\n           warning: {w}"
        lines.append(row)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "summarise":
        sys.exit("usage: python3 tools/fla_public_plugin.py summarise REPORT.jsonl...")
    sys.stdout.write(summarise(sys.argv[2:]))
