"""The monitor's HTML page, rendered on the server from a `SwarmHistory.view()`: summary, each stage's
peers, the bottleneck, loss and samples/s over time, lost and retried work, recent events.

Live pages refresh their content with a ten-line script that fetches `fragment` (this same content,
rendered again); a replay is static. Charts are inline SVG (`charts.py`): nothing is downloaded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from html import escape

from swarmtrain.monitor.charts import fmt_number, line_chart, stage_bars
from swarmtrain.monitor.events import short_id
from swarmtrain.monitor.snapshot import format_plan

MAX_PEER_ROWS = 12  # per stage; a thousand-peer simulated stage would bury the page
MAX_EVENT_ROWS = 60  # in a scrolling box
WORK_LABELS = {
    "microbatches_completed": "micro-batches completed",
    "microbatches_failed": "micro-batches failed for good",
    "retries": "calls retried on another peer",
    "samples_lost": "samples of unapplied gradients lost",
    "state_downloads": "stage states downloaded (resyncs; simulator: joins and moves)",
    "duplicates": "duplicate requests (already applied)",
}
WORK_SERIES = {  # work totals charted over time: key -> legend
    "retries": "retried calls",
    "microbatches_failed": "failed micro-batches",
    "samples_lost": "lost samples",
}


@dataclass(frozen=True)
class PageMeta:
    """What the page says about where its data comes from."""

    source: str  # e.g. "DHT via /ip4/..." or "replay of sim.json"
    refresh_s: float | None  # live: seconds between content refreshes; None: a static replay
    simulated: bool = False  # replay: times are simulated seconds, not wall-clock


STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:16px;color:#222;background:#fafafa}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:18px 0 6px}
.meta{color:#555;font-size:13px} .error{background:#fdecea;color:#a12622;padding:6px 10px;border-radius:4px}
.cards{display:flex;gap:10px;flex-wrap:wrap;margin:12px 0}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px 14px;min-width:150px}
.card .v{font-size:20px;font-weight:600} .card .k{font-size:12px;color:#666}
.grid2{display:grid;grid-template-columns:repeat(auto-fit,minmax(560px,1fr));gap:12px}
.grid3{display:grid;grid-template-columns:repeat(auto-fit,minmax(380px,1fr));gap:12px}
svg.chart{width:100%;height:auto} .stage h3{font-size:14px;margin:4px 0}
.panel{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px 10px}
table{border-collapse:collapse;font-size:13px;width:100%} th,td{text-align:left;padding:3px 8px;border-bottom:1px solid #eee}
th{color:#555;font-weight:600} td.num{text-align:right;font-variant-numeric:tabular-nums}
.events{max-height:640px;overflow-y:auto;background:#fff;border:1px solid #ddd;border-radius:6px}
td.when{white-space:nowrap} .bottleneck{color:#d62728;font-weight:600} .muted{color:#888}
.chart{font-size:11px} .chart-title{font-size:13px;font-weight:600} .chart-empty{fill:#888;font-size:13px}
.axis{stroke:#888} .grid{stroke:#eee} .tick{fill:#444;font-size:11px} .legend{fill:#333;font-size:11px}
"""

SCRIPT = """
(function () {
  var periodMs = %d;
  function refresh() {
    fetch('fragment', {cache: 'no-store'})
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) { if (html) document.getElementById('content').innerHTML = html; })
      .catch(function () {});  // the monitor restarting: try again next period
  }
  setInterval(refresh, periodMs);
})();
"""


def render_page(view: dict, meta: PageMeta) -> str:
    snapshot = view.get("snapshot") or {}
    script = "" if meta.refresh_s is None else f"<script>{SCRIPT % int(meta.refresh_s * 1000)}</script>"
    return (
        "<!doctype html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>swarmtrain monitor: {escape(str(snapshot.get('run_id', '')))}</title>"
        f"<style>{STYLE}</style></head><body>\n<main id='content'>{render_content(view, meta)}</main>\n"
        f"{script}</body></html>\n"
    )


def render_content(view: dict, meta: PageMeta) -> str:
    snapshot = view.get("snapshot")
    parts = [_header(view, meta)]
    if snapshot is None:
        parts.append("<p class='muted'>waiting for the first snapshot...</p>")
        return "\n".join(parts)
    parts += [
        _cards(snapshot),
        _charts(view.get("points", []), snapshot, meta),
        "<div class='grid2'>",
        f"<div><h2>Trainers</h2>{_trainers(snapshot)}<h2>Lost and retried work</h2>{_work(snapshot)}"
        f"<div class='panel'>{_work_chart(view.get('points', []), meta)}</div></div>",
        f"<div><h2>Recent events</h2><div class='events'>{_events(view.get('events', []), meta)}</div></div>",
        "</div>",
        "<h2>Stages and their peers</h2>",
        _plan(snapshot),
        "<div class='grid3'>" + "".join(_stage_panel(s, snapshot) for s in snapshot["stages"]) + "</div>",
        _replicas(snapshot),
    ]
    return "\n".join(p for p in parts if p)


def _header(view: dict, meta: PageMeta) -> str:
    snapshot = view.get("snapshot") or {}
    run = escape(str(snapshot.get("run_id", "?")))
    digest = escape(str(snapshot.get("digest") or "-"))
    when = _when(snapshot.get("time"), meta) + (" (simulated)" if meta.simulated else "") if snapshot else "-"
    polls = view.get("polls", 0)
    error = view.get("error")
    banner = f"<p class='error'>last poll failed: {escape(error)}</p>" if error else ""
    return (
        f"<h1>swarmtrain monitor: run {run}</h1>"
        f"<div class='meta'>config {digest} | {escape(meta.source)} | snapshot {when} | "
        f"{polls} snapshot(s)</div>{banner}"
    )


def _when(time_s, meta: PageMeta) -> str:
    if time_s is None:
        return "-"
    if meta.simulated:
        return f"t={time_s:.0f} s"
    return time.strftime("%H:%M:%S", time.localtime(time_s))


def _card(value: str, label: str, css: str = "") -> str:
    return f"<div class='card {css}'><div class='v'>{value}</div><div class='k'>{escape(label)}</div></div>"


def _cards(snapshot: dict) -> str:
    stages, trainers = snapshot["stages"], snapshot.get("trainers", [])
    b = snapshot.get("bottleneck")
    bottleneck = next((s for s in stages if s["index"] == b), None)
    losses = [t["loss"] for t in trainers if t.get("loss") is not None]
    rates = [t["samples_per_s"] for t in trainers if t.get("samples_per_s") is not None]
    cards = [
        _card(str(sum(len(s["peers"]) for s in stages)), f"peers in {len(stages)} stages"),
        _card(
            "-" if bottleneck is None else f"stage {b}",
            "bottleneck"
            + (
                ""
                if bottleneck is None
                else f": {fmt_number(bottleneck['throughput_samples_per_s'])} samples/s"
            ),
            "bottleneck",
        ),
        _card(str(len(trainers)), "trainers"),
        _card(fmt_number(sum(rates)) if rates else "-", "samples/s (all trainers)"),
        _card(fmt_number(sum(losses) / len(losses)) if losses else "-", "loss (mean of trainers)"),
    ]
    return "<div class='cards'>" + "".join(cards) + "</div>"


def _plan(snapshot: dict) -> str:
    """The balancer's plan now (an older snapshot or a replayed one may have none)."""
    rebalance = snapshot.get("rebalance")
    if not rebalance:
        return ""
    return f"<p class='plan'>{escape(format_plan(rebalance))}</p>"


def _stage_panel(stage: dict, snapshot: dict) -> str:
    index, peers = stage["index"], stage["peers"]
    mark = " <span class='bottleneck'>bottleneck</span>" if index == snapshot.get("bottleneck") else ""
    rows = []
    for peer in peers[:MAX_PEER_ROWS]:
        other = (
            "" if peer.get("same_config", True) else " <span class='muted'>(other config: not used)</span>"
        )
        rows.append(
            f"<tr class='peer'><td title='{escape(peer['peer_id'])}'>{escape(short_id(peer['peer_id']))}</td>"
            f"<td>{escape(str(peer.get('state')))}{other}</td>"
            f"<td class='num'>{fmt_number(peer.get('throughput_samples_per_s'))}</td>"
            f"<td>{escape(str(peer.get('limit', '-')))}</td>"
            f"<td class='num'>{fmt_number(peer.get('queue'))}</td><td class='num'>{fmt_number(peer.get('epoch'))}</td></tr>"
        )
    if len(peers) > MAX_PEER_ROWS:
        rows.append(
            f"<tr><td colspan='6' class='muted'>... and {len(peers) - MAX_PEER_ROWS} more peers</td></tr>"
        )
    if not peers:
        rows.append("<tr><td colspan='6' class='muted'>no peer announced</td></tr>")
    return (
        f"<section class='panel stage' id='stage-{index}' data-peers='{len(peers)}'>"
        f"<h3>Stage {index}: {len(peers)} peer(s), {fmt_number(stage['throughput_samples_per_s'])} samples/s{mark}</h3>"
        "<table><tr><th>peer</th><th>state</th><th>samples/s</th><th>limited by</th><th>queue</th><th>step</th></tr>"
        + "".join(rows)
        + "</table></section>"
    )


def _charts(points: list[dict], snapshot: dict, meta: PageMeta) -> str:
    axis = _time_axis(points, meta)
    start = points[0]["time"] if points else 0.0
    trainer_ids = sorted({t for p in points for t in p["trainers"]})

    def per_trainer(key: str) -> dict:
        return {
            t: [(p["time"] - start, p["trainers"].get(t, {}).get(key)) for p in points] for t in trainer_ids
        }

    stages = max((len(p["stage_throughput"]) for p in points), default=0)
    by_stage = {
        f"stage {i}": [(p["time"] - start, _at(p["stage_throughput"], i)) for p in points]
        for i in range(stages)
    }
    no_loss = "no loss reported (a simulator run does not model loss)" if meta.simulated else "no loss yet"
    charts = [
        stage_bars(snapshot["stages"], snapshot.get("bottleneck")),
        line_chart(by_stage, title="throughput per stage over time (samples/s)", **axis),
        line_chart(
            per_trainer("loss"),
            title="training loss per trainer",
            **axis,
            y_from_zero=False,
            empty_text=no_loss,
        ),
        line_chart(per_trainer("samples_per_s"), title="samples/s per trainer", **axis),
    ]
    return "<div class='grid2'>" + "".join(f"<div class='panel'>{c}</div>" for c in charts) + "</div>"


def _work_chart(points: list[dict], meta: PageMeta) -> str:
    start = points[0]["time"] if points else 0.0
    series = {
        WORK_SERIES[key]: [(p["time"] - start, p["work"].get(key)) for p in points]
        for key in WORK_SERIES
        if any(p["work"].get(key) is not None for p in points)
    }
    return line_chart(
        series,
        title="lost and retried work (totals)",
        **_time_axis(points, meta),
        empty_text="no counters reported",
    )


def _time_axis(points: list[dict], meta: PageMeta) -> dict:
    """One time axis for every chart: seconds from the first snapshot to the latest."""
    span_s = points[-1]["time"] - points[0]["time"] if points else 0.0
    label = "simulated seconds" if meta.simulated else "seconds since the monitor started"
    return {"x_label": label, "x_range": (0.0, span_s)}


def _at(values: list, index: int):
    return values[index] if index < len(values) else None


def _trainers(snapshot: dict) -> str:
    trainers = snapshot.get("trainers", [])
    if not trainers:
        return "<p class='muted'>no trainer publishes metrics</p>"
    rows = [
        f"<tr class='trainer' data-trainer='{escape(t['trainer_id'])}'><td>{escape(t['trainer_id'])}</td>"
        f"<td class='num loss'>{fmt_number(t.get('loss'))}</td><td class='num'>{fmt_number(t.get('samples_per_s'))}</td>"
        f"<td class='num'>{fmt_number(t.get('samples'))}</td><td class='num'>{fmt_number(t.get('failed'))}</td></tr>"
        for t in trainers
    ]
    head = "<tr><th>trainer</th><th>loss</th><th>samples/s</th><th>samples</th><th>failed</th></tr>"
    return "<table>" + head + "".join(rows) + "</table>"


def _work(snapshot: dict) -> str:
    work = snapshot.get("work") or {}
    rows = [
        f"<tr class='work' data-key='{key}'><td>{escape(label)}</td><td class='num'>{fmt_number(work.get(key))}</td></tr>"
        for key, label in WORK_LABELS.items()
    ]
    return "<table>" + "".join(rows) + "</table>"


def _events(events: list[dict], meta: PageMeta) -> str:
    if not events:
        return "<p class='muted'>nothing happened yet</p>"
    rows = [
        f"<tr class='event' data-kind='{escape(e['kind'])}'><td class='muted when'>{_when(e.get('time'), meta)}</td>"
        f"<td>{escape(e['kind'])}</td><td>{escape(e['text'])}</td></tr>"
        for e in reversed(events[-MAX_EVENT_ROWS:])
    ]
    return "<table><tr><th>when</th><th>kind</th><th>what</th></tr>" + "".join(rows) + "</table>"


def _replicas(snapshot: dict) -> str:
    replicas = snapshot.get("replicas", [])
    if not replicas:
        return ""
    rows = [
        f"<tr><td>{escape(short_id(r['peer_id']))}</td><td class='num'>{fmt_number(r.get('outer_step'))}</td>"
        f"<td class='num'>{fmt_number(r.get('inner_step'))}</td><td class='num'>{fmt_number(r.get('samples_per_s'))}</td>"
        f"<td class='num'>{fmt_number(r.get('loss'))}</td></tr>"
        for r in replicas
    ]
    head = "<tr><th>replica</th><th>outer step</th><th>local step</th><th>samples/s</th><th>loss</th></tr>"
    return "<h2>Whole-model replicas</h2><table>" + head + "".join(rows) + "</table>"
