"""The bounds on what callers may make a stage server hold (net/server_bounds.py): derived from the run
(the largest request of each kind in the run's codec, never below one micro-batch in fp32, the widest
codec a message may name) and the memory budget, whichever is smaller; the accountant of held bytes,
all callers together and per peer id, and the libp2p servicer holding a stream's chunks in it."""

import asyncio
from types import SimpleNamespace

import pytest
import torch
from hivemind.proto import runtime_pb2

from swarmtrain.config.presets import get_preset
from swarmtrain.net import data_plane
from swarmtrain.net.bundle import MAX_BUNDLE_ITEMS, bundle_message
from swarmtrain.net.hand_off import chain_message
from swarmtrain.net.protocol import (
    HAND_OFF_KINDS,
    Message,
    StageIO,
    encode_labels,
    encode_tensor,
    make_message,
    pack,
    request_message,
    unpack,
)
from swarmtrain.net.server_bounds import (
    BOUNDED_KINDS,
    MIN_HELD_BYTES,
    PEER_SHARES,
    REQUESTS_PER_PEER,
    ByteBounds,
    HeldBytes,
    Holding,
    MemoryBudget,
    RequestLimits,
    derive_bounds,
    request_bytes,
)
from swarmtrain.net.transport import StageServicer

pytestmark = pytest.mark.unit

PLENTY = MemoryBudget(1 << 40, "a test's plenty")  # the run alone bounds
A_64_GIB_HOST = MemoryBudget(16 << 30, "a quarter of a 64 GiB host's available memory")
CODECS = ("none", "8bit", "4bit")


def _io(stage: int, stages: int, preset: str = "tiny") -> StageIO:
    cfg = get_preset(preset)
    m = cfg.model
    max_batch = 4 * _micro(preset)
    return StageIO(stage, stage == 0, stage == stages - 1, m.wire_dim, m.seq_len, m.vocab_size, max_batch)


def _micro(preset: str) -> int:
    return get_preset(preset).training.micro_batch_size


@pytest.mark.parametrize("preset", ["tiny", "llama-8b"])
@pytest.mark.parametrize("codec_name", CODECS)
def test_each_kind_is_bounded_by_the_run_never_below_one_fp32_micro_batch_nor_above_the_legal_largest(
    preset, codec_name
):
    for stage in (0, 1, 2):  # first, a middle stage, the last
        io = _io(stage, 3, preset)
        bounds = derive_bounds(io, codec_name, _micro(preset), PLENTY)
        assert bounds.limited_by == "run"
        for kind in BOUNDED_KINDS:
            if kind == "bundle":
                continue
            one_fp32 = request_bytes(io, kind, "none", _micro(preset))
            run_largest = request_bytes(io, kind, codec_name, io.max_batch)
            assert bounds.limits[kind] == max(one_fp32, run_largest), (stage, kind)
            # never above the largest request the stage validates (fp32 in and out, int64 labels)
            assert bounds.limits[kind] <= io.max_message_bytes() + 1024, (stage, kind)
        assert bounds.bundle_bytes == MAX_BUNDLE_ITEMS * bounds.frame_bytes
        assert bounds.held_bytes_per_peer >= 2 * bounds.bundle_bytes
        assert bounds.held_bytes == max(MIN_HELD_BYTES, PEER_SHARES * bounds.held_bytes_per_peer)


def test_the_run_s_real_messages_fit_their_bounds():
    """Packed messages of a tiny run, built the way trainers and servers build them: one micro-batch
    in fp32, the largest batch in the run's codec, and a bundle of 16 fp32 micro-batches."""
    io, micro = _io(1, 3), _micro("tiny")
    for codec_name in CODECS:
        bounds = derive_bounds(io, codec_name, micro, PLENTY)
        for samples, wire in ((micro, "none"), (io.max_batch, codec_name)):
            inputs = torch.randn(samples, io.seq_len, io.wire_dim)
            labels = encode_labels(torch.zeros(samples, io.seq_len, dtype=torch.long), io.vocab_size)
            route = [[f"peer-{i}-" + "x" * 46 for i in range(8)]]
            chain = chain_message(
                "mb-1", 1, "d" * 16, wire, encode_tensor("inputs", inputs, wire), labels, route, [True, True]
            )
            assert len(pack(chain)) <= bounds.limits["chain"], (codec_name, samples)
            backward = request_message(
                "backward", "mb-2", 1, "d" * 16, wire, {"inputs": inputs, "grad_outputs": inputs}, step=3
            )
            assert len(pack(backward)) <= bounds.limits["backward"], (codec_name, samples)
        inputs = encode_tensor("inputs", torch.randn(micro, io.seq_len, io.wire_dim), "none")
        labels = encode_labels(torch.zeros(micro, io.seq_len, dtype=torch.long), io.vocab_size)
        fp32 = chain_message("mb", 1, "d" * 16, "none", inputs, labels, [["p"]], [True, True])
        assert len(pack(bundle_message([fp32] * MAX_BUNDLE_ITEMS, 1))) <= bounds.bundle_bytes


def test_llama_8b_bounds_by_codec():
    """A middle stage of `llama-8b` (4,096 values per token, 2,048 tokens a sample, micro-batches of 1,
    4 per request at most): the old frame bound (fp32 inputs and gradients, int64 labels, 4 samples) was
    268.6 MB for every kind, a bundle 16 of those."""
    io = _io(1, 16, "llama-8b")
    assert io.max_message_bytes() == 268_570_624
    frames = {}
    for codec_name in CODECS:
        bounds = derive_bounds(io, codec_name, 1, PLENTY)
        frames[codec_name] = bounds.frame_bytes
        print(codec_name, bounds.line())
    one_fp32_chain = 2048 * 4096 * 4 + 2048 * 8 + 64 * 1024 + 4096
    assert frames["none"] == 4 * (2048 * 4096 * 4 + 2048 * 8) + 64 * 1024 + 4096  # 134.4 MB: 4 in fp32
    assert frames["8bit"] == 4 * (2048 * 4096 + 2048 * 64 + 2048 * 8) + 64 * 1024 + 4096  # 34.2 MB: scales
    assert frames["4bit"] == one_fp32_chain  # 4 samples at 4.25 bits are less than one in fp32: 33.6 MB
    assert frames["none"] > frames["8bit"] > frames["4bit"]


def test_a_memory_budget_below_the_run_s_needs_cuts_the_bounds_down_to_the_floors_at_most():
    io, micro = _io(1, 3, "llama-8b"), 1
    run = derive_bounds(io, "none", micro, PLENTY)
    budget = MemoryBudget(2 << 30, "--request-memory-mb 2048")
    cut = derive_bounds(io, "none", micro, budget)
    assert cut.limited_by == "memory" and cut.held_bytes == 2 << 30
    assert cut.held_bytes_per_peer == max(cut.held_bytes // PEER_SHARES, 2 * cut.bundle_bytes)
    for kind in BOUNDED_KINDS:
        assert cut.floors.get(kind, 0) <= cut.limits[kind] <= run.limits[kind], kind
    starved = derive_bounds(io, "none", micro, MemoryBudget(1 << 20, "1 MB"))  # down to the floors
    floors = starved.floors
    assert set(floors) == set(BOUNDED_KINDS) - {"bundle"}
    assert all(floors[kind] == request_bytes(io, kind, "none", micro) for kind in floors)
    bundle_floor = MAX_BUNDLE_ITEMS * max(floors[kind] for kind in HAND_OFF_KINDS)
    assert starved.bundle_bytes == bundle_floor
    per_peer_floor = max(2 * bundle_floor, REQUESTS_PER_PEER * max(floors.values()))
    assert starved.held_bytes == starved.held_bytes_per_peer == per_peer_floor
    for kind in floors:
        assert floors[kind] <= starved.limits[kind] <= cut.limits[kind], kind


def test_the_memory_budget_is_a_share_of_the_available_memory_unless_given():
    given = MemoryBudget.of(300 << 20)
    assert given.bytes == 300 << 20 and "--request-memory-mb" in given.source
    share = MemoryBudget.of()
    assert share.bytes is None or 0 < share.bytes < (1 << 50)


def test_held_bytes_are_bounded_in_all_and_per_peer_id():
    held = HeldBytes(total=1000, per_peer=400)
    assert held.reserve("a", 300) is None and held.reserve("a", 100) is None
    assert "peer id" in held.reserve("a", 1)
    assert held.reserve("b", 400) is None and held.reserve("c", 200) is None
    assert "holds as many requests as it may" in held.reserve("d", 1)
    assert held.status() == {"held_bytes": 1000, "peers_holding": 3, "most_held_by_one_peer": 400}
    held.release("a", 400)
    assert held.held_by("a") == 0 and held.reserve("d", 300) is None and held.refused == 2
    holding = Holding(held, "e")
    assert holding.take(50) is None and holding.take(100) is not None  # 150 over the total of 1000
    holding.release()
    holding.release()  # once only
    assert held.held == 900 and held.held_by("e") == 0


async def _stream(data: bytes, chunk: int = 1000):
    for i in range(0, len(data), chunk):
        yield runtime_pb2.ExpertRequest(metadata=data[i : i + chunk])


def _context(peer: str):
    return SimpleNamespace(remote_id=SimpleNamespace(to_base58=lambda: peer))


def test_the_libp2p_servicer_holds_a_peer_s_streams_within_its_share_and_serves_another_peer():
    request = make_message("chain", {"stage": 1, "mb": "a"}, {"inputs": torch.ones(8, 64)}, "none")
    size = len(pack(request))
    limits = RequestLimits.of(ByteBounds({"chain": 4 * size, "bundle": 4 * size}, 10 * size, 2 * size + 10))
    gate = asyncio.Event()

    async def handler(message: Message, context) -> Message:
        await gate.wait()
        return Message("result", {"mb": message.header["mb"]})

    servicer = StageServicer(handler, 1 << 20, bounds=limits.bounds, held=limits.held)

    async def call(peer: str) -> Message:
        chunks = [c.metadata async for c in servicer._serve("chain", _stream(pack(request)), _context(peer))]
        return unpack(b"".join(chunks), 1 << 20)

    async def main():
        stranger = [asyncio.create_task(call("stranger")) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert limits.held.held_by("stranger") == 2 * size
        refused = await call("stranger")  # its third would pass its share
        assert refused.header["code"] == "unavailable" and "peer id" in refused.header["error"]
        assert limits.held.held_by("stranger") == 2 * size  # the refused stream holds nothing
        other = asyncio.create_task(call("other"))
        await asyncio.sleep(0.05)
        assert limits.held.held_by("other") == size
        gate.set()
        assert [r.header["mb"] for r in await asyncio.gather(*stranger, other)] == ["a"] * 3
        assert limits.status()["held_bytes"] == 0 and limits.status()["refused"] == 1
        assert servicer.limit("chain") == 4 * size and servicer.limit("grads") == 1 << 20

    asyncio.run(asyncio.wait_for(main(), 30))


# the note: the most one stranger (one self-made identity, one address) can make a server hold --------
READ_BUFFER_BYTES = 2 * (1 << 16)  # asyncio pauses a connection's reading past twice its 64 KiB limit
HELLO_BYTES = 4096  # net/secure_link.py's _MAX_HELLO_BYTES


def one_stranger(bounds: ByteBounds) -> dict[str, int]:
    """What one stranger (one peer id, one address) can make a server with `bounds` hold at most, in
    bytes: the request bodies counted for its peer id (both transports), their unpacked tensor payloads
    while they are answered (net/protocol.unpack copies each payload: at most as many bytes again), the
    two transient copies of the one frame being joined and decrypted at a time (the joined body and its
    plaintext: the event loop does one at a time, so at most two of the largest request), and the buffers
    of every connection its address may hold (handshakes included)."""
    requests = bounds.held_bytes_per_peer
    connections = data_plane.MAX_CONNECTIONS_PER_ADDRESS * (READ_BUFFER_BYTES + HELLO_BYTES)
    parts = {
        "request bodies (counted)": requests,
        "their unpacked payloads": requests,
        "one frame being decrypted": 2 * max(bounds.limits.values()),
        "connection buffers": connections,
    }
    return parts | {"in all": sum(parts.values())}


def test_the_most_one_stranger_can_make_a_llama_8b_server_hold():
    """Printed for the log (docs/LOG.md): `llama-8b`'s first and middle stages, default micro-batch
    (1 sample, 4 per request at most), its default codec (8-bit), on a host with 64 GiB available."""
    cfg = get_preset("llama-8b")
    m, micro = cfg.model, cfg.training.micro_batch_size
    old_bundle = StageIO.from_config(m, cfg.stages()[1], 4 * micro).max_message_bytes() * MAX_BUNDLE_ITEMS
    old_held = max(MIN_HELD_BYTES, 2 * old_bundle)
    print(
        f"before: a frame {old_bundle // MAX_BUNDLE_ITEMS}, a bundle {old_bundle}, held {old_held} by anyone"
    )
    for stage in (0, 1, 15):
        io = StageIO.from_config(m, cfg.stages()[stage], 4 * micro)
        bounds = derive_bounds(io, cfg.swarm.compression, micro, A_64_GIB_HOST)
        stranger = one_stranger(bounds)
        print(f"stage {stage}: {bounds.line(data_plane.connection_limits())}")
        print(f"stage {stage}: one stranger: {stranger}")
        assert bounds.limited_by == "run"
        assert stranger["request bodies (counted)"] <= bounds.held_bytes // PEER_SHARES
        assert stranger["in all"] < old_held / 2
    middle = derive_bounds(StageIO.from_config(m, cfg.stages()[1], 4 * micro), "8bit", micro, A_64_GIB_HOST)
    assert middle.frame_bytes == 34_213_888 and middle.bundle_bytes == 547_422_208
    assert middle.held_bytes_per_peer == 1_094_844_416 and middle.held_bytes == 4_379_377_664
