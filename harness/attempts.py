"""Attempts and the experiment's state: the stop rule of a declared optimisation.

Files under profile/<experiment>/:
  attempts.jsonl  append-only log, one JSON object a line:
      {type: "attempt", t, run_id, sha, note, verdict, measured_verdict, failing_gates, capped}
      {type: "reopen",  t, run_id, reason, state_before}
  state.json      {state: OPEN | TERMINAL_NO_GO | STOPPED, reason, experiment, updated,
                   max_attempts, distinct_attempts, shas, window_start, reopened, terminal {...} | null}

Every `harness run` on a candidate is an attempt. Attempts are *materially distinct* when their
candidate SHAs differ (a re-run of the same SHA is logged but counts once). Counting starts at
the latest logged reopen (or at the start of the log): once `max_attempts` distinct SHAs in that
window have run without a GO, the state is STOPPED and is a NO-GO; a further run still measures,
but `cap_verdict` turns its GO into NO-GO unless a reopen with a reason is logged first
(`reopen`, `harness attempts EXP --reopen REASON`, or `harness run --reopen REASON`), which
starts a new window of `max_attempts`. TERMINAL_NO_GO (a red or irreproducible baseline, written
by harness/fixtures.py) is final for that baseline SHA: attempts and reopens never lift it.
"""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from harness.errors import BadInput
from harness.progress import plain
from harness.records import append_jsonl, read_jsonl

OPEN, TERMINAL_NO_GO, STOPPED = "OPEN", "TERMINAL_NO_GO", "STOPPED"
ATTEMPTS_FILE = "attempts.jsonl"
STATE_FILE = "state.json"


class AttemptError(BadInput):
    """A reopen that is not allowed (terminal state, empty reason)."""


def clean_reason(text: str) -> str:
    """A reason or note a user typed, as it is stored and echoed: terminal escapes and control
    characters removed, every run of whitespace (newlines too) one space."""
    return " ".join(plain(text).split())


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def exp_dir(profile_root: Path | str, exp_name: str) -> Path:
    return Path(profile_root) / exp_name


def log_path(profile_root, exp_name: str) -> Path:
    return exp_dir(profile_root, exp_name) / ATTEMPTS_FILE


def state_path(profile_root, exp_name: str) -> Path:
    return exp_dir(profile_root, exp_name) / STATE_FILE


def read_log(profile_root, exp_name: str) -> list[dict]:
    return read_jsonl(log_path(profile_root, exp_name))


def read_state_file(profile_root, exp_name: str) -> dict:
    path = state_path(profile_root, exp_name)
    if not path.exists():
        return {}
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        state = e
    if not isinstance(state, dict):
        raise AttemptError(f"{path} is damaged ({state}); move it away: the next run rebuilds it from "
                           f"{ATTEMPTS_FILE} (a red baseline's terminal NO-GO comes back with the next freeze)")
    return state


def _write_state(profile_root, exp_name: str, state: dict) -> None:
    path = state_path(profile_root, exp_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True))
    tmp.replace(path)


def set_terminal(profile_root, exp_name: str, reason: str, failures: list, baseline_sha: str,
                 freeze_file: str | None = None) -> dict:
    """Record a terminal NO-GO (red or irreproducible baseline) in state.json."""
    state = read_state_file(profile_root, exp_name)
    state.update(state=TERMINAL_NO_GO, reason=reason, experiment=exp_name, updated=_now(),
                 terminal={"baseline_sha": baseline_sha, "failures": failures, "freeze": freeze_file, "t": _now()})
    _write_state(profile_root, exp_name, state)
    return state


def _terminal(profile_root, exp_name: str) -> dict | None:
    st = read_state_file(profile_root, exp_name)
    return st if st.get("state") == TERMINAL_NO_GO else None


def compute_state(entries: list[dict], max_attempts: int) -> dict:
    """OPEN or STOPPED from the log alone (see the module docstring for the rule)."""
    start = 0
    reopens = [i for i, e in enumerate(entries) if e.get("type") == "reopen"]
    if reopens:
        start = reopens[-1] + 1
    window = [e for e in entries[start:] if e.get("type") == "attempt"]
    shas: list[str] = []
    for e in window:
        if e["sha"] not in shas:
            shas.append(e["sha"])
    go = [e for e in window if e.get("verdict") == "GO"]
    out = {"max_attempts": max_attempts, "distinct_attempts": len(shas), "shas": shas,
           "window_start": start, "reopened": bool(reopens),
           "attempts_total": sum(1 for e in entries if e.get("type") == "attempt")}
    if go:
        out.update(state=OPEN, reason=f"GO reached by {go[0]['sha'][:12]} (run {go[0].get('run_id')})")
    elif len(shas) >= max_attempts:
        out.update(state=STOPPED, reason=(f"stopped: {len(shas)} materially distinct attempts (distinct candidate SHAs) "
                                          f"without GO, max_attempts={max_attempts}; a further run cannot be GO "
                                          f"without a logged --reopen reason"))
    else:
        left = max_attempts - len(shas)
        out.update(state=OPEN, reason=f"{len(shas)} of {max_attempts} distinct attempts used, {left} left")
    return out


def attempt_state(profile_root, exp) -> dict:
    """The experiment's state now: TERMINAL_NO_GO from the freeze, else OPEN/STOPPED from the log.

    `exp` is the Experiment (its name and max_attempts are used)."""
    state = compute_state(read_log(profile_root, exp.name), exp.max_attempts)
    term = _terminal(profile_root, exp.name)
    red_sha = ((term or {}).get("terminal") or {}).get("baseline_sha") or ""
    if term is not None and exp.baseline.ref and red_sha and not red_sha.startswith(exp.baseline.ref):
        term = None  # the red baseline was another commit: a new baseline gets its own baseline gate
    if term is not None:
        state.update(state=TERMINAL_NO_GO, reason=term.get("reason"), terminal=term.get("terminal"))
    state["experiment"] = exp.name
    return state


experiment_state = attempt_state  # the name harness/run.py calls


def _refresh_state(profile_root, exp_name: str, max_attempts: int | None) -> dict:
    st = read_state_file(profile_root, exp_name)
    if max_attempts is None:  # keep the experiment's limit from an earlier call, else the schema default
        max_attempts = int(st.get("max_attempts") or 3)
    computed = compute_state(read_log(profile_root, exp_name), max_attempts)
    if st.get("state") == TERMINAL_NO_GO:
        st.update({k: v for k, v in computed.items() if k not in ("state", "reason")})
    else:
        st.update(computed)
    st.update(experiment=exp_name, updated=_now())
    _write_state(profile_root, exp_name, st)
    return st


def cap_verdict(state: dict, verdict: str) -> tuple[str, str | None]:
    """The verdict a run may report given the state it started in: STOPPED or terminal turn GO into NO-GO."""
    if state.get("state") == TERMINAL_NO_GO:
        return "NO-GO", f"terminal NO-GO: {state.get('reason')}"
    if state.get("state") == STOPPED and verdict == "GO":
        return "NO-GO", f"measured GO, but {state.get('reason')}"
    return verdict, None


def record_attempt(profile_root, exp_name: str, sha: str, note: str, verdict: str, failing_gates: list[str],
                   run_id: str | None, max_attempts: int | None = None, measured_verdict: str | None = None) -> dict:
    """Append one attempt and refresh state.json; returns the logged entry."""
    entry = {"type": "attempt", "t": _now(), "run_id": run_id, "sha": sha, "note": clean_reason(note or ""),
             "verdict": verdict, "measured_verdict": measured_verdict or verdict,
             "capped": measured_verdict is not None and measured_verdict != verdict,
             "failing_gates": list(failing_gates)}
    append_jsonl(log_path(profile_root, exp_name), entry)
    _refresh_state(profile_root, exp_name, max_attempts)
    return entry


def reopen(profile_root, exp_name: str, reason: str, run_id: str | None = None, max_attempts: int | None = None) -> dict:
    """Log an explicit reopen (a new window of max_attempts); refused on a terminal NO-GO or without a reason."""
    reason = clean_reason(reason or "")
    if not reason:
        raise AttemptError("reopen needs a reason (it is logged and shown in the report)")
    term = _terminal(profile_root, exp_name)
    if term is not None:
        raise AttemptError(f"{exp_name} is TERMINAL_NO_GO ({term.get('reason')}); a red baseline cannot be reopened")
    limit = max_attempts or int(read_state_file(profile_root, exp_name).get("max_attempts") or 3)
    before = compute_state(read_log(profile_root, exp_name), limit)
    entry = {"type": "reopen", "t": _now(), "run_id": run_id, "reason": reason,
             "state_before": before["state"], "distinct_before": before["distinct_attempts"]}
    append_jsonl(log_path(profile_root, exp_name), entry)
    _refresh_state(profile_root, exp_name, max_attempts)
    return entry


reopen_experiment = reopen  # log_run's `reopen` argument shadows the function's name


def _failing_gates(data: dict) -> list[str]:
    verdict = data.get("verdict")
    gates = (verdict.get("gates") if isinstance(verdict, dict) else None) or data.get("gates") or []
    out = []
    for g in gates:
        if isinstance(g, dict) and g.get("status") == "FAIL":
            out.append(g.get("name") or g.get("kind") or "?")
    return out


def log_run(profile_root, exp, data: dict, run_dir: Path, note: str = "", reopen: str | None = None) -> dict:
    """Log a finished `harness run` as an attempt (called by harness/run.py after the report).

    `reopen` (the run's --reopen reason) is logged first unless this run already logged it; the
    run's verdict is capped by the state before this attempt (`cap_verdict`)."""
    run_dir = Path(run_dir)
    run_id = run_dir.name
    manifest = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").exists() else {}
    sha = ((manifest.get("revisions") or {}).get("candidate") or {}).get("sha") or "unknown"
    if reopen:
        already = any(e.get("type") == "reopen" and e.get("run_id") == run_id for e in read_log(profile_root, exp.name))
        if not already:
            reopen_experiment(profile_root, exp.name, reopen, run_id=run_id, max_attempts=exp.max_attempts)
    state = attempt_state(profile_root, exp)
    verdict = data.get("verdict")
    measured = verdict.get("verdict") if isinstance(verdict, dict) else verdict
    final, _ = cap_verdict(state, measured)
    return record_attempt(profile_root, exp.name, sha, note, final, _failing_gates(data), run_id,
                          max_attempts=exp.max_attempts, measured_verdict=measured)


def format_table(entries: list[dict], state: dict | None = None) -> str:
    """The log as a plain-text table (attempts numbered by distinct SHA within their window)."""
    rows = [("#", "time (UTC)", "candidate", "verdict", "failing gates", "run", "note")]
    seen: list[str] = []
    for e in entries:
        if e.get("type") == "reopen":
            seen = []
            rows.append(("--", e.get("t", ""), "REOPEN", "", "", e.get("run_id") or "", clean_reason(str(e.get("reason", "")))))
            continue
        if e["sha"] not in seen:
            seen.append(e["sha"])
        n = str(seen.index(e["sha"]) + 1)
        verdict = e.get("verdict", "")
        if e.get("capped"):
            verdict += f" (measured {e.get('measured_verdict')})"
        rows.append((n, e.get("t", ""), e["sha"][:12], verdict, ", ".join(e.get("failing_gates") or []) or "-",
                     e.get("run_id") or "", clean_reason(str(e.get("note", "")))))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r[:-1], widths)) + "  " + str(r[-1]) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * 4)
    if state is not None:
        lines.append("")
        lines.append(f"state: {state.get('state')} - {state.get('reason')}")
    return "\n".join(lines)
