"""Inline SVG figures for the verdict report, drawn with matplotlib from report.json values only.

Every function takes plain report.json data and returns an `<svg>` element as a string (no XML
header, no external references) ready to be placed in the HTML. Text goes into the SVG as text
(svg.fonttype none) so labels stay searchable; matplotlib's SVG writer escapes it.
"""
from __future__ import annotations

import io
import math
import re
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SIDE_COLOURS = {"baseline": "#4c72b0", "candidate": "#dd8452"}
_RC = {
    "svg.fonttype": "none",
    "svg.hashsalt": "harness-report",  # stable ids: the same report renders to the same bytes
    "font.size": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
    # one font the page names once per text (the default list of nine families is in every label)
    "font.family": "sans-serif",
    "font.sans-serif": ["DejaVu Sans"],
}
THRESHOLD_STYLES = ("--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3)))
LEGEND_CHARS = 110  # a threshold's legend text wraps here (7 pt on a 7.5 in figure)
THRESHOLD_COLOURS = ("#c0392b", "#7d3c98", "#1f618d", "#b9770e", "#117a65")


def _label(text: str) -> str:
    """A label that matplotlib draws literally ('$' would start mathtext)."""
    return str(text).replace("$", r"\$")


def _margins(fig, labels: list[str] = (), right: float = 0.2, top: float = 0.3, bottom: float = 0.5) -> None:
    """Fixed margins (inches) instead of bbox_inches='tight', which draws every figure twice;
    the left margin grows with the longest y tick label."""
    w, h = fig.get_size_inches()
    longest = max((len(str(s)) for s in labels), default=6)
    left = min(0.45 * w, 0.35 + 0.08 * max(longest, 6))  # DejaVu Sans 9 pt: about 0.075 in a character
    fig.subplots_adjust(left=left / w, right=1 - right / w, bottom=bottom / h, top=1 - top / h)


def _to_svg(fig, name: str) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    plt.close(fig)
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]  # drop the XML declaration and DOCTYPE: this is inline SVG
    svg = re.sub(r"<metadata>.*?</metadata>\s*", "", svg, flags=re.S)  # RDF boilerplate, nothing of ours
    # ids must be unique across the page: several figures share matplotlib's id scheme
    prefix = re.sub(r"[^A-Za-z0-9_-]", "_", name)
    svg = _compact(svg)
    svg = re.sub(r'id="([^"]+)"', lambda m: f'id="{prefix}-{m.group(1)}"', svg)
    svg = re.sub(r'url\(#([^)]+)\)', lambda m: f'url(#{prefix}-{m.group(1)})', svg)
    svg = re.sub(r'xlink:href="#([^"]+)"', lambda m: f'xlink:href="#{prefix}-{m.group(1)}"', svg)
    svg = re.sub(r'(?<![:\w])href="#([^"]+)"', lambda m: f'href="#{prefix}-{m.group(1)}"', svg)
    return svg.replace("<svg ", f'<svg class="plot" role="img" aria-label="{prefix}" ', 1)


def _compact(svg: str) -> str:
    """The same drawing in fewer bytes (a report holds dozens of figures): no ids on groups nobody
    references, no identity rotations, coordinates to 0.01 pt, no indentation."""
    svg = re.sub(r'<g id="[^"]+">', "<g>", svg)
    svg = re.sub(r' transform="rotate\(-0 [^)]*\)"', "", svg)
    svg = re.sub(r"(\d\.\d\d)\d+", r"\1", svg)
    return re.sub(r"\n\s*", " ", svg)


def speedup_forest(items: list[dict], thresholds: list[dict], name: str = "forest") -> str | None:
    """Forest plot: one line per item {label, point, lo, hi}; vertical lines at 1 and at each
    threshold {label, value}. Returns None when no item has an interval."""
    items = [i for i in items if i.get("point") is not None]
    if not items:
        return None
    with plt.rc_context(_RC):
        fig, ax = plt.subplots(figsize=(7.5, 1.1 + 0.32 * len(items)))
        ys = list(range(len(items)))[::-1]
        for y, it in zip(ys, items):
            lo = it.get("lo", it["point"]) if it.get("lo") is not None else it["point"]
            hi = it.get("hi", it["point"]) if it.get("hi") is not None else it["point"]
            colour = "#333333" if not it.get("geomean") else "#8c2d04"
            ax.plot([lo, hi], [y, y], color=colour, lw=2, solid_capstyle="butt")
            ax.plot([it["point"]], [y], marker="D" if it.get("geomean") else "o", color=colour, ms=5)
        ax.set_yticks(ys)
        ax.set_yticklabels([_label(i["label"]) for i in items])
        ax.axvline(1.0, color="#999999", lw=1, ls="-")
        # thresholds as lines named in a legend under the axes: labels drawn at the lines overprint
        # each other where gates sit close (1.08x, 1.1x; 0.98x beside 1x)
        by_value: dict[float, list[str]] = {}
        for th in sorted(thresholds, key=lambda t: t["value"]):
            by_value.setdefault(round(th["value"], 4), []).append(th["label"])
        texts = [textwrap.fill(f"{value:.3g}x: {', '.join(labels)}", LEGEND_CHARS) for value, labels in by_value.items()]
        ncol = 2 if texts and max(len(t) for t in texts) <= LEGEND_CHARS // 2 - 4 else 1
        for k, (value, text) in enumerate(zip(by_value, texts)):
            ax.axvline(value, color=THRESHOLD_COLOURS[k % len(THRESHOLD_COLOURS)], lw=1.2,
                       ls=THRESHOLD_STYLES[k % len(THRESHOLD_STYLES)], label=_label(text))
        ax.set_xlabel("speedup = baseline time / candidate time (x), with its 95% interval")
        ax.set_ylim(-0.7, len(items) - 0.3)
        lines = [t.count("\n") + 1 for t in texts]
        legend_in = (0.16 * (sum(lines) if ncol == 1 else max(sum(lines[0::2]), sum(lines[1::2]))) + 0.35
                     if texts else 0.0)
        if texts:
            fig.legend(loc="lower left", bbox_to_anchor=(0.01, 0.0), ncol=ncol, fontsize=7, frameon=False,
                       title="gate thresholds (a non-regression margin m at 1/(1+m))", title_fontsize=7,
                       alignment="left")
        fig.set_size_inches(7.5, 1.1 + 0.32 * len(items) + legend_in)
        _margins(fig, [i["label"] for i in items], top=0.2, bottom=0.5 + legend_in)
        return _to_svg(fig, name)


def block_series(points: list[dict], title: str, name: str) -> str | None:
    """Per-block median time (ms) against block index, one colour per side: shows the
    interleaving and any drift. points: {block, side, median_ms, low_clock}."""
    points = [p for p in points if p.get("median_ms") is not None]
    if not points:
        return None
    with plt.rc_context(_RC):
        fig, ax = plt.subplots(figsize=(5.2, 2.4))
        for side, colour in SIDE_COLOURS.items():
            pts = sorted((p for p in points if p["side"] == side), key=lambda p: p["block"])
            if pts:
                ax.plot([p["block"] for p in pts], [p["median_ms"] for p in pts], "o-", color=colour, ms=4, lw=1,
                        label=side)
        flagged = [p for p in points if p.get("low_clock")]
        if flagged:
            ax.scatter([p["block"] for p in flagged], [p["median_ms"] for p in flagged], s=80, facecolors="none",
                       edgecolors="#c0392b", label="SM clock < 75% boost")
        ax.set_xlabel("block (run order)")
        ax.set_ylabel("block median (ms)")
        ax.set_title(_label(title), fontsize=9)
        ax.legend(fontsize=7, frameon=False)
        _margins(fig)
        return _to_svg(fig, name)


def distributions(samples: dict[str, list[float]], title: str, name: str) -> str | None:
    """Strip + box plot of every sample (ms) per side."""
    sides = [s for s in SIDE_COLOURS if samples.get(s)]
    if not sides:
        return None
    with plt.rc_context(_RC):
        fig, ax = plt.subplots(figsize=(5.2, 1.2 + 0.6 * len(sides)))
        data = [samples[s] for s in sides]
        ax.boxplot(data, orientation="horizontal", widths=0.5, showfliers=False, tick_labels=sides)
        for y, s in enumerate(sides, start=1):
            xs = samples[s]
            jitter = [((i * 0.6180339887) % 1 - 0.5) * 0.3 for i in range(len(xs))]
            ax.scatter(xs, [y + j for j in jitter], s=6, alpha=0.5, color=SIDE_COLOURS[s])
        ax.set_xlabel("time per call (ms)")
        ax.set_title(_label(title), fontsize=9)
        _margins(fig, sides)
        return _to_svg(fig, name)


def stage_shares(shares: dict[str, dict[str, float]], title: str, name: str = "stage-shares") -> str | None:
    """Stacked horizontal bars: share of time per stage, one bar per side (or row).
    shares: {bar label: {stage: share in [0, 1]}}."""
    bars = [b for b, s in shares.items() if s]
    if not bars:
        return None
    stages: list[str] = []
    for b in bars:
        stages += [s for s in shares[b] if s not in stages]
    cmap = plt.get_cmap("tab20")
    with plt.rc_context(_RC):
        fig, ax = plt.subplots(figsize=(7.5, 1.2 + 0.45 * len(bars)))
        for yi, bar in enumerate(bars):
            left = 0.0
            for si, stage in enumerate(stages):
                w = float(shares[bar].get(stage) or 0.0)
                if w <= 0 or math.isnan(w):
                    continue
                ax.barh(yi, w, left=left, color=cmap(si % 20), label=_label(stage) if yi == 0 else None,
                        edgecolor="white", lw=0.5)
                if w >= 0.06:
                    ax.text(left + w / 2, yi, f"{w:.0%}", ha="center", va="center", fontsize=7)
                left += w
        ax.set_yticks(range(len(bars)))
        ax.set_yticklabels([_label(b) for b in bars])
        ax.set_xlim(0, 1)
        ax.set_xlabel("share of time")
        ax.set_title(_label(title), fontsize=9)
        handles, labels = [], []
        for si, stage in enumerate(stages):
            handles.append(plt.Rectangle((0, 0), 1, 1, color=cmap(si % 20)))
            labels.append(_label(stage))
        ax.legend(handles, labels, fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        _margins(fig, bars, right=0.6 + 0.065 * max(len(x) for x in labels))  # swatch, gap and text
        return _to_svg(fig, name)


def stall_bars(shares: dict[str, dict[str, float]], title: str, name: str, top: int = 8) -> str | None:
    """Grouped horizontal bars of warp-stall reasons, one bar per side for each reason.
    shares: {side: {reason: share of that side's stall samples}}; the `top` reasons by their
    largest share on any side are drawn, largest first."""
    sides = [s for s, d in shares.items() if d]
    if not sides:
        return None
    reasons = sorted({r for s in sides for r in shares[s]}, key=lambda r: -max(shares[s].get(r, 0.0) for s in sides))
    reasons = [r for r in reasons if max(shares[s].get(r, 0.0) for s in sides) > 0][:top]
    if not reasons:
        return None
    h = 0.8 / len(sides)
    with plt.rc_context(_RC):
        fig, ax = plt.subplots(figsize=(7.5, 0.8 + 0.32 * len(reasons) * len(sides)))
        for si, side in enumerate(sides):
            ys = [ri + si * h for ri in range(len(reasons))]
            vals = [float(shares[side].get(r, 0.0)) for r in reasons]
            ax.barh(ys, vals, height=h, color=SIDE_COLOURS.get(side, "#888888"), label=_label(side))
            for y, v in zip(ys, vals):
                if v > 0:
                    ax.text(v, y, f" {v:.0%}", va="center", fontsize=7)
        ax.set_yticks([ri + h * (len(sides) - 1) / 2 for ri in range(len(reasons))])
        ax.set_yticklabels([_label(r) for r in reasons])
        ax.invert_yaxis()
        ax.set_xlim(0, min(1.0, 1.15 * max(max(shares[s].values()) for s in sides)))
        ax.set_xlabel("share of sampled warp stalls")
        ax.set_title(_label(title), fontsize=9)
        ax.legend(fontsize=7, frameon=False, loc="lower right")
        _margins(fig, reasons)
        return _to_svg(fig, name)
