"""The data plane's secure link: the handshake that opens each of its TCP connections (net/data_plane.py)
and the AES-GCM seal of every frame after it. This file is what a security review of the data plane
reads; the frames it seals are in net/framing.py, the links, their limits, the server and the client in
net/data_plane.py.

A connection opens with a handshake, in every run, public or private (threat model: anyone can reach
the port and anyone on the path can read, drop, replay or change bytes):
1. the client sends its peer id, the peer id of the server it means to reach (an address now used by
   another process is refused, not served), a link id and role, a random nonce, an ephemeral X25519
   public key and its libp2p public key;
2. the server answers with its own nonce, ephemeral key and libp2p public key, and its signature over
   the transcript (a hash of every field of both messages);
3. the client checks that the server's key is the one its peer id names (a peer id is the hash of its
   public key: net/identity.py) and the signature, then signs the transcript itself; the server checks
   the same of the client's claimed peer id.
So each side proves the libp2p identity it claims, as libp2p's own handshake does, and a caller's peer
id (what a stage bans, credits or answers) is authenticated. Every frame's body is then sealed with
AES-GCM, the header as associated data, under a key derived (HKDF-SHA256) from the X25519 secret and
the transcript: an eavesdropper reads nothing, and a changed, dropped, replayed or reordered frame fails
its authentication (each direction counts its nonces) and ends the link. A private run adds what a
public one cannot ask: both sides prove they hold the run key (an HMAC over the transcript), and the run
key salts the frames' key, so a stranger cannot even complete the handshake.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hivemind.p2p import PeerID

from swarmtrain.net import identity
from swarmtrain.net.auth import RunKey
from swarmtrain.net.codec import Buffer
from swarmtrain.net.identity import PeerIdentity
from swarmtrain.net.protocol import ProtocolError
from swarmtrain.net.stream import Stream
from swarmtrain.utils.logging import get_logger

# the data plane's lines: one logger name to read or filter a server's data-plane logs by
logger = get_logger("swarmtrain.net.data_plane")

_HELLO_LENGTH = struct.Struct("!I")
_MAX_HELLO_BYTES = 4096
NONCE_BYTES = 16
TAG_BYTES = 16  # AES-GCM's authentication tag, appended to a sealed body
_STREAMED_BYTES = 1 << 20  # a body of several parts at least this large is sealed part by part
_PROTOCOL = "swarmtrain-data/2"
_DH_BYTES = 32  # an X25519 public key
_MAX_KEY_BYTES = 1200  # a libp2p RSA public key (up to MAX_RSA_BITS) or a signature, serialized
REQUESTS, REPLIES = "requests", "replies"  # a link's two connections


class Seal:
    """AES-GCM for one connection: a key from the handshake, a counted nonce per direction."""

    def __init__(self, key: bytes, sending: bytes, receiving: bytes) -> None:
        self._key, self._aead = key, AESGCM(key)
        self._sending, self._receiving = sending, receiving  # 4-byte direction labels
        self._sent = self._received = 0

    def seal(self, head: bytes, body: Buffer) -> bytes:
        self._sent += 1
        return self._aead.encrypt(self._sending + self._sent.to_bytes(8, "big"), body, head)

    def seal_into(self, head: bytes, parts: Sequence[Buffer], out: memoryview) -> None:
        """Seal the concatenation of `parts` into `out` (their size and TAG_BYTES) without joining them:
        a large message's payloads are read once, by the cipher (docs/LOG.md, "The data plane's own
        stream")."""
        self._sent += 1
        nonce = self._sending + self._sent.to_bytes(8, "big")
        if len(parts) == 1 or len(out) < _STREAMED_BYTES:  # one call of the cipher is cheaper
            self._aead.encrypt_into(nonce, parts[0] if len(parts) == 1 else b"".join(parts), head, out)
            return
        encryptor = Cipher(algorithms.AES(self._key), modes.GCM(nonce)).encryptor()
        encryptor.authenticate_additional_data(head)
        offset = 0
        for part in parts:
            # each call wants 15 bytes of room past its part's end: the next part's place or the tag's
            offset += encryptor.update_into(part, out[offset:])
        encryptor.finalize()
        out[offset:] = encryptor.tag

    def skip(self) -> None:
        """A frame the receiver dropped unread still used its nonce."""
        self._received += 1

    def open(self, head: bytes, body: Buffer) -> bytes:
        self._received += 1
        try:
            return self._aead.decrypt(self._receiving + self._received.to_bytes(8, "big"), body, head)
        except InvalidTag:
            raise ProtocolError("a data-plane frame failed its authentication", "unauthorized") from None

    def open_in_place(self, head: bytes, sealed: bytearray | memoryview) -> memoryview:
        """Open a sealed body where it lies (no second buffer): its plaintext, a view of `sealed`'s
        first bytes."""
        self._received += 1
        view = memoryview(sealed)
        size = len(sealed) - TAG_BYTES
        try:
            if size < 0:
                raise InvalidTag
            self._aead.decrypt_into(
                self._receiving + self._received.to_bytes(8, "big"), view, head, view[:size]
            )
        except InvalidTag:
            raise ProtocolError("a data-plane frame failed its authentication", "unauthorized") from None
        return view[:size]


# the handshake --------------------------------------------------------------------------------------
async def _say(stream: Stream, fields: dict) -> None:
    data = json.dumps(fields).encode()
    stream.write(_HELLO_LENGTH.pack(len(data)) + data)
    await stream.drain()


async def _hear(stream: Stream) -> dict:
    (length,) = _HELLO_LENGTH.unpack(await stream.readexactly(_HELLO_LENGTH.size))
    if length > _MAX_HELLO_BYTES:
        raise ProtocolError(f"a data-plane handshake message of {length} bytes")
    data = await stream.readexactly(length)
    try:
        fields = json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: deeply nested JSON
        raise ProtocolError("a malformed data-plane handshake message") from None
    if not isinstance(fields, dict):
        raise ProtocolError("a malformed data-plane handshake message")
    return fields


def _field(fields: dict, name: str, size: int | None = None, max_size: int = _MAX_KEY_BYTES) -> bytes:
    """A hex field of a handshake message: `size` bytes, or up to `max_size`."""
    try:
        value = bytes.fromhex(str(fields.get(name)))
    except ValueError:
        value = b""
    if not value or (size is not None and len(value) != size) or len(value) > max_size:
        raise ProtocolError(f"a data-plane handshake without a valid {name}")
    return value


def _transcript(hello: dict, reply: dict) -> bytes:
    """What both sides sign and derive their keys from: every field of both opening messages."""
    parts = [_PROTOCOL, hello["peer"], hello["to"], hello["link"], hello["role"]]
    parts += [hello["nonce"], reply["nonce"], hello["dh"], reply["dh"], hello["key"], reply["key"]]
    encoded = b"".join(struct.pack("!I", len(p)) + p for p in (str(x).encode() for x in parts))
    return hashlib.sha256(encoded).digest()


@dataclass(frozen=True)
class _Session:
    """What both sides derive from the handshake: the signed transcript, and in a private run the run
    key's proofs; the frames' key from the ephemeral X25519 secret (the run key mixed in when there)."""

    transcript: bytes
    shared: bytes  # the X25519 secret
    run_key: RunKey | None

    def signed(self, side: str) -> bytes:
        return f"{_PROTOCOL} {side}".encode() + self.transcript

    def proof(self, side: str) -> str:
        return self.run_key.mac(f"data-plane {side}", self.transcript).hex() if self.run_key else ""

    def seal(self, side: str) -> Seal:
        salt = self.run_key.mac("data-plane session", self.transcript) if self.run_key else None
        hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=f"{_PROTOCOL} session".encode())
        key = hkdf.derive(self.shared + self.transcript)
        client, server = b"c->s", b"s->c"
        return Seal(key, client, server) if side == "client" else Seal(key, server, client)


def _ephemeral() -> tuple[X25519PrivateKey, str]:
    key = X25519PrivateKey.generate()
    return key, key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


def _shared(ours: X25519PrivateKey, fields: dict) -> bytes:
    try:
        return ours.exchange(X25519PublicKey.from_public_bytes(_field(fields, "dh", _DH_BYTES)))
    except ValueError:  # a low-order point: no shared secret
        raise ProtocolError("a data-plane handshake with an unusable key exchange") from None


@dataclass(frozen=True)
class Hello:
    """Who calls (proven by its libp2p key), for which link and as which of its connections."""

    caller: str
    link: str
    role: str


async def client_handshake(
    stream: Stream,
    me: PeerIdentity,
    server: str,
    run_key: RunKey | None,
    link: str,
    role: str,
) -> Seal:
    ephemeral, dh = _ephemeral()
    hello = {"protocol": _PROTOCOL, "peer": me.peer_id, "to": server, "link": link, "role": role}
    hello |= {"nonce": secrets.token_hex(NONCE_BYTES), "dh": dh, "key": me.public_key.hex()}
    await _say(stream, hello)
    reply = await _hear(stream)
    if "error" in reply:
        raise ProtocolError(f"refused: {str(reply['error']):.200}")
    if reply.get("peer") != server:
        raise ProtocolError(f"reached {str(reply.get('peer')):.60}, not {server}")
    _field(reply, "nonce", NONCE_BYTES)
    their_key, shared = _field(reply, "key"), _shared(ephemeral, reply)  # checked before any use
    _check_key(server, their_key, f"the server could not prove it is {server}")
    session = _Session(_transcript(hello, reply), shared, run_key)
    if not identity.verify(server, their_key, session.signed("server"), _field(reply, "sig")):
        raise ProtocolError(f"the server could not prove it is {server}")
    if run_key is None and "proof" in reply:
        raise ProtocolError("the server's run is private and we hold no run key")
    if run_key is not None and not secrets.compare_digest(str(reply.get("proof")), session.proof("server")):
        raise ProtocolError("the server holds no valid run key")
    answer = {"sig": me.sign(session.signed("client")).hex()}
    await _say(stream, answer | ({"proof": session.proof("client")} if run_key is not None else {}))
    verdict = await _hear(stream)
    if "error" in verdict:
        raise ProtocolError(f"refused: {str(verdict['error']):.200}")
    return session.seal("client")


async def server_handshake(
    stream: Stream,
    me: PeerIdentity,
    run_key: RunKey | None,
    admit: Callable[[str], str | None] | None = None,
) -> tuple[Hello, Seal]:
    """Who calls, proven, and the frames' seal. A caller that fails any check (a malformed message, a
    key that is not its peer id's or no key at all, no proof, or `admit(peer id)` naming a reason once it
    is proven: a limit of the server's) is told why in one error message and the refusal is logged in
    one line: what a stranger sends raises ProtocolError here, nothing else."""
    try:
        return await _proven_caller(stream, me, run_key, admit)
    except ProtocolError as exc:
        logger.info("data plane: refused a handshake from %s: %s", _remote_ip(stream), exc)
        with contextlib.suppress(OSError, RuntimeError):  # the caller may have gone already
            await _say(stream, {"error": str(exc)})
        raise


async def _proven_caller(
    stream: Stream,
    me: PeerIdentity,
    run_key: RunKey | None,
    admit: Callable[[str], str | None] | None,
) -> tuple[Hello, Seal]:
    hello = await _hear(stream)
    caller, link, role = str(hello.get("peer", "")), str(hello.get("link", "")), hello.get("role")
    if hello.get("protocol") != _PROTOCOL:
        raise ProtocolError(f"protocol {str(hello.get('protocol')):.40} is not {_PROTOCOL}")
    if hello.get("to") != me.peer_id:
        raise ProtocolError(f"this is {me.peer_id}, not {str(hello.get('to')):.60}")
    if not _is_peer_id(caller):
        raise ProtocolError("a malformed peer id")
    if role not in (REQUESTS, REPLIES) or not 0 < len(link) <= 64:
        raise ProtocolError("a malformed link")
    _field(hello, "nonce", NONCE_BYTES)
    ephemeral, dh = _ephemeral()
    their_key, shared = _field(hello, "key"), _shared(ephemeral, hello)  # checked before any use
    # the key is checked before we sign anything for it
    _check_key(caller, their_key, f"{caller[-8:]} could not prove it holds its peer id's key")
    reply = {
        "peer": me.peer_id,
        "nonce": secrets.token_hex(NONCE_BYTES),
        "dh": dh,
        "key": me.public_key.hex(),
    }
    session = _Session(_transcript(hello, reply), shared, run_key)
    reply["sig"] = me.sign(session.signed("server")).hex()
    if run_key is not None:
        reply["proof"] = session.proof("server")
    await _say(stream, reply)
    answer = await _hear(stream)
    if not identity.verify(caller, their_key, session.signed("client"), _field(answer, "sig")):
        raise ProtocolError(f"{caller[-8:]} could not prove it holds its peer id's key", "unauthorized")
    if run_key is not None and not secrets.compare_digest(str(answer.get("proof")), session.proof("client")):
        raise ProtocolError(f"{caller[-8:]} holds no valid run key", "unauthorized")
    refusal = admit(caller) if admit is not None else None
    if refusal is not None:
        raise ProtocolError(refusal, "unavailable")
    await _say(stream, {"ok": True})
    return Hello(caller, link, role), session.seal("server")


def _check_key(peer_id: str, public_key: bytes, refusal: str) -> None:
    """ProtocolError(`refusal` and the reason) unless `public_key` is a usable libp2p key of `peer_id`
    (net/identity.py): bytes that hash to the claimed peer id can still be no key at all."""
    try:
        identity.public_key_of(peer_id, public_key)
    except identity.IdentityError as exc:
        raise ProtocolError(f"{refusal}: {exc}", "unauthorized") from None


def _remote_ip(stream: Stream) -> str:
    return str((stream.get_extra_info("peername") or ("?",))[0])


def _is_peer_id(text: str) -> bool:
    try:
        PeerID.from_base58(text)
    except Exception:  # base58 and multihash parsers raise several kinds
        return False
    return bool(text)
