"""Run keys: file handling, membership tokens and signed DHT records (what strangers cannot forge)."""

import dataclasses
import stat

import pytest

from swarmtrain.net.auth import (
    RunKey,
    RunKeyError,
    generate_key_file,
    keyless_record_filter,
    record_validator,
)

pytestmark = pytest.mark.unit


def test_key_file_is_private_and_never_overwritten(tmp_path):
    path = generate_key_file(tmp_path / "k")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(RunKeyError, match="refusing to overwrite"):
        generate_key_file(path)
    (tmp_path / "bad").write_text("not hex")
    with pytest.raises(RunKeyError, match="not a run key"):
        RunKey.load(tmp_path / "bad")
    with pytest.raises(RunKeyError, match="cannot read"):
        RunKey.load(tmp_path / "missing")


def test_tokens_bind_the_key_and_the_peer(tmp_path):
    key, other = (
        RunKey.load(generate_key_file(tmp_path / "a")),
        RunKey.load(generate_key_file(tmp_path / "b")),
    )
    token = key.token("peerA")
    assert key.verify("peerA", token)
    assert not key.verify("peerB", token)  # another peer's token is useless
    assert not key.verify("peerA", other.token("peerA"))  # another run's key
    assert not key.verify("peerA", None) and not key.verify("peerA", ["x"])


def test_signed_records_validate_and_edits_do_not(tmp_path):
    from hivemind.dht.validation import DHTRecord

    key = RunKey.load(generate_key_file(tmp_path / "a"))
    mine, strangers = record_validator(key), record_validator(RunKey.load(generate_key_file(tmp_path / "b")))
    record = DHTRecord(b"run.stage1", b"peer", b"\x81\xa1a\x01", 1234.5)
    signed = dataclasses.replace(record, value=mine.sign_value(record))
    assert mine.validate(signed) and mine.strip_value(signed) == record.value
    assert not mine.validate(record)  # unsigned
    assert not mine.validate(dataclasses.replace(signed, value=strangers.sign_value(record)))
    for edit in (dict(subkey=b"other"), dict(expiration_time=9999.0), dict(value=b"X" + signed.value[1:])):
        assert not mine.validate(dataclasses.replace(signed, **edit)), edit


def test_a_node_without_the_key_reads_a_signed_record_as_nothing_and_still_stores_it(tmp_path):
    """A signed value decodes to None on a node without the key (hivemind's own decoder fails on the tag,
    and the read never completed); unsigned values, and every store, are as without the filter."""
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils.serializer import MSGPackSerializer

    keyless = keyless_record_filter()
    record = DHTRecord(b"run.stage1", b"peer", MSGPackSerializer.dumps({"stage": 1}), 1234.5)
    signed = dataclasses.replace(
        record, value=record_validator(RunKey.load(generate_key_file(tmp_path / "a"))).sign_value(record)
    )
    from msgpack.exceptions import ExtraData

    with pytest.raises(ExtraData):  # hivemind's decoder on the signed value, as a node without the key had it
        MSGPackSerializer.loads(signed.value)
    assert MSGPackSerializer.loads(keyless.strip_value(signed)) is None
    assert MSGPackSerializer.loads(keyless.strip_value(record)) == {"stage": 1}
    assert (
        keyless.validate(signed) and keyless.validate(record) and keyless.sign_value(record) == record.value
    )
    bracketed = dataclasses.replace(record, value=record.value + b"[swarmtrain-hmac:" + b"x" * 64 + b"]")
    assert keyless.strip_value(bracketed) == bracketed.value  # not a signature: passed on as it is
