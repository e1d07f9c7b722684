"""Small server-side SVG charts: no chart library, nothing to load from anywhere."""

from __future__ import annotations

from decimal import Decimal

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

WIDTH, BAR_AREA = 640, 180


def column_chart(points: list[tuple[str, Decimal | int]], *, title: str, unit: str = "") -> SafeString:
    """Vertical bars over time (one per label), with the largest value marked on the axis."""
    top = max((float(v) for _, v in points), default=0) or 1.0
    n = max(len(points), 1)
    step = (WIDTH - 60) / n
    bars = []
    for i, (label, value) in enumerate(points):
        h = BAR_AREA * float(value) / top
        x = 50 + i * step
        bars.append(
            f'<rect x="{x:.1f}" y="{20 + BAR_AREA - h:.1f}" width="{max(step - 2, 1):.1f}" height="{h:.1f}">'
            f"<title>{escape(label)}: {escape(value)} {escape(unit)}</title></rect>"
        )
    first = escape(points[0][0]) if points else ""
    last = escape(points[-1][0]) if points else ""
    return mark_safe(
        f'<svg class="chart" viewBox="0 0 {WIDTH} 230" role="img" aria-label="{escape(title)}">'
        f'<text x="4" y="14" class="chart-title">{escape(title)}</text>'
        f'<text x="4" y="34" class="axis">{top:,.4g}</text><text x="4" y="{20 + BAR_AREA}" class="axis">0</text>'
        f'<line x1="48" y1="{20 + BAR_AREA}" x2="{WIDTH}" y2="{20 + BAR_AREA}" class="axis-line"/>'
        f"{''.join(bars)}"
        f'<text x="50" y="220" class="axis">{first}</text>'
        f'<text x="{WIDTH - 4}" y="220" class="axis" text-anchor="end">{last}</text></svg>'
    )


def bar_chart(points: list[tuple[str, Decimal | int]], *, title: str, unit: str = "") -> SafeString:
    """Horizontal bars, one per label (teams, models), longest first."""
    points = sorted(points, key=lambda p: -float(p[1]))[:12]
    top = max((float(v) for _, v in points), default=0) or 1.0
    rows = []
    for i, (label, value) in enumerate(points):
        w = 360 * float(value) / top
        y = 28 + i * 22
        rows.append(
            f'<text x="4" y="{y + 13}" class="axis">{escape(label[:32])}</text>'
            f'<rect x="220" y="{y}" width="{w:.1f}" height="16"><title>{escape(label)}</title></rect>'
            f'<text x="{224 + w:.1f}" y="{y + 13}" class="axis">{escape(value)} {escape(unit)}</text>'
        )
    height = 40 + 22 * len(points)
    return mark_safe(
        f'<svg class="chart" viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{escape(title)}">'
        f'<text x="4" y="14" class="chart-title">{escape(title)}</text>{"".join(rows)}</svg>'
    )


LINE_COLOURS = ("#1f6feb", "#d97706", "#059669", "#9333ea")


def line_chart(
    series: dict[str, list[tuple[float, float | None]]],
    *,
    title: str,
    unit: str = "",
    objective: float | None = None,
) -> SafeString:
    """Lines over time (x: seconds before now), one per series, with an optional dashed objective line."""
    points = [(x, y) for values in series.values() for x, y in values if y is not None]
    if not points:
        return mark_safe(f'<p class="muted">{escape(title)}: no data yet.</p>')
    x0, x1 = min(x for x, _ in points), max(x for x, _ in points)
    top = max([y for _, y in points] + ([objective] if objective else [])) or 1.0
    span = (x1 - x0) or 1.0

    def at(x: float, y: float) -> str:
        return f"{50 + (WIDTH - 60) * (x - x0) / span:.1f},{20 + BAR_AREA - BAR_AREA * y / top:.1f}"

    lines, legend = [], []
    for i, (name, values) in enumerate(series.items()):
        colour = LINE_COLOURS[i % len(LINE_COLOURS)]
        path = " ".join(at(x, y) for x, y in values if y is not None)
        lines.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{path}"/>')
        legend.append(f'<text x="{200 + 150 * i}" y="14" class="axis" fill="{colour}">{escape(name)}</text>')
    if objective:
        y = 20 + BAR_AREA - BAR_AREA * objective / top
        lines.append(
            f'<line x1="50" y1="{y:.1f}" x2="{WIDTH}" y2="{y:.1f}" stroke="#dc2626" stroke-dasharray="6 4">'
            f"<title>objective {objective:g} {escape(unit)}</title></line>"
        )
    return mark_safe(
        f'<svg class="chart" viewBox="0 0 {WIDTH} 230" role="img" aria-label="{escape(title)}">'
        f'<text x="4" y="14" class="chart-title">{escape(title)}</text>{"".join(legend)}'
        f'<text x="4" y="34" class="axis">{top:,.4g} {escape(unit)}</text>'
        f'<text x="4" y="{20 + BAR_AREA}" class="axis">0</text>'
        f'<line x1="48" y1="{20 + BAR_AREA}" x2="{WIDTH}" y2="{20 + BAR_AREA}" class="axis-line"/>'
        f"{''.join(lines)}"
        f'<text x="50" y="220" class="axis">-{span:.0f} s</text>'
        f'<text x="{WIDTH - 4}" y="220" class="axis" text-anchor="end">now</text></svg>'
    )
