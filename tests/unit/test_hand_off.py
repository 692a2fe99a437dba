"""Direct hand-off's pure parts (net/hand_off.py): the `chain` and `evaluate_chain` messages and their checks, hop reports and hop
service times (the failure table is tests/unit/test_failures.py)."""

import dataclasses

import pytest
import torch

from swarmtrain.config import get_preset
from swarmtrain.net import codec
from swarmtrain.net.hand_off import (
    HopReport,
    chain_message,
    checked_loss,
    evaluate_chain_message,
    hop_service_times,
    micro_batch_origin,
    validate_chain,
    validate_evaluate_chain,
    validate_hops,
)
from swarmtrain.net.protocol import (
    Message,
    ProtocolError,
    StageIO,
    encode_labels,
    pack,
    unpack,
    validate_request,
)
from swarmtrain.net.token_ids import encode_token_ids

pytestmark = pytest.mark.unit

DIGEST = "d1"


@pytest.fixture
def three_stages():
    cfg = get_preset("tiny")
    return cfg.replace(swarm=dataclasses.replace(cfg.swarm, num_stages=3))


def _io(cfg, stage):
    return StageIO.from_config(cfg.model, cfg.stages()[stage], max_batch=16)


def _chain(cfg, stage=0, route=None, flags=None, n=2, **header):
    seq = cfg.model.seq_len
    inputs = torch.randint(0, 256, (n, seq)) if stage == 0 else torch.randn(n, seq, cfg.model.d_model)
    route = route if route is not None else [["p1", "p1b"], ["p2"]][stage:]
    flags = flags if flags is not None else [True] * (1 + len(route))
    message = chain_message(
        "mb-1",
        stage,
        DIGEST,
        "none",
        codec.encode(inputs, "none"),
        codec.encode(torch.randint(0, 256, (n, seq)), "none"),
        route,
        flags,
        step=3,
        **header,
    )
    return unpack(pack(message), 10**8)  # as a server receives it


def test_a_chain_survives_the_wire_and_validates(three_stages):
    chain = validate_chain(_chain(three_stages, flags=[True, False, True]), _io(three_stages, 0), DIGEST, 3)
    assert chain.route == [["p1", "p1b"], ["p2"]] and chain.accumulate_after == [False, True]
    assert chain.forward.accumulate is True and chain.forward.step == 3 and chain.forward.num_samples == 2
    assert chain.labels.dtype == "int64"
    middle = validate_chain(_chain(three_stages, stage=1), _io(three_stages, 1), DIGEST, 3)
    assert middle.route == [["p2"]] and middle.forward.inputs.dtype == torch.float32


@pytest.mark.parametrize(
    "route,flags,match",
    [
        ([["p1"]], [True, True], "route must list"),  # one later stage too few
        ([["p1", "p1"], ["p2"]], None, "twice"),
        ([["a", "b", "c", "d", "e"], ["p2"]], None, "1 to 4"),
        ([[], ["p2"]], None, "1 to 4"),
        ([["p1"], [7]], None, "peer ids"),
        ([["p1"], ["p2"]], [True, True], "accumulate_after"),
    ],
)
def test_bad_routes_and_flags_are_refused(three_stages, route, flags, match):
    with pytest.raises(ProtocolError, match=match):
        validate_chain(_chain(three_stages, route=route, flags=flags), _io(three_stages, 0), DIGEST, 3)


def test_the_last_stage_and_a_wrong_digest_refuse_a_chain(three_stages):
    with pytest.raises(ProtocolError, match="last stage"):
        validate_chain(_chain(three_stages, stage=2, route=[]), _io(three_stages, 2), DIGEST, 3)
    with pytest.raises(ProtocolError) as info:
        validate_chain(_chain(three_stages), _io(three_stages, 0), "other", 3)
    assert info.value.code == "digest_mismatch"


def _hop(stage, peer, acc=2, server_s=1.0, compute_s=0.3, step_wait_s=0.1, child_s=0.5):
    return HopReport(stage, peer, acc, server_s, compute_s, step_wait_s, child_s).to_dict()


def test_hop_reports_must_follow_the_route():
    candidates = [["a"], ["b", "b2"], ["c"]]
    good = {"hops": [_hop(0, "a"), _hop(1, "b2", acc=0), _hop(2, "c", child_s=0.0)]}
    hops = validate_hops(good, 0, 3, candidates, 2)
    assert [(h.stage, h.peer, h.acc) for h in hops] == [(0, "a", 2), (1, "b2", 0), (2, "c", 2)]
    for bad in (
        {"hops": good["hops"][:2]},  # a stage missing
        {"hops": [_hop(0, "a"), _hop(1, "x"), _hop(2, "c")]},  # not a candidate of stage 1
        {"hops": [_hop(0, "a"), _hop(2, "c"), _hop(1, "b")]},  # out of order
        {"hops": [_hop(0, "a", acc=1), _hop(1, "b"), _hop(2, "c")]},  # part of a micro-batch
        {"hops": [_hop(0, "a", acc=True), _hop(1, "b"), _hop(2, "c")]},
    ):
        with pytest.raises(ProtocolError):
            validate_hops(bad, 0, 3, candidates, 2)


def test_service_time_of_a_hop_is_its_own_work_plus_the_transfer_into_it():
    # trainer waited 2.0 s for stage 0, which reported 1.8 s (0.2 s transfer in) of which 1.0 s in its
    # call to stage 1 (which reported 0.7 s: 0.3 s transfer in) and 0.1 s waiting for the previous step
    hops = [
        HopReport(0, "a", 2, server_s=1.8, compute_s=0.5, step_wait_s=0.1, child_s=1.0),
        HopReport(1, "b", 2, server_s=0.7, compute_s=0.6, step_wait_s=0.0, child_s=0.0),
    ]
    assert hop_service_times(2.0, hops) == pytest.approx([0.7 + 0.2, 0.7 + 0.3])


@pytest.mark.parametrize("vocab_size,dtype", [(256, "int16"), (32_000, "int16"), (50_257, "int32")])
def test_labels_go_as_the_narrowest_integer_that_holds_the_vocabulary_and_arrive_as_int64(
    three_stages, vocab_size, dtype
):
    labels = torch.tensor([[vocab_size - 1, 0, -100]])
    encoded = encode_labels(labels, vocab_size)
    assert encoded.dtype == dtype and len(encoded.payload) == 3 * (2 if dtype == "int16" else 4)
    cfg = three_stages.replace(
        model=dataclasses.replace(three_stages.model, vocab_size=vocab_size, seq_len=3)
    )
    last = StageIO.from_config(cfg.model, cfg.stages()[2], max_batch=16)
    inputs = codec.encode(torch.randn(1, 3, cfg.model.d_model), "none")
    for sent in (encoded, codec.encode(labels, "none")):  # int64 from an older trainer still passes
        header = {"mb": "m", "stage": 2, "digest": DIGEST, "codec": "none", "step": 0}
        message = Message("forward_backward", header)
        message.tensors.update(inputs=inputs, labels=sent)
        request = validate_request(unpack(pack(message), 10**8), last, DIGEST)
        assert request.labels.dtype == torch.int64 and request.labels.tolist() == labels.tolist()


def _evaluation(cfg, stage=0, route=None, n=2):
    seq = cfg.model.seq_len
    inputs = torch.randint(0, 256, (n, seq)) if stage == 0 else torch.randn(n, seq, cfg.model.d_model)
    route = route if route is not None else [["p1", "p1b"], ["p2"]][stage:]
    labels = codec.encode(torch.randint(0, 256, (n, seq)), "none")
    message = evaluate_chain_message(
        "ev-1", stage, DIGEST, "none", codec.encode(inputs, "none"), labels, route, step=3
    )
    return unpack(pack(message), 10**8)


def test_an_evaluation_chain_is_a_forward_only_request_that_accumulates_nowhere(three_stages):
    chain = validate_evaluate_chain(_evaluation(three_stages), _io(three_stages, 0), DIGEST, 3)
    assert chain.forward.kind == "evaluate" and chain.forward.evaluate and chain.forward.step == 3
    assert chain.route == [["p1", "p1b"], ["p2"]] and chain.accumulate_after == [False, False]
    middle = validate_evaluate_chain(_evaluation(three_stages, stage=1), _io(three_stages, 1), DIGEST, 3)
    assert middle.route == [["p2"]] and middle.forward.inputs.shape[-1] == three_stages.model.d_model


def test_an_evaluation_chain_is_checked_as_a_training_chain_is(three_stages):
    with pytest.raises(ProtocolError, match="route must list"):
        validate_evaluate_chain(_evaluation(three_stages, route=[["p1"]]), _io(three_stages, 0), DIGEST, 3)
    with pytest.raises(ProtocolError, match="names a peer twice"):
        route = [["p1", "p1"], ["p2"]]
        validate_evaluate_chain(_evaluation(three_stages, route=route), _io(three_stages, 0), DIGEST, 3)
    with pytest.raises(ProtocolError, match="last stage takes no evaluate_chain"):
        validate_evaluate_chain(_evaluation(three_stages, stage=2, route=[]), _io(three_stages, 2), DIGEST, 3)
    with pytest.raises(ProtocolError) as info:
        validate_evaluate_chain(_evaluation(three_stages), _io(three_stages, 0), "other", 3)
    assert info.value.code == "digest_mismatch"


@pytest.mark.parametrize("loss", [None, "1.0", True, float("nan"), float("inf")])
def test_a_chain_reply_without_a_finite_loss_is_a_protocol_error(loss):
    with pytest.raises(ProtocolError, match="bad loss"):
        checked_loss(Message("result", {"loss": loss}))
    assert checked_loss(Message("result", {"loss": 2})) == 2.0


def test_a_micro_batchs_origin_is_the_named_trainer_or_else_the_caller():
    """A stage server handing a micro-batch off names its trainer (`origin`); a trainer's own call names
    none and is its own origin; a malformed origin is a protocol error, not an assert."""
    assert micro_batch_origin({"origin": "12D3trainer"}, "12D3server") == "12D3trainer"
    assert micro_batch_origin({}, "12D3trainer") == "12D3trainer"
    for bad in ("", 7, ["x"], "x" * 200, True):
        with pytest.raises(ProtocolError, match="origin"):
            micro_batch_origin({"origin": bad}, "12D3trainer")


def _stage0_chain(cfg, ids, labels, evaluate=False):
    vocab, route = cfg.model.vocab_size, [["p1"], ["p2"]]
    inputs, sent_labels = encode_token_ids(ids, labels, vocab), encode_labels(labels, vocab)
    if evaluate:
        message = evaluate_chain_message("mb-1", 0, DIGEST, "none", inputs, sent_labels, route, step=3)
    else:
        message = chain_message("mb-1", 0, DIGEST, "none", inputs, sent_labels, route, [True] * 3, step=3)
    return unpack(pack(message), 10**8)


@pytest.mark.parametrize("evaluate", [False, True])
def test_stage_0_reads_its_ids_from_the_labels_of_a_chain_that_sends_them_compact(three_stages, evaluate):
    rows = torch.randint(0, 256, (4, three_stages.model.seq_len + 1))
    ids, labels = rows[:, :-1], rows[:, 1:]
    message = _stage0_chain(three_stages, ids, labels, evaluate)
    assert message.tensors["inputs"].shape == (4, 1) and message.tensors["inputs"].dtype == "int16"
    check = validate_evaluate_chain if evaluate else validate_chain
    chain = check(message, _io(three_stages, 0), DIGEST, 3)
    assert chain.forward.inputs.dtype == torch.int64 and torch.equal(chain.forward.inputs, ids)
    # an ignored label names no id: the ids go whole (int16), and arrive the same
    labels = labels.clone()
    labels[1, 5] = -100
    whole = _stage0_chain(three_stages, ids, labels, evaluate)
    assert whole.tensors["inputs"].shape == tuple(ids.shape)
    assert torch.equal(check(whole, _io(three_stages, 0), DIGEST, 3).forward.inputs, ids)


def test_compact_stage_0_ids_that_do_not_fit_their_labels_are_refused(three_stages):
    io, seq = _io(three_stages, 0), three_stages.model.seq_len
    labels = encode_labels(torch.randint(0, 256, (2, seq)), 256)
    route = [["p1"], ["p2"]]

    def chain(inputs):
        message = chain_message("mb-1", 0, DIGEST, "none", inputs, labels, route, [True] * 3, step=3)
        return unpack(pack(message), 10**8)

    with pytest.raises(ProtocolError, match="labels must be"):  # three samples' ids, two samples' labels
        validate_chain(chain(codec.encode(torch.zeros(3, 1, dtype=torch.int16), "none")), io, DIGEST, 3)
    with pytest.raises(ProtocolError, match="must be in"):
        validate_chain(chain(codec.encode(torch.full((2, 1), 300, dtype=torch.int16), "none")), io, DIGEST, 3)
    with pytest.raises(ProtocolError, match="stage 0 takes token ids"):
        validate_chain(chain(codec.encode(torch.zeros(2, seq), "none")), io, DIGEST, 3)


def test_stage_0_takes_whole_ids_of_any_integer_width_and_refuses_floats(three_stages):
    io, seq = _io(three_stages, 0), three_stages.model.seq_len
    ids = torch.randint(0, 256, (2, seq))
    for dtype in (torch.int16, torch.int32, torch.int64):
        message = Message("forward", {"mb": "m", "stage": 0, "digest": DIGEST, "step": 0},
                          {"inputs": codec.encode(ids.to(dtype), "none")})  # fmt: skip
        assert torch.equal(validate_request(unpack(pack(message), 10**8), io, DIGEST).inputs, ids)
    floats = Message("forward", {"mb": "m", "stage": 0, "digest": DIGEST, "step": 0},
                     {"inputs": codec.encode(ids.float(), "none")})  # fmt: skip
    with pytest.raises(ProtocolError, match="stage 0 takes token ids"):
        validate_request(floats, io, DIGEST)
