"""`chain_hop.StagePeers`, a server's view of a neighbouring stage: the next stage's peers are connected
to once (hand-offs go there); a server behind a NAT redials the stage before at every refresh, since the
connections it opens are the only direct way that stage's hand-offs can reach it."""

import asyncio

import pytest

from swarmtrain.net.dht_records import StageAnnouncement
from swarmtrain.runtime.server.chain_hop import StagePeers

pytestmark = pytest.mark.unit

A = "12D3KooWGGjfWJcFwQXF969qn2FJMvWce4js2Sq2jEABwUuvvJ6a"
B = "12D3KooWFkcVKqyWhSeozaP4iNs1jFfv9JRDSUNzAUDZbEUBeumz"
C = "12D3KooWJWoaqZhDaoEFshF7Rh1bpY9ohihFhzcW6d69Lr2NASuq"


def _ann(digest: str = "d1", state: str = "online") -> StageAnnouncement:
    return StageAnnouncement(0, ["/ip4/203.0.113.7/tcp/31337"], 10.0, 0, digest, 0, state)


class Records:
    def __init__(self, peers: dict[str, StageAnnouncement]) -> None:
        self.peers = peers

    def stage_peers(self, stage: int, with_offline: bool = False) -> dict[str, StageAnnouncement]:
        return {p: a for p, a in self.peers.items() if with_offline or a.state != "offline"}


class Client:
    def __init__(self) -> None:
        self.connects: list[str] = []

    async def connect(self, peer_id, addresses: list[str], timeout_s: float) -> bool:
        self.connects.append(peer_id)
        return True


def _refresh(peers: StagePeers, times: int) -> None:
    async def run() -> None:
        for _ in range(times):
            await peers.refresh()

    asyncio.run(run())


@pytest.mark.parametrize("redial", [False, True])
def test_live_peers_with_our_digest_are_connected_once_or_at_every_refresh(redial):
    records = Records({A: _ann(), B: _ann(digest="other run"), C: _ann(state="offline")})
    client = Client()
    peers = StagePeers(records, 0, "d1", client, redial=redial)  # type: ignore[arg-type]
    _refresh(peers, 3)
    assert peers.peers == {A}
    assert client.connects == [A] * (3 if redial else 1)


def test_a_next_stage_peer_whose_record_lapsed_stays_a_candidate_for_the_grace():
    """Its DHT stores may fail while it serves (the DHT's nodes are the servers, some cut off); one that
    says "offline" is leaving and goes at once."""
    from swarmtrain.net.dht_records import LAPSE_GRACE_S

    records = Records({A: _ann(), C: _ann()})
    peers = StagePeers(records, 0, "d1", Client())  # type: ignore[arg-type]
    _refresh(peers, 1)
    records.peers = {C: _ann(state="offline")}  # A's record lapsed, C leaves
    _refresh(peers, 1)
    assert peers.peers == {A}
    peers._view._seen_at_s[A] -= LAPSE_GRACE_S  # as if the grace had passed since A was last listed
    _refresh(peers, 1)
    assert peers.peers == set()
