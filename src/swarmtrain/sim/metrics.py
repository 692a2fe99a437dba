"""What a simulation measures: throughput over time against the optimum, utilization, bytes, events.

Samples count when their micro-batch finishes its last backward (SWARM, async replicas: when a local
step ends; GPipe: when the pipeline's step ends). Per-stage utilization is busy compute seconds divided
by serving peer-seconds of that stage in each interval, attributed exactly to the interval they fall in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BYTE_KINDS = ("tokens", "activations", "gradients", "averaging", "state")


def _mean(values: list) -> float:
    return sum(values) / len(values) if values else 0.0


@dataclass
class SimResult:
    mode: str
    num_stages: int
    duration_s: float
    summary: dict
    series: dict[str, list] = field(default_factory=dict)


class Metrics:
    def __init__(self, num_stages: int) -> None:
        self.num_stages = num_stages
        self.samples_completed = 0.0
        self.samples_lost = 0.0
        self.bytes_by_kind = dict.fromkeys(BYTE_KINDS, 0.0)
        self.counts = dict.fromkeys(
            ("joins", "leaves", "failures", "moves", "reroutes", "timeouts", "stalls"), 0
        )
        self.stage_busy_s = [0.0] * num_stages  # within the current interval
        self._serving = [0] * num_stages
        self._serving_acc_s = [0.0] * num_stages
        self._serving_since_s = [0.0] * num_stages
        self._last_sample_s = 0.0
        self._last_samples = 0.0
        self.series: dict[str, list] = {
            "time_s": [],
            "samples_per_s": [],
            "optimal_samples_per_s": [],
            "live_peers": [],
            "serving_peers": [],
            "bytes_moved": [],
            "utilization": [],
        }
        self._optimal_integral = 0.0

    # membership --------------------------------------------------------------------------------
    def serving_changed(self, now_s: float, stage: int, delta: int) -> None:
        self._serving_acc_s[stage] += self._serving[stage] * (now_s - self._serving_since_s[stage])
        self._serving_since_s[stage] = now_s
        self._serving[stage] += delta

    # sampling ----------------------------------------------------------------------------------
    def sample(self, now_s: float, optimal_samples_per_s: float, live_peers: int) -> bool:
        """Close the interval since the last sample; False (nothing recorded) for an empty one."""
        dt = now_s - self._last_sample_s
        if dt <= 0:
            return False
        rate = (self.samples_completed - self._last_samples) / dt
        utilization = []
        for s in range(self.num_stages):
            self.serving_changed(now_s, s, 0)
            peer_s = self._serving_acc_s[s]
            utilization.append(min(1.0, self.stage_busy_s[s] / peer_s) if peer_s > 0 else 0.0)
            self._serving_acc_s[s] = 0.0
            self.stage_busy_s[s] = 0.0
        series = self.series
        series["time_s"].append(now_s)
        series["samples_per_s"].append(rate)
        series["optimal_samples_per_s"].append(optimal_samples_per_s)
        series["live_peers"].append(live_peers)
        series["serving_peers"].append(sum(self._serving))
        series["bytes_moved"].append(sum(self.bytes_by_kind.values()))
        series["utilization"].append(utilization)
        self._optimal_integral += optimal_samples_per_s * dt
        self._last_sample_s, self._last_samples = now_s, self.samples_completed
        return True

    # summary -----------------------------------------------------------------------------------
    def summary(self, duration_s: float, events: int) -> dict:
        optimal = self._optimal_integral / duration_s if duration_s > 0 else 0.0
        achieved = self.samples_completed / duration_s if duration_s > 0 else 0.0
        times, rates, optima = (
            self.series["time_s"],
            self.series["samples_per_s"],
            self.series["optimal_samples_per_s"],
        )
        half = [i for i, t in enumerate(times) if t > duration_s / 2]
        steady_opt = sum(optima[i] for i in half)
        steady = sum(rates[i] for i in half) / steady_opt if steady_opt > 0 else 0.0
        utils = self.series["utilization"]
        mean_util = [sum(u[s] for u in utils) / len(utils) if utils else 0.0 for s in range(self.num_stages)]
        return {
            "samples_per_s": achieved,
            "optimal_samples_per_s": optimal,
            "fraction_of_optimal": achieved / optimal if optimal > 0 else 0.0,
            "steady_fraction_of_optimal": steady,
            "samples": self.samples_completed,
            "samples_lost": self.samples_lost,
            "bytes_moved": sum(self.bytes_by_kind.values()),
            "bytes_by_kind": dict(self.bytes_by_kind),
            "stage_utilization": mean_util,
            "mean_live_peers": _mean(self.series["live_peers"]),
            "mean_serving_peers": _mean(self.series["serving_peers"]),
            "events": events,
            **self.counts,
        }
