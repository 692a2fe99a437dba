"""PNG figures of simulation results (matplotlib with the Agg backend, imported only when plotting)."""

from __future__ import annotations

from pathlib import Path

from swarmtrain.config.errors import UserError
from swarmtrain.sim.metrics import SimResult


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path) -> None:
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(target, dpi=110, bbox_inches="tight")
    except OSError as exc:
        raise UserError(f"cannot write plot {target}: {exc.strerror}") from None
    finally:
        _pyplot().close(fig)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average: modes whose samples complete in big steps (async replicas) plot readably."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_results(results: list[SimResult], path: str | Path, title: str = "") -> None:
    """Throughput vs the optimum, fraction of optimal, and (single run) per-stage utilization.

    Throughput is a trailing moving average over 1/30 of the run."""
    plt = _pyplot()
    panels = 3 if len(results) == 1 else 2
    fig, axes = plt.subplots(panels, 1, figsize=(9, 3.2 * panels), sharex=True)
    ax = axes[0]
    first = results[0].series
    hours = [t / 3600 for t in first["time_s"]]
    ax.plot(hours, first["optimal_samples_per_s"], "k--", lw=1.2, label="optimal (best static allocation)")
    window = max(1, len(first["time_s"]) // 30)
    for r in results:
        ax.plot(
            [t / 3600 for t in r.series["time_s"]],
            smooth(r.series["samples_per_s"], window),
            lw=1.4,
            label=r.mode,
        )
    ax.set_ylabel("samples/s" + (f" (mean of {window} points)" if window > 1 else ""))
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title or "throughput over time")
    ax = axes[1]
    for r in results:
        rates = smooth(r.series["samples_per_s"], window)
        frac = [
            a / o if o > 0 else 0.0 for a, o in zip(rates, r.series["optimal_samples_per_s"], strict=True)
        ]
        ax.plot([t / 3600 for t in r.series["time_s"]], frac, lw=1.4, label=r.mode)
    ax.set_ylabel("fraction of optimal")
    ax.axhline(1.0, color="k", lw=0.6, ls=":")
    ax.legend(fontsize=8, loc="lower right")
    if panels == 3:
        ax = axes[2]
        util = results[0].series["utilization"]
        for s in range(results[0].num_stages):
            ax.plot(hours, [u[s] for u in util], lw=1.0, label=f"stage {s}")
        ax.set_ylabel("compute utilization")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=7, ncol=4, loc="lower right")
    axes[-1].set_xlabel("simulated time (h)")
    save_figure(fig, path)
