"""What callers may make a stage server hold, sized to that server: its run and its memory.

A stage server takes requests from callers it cannot trust: anyone who reaches its ports and proves a
libp2p identity, which anyone can make. A request's bytes are held from its first byte until its answer
has gone (net/data_plane.py reserves a frame's size at its header, net/transport.py a libp2p stream's
chunks as they come), and these bounds say how many, derived once per stage served from two things:
- the run: the largest request of each micro-batch kind the stage can get from an honest peer. A trainer
  sends micro-batches of `training.micro_batch_size` samples in the run's codec (`swarm.compression`), or
  in another codec it names (every message names its own and the server validates any of them; fp32 is
  the widest), and the stage validates up to `StageIO.max_batch` samples (`StageOptions.max_batch`, 4
  micro-batches by default). So a kind's bound is the larger of `max_batch` samples in the run's codec and
  one micro-batch in fp32 (its floor: below it an honest trainer's micro-batch would be refused), counting
  only the tensors that kind carries (a hand-off carries no gradient, a backward no labels). A bundle
  carries at most `MAX_BUNDLE_ITEMS` hand-offs (how many its sender gathers is the sender's
  `--max-batch-tokens`, not ours to know). One peer id may hold `BUNDLES_PER_PEER` bundles or
  `REQUESTS_PER_PEER` of the largest request, whichever is more (at least 1/`PEER_SHARES` of
  `MIN_HELD_BYTES`); all callers together `PEER_SHARES` peer ids' worth, at least `MIN_HELD_BYTES`;
- the memory budget: `--request-memory-mb`, or `MEMORY_FRACTION` of the memory the host has available
  when the stage starts serving. Where the run's figure for all callers is more, all callers hold at
  most the budget, one peer id 1/`PEER_SHARES` of it, a bundle 1/`BUNDLES_PER_PEER` of that, any other
  request 1/`REQUESTS_PER_PEER`; never below the floors (a bundle of `MAX_BUNDLE_ITEMS` micro-batches in
  fp32, a peer id's share of those), so honest traffic is never refused for its size: at worst it is
  asked to wait (`unavailable`: the caller takes another peer).
The server prints the bounds when it starts serving a stage (`ByteBounds.line`) and reports them, with
what is held now, in its `info` reply (`data_plane`). Connections have their own limits (net/data_plane.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from swarmtrain.net import codec
from swarmtrain.net.bundle import MAX_BUNDLE_ITEMS
from swarmtrain.net.protocol import BUNDLE_KIND, HAND_OFF_KINDS, MAX_HEADER_BYTES, MICRO_BATCH_KINDS, StageIO

MIN_HELD_BYTES = 128 << 20  # request bytes all callers together may make a server hold, at least
MEMORY_FRACTION = 0.25  # of the host's available memory, without --request-memory-mb
BUNDLES_PER_PEER = 2  # one peer id: a bundle being answered and the next arriving
REQUESTS_PER_PEER = 16  # or this many of the largest request of any kind, if more (a trainer's backwards)
PEER_SHARES = 4  # all callers together: as much as this many peer ids may hold
SINGLE_KINDS = tuple(dict.fromkeys((*MICRO_BATCH_KINDS, *HAND_OFF_KINDS)))  # one micro-batch each
BOUNDED_KINDS = (*SINGLE_KINDS, BUNDLE_KIND)  # the kinds these bounds size, and hold as they come
_CHAIN_KINDS = ("chain", "evaluate_chain")  # carry the labels to the last stage, whatever this stage is
_ENVELOPE = MAX_HEADER_BYTES + 4096  # a message's header (bounded), magic, lengths and descriptors
_WIDEST = "none"  # fp32: the widest codec a message may name


def request_bytes(io: StageIO, kind: str, codec_name: str, samples: int) -> int:
    """Bytes of the largest `kind` request of `samples` samples that `io`'s stage validates, its floats
    in `codec_name`: inputs (token ids at stage 0: int64 at most), the gradient of the outputs (`backward`), labels
    (the last stage's, and every chain's; int64 at most), token ids after a subspace boundary (int32 at
    most, net/token_ids.py) and the envelope."""
    tokens = samples * io.seq_len
    floats = codec.payload_size(codec_name, torch.float32, tokens * io.wire_dim)
    inputs = 8 * tokens if io.is_first else floats
    gradient = floats if kind == "backward" else 0
    labels = 8 * tokens if io.is_last or kind in _CHAIN_KINDS else 0
    ids = 4 * tokens if io.token_ids else 0
    return inputs + gradient + labels + ids + _ENVELOPE


def reply_bytes(io: StageIO, codec_name: str, micro_batch: int) -> int:
    """The largest answer to a bundle of hand-offs that this stage's server sends the next stage: per
    item the gradient of what it sent (floats of the wire's width, as a hand-off's inputs) and a header."""
    floats = max(
        codec.payload_size(codec_name, torch.float32, io.max_batch * io.seq_len * io.wire_dim),
        codec.payload_size(_WIDEST, torch.float32, micro_batch * io.seq_len * io.wire_dim),
    )
    return MAX_BUNDLE_ITEMS * (floats + _ENVELOPE)


@dataclass(frozen=True)
class MemoryBudget:
    """Memory the server lends callers' requests: `bytes` (None: no figure, the run alone bounds them)
    and where it comes from, for the start-up line."""

    bytes: int | None
    source: str

    @classmethod
    def of(cls, explicit_bytes: int | None = None) -> MemoryBudget:
        """`explicit_bytes` (--request-memory-mb), or `MEMORY_FRACTION` of the available memory now."""
        if explicit_bytes is not None:
            return cls(explicit_bytes, "--request-memory-mb")
        available = available_memory_bytes()
        if available is None:
            return cls(None, "no memory figure")
        return cls(int(available * MEMORY_FRACTION), f"{MEMORY_FRACTION:g} of {_size(available)} available")


def available_memory_bytes() -> int | None:
    """The host's available memory (Linux's MemAvailable; else free pages), None where neither is read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass(frozen=True)
class ByteBounds:
    """The byte bounds of one stage's server (module docstring): the largest request of each bounded kind
    (`limits`), request bytes held at once by all callers and by one peer id, the largest answer it takes
    from the next stage, and what they were derived from."""

    limits: dict[str, int]
    held_bytes: int
    held_bytes_per_peer: int
    reply_bytes: int = 0  # 0: not derived (the transport's default)
    memory: MemoryBudget = MemoryBudget(None, "not given")
    limited_by: str = "run"  # or "memory": the budget cut what the run would allow
    run: str = ""  # what the run's figures come from, for the start-up line
    floors: dict[str, int] = field(default_factory=dict)  # one micro-batch in fp32, per kind

    @classmethod
    def from_limits(cls, limits: dict[str, int]) -> ByteBounds:
        """Bounds around given frame limits (a server built without a run: tests, tools)."""
        limits = {BUNDLE_KIND: max(limits.values()), **limits}
        largest = max(v for k, v in limits.items() if k != BUNDLE_KIND)
        per_peer = max(BUNDLES_PER_PEER * limits[BUNDLE_KIND], REQUESTS_PER_PEER * largest)
        per_peer = max(per_peer, MIN_HELD_BYTES // PEER_SHARES)
        return cls(limits, max(MIN_HELD_BYTES, PEER_SHARES * per_peer), per_peer)

    @property
    def frame_bytes(self) -> int:
        """The largest single hand-off (a data-plane frame that is no bundle)."""
        return max((v for k, v in self.limits.items() if k in HAND_OFF_KINDS), default=0)

    @property
    def bundle_bytes(self) -> int:
        return self.limits[BUNDLE_KIND]

    def as_dict(self) -> dict:
        """The bounds as the `info` reply's `data_plane` shows them."""
        return {
            "max_frame_bytes": self.frame_bytes,
            "max_micro_batch_bytes": max(
                (v for k, v in self.limits.items() if k in MICRO_BATCH_KINDS), default=0
            ),
            "max_bundle_bytes": self.bundle_bytes,
            "max_held_bytes": self.held_bytes,
            "max_held_bytes_per_peer": self.held_bytes_per_peer,
            "max_reply_bytes": self.reply_bytes,
            "memory_budget_bytes": self.memory.bytes,
            "limited_by": self.limited_by,
        }

    def line(self, connections: str = "") -> str:
        """One line for the log: every bound and where it comes from."""
        return (
            f"request bounds: hand-off {_size(self.frame_bytes)}, micro-batch "
            f"{_size(self.as_dict()['max_micro_batch_bytes'])}, bundle {_size(self.bundle_bytes)}, held "
            f"{_size(self.held_bytes_per_peer)} per peer id and {_size(self.held_bytes)} in all"
            f"{connections}; "
            f"from the run ({self.run}) and a memory budget of {_size(self.memory.bytes)} "
            f"({self.memory.source}): limited by the {self.limited_by}"
        )


def derive_bounds(io: StageIO, codec_name: str, micro_batch: int, memory: MemoryBudget) -> ByteBounds:
    """The bounds of a server of `io`'s stage in a run whose codec is `codec_name` and whose micro-batches
    hold `micro_batch` samples, within `memory` (module docstring)."""
    floors = {kind: request_bytes(io, kind, _WIDEST, micro_batch) for kind in SINGLE_KINDS}
    legal = {kind: max(request_bytes(io, kind, codec_name, io.max_batch), floors[kind]) for kind in floors}

    def per_peer_of(sizes: dict[str, int]) -> tuple[int, int]:  # (bundle, one peer id's bytes)
        bundle = MAX_BUNDLE_ITEMS * max(sizes[kind] for kind in HAND_OFF_KINDS)
        return bundle, max(BUNDLES_PER_PEER * bundle, REQUESTS_PER_PEER * max(sizes.values()))

    bundle_floor, per_peer_floor = per_peer_of(floors)
    bundle, per_peer = per_peer_of(legal)
    per_peer = max(per_peer, MIN_HELD_BYTES // PEER_SHARES)  # generous where it costs little
    held = max(MIN_HELD_BYTES, PEER_SHARES * per_peer)
    limited_by = "memory" if memory.bytes is not None and memory.bytes < held else "run"
    if limited_by == "memory":
        held = max(memory.bytes or 0, per_peer_floor)
        per_peer = max(min(per_peer, held // PEER_SHARES), per_peer_floor)
        bundle = max(min(bundle, per_peer // BUNDLES_PER_PEER), bundle_floor)
        legal = {k: max(min(size, per_peer // REQUESTS_PER_PEER), floors[k]) for k, size in legal.items()}
    limits = {kind: min(size, bundle) if kind in HAND_OFF_KINDS else size for kind, size in legal.items()}
    limits[BUNDLE_KIND] = bundle
    run = f"{codec_name}, {io.max_batch} x {io.seq_len} tokens, at least {micro_batch} x {io.seq_len} in fp32"
    return ByteBounds(
        limits, held, per_peer, reply_bytes(io, codec_name, micro_batch), memory, limited_by, run, floors
    )


class HeldBytes:
    """Request bytes held for callers (arriving or awaiting their answer) against the bounds: all callers
    together and each peer id. The data plane and the libp2p servicer of a server share one, on its event
    loop."""

    def __init__(self, total: int, per_peer: int) -> None:
        self.total, self.per_peer = total, per_peer
        self.held = 0
        self.refused = 0  # reservations refused by either limit
        self._by_peer: dict[str, int] = {}

    def reserve(self, peer: str, size: int) -> str | None:
        """None once `size` more bytes are held for `peer`; else why not (an `unavailable` answer)."""
        mine = self._by_peer.get(peer, 0)
        if self.held + size > self.total:
            self.refused += 1
            return "this server holds as many requests as it may; try another"
        if mine + size > self.per_peer:
            self.refused += 1
            return "this server holds as many requests of this peer id as it may; try another"
        self.held += size
        self._by_peer[peer] = mine + size
        return None

    def release(self, peer: str, size: int) -> None:
        self.held -= size
        left = self._by_peer.get(peer, 0) - size
        if left > 0:
            self._by_peer[peer] = left
        else:
            self._by_peer.pop(peer, None)

    def held_by(self, peer: str) -> int:
        return self._by_peer.get(peer, 0)

    def status(self) -> dict:
        return {
            "held_bytes": self.held,
            "peers_holding": len(self._by_peer),
            "most_held_by_one_peer": max(self._by_peer.values(), default=0),
        }


class Holding:
    """One request's reservation in a `HeldBytes`, taken as its bytes come (a libp2p stream's chunks):
    `take` says why not when a limit is reached; `release` gives all of it back, once."""

    def __init__(self, held: HeldBytes, peer: str) -> None:
        self.held, self.peer, self.size = held, peer, 0

    def take(self, size: int) -> str | None:
        refusal = self.held.reserve(self.peer, size)
        if refusal is None:
            self.size += size
        return refusal

    def release(self) -> None:
        self.held.release(self.peer, self.size)
        self.size = 0


@dataclass(frozen=True)
class RequestLimits:
    """One server's bounds and what its callers hold against them, shared by its two transports."""

    bounds: ByteBounds
    held: HeldBytes

    @classmethod
    def of(cls, bounds: ByteBounds) -> RequestLimits:
        return cls(bounds, HeldBytes(bounds.held_bytes, bounds.held_bytes_per_peer))

    def status(self) -> dict:
        """What is held now against the bounds (the `info` reply's `data_plane` without a data plane)."""
        return {**self.held.status(), "refused": self.held.refused, **self.bounds.as_dict()}


def _size(value: int | None) -> str:
    if value is None:
        return "none"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value} B"
