"""Fuzzing the data plane's open port (net/data_plane.py) of live stage servers at the frame level while
a trainer trains through them (stopped with Ctrl-C afterwards): garbage, bad handshakes, identities whose
public key is no key (self-made: claiming the peer id its bytes hash to; or claiming a real peer's id) or
not the claimed peer id's, in both connection roles, invalid messages of every hand-off kind to
every stage (alone and bundled, and replayed), frames of absurd or unfinished lengths, wrong frame
types, half-open and idle connections, and large unfinished frames on many links of several identities
(each as many links as a peer id may have; one more is refused). Asserted: every
invalid message gets a protocol error (never `internal`), every refused handshake an error message and
one log line at the server, every misbehaving connection is closed, the memory a caller can make a
server hold stays within its budget and is all released, the trainer finishes its run with no failed
micro-batch, and no log shows a traceback (the processes log an exception in one line: none may name
one asyncio could not hand to a handler either)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
from pathlib import Path

import pytest
import torch

from fuzz_cases import HostileIdentity, hostile_identities, locally_rejected, mutations, valid_messages
from swarm_fixtures import start_servers
from swarmtrain.net import data_plane, framing, secure_link
from swarmtrain.net import server_bounds as data_bounds
from swarmtrain.net.bundle import MAX_BUNDLE_ITEMS, bundle_message
from swarmtrain.net.identity import PeerIdentity
from swarmtrain.net.protocol import (
    Message,
    ProtocolError,
    encode_labels,
    pack,
    request_message,
    unpack,
)
from swarmtrain.net.stream import Stream, open_stream

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

FUZZER_IDENTITY = PeerIdentity.generate()
FUZZER = FUZZER_IDENTITY.peer_id
SAMPLES = 1 << 20  # more than the fuzzing lasts: the run is stopped with Ctrl-C after it
CLOSED_WITHIN_S = 15.0
REPLY_WITHIN_S = 30.0
IDLE_CONNECTIONS = data_plane.MAX_CONNECTIONS_PER_ADDRESS + 16
BIG_FRAME_LINKS = 24
RSS_SLACK_BYTES = 96 << 20  # allocator and interpreter noise on top of the held-bytes budget
GARBAGE_SOURCE = "127.0.0.2"  # a loopback address of its own (the servers listen on 127.0.0.1)
# the idle connections fill their address's share of a server's connections (MAX_CONNECTIONS_PER_ADDRESS)
# for a handshake timeout: from 127.0.0.1, the address stage 0's server dials stage 1's from, a first
# dial in that window was refused by design (closed unread: DialFailed, then libp2p for DIAL_COOLDOWN_S)
IDLE_SOURCE = "127.0.0.3"


def test_the_data_plane_refuses_what_strangers_send_and_the_swarm_trains_on(make_swarm):
    swarm, cfg = make_swarm("tiny", {"training": {"max_samples": SAMPLES}})
    start_servers(swarm, {"s0": 0, "s1": 1})
    probe = make_swarm.probe(cfg, swarm)
    probe.wait_for_peers([1, 1])
    targets = {}
    for stage in (0, 1):
        peer = probe.peers(stage)[0]
        record = probe.trainer.table.announcements[stage][peer]
        targets[stage] = (peer, data_plane.dial_address(record.addresses, record.data_port))
        assert targets[stage][1] is not None, "the server announced no data plane"
    names = {0: "s0", 1: "s1"}
    swarm.start_trainer("trainer", "--max-samples", str(SAMPLES), "--log-period-s", "5")
    epochs_before = {s: probe.info(p).header["epoch"] for s, (p, _) in targets.items()}
    bounds = {s: probe.info(p).header["data_plane"] for s, (p, _) in targets.items()}  # sized to the run
    for status in bounds.values():
        assert status["limited_by"] == "run", status
        assert status["max_held_bytes"] >= data_bounds.MIN_HELD_BYTES, status
        assert status["max_bundle_bytes"] < 2 * status["max_held_bytes_per_peer"] <= status["max_held_bytes"]

    report = asyncio.run(asyncio.wait_for(_attack_all(cfg, targets, swarm, names, bounds), 400))
    print("data-plane fuzz:", json.dumps(report, sort_keys=True))

    trainer = swarm.processes["trainer"]
    assert trainer.alive, "the run ended before the fuzzing did: too short to show it trains on"
    epochs_after = {s: probe.info(p).header["epoch"] for s, (p, _) in targets.items()}
    assert all(epochs_after[s] > epochs_before[s] for s in targets), (epochs_before, epochs_after)
    trainer.proc.send_signal(signal.SIGINT)  # a user's Ctrl-C: the run stops cleanly, with its summary
    assert swarm.wait_exit("trainer", 120) == 0, trainer.log_text()[-3000:]
    summary = json.loads((swarm.workdir / "trainer.summary.json").read_text())
    assert summary["microbatches_failed"] == 0 and summary["steps"] > 0, summary
    for stage, (peer, _) in targets.items():  # the swarm is idle now: everything held was released
        status = probe.info(peer).header["data_plane"]
        assert status["held_bytes"] == status["answers_under_way"] == 0 and status["refused"] > 0, (
            stage,
            status,
        )
    for name, proc in swarm.processes.items():
        log = proc.log_text()
        assert "Traceback" not in log, f"{name}:\n{log[-4000:]}"
        assert "internal error" not in log and "failed:" not in log, f"{name}:\n{log[-4000:]}"
        # an exception no handler caught, reported in one line by the process's logging
        assert "Unhandled exception" not in log and "DecodeError" not in log, f"{name}:\n{log[-4000:]}"
    for stage, name in names.items():  # each refused identity in one line of the server's log
        refused = swarm.processes[name].log_text().count("data plane: refused a handshake")
        assert refused >= report[f"stage {stage}"]["hostile identities"], (name, refused)


async def _attack_all(cfg, targets, swarm, names, bounds) -> dict:
    """Every stage's server at once (each its own port, limits and memory: one attack per server at a
    time, as before): most of an attack is waiting for the server's handshake timeout."""
    swarm_peers = [p for p, _ in targets.values()]

    async def attack(stage: int) -> dict:
        peer, address = targets[stage]
        pid = swarm.processes[names[stage]].pid

        async def in_turn() -> dict:
            return {
                "bad hellos": await _bad_hellos(address, peer),
                "hostile identities": await _hostile_identities(address, peer, swarm_peers),
                "invalid messages": await _invalid_messages(address, peer, cfg, stage),
                "bad frames": await _bad_frames(address, peer),
                "idle connections": await _idle_connections(address, IDLE_SOURCE),
            }

        # the garbage (one connection at a time, ~5 s of waiting for the handshake timeout) comes from
        # another loopback address beside the attacks above: the server counts connections per remote
        # address, so the idle ones (from a third address, not the swarm's own 127.0.0.1) fill their
        # address's share alone; the big unfinished frames (which measure the server's memory) still run
        # alone, last
        garbage, report = await asyncio.gather(_garbage(address, GARBAGE_SOURCE), in_turn())
        return {
            "garbage": garbage,
            **report,
            "big unfinished frames": await _big_unfinished_frames(address, peer, bounds[stage], pid),
        }

    reports = await asyncio.gather(*(attack(stage) for stage in targets))
    return {f"stage {stage}": report for stage, report in zip(targets, reports, strict=True)}


# the attacks -------------------------------------------------------------------------------------
async def _closed(reader: asyncio.StreamReader | Stream) -> bool:
    """Whether the server closes the connection (after whatever it says) within CLOSED_WITHIN_S."""
    try:
        while await asyncio.wait_for(reader.read(1 << 16), CLOSED_WITHIN_S):
            pass
    except ConnectionError:
        pass
    return True


async def _garbage(address, source: str) -> int:
    rng = random.Random(1)
    for size in (1, 7, 64, 5000):
        reader, writer = await asyncio.open_connection(*address, local_addr=(source, 0))
        writer.write(rng.randbytes(size))
        assert await _closed(reader)
        writer.close()
    return 4


async def _bad_hellos(address, server: str) -> int:
    good = {
        "protocol": secure_link._PROTOCOL,
        "peer": FUZZER,
        "to": server,
        "nonce": "00" * 16,
        "link": "l" * 32,
    }
    hellos = [
        b"[" * 3000 + b"]" * 3000,
        b'{"a":' * 1500 + b"1" + b"}" * 1500,
        b"[]",
        b"\xff\xfe",
        json.dumps({**good, "role": "requests", "protocol": "other"}).encode(),
        json.dumps({**good, "role": "requests", "to": FUZZER}).encode(),
        json.dumps({**good, "role": "requests", "peer": "not a peer id"}).encode(),
        json.dumps({**good, "role": "both"}).encode(),
        json.dumps({**good, "role": "requests", "link": "l" * 65}).encode(),
        json.dumps({**good, "role": "requests"}).encode(),  # no key exchange, no public key
    ]
    for hello in hellos:
        reader, writer = await asyncio.open_connection(*address)
        writer.write(secure_link._HELLO_LENGTH.pack(len(hello)) + hello)
        assert await _closed(reader)
        writer.close()
    reader, writer = await asyncio.open_connection(*address)  # a length far over the limit
    writer.write(secure_link._HELLO_LENGTH.pack(2**31))
    assert await _closed(reader)
    writer.close()
    return len(hellos) + 1


async def _hostile_identities(address, server: str, swarm_peers: list[str]) -> int:
    """Handshakes as identities whose public key is no key or not the peer id claimed: self-made ones,
    the fuzzer's own peer id, and the swarm's real peers' ids with one byte 0xff as their key. Each is
    refused with an error message and the connection closed, in both roles."""
    cases = [hostile for _, hostile in hostile_identities(FUZZER_IDENTITY)]
    cases += [HostileIdentity(b"\xff", peer) for peer in swarm_peers]
    for hostile in cases:
        for role in (secure_link.REPLIES, secure_link.REQUESTS):
            stream = await open_stream(*address)
            try:
                await secure_link.client_handshake(stream, hostile, server, None, os.urandom(16).hex(), role)
            except ProtocolError as exc:
                assert str(exc).startswith("refused: ") and "could not prove" in str(exc), exc
            else:
                raise AssertionError(
                    f"the server accepted {hostile.peer_id} with key {hostile.public_key[:8]!r}"
                )
            assert await _closed(stream)
            stream.close()
    return 2 * len(cases)


class _RawLink:
    """A link made by hand with the fuzzer's own identity, or another self-made one (a public run admits
    anyone who proves one)."""

    def __init__(self, replies, requests) -> None:
        self.replies, self.requests = replies, requests

    @classmethod
    async def open(cls, address, server: str, identity: PeerIdentity = FUZZER_IDENTITY) -> _RawLink:
        link, channels = os.urandom(16).hex(), []
        for role in (secure_link.REPLIES, secure_link.REQUESTS):
            stream = await open_stream(*address)
            try:
                seal = await secure_link.client_handshake(stream, identity, server, None, link, role)
            except BaseException:
                stream.close()
                for channel in channels:
                    channel.close()
                raise
            channels.append(framing.Channel(stream, seal))
        return cls(*channels)

    async def reply(self) -> Message:
        while True:
            head = await asyncio.wait_for(self.replies.head(), REPLY_WITHIN_S)
            body = await self.replies.body(head)
            if head.kind_type == framing.REPLY:
                return unpack(body, data_plane.MAX_REPLY_BYTES)

    async def drain_acks(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self.requests.stream.read(1 << 16), 0.05)
            except TimeoutError:
                return

    def close(self) -> None:
        self.requests.close()
        self.replies.close()


def _invalid_cases(cfg, stage: int) -> list[tuple[str, bytes]]:
    """(kind, bytes) of invalid hand-offs of every kind for `stage`: mutations of valid ones, a kind the
    stage does not take, bundles of invalid items and malformed bundles."""
    valid = valid_messages(cfg, stage)
    cases = [
        (kind, data)
        for _, kind, data in mutations(valid, 60, seed=7 + stage)
        if kind in ("forward_backward", "forward") and locally_rejected(kind, data, cfg, stage)
    ]
    cases = [("chain" if kind == "forward" else kind, data) for kind, data in cases]  # chain: stage 0's
    forward = next(unpack(data, 1 << 30) for kind, data in valid if kind in ("forward", "forward_backward"))
    inputs = forward.tensor("inputs")
    labels = encode_labels(torch.zeros(inputs.shape[:2], dtype=torch.long), cfg.model.vocab_size)
    chain = Message("chain", {**forward.header, "route": [], "accumulate_after": []}, dict(forward.tensors))
    chain.tensors["labels"] = labels
    wrong_digest = request_message("forward_backward", "fz-9", stage, "0" * 16, "none", {"inputs": inputs})
    wire = {"inputs": forward.tensors["inputs"], "labels": labels}
    evaluation = Message("evaluate_chain", {**forward.header, "route": []}, wire)
    wrong_evaluation = request_message("evaluate", "fz-8", stage, "0" * 16, "none", {"inputs": inputs})
    cases += [
        ("evaluate_chain", pack(evaluation)),  # stage 0: a route of the wrong length; the last: refused
        ("evaluate", pack(wrong_evaluation)),
        ("chain", pack(chain)),  # at stage 0 a route of the wrong length; at the last stage no chain at all
        ("forward_backward" if stage == 0 else "chain", pack(forward)),  # a kind this stage does not take
        ("forward_backward", pack(wrong_digest)),
        ("bundle", pack(bundle_message([chain, wrong_digest], stage))),
        ("bundle", pack(bundle_message([wrong_digest] * MAX_BUNDLE_ITEMS, stage))),
        ("bundle", pack(Message("bundle", {"stage": stage, "items": "x"}))),
        ("bundle", pack(Message("bundle", {"stage": stage, "items": [{"kind": "grads"}]}))),
        ("bundle", b"not a message"),
    ]
    return cases


async def _invalid_messages(address, server: str, cfg, stage: int) -> dict:
    link = await _RawLink.open(address, server)
    codes: dict[str, int] = {}
    try:
        cases = _invalid_cases(cfg, stage)
        for exchange, (kind, data) in enumerate(cases, start=1):
            for _ in range(2 if exchange % 5 == 0 else 1):  # every fifth frame replayed as it was
                await link.requests.send(framing.REQUEST, exchange, data, kind)
                reply = await link.reply()
                code = _error_code(reply)
                assert code != "internal", (kind, reply.header)
                codes[code] = codes.get(code, 0) + 1
        await link.drain_acks()
    finally:
        link.close()
    assert sum(codes.values()) >= len(cases)
    return codes


def _error_code(reply: Message) -> str:
    if reply.kind == "bundle":  # a bundle's items are answered one by one
        codes = {item.get("code") for item in reply.header["items"]}
        assert all(item.get("kind") == "error" for item in reply.header["items"]), reply.header
        return "bundle:" + ",".join(sorted(map(str, codes)))
    assert reply.kind == "error", reply.header
    return str(reply.header.get("code"))


async def _bad_frames(address, server: str) -> int:
    head = framing.HEADER
    frames = [
        head.pack(framing.ACK, 0, 0, 1),  # a frame type only servers send
        head.pack(framing.REQUEST, 5, 0, 1) + b"grads",  # a kind the data plane does not carry
        head.pack(framing.REQUEST, 5, 0, 1) + b"ch\xffin",  # not ASCII
        head.pack(framing.REQUEST, 5, 10, 1) + b"chain" + b"x" * 5,  # half a frame, then EOF
    ]
    for frame in frames:
        link = await _RawLink.open(address, server)
        link.requests.stream.write(frame)
        link.requests.stream.write_eof()
        assert await _closed(link.replies.stream)
        link.close()
    link = await _RawLink.open(address, server)  # a length far over the limit: refused, then dropped
    link.requests.stream.write(head.pack(framing.REQUEST, 5, 2**40, 1) + b"chain")
    reply = await link.reply()
    assert reply.header.get("code") == "too_large", reply.header
    link.close()
    return len(frames) + 1


async def _idle_connections(address, source: str) -> int:
    """More idle connections than one address may hold, from `source`: the extra ones are refused at
    once, all of them closed by the handshake timeout."""
    held = [await asyncio.open_connection(*address, local_addr=(source, 0)) for _ in range(IDLE_CONNECTIONS)]
    results = await asyncio.gather(*(_closed(reader) for reader, _ in held))
    for _, writer in held:
        writer.close()
    assert all(results)
    return len(held)


async def _big_unfinished_frames(address, server: str, bounds: dict, pid: int) -> dict:
    """Links of several self-made identities, as many as one peer id may have each (one more is refused
    at its handshake), each send a bundle frame of the largest size the server takes but its last byte:
    the server holds at most its byte budgets, in all and per peer id (the rest are refused unread), and
    releases it all when the links go."""
    size = bounds["max_bundle_bytes"]
    per_identity = data_plane.MAX_CONNECTIONS_PER_PEER // 2
    identities = [PeerIdentity.generate() for _ in range(BIG_FRAME_LINKS // per_identity)]
    rss_before = _rss_bytes(pid)
    links = [await _RawLink.open(address, server, who) for who in identities for _ in range(per_identity)]
    with pytest.raises(ProtocolError, match="all a peer id may"):
        await _RawLink.open(address, server, identities[0])
    chunk = b"\0" * (1 << 20)
    for exchange, link in enumerate(links, start=1):
        link.requests.stream.write(framing.HEADER.pack(framing.REQUEST, 6, size, exchange) + b"bundle")
        left = size - 1
        while left:
            link.requests.stream.write(chunk[: min(left, len(chunk))])
            left -= min(left, len(chunk))
        await link.requests.stream.drain()
    await asyncio.sleep(2.0)
    grown = _rss_bytes(pid) - rss_before
    for link in links:
        link.close()
    budget = min(bounds["max_held_bytes"], len(identities) * bounds["max_held_bytes_per_peer"])
    assert grown <= budget + RSS_SLACK_BYTES, (grown, budget)
    return {
        "frame_bytes": size,
        "links": len(links),
        "identities": len(identities),
        "rss_growth_mib": round(grown / 2**20, 1),
        "budget_mib": round(budget / 2**20, 1),
    }


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")
