"""Statistics of interleaved A/B timing blocks: summaries, block-bootstrap speedup intervals,
geomeans, time ratios, the A/A noise floor and a rank test shown as a secondary signal.

Pure functions, no I/O; given the same inputs and seed the results are identical.

The block (one fresh, warmed process) is the unit of independence. Baseline block i is paired
with candidate block i in the order they were run, so slow drift between blocks (clocks,
temperature, neighbours) hits both members of a pair and cancels in the ratio. The bootstrap
resamples pair indices with replacement and recomputes the statistic on the pooled samples of
the chosen blocks; samples inside a block are never resampled on their own, because they are
not independent of each other. Every interval is the union of that bootstrap interval and a
paired Student-t interval on the per-pair log ratios (`_union` says why: with the 3-5 pairs a
run affords, the percentile bootstrap alone covers far less than its nominal 95%).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
from scipy import stats as _st

QUANTILE_METHOD = "linear"  # numpy's default, Hyndman & Fan type 7
DEFAULT_RESAMPLES = 9999
DEFAULT_CI_METHOD = "percentile"  # works with 3 blocks; BCa's jackknife is unstable there
_MAX_CELLS = 2_000_000  # resamples x pooled samples evaluated per vectorised call

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


@dataclass
class Interval:
    point: float | None
    lo: float | None
    hi: float | None
    confidence: float
    n_blocks: int  # pairs of blocks the interval was resampled from
    method: str
    n_base_blocks: int = 0
    n_cand_blocks: int = 0
    note: str = ""
    # the two intervals whose union is [lo, hi] (see `_union`): the block bootstrap's and the paired
    # Student-t interval on the per-pair log ratios
    boot_lo: float | None = None
    boot_hi: float | None = None
    t_lo: float | None = None
    t_hi: float | None = None

    @property
    def half_width(self) -> float | None:
        return None if self.lo is None or self.hi is None else (self.hi - self.lo) / 2

    def to_json(self) -> dict:
        return asdict(self)


# --- pooled medians of resampled blocks ---------------------------------------------------------

def _clean_blocks(blocks: Blocks) -> list[np.ndarray]:
    return [np.asarray(b, dtype=float).ravel() for b in blocks]


def _pooled_median(blocks: list[np.ndarray]) -> float | None:
    pooled = np.concatenate(blocks) if blocks else np.empty(0)
    return float(np.median(pooled)) if pooled.size else None


def _padded(blocks: list[np.ndarray]) -> np.ndarray:
    """Blocks as rows of a (n_blocks, max_len) array, NaN-padded."""
    width = max((b.size for b in blocks), default=0)
    out = np.full((len(blocks), max(width, 1)), np.nan)
    for i, b in enumerate(blocks):
        out[i, : b.size] = b
    return out


def _resampled_medians(padded: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Median of the pooled samples of blocks idx[..., :] for every leading index of idx.

    Equivalent to np.median(np.concatenate([blocks[i] for i in row])) per row; NaN padding sorts
    last and is excluded by counting the real values."""
    chosen = padded[idx].reshape(*idx.shape[:-1], -1)  # (..., n * width)
    chosen = np.sort(chosen, axis=-1)
    k = np.sum(~np.isnan(chosen), axis=-1)
    lo_i = np.maximum((k - 1) // 2, 0)[..., None]
    hi_i = (k // 2)[..., None]
    med = (np.take_along_axis(chosen, lo_i, -1) + np.take_along_axis(chosen, hi_i, -1))[..., 0] / 2
    return np.where(k > 0, med, np.nan)


def _pairs(base_blocks: Blocks, cand_blocks: Blocks) -> tuple[list[np.ndarray], list[np.ndarray], str]:
    base, cand = _clean_blocks(base_blocks), _clean_blocks(cand_blocks)
    note = ""
    if len(base) != len(cand):
        n = min(len(base), len(cand))
        note = (f"block counts differ (baseline {len(base)}, candidate {len(cand)}): "
                f"the point and interval pair the first {n} of each by position")
    return base, cand, note


def _paired_t(logs: np.ndarray, confidence: float) -> tuple[float | None, float | None]:
    """Student-t interval of exp(mean log r) over n independent pair log ratios (None if n < 2)."""
    logs = np.asarray(logs, dtype=float)
    logs = logs[np.isfinite(logs)]
    n = logs.size
    if n < 2:
        return None, None
    half = float(_st.t.ppf((1 + confidence) / 2, n - 1)) * float(np.std(logs, ddof=1)) / math.sqrt(n)
    m = float(np.mean(logs))
    return math.exp(m - half), math.exp(m + half)


def _pair_log_ratios(base: list[np.ndarray], cand: list[np.ndarray], n: int) -> np.ndarray:
    """log(median of baseline block i / median of candidate block i) for the first n pairs."""
    out = np.full(n, np.nan)
    for i in range(n):
        if base[i].size and cand[i].size:
            mb, mc = np.median(base[i]), np.median(cand[i])
            if mb > 0 and mc > 0:
                out[i] = math.log(mb / mc)
    return out


def _union(out: Interval, boot: tuple[float | None, float | None], t: tuple[float | None, float | None],
           used: str) -> None:
    """[lo, hi] = the union of the block-bootstrap and the paired-t intervals.

    A percentile bootstrap over n block pairs resamples only those n pairs, so its interval never
    reaches past what they show: with 3 pairs the true ratio lies outside the pairs' own range with
    probability 2/2^3 = 25% (process-to-process spread), so its actual coverage is at most 75%, not
    95%. The t interval on the pairs' log ratios is honest about small n (t = 4.30 at 3 pairs);
    the union is never narrower than either, so a gate decided on it claims no more than both support.
    """
    out.boot_lo, out.boot_hi = boot
    out.t_lo, out.t_hi = t
    los = [v for v in (boot[0], t[0]) if v is not None]
    his = [v for v in (boot[1], t[1]) if v is not None]
    out.lo, out.hi = (min(los) if los else None), (max(his) if his else None)
    out.method = used + (" + paired t" if t[0] is not None else "")


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _bootstrap_ci(n_pairs: int, statistic, cells_per_resample: int, confidence: float,
                  n_resamples: int, seed: int, method: str) -> tuple[float | None, float | None, str, str]:
    """Bootstrap over pair indices 0..n_pairs-1; returns (lo, hi, method used, note).

    `statistic(idx)` maps an integer array (..., n_pairs) of resampled pair indices to the
    statistic per leading index. If the requested method fails (BCa on degenerate or tiny data)
    the percentile interval is used instead and the fallback is recorded."""
    batch = max(1, min(n_resamples, _MAX_CELLS // max(cells_per_resample, 1)))

    def stat(i, axis=-1):
        return statistic(np.asarray(i).astype(np.intp))

    note = ""
    for m in ([method, "percentile"] if method != "percentile" else ["percentile"]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                res = _st.bootstrap((np.arange(n_pairs),), stat, n_resamples=n_resamples, batch=batch,
                                    vectorized=True, axis=-1, confidence_level=confidence,
                                    method=m, rng=_rng(seed))
            except Exception as e:  # scipy refuses some degenerate inputs outright
                note = f"{m} bootstrap failed ({type(e).__name__}: {e}); "
                continue
        lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
        if math.isfinite(lo) and math.isfinite(hi):
            return lo, hi, f"block bootstrap, {m}", note + ("fell back to percentile" if note else "")
        note = f"{m} bootstrap gave no finite interval; "
    # every resample was degenerate in a way scipy could not summarise: fall back to numpy
    idx = _rng(seed).integers(0, n_pairs, size=(n_resamples, n_pairs))
    dist = statistic(idx)
    dist = dist[np.isfinite(dist)]
    if dist.size == 0:
        return None, None, "block bootstrap, none", note + "no finite resample"
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(dist, [alpha, 1 - alpha], method=QUANTILE_METHOD)
    return float(lo), float(hi), "block bootstrap, percentile (numpy)", note + "computed directly"


# --- speedup and its relatives ------------------------------------------------------------------

def paired_block_speedup(base_blocks: Blocks, cand_blocks: Blocks, confidence: float = 0.95,
                         n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
                         method: str = DEFAULT_CI_METHOD) -> Interval:
    """Speedup S = median(all baseline samples) / median(all candidate samples), with a block
    bootstrap interval over blocks paired by position (i-th baseline with i-th candidate).
    When the block counts differ (a failed block), both the point and the interval use the first
    min(n) blocks of each side, and `note` says so.

    With fewer than 2 pairs (or a side without samples) the interval bounds are None."""
    base, cand, note = _pairs(base_blocks, cand_blocks)
    n, n_base, n_cand = min(len(base), len(cand)), len(base), len(cand)
    if n >= 2 and len(base) != len(cand):
        # the point describes the same paired blocks as its interval (else it can fall outside)
        base, cand = base[:n], cand[:n]
    mb, mc = _pooled_median(base), _pooled_median(cand)
    point = mb / mc if mb is not None and mc is not None and mc > 0 else None
    out = Interval(point, None, None, confidence, n, "none", n_base, n_cand, note)
    if point is None:
        out.note = "; ".join(x for x in (note, "a side has no samples") if x)
        return out
    if n < 2:
        out.note = "; ".join(x for x in (note, f"{n} block pair(s): no interval") if x)
        return out
    pb, pc = _padded(base[:n]), _padded(cand[:n])

    def ratio(idx: np.ndarray) -> np.ndarray:
        return _resampled_medians(pb, idx) / _resampled_medians(pc, idx)

    lo, hi, used, bnote = _bootstrap_ci(n, ratio, n * (pb.shape[1] + pc.shape[1]), confidence,
                                        n_resamples, seed, method)
    _union(out, (lo, hi), _paired_t(_pair_log_ratios(base, cand, n), confidence), used)
    out.note = "; ".join(x for x in (note, bnote) if x)
    return out


def geomean_speedup(rows: Sequence[tuple[Blocks, Blocks]], confidence: float = 0.95,
                    n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
                    method: str = DEFAULT_CI_METHOD) -> Interval:
    """Equal-weight geometric mean exp(mean_i log S_i) of the rows' speedups.

    Blocks are shared by every row (one block runs all shapes), so one resample of pair indices
    is applied to all rows at once; the interval is the bootstrap distribution of the geomean.
    Rows with different block counts are paired over the first min(n) blocks."""
    rows = [_pairs(b, c) for b, c in rows]
    n_base = min((len(b) for b, _, _ in rows), default=0)
    n_cand = min((len(c) for _, c, _ in rows), default=0)
    points = []
    for base, cand, _ in rows:
        mb, mc = _pooled_median(base), _pooled_median(cand)
        points.append(mb / mc if mb is not None and mc is not None and mc > 0 else None)
    notes = sorted({n for _, _, n in rows if n})
    if not rows or any(p is None or p <= 0 for p in points):
        return Interval(None, None, None, confidence, 0, "none", n_base, n_cand,
                        "; ".join(notes + ["a row has no samples on a side" if rows else "no rows"]))
    point = float(np.exp(np.mean(np.log(points))))
    n = min(min(len(b), len(c)) for b, c, _ in rows)
    if len({min(len(b), len(c)) for b, c, _ in rows}) > 1:
        notes.append(f"rows have different block counts: pairs 0..{n - 1} are resampled jointly")
    out = Interval(point, None, None, confidence, n, "none", n_base, n_cand, "; ".join(notes))
    if n < 2:
        out.note = "; ".join(notes + [f"{n} block pair(s): no interval"])
        return out
    padded = [(_padded(b[:n]), _padded(c[:n])) for b, c, _ in rows]
    cells = n * sum(pb.shape[1] + pc.shape[1] for pb, pc in padded)

    def geo(idx: np.ndarray) -> np.ndarray:
        logs = [np.log(_resampled_medians(pb, idx) / _resampled_medians(pc, idx)) for pb, pc in padded]
        return np.exp(np.mean(logs, axis=0))

    lo, hi, used, bnote = _bootstrap_ci(n, geo, cells, confidence, n_resamples, seed, method)
    # the geomean of pair i over the rows: the rows of one pair share its two processes
    pair_logs = np.mean([_pair_log_ratios(b, c, n) for b, c, _ in rows], axis=0)
    _union(out, (lo, hi), _paired_t(pair_logs, confidence), used)
    out.note = "; ".join(notes + ([bnote] if bnote else []))
    return out


def reciprocal(iv: Interval) -> Interval:
    """1/x of an interval of a positive quantity: a speedup interval becomes a time-ratio one."""
    inv = lambda v: None if v is None or v <= 0 else 1.0 / v  # noqa: E731
    return Interval(inv(iv.point), inv(iv.hi), inv(iv.lo), iv.confidence, iv.n_blocks, iv.method,
                    iv.n_base_blocks, iv.n_cand_blocks, iv.note, inv(iv.boot_hi), inv(iv.boot_lo),
                    inv(iv.t_hi), inv(iv.t_lo))


def time_ratio(base_blocks: Blocks, cand_blocks: Blocks, confidence: float = 0.95,
               n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
               method: str = DEFAULT_CI_METHOD) -> Interval:
    """Candidate time / baseline time (1.02 = candidate 2% slower) with its interval: the
    reciprocal of the paired block speedup interval (same resamples, bounds swapped)."""
    return reciprocal(paired_block_speedup(base_blocks, cand_blocks, confidence, n_resamples, seed, method))


def aa_noise_floor(a_blocks: Blocks, b_blocks: Blocks, confidence: float = 0.95,
                   n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
                   method: str = DEFAULT_CI_METHOD) -> float:
    """Half-width of the speedup interval of an A/A comparison (the same code on both sides of the
    interleaving), as a fraction: 0.012 means the harness cannot resolve differences below ~1.2%.
    NaN when there are too few blocks for an interval."""
    iv = paired_block_speedup(a_blocks, b_blocks, confidence, n_resamples, seed, method)
    hw = iv.half_width
    return float("nan") if hw is None else float(hw)


def block_spread(blocks: Blocks) -> float:
    """Half the range of the per-block medians over the pooled median: how far apart fresh processes
    of the same code land (a within-run stand-in for the A/A noise floor). NaN with < 2 blocks."""
    cleaned = [b for b in _clean_blocks(blocks) if b.size]
    if len(cleaned) < 2:
        return float("nan")
    medians = np.array([np.median(b) for b in cleaned])
    pooled = _pooled_median(cleaned)
    return float((medians.max() - medians.min()) / (2 * pooled)) if pooled else float("nan")


def mann_whitney_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided Mann-Whitney U p-value over all samples of two sides. A secondary signal only:
    it treats samples as independent, which samples inside one block are not. NaN if a side is empty."""
    x, y = np.asarray(a, dtype=float).ravel(), np.asarray(b, dtype=float).ravel()
    if x.size == 0 or y.size == 0:
        return float("nan")
    return float(_st.mannwhitneyu(x, y, alternative="two-sided").pvalue)
