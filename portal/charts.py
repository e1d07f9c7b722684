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
