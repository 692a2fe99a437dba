"""A micro-batch through a real swarm (2 stages, 1 server each) equals the local model: loss and
accumulated parameter gradients; with 8-bit activations and gradients, close to it."""

import pytest
import torch

from swarmtrain.data import build_datasets, iterate_batches
from swarmtrain.model import build_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _local_loss_and_grads(cfg, inputs, labels):
    model = build_model(cfg.model, seed=cfg.training.seed)
    loss = model(inputs, labels)
    loss.backward()
    return float(loss.detach()), {name: p.grad.clone() for name, p in model.named_parameters()}


def _server_grads(probe, num_stages):
    """name -> accumulated gradient sum of every stage's single server, and its sample count."""
    grads, samples = {}, {}
    for stage in range(num_stages):
        (peer,) = probe.peers(stage)
        reply = probe.info(peer, want="grads")
        samples[stage] = reply.header["pending_samples"]
        grads.update({name: reply.tensor(name) for name in reply.tensors})
    return grads, samples


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def test_swarm_matches_local_model(make_swarm):
    swarm, cfg = make_swarm("tiny")
    swarm.start_dht()
    swarm.start_server("s0", 0)
    swarm.start_server("s1", 1)
    swarm.wait_ready(["s0", "s1"])
    probe = make_swarm.probe(cfg, swarm, codec="none")
    probe.wait_for_peers([1, 1])
    train, _ = build_datasets(cfg)
    batches = iterate_batches(train, cfg.training.micro_batch_size, seed=1)
    inputs, labels = next(batches)
    n = inputs.shape[0]
    local_loss, local_grads = _local_loss_and_grads(cfg, inputs, labels)

    # compression off: same loss, same gradients (float tolerance)
    loss = probe.forward_backward("parity-none", inputs, labels)
    assert loss == pytest.approx(local_loss, rel=1e-5)
    grads, samples = _server_grads(probe, 2)
    assert samples == {0: n, 1: n}
    assert set(grads) == set(local_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad / n, local_grads[name], rtol=1e-4, atol=1e-6, msg=name)

    # 8-bit in all four directions: loss within 1%, gradient cosine >= 0.99
    probe.set_codec("8bit")
    loss_8bit = probe.forward_backward("parity-8bit", inputs, labels)
    assert loss_8bit == pytest.approx(local_loss, rel=0.01)
    grads_after, samples = _server_grads(probe, 2)
    assert samples == {0: 2 * n, 1: 2 * n}
    delta = {name: (grads_after[name] - grads[name]) / n for name in grads}
    total = _cosine(
        torch.cat([d.flatten() for d in delta.values()]), torch.cat([local_grads[k].flatten() for k in delta])
    )
    worst = min(_cosine(delta[k], local_grads[k]) for k in delta if local_grads[k].abs().sum() > 0)
    print(
        f"8-bit: loss {loss_8bit:.5f} vs local {local_loss:.5f}; grad cosine {total:.5f} (worst tensor {worst:.4f})"
    )
    assert total >= 0.99
