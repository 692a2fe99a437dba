"""A micro-batch's reference for tests that send one through a real swarm: the whole model train-local
builds (boundary layers and subspaces included), its loss and every parameter's gradient on the same
samples, and the gradients the servers accumulated (their `info` with `want="grads"`)."""

from __future__ import annotations

import pytest
import torch

from swarmtrain.data import build_datasets, iterate_batches
from swarmtrain.model import build_model


def whole_model_reference(cfg) -> tuple[torch.Tensor, torch.Tensor, float, dict[str, torch.Tensor]]:
    """(inputs, labels) of the run's first training micro-batch (seed 1), the whole model's loss on it
    and its gradients by parameter name."""
    inputs, labels = next(iterate_batches(build_datasets(cfg)[0], cfg.training.micro_batch_size, seed=1))
    model = build_model(cfg.model, seed=cfg.training.seed, cuts=cfg.boundary_cuts())
    loss = model(inputs, labels)
    loss.backward()
    return inputs, labels, float(loss), {name: p.grad for name, p in model.named_parameters()}


def server_grads(probe, stages: int) -> dict[str, torch.Tensor]:
    """The gradient sums the one server of each of `stages` stages holds, by parameter name."""
    grads = {}
    for stage in range(stages):
        (peer,) = probe.peers(stage)
        reply = probe.info(peer, want="grads")
        grads.update({name: reply.tensor(name) for name in reply.tensors})
    return grads


def exact_micro_batch(probe, cfg, stages: int):
    """The reference micro-batch through the swarm's `stages` stages without a codec: the loss the
    swarm returns equals the whole model's and the servers hold gradients of exactly its parameters.
    Returns (inputs, labels, the whole model's loss, its gradients, the servers' gradient sums)."""
    inputs, labels, local_loss, local = whole_model_reference(cfg)
    loss = probe.forward_backward("exact", inputs, labels)
    assert loss == pytest.approx(local_loss, rel=1e-5)
    grads = server_grads(probe, stages)
    assert set(grads) == set(local)
    return inputs, labels, local_loss, local, grads
