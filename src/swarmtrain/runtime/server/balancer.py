"""Live adaptive rebalancing: each server, every `swarm.rebalance_period_s` (jittered), reads every
stage's announcements and asks the pure policy the simulator uses (`planner.rebalance.plan_moves`, on
the announcements and leases through `planner.lease_plan.swarm_plan`, which `swarmtrain status` shows)
which peers should move to the bottleneck stage. The policy is deterministic on the same data, so every
server that reads the same loads computes the same plan, and each acts only on its own part of it: a
decision moves at most the server making it. A plan of several moves covers several parts of the gap
(each move is planned on the loads the previous ones leave, so two peers never move for the same part);
its hysteresis means a move always raises the pipeline's minimum and moves cannot ping-pong; it never
empties a stage (a stage's only server stays). A server also waits two periods after it starts serving
before it may move (its measured throughput settles first).

Leases (`{run}.moves` in the DHT, one subkey per mover): a server the plan names proposes its move,
waits `settle_s` for concurrent proposals to become visible, then plans again counting every committed
move and every proposal of a lower peer id as done; it commits ("moving") only if it is still named,
otherwise it withdraws. Every server counts each live lease as its mover serving the target already
(pending, at the rate the plan expected), whatever the mover's own records say mid-move, and the moved
server releases its lease ("done") when it serves. A new or changed lease makes every server decide at
its next announce period instead of waiting for its period: the rest of a plan follows the first move
within seconds. (Before, a single lease blocked every other move for max(30 s, 5 periods), and going
from 4+1 to 1+4 servers took three leases, 67 s at a 4 s period: bench/rebalance_live.py.)

How a server moves (runtime/server/server_process.py): it stops announcing (offline), finishes and
shuts down its stage like a graceful stop but keeps its DHT node; the same process then builds a server
for the target stage on that node, which joins like any joiner (downloads parameters and optimizer
state from that stage's peers) and logs and publishes what the move cost. hivemind's averager holds a
stage's tensors in shared memory in its own process, so each stage gets a new averager.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field

from swarmtrain.planner.lease_plan import (
    DONE,
    MOVING,
    PROPOSED,
    loads_from_announcements,
    swarm_plan,
    valid_lease,
)
from swarmtrain.planner.rebalance import Move, bottleneck_utilization
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)


def lease_record(from_stage: int, to_stage: int, rate_samples_per_s: float, state: str) -> dict:
    return {"from": from_stage, "to": to_stage, "rate": rate_samples_per_s, "state": state}


def move_lease(move: Move, state: str) -> dict:
    return lease_record(move.from_stage, move.to_stage, move.rate_samples_per_s, state)


@dataclass(frozen=True)
class MovedFrom:
    """What a server that moves hands to its next incarnation (same process, DHT node and peer id)."""

    stage: int
    decided_at_unix_s: float
    expected_samples_per_s: float  # what the plan expected of it at the target


@dataclass
class Balancer:
    """Decides, from the records, whether this server (`peer_id`) moves now."""

    peer_id: str
    num_stages: int
    digest: str
    period_s: float
    margin: float
    serving_since_s: float | None = None
    # between proposing and committing: a proposal another server stores meanwhile becomes visible.
    # Without it two servers deciding 1 s apart each re-read before the other's store and both moved
    # for the same gap (bench/rebalance_live.py)
    settle_s: float = 1.0
    _seen_leases: frozenset = frozenset()
    last_plan: list[str] = field(default_factory=list)  # the last plan computed, for the log
    _logged_plan: list[str] = field(default_factory=list)

    def jittered_period_s(self) -> float:
        return self.period_s * random.uniform(0.75, 1.25)

    @property
    def lease_ttl_s(self) -> float:
        """A lease's life if its mover never releases it (it died mid-move): the mover's stop, restart
        and state download take 5-20 s (bench/rebalance_live.py)."""
        return max(60.0, 5 * self.period_s)

    def leases_changed(self, records) -> bool:
        """Whether another server proposed, committed or released a move since we last looked: then
        decide now, since the plan that named it may name us too."""
        seen = frozenset(
            (peer, lease.get("state")) for peer, lease in records.moves().items() if peer != self.peer_id
        )
        changed, self._seen_leases = seen != self._seen_leases, seen
        return changed

    def decide(self, records, now_s: float | None = None) -> Move | None:
        """The move this server makes now, or None (see the module docstring for the lease protocol)."""
        now_s = time.monotonic() if now_s is None else now_s
        if self.serving_since_s is None or now_s - self.serving_since_s < 2 * self.period_s:
            return None
        move = self._my_move(records, lambda peer, lease: lease["state"] != DONE)
        if self.last_plan != self._logged_plan:  # what every server plans, when it changes
            self._logged_plan = self.last_plan
            logger.info("rebalancing: the plan is %s", self.last_plan or "no move")
        if move is None or not records.publish_move(
            self.peer_id, move_lease(move, PROPOSED), self.lease_ttl_s
        ):
            return None  # a proposal that was not stored protects nothing: decide next time
        logger.info("rebalancing: proposed a move to stage %d", move.to_stage)
        # twice: before committing, and after, since a check's reads can take longer than the settle and
        # a rival's commit may land meanwhile (both then withdraw if only one was needed: safe)
        for check_index in range(2):
            self.settle()
            check = self._my_move(records, self._counts_in_check)
            if (
                check is None
                or check.to_stage != move.to_stage
                or not records.publish_move(self.peer_id, move_lease(move, MOVING), self.lease_ttl_s)
            ):
                records.publish_move(self.peer_id, move_lease(move, DONE), self.lease_ttl_s)
                logger.info(
                    "rebalancing: withdrew the move at check %d (the plan now: %s)",
                    check_index,
                    self.last_plan,
                )
                return None
        return move

    def _counts_in_check(self, peer: str, lease: dict) -> bool:
        """Committed moves count; of concurrent proposals only lower peer ids' (a higher id's proposal
        gives way to ours: it counts ours when it checks)."""
        return lease["state"] == MOVING or (lease["state"] == PROPOSED and peer < self.peer_id)

    def _my_move(self, records, counts) -> Move | None:
        """Our part of the plan on the current records, with the leases `counts` keeps as done moves."""
        announced = {s: records.stage_peers(s) for s in range(self.num_stages)}
        # read last: the stage reads can take seconds, and a lease stored meanwhile counts
        leases = {
            peer: lease
            for peer, lease in records.moves().items()
            if peer != self.peer_id and valid_lease(lease, self.num_stages) and counts(peer, lease)
        }
        plan = swarm_plan(announced, leases, self.num_stages, self.digest, self.margin)
        self.last_plan = [_named(m) for m in plan]
        # for the log: the moves the capacities alone want that the bottleneck's busy fraction says are
        # not worth it
        held = swarm_plan(announced, leases, self.num_stages, self.digest, self.margin, weigh=False)[
            len(plan) :
        ]
        if held:
            loads = loads_from_announcements(announced, self.digest)
            busy = bottleneck_utilization(loads, self.num_stages) or 0.0
            names = ", ".join(map(_named, held))
            self.last_plan.append(f"(held back, the bottleneck busy {busy:.0%} of the time: {names})")
        return next((move for move in plan if move.peer == self.peer_id), None)

    def settle(self) -> None:
        time.sleep(self.settle_s)

    def hold(self, records, moved: MovedFrom, to_stage: int, done: bool) -> bool:
        """The moved server's lease: renewed while it joins (a long download outlived the lease and the
        plan sent another peer for the same gap), released once it serves (its own records count it
        then). False if the store failed: the caller tries again."""
        lease = lease_record(moved.stage, to_stage, moved.expected_samples_per_s, DONE if done else MOVING)
        return records.publish_move(self.peer_id, lease, self.lease_ttl_s)

    def announce_intent(self, records, announcement, ttl_s: float) -> None:
        """Count this server at its target stage (as joining), so others see the move before its new
        incarnation announces itself. `ttl_s` is a regular announcement's: the DHT keeps a record until
        one with a later expiry replaces it, so an intent held for the lease's length (30-50 s) refused
        the new incarnation's "online" records and trainers saw the moved server as joining, and routed
        nothing to it, for that long (measured in bench/rebalance_live.py)."""
        records.announce(self.peer_id, announcement, ttl_s)


def _named(move: Move) -> str:
    return f"{str(move.peer)[-8:]}:{move.from_stage}->{move.to_stage}"


def move_record(move_from: int, move_to: int, started_s: float, download_bytes: int) -> str:
    return json.dumps(
        {
            "from": move_from,
            "to": move_to,
            "seconds": round(time.time() - started_s, 2),
            "bytes": download_bytes,
        }
    )
