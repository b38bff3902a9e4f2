"""Statistics of a comparison: summaries, and intervals that respect how the samples were taken.

Pure functions, no I/O. The data model is nested (../shared/design/harness.md, "How a comparison is
measured"):

    calls  in  bursts  in  rounds  in  worker pairs
    (one timed call)   (back to back,   (one burst per side,   (one fresh process per side,
                        one process)     adjacent in time)      long-lived, warmed once)

A `Round` holds one burst per side; a `Series` holds, per worker pair, its rounds on one row and
timing basis. The first engine (a fresh process per block) fits the same model: its i-th baseline
and i-th candidate block are one pair with one round whose bursts are the blocks' samples.

The estimator (`ratio_interval`): in every round, log(median of one side's burst / median of the
other's); a pair's estimate is the mean over its rounds; the point is exp(mean over pairs), and the
95% interval a Student-t interval over the pair estimates with P-1 degrees of freedom. Drift that
hits both bursts of a round cancels in its ratio (the side order alternates between rounds); noise
between rounds averages out within a pair; a per-process offset (fresh processes of identical code
land up to +-1.5% apart on the H200 even for a compute-bound call) differs from pair to pair, and
only the spread of the pair estimates shows it: so the pair, not the round or the call, is the unit
of independence, and the interval pays for every pair it lacks (t = 4.30 at 3 pairs, 2.36 at 8).
Coverage is a measured property: tests/test_stats.py simulates it, with the stopping rule.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

import numpy as np
from scipy import stats as _st

QUANTILE_METHOD = "linear"  # numpy's default, Hyndman & Fan type 7
CONFIDENCE = 0.95
METHOD = "t over worker pairs of mean per-round log ratios"

Blocks = Sequence[Sequence[float]]


@dataclass
class Summary:
    n: int
    median: float | None
    mean: float | None
    std: float | None  # sample std (ddof=1); None when n < 2
    min: float | None
    p10: float | None
    p90: float | None
    quantile_method: str = QUANTILE_METHOD

    def to_json(self) -> dict:
        return asdict(self)


def summarize(values: Sequence[float]) -> Summary:
    """n, median, mean, std (ddof=1), min, p10, p90 of one (side, shape, mode); quantiles are
    numpy's 'linear' method (type 7). Undefined statistics are None, not NaN."""
    x = np.asarray(values, dtype=float).ravel()
    n = int(x.size)
    if n == 0:
        return Summary(0, None, None, None, None, None, None)
    p10, p50, p90 = np.quantile(x, [0.10, 0.50, 0.90], method=QUANTILE_METHOD)
    std = float(np.std(x, ddof=1)) if n >= 2 else None
    return Summary(n=n, median=float(p50), mean=float(np.mean(x)), std=std, min=float(np.min(x)),
                   p10=float(p10), p90=float(p90))


# --- the nested data ---------------------------------------------------------------------------

SIDE_FIELDS = ("base", "cand", "control")


@dataclass
class Round:
    """One round of one worker pair on one row and basis: a burst of timed calls (ms) per side.
    `control` is the burst of the pair's baseline twin (the A/A control), when one was measured."""

    base: list[float]
    cand: list[float]
    control: list[float] | None = None

    def burst(self, side: str) -> list[float] | None:
        return getattr(self, side)


@dataclass
class Series:
    """Every round of one row on one timing basis, per worker pair (pair id -> rounds in order)."""

    pairs: dict[int, list[Round]] = field(default_factory=dict)

    @classmethod
    def from_blocks(cls, base_blocks: Blocks, cand_blocks: Blocks) -> "Series":
        """The first engine's blocks: the i-th baseline and i-th candidate block are pair i, one round."""
        n = min(len(base_blocks), len(cand_blocks))
        if n == 0:  # one side has no blocks: keep the other's, so a reader can say which side is missing
            return cls({i: [Round(list(b), [])] for i, b in enumerate(base_blocks)} or
                       {i: [Round([], list(c))] for i, c in enumerate(cand_blocks)})
        return cls({i: [Round(list(base_blocks[i]), list(cand_blocks[i]))] for i in range(n)})

    def add(self, pair: int, rnd: Round) -> None:
        self.pairs.setdefault(pair, []).append(rnd)

    def samples(self, side: str) -> list[float]:
        """Every call of one side, pooled (for summaries: median, p10, p90 of the calls)."""
        return [x for rounds in self.pairs.values() for r in rounds for x in (r.burst(side) or [])]

    def per_pair(self, side: str) -> list[list[float]]:
        """One side's calls per pair, pooled over the pair's rounds (pairs in id order)."""
        return [[x for r in self.pairs[p] for x in (r.burst(side) or [])] for p in sorted(self.pairs)]

    @property
    def n_rounds(self) -> int:
        return sum(len(r) for r in self.pairs.values())

    def has(self, side: str) -> bool:
        return any(r.burst(side) for rounds in self.pairs.values() for r in rounds)

    def __bool__(self) -> bool:
        return bool(self.pairs)


def _median(x: Sequence[float] | None) -> float | None:
    if not x:
        return None
    m = float(np.median(np.asarray(x, dtype=float)))
    return m if m > 0 and math.isfinite(m) else None


def round_log_ratios(rounds: Iterable[Round], num: str, den: str) -> list[float]:
    """log(median(num burst) / median(den burst)) of every round where both bursts have a positive median."""
    out = []
    for r in rounds:
        a, b = _median(r.burst(num)), _median(r.burst(den))
        if a is not None and b is not None:
            out.append(math.log(a / b))
    return out


def pair_estimates(series: Series, num: str, den: str) -> dict[int, list[float]]:
    """Per pair (with at least one usable round): its rounds' log ratios, in order."""
    out = {}
    for pair in sorted(series.pairs):
        logs = round_log_ratios(series.pairs[pair], num, den)
        if logs:
            out[pair] = logs
    return out


@dataclass
class Interval:
    point: float | None
    lo: float | None
    hi: float | None
    confidence: float
    n_blocks: int  # worker pairs the interval is computed over (the first engine: block pairs)
    method: str
    n_base_blocks: int = 0
    n_cand_blocks: int = 0
    note: str = ""
    n_rounds: int = 0  # usable rounds over those pairs
    # variance components on the log scale (the stopping rule projects from them): between pairs
    # (per-process offsets), and within a pair from round to round
    var_between: float | None = None
    var_within: float | None = None

    @property
    def half_width(self) -> float | None:
        return None if self.lo is None or self.hi is None else (self.hi - self.lo) / 2

    @property
    def rel_half_width(self) -> float | None:
        """Half the interval's width as a fraction of its point (0.005 = +-0.5%)."""
        hw = self.half_width
        return None if hw is None or not self.point else hw / self.point

    def contains(self, value: float) -> bool | None:
        return None if self.lo is None or self.hi is None else self.lo <= value <= self.hi

    def to_json(self) -> dict:
        d = asdict(self)
        d["rel_half_width"] = self.rel_half_width
        return d


def t_half(sd: float, n: int, confidence: float = CONFIDENCE) -> float:
    """Half-width of a Student-t interval of a mean of n values with sample sd `sd` (log scale)."""
    return float(_st.t.ppf((1 + confidence) / 2, n - 1)) * sd / math.sqrt(n)


def _components(per_pair: dict[int, list[float]]) -> tuple[float | None, float | None]:
    """(between-pair variance of the true pair means, within-pair variance of one round's log ratio):
    one-way random effects by moments, the between part clipped at 0."""
    within = [np.var(v, ddof=1) for v in per_pair.values() if len(v) >= 2]
    var_within = float(np.mean(within)) if within else None
    means = [float(np.mean(v)) for v in per_pair.values()]
    if len(means) < 2:
        return None, var_within
    mean_rounds = float(np.mean([len(v) for v in per_pair.values()]))
    between = float(np.var(means, ddof=1)) - (var_within or 0.0) / mean_rounds
    return max(0.0, between), var_within


def ratio_interval(series: Series, num: str = "base", den: str = "cand",
                   confidence: float = CONFIDENCE) -> Interval:
    """exp(mean over pairs of each pair's mean round log ratio) of num/den time, with its t interval
    over pairs. num="base", den="cand" is the speedup (baseline time / candidate time); num="cand",
    den="base" the time ratio; num="control", den="base" the A/A control's time ratio.
    With fewer than 2 usable pairs there is no interval (one pair cannot show per-process offsets)."""
    per_pair = pair_estimates(series, num, den)
    n_pairs, n_rounds = len(per_pair), sum(len(v) for v in per_pair.values())
    out = Interval(None, None, None, confidence, n_pairs, METHOD, n_pairs, n_pairs, "", n_rounds)
    if not per_pair:
        sides = [s for s in (num, den) if not series.has(s)]
        out.note = f"no {' and '.join(sides)} samples" if sides else "no usable round"
        return out
    means = np.array([np.mean(v) for v in per_pair.values()])
    center = float(np.mean(means))
    out.point = math.exp(center)
    out.var_between, out.var_within = _components(per_pair)
    if n_pairs < 2:
        out.note = "1 worker pair: no interval (per-process offsets are unseen with one pair)"
        return out
    half = t_half(float(np.std(means, ddof=1)), n_pairs, confidence)
    out.lo, out.hi = math.exp(center - half), math.exp(center + half)
    return out


def geomean_interval(series_list: Sequence[Series], num: str = "base", den: str = "cand",
                     confidence: float = CONFIDENCE) -> Interval:
    """Equal-weight geometric mean over rows of num/den time, exp(mean_rows mean_pairs L), with a t
    interval over the worker pairs every row shares: the rows of one pair ran in the same two
    processes, so a process offset moves them together and the pair, again, is the unit."""
    per_row = [pair_estimates(s, num, den) for s in series_list]
    if not per_row or any(not r for r in per_row):
        return Interval(None, None, None, confidence, 0, METHOD,
                        note="a row has no usable round on a side" if per_row else "no rows")
    common = sorted(set.intersection(*(set(r) for r in per_row)))
    n_rounds = sum(len(r[p]) for r in per_row for p in common)
    out = Interval(None, None, None, confidence, len(common), METHOD, len(common), len(common), "", n_rounds)
    if len(common) >= 2:
        pair_means = np.array([np.mean([np.mean(r[p]) for r in per_row]) for p in common])
        center = float(np.mean(pair_means))
        half = t_half(float(np.std(pair_means, ddof=1)), len(common), confidence)
        out.point, out.lo, out.hi = math.exp(center), math.exp(center - half), math.exp(center + half)
        dropped = sorted({p for r in per_row for p in r} - set(common))
        if dropped:
            out.note = f"pairs {dropped} did not measure every row: the geomean uses the {len(common)} pairs that did"
        return out
    # rows measured by different pairs (e.g. older records): combine the rows as independent
    ivs = [ratio_interval(s, num, den, confidence) for s in series_list]
    logs = [math.log(iv.point) for iv in ivs]
    out.point = math.exp(float(np.mean(logs)))
    out.n_blocks = min(iv.n_blocks for iv in ivs)
    out.note = "rows share fewer than 2 worker pairs: combined as independent rows"
    if any(iv.lo is None for iv in ivs):
        out.note += "; a row has no interval"
        return out
    # each row's log-scale variance of its mean and its degrees of freedom; Welch-Satterthwaite df
    parts = []
    for iv in ivs:
        df = iv.n_blocks - 1
        se = (math.log(iv.hi) - math.log(iv.lo)) / 2 / float(_st.t.ppf((1 + confidence) / 2, df))
        parts.append((se ** 2 / len(ivs) ** 2, df))
    var = sum(v for v, _ in parts)
    df = var ** 2 / sum(v ** 2 / d for v, d in parts) if var > 0 else 1.0
    half = float(_st.t.ppf((1 + confidence) / 2, df)) * math.sqrt(var)
    out.lo, out.hi = out.point * math.exp(-half), out.point * math.exp(half)
    return out


def reciprocal(iv: Interval) -> Interval:
    """1/x of an interval of a positive quantity: a speedup interval becomes a time-ratio one."""
    inv = lambda v: None if v is None or v <= 0 else 1.0 / v  # noqa: E731
    return Interval(inv(iv.point), inv(iv.hi), inv(iv.lo), iv.confidence, iv.n_blocks, iv.method,
                    iv.n_base_blocks, iv.n_cand_blocks, iv.note, iv.n_rounds, iv.var_between, iv.var_within)


# --- the first engine's block lists, through the same estimator ---------------------------------

def paired_block_speedup(base_blocks: Blocks, cand_blocks: Blocks, confidence: float = CONFIDENCE) -> Interval:
    """Speedup of blocks paired by position (i-th baseline with i-th candidate; one round each)."""
    iv = ratio_interval(Series.from_blocks(base_blocks, cand_blocks), "base", "cand", confidence)
    iv.n_base_blocks, iv.n_cand_blocks = len(base_blocks), len(cand_blocks)
    if len(base_blocks) != len(cand_blocks):
        n = min(len(base_blocks), len(cand_blocks))
        iv.note = "; ".join(x for x in (f"block counts differ (baseline {len(base_blocks)}, candidate "
                                        f"{len(cand_blocks)}): the first {n} of each are paired", iv.note) if x)
    return iv


def geomean_speedup(rows: Sequence[tuple[Blocks, Blocks]], confidence: float = CONFIDENCE) -> Interval:
    return geomean_interval([Series.from_blocks(b, c) for b, c in rows], "base", "cand", confidence)


def time_ratio(base_blocks: Blocks, cand_blocks: Blocks, confidence: float = CONFIDENCE) -> Interval:
    """Candidate time / baseline time (1.02 = candidate 2% slower) of paired blocks."""
    return reciprocal(paired_block_speedup(base_blocks, cand_blocks, confidence))


def pair_spread(series: Series, side: str = "base") -> float:
    """Half the range of one side's per-pair medians over its pooled median: how far apart fresh
    processes of the same code land (a within-run stand-in for an A/A control). NaN with < 2 pairs."""
    medians = [m for m in (_median(x) for x in series.per_pair(side)) if m is not None]
    pooled = _median(series.samples(side))
    if len(medians) < 2 or not pooled:
        return float("nan")
    return float((max(medians) - min(medians)) / (2 * pooled))


def block_spread(blocks: Blocks) -> float:
    """`pair_spread` of one side's blocks (the first engine)."""
    return pair_spread(Series.from_blocks(blocks, blocks), "base")


def mann_whitney_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided Mann-Whitney U p-value over all samples of two sides. A secondary signal only:
    it treats samples as independent, which samples of one process are not. NaN if a side is empty."""
    x, y = np.asarray(a, dtype=float).ravel(), np.asarray(b, dtype=float).ravel()
    if x.size == 0 or y.size == 0:
        return float("nan")
    return float(_st.mannwhitneyu(x, y, alternative="two-sided").pvalue)
