"""Malformed protocol messages for fuzz tests: seeded mutations of valid forward, backward, evaluate,
evaluate_chain, close, grads and info messages (byte flips, truncation, header fields replaced by hostile JSON, descriptor edits);
and hostile identities for the data plane's handshake (public keys that are no key, of another type or
size, or not the claimed peer id's, and signatures of garbage)."""

from __future__ import annotations

import json
import random
import struct

import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from hivemind.proto import crypto_pb2

from swarmtrain.config import RunConfig
from swarmtrain.net import identity, protocol
from swarmtrain.net.hand_off import evaluate_chain_message, validate_evaluate_chain
from swarmtrain.net.protocol import Message, StageIO, encode_labels, pack, request_message

# JSON texts that broke or could break a header reader: deep nesting, Python's 4,300-digit integer
# limit, strings where flags are expected, values of every type and absurd sizes
HOSTILE_VALUES = [
    "[" * 5000 + "]" * 5000,
    '{"a":' * 3000 + "1" + "}" * 3000,
    "9" * 4400,
    "-" + "9" * 5000,
    '"no"',
    '"yes"',
    '"false"',
    "0",
    "1",
    "-1",
    "null",
    "true",
    "1e308",
    "-1e309",
    "NaN",
    "Infinity",
    "18446744073709551617",
    '"' + "x" * 20000 + '"',
    "[]",
    "{}",
    '[["inputs","none","float32",[1,1],4]]',
    '{"stage": 0}',
    "3.5",
    '"\\ud800"',
]
_ENVELOPE = ["kind", "v", "tensors", "stage", "digest"]
FIELDS = {  # the header fields each kind's validator reads
    "forward": _ENVELOPE + ["mb", "codec", "step", "accumulate"],
    "forward_backward": _ENVELOPE + ["mb", "codec", "step", "accumulate"],
    "evaluate": _ENVELOPE + ["mb", "codec", "step"],
    "evaluate_chain": _ENVELOPE + ["mb", "codec", "step", "route"],
    "backward": _ENVELOPE + ["mb", "codec", "step", "accumulate"],
    "close": _ENVELOPE + ["step", "shard", "shards", "members", "participants"],
    "grads": _ENVELOPE + ["step", "samples"],
    "info": _ENVELOPE + ["want"],
}


def valid_messages(cfg: RunConfig, stage: int) -> list[tuple[str, bytes]]:
    """(kind, bytes) of one valid message of each kind for `stage` of `cfg`."""
    m, digest, b = cfg.model, cfg.digest(), 2
    spec = cfg.stages()[stage]
    inputs = (
        torch.randint(0, m.vocab_size, (b, m.seq_len))
        if spec.is_first
        else torch.randn(b, m.seq_len, m.d_model)
    )
    # token ids and labels packed as a trainer sends them (net/codec.py `encode_ints`)
    tensors = {"inputs": encode_labels(inputs, m.vocab_size) if spec.is_first else inputs}
    if spec.is_last:
        tensors["labels"] = encode_labels(torch.randint(0, m.vocab_size, (b, m.seq_len)), m.vocab_size)
    kind = "forward_backward" if spec.is_last else "forward"
    forward = request_message(kind, "fz-1", stage, digest, "8bit", tensors, step=0)
    evaluate = request_message("evaluate", "fz-2", stage, digest, "8bit", tensors)
    messages = [(kind, pack(forward)), ("evaluate", pack(evaluate))]
    if not spec.is_last:
        labels = encode_labels(torch.randint(0, m.vocab_size, (b, m.seq_len)), m.vocab_size)
        route = [["fz-peer"]] * (cfg.swarm.num_stages - stage - 1)
        wire_inputs = protocol.encode_tensor("inputs", inputs, "8bit")
        chain = evaluate_chain_message("fz-3", stage, digest, "8bit", wire_inputs, labels, route)
        messages.append(("evaluate_chain", pack(chain)))
        grad = torch.randn(b, m.seq_len, m.d_model)
        backward = request_message(
            "backward", "fz-1", stage, digest, "none", {**tensors, "grad_outputs": grad}, step=0
        )
        messages.append(("backward", pack(backward)))
    close = protocol.close_message(0, stage, digest, 0, 1, {"peer-a": 8}, ["peer-a"])
    messages.append(("close", pack(close)))
    grads = protocol.make_message(
        "grads", {"step": 0, "stage": stage, "digest": digest, "samples": 8}, {"w": torch.randn(3)}
    )
    messages.append(("grads", pack(grads)))
    messages.append(("info", pack(Message("info", {"stage": stage, "want": "params"}))))
    return messages


def mutations(valid: list[tuple[str, bytes]], count: int, seed: int) -> list[tuple[str, str, bytes]]:
    """`count` (description, handler kind, bytes) mutations of the valid messages."""
    rng = random.Random(seed)
    makers = [_flip_bytes, _truncate, _replace_field, _replace_field, _edit_descriptor, _bad_length, _append]
    cases = []
    for i in range(count):
        kind, data = valid[i % len(valid)]
        maker = rng.choice(makers)
        description, mutated = maker(rng, data, kind)
        cases.append((f"{kind}: {description}", kind, mutated))
    return cases


def _split(data: bytes) -> tuple[dict, bytes]:
    start = len(protocol.MAGIC) + 4
    (length,) = struct.unpack_from("<I", data, len(protocol.MAGIC))
    return json.loads(data[start : start + length]), data[start + length :]


def _join(header_text: bytes, payload: bytes) -> bytes:
    return protocol.MAGIC + struct.pack("<I", len(header_text)) + header_text + payload


def _flip_bytes(rng: random.Random, data: bytes, kind: str) -> tuple[str, bytes]:
    out = bytearray(data)
    # flip in the header (the payload alone can stay a valid message)
    header_end = min(len(out), len(protocol.MAGIC) + 4 + struct.unpack_from("<I", data, 4)[0])
    for _ in range(rng.randint(1, 4)):
        out[rng.randrange(header_end)] ^= 1 << rng.randrange(8)
    return "flipped header bits", bytes(out)


def _truncate(rng: random.Random, data: bytes, kind: str) -> tuple[str, bytes]:
    return "truncated", data[: rng.randrange(len(data))]


def _replace_field(rng: random.Random, data: bytes, kind: str) -> tuple[str, bytes]:
    header, payload = _split(data)
    name, value = rng.choice(FIELDS[kind]), rng.choice(HOSTILE_VALUES)
    header.pop(name, None)
    text = json.dumps(header, separators=(",", ":"))
    text = text[:-1] + ("," if len(header) else "") + f'"{name}":{value}' + "}"
    return f"{name} = {value[:24]}", _join(text.encode(), payload)


def _edit_descriptor(rng: random.Random, data: bytes, kind: str) -> tuple[str, bytes]:
    header, payload = _split(data)
    if not header.get("tensors"):
        header["tensors"] = [["inputs", "none", "float32", [2, 2], 16]]
    entry = rng.choice(header["tensors"])
    slot = rng.randrange(5)
    hostile = [-1, 0, 2**40, "float64", "zip", "bits0", "bits33", "bits16", [10**6] * 9, [-3], None, {"a": 1}]
    entry[slot] = rng.choice([*hostile, "inputs"])
    return f"descriptor slot {slot}", _join(json.dumps(header).encode(), payload)


def _bad_length(rng: random.Random, data: bytes, kind: str) -> tuple[str, bytes]:
    length = rng.choice([0, 1, 2**31, 2**32 - 1, len(data), protocol.MAX_HEADER_BYTES + 1])
    return f"header length {length}", protocol.MAGIC + struct.pack("<I", length) + data[8:]


def _append(rng: random.Random, data: bytes, kind: str) -> tuple[str, bytes]:
    return "trailing bytes", data + rng.randbytes(rng.randint(1, 64))


def locally_rejected(kind: str, data: bytes, cfg: RunConfig, stage: int) -> bool:
    """Whether the server's own checks refuse these bytes (a mutation can stay valid: skip those)."""
    spec = cfg.stages()[stage]
    io = StageIO.from_config(cfg.model, spec, 4 * cfg.training.micro_batch_size)
    try:
        message = protocol.unpack(data, io.max_message_bytes())
        if message.kind != kind:
            return True
        if kind in protocol.MICRO_BATCH_KINDS:
            protocol.validate_request(message, io, cfg.digest())
        elif kind == "evaluate_chain":
            validate_evaluate_chain(message, io, cfg.digest(), cfg.swarm.num_stages)
        elif kind == "close":
            protocol.validate_close(message, stage, cfg.digest())
        elif kind == "grads":
            protocol.validate_grads(message, stage, cfg.digest(), ["w"], [(3,)])
        else:
            return False  # info: any header is answered
    except protocol.ProtocolError:
        return True
    return False


# hostile identities ---------------------------------------------------------------------------------
class HostileIdentity:
    """What a handshake uses of a PeerIdentity (`peer_id`, `public_key`, `sign`), each as a stranger
    chooses: a "public key" that may be no key, a peer id that may not be its hash, any signature."""

    def __init__(
        self, public_key: bytes, peer_id: str | None = None, signature: bytes | None = None, signer=None
    ):
        self.public_key = public_key
        self.peer_id = peer_id if peer_id is not None else identity.peer_id_of(public_key)  # self-made
        self._signature, self._signer = signature, signer

    def sign(self, data: bytes) -> bytes:
        if self._signer is not None:
            return self._signer.sign(data)
        return self._signature if self._signature is not None else b"\x01" * 256


def _key_protobuf(key_type: int, data: bytes) -> bytes:
    return crypto_pb2.PublicKey(key_type=key_type, data=data).SerializeToString()


def _der(key) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def hostile_identities(real: identity.PeerIdentity) -> list[tuple[str, HostileIdentity]]:
    """(description, identity) of identities no handshake may accept, for a side that knows the real
    identity `real` (its public key and peer id, not its private key). Self-made ones claim the peer id
    their bytes hash to (so they pass the hash check and must fail at decoding); the others claim
    `real`'s peer id."""
    small_rsa = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    ec_key = ec.generate_private_key(ec.SECP256R1())
    ed_key = ed25519.Ed25519PrivateKey.generate()
    ed_raw = ed_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    impostor = identity.PeerIdentity.generate()
    rng = random.Random(55)
    real_key = real.public_key
    self_made = [
        ("one byte 0xff", b"\xff"),
        ("1200 random bytes", rng.randbytes(1200)),
        ("a truncated real key", real_key[: len(real_key) // 2]),
        ("a protobuf of no fields but an unknown one", b"\x18\x01"),
        ("key type 99 with a real key's DER", b"\x08\x63" + real_key[2:]),
        ("an RSA protobuf whose data is no DER", _key_protobuf(crypto_pb2.RSA, b"\x30\x03junk")),
        ("an RSA protobuf of empty data", _key_protobuf(crypto_pb2.RSA, b"")),
        ("an Ed25519 key", _key_protobuf(crypto_pb2.Ed25519, ed_raw)),
        ("an EC key labelled RSA", _key_protobuf(crypto_pb2.RSA, _der(ec_key.public_key()))),
        ("an RSA key of 1024 bits", _key_protobuf(crypto_pb2.RSA, _der(small_rsa.public_key()))),
    ]
    cases = [(f"self-made: {name}", HostileIdentity(key)) for name, key in self_made]
    cases += [
        ("the real peer id, one byte 0xff as its key", HostileIdentity(b"\xff", real.peer_id)),
        ("the real peer id, an Ed25519 key", HostileIdentity(self_made[7][1], real.peer_id)),
        (
            "the real peer id and key, a signature of one byte",
            HostileIdentity(real_key, real.peer_id, b"\x00"),
        ),
        (
            "the real peer id and key, a signature of 1200 bytes",
            HostileIdentity(real_key, real.peer_id, b"\xff" * 1200),
        ),
        (
            "the real peer id, a key of its own that signs",
            HostileIdentity(impostor.public_key, real.peer_id, signer=impostor),
        ),
    ]
    return cases
