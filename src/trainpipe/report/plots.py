"""Inline SVG plots for the HTML report: line charts and grouped bars, drawn here (no plotting library, no CDN, no
script), so a report opens anywhere, offline, and stays a single file.

Every plot is `<svg class="plot" data-points="N">`; N is how many data points it draws. A plot with nothing to draw
is not an SVG but a `<p class="empty">` line saying what is missing, so an empty chart can never pass for a drawn one.
"""

from __future__ import annotations

import math
from html import escape

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
W, H = 540, 260
ML, MR, MT, MB = 62, 14, 28, 40


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.ceil(lo / step) * step
    out, v = [], start
    while v <= hi + 1e-12 * abs(hi):
        out.append(round(v, 12))
        v += step
    return out


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e5 or a < 1e-3:
        return f"{v:.1e}"
    if a >= 100:
        return f"{v:.0f}"
    return f"{v:.3g}"


def empty(title: str, why: str) -> str:
    return f'<figure class="chart"><figcaption>{escape(title)}</figcaption><p class="empty">{escape(why)}</p></figure>'


def line_chart(title: str, series: list[tuple[str, list[tuple[float, float]]]], *, xlabel: str = "step", ylabel: str = "",
               hlines: list[tuple[str, float]] | None = None, log_y: bool = False, why_empty: str = "not recorded") -> str:
    """Lines (with a marker per point) of ``series`` = [(label, [(x, y), ...]), ...]; ``hlines`` = [(label, y)]."""
    series = [(name, [(float(x), float(y)) for x, y in pts if isinstance(y, (int, float)) and math.isfinite(y)]) for name, pts in series]
    series = [(n, p) for n, p in series if p]
    if not series:
        return empty(title, why_empty)
    hlines = [(n, float(y)) for n, y in (hlines or []) if isinstance(y, (int, float)) and math.isfinite(y)]
    if log_y and any(y <= 0 for _, p in series for _, y in p):
        log_y = False
    tf = (lambda y: math.log10(y)) if log_y else (lambda y: y)
    xs = [x for _, p in series for x, _ in p]
    ys = [tf(y) for _, p in series for _, y in p] + [tf(y) for _, y in hlines if not log_y or y > 0]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        pad = abs(y0) * 0.1 or 1.0
        y0, y1 = y0 - pad, y1 + pad
    else:
        pad = (y1 - y0) * 0.06
        y0, y1 = y0 - pad, y1 + pad
    pw, ph = W - ML - MR, H - MT - MB
    sx = lambda x: ML + (x - x0) / (x1 - x0) * pw  # noqa: E731
    sy = lambda y: MT + ph - (tf(y) - y0) / (y1 - y0) * ph  # noqa: E731
    n_points = sum(len(p) for _, p in series)
    parts = [f'<svg class="plot" data-points="{n_points}" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
             f'<rect x="{ML}" y="{MT}" width="{pw}" height="{ph}" fill="#fff" stroke="#ccc"/>']
    for t in _ticks(x0, x1):
        X = sx(t)
        parts.append(f'<line x1="{X:.1f}" y1="{MT + ph}" x2="{X:.1f}" y2="{MT + ph + 4}" stroke="#666"/><text x="{X:.1f}" y="{MT + ph + 16}" font-size="10" text-anchor="middle">{_fmt(t)}</text>')
    for t in _ticks(y0, y1):
        Y = MT + ph - (t - y0) / (y1 - y0) * ph
        label = _fmt(10 ** t) if log_y else _fmt(t)
        parts.append(f'<line x1="{ML}" y1="{Y:.1f}" x2="{ML + pw}" y2="{Y:.1f}" stroke="#eee"/><text x="{ML - 5}" y="{Y + 3:.1f}" font-size="10" text-anchor="end">{label}</text>')
    parts.append(f'<text x="{ML + pw / 2}" y="{H - 6}" font-size="11" text-anchor="middle">{escape(xlabel)}</text>')
    if ylabel:
        parts.append(f'<text x="12" y="{MT + ph / 2}" font-size="11" text-anchor="middle" transform="rotate(-90 12 {MT + ph / 2})">{escape(ylabel)}{" (log)" if log_y else ""}</text>')
    for i, (name, y) in enumerate(hlines):
        Y = sy(y)
        parts.append(f'<line class="hline" x1="{ML}" y1="{Y:.1f}" x2="{ML + pw}" y2="{Y:.1f}" stroke="#999" stroke-dasharray="5 4"><title>{escape(name)}: {_fmt(y)}</title></line>'
                     f'<text x="{ML + pw - 4}" y="{Y - 4:.1f}" font-size="10" text-anchor="end" fill="#666">{escape(name)}</text>')
    for i, (name, pts) in enumerate(series):
        c = PALETTE[i % len(PALETTE)]
        d = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        parts.append(f'<polyline class="series" fill="none" stroke="{c}" stroke-width="1.8" points="{d}"><title>{escape(name)}</title></polyline>')
        if len(pts) <= 60:
            parts += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{c}"><title>{escape(name)} @ {_fmt(x)}: {_fmt(y)}</title></circle>' for x, y in pts]
    for i, (name, _) in enumerate(series):  # legend
        c = PALETTE[i % len(PALETTE)]
        lx = ML + 8 + (i % 3) * 170
        ly = MT - 16 + (i // 3) * 12
        parts.append(f'<rect x="{lx}" y="{ly}" width="10" height="3" fill="{c}"/><text x="{lx + 14}" y="{ly + 4}" font-size="10">{escape(name[:28])}</text>')
    parts.append("</svg>")
    return f'<figure class="chart"><figcaption>{escape(title)}</figcaption>{"".join(parts)}</figure>'


def bar_chart(title: str, groups: list[str], series: list[tuple[str, list[float | None]]], *, ylabel: str = "", why_empty: str = "not measured") -> str:
    """Grouped bars: one group per label in ``groups``, one bar per series (e.g. baseline and final)."""
    clean = [(n, [float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None for v in vals]) for n, vals in series]
    n_points = sum(v is not None for _, vals in clean for v in vals)
    if not groups or not n_points:
        return empty(title, why_empty)
    vals_all = [v for _, vals in clean for v in vals if v is not None]
    lo, hi = min(0.0, min(vals_all)), max(0.0, max(vals_all))
    if hi == lo:
        hi = lo + 1
    pw, ph = W - ML - MR, H - MT - MB
    sy = lambda y: MT + ph - (y - lo) / (hi - lo) * ph  # noqa: E731
    gw = pw / len(groups)
    bw = gw * 0.8 / max(len(clean), 1)
    parts = [f'<svg class="plot" data-points="{n_points}" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
             f'<rect x="{ML}" y="{MT}" width="{pw}" height="{ph}" fill="#fff" stroke="#ccc"/>']
    for t in _ticks(lo, hi):
        Y = sy(t)
        parts.append(f'<line x1="{ML}" y1="{Y:.1f}" x2="{ML + pw}" y2="{Y:.1f}" stroke="#eee"/><text x="{ML - 5}" y="{Y + 3:.1f}" font-size="10" text-anchor="end">{_fmt(t)}</text>')
    for gi, g in enumerate(groups):
        for si, (name, vals) in enumerate(clean):
            v = vals[gi] if gi < len(vals) else None
            if v is None:
                continue
            x = ML + gi * gw + gw * 0.1 + si * bw
            y, y0 = sy(max(v, 0)), sy(min(v, 0))
            parts.append(f'<rect class="bar" x="{x:.1f}" y="{y:.1f}" width="{bw * 0.92:.1f}" height="{max(y0 - y, 0.5):.1f}" fill="{PALETTE[si % len(PALETTE)]}"><title>{escape(g)} {escape(name)}: {_fmt(v)}</title></rect>')
        parts.append(f'<text x="{ML + gi * gw + gw / 2:.1f}" y="{MT + ph + 14}" font-size="10" text-anchor="middle">{escape(str(g)[:18])}</text>')
    if ylabel:
        parts.append(f'<text x="12" y="{MT + ph / 2}" font-size="11" text-anchor="middle" transform="rotate(-90 12 {MT + ph / 2})">{escape(ylabel)}</text>')
    for si, (name, _) in enumerate(clean):
        lx = ML + 8 + si * 120
        parts.append(f'<rect x="{lx}" y="{MT - 18}" width="10" height="8" fill="{PALETTE[si % len(PALETTE)]}"/><text x="{lx + 14}" y="{MT - 10}" font-size="10">{escape(name)}</text>')
    parts.append("</svg>")
    return f'<figure class="chart"><figcaption>{escape(title)}</figcaption>{"".join(parts)}</figure>'
