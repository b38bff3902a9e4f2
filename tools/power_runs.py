"""Run one experiment N times (fresh worker processes each time) and tabulate what the instrument read.

    python3 tools/power_runs.py experiments/power-2pct.yaml 10 [--out DIR] [--cpu] [--measure KEY=VALUE ...]

Each run is a whole `harness run` (its own run id, its own worker pairs); this parent process is
reused between runs only to save its start-up (it measures nothing). Per run and row it records the
gates' statuses, each basis's speedup interval and relative half-width, the A/A control's interval,
pairs, rounds, rounds left out, calls re-timed (late replays), what ended the rounds, and the run's
wall time; then prints a table and writes power-<experiment>.json (and the table as .txt) under --out (default $OUT, else profile/power/).
The instrument's acceptance (issue 17) is read off that table: see docs/perf/measurement.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import yaml
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.progress import QuietProgress  # noqa: E402
from harness.run import RunOptions, run_experiment  # noqa: E402
from harness.spec import LoadedExperiment, MeasureSpec, load_experiment  # noqa: E402


def summarize_run(report: dict, seconds: float) -> dict:
    rows = []
    for r in report["rows"]:
        bases = {}
        for name, b in (r.get("bases") or {}).items():
            sp, aa = b["speedup"], b.get("aa_control") or {}
            bases[name] = {"point": sp["point"], "lo": sp["lo"], "hi": sp["hi"], "rel_half_width": sp["rel_half_width"],
                           "aa_point": aa.get("point"), "aa_lo": aa.get("lo"), "aa_hi": aa.get("hi"),
                           "aa_rel_half_width": aa.get("rel_half_width"), "pairs": b["pairs"], "rounds": b["rounds"],
                           "excluded_rounds": b["excluded_rounds"], "retimed_calls": b.get("retimed_calls", 0),
                           "stop": (b.get("stop") or {}).get("reason"),
                           "stop_seconds": (b.get("stop") or {}).get("seconds"),
                           "baseline_median_ms": b["baseline"]["median"], "candidate_median_ms": b["candidate"]["median"]}
        rows.append({"row": r["name"], "primary": r["primary_basis"], "graph_reason": r.get("graph_reason"),
                     "bases": bases})
    gates = {g["name"]: g["status"] for g in report["gates"]}
    nr_rows = {g["name"]: {k: v.get("status") for k, v in (g["numbers"].get("rows") or {}).items()}
               for g in report["gates"] if g["kind"] == "non_regression"}
    return {"run": report["run"]["id"], "verdict": report["verdict"], "seconds": seconds, "gates": gates,
            "non_regression_rows": nr_rows, "rows": rows}


def table(runs: list[dict]) -> list[str]:
    lines = ["run  verdict       seconds  row                            basis  speedup [95%]                 +-hw      "
             "A/A [95%]                     pairs rounds left retimed stop      gates"]
    for i, run in enumerate(runs):
        first = True
        for row in run["rows"]:
            for basis, b in row["bases"].items():
                iv = (f"{b['point']:.4f} [{b['lo']:.4f}, {b['hi']:.4f}]" if b["lo"] is not None
                      else f"{b['point'] or 0:.4f} [no interval]")
                aa = (f"{b['aa_point']:.4f} [{b['aa_lo']:.4f}, {b['aa_hi']:.4f}]" if b["aa_lo"] is not None else "-")
                hw = f"{b['rel_half_width']:.3%}" if b["rel_half_width"] is not None else "-"
                gates = " ".join(f"{k}={v}" for k, v in run["gates"].items()) if first else ""
                lines.append(f"{i:<4} {run['verdict'] if first else '':<13} {run['seconds'] if first else 0:7.1f}  "
                             f"{row['row']:<30} {basis:<6} {iv:<29} {hw:<9} {aa:<29} {b['pairs']:>5} {b['rounds']:>6} "
                             f"{b['excluded_rounds']:>4} {b.get('retimed_calls', 0):>7} {b['stop'] or '-':<9} {gates}")
                first = False
    return lines


def with_measure(loaded: LoadedExperiment, settings: list[str]) -> tuple[LoadedExperiment, str]:
    """The experiment with fields of its `measure:` replaced (KEY=VALUE, the value read as YAML), checked
    as the file's own would be, and a suffix naming the change for the output files; a design is tried
    on the device without a copy of the experiment file."""
    if not settings:
        return loaded, ""
    update = {}
    for item in settings:
        key, sep, value = item.partition("=")
        if not sep or key not in MeasureSpec.model_fields:
            raise SystemExit(f"--measure {item!r}: expected KEY=VALUE, KEY one of {', '.join(MeasureSpec.model_fields)}")
        update[key] = yaml.safe_load(value)
    try:
        measure = MeasureSpec.model_validate({**loaded.exp.measure.model_dump(), **update})
    except ValidationError as e:
        raise SystemExit(f"--measure {' '.join(settings)}: {e}") from None
    suffix = "".join(f"-{k}{v}" for k, v in update.items())
    return loaded.model_copy(update={"exp": loaded.exp.model_copy(update={"measure": measure})}), suffix


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment")
    ap.add_argument("runs", type=int)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--cpu", action="store_true", help="the experiment's CPU profile (a smoke of this tool only)")
    ap.add_argument("--aa", action="store_true", help="harness run --aa: the baseline on both sides")
    ap.add_argument("--measure", action="append", default=[], metavar="KEY=VALUE",
                    help="replace a field of the experiment's measure: settings for these runs (repeatable)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no further run once this many seconds have passed (a device call's limit)")
    args = ap.parse_args(argv)
    loaded, suffix = with_measure(load_experiment(args.experiment), args.measure)
    out = args.out or Path(os.environ.get("OUT") or ROOT / "profile" / "power")
    out.mkdir(parents=True, exist_ok=True)
    stem = f"power-{loaded.exp.name}{'-aa' if args.aa else ''}{suffix}"
    runs = []
    start = time.monotonic()
    for i in range(args.runs):
        if args.budget_s is not None and i and time.monotonic() - start + runs[-1]["seconds"] > args.budget_s:
            print(f"stopping after {i} runs: the next would end past --budget-s {args.budget_s:.0f}", flush=True)
            break
        t0 = time.monotonic()
        # the runs' reports stay with their records (ignored), never in this repository's reports/
        opts = RunOptions(run_id=f"power-{time.strftime('%Y%m%dT%H%M%S')}-{i:02d}", force_cpu=args.cpu, aa=args.aa,
                          note=f"power run {i + 1} of {args.runs}", reports_root=ROOT / "profile" / "power" / "reports")
        _, _, report = run_experiment(loaded, opts, log=QuietProgress(write=lambda line: print(line, flush=True)))
        runs.append(summarize_run(report, time.monotonic() - t0))
        for failure in report["failures"][:3]:  # what went wrong, right where the table is read
            print(f"failure: {failure}", flush=True)
        (out / f"{stem}.json").write_text(json.dumps({"experiment": loaded.exp.name, "aa": args.aa,
                                                       "measure": loaded.exp.measure.model_dump(), "runs": runs},
                                                      indent=1))
        print("\n".join(table(runs[-1:])), flush=True)
    lines = table(runs)
    (out / f"{stem}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
