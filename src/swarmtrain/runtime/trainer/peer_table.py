"""A trainer's view of the swarm: the live servers of every stage, their routers and their bans.

DHT reads happen off the event loop (`fetch`, blocking); `apply` folds them into the per-stage IWRR
routers (planner/routing.py) on the loop thread, so routers are only ever touched by one thread.
Bans follow docs/DESIGN.md section 5: a peer that failed with a connection error stays banned until its
record expires (it disappears) or it re-announces after the ban; the trainer also lifts a ban when the
peer answers a ping again (`StageCaller.recheck_banned`: its announcement may not reach us while the
DHT's own nodes are cut off or frozen).

A stage whose announced peers all run another config digest is a mismatch, not a wait: once it has
been so for a grace (`mismatch`), the trainer stops with a one-line error naming the settings that
differ, from what the servers publish their digest is made of (RunConfig.settings_summary, the
`{run}.settings` record, read when a foreign digest is new; servers of older versions put it in their
announcements).
"""

from __future__ import annotations

import collections
import logging
import time

from swarmtrain.config.errors import UserError
from swarmtrain.config.run import differing_settings
from swarmtrain.net.data_plane import Address, dial_address
from swarmtrain.net.dht_records import RunRecords, StageAnnouncement, StageView
from swarmtrain.net.reachability import ip_and_tcp_port
from swarmtrain.planner.routing import StageRouter, can_hand_off
from swarmtrain.utils.logging import get_logger, log_repeated

logger = get_logger(__name__)

MAX_BAN_S = 60.0
# how long, in announce periods, a stage may show peers of other digests only before the trainer stops:
# long enough for a swarm restarted with a new config to replace its old records (they expire within 3
# announce periods) and for its servers to announce themselves as joining, short enough that a mistake
# is an error within half a minute of starting (20 s at the default 2 s period), not a wait for ever
MISMATCH_GRACE_PERIODS = 10


class RunMismatch(UserError):
    """Every peer of a stage runs other settings than ours: no trainer of this config can use it."""


class PeerTable:
    def __init__(
        self,
        records: RunRecords,
        num_stages: int,
        digest: str,
        settings: dict[str, str] | None = None,
        mismatch_grace_s: float = 20.0,
    ) -> None:
        self.records = records
        self.mismatch_grace_s = mismatch_grace_s  # see MISMATCH_GRACE_PERIODS
        self.num_stages = num_stages
        self.digest = digest
        self.settings = settings or {}  # what our digest is made of (RunConfig.settings_summary)
        self.routers = [StageRouter() for _ in range(num_stages)]
        self.announcements: list[dict[str, StageAnnouncement]] = [{} for _ in range(num_stages)]
        self.views = [StageView() for _ in range(num_stages)]
        self._banned_at: dict[str, float] = {}  # peer -> wall time of the ban
        self._warned_foreign: set[str] = set()
        # per stage: since when (monotonic) it shows peers of other digests and none of ours
        self._unmatched_since: list[float | None] = [None] * num_stages
        self._foreign: list[dict[str, StageAnnouncement]] = [{} for _ in range(num_stages)]
        self._foreign_settings: dict[str, dict[str, str]] = {}  # digest -> its settings (`fetch`)
        # peer -> when (monotonic) a DHT read last listed it, not "offline": how long a peer the trainer
        # cannot connect to has been gone from the DHT tells a dead peer (planner/close_retry.py)
        self._listed_at_s: dict[str, float] = {}

    def fetch(self) -> list[dict[str, StageAnnouncement]]:
        """Blocking DHT read of every stage's announcements (run in an executor), and of what each
        config digest other than ours is made of, once per digest (what a mismatch error names)."""
        fetched = [self.records.stage_peers(stage, with_offline=True) for stage in range(self.num_stages)]
        foreign = {a.config_digest for found in fetched for a in found.values()} - {self.digest}
        known = {d: s for d, s in self._foreign_settings.items() if d in foreign}  # bounded by what is seen
        if foreign - set(known):  # a digest not read yet (or not published yet: asked again next time)
            published = self.records.published_settings()
            known.update((d, published[d]) for d in foreign if d in published)
        self._foreign_settings = known
        return fetched

    def apply(self, fetched: list[dict[str, StageAnnouncement]], now_s: float | None = None) -> list[str]:
        """Update routers from fetched records; returns peers seen for the first time. A peer whose
        record lapsed stays routable for a while (`StageView`)."""
        now_s = time.monotonic() if now_s is None else now_s
        new_peers = []
        for stage, found in enumerate(fetched):
            self._listed_at_s.update((p, now_s) for p, a in found.items() if a.state != "offline")
            ours = {}
            for peer, ann in found.items():
                if ann.config_digest != self.digest:
                    if peer not in self._warned_foreign:
                        self._warned_foreign.add(peer)
                        log_repeated(  # a swarm of another run's peers: one line, then a count
                            logger,
                            logging.WARNING,
                            "ignoring peer %s of stage %d: config digest %s differs from ours (%s)",
                            *(peer, stage, ann.config_digest, self.digest),
                        )
                    continue
                ours[peer] = ann
            live = self.views[stage].update(ours, now_s)
            self._watch_mismatch(stage, live, found, now_s)
            router = self.routers[stage]
            for peer in router.peers:
                if peer not in live:
                    router.remove_peer(peer)
                    self._banned_at.pop(peer, None)
            for peer, ann in live.items():
                if peer not in router.peers:
                    router.add_peer(peer, ann.throughput_samples_per_s)
                    new_peers.append(peer)
                router.set_capacity(peer, ann.throughput_samples_per_s)
                banned_at = self._banned_at.get(peer)
                if banned_at is not None and (
                    ann.announced_at > banned_at or time.time() - banned_at > MAX_BAN_S
                ):
                    router.unban(peer)
                    del self._banned_at[peer]
            self.announcements[stage] = live
        return new_peers

    def _watch_mismatch(
        self, stage: int, live: dict, found: dict[str, StageAnnouncement], now_s: float
    ) -> None:
        foreign = {p: a for p, a in found.items() if a.config_digest != self.digest and a.state != "offline"}
        self._foreign[stage] = foreign
        # a peer of ours still joining (downloading the stage's state) is coming: no mismatch
        joining = any(a.config_digest == self.digest and a.state != "offline" for a in found.values())
        if live or joining or not foreign:
            self._unmatched_since[stage] = None
        elif self._unmatched_since[stage] is None:
            self._unmatched_since[stage] = now_s

    def mismatch(self, now_s: float) -> str | None:
        """The one-line error when a stage has shown peers of other digests only for `mismatch_grace_s`;
        None while every stage has a peer of ours, or none at all (servers may still be starting)."""
        for stage, since in enumerate(self._unmatched_since):
            if since is not None and now_s - since >= self.mismatch_grace_s:
                return self._mismatch_error(stage, now_s - since)
        return None

    def _mismatch_error(self, stage: int, waited_s: float) -> str:
        """The error naming the settings our digest and the stage's most common foreign one differ in."""
        foreign = self._foreign[stage]
        digest, count = collections.Counter(a.config_digest for a in foreign.values()).most_common(1)[0]
        announced = next(a.settings for a in foreign.values() if a.config_digest == digest)
        theirs = announced or self._foreign_settings.get(digest, {})  # announced: servers of older versions
        if theirs:
            differ = differing_settings(self.settings, theirs)
            named = "; ".join(
                f"{name}: this run {_shown(a)}, the servers {_shown(b)}" for name, a, b in differ
            )
            named = named or "settings this version does not list"
        else:
            named = "they do not announce their settings (an older version)"
        return (
            f"stage {stage} has had only servers of other settings for {waited_s:.0f} s ({count} with config "
            f"digest {digest}, this run {self.digest}): {named}. Start the trainer with the servers' settings "
            f"(the same run file and flags, e.g. --compression), or the servers with this run's"
        )

    def choose(self, stage: int, num_samples: int, weight: float, exclude=()) -> str | None:
        return self.routers[stage].choose(time.monotonic(), num_samples, weight, exclude)

    def report(self, stage: int, peer: str, num_samples: int, duration_s: float, weight: float) -> None:
        self.routers[stage].report(peer, num_samples, duration_s, weight)

    def ban(self, stage: int, peer: str) -> None:
        self.routers[stage].ban(peer, float("inf"))
        self._banned_at[peer] = time.time()

    def data_address(self, peer: str) -> Address | None:
        """Where `peer`'s data plane listens, from its announcement (None: it announces none, or it is
        not a peer we know)."""
        for announced in self.announcements:
            if peer in announced:
                return dial_address(announced[peer].addresses, announced[peer].data_port)
        return None

    def any_behind_nat(self) -> bool:
        return any(a.behind_nat for anns in self.announcements for a in anns.values())

    def behind_nat(self, stage: int, peer: str | None) -> bool:
        ann = self._announced(stage, peer)
        return ann is not None and ann.behind_nat

    def can_hand_off(self, stage: int, peer: str | None, next_peer: str | None) -> bool:
        """Can `peer` (of `stage`) hand off directly to `next_peer` (of the next stage)? From their
        announcements (planner/routing.py `can_hand_off`); an unknown or missing peer counts as public."""
        a, b = self._announced(stage, peer), self._announced(stage + 1, next_peer)
        if a is None or b is None:
            return True
        return can_hand_off((a.behind_nat, b.behind_nat), (_ips(a), _ips(b)))

    def _announced(self, stage: int, peer: str | None) -> StageAnnouncement | None:
        return self.announcements[stage].get(peer) if peer is not None else None

    def is_banned(self, peer: str) -> bool:
        return peer in self._banned_at

    def banned(self, stage: int) -> list[str]:
        return [p for p in self.routers[stage].peers if p in self._banned_at]

    def unban(self, stage: int, peer: str) -> None:
        self.routers[stage].unban(peer)
        self._banned_at.pop(peer, None)

    def unlisted_s(self, peer: str, now_s: float) -> float | None:
        """How long no DHT read has listed `peer` (as anything but "offline") at `now_s`; None if none ever
        did: no evidence that it is gone."""
        listed_at_s = self._listed_at_s.get(peer)
        return None if listed_at_s is None else max(0.0, now_s - listed_at_s)

    def close_recipients(self, stage: int, members: dict[str, int]) -> set[str]:
        """Who hears a close of `stage`: every replica of it we know of, banned ones too, and the
        members. A replica banned as frozen that wakes up then holds the close and applies the step
        with the others; one never told would wait a whole close timeout for it (and then apply the step
        short, diverging) while every micro-batch of the next step waits on it."""
        return set(self.routers[stage].peers) | set(members)

    def available(self, stage: int) -> list[str]:
        return self.routers[stage].available(time.monotonic())

    def peers_per_stage(self) -> list[int]:
        return [len(self.available(stage)) for stage in range(self.num_stages)]


def _shown(value: str) -> str:
    """A settings-summary value as a user writes it: a JSON string without its quotes."""
    return value[1:-1] if len(value) >= 2 and value[0] == value[-1] == '"' else value


def _ips(ann: StageAnnouncement) -> list[str]:
    """The IPs of a peer's announced addresses (a relayed address is the relay's: left out)."""
    return [ip for ip, _ in map(ip_and_tcp_port, ann.addresses) if ip]
