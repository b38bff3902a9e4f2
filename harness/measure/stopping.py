"""When a row is measured enough: stop once its interval is as narrow as declared, or its time is up.

The idea of nvbench's relative-noise criterion, on the nested model of harness/stats.py: after every
pair has its rounds, the speedup interval's relative half-width is compared with the target. If it
is wider, the variance components say what would narrow it: round-to-round noise shrinks with more
rounds per pair; per-process offsets (the between-pair part) only with more pairs. The rule projects
the half-width  t(P-1) * sqrt((between + within / R) / P)  and asks for the cheaper of the two.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from harness import stats

ROUND_STEP = 5  # rounds asked for at least, when more rounds are the answer


@dataclass
class Limits:
    target: float  # relative half-width
    min_rounds: int
    max_rounds: int
    max_pairs: int
    budget_s: float


@dataclass
class Decision:
    stop: str | None  # resolved | budget | limit | None (go on)
    detail: str
    rounds: int = 0  # rounds every pair should have next
    add_pairs: int = 0


def projected_half_width(between: float, within: float, pairs: int, rounds: int) -> float:
    """Relative half-width (approximately, on the log scale) with `pairs` pairs of `rounds` rounds."""
    if pairs < 2:
        return math.inf
    sd = math.sqrt(max(between, 0.0) + max(within, 0.0) / max(rounds, 1))
    return stats.t_half(sd, pairs)


def decide(iv: stats.Interval, pairs: int, rounds: int, elapsed_s: float, lim: Limits) -> Decision:
    """`iv`: the row's speedup interval now, over `pairs` live pairs that each have `rounds` rounds."""
    hw = iv.rel_half_width
    shown = "no interval yet" if hw is None else f"+-{hw:.3%}"
    if hw is not None and hw <= lim.target and rounds >= lim.min_rounds:
        return Decision("resolved", f"{shown} <= {lim.target:.3%} with {iv.n_blocks} pairs, {iv.n_rounds} rounds")
    if elapsed_s >= lim.budget_s:
        # within the target but short of min_rounds: pairs added late (a new wave) had fewer rounds
        short = (f"; within the target, but the pairs' fewest rounds, {rounds}, are under min_rounds "
                 f"{lim.min_rounds}" if hw is not None and hw <= lim.target else "")
        return Decision("budget", f"{shown} after {elapsed_s:.0f} s (budget {lim.budget_s:.0f} s){short}")
    if rounds < lim.min_rounds:
        return Decision(None, "below min_rounds", rounds=lim.min_rounds)
    between = iv.var_between if iv.var_between is not None else 0.0
    within = iv.var_within if iv.var_within is not None else 0.0
    if pairs < 2 or iv.var_between is None:
        need = max(2, 3 - pairs) if pairs < lim.max_pairs else 0
        if need:
            return Decision(None, "too few pairs for an interval", rounds=rounds, add_pairs=need)
    # the fewest rounds (at this many pairs) that would reach the target, if any
    if rounds < lim.max_rounds:
        for r in range(rounds + ROUND_STEP, lim.max_rounds + ROUND_STEP, ROUND_STEP):
            r = min(r, lim.max_rounds)
            if projected_half_width(between, within, pairs, r) <= lim.target:
                return Decision(None, f"{shown}: {r} rounds should reach {lim.target:.3%}", rounds=r)
    if pairs < lim.max_pairs:
        r = max(rounds, lim.min_rounds)
        want = lim.max_pairs
        for p in range(pairs + 1, lim.max_pairs + 1):
            if projected_half_width(between, within, p, r) <= lim.target:
                want = p
                break
        return Decision(None, f"{shown}: per-process offsets dominate, {want} pairs should reach "
                              f"{lim.target:.3%}", rounds=r, add_pairs=want - pairs)
    if rounds < lim.max_rounds:
        return Decision(None, f"{shown}: at max_pairs, more rounds", rounds=min(lim.max_rounds, rounds + ROUND_STEP))
    return Decision("limit", f"{shown} at max_pairs {lim.max_pairs} and max_rounds {lim.max_rounds}")
