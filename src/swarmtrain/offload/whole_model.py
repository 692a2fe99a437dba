"""A whole model (a stage with embeddings and head) trained through the layer swapper: the blocks live in
host memory and stream through `device` in the groups of a swap plan sized to a memory budget; the
embeddings, final norm and head ("outer" parameters) are copied to the device for each micro-batch when
they fit in the budget next to the plan, else they run where their host copies are (slow: a 50k-vocabulary
head on one host core was the GPU run's 102x). The head's logit-sized tensors are what usually does not
fit: the head and loss then run forward and backward on `head_chunks` chunks of the sequence in turn,
the fewest whose moment fits, so only one chunk's logits exist at a time.

The plan counts what is really on the device (plan.py): per group parameters, gradients and the
activations autograd saves in the recomputed forward, measured once per kind of layer at construction on
a micro-batch of `micro_batch_size` full-length sequences (a larger micro-batch re-plans), the prefetched
group, the group inputs kept as checkpoints, hidden states in flight and the outer parameters with their
gradients. Between the blocks' forward and backward the head and loss run, a moment of its own
(`head_moment`): the last group resident, all checkpoints, the head's saved activations and the
logit-sized gradients of the loss. When the last group's saved activations fit beside that moment and its
forward's, the last group keeps its graph from the forward (`kept_graph_moments`), so its backward does not
recompute it; `predicted_peak` is the largest of these moments and the plan's peak.

One micro-batch: embed with autograd, blocks forward through the swapper (no graph but the last group's when
kept, group inputs kept), head and loss with autograd on a leaf of the blocks' output, then back: the head's
gradient wrt that leaf goes back through the swapper (each other group recomputed, parameter gradients added
to the host blocks), and its input gradient into the embeddings. The same gradients as the resident model, up to
floating-point order (tested).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from swarmtrain.model.stage import DecoderStage
from swarmtrain.offload.plan import PeakBytes, SwapPlan, SwapPlanError, plan_swap_groups
from swarmtrain.offload.swapper import Fetched, HostParams, LayerSwapper, saved_activation_bytes, tensor_bytes
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

BLOCKS_PREFIX = "layers."
# hidden states on the device beside the blocks' own bytes: the current and the next one in the forward;
# the blocks' output (kept for the head), the incoming and the outgoing gradient in the backward
HIDDEN_STATES_IN_FLIGHT = 3


class _Embed(nn.Module):
    """`stage.embed` as a forward, so functional_call can run it on device copies of its parameters."""

    def __init__(self, stage: DecoderStage) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.stage.embed(token_ids)


class _HeadLoss(nn.Module):
    """The head and the next-token loss (DecoderStage.forward's, summed), logits freed inside."""

    def __init__(self, stage: DecoderStage) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss summed over the tokens (the caller divides by the counted ones: the head runs on
        chunks of the sequence, whose sums add up to the whole's)."""
        logits = self.stage.head(hidden)
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            labels.reshape(-1),
            ignore_index=self.stage.cfg.pad_token_id,
            reduction="sum",
        )


@dataclass(frozen=True)
class MicroBatchCosts:
    """Device bytes of one micro-batch's pieces, measured on the device at planning."""

    block_param_bytes: list[float]
    block_activation_bytes: list[float]  # saved by autograd in each block's recomputed forward
    hidden_bytes: float  # one hidden state (batch x seq x d_model)
    outer_param_bytes: float  # embeddings, final norm, head
    embed_activation_bytes: float
    head_activation_bytes: float  # head and loss
    logits_fp32_bytes: float  # one fp32 batch x seq x vocab tensor (the loss's gradients are two)


class SwappedGPT:
    """`loss_and_backward` of a whole `model` whose blocks stream through `device` within `budget_bytes`
    (see the module docstring). Raises SwapPlanError when no plan fits."""

    def __init__(
        self,
        model: DecoderStage,
        budget_bytes: float,
        device: str | torch.device = "cpu",
        micro_batch_size: int = 1,
    ) -> None:
        if not (model.spec.is_first and model.spec.is_last):
            raise ValueError("SwappedGPT trains a whole model (first and last stage in one)")
        if model.cfg.shared_layer_repeats != 1:
            raise ValueError("the layer swapper streams unique layers once: shared_layer_repeats must be 1")
        self.model = model
        self.budget_bytes = budget_bytes
        self.device = torch.device(device)
        self._embed, self._head_loss = _Embed(model), _HeadLoss(model)
        self._plan_for(micro_batch_size)

    # planning -----------------------------------------------------------------------------------
    def _plan_for(self, micro_batch_size: int) -> None:
        """Measure, plan (outer parameters on the device if any plan fits with them, else on the host) and
        build the swapper for micro-batches of up to `micro_batch_size` sequences."""
        blocks = list(self.model.layers.values())
        costs = self._measure(micro_batch_size)
        try:
            plan, head, chunks = self._plan_with_outer_on_device(costs)
            outer_on_device = True
        except SwapPlanError as on_device:
            logger.warning("embeddings and head stay on the host, computed there (slow): %s", on_device)
            in_flight = HIDDEN_STATES_IN_FLIGHT * costs.hidden_bytes
            plan, outer_on_device = self._plan_blocks(costs, working_bytes=in_flight), False
            head, chunks = PeakBytes("head and loss on the host"), 1
        self.micro_batch_size, self.costs, self.plan = micro_batch_size, costs, plan
        self.outer_on_device, self.head_moment, self.head_chunks = outer_on_device, head, chunks
        kept = self._kept_graph_moments(costs, plan, head)
        self.kept_graph_moments = kept if all(m.total_bytes <= self.budget_bytes for m in kept) else []
        keep = bool(self.kept_graph_moments)
        self.swapper = LayerSwapper(blocks, plan, self.device, keep_last_graph=keep)
        pin = outer_on_device and self.device.type == "cuda"
        self._outer = HostParams(self.model, pin=pin, skip_prefix=BLOCKS_PREFIX)

    @property
    def predicted_peak(self) -> PeakBytes:
        moments = [self.plan.peak, self.head_moment, *self.kept_graph_moments]
        return max(moments, key=lambda moment: moment.total_bytes)

    def _plan_blocks(self, costs: MicroBatchCosts, working_bytes: float) -> SwapPlan:
        return plan_swap_groups(
            costs.block_param_bytes,
            self.budget_bytes,
            working_bytes,
            grad_bytes=costs.block_param_bytes,  # gradients have their parameters' dtype and shape
            activation_bytes=costs.block_activation_bytes,
            checkpoint_bytes=costs.hidden_bytes,
        )

    def _plan_with_outer_on_device(self, costs: MicroBatchCosts) -> tuple[SwapPlan, PeakBytes, int]:
        """The plan, the head's moment and the fewest chunks of the sequence the head must run in for
        that moment to fit (logit-sized tensors of a 50k vocabulary outweigh everything else there)."""
        # the outer parameters, their gradients and what the embedding saved stay for the whole micro-batch
        outer = 2 * costs.outer_param_bytes + costs.embed_activation_bytes
        plan = self._plan_blocks(costs, working_bytes=HIDDEN_STATES_IN_FLIGHT * costs.hidden_bytes + outer)
        seq_len = self.model.cfg.seq_len
        chunks = 1
        while True:
            head = self._head_moment(costs, plan, -(-seq_len // chunks) / seq_len)
            if head.total_bytes <= self.budget_bytes:
                return plan, head, chunks
            if chunks >= seq_len:
                raise SwapPlanError(
                    f"the head's moment needs {head.total_bytes:.3g} B of {self.budget_bytes:.3g} B "
                    f"even one token at a time"
                )
            chunks = min(2 * chunks, seq_len)

    def _head_moment(self, costs: MicroBatchCosts, plan: SwapPlan, share: float) -> PeakBytes:
        """Between the blocks' forward and backward: the last group resident, every checkpoint, the blocks'
        output and its gradient, and for one chunk of `share` of the tokens the head's saved tensors and
        the loss's two logit-sized gradients."""
        last_start, last_end = plan.groups[-1] if plan.groups else (0, 0)
        return PeakBytes(
            "head and loss",
            params_bytes=costs.outer_param_bytes + sum(costs.block_param_bytes[last_start:last_end]),
            grads_bytes=costs.outer_param_bytes,
            activations_bytes=share * (costs.head_activation_bytes + 2 * costs.logits_fp32_bytes),
            checkpoints_bytes=plan.num_groups * costs.hidden_bytes,
            working_bytes=2 * costs.hidden_bytes + costs.embed_activation_bytes,
        )

    def _kept_graph_moments(self, costs: MicroBatchCosts, plan: SwapPlan, head: PeakBytes) -> list[PeakBytes]:
        """What keeping the last group's graph from its forward to its backward adds (no recompute of that
        group: with a single group, of anything): its forward with autograd (its parameters, what it saves,
        one layer's temporaries) and the head's moment with those saved tensors still held. Empty without
        groups."""
        if not plan.groups:
            return []
        start, end = plan.groups[-1]
        saved = sum(costs.block_activation_bytes[start:end])
        forward = PeakBytes(
            "forward of the last group, its graph kept",
            params_bytes=sum(costs.block_param_bytes[start:end]),
            activations_bytes=saved + max(costs.block_activation_bytes),
            checkpoints_bytes=plan.num_groups * costs.hidden_bytes,
            working_bytes=plan.peak.working_bytes,
        )
        with_head = dataclasses.replace(
            head,
            moment=f"{head.moment}, the last group's graph kept",
            activations_bytes=head.activations_bytes + saved,
        )
        return [forward, with_head]

    def _measure(self, micro_batch_size: int) -> MicroBatchCosts:
        """Each piece's device bytes for `micro_batch_size` sequences of cfg.seq_len, autograd's saved
        tensors measured on the device once per kind of block (same class and parameter shapes)."""
        cfg, device = self.model.cfg, self.device
        blocks = list(self.model.layers.values())
        dtype = next(blocks[0].parameters()).dtype if blocks else torch.float32
        # zeros, not random: planning must not move the global random stream training draws from
        shape = (micro_batch_size, cfg.seq_len, cfg.d_model)
        hidden = torch.zeros(shape, dtype=dtype, device=device, requires_grad=True)
        token_ids = torch.zeros(micro_batch_size, cfg.seq_len, dtype=torch.long, device=device)
        measured: dict[tuple, int] = {}
        block_activation_bytes = []
        for block in blocks:
            kind = (type(block), tuple((n, p.shape, p.dtype) for n, p in block.named_parameters()))
            if kind not in measured:
                measured[kind] = saved_activation_bytes(block, _device_copies(block, device), hidden)
            block_activation_bytes.append(float(measured[kind]))
        outer = {f"stage.{name}": t for name, t in _device_copies(self.model, device, BLOCKS_PREFIX).items()}
        return MicroBatchCosts(
            block_param_bytes=[float(sum(tensor_bytes(p) for p in b.parameters())) for b in blocks],
            block_activation_bytes=block_activation_bytes,
            hidden_bytes=float(tensor_bytes(hidden)),
            outer_param_bytes=float(sum(tensor_bytes(t) for t in outer.values())),
            embed_activation_bytes=float(saved_activation_bytes(self._embed, outer, token_ids)),
            head_activation_bytes=float(saved_activation_bytes(self._head_loss, outer, hidden, token_ids)),
            logits_fp32_bytes=float(micro_batch_size * cfg.seq_len * cfg.vocab_size * 4),
        )

    # training -----------------------------------------------------------------------------------
    def loss_and_backward(self, inputs: torch.Tensor, labels: torch.Tensor, scale: float) -> float:
        """Back-propagates `loss * scale` into the host parameters' `.grad`; returns the loss."""
        if inputs.shape[0] > self.micro_batch_size:
            logger.info("re-planning the layer swapper for micro-batches of %d", inputs.shape[0])
            self._plan_for(inputs.shape[0])
        host = inputs.device
        outer_device = self.device if self.outer_on_device else host
        fetched, params = self._outer_params()
        x = functional_call(self._embed, params, (inputs.to(outer_device),))
        hidden = self.swapper.forward(x.detach().to(self.device))
        leaf = hidden.detach().to(outer_device).requires_grad_(True)
        loss = self._head_and_loss(params, leaf, labels.to(outer_device), scale)
        assert leaf.grad is not None
        grad_x = self.swapper.backward(leaf.grad.to(self.device))
        x.backward(grad_x.to(outer_device))
        if fetched is not None:  # the outer gradients are on the leaves of the device copies
            grads = [params[f"stage.{name}"].grad for name in self._outer.names]
            self.swapper.transfers.send_grads([self._outer], [grads])
            self.swapper.transfers.settle()
        return loss

    def _head_and_loss(
        self, params: dict[str, torch.Tensor], leaf: torch.Tensor, labels: torch.Tensor, scale: float
    ) -> float:
        """The mean loss over the counted tokens; `loss * scale` back-propagated into `leaf.grad` and the
        outer parameters, the head running forward and backward on `head_chunks` chunks of the sequence
        in turn, so only one chunk's logits exist at a time."""
        counted = int((labels != self.model.cfg.pad_token_id).sum())
        chunk = -(-leaf.shape[1] // self.head_chunks)
        total = torch.zeros((), device=leaf.device)
        for start in range(0, leaf.shape[1], chunk):
            rows = slice(start, start + chunk)
            summed = functional_call(self._head_loss, params, (leaf[:, rows], labels[:, rows]))
            (summed * (scale / max(counted, 1))).backward()
            total += summed.detach()  # read once at the end: no wait for the device per chunk
        return float(total) / counted if counted else float("nan")

    def _outer_params(self) -> tuple[Fetched | None, dict[str, torch.Tensor]]:
        """Parameters the embedding and head run with: leaves over device copies (their gradients sent to
        the host at the end), or the host parameters themselves (gradients accumulate in place)."""
        if not self.outer_on_device:
            return None, {f"stage.{n}": p for n, p in zip(self._outer.names, self._outer.params, strict=True)}
        self._outer.keep_pinned()
        fetched = self.swapper.transfers.fetch(self._outer)
        self.swapper.transfers.use(fetched)
        leaves = {f"stage.{name}": t.detach().requires_grad_(True) for name, t in fetched.tensors.items()}
        return fetched, leaves


def _device_copies(
    module: nn.Module, device: torch.device, skip_prefix: str | None = None
) -> dict[str, torch.Tensor]:
    """One-off device copies of a module's parameters (for measuring; not the streaming path)."""
    return {
        name: param.detach().to(device, copy=True)
        for name, param in module.named_parameters()
        if not (skip_prefix and name.startswith(skip_prefix))
    }
