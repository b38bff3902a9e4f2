"""How often the stopping rule's final 95% interval misses the truth, by Monte Carlo (CPU, seconds).

    python3 tools/stopping_coverage.py [--runs 1500] [--seed 0] [--pairs 8] [--max-pairs 12]

Each simulated row is what the lockstep driver does at one row of an A/A (truth 1.0): `--pairs`
worker pairs start, each side of a pair with its own per-process offset (normal, sigma_proc), each
round a ratio of the two sides' calls with per-round noise (normal, sigma_round); rounds are added in
whole side-order cycles; at every look harness/stats.py `ratio_interval` is computed and
harness/measure/stopping.py `decide` says stop, add rounds or add pairs (up to --max-pairs), exactly
as in a run, with the row budget left out (time is not simulated). Prints the miss rate per
(sigma_proc, sigma_round) and what ended the rows. A calibrated rule misses about 5%: looking again
after each batch (stopping when the interval is narrow) would show here as a higher miss rate.
tests/test_stats.py pins coverage in CI; this tool is the long version behind docs/perf/pkda.md
("Do identical-code intervals miss 1.0 too often?").
"""
from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import stats  # noqa: E402
from harness.measure import stopping  # noqa: E402

SIDE_ORDER_CYCLE = 6  # rounds in one cycle of side orders: the driver adds rounds in whole cycles


def whole_cycles(rounds: int) -> int:
    return -(-rounds // SIDE_ORDER_CYCLE) * SIDE_ORDER_CYCLE


def simulate_row(rng: np.random.Generator, sigma_proc: float, sigma_round: float, lim: stopping.Limits,
                 pairs: int) -> tuple[stats.Interval, str]:
    """One A/A row to its stop: the final interval and what ended it."""
    offsets: dict[int, np.ndarray] = {}
    rounds: Counter[int] = Counter()
    series = stats.Series()
    for p in range(pairs):
        offsets[p] = rng.normal(0.0, sigma_proc, 2)
    target = whole_cycles(lim.min_rounds)
    while True:
        for p, (base, cand) in offsets.items():
            while rounds[p] < target:
                series.add(p, stats.Round([math.exp(base + rng.normal(0.0, sigma_round))],
                                          [math.exp(cand + rng.normal(0.0, sigma_round))]))
                rounds[p] += 1
        iv = stats.ratio_interval(series, "base", "cand")
        decision = stopping.decide(iv, len(offsets), min(rounds.values()), 0.0, lim)
        if decision.stop:
            return iv, decision.stop
        for p in range(len(offsets), len(offsets) + decision.add_pairs):
            offsets[p] = rng.normal(0.0, sigma_proc, 2)
        target = max(target, whole_cycles(decision.rounds))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1500, help="simulated rows per noise setting")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pairs", type=int, default=8, help="pairs a row starts with (measure.pairs)")
    ap.add_argument("--max-pairs", type=int, default=12, help="measure.max_pairs")
    ap.add_argument("--target", type=float, default=0.005, help="measure.target_half_width")
    ap.add_argument("--min-rounds", type=int, default=10)
    ap.add_argument("--max-rounds", type=int, default=60)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    lim = stopping.Limits(args.target, args.min_rounds, args.max_rounds, args.max_pairs, math.inf)
    print("sigma_proc sigma_round  miss   ended by (misses)")
    for sigma_proc in (0.001, 0.002, 0.003, 0.004, 0.005):
        for sigma_round in (0.002, 0.01):
            ended: Counter[str] = Counter()
            missed: Counter[str] = Counter()
            for _ in range(args.runs):
                iv, why = simulate_row(rng, sigma_proc, sigma_round, lim, args.pairs)
                ended[why] += 1
                missed[why] += not (iv.lo <= 1.0 <= iv.hi)
            how = ", ".join(f"{k} {n} ({missed[k]})" for k, n in sorted(ended.items()))
            print(f"{sigma_proc:10.3f} {sigma_round:11.3f}  {sum(missed.values()) / args.runs:.3f}  {how}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
