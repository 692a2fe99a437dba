"""Plain-text tables of simulation summaries (what the CLI and the experiments print)."""

from __future__ import annotations

from collections.abc import Sequence


def human_bytes(num_bytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(num_bytes) < 1000 or unit == "PB":
            return f"{num_bytes:.3g} {unit}"
        num_bytes /= 1000
    return f"{num_bytes:.3g} PB"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned first column, right-aligned others; floats with 3 significant digits."""

    def cell(value: object) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1e5 else f"{value:.4g}"
        return str(value)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) for i, h in enumerate(headers)]
    lines = []
    for row in [list(headers), *text]:
        parts = [row[0].ljust(widths[0])] + [v.rjust(w) for v, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(parts))
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


SUMMARY_HEADERS = (
    "mode",
    "samples/s",
    "optimal",
    "fraction",
    "steady",
    "lost",
    "moves",
    "timeouts",
    "bytes moved",
    "events",
)


def summary_row(summary: dict) -> list[object]:
    return [
        summary["mode"],
        summary["samples_per_s"],
        summary["optimal_samples_per_s"],
        summary["fraction_of_optimal"],
        summary["steady_fraction_of_optimal"],
        int(summary["samples_lost"]),
        summary["moves"],
        summary["timeouts"],
        human_bytes(summary["bytes_moved"]),
        summary["events"],
    ]


def summaries_table(summaries: Sequence[dict]) -> str:
    return format_table(SUMMARY_HEADERS, [summary_row(s) for s in summaries])
