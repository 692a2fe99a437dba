"""A private run: peers holding the run key train together (a joiner downloads the state); a peer
without it, or with another key, is refused as trainer, server, averaging member and state downloader,
and its records (a forged stage announcement) and control messages (a forged close) are ignored; at
each of hivemind's averaging RPCs (download the state, join a group, send a part) a stranger is
refused."""

import asyncio

import pytest
import torch

from swarmtrain.net.auth import RunKey, generate_key_file
from swarmtrain.net.engine import PeerNetwork
from swarmtrain.net.protocol import Message, close_message, make_message, namespace
from swarmtrain.net.transport import RemoteError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_private_run_refuses_strangers(make_swarm, tmp_path):
    key_path, other_path = generate_key_file(tmp_path / "run.key"), generate_key_file(tmp_path / "other.key")
    key = ["--run-key", str(key_path)]
    swarm, cfg = make_swarm("tiny")
    swarm.start_dht(*key)
    swarm.start_server("s0", 0, *key)
    swarm.start_server("s1", 1, *key)
    swarm.start_server("stranger", 1, "--run-key", str(other_path))  # a forged stage-1 announcement
    swarm.wait_ready(["s0", "s1", "stranger"])

    member = make_swarm.probe(cfg, swarm, network=PeerNetwork(run_key=RunKey.load(key_path)))
    member.wait_for_peers([1, 1])
    (s1,) = member.peers(1)  # the stranger's record is not believed

    # members train: two steps through the private swarm
    swarm.start_trainer("trainer", *key, "--max-samples", str(2 * cfg.training.global_batch_size))
    assert swarm.wait_exit("trainer", 120) == 0, swarm.processes["trainer"].log_text()[-3000:]
    assert member.info(s1).header["epoch"] == 2
    # a member joins stage 1 now (checked at the end): it starts while the stranger below waits out its
    # negative checks, which its start-up does not touch (the stranger reads no record of a member)
    swarm.start_server("s1b", 1, *key)

    # a stranger sees no server, and a direct call (trainer request or a forged close) is refused
    stranger = make_swarm.probe(cfg, swarm)
    with pytest.raises(TimeoutError):
        stranger.wait_for_peers([1, 1], timeout_s=6)
    stranger_client = stranger.trainer.client
    addresses = member.trainer.table.announcements[1][s1].addresses
    _peer_id = _pid(s1)
    assert stranger.run(stranger_client.connect(s1, addresses, timeout_s=10))
    forged_close = close_message(2, 1, cfg.digest(), 0, 1, {s1: 16}, [s1])
    forged_grads = make_message(
        "grads", {"step": 2, "stage": 1, "digest": cfg.digest(), "samples": 16}, {"w": torch.zeros(2)}
    )
    for message in [Message("info", {}), forged_close, forged_grads]:
        with pytest.raises(RemoteError) as refused:
            stranger.run(stranger_client.call(s1, message, timeout_s=20))
        assert refused.value.code == "unauthorized"

    # hivemind's averaging RPCs: no state for a stranger, no place in a group
    prefix = f"{namespace(cfg)}_s1".replace(".", "_")
    assert stranger.run(_download_state(stranger_client.p2p, _peer_id, prefix)) == "refused"
    assert stranger.run(_join_group(stranger_client.p2p, _peer_id, prefix)) == "PROTOCOL_VIOLATION"
    # refused either way: the answer, or a stream closed before it (the member's log below says why);
    # without the guard hivemind would answer the forged group id with BAD_GROUP_ID
    assert stranger.run(_send_part(stranger_client.p2p, _peer_id, prefix)) in ("PROTOCOL_VIOLATION", "closed")
    log = swarm.processes["s1"].log_text()
    for action in ("download our state", "join our averaging group", "send an averaging part"):
        assert f"{action}: not a peer of this private run" in log, action

    # the member that joined stage 1 downloaded the state from s1 (the guard lets members through)
    swarm.wait_ready(["s1b"])
    member.wait_for_peers([1, 2])
    joiner = next(p for p in member.peers(1) if p != s1)
    after = {p: member.info(p, want="params") for p in (s1, joiner)}
    assert after[joiner].header["epoch"] == 2
    for name in after[s1].tensors:
        assert torch.equal(after[s1].tensor(name), after[joiner].tensor(name)), name


def _pid(peer: str):
    from hivemind.p2p import PeerID

    return PeerID.from_base58(peer)


async def _download_state(p2p, peer_id, prefix: str) -> str:
    from hivemind.proto import averaging_pb2

    from swarmtrain.net.averaging import StageAverager

    stub = StageAverager.get_stub(p2p, peer_id, namespace=prefix)
    stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
    chunks = await asyncio.wait_for(_count(stream), 20)
    return "refused" if chunks == 0 else f"{chunks} chunks"


async def _join_group(p2p, peer_id, prefix: str) -> str:
    """A stranger asks to join the stage's averaging group: the first answer's code."""
    from hivemind.proto import averaging_pb2
    from hivemind.utils import get_dht_time

    from swarmtrain.net.averaging import StageAverager

    stub = StageAverager.get_stub(p2p, peer_id, namespace=prefix)
    request = averaging_pb2.JoinRequest(schema_hash=b"forged", expiration=get_dht_time() + 15, gather=b"")
    stream = await stub.rpc_join_group(request)
    first = await asyncio.wait_for(anext(stream), 20)
    return averaging_pb2.MessageCode.Name(first.code)


async def _send_part(p2p, peer_id, prefix: str) -> str:
    """A stranger sends an averaging part (a forged group id): the answer's code."""
    from hivemind.proto import averaging_pb2, runtime_pb2

    from swarmtrain.net.averaging import StageAverager

    async def parts():
        part = runtime_pb2.Tensor(buffer=b"\0" * 8, size=[2], dtype="float32")
        yield averaging_pb2.AveragingData(
            code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"forged", tensor_part=part
        )

    stub = StageAverager.get_stub(p2p, peer_id, namespace=prefix)
    try:
        stream = await stub.rpc_aggregate_part(parts())
        first = await asyncio.wait_for(anext(stream), 20)
    except (StopAsyncIteration, BrokenPipeError, ConnectionError):
        # the member answers and closes without reading the stranger's parts; the close can overtake
        # the answer (seen in CI: the stream ended, or the part's write found the pipe closed)
        return "closed"
    return averaging_pb2.MessageCode.Name(first.code)


async def _count(stream) -> int:
    return sum([1 async for _ in stream])
