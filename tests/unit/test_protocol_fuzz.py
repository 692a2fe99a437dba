"""Thousands of malformed messages through the server's own parse-and-validate path: every one is
refused with ProtocolError (an error answer), none raises anything else (a traceback, `internal`); and
the data plane's identity check (net/identity.py) given public keys that are no key, of another type or
size, or not the claimed peer id's: each is no key (IdentityError, a failed verification), nothing else.
The handshakes themselves meet these identities in tests/integration/test_data_plane.py."""

import pytest

from fuzz_cases import hostile_identities, locally_rejected, mutations, valid_messages
from swarmtrain.config import get_preset
from swarmtrain.net import identity, protocol

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("stage", [0, 1])
def test_malformed_messages_are_refused_never_crash(stage):
    cfg = get_preset("tiny")
    cases = [c for c in mutations(valid_messages(cfg, stage), count=3000, seed=stage) if c[1] != "info"]
    refused = sum(locally_rejected(kind, data, cfg, stage) for _, kind, data in cases)
    # a few mutations stay valid (a flipped bit in a micro-batch id); nearly all must be refused
    assert refused >= 0.9 * len(cases)


@pytest.mark.parametrize("value", ["no", "yes", "false", 0, 1, None, [], {}])
def test_flags_must_be_json_booleans(value):
    with pytest.raises(protocol.ProtocolError, match="true or false"):
        protocol.header_flag({"fused_backward": value}, "fused_backward", False)
    assert protocol.header_flag({}, "accumulate", True) is True


def test_deep_nesting_and_huge_integers_are_bad_requests():
    for text in ("[" * 5000 + "]" * 5000, '{"step":' + "9" * 4400 + "}"):
        body = text.encode()
        data = protocol.MAGIC + len(body).to_bytes(4, "little") + body
        with pytest.raises(protocol.ProtocolError) as info:
            protocol.unpack(data, 1 << 20)
        assert info.value.code == "bad_request"


def test_undecodable_and_foreign_identities_are_no_key_never_an_exception():
    real = identity.PeerIdentity.generate()
    data = b"a handshake transcript"
    assert identity.verify(real.peer_id, real.public_key, data, real.sign(data))  # the control
    for description, hostile in hostile_identities(real):
        assert not identity.verify(hostile.peer_id, hostile.public_key, data, hostile.sign(data)), description
        if description.startswith("self-made") and "type 99" not in description:
            # its bytes hash to the peer id it claims: refused for what they are, not for the hash
            with pytest.raises(identity.IdentityError, match="decodable|RSA") as refused:
                identity.public_key_of(hostile.peer_id, hostile.public_key)
            assert "\n" not in str(refused.value), description
