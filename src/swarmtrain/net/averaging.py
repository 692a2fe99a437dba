"""Intra-stage gradient averaging and state download on top of hivemind's `DecentralizedAverager`.

What this wrapper adds (notes/hivemind-engine.md 2.6 and 3.2):
- per round, the group size is set to the live replica count and the group key to the epoch, so
  replicas at different epochs never average together and a full group starts at once;
- every blocking call is bounded (`step` and `load_state_from_peers` otherwise wait forever when
  the averager process is gone) and failures come back as values, not exceptions;
- the round reports who took part, so the caller can detect partial rounds;
- the state shared with joining peers comes from a callback of the owner (parameters + optimizer),
  and SIGINT is restored after start (hivemind sets it to ignored in the parent).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.utils import MPFuture

from swarmtrain.net.engine import restore_sigint
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

StateProvider = Callable[[], tuple[dict, Sequence[torch.Tensor]]]
GROUP_BITS = 16


@dataclass
class RoundResult:
    averaged: list[torch.Tensor]
    gathered: dict[str, dict]  # peer id (base58) -> what that peer passed as `gather`

    @property
    def group_size(self) -> int:
        return len(self.gathered)


class StageAverager(DecentralizedAverager):
    """Averages a fixed list of tensors (one stage's gradients) with the stage's other replicas."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        dht,
        *,
        prefix: str,
        state_provider: StateProvider,
        min_matchmaking_time_s: float = 1.0,
        request_timeout_s: float = 0.5,
        allreduce_timeout_s: float = 30.0,
        declare_state_period_s: float = 5.0,
    ) -> None:
        self._state_provider = state_provider
        super().__init__(
            [t.detach().clone() for t in tensors],
            dht,
            start=True,
            prefix=prefix.replace(".", "_"),
            target_group_size=2,
            min_group_size=2,
            min_matchmaking_time=min_matchmaking_time_s,
            request_timeout=request_timeout_s,
            allreduce_timeout=allreduce_timeout_s,
            next_chunk_timeout=request_timeout_s * 4,
            declare_state_period=declare_state_period_s,
            shutdown_timeout=3,
        )
        restore_sigint()

    # state sharing (called in this process by hivemind's background thread) ----------------------
    def get_current_state(self):
        metadata, tensors = self._state_provider()
        return metadata, list(tensors), None

    def download_state(self, timeout_s: float) -> tuple[dict, list[torch.Tensor]] | None:
        """Parameters and optimizer state from the stage peer with the highest sharing priority."""
        try:
            # note: hivemind replaces a non-None timeout by its per-chunk request timeout (inverted
            # condition); the overall bound is the .result(timeout) below
            future = self.load_state_from_peers(wait=False, timeout=timeout_s)
            loaded = future.result(timeout=timeout_s)
        except Exception as exc:
            logger.warning("state download failed: %r", exc)
            return None
        if loaded is None:
            return None
        metadata, tensors = loaded
        return (metadata if isinstance(metadata, dict) else {}), list(tensors)

    # rounds -------------------------------------------------------------------------------------
    def configure_round(self, epoch: int, group_size: int, timeout_s: float = 5.0) -> None:
        """Only replicas at the same epoch match; the group is complete with `group_size` peers."""
        bits = format(epoch % (1 << GROUP_BITS), f"0{GROUP_BITS}b")
        future = MPFuture()
        self._outer_pipe.send(
            (
                "_configure_round",
                [],
                dict(group_bits=bits, target_group_size=max(2, group_size), future=future),
            )
        )
        future.result(timeout=timeout_s)

    async def _configure_round(self, group_bits: str, target_group_size: int, future: MPFuture) -> None:
        """Runs inside the averager process (dispatched by name through its control pipe)."""
        try:
            matchmaking = self._matchmaking
            matchmaking.target_group_size = target_group_size
            matchmaking.potential_leaders.target_group_size = target_group_size
            matchmaking.group_key_manager.target_group_size = target_group_size
            matchmaking.group_key_manager.group_bits = group_bits
            future.set_result(None)
        except Exception as exc:
            future.set_exception(exc)

    def average(
        self,
        tensors: Sequence[torch.Tensor],
        weight: float,
        gather: dict,
        find_group_timeout_s: float,
        allreduce_timeout_s: float,
    ) -> RoundResult | None:
        """One weighted all-reduce of `tensors` with the current group; None if no group formed within
        `find_group_timeout_s` or the round failed. Inputs are not modified."""
        with self.get_tensors() as shared:
            for slot, tensor in zip(shared, tensors, strict=True):
                slot.copy_(tensor)
        control = None
        try:
            control = self.step(gather=gather, weight=float(weight), timeout=find_group_timeout_s, wait=False)
            gathered = control.result(timeout=find_group_timeout_s + allreduce_timeout_s)
        except Exception as exc:  # "could not find a group", timeouts, peer failures
            logger.warning("averaging round failed: %r", exc)
            if control is not None and not control.done():
                control.cancel()
            return None
        if not gathered:
            return None
        with self.get_tensors() as shared:
            averaged = [slot.clone() for slot in shared]
        return RoundResult(averaged, {str(peer): data for peer, data in gathered.items()})
