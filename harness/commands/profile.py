"""`harness profile EXP`: stage attribution of the untouched baseline and the Amdahl pre-gate, alone.

Writes profile/<exp>/profile/<timestamp>/profile.json (the same record `harness run` writes into its
run directory) and prints the table. Exit 0 PASS, 1 FAIL (terminal NO-GO), 3 INCONCLUSIVE, 2 bad input
or an error (a stage that matches nothing, a kernel in two stages, the op failing).
"""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from harness.cli import UsageError
from harness.revisions import RevisionError, resolve
from harness.results import add_results_arguments, roots_from_args
from harness.spec import load_experiment


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="profile the baseline's stages and decide the Amdahl pre-gate")
    p.add_argument("experiment", help="path to experiments/<name>.yaml")
    add_results_arguments(p, reports=False)
    p.add_argument("--cpu", action="store_true", help="profile on CPU (Triton interpreter, fp32) even when a GPU is present")
    p.add_argument("--top", type=int, default=12, help="kernels shown per row (all are in profile.json)")
    p.set_defaults(func=run)


def _ms(x) -> str:
    return "-" if x is None else f"{x:.4g}"


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def print_record(record: dict, top: int = 12, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    bw = (record.get("copy_bandwidth") or {}).get("bytes_per_s")
    console.print(f"[bold]{record['experiment']}[/] baseline {str(record.get('sha', ''))[:12]}"
                  f"{'  [CPU smoke test]' if record.get('cpu_mode') else ''}"
                  + (f"  copy bandwidth {bw / 1e9:.1f} GB/s (read+write)" if bw else ""))
    stages = list(record.get("stages") or {})
    for r in record["rows"]:
        if r.get("error"):
            console.print(f"[bold]{r['row']}[/]: [red]{r['error']}[/]")
            continue
        t = Table(title=f"{r['row']}: endpoint {_ms(r['endpoint_ms'])} ms (wall), kernels {_ms(r['device_total_ms'])} ms "
                        f"(device), removable {r.get('removable_bytes') or 0:.4g} B = {_ms(r.get('removable_floor_ms'))} ms floor")
        for col in ("stage", "ms", "share of wall", "share of device", "kernel names"):
            t.add_column(col, justify="left" if col == "stage" else "right")
        for s in stages:
            st = r["stages"][s]
            t.add_row(s, _ms(st["ms"]), _pct(st["share_wall"]), _pct(st["share_device"]), str(st["kernels"]))
        t.add_row("[yellow]unassigned[/]", _ms(r["unassigned_ms"]), _pct(r["stage_share_wall"].get("unassigned")),
                  _pct(r["stage_share_device"].get("unassigned")), str(len(r["unassigned"])))
        t.add_row("host/gaps", _ms(r["gap_ms"]), _pct(r["stage_share_wall"].get("host/gaps")), "", "")
        console.print(t)
    for r in record["rows"]:
        if r.get("error"):
            continue
        k = Table(title=f"{r['row']}: kernels (mean per call), largest first")
        for col in ("kernel", "stage", "ms", "launches", "device share"):
            k.add_column(col, justify="left" if col in ("kernel", "stage") else "right")
        for row in r["kernels"][:top]:
            k.add_row(row["name"][:80], row["stage"] or "[yellow]unassigned[/]", _ms(row["ms"]),
                      f"{row['launches']:.3g}", _pct(row["share_device"]))
        if len(r["kernels"]) > top:
            k.add_row(f"... {len(r['kernels']) - top} more in profile.json", "", "", "", "")
        console.print(k)
    for note in record.get("notes") or []:
        console.print(f"[yellow]note:[/] {note}")
    for e in record.get("errors") or []:
        console.print(f"[red]error:[/] {e['message']}")
    g = record["gate"]
    color = {"PASS": "green", "FAIL": "red"}.get(g["status"], "yellow")
    console.print(f"amdahl pre-gate: [{color}]{g['status'] or 'INCONCLUSIVE'}[/] {g['reason']}")


def run(args) -> int:
    from harness import profile
    from harness.device import cuda_available

    loaded = load_experiment(args.experiment)
    if loaded.exp.profile is None:
        raise UsageError(f"{loaded.path}: the experiment has no `profile:` section")
    root, _ = roots_from_args(args, loaded.path)
    cpu_mode = args.cpu or not cuda_available()
    try:
        revisions = resolve(loaded, root)
    except RevisionError as e:
        raise UsageError(str(e)) from e
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir = root / loaded.exp.name / "profile" / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    record = profile.profile_run(loaded, revisions, out_dir, root, cpu_mode=cpu_mode, log=print)
    print_record(record, top=args.top)
    print(f"record: {out_dir / 'profile.json'}")
    return profile.exit_code(record)
