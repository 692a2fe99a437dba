"""A private run: a shared secret (the run key) that every peer of the run holds, and the checks built
on it.

libp2p already authenticates peer ids (each connection proves the private key behind the remote peer
id) and encrypts traffic; what it does not say is whether that peer belongs to *this run*. The run key
adds that, four ways:
- DHT records are HMAC-signed (`RunKeyValidator`): a record a stranger stores, or a valid one it
  edits, is dropped by every node of the run, so strangers cannot announce a stage, a replica,
  metrics, a move or an averaging group, and nobody routes to them.
- Every request on the swarm's own protocol carries a membership token, HMAC(key, sender peer id),
  checked against the authenticated sender (`RunKey.verify`): a stranger can neither compute its own
  token nor use another peer's (it cannot speak as that peer id).
- The direct data plane of stage servers (net/data_plane.py; its handshake: net/secure_link.py; its
  callers: the servers before them and trainers)
  opens each connection with an HMAC challenge both ways and seals its frames with a key derived from
  the run key.
- hivemind's averaging RPCs (join a group, send a part, download state) carry no token; they accept
  only peers whose signed records place them in the same group (net/averaging.py).

It does not hide that a run exists, keep strangers out of the DHT's routing (they can withhold
records: a denial of service), or protect against a peer that holds the key (see README "Private
runs").
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import secrets
import struct
from pathlib import Path

from swarmtrain.config.errors import UserError

KEY_BYTES = 32
_TAG = b"[swarmtrain-hmac:"
_TAG_LEN = len(_TAG) + 64 + 1  # tag, hex digest, "]"
_MSGPACK_NIL = b"\xc0"  # None, as hivemind's serializer writes it


class RunKeyError(UserError):
    """A run key file that is missing, unreadable or malformed."""


def generate_key_file(path: str | Path, overwrite: bool = False) -> Path:
    """Write a new random run key (hex, one line) readable by the owner only."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise RunKeyError(f"{path} exists; refusing to overwrite a run key (use --force to replace it)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(KEY_BYTES) + "\n")
    except OSError as exc:
        raise RunKeyError(f"cannot write run key {path}: {exc.strerror}") from None
    return path


@dataclasses.dataclass(frozen=True)
class RunKey:
    secret: bytes = dataclasses.field(repr=False)

    @classmethod
    def load(cls, path: str | Path) -> RunKey:
        try:
            text = Path(path).read_text().strip()
        except OSError as exc:
            raise RunKeyError(f"cannot read run key {path}: {exc.strerror}") from None
        try:
            secret = bytes.fromhex(text)
        except ValueError:
            secret = b""
        if len(secret) != KEY_BYTES:
            raise RunKeyError(
                f"{path} is not a run key (expected {2 * KEY_BYTES} hex digits from `swarmtrain keygen`)"
            )
        return cls(secret)

    def token(self, peer_id: str) -> str:
        """The membership token of `peer_id` (base58): what its requests carry."""
        return hmac.new(self.secret, b"member:" + peer_id.encode(), hashlib.sha256).hexdigest()

    def verify(self, peer_id: str, token: object) -> bool:
        return isinstance(token, str) and hmac.compare_digest(token, self.token(peer_id))

    def mac(self, label: str, *parts: bytes) -> bytes:
        """A keyed hash of `label` and `parts` (each length-prefixed, so no two lists hash alike)."""
        message = label.encode() + b"".join(struct.pack("<I", len(p)) + p for p in parts)
        return hmac.new(self.secret, message, hashlib.sha256).digest()

    def sign_record(self, key: bytes, subkey: bytes, value: bytes, expiration_time: float) -> str:
        message = b"record:" + b"".join(struct.pack("<I", len(p)) + p for p in (key, subkey, value))
        message += struct.pack("<d", expiration_time)
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()


def record_validator(run_key: RunKey):
    """A hivemind record validator that signs every record this node stores and drops unsigned or
    edited ones (hivemind is imported here, not at module import)."""
    from hivemind.dht.validation import DHTRecord, RecordValidatorBase

    class RunKeyValidator(RecordValidatorBase):
        def sign_value(self, record: DHTRecord) -> bytes:
            digest = run_key.sign_record(record.key, record.subkey, record.value, record.expiration_time)
            return record.value + _TAG + digest.encode() + b"]"

        def validate(self, record: DHTRecord) -> bool:
            value = record.value
            if not _signed(value):
                return False
            payload, digest = value[:-_TAG_LEN], value[-_TAG_LEN + len(_TAG) : -1]
            expected = run_key.sign_record(record.key, record.subkey, payload, record.expiration_time)
            return hmac.compare_digest(digest, expected.encode())

        def strip_value(self, record: DHTRecord) -> bytes:
            return record.value[:-_TAG_LEN]

        @property
        def priority(self) -> int:
            return 10  # outermost: signs what any other validator produced

    return RunKeyValidator()


def _signed(value: bytes) -> bool:
    """`value` ends as `RunKeyValidator.sign_value` ends it: the tag, 64 hex digits, "]"."""
    if len(value) < _TAG_LEN or not value.endswith(b"]") or value[-_TAG_LEN:][: len(_TAG)] != _TAG:
        return False
    return all(c in b"0123456789abcdef" for c in value[-_TAG_LEN + len(_TAG) : -1])


def keyless_record_filter():
    """The record validator of a node without a run key: a private run's signed record reads as nothing
    (None, which the run's readers drop as they drop any value that is not theirs). Without it hivemind
    fails to decode such a value inside its search (the tag after the msgpack payload), the read's future
    never completes, and every read of a private run's key by a node without the key (a stranger, a peer
    started without --run-key) waited out its whole timeout. Stores are not filtered: a node without the
    key still keeps a private run's records for the run's members, as before."""
    from hivemind.dht.validation import DHTRecord, RecordValidatorBase

    class KeylessRecordFilter(RecordValidatorBase):
        def validate(self, record: DHTRecord) -> bool:
            return True

        def strip_value(self, record: DHTRecord) -> bytes:
            return _MSGPACK_NIL if _signed(record.value) else record.value

        @property
        def priority(self) -> int:
            return 10  # outermost, as the run key's validator would be

    return KeylessRecordFilter()
