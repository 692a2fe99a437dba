"""DHT records of a run: stage announcements, per-stage training progress and peer metrics.

Keys (docs/DESIGN.md section 4), one subkey per peer (its base58 peer id), every subkey with its own
expiration so that dead peers disappear by themselves:
- `{run}.stage{i}`          -> StageAnnouncement (addresses, throughput, queue, digest, state version)
- `{run}.stage{i}.progress` -> {epoch, samples, ready, params_digest, time}: drives intra-stage steps
- `{run}.metrics`           -> {role, stage, step, loss, samples_per_s, time, ...}
- `{run}.replicas`          -> {digest, outer_step, inner_step, samples_per_s, fp, time}: whole-model
                               replicas (`swarmtrain replica`)
- `{run}.moves`             -> {from, to, rate, state, time}: rebalancing leases (proposed, moving, done)
- `{run}.stops`             -> {step, shards, time}, subkey `shard{i}`: where a trainer shard on a time
                               limit proposes that every shard stops (planner/stop_step.py)

Every call is bounded by a timeout (a dead DHT process would otherwise hang callers forever) and
tolerates malformed values from other peers (skipped, never raised).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)


def live_subkeys(found) -> dict[str, object]:
    """A dictionary record as hivemind returns it (or None) -> {subkey: value} of its live entries
    (a peer that went offline stores None; malformed subkeys are skipped)."""
    if found is None or not isinstance(found.value, dict):
        return {}
    out = {}
    for subkey, item in found.value.items():
        value = getattr(item, "value", None)
        if isinstance(subkey, str) and value is not None:
            out[subkey] = value
    return out


def stage_key(run_id: str, stage: int) -> str:
    return f"{run_id}.stage{stage}"


def progress_key(run_id: str, stage: int) -> str:
    return f"{run_id}.stage{stage}.progress"


def metrics_key(run_id: str) -> str:
    return f"{run_id}.metrics"


def replicas_key(run_id: str) -> str:
    return f"{run_id}.replicas"


def moves_key(run_id: str) -> str:
    return f"{run_id}.moves"


def stops_key(run_id: str) -> str:
    return f"{run_id}.stops"


@dataclass
class StageAnnouncement:
    """What a stage server tells trainers about itself."""

    stage: int
    addresses: list[str]
    throughput_samples_per_s: float
    queue_len: int
    config_digest: str
    state_version: int
    state: str = "online"  # joining | online | offline
    announced_at: float = field(default_factory=time.time)
    # reachable only through relays (--auto-relay): it dials out, nobody dials it directly
    behind_nat: bool = False
    # the TCP port of its direct data plane for hand-offs (net/data_plane.py); 0: none, use libp2p
    data_port: int = 0

    def to_value(self) -> dict:
        return asdict(self)

    @classmethod
    def from_value(cls, value) -> StageAnnouncement | None:
        try:
            return cls(
                stage=int(value["stage"]),
                addresses=[str(a) for a in value["addresses"]][:16],
                throughput_samples_per_s=float(value["throughput_samples_per_s"]),
                queue_len=int(value["queue_len"]),
                config_digest=str(value["config_digest"]),
                state_version=int(value["state_version"]),
                state=str(value.get("state", "online")),
                announced_at=float(value.get("announced_at", 0.0)),
                behind_nat=value.get("behind_nat", False) is True,
                data_port=_port(value.get("data_port", 0)),
            )
        except (KeyError, TypeError, ValueError):
            return None


def _port(value) -> int:
    """A TCP port from a record; anything else reads as none (0), like an older record's."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536 else 0


class RunRecords:
    """Reads and writes the records of one run through a hivemind DHT, every call with a timeout."""

    def __init__(self, dht, run_id: str, timeout_s: float = 5.0) -> None:
        self.dht = dht
        self.run_id = run_id
        self.timeout_s = timeout_s

    # generic ------------------------------------------------------------------------------------
    def _store(self, key: str, subkey: str, value, ttl_s: float) -> bool:
        from hivemind.utils import get_dht_time

        try:
            future = self.dht.store(key, value, get_dht_time() + ttl_s, subkey=subkey, return_future=True)
            return bool(future.result(timeout=self.timeout_s))
        except Exception as exc:  # timeouts and a dead DHT process: report, caller retries next period
            logger.warning("DHT store of %s failed: %r", key, exc)
            return False

    def _get_dict(self, key: str) -> dict[str, object]:
        try:
            found = self.dht.get(key, latest=True, return_future=True).result(timeout=self.timeout_s)
        except Exception as exc:
            logger.warning("DHT get of %s failed: %r", key, exc)
            return {}
        return live_subkeys(found)

    # announcements ------------------------------------------------------------------------------
    def announce(self, peer_id: str, announcement: StageAnnouncement, ttl_s: float) -> bool:
        return self._store(
            stage_key(self.run_id, announcement.stage), peer_id, announcement.to_value(), ttl_s
        )

    def stage_peers(self, stage: int) -> dict[str, StageAnnouncement]:
        peers = {}
        for peer_id, value in self._get_dict(stage_key(self.run_id, stage)).items():
            parsed = StageAnnouncement.from_value(value) if isinstance(value, dict) else None
            if parsed is not None and parsed.stage == stage and parsed.state != "offline":
                peers[peer_id] = parsed
        return peers

    # progress -----------------------------------------------------------------------------------
    def publish_progress(self, stage: int, peer_id: str, progress: dict, ttl_s: float) -> bool:
        return self._store(progress_key(self.run_id, stage), peer_id, dict(progress, time=time.time()), ttl_s)

    def stage_progress(self, stage: int) -> dict[str, dict]:
        out = {}
        for peer_id, value in self._get_dict(progress_key(self.run_id, stage)).items():
            if (
                isinstance(value, dict)
                and isinstance(value.get("epoch"), int)
                and isinstance(value.get("samples"), int)
            ):
                out[peer_id] = value
        return out

    # metrics ------------------------------------------------------------------------------------
    def publish_metrics(self, peer_id: str, metrics: dict, ttl_s: float) -> bool:
        return self._store(metrics_key(self.run_id), peer_id, dict(metrics, time=time.time()), ttl_s)

    def metrics(self) -> dict[str, dict]:
        return {k: v for k, v in self._get_dict(metrics_key(self.run_id)).items() if isinstance(v, dict)}

    # whole-model replicas -------------------------------------------------------------------------
    def publish_replica(self, peer_id: str, record: dict, ttl_s: float) -> bool:
        return self._store(replicas_key(self.run_id), peer_id, dict(record, time=time.time()), ttl_s)

    def replicas(self, digest: str) -> dict[str, dict]:
        """Live replicas of this config (a record of another digest is another run's, never counted)."""
        out = {}
        for peer_id, value in self._get_dict(replicas_key(self.run_id)).items():
            if (
                isinstance(value, dict)
                and value.get("digest") == digest
                and isinstance(value.get("outer_step"), int)
                and isinstance(value.get("inner_step"), int)
            ):
                out[peer_id] = value
        return out

    # rebalancing moves in progress ----------------------------------------------------------------
    def publish_move(self, peer_id: str, record: dict, ttl_s: float) -> bool:
        return self._store(moves_key(self.run_id), peer_id, dict(record, time=time.time()), ttl_s)

    def moves(self) -> dict[str, dict]:
        return {k: v for k, v in self._get_dict(moves_key(self.run_id)).items() if isinstance(v, dict)}

    # where trainers on a time limit stop ----------------------------------------------------------
    def publish_stop(self, shard: int, shard_count: int, step: int, ttl_s: float) -> bool:
        record = {"step": step, "shards": shard_count, "time": time.time()}
        return self._store(stops_key(self.run_id), f"shard{shard}", record, ttl_s)

    def stops(self, shard_count: int, since: float) -> dict[int, int]:
        """shard -> proposed stop step, of records made at or after `since` (a time.time() value) by
        shards of a run with `shard_count` shards (an earlier launch's records are not this stop's)."""
        out = {}
        for subkey, value in self._get_dict(stops_key(self.run_id)).items():
            shard = subkey.removeprefix("shard")
            if not (isinstance(value, dict) and shard.isdigit() and int(shard) < shard_count):
                continue
            step, shards, made = value.get("step"), value.get("shards"), value.get("time")
            fresh = isinstance(made, (int, float)) and made >= since
            if type(step) is int and shards == shard_count and fresh:
                out[int(shard)] = step
        return out
