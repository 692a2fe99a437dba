"""Stage state sharing and download on top of hivemind's `DecentralizedAverager`.

A step's gradients are exchanged directly between a stage's replicas (runtime/stage_steps.py says
why hivemind's matchmaking is too slow for that); hivemind's averager serves the stage state
(parameters + optimizer) to joining and lagging replicas, which download it with
`load_state_from_peers`. What this wrapper adds:
- the download is bounded (`load_state_from_peers` otherwise waits forever when the averager process
  is gone) and failures come back as values, not exceptions;
- the state shared with joining peers comes from a callback of the owner (parameters + optimizer),
  and SIGINT is restored after start (hivemind sets it to ignored in the parent).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from hivemind.averaging import DecentralizedAverager

from swarmtrain.net.engine import restore_sigint
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

StateProvider = Callable[[], tuple[dict, Sequence[torch.Tensor]]]


class StageAverager(DecentralizedAverager):
    """Shares one stage's state with its other replicas (its own tensors are never averaged)."""

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
        **averager_kwargs,
    ) -> None:
        self._state_provider = state_provider
        options = dict(
            target_group_size=2,
            min_group_size=2,
            min_matchmaking_time=min_matchmaking_time_s,
            request_timeout=request_timeout_s,
            allreduce_timeout=allreduce_timeout_s,
            next_chunk_timeout=request_timeout_s * 4,
            declare_state_period=declare_state_period_s,
            shutdown_timeout=3,
        )
        options.update(averager_kwargs)
        super().__init__(
            [t.detach().clone() for t in tensors], dht, start=True, prefix=prefix.replace(".", "_"), **options
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
