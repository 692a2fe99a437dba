"""One table from bench/device_stage.py's summary JSON files (tools/gpu/check.sh), with issue 53's
criteria: served / shared-device bound >= 0.85, recomputed backwards <= 5%, batching on / off >= 1.3 with 4
trainers of micro-batch 2, swapped / resident <= 1.5.

    python tools/gpu/summary.py gpu-out/device_stage_*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CRITERIA = {
    "served/bound": (0.85, ">="),
    "recomputed": (0.05, "<="),
    "on/off": (1.3, ">="),
    "swap": (1.5, "<="),
}


def _num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _verdict(name: str, value) -> str:
    if value is None:
        return ""
    limit, sense = CRITERIA[name]
    met = value >= limit if sense == ">=" else value <= limit
    return "" if met else " !"


def rows(report: dict) -> list[str]:
    setup = report["setup"]
    batching = {e["trainers"]: e.get("on_over_off") for e in report.get("batching", [])}
    on_off = batching.get(4)
    swap = (report.get("swap") or {}).get("swapped_over_resident")
    lines = []
    for entry in report.get("served", []):
        local = entry.get("local_samples_per_s") or {}
        stages = "/".join(_num(local.get(str(i)), ".0f") for i in range(setup["num_stages"]))
        ratio = entry.get("served_over_shared_bound")
        recomputed = entry.get("recomputed_share")
        lines.append(
            f"{setup['preset']:<11} {entry['dtype']:<5} {entry.get('in_flight') or 'def':>5} {stages:>23} "
            f"{_num(entry.get('shared_bound'), '.1f'):>7} "
            f"{_num(entry['run'].get('samples_per_s'), '.1f'):>7} {_num(ratio, '.2f') + _verdict('served/bound', ratio):>8} "
            f"{_num(recomputed, '.0%') + _verdict('recomputed', recomputed):>7} "
            f"{_num(on_off, '.2f') + _verdict('on/off', on_off):>7} {_num(swap, '.2f') + _verdict('swap', swap):>7}"
        )
    return lines


def swarm_line(result: dict) -> str:
    """tools/gpu/one_gpu_swarm.py's result: the swarm on one GPU over `train-local` there (>= 0.6)."""
    ratio = result.get("swarm_over_local")
    return (
        f"4-stage swarm on one GPU ({result.get('preset')} {result.get('dtype')}, "
        f"{result.get('in_flight') or 'default'} in flight): {_num(result.get('swarm_samples_per_s'), '.1f')} "
        f"samples/s, train-local {_num(result.get('local_samples_per_s'), '.1f')}: "
        f"{_num(ratio, '.2f')}{' !' if ratio is None or ratio < 0.6 else ''} (>= 0.6)"
    )


def main(paths: list[str]) -> int:
    header = (
        f"{'preset':<11} {'dtype':<5} {'in fl':>5} {'local samples/s by stage':>23} {'bound':>7} {'served':>7} "
        f"{'srv/bnd':>8} {'recomp':>7} {'on/off':>7} {'swap':>7}"
    )
    lines = [header]
    for path in paths:
        try:
            report = json.loads(Path(path).read_text())
            lines += [swarm_line(report)] if "swarm_over_local" in report else rows(report)
        except (OSError, ValueError, KeyError) as exc:
            lines.append(f"{path}: unreadable ({exc})")
    lines.append(
        "in fl: micro-batches in flight (def: the trainer's default, 4 per stage); "
        "bound: 1 / sum(1 / local) of servers sharing the GPU; srv/bnd >= 0.85, recomp <= 5%, batching on/off "
        "(fp32, 4 trainers of micro-batch 2) >= 1.3, swapped/resident (fp32, budget 0.5) <= 1.5; ! marks a miss"
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
