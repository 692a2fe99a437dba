"""A peer's libp2p identity in this process, for what libp2p does not carry: the data plane's handshake
(net/secure_link.py) signs with the key the peer's `p2pd` runs with, and checks that a caller's public
key is the one its peer id names.

hivemind's identity files (`--identity-path`) hold an RSA private key as a libp2p `PrivateKey`
protobuf (DER inside). A peer id is the sha2-256 multihash of the protobuf-serialized public key, so a
public key proves which peer id it belongs to, and a signature under it proves the signer holds that
peer id's key. Signatures are RSA-PSS with SHA-256.

A public key comes from a stranger (a data-plane handshake): anything it can send, bytes that are not
a protobuf, a protobuf of another key type, DER of no key or of a key out of range, reads as no key
(`IdentityError` from `public_key_of`, False from `verify`), never another exception.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import multihash
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from google.protobuf.message import DecodeError
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2

RSA_BITS = 2048
MAX_RSA_BITS = 4096  # a caller's key is checked before any work that grows with its size
_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)


class IdentityError(ValueError):
    """An identity file or a public key that is not a usable libp2p RSA identity."""


class PeerIdentity:
    """This peer's private key, its public key as libp2p serializes it, and its peer id."""

    def __init__(self, private_key: rsa.RSAPrivateKey) -> None:
        self._private_key = private_key
        self.public_key = _public_key_protobuf(private_key.public_key())
        self.peer_id = peer_id_of(self.public_key)

    @classmethod
    def generate(cls) -> PeerIdentity:
        return cls(rsa.generate_private_key(public_exponent=65537, key_size=RSA_BITS))

    @classmethod
    def from_file(cls, path: str | Path) -> PeerIdentity:
        """The identity in a libp2p private-key file as hivemind writes and p2pd reads it."""
        try:
            proto = crypto_pb2.PrivateKey.FromString(Path(path).read_bytes())
            key = serialization.load_der_private_key(proto.data, password=None)
        except (OSError, ValueError) as exc:
            raise IdentityError(f"{path} holds no libp2p private key: {exc}") from None
        if proto.key_type != crypto_pb2.RSA or not isinstance(key, rsa.RSAPrivateKey):
            raise IdentityError(f"{path} holds a key of another type than RSA, which hivemind uses")
        return cls(key)

    def write(self, path: str | Path) -> None:
        """Save as a libp2p private-key file only its owner can read (p2pd's `-id`)."""
        der = self._private_key.private_bytes(
            serialization.Encoding.DER,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
        data = crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)

    def sign(self, data: bytes) -> bytes:
        return self._private_key.sign(data, _PSS, hashes.SHA256())


def peer_id_of(public_key: bytes) -> str:
    """The base58 peer id of a protobuf-serialized libp2p public key."""
    digest = multihash.encode(hashlib.sha256(public_key).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


def public_key_of(peer_id: str, public_key: bytes) -> rsa.RSAPublicKey:
    """The RSA key that `public_key` (protobuf-serialized, as a caller sent it) holds, if it is
    `peer_id`'s and of a size we accept; IdentityError, with the reason in one line, for anything else."""
    if peer_id_of(public_key) != peer_id:
        raise IdentityError("the public key is not the one its peer id names")
    try:
        proto = crypto_pb2.PublicKey.FromString(public_key)
        key = serialization.load_der_public_key(proto.data)
    # protobuf's DecodeError is no ValueError; a DER key of an algorithm the backend lacks raises
    # UnsupportedAlgorithm: both are a stranger's bytes, not a bug here
    except (DecodeError, ValueError, TypeError, UnsupportedAlgorithm):
        raise IdentityError("the public key is not a decodable libp2p key") from None
    if proto.key_type != crypto_pb2.RSA or not isinstance(key, rsa.RSAPublicKey):
        raise IdentityError("the public key is not an RSA key, which hivemind uses")
    if not RSA_BITS <= key.key_size <= MAX_RSA_BITS:
        raise IdentityError(f"an RSA key of {key.key_size} bits (accepted: {RSA_BITS} to {MAX_RSA_BITS})")
    return key


def verify(peer_id: str, public_key: bytes, data: bytes, signature: bytes) -> bool:
    """Whether `signature` over `data` was made with the private key of `public_key`, and that key is
    `peer_id`'s. False for anything malformed."""
    try:
        key = public_key_of(peer_id, public_key)
    except IdentityError:
        return False
    try:
        key.verify(signature, data, _PSS, hashes.SHA256())
    except (InvalidSignature, ValueError, TypeError):  # a signature of any length or content: not valid
        return False
    return True


def _public_key_protobuf(key: rsa.RSAPublicKey) -> bytes:
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
