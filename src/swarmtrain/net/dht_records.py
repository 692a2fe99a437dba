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
- `{run}.settings`          -> {digest, settings, time}: what a server's config digest is made of
                               (RunConfig.settings_summary), so that a peer of another digest can name
                               the settings that differ. Apart from the announcements, which are read
                               several times a second: there it was 60% of every record's bytes

Every call is bounded by a timeout (a dead DHT process would otherwise hang callers forever) and
tolerates malformed values from other peers (skipped, never raised). A stage server's records allow an
idle slack (planner/idle_pace.py): reads of a key reuse the last one, stores of an unchanged value
are skipped, and stores live longer, within it; everyone else's read and store every time. A store never
expires before the last one of its subkey from these records (the DHT would refuse it).
"""

from __future__ import annotations

import copy
import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from swarmtrain.planner.idle_pace import (
    may_reuse_read,
    may_skip_store,
    outlasting_expiration,
    store_expiration,
    stored_ttl_s,
)
from swarmtrain.planner.link_capacity import COMPUTE, DOWNLINK, UPLINK
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


def settings_key(run_id: str) -> str:
    return f"{run_id}.settings"


# a server stores its settings record this often (runtime/server/server_process.py), to live three times as
# long: it never changes in a run
SETTINGS_PERIOD_S = 20.0
SETTINGS_TTL_S = 3 * SETTINGS_PERIOD_S


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
    # what limits the announced throughput: compute, or a direction of its links (runtime/server/capacity.py)
    limit: str = "compute"
    # the swarm's samples per second as this replica's applied steps show it (runtime/server/step_rate.py);
    # 0: not known. The balancer models what its stages' capacities do not explain (planner/rebalance.py)
    swarm_samples_per_s: float = 0.0
    # the busy fraction of the resource that limits it (runtime/server/step_rate.Utilization); 0: not known
    utilization: float = 0.0
    # what its config digest is made of (RunConfig.settings_summary), as servers before the `{run}.settings`
    # record announced it; today's servers leave it empty ({}) and publish it there
    settings: dict[str, str] = field(default_factory=dict)

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
                limit=_limit(value.get("limit")),
                swarm_samples_per_s=_rate(value.get("swarm_samples_per_s", 0.0)),
                utilization=_fraction(value.get("utilization", 0.0)),
                settings=_settings(value.get("settings")),
            )
        except (KeyError, TypeError, ValueError):
            return None


LIMITS = (COMPUTE, UPLINK, DOWNLINK)


def _limit(value) -> str:
    """The limiting resource a record names; anything else (an older record's none) reads as compute."""
    return value if value in LIMITS else "compute"


MAX_RATE_SAMPLES_PER_S = 1e9


def _rate(value) -> float:
    """A rate from a record: finite, 0 to `MAX_RATE_SAMPLES_PER_S`; anything else reads as 0 (not known),
    like an older record's none."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return 0.0
    return float(value) if 0 <= value <= MAX_RATE_SAMPLES_PER_S else 0.0


def _fraction(value) -> float:
    """A fraction from a record, 0 to 1; anything else reads as 0 (not known)."""
    rate = _rate(value)
    return rate if rate <= 1 else 0.0


MAX_SETTINGS = 128  # a settings summary holds ~40; more, or a key or value longer than below, is none
MAX_SETTING_CHARS = 128


def _settings(value) -> dict[str, str]:
    """A settings summary from a record (str -> str, bounded); anything else reads as none ({})."""
    if not isinstance(value, dict) or len(value) > MAX_SETTINGS:
        return {}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return {}
    if any(len(k) > MAX_SETTING_CHARS or len(v) > MAX_SETTING_CHARS for k, v in value.items()):
        return {}
    return dict(value)


def _port(value) -> int:
    """A TCP port from a record; anything else reads as none (0), like an older record's."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536 else 0


# How long a reader keeps routing to a peer whose record lapsed without saying "offline". The servers are
# the DHT's nodes, so while some are cut off or frozen, the others' stores time out and their records
# lapse as they serve: without the grace a trainer can see no peer of a stage for 30 s while a replica
# of it serves (docs/LOG.md, the WAN-bed chaos runs). A dead peer is banned by its first failed call; a
# leaving one says "offline" and is dropped at once.
LAPSE_GRACE_S = 45.0


@dataclass
class StageView:
    """One stage's usable peers as a reader keeps them between DHT reads: every peer a read lists as
    `usable`, plus those missing from the read (not listed at all) that a read listed within `grace_s`."""

    usable: Callable[[StageAnnouncement], bool] = lambda announcement: announcement.state == "online"
    grace_s: float = LAPSE_GRACE_S
    peers: dict[str, StageAnnouncement] = field(default_factory=dict)
    _seen_at_s: dict[str, float] = field(default_factory=dict)

    def update(self, found: dict[str, StageAnnouncement], now_s: float) -> dict[str, StageAnnouncement]:
        """Fold one read (every record of the stage, "offline" ones included) in; returns `peers`."""
        listed = {peer: a for peer, a in found.items() if self.usable(a)}
        self._seen_at_s.update(dict.fromkeys(listed, now_s))
        lapsed = {
            peer: a
            for peer, a in self.peers.items()
            if peer not in found and now_s - self._seen_at_s[peer] < self.grace_s
        }
        self.peers = {**lapsed, **listed}
        self._seen_at_s = {peer: self._seen_at_s[peer] for peer in self.peers}
        return self.peers


# fields of a record's value that say when it was written, not what it says: a store of a value that
# differs only in them is a store of the same record (skipped within the slack)
TIME_STAMP_FIELDS = frozenset({"time", "announced_at"})


def _without_time_stamps(value):
    """A copy to compare the next store's value with (a caller may change its lists afterwards)."""
    if isinstance(value, dict):
        value = {k: v for k, v in value.items() if k not in TIME_STAMP_FIELDS}
    return copy.deepcopy(value)


def no_slack() -> float:
    return 0.0


class StoreExpirations:
    """When the last store of each (key, subkey) a peer made expires (DHT time), shared by the views of
    its records (`RunRecords.without_slack`): the DHT keeps the value of a subkey that expires last, so
    each store must expire after the one before it (planner/idle_pace.store_expiration)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the sync thread, the loop's executor threads store
        self._last: dict[tuple[str, str], float] = {}  # one entry per record of this peer's

    def next(self, key: tuple[str, str], ttl_s: float, now_s: float) -> tuple[float, bool]:
        """(the next store's expiration, whether this peer stored the subkey before); remembered before
        the call: a store that timed out may still have landed."""
        with self._lock:
            last = self._last.get(key)
            self._last[key] = expiration = store_expiration(now_s, ttl_s, last)
        return expiration, last is not None

    def outlast(self, key: tuple[str, str], ttl_s: float, now_s: float) -> float:
        """An expiration past any store of the subkey a previous life of this peer can have made."""
        with self._lock:
            self._last[key] = expiration = max(outlasting_expiration(now_s, ttl_s), self._last.get(key, 0.0))
        return expiration


class RunRecords:
    """Reads and writes the records of one run through a hivemind DHT, every call with a timeout.

    `slack_s()`: how stale a read may be and how long an unchanged record's re-store may wait now
    (planner/idle_pace.py; a stage server's `ActivityClock`); by default none: every read and store goes
    to the DHT. `without_slack()` is a view that never allows any (the balancer's lease protocol)."""

    def __init__(
        self,
        dht,
        run_id: str,
        timeout_s: float = 5.0,
        slack_s: Callable[[], float] = no_slack,
        expirations: StoreExpirations | None = None,
    ) -> None:
        """`expirations`: shared with the other views of the same peer's records (`without_slack`)."""
        self.dht = dht
        self.run_id = run_id
        self.timeout_s = timeout_s
        self.slack_s = slack_s
        self._lock = threading.Lock()  # the sync thread, the loop's executor threads read and store
        self._reads: dict[str, tuple[float, dict[str, object]]] = {}  # key -> (read at, live subkeys)
        self._stored: dict[tuple[str, str], tuple[float, float, object]] = {}  # -> (at, ttl, value)
        self._expirations = expirations if expirations is not None else StoreExpirations()
        self.reads_reused = self.stores_skipped = 0

    def without_slack(self) -> RunRecords:
        return RunRecords(self.dht, self.run_id, self.timeout_s, expirations=self._expirations)

    # generic ------------------------------------------------------------------------------------
    def _store(self, key: str, subkey: str, value, ttl_s: float) -> bool:
        from hivemind.utils import get_dht_time

        # ages in DHT (wall) time, as the record's expiration: a monotonic clock stops while a host sleeps
        now_s, comparable, slack_s = get_dht_time(), _without_time_stamps(value), self.slack_s()
        with self._lock:
            last = self._stored.get((key, subkey))
        unchanged = last is not None and last[2] == comparable
        if last is not None and may_skip_store(unchanged, now_s - last[0], last[1], slack_s):
            self.stores_skipped += 1
            return True  # the same record is in the DHT with over half its life ahead
        ttl_s = stored_ttl_s(ttl_s, slack_s)
        stored = self._put(key, subkey, value, ttl_s)
        with self._lock:
            if not unchanged:  # a read from before this store does not show it
                self._reads.pop(key, None)
            if stored:
                self._stored[(key, subkey)] = (now_s, ttl_s, comparable)
            else:
                self._stored.pop((key, subkey), None)
        return stored

    def _put(self, key: str, subkey: str, value, ttl_s: float) -> bool:
        """One store, expiring after the last one of its subkey. The first of a subkey in this process,
        when the DHT answers False (a node refused it, or none answered), goes once more outlasting any
        store a previous life of this peer (restarted with its --identity-path) can have made."""
        from hivemind.utils import get_dht_time

        expiration, known = self._expirations.next((key, subkey), ttl_s, get_dht_time())
        stored = self._dht_store(key, subkey, value, expiration)
        if stored is False and not known:
            expiration = self._expirations.outlast((key, subkey), ttl_s, get_dht_time())
            stored = self._dht_store(key, subkey, value, expiration)
        return bool(stored)

    def _dht_store(self, key: str, subkey: str, value, expiration: float) -> bool | None:
        """True: stored; False: refused, or no node answered (hivemind's verdict); None: failed (a
        timeout, a dead DHT process)."""
        try:
            future = self.dht.store(key, value, expiration, subkey=subkey, return_future=True)
            return bool(future.result(timeout=self.timeout_s))
        except Exception as exc:  # report; the caller retries next period
            logger.warning("DHT store of %s failed: %r", key, exc)
            return None

    def _get_dict(self, key: str) -> dict[str, object]:
        from hivemind.utils import get_dht_time

        now_s = get_dht_time()
        with self._lock:
            last = self._reads.get(key)
        if last is not None and may_reuse_read(now_s - last[0], self.slack_s()):
            self.reads_reused += 1
            return dict(last[1])
        try:
            found = self.dht.get(key, latest=True, return_future=True).result(timeout=self.timeout_s)
        except Exception as exc:  # a failed read is not remembered: the next one asks the DHT again
            logger.warning("DHT get of %s failed: %r", key, exc)
            return {}
        live = live_subkeys(found)
        with self._lock:
            self._reads[key] = (now_s, live)
        return dict(live)

    # announcements ------------------------------------------------------------------------------
    def announce(self, peer_id: str, announcement: StageAnnouncement, ttl_s: float) -> bool:
        return self._store(
            stage_key(self.run_id, announcement.stage), peer_id, announcement.to_value(), ttl_s
        )

    def stage_peers(self, stage: int, with_offline: bool = False) -> dict[str, StageAnnouncement]:
        """The stage's announcements; "offline" ones (a peer that is leaving) only `with_offline`."""
        peers = {}
        for peer_id, value in self._get_dict(stage_key(self.run_id, stage)).items():
            parsed = StageAnnouncement.from_value(value) if isinstance(value, dict) else None
            if parsed is not None and parsed.stage == stage and (with_offline or parsed.state != "offline"):
                peers[peer_id] = parsed
        return peers

    def _publish(self, key: str, peer_id: str, record: dict, ttl_s: float) -> bool:
        """A peer's record under `key`, stamped with when it was made (readers show its age)."""
        return self._store(key, peer_id, dict(record, time=time.time()), ttl_s)

    def _records(self, key: str, fields_ok: Callable[[dict], bool] = lambda record: True) -> dict[str, dict]:
        """The peers' records under `key` whose fields pass `fields_ok` (anything but a dict is dropped:
        a stranger's or an older version's value is never handed on)."""
        items = self._get_dict(key).items()
        return {peer_id: value for peer_id, value in items if isinstance(value, dict) and fields_ok(value)}

    # progress -----------------------------------------------------------------------------------
    def publish_progress(self, stage: int, peer_id: str, progress: dict, ttl_s: float) -> bool:
        return self._publish(progress_key(self.run_id, stage), peer_id, progress, ttl_s)

    def stage_progress(self, stage: int) -> dict[str, dict]:
        return self._records(
            progress_key(self.run_id, stage),
            lambda v: isinstance(v.get("epoch"), int) and isinstance(v.get("samples"), int),
        )

    # settings -----------------------------------------------------------------------------------
    def publish_settings(self, peer_id: str, digest: str, settings: dict[str, str]) -> bool:
        return self._publish(
            settings_key(self.run_id), peer_id, {"digest": digest, "settings": settings}, SETTINGS_TTL_S
        )

    def published_settings(self) -> dict[str, dict[str, str]]:
        """Config digest -> what it is made of, as the servers of each published it (one DHT read)."""
        out: dict[str, dict[str, str]] = {}
        for record in self._records(
            settings_key(self.run_id), lambda v: isinstance(v.get("digest"), str)
        ).values():
            settings = _settings(record.get("settings"))
            if settings:
                out.setdefault(record["digest"], settings)
        return out

    # metrics ------------------------------------------------------------------------------------
    def publish_metrics(self, peer_id: str, metrics: dict, ttl_s: float) -> bool:
        return self._publish(metrics_key(self.run_id), peer_id, metrics, ttl_s)

    def metrics(self) -> dict[str, dict]:
        return self._records(metrics_key(self.run_id))

    # whole-model replicas -------------------------------------------------------------------------
    def publish_replica(self, peer_id: str, record: dict, ttl_s: float) -> bool:
        return self._publish(replicas_key(self.run_id), peer_id, record, ttl_s)

    def replicas(self, digest: str) -> dict[str, dict]:
        """Live replicas of this config (a record of another digest is another run's, never counted)."""
        return self._records(
            replicas_key(self.run_id),
            lambda v: (
                v.get("digest") == digest
                and isinstance(v.get("outer_step"), int)
                and isinstance(v.get("inner_step"), int)
            ),
        )

    # rebalancing moves in progress ----------------------------------------------------------------
    def publish_move(self, peer_id: str, record: dict, ttl_s: float) -> bool:
        return self._publish(moves_key(self.run_id), peer_id, record, ttl_s)

    def moves(self) -> dict[str, dict]:
        return self._records(moves_key(self.run_id))

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
