"""Charts as inline SVG strings, drawn on the server: the page needs no script library, no CDN and no
download at run time, and a test can read the drawing as text.

`line_chart` draws named series of (x, y) points (None y: a gap); `stage_bars` draws each stage's
throughput with the bottleneck in red.
"""

from __future__ import annotations

import math
from html import escape

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f")
BOTTLENECK_COLOR = "#d62728"
STAGE_COLOR = "#1f77b4"
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 56, 14, 44, 34  # the legend's row above the plot
LEGEND_Y = 34
CHAR_WIDTH = 6.5  # of the 11px legend text, to lay out the legend without a browser


def fmt_number(value) -> str:
    """A short human number: 1234 -> 1234, 12.34 -> 12.3, 1.234 -> 1.23, None -> -."""
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"


def nice_step(low: float, high: float, count: int = 5) -> float:
    """A round step (1, 2 or 5 times a power of ten) cutting [low, high] into about `count` parts."""
    raw = (high - low) / count
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values (multiples of `nice_step`) within [low, high]."""
    if not high > low:
        return [low]
    step = nice_step(low, high, count)
    first = math.ceil(low / step - 1e-9) * step
    ticks, value = [], first
    while value <= high + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    return ticks


def nice_bounds(low: float, high: float, count: int = 5) -> tuple[float, float]:
    """[low, high] widened to the surrounding ticks, so the highest point never touches the frame."""
    if not high > low:
        return low, high
    step = nice_step(low, high, count)
    return math.floor(low / step + 1e-9) * step, math.ceil(high / step - 1e-9) * step


def _svg_open(width: int, height: int, title: str, label: str) -> list[str]:
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" role="img" aria-label="{escape(label)}" '
        f'width="{width}" height="{height}" viewBox="0 0 {width} {height}">',
        f'<text x="{MARGIN_LEFT}" y="18" class="chart-title">{escape(title)}</text>',
    ]


def _empty(width: int, height: int, title: str, text: str) -> str:
    parts = _svg_open(width, height, title, f"{title}: {text}")
    parts.append(
        f'<text x="{width / 2:.0f}" y="{height / 2:.0f}" text-anchor="middle" class="chart-empty">{escape(text)}</text>'
    )
    return "\n".join(parts + ["</svg>"])


def line_chart(
    series: dict[str, list[tuple[float, float | None]]],
    *,
    title: str,
    x_label: str,
    width: int = 560,
    height: int = 220,
    y_from_zero: bool = True,
    empty_text: str = "no data yet",
    x_range: tuple[float, float] | None = None,
) -> str:
    """One polyline per named series (gaps where y is None), axes with round ticks, a legend.
    `x_range`: the x axis's extent (charts side by side share one time axis); default: the data's."""
    points = [(x, y) for values in series.values() for x, y in values if y is not None]
    if not points:
        return _empty(width, height, title, empty_text)
    x_low, x_high = x_range or (min(p[0] for p in points), max(p[0] for p in points))
    y_low, y_high = min(p[1] for p in points), max(p[1] for p in points)
    y_low = min(0.0, y_low) if y_from_zero else y_low
    if x_high <= x_low:
        x_low, x_high = x_low - 1, x_high + 1
    if y_high <= y_low:  # a flat line: give it room, below only where values may go there
        pad = abs(y_high) * 0.1 or 1.0
        y_low, y_high = (y_low if y_from_zero and y_low >= 0 else y_low - pad), y_high + pad
    y_low, y_high = nice_bounds(y_low, y_high)
    plot_w, plot_h = width - MARGIN_LEFT - MARGIN_RIGHT, height - MARGIN_TOP - MARGIN_BOTTOM

    def sx(x: float) -> float:
        return MARGIN_LEFT + (x - x_low) / (x_high - x_low) * plot_w

    def sy(y: float) -> float:
        return MARGIN_TOP + (1 - (y - y_low) / (y_high - y_low)) * plot_h

    parts = _svg_open(width, height, title, title)
    parts += _axes(x_low, x_high, y_low, y_high, sx, sy, x_label, width, height)
    for i, (name, values) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        for segment in _segments(values):
            if len(segment) == 1:
                x, y = segment[0]
                parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{color}"/>')
            else:
                coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in segment)
                parts.append(
                    f'<polyline fill="none" stroke="{color}" stroke-width="1.8" points="{coords}">'
                    f"<title>{escape(name)}</title></polyline>"
                )
    parts += _legend(list(series), width)
    return "\n".join(parts + ["</svg>"])


def _segments(values: list[tuple[float, float | None]]) -> list[list[tuple[float, float]]]:
    segments: list[list[tuple[float, float]]] = [[]]
    for x, y in values:
        if y is None:
            if segments[-1]:
                segments.append([])
        else:
            segments[-1].append((x, y))
    return [s for s in segments if s]


def _axes(x_low, x_high, y_low, y_high, sx, sy, x_label: str, width: int, height: int) -> list[str]:
    bottom, right = height - MARGIN_BOTTOM, width - MARGIN_RIGHT
    parts = [
        f'<line x1="{MARGIN_LEFT}" y1="{bottom}" x2="{right}" y2="{bottom}" class="axis"/>',
        f'<line x1="{MARGIN_LEFT}" y1="{MARGIN_TOP}" x2="{MARGIN_LEFT}" y2="{bottom}" class="axis"/>',
    ]
    for y in nice_ticks(y_low, y_high):
        parts.append(
            f'<line x1="{MARGIN_LEFT}" y1="{sy(y):.1f}" x2="{right}" y2="{sy(y):.1f}" class="grid"/>'
        )
        parts.append(
            f'<text x="{MARGIN_LEFT - 6}" y="{sy(y) + 4:.1f}" text-anchor="end" class="tick">{fmt_number(y)}</text>'
        )
    for x in nice_ticks(x_low, x_high, count=5):
        parts.append(
            f'<text x="{sx(x):.1f}" y="{bottom + 16}" text-anchor="middle" class="tick">{fmt_number(x)}</text>'
        )
    parts.append(
        f'<text x="{(MARGIN_LEFT + right) / 2:.0f}" y="{height - 4}" text-anchor="middle" class="tick">'
        f"{escape(x_label)}</text>"
    )
    return parts


def _legend(names: list[str], width: int) -> list[str]:
    """One row under the title, left to right; what does not fit is counted as "+N more"."""
    parts, x = [], float(MARGIN_LEFT)
    for i, name in enumerate(names):
        text = name[:20]
        item_w = 14 + CHAR_WIDTH * len(text) + 12
        if x + item_w > width - MARGIN_RIGHT - 60 and i < len(names) - 1:
            parts.append(f'<text x="{x:.0f}" y="{LEGEND_Y}" class="legend">+{len(names) - i} more</text>')
            break
        color = PALETTE[i % len(PALETTE)]
        parts.append(f'<rect x="{x:.0f}" y="{LEGEND_Y - 9}" width="10" height="10" fill="{color}"/>')
        parts.append(f'<text x="{x + 14:.0f}" y="{LEGEND_Y}" class="legend">{escape(text)}</text>')
        x += item_w
    return parts


def stage_bars(stages: list[dict], bottleneck: int | None, width: int = 560) -> str:
    """A horizontal bar per stage: summed throughput of its serving peers; the bottleneck in red."""
    row_h, label_w, top_y = 26, 150, 28
    height = top_y + row_h * max(len(stages), 1) + 8
    title = "throughput per stage (samples/s)"
    if not stages:
        return _empty(width, height, title, "no stages")
    top = max((s["throughput_samples_per_s"] for s in stages), default=0.0) or 1.0
    parts = _svg_open(width, height, title, title)
    for row, stage in enumerate(stages):
        y = top_y + row * row_h
        value = stage["throughput_samples_per_s"]
        is_bottleneck = stage["index"] == bottleneck
        bar_w = (width - label_w - 70) * value / top
        color = BOTTLENECK_COLOR if is_bottleneck else STAGE_COLOR
        label = f"stage {stage['index']} ({len(stage['peers'])} peers)"
        parts.append(f'<text x="4" y="{y + 16}" class="tick">{escape(label)}</text>')
        parts.append(
            f'<rect x="{label_w}" y="{y + 4}" width="{bar_w:.1f}" height="{row_h - 8}" fill="{color}"/>'
        )
        note = " bottleneck" if is_bottleneck else ""
        parts.append(
            f'<text x="{label_w + bar_w + 6:.1f}" y="{y + 16}" class="tick">{fmt_number(value)}{note}</text>'
        )
    return "\n".join(parts + ["</svg>"])
