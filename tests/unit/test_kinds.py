"""One table of message kinds (net/protocol.py's `KIND_TABLE`): every kind set is derived from it, and
every request kind has its one handler on the servicer."""

import inspect

import pytest

from swarmtrain.net import protocol
from swarmtrain.net.transport import StageServicer

pytestmark = pytest.mark.unit


def test_the_derived_sets_are_what_the_transport_data_plane_and_trainer_rely_on():
    assert set(protocol.MICRO_BATCH_KINDS) == {"forward", "backward", "forward_backward", "evaluate"}
    assert set(protocol.TRAINING_KINDS) == {"forward", "backward", "forward_backward", "chain"}
    assert set(protocol.ACCUMULATING_KINDS) == {"backward", "forward_backward"}
    hand_offs = {"chain", "forward_backward", "evaluate_chain", "evaluate"}
    assert set(protocol.HAND_OFF_KINDS) == hand_offs
    assert set(protocol.DIRECT_KINDS) == hand_offs | {"bundle"}
    assert set(protocol.UNARY_KINDS) == {"info", "ping", "close"}
    assert set(protocol.REPLY_KINDS) == {"result", "error"}
    requests = set(protocol.STREAM_KINDS) | set(protocol.UNARY_KINDS)
    assert requests | set(protocol.REPLY_KINDS) == set(protocol.KINDS)
    assert not set(protocol.STREAM_KINDS) & set(protocol.UNARY_KINDS)


@pytest.mark.parametrize("kind", [k for k, spec in protocol.KIND_TABLE.items() if spec.request])
def test_every_request_kind_has_one_handler_of_its_shape(kind):
    handler = getattr(StageServicer, f"rpc_{kind}")
    assert inspect.isasyncgenfunction(handler) == protocol.KIND_TABLE[kind].stream


def test_the_servicer_has_no_handler_for_a_kind_the_table_lacks():
    handled = {name.removeprefix("rpc_") for name in dir(StageServicer) if name.startswith("rpc_")}
    assert handled == {k for k, spec in protocol.KIND_TABLE.items() if spec.request}
