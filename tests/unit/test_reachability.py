"""The dial-back check's pure logic (net/reachability.py): what the asked peer dials, when a peer skips
the check, and which answers stop a peer. The check itself runs behind a real NAT in
tests/integration/test_nat.py; here, also the DHT options --auto-relay maps to (net/engine.py)."""

import pytest

from swarmtrain.net import reachability as r
from swarmtrain.net.engine import PeerNetwork, _dht_options

pytestmark = pytest.mark.unit

PEER = "12D3KooWGGjfWJcFwQXF969qn2FJMvWce4js2Sq2jEABwUuvvJ6a"
RELAY = "12D3KooWFkcVKqyWhSeozaP4iNs1jFfv9JRDSUNzAUDZbEUBeumz"


def test_ip_and_tcp_port_of_direct_relayed_and_other_addresses():
    assert r.ip_and_tcp_port(f"/ip4/10.1.2.3/tcp/31337/p2p/{PEER}") == ("10.1.2.3", 31337)
    assert r.ip_and_tcp_port("/ip6/::1/tcp/5") == ("::1", 5)
    # a relayed address names the relay's IP and port, not the peer's
    assert r.ip_and_tcp_port(f"/ip4/10.1.2.3/tcp/31337/p2p/{RELAY}/p2p-circuit/p2p/{PEER}") == (None, None)
    assert r.ip_and_tcp_port("/dns4/relay.example/tcp/31337") == (None, 31337)
    assert r.ip_and_tcp_port("/ip4/10.1.2.3/udp/9/quic") == ("10.1.2.3", None)


def test_dial_targets_are_the_observed_ip_at_the_announced_ports():
    observed = ["/ip4/203.0.113.7/tcp/40001"]  # the NAT's address, and the port it mapped
    announced = [f"/ip4/192.168.1.5/tcp/31338/p2p/{PEER}", "/ip4/203.0.113.7/tcp/31338", "/dns4/x/tcp/4000"]
    # never an IP the asker names: only the one its connection comes from
    assert r.dial_targets(observed, announced) == [("203.0.113.7", 31338), ("203.0.113.7", 4000)]
    assert r.dial_targets([f"/ip4/10.0.0.1/tcp/1/p2p/{RELAY}/p2p-circuit"], announced) == []
    many_ports = [f"/ip4/1.2.3.4/tcp/{port}" for port in range(1000, 1010)]
    assert len(r.dial_targets(observed, many_ports)) == r._MAX_PORTS


def test_only_a_peer_on_loopback_alone_skips_the_check():
    assert r.all_loopback([f"/ip4/127.0.0.1/tcp/5/p2p/{PEER}", "/ip6/::1/tcp/5"])
    assert not r.all_loopback(["/ip4/127.0.0.1/tcp/5", "/ip4/10.1.2.3/tcp/5"])
    assert not r.all_loopback([])
    assert r.peer_id_of(f"/ip4/10.1.2.3/tcp/5/p2p/{RELAY}/p2p-circuit/p2p/{PEER}") == PEER


def test_only_a_verdict_of_unreachable_from_every_answering_peer_stops_a_peer():
    no = {"reachable": False, "tried": ["203.0.113.7:31338"]}
    yes = {"reachable": True, "tried": ["203.0.113.7:31338"]}
    reason = r.unreachable_reason([no, None])
    assert reason is not None and "203.0.113.7:31338" in reason and "--auto-relay" in reason
    assert "--client-mode" in reason and "\n" not in reason  # one line
    assert r.unreachable_reason([no, yes]) is None  # one peer could connect
    assert r.unreachable_reason([None, None]) is None  # no answer: older peers, timeouts
    assert r.unreachable_reason([{"reachable": None, "tried": []}]) is None  # nothing it could dial
    assert r.unreachable_reason([]) is None


def test_auto_relay_forces_private_reachability_and_nothing_else_does():
    assert _dht_options(PeerNetwork(use_auto_relay=True))["force_reachability"] == "private"
    assert "force_reachability" not in _dht_options(PeerNetwork())
    assert "force_reachability" not in _dht_options(PeerNetwork(client_mode=True))


HOSTILE_REQUESTS = [
    b"[" * 5000 + b"]" * 5000,  # deeper than the JSON parser recurses
    b'{"addrs":' + b"[" * 3000 + b"]" * 3000 + b"}",
    b'{"addrs": 5}',
    b'{"addrs": [{"a": 1}]}',
    b'{"addrs": "/ip4/1.2.3.4/tcp/5"}',
    b"[]",
    b"\xff\xfe",
    b'{"addrs": [' + b"9" * 4400 + b"]}",  # beyond Python's 4,300-digit integer limit
    b'{"addrs": ["' + b"x" * (1 << 17) + b'"]}',
]


def test_a_malformed_dial_back_request_is_refused_with_a_reason_and_nothing_is_dialed():
    import asyncio
    import json
    from types import SimpleNamespace

    from hivemind.proto import runtime_pb2

    assert r.announced_addrs(b'{"addrs": ["/ip4/1.2.3.4/tcp/5"]}') == ["/ip4/1.2.3.4/tcp/5"]
    assert r.announced_addrs(b"") == []

    class NoPeers:
        async def list_peers(self):
            raise AssertionError("a malformed request must dial nothing")

    context = SimpleNamespace(remote_id=PEER)
    for metadata in HOSTILE_REQUESTS:
        with pytest.raises(ValueError) as refused:
            r.announced_addrs(metadata)
        assert "\n" not in str(refused.value)
        request = runtime_pb2.ExpertRequest(metadata=metadata)
        response = asyncio.run(r._dial_back(NoPeers(), request, context))
        answer = json.loads(response.metadata)
        assert answer["reachable"] is None and answer["error"], metadata[:40]


def test_a_malformed_dial_back_answer_is_no_verdict():
    answers = [r.checked_answer(m) for m in HOSTILE_REQUESTS]
    answers += [
        r.checked_answer(m)
        for m in (b'{"reachable": "no"}', b'{"reachable": false, "tried": 3}', b"null", b'{"reachable": 0}')
    ]
    assert all(a is None or a == {"reachable": None, "tried": []} for a in answers), answers  # no verdict
    no = r.checked_answer(b'{"reachable": false, "tried": ["1.2.3.4:5", {"a": 1}]}')
    assert no == {"reachable": False, "tried": ["1.2.3.4:5", "{'a': 1}"]}
    assert r.unreachable_reason([no, *answers]) is not None  # the one verdict counts, the rest are none
    assert r.checked_answer(b'{"reachable": null, "error": "a request that is not JSON"}') == {
        "reachable": None,
        "tried": [],
    }


CIRCUIT = "/dns4/relay.test/tcp/31337/p2p/QmRelay/p2p-circuit/p2p/QmSelf"


def test_a_peer_behind_a_nat_waits_until_its_addresses_include_a_relayed_one():
    polls = iter([["/ip4/10.0.0.2/tcp/5/p2p/QmSelf"]] * 2 + [["/ip4/10.0.0.2/tcp/5/p2p/QmSelf", CIRCUIT]])
    asked = []

    def visible():
        asked.append(1)
        return next(polls)

    assert r.wait_for_relay(visible, timeout_s=30.0) == [CIRCUIT]
    assert len(asked) == 3  # asked again until the relayed address appeared, not once more


def test_a_peer_no_relay_reserves_goes_on_after_the_wait_with_a_warning(caplog):
    assert r.wait_for_relay(lambda: ["/ip4/10.0.0.2/tcp/5/p2p/QmSelf"], timeout_s=0.0) == []
    assert "no relay reserved a slot" in caplog.text
