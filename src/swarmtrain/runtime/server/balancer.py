"""Live adaptive rebalancing: each server, every `swarm.rebalance_period_s` (jittered), reads every
stage's announcements and asks the pure policy the simulator uses (`planner.rebalance.choose_move`)
whether one peer should move to the bottleneck stage. The policy is deterministic on the same data, so
every server that reads the same loads names the same mover, and only the named one acts; its
hysteresis means a move always raises the pipeline's minimum and moves cannot ping-pong; it never
empties a stage (a stage's only server stays). Peers still joining a stage count toward its capacity and
never move. A server also waits two periods after it starts serving before it may move (its measured
throughput settles first).

How a server moves (runtime/server/stage_server.py, cli/server.py): it stops announcing (offline), finishes and
shuts down its stage like a graceful stop but keeps its DHT node; the same process then builds a server
for the target stage on that node, which joins like any joiner (downloads parameters and optimizer
state from that stage's peers) and logs and publishes what the move cost. hivemind's averager holds a
stage's tensors in shared memory in its own process, so each stage gets a new averager.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

from swarmtrain.planner.rebalance import Move, PeerLoad, RebalanceConfig, choose_move


def loads_from_announcements(announced: dict[int, dict], digest: str) -> list[PeerLoad]:
    """PeerLoads of the peers announcing this run's config (joining ones as pending)."""
    loads = []
    for stage, peers in announced.items():
        for peer, a in peers.items():
            if a.config_digest == digest and a.state in ("online", "joining"):
                loads.append(
                    PeerLoad(
                        peer, stage, a.throughput_samples_per_s, a.queue_len, pending=a.state == "joining"
                    )
                )
    return loads


@dataclass
class Balancer:
    """Decides, from the records, whether this server (`peer_id`) moves now."""

    peer_id: str
    num_stages: int
    digest: str
    period_s: float
    margin: float
    serving_since_s: float | None = None
    # between taking the lease and trusting it: a lease another server stores meanwhile becomes visible.
    # Without it two servers deciding 1 s apart each re-read before the other's store and both moved
    # (bench/rebalance_live.py)
    settle_s: float = 1.0

    def jittered_period_s(self) -> float:
        return self.period_s * random.uniform(0.75, 1.25)

    @property
    def lease_ttl_s(self) -> float:
        """How long a move blocks every other one: the mover's stop, restart and state download."""
        return max(30.0, 5 * self.period_s)

    def decide(self, records, now_s: float | None = None) -> Move | None:
        """The move this server makes now, or None. Only one move in the swarm at a time: a mover takes
        a lease in the DHT first and gives way to any other lease (the lower peer id wins a tie), so
        servers reading slightly different snapshots never empty a stage together."""
        now_s = time.monotonic() if now_s is None else now_s
        if self.serving_since_s is None or now_s - self.serving_since_s < 2 * self.period_s:
            return None
        if any(peer != self.peer_id for peer in records.moves()):
            return None  # someone is moving: wait until it is visible where it went
        announced = {s: records.stage_peers(s) for s in range(self.num_stages)}
        move = choose_move(
            loads_from_announcements(announced, self.digest), self.num_stages, RebalanceConfig(self.margin)
        )
        if move is None or move.peer != self.peer_id:
            return None
        records.publish_move(self.peer_id, {"from": move.from_stage, "to": move.to_stage}, self.lease_ttl_s)
        self.settle()
        if min(records.moves(), default=self.peer_id) != self.peer_id:
            return None  # another server took a lease at the same moment
        return move

    def settle(self) -> None:
        time.sleep(self.settle_s)

    def announce_intent(self, records, announcement, ttl_s: float) -> None:
        """Count this server at its target stage (as joining), so others see the move before its new
        incarnation announces itself. `ttl_s` is a regular announcement's: the DHT keeps a record until
        one with a later expiry replaces it, so an intent held for the lease's length (30-50 s) refused
        the new incarnation's "online" records and trainers saw the moved server as joining, and routed
        nothing to it, for that long (measured in bench/rebalance_live.py)."""
        records.announce(self.peer_id, announcement, ttl_s)


def move_record(move_from: int, move_to: int, started_s: float, download_bytes: int) -> str:
    return json.dumps(
        {
            "from": move_from,
            "to": move_to,
            "seconds": round(time.time() - started_s, 2),
            "bytes": download_bytes,
        }
    )
