"""`harness attempts EXP`: the attempt log as a table, and the experiment's state (OPEN/STOPPED/TERMINAL_NO_GO)."""
from __future__ import annotations

from harness.results import add_results_arguments, roots_from_args
from harness.spec import load_experiment


def add_parser(sub) -> None:
    p = sub.add_parser("attempts", help="print the attempt log and the stop state of an experiment")
    p.add_argument("experiment", help="path to experiments/<name>.yaml")
    add_results_arguments(p, reports=False)
    p.add_argument("--reopen", metavar="REASON", default=None,
                   help="log an explicit reopen (a new window of max_attempts) with this reason")
    p.add_argument("--json", action="store_true", help="print the log and state as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    import json

    from harness import attempts
    from harness.cli import UsageError

    loaded = load_experiment(args.experiment)
    exp = loaded.exp
    profile_root, _ = roots_from_args(args, loaded.path)
    if args.reopen is not None:
        try:
            entry = attempts.reopen(profile_root, exp.name, args.reopen, max_attempts=exp.max_attempts)
        except attempts.AttemptError as e:
            raise UsageError(str(e)) from e
        print(f"reopened {exp.name}: {entry['reason']}")
    entries = attempts.read_log(profile_root, exp.name)
    state = attempts.attempt_state(profile_root, exp)
    if args.json:
        print(json.dumps({"experiment": exp.name, "state": state, "log": entries}, indent=2, sort_keys=True))
    elif not entries:
        print(f"{exp.name}: no attempts logged\nstate: {state.get('state')} - {state.get('reason')}")
    else:
        print(attempts.format_table(entries, state))
    return 0
