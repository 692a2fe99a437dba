"""The swap plan: which consecutive layers form each group streamed through the accelerator, and the
device bytes the swapper (swapper.py) holds at its worst moment, by kind.

What is live on the device for groups 0..k-1, with P, G and A a group's parameter, gradient and
activation bytes (A: what autograd saves when the group's forward is recomputed for its backward):

- forward of group g (no autograd), g+1 prefetched meanwhile: P_g + P_{g+1} + the temporaries of one
  layer (bounded by the largest layer's A);
- backward of group g: P_g + G_g + A_g, and either
  - overlapped: group g-1 prefetched meanwhile (+ P_{g-1}), chosen whenever it fits, or
  - serial: group g-1 fetched only once g's parameters and activations are freed, while g's gradients
    are still being copied out (G_g + P_{g-1});
- always: the inputs of groups 0..g kept for the backward (checkpoints) and the caller's working bytes
  (hidden states in flight, embeddings and head when they live on the device).

The swapper waits for a group's gradients to reach the host before the next group's backward allocates
anything, so no moment holds a third group. Every constraint involves two neighbouring groups only, so the
planner minimizes the group count (fewer, larger transfers overlap compute better) with a dynamic program
over layer boundaries, exact for pairwise constraints. The checkpoint term grows with the group count: the
program counts `count` checkpoints at every moment, and `count` is raised to the plan's group count until
the plan needs no more (a fixed point that skips only counts that cannot work), so the plan is minimal
among those fitting with all their checkpoints counted throughout; the reported moments count each
moment's own (groups 0..g's inputs at group g), and decide per group whether the backward overlaps.
With gradients and activations left out this is the parameters-only plan of earlier versions.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from swarmtrain.config.errors import UserError


class SwapPlanError(UserError):
    """The model cannot be streamed through the given memory budget."""


@dataclass(frozen=True)
class PeakBytes:
    """Device bytes live at one moment of a swapped forward and backward, by kind."""

    moment: str
    params_bytes: float = 0.0  # the computing group's parameters (device copies)
    grads_bytes: float = 0.0  # its parameter gradients on the device
    activations_bytes: float = 0.0  # saved by autograd (backward) or one layer's temporaries (forward)
    prefetch_bytes: float = 0.0  # the neighbouring group's parameters, arriving meanwhile
    checkpoints_bytes: float = 0.0  # group inputs kept for the backward
    working_bytes: float = 0.0  # the caller's: hidden states in flight, embeddings and head on the device

    @property
    def total_bytes(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "moment")


@dataclass(frozen=True)
class SwapPlan:
    groups: tuple[tuple[int, int], ...]  # [start, end) layer ranges, in order
    peak: PeakBytes  # the worst moment of the plan, with its components
    overlapped_backward: tuple[bool, ...]  # per group: its backward runs while group-1 is prefetched

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def peak_bytes(self) -> float:
        return self.peak.total_bytes


class _LayerCosts:
    """Per-layer bytes with prefix sums, so any group's total is two lookups."""

    def __init__(self, param_bytes: list[float], grad_bytes: list[float], activation_bytes: list[float]):
        if not len(param_bytes) == len(grad_bytes) == len(activation_bytes):
            raise ValueError("parameter, gradient and activation bytes must be given for every layer")
        self._params, self._grads, self._acts = (
            _prefix(b) for b in (param_bytes, grad_bytes, activation_bytes)
        )
        self.max_activation_bytes = max(activation_bytes, default=0.0)

    def params(self, group: tuple[int, int]) -> float:
        return self._params[group[1]] - self._params[group[0]]

    def grads(self, group: tuple[int, int]) -> float:
        return self._grads[group[1]] - self._grads[group[0]]

    def activations(self, group: tuple[int, int]) -> float:
        return self._acts[group[1]] - self._acts[group[0]]

    def backward(self, group: tuple[int, int]) -> float:
        return self.params(group) + self.grads(group) + self.activations(group)

    def alone(self, group: tuple[int, int]) -> float:
        """The group computing with nothing prefetched (its backward, or its forward as the last group)."""
        return max(self.backward(group), self.params(group) + self.max_activation_bytes)

    def neighbours_fit(self, first: tuple[int, int], second: tuple[int, int], free_bytes: float) -> bool:
        """`first` computes its forward while `second` arrives, and `second` its backward before `first`."""
        forward = self.params(first) + self.params(second) + self.max_activation_bytes
        overlapped = self.backward(second) + self.params(first)
        serial_transfer = self.grads(second) + self.params(first)
        return forward <= free_bytes and min(overlapped, serial_transfer) <= free_bytes


def _prefix(values: list[float]) -> list[float]:
    prefix = [0.0]
    for value in values:
        prefix.append(prefix[-1] + value)
    return prefix


def plan_swap_groups(
    layer_bytes: list[float],
    budget_bytes: float,
    working_bytes: float = 0.0,
    *,
    grad_bytes: list[float] | None = None,
    activation_bytes: list[float] | None = None,
    checkpoint_bytes: float = 0.0,
) -> SwapPlan:
    """Fewest contiguous groups of layers whose every moment (see the module docstring) fits the budget.

    `layer_bytes`: each layer's parameter bytes; `grad_bytes`: its gradient bytes (absent: no gradients
    counted); `activation_bytes`: what autograd saves in its recomputed forward for the planned micro-batch
    (absent: none counted); `checkpoint_bytes`: one group input kept for the backward; `working_bytes`:
    everything else the caller keeps on the device throughout.
    """
    n = len(layer_bytes)
    costs = _LayerCosts(list(layer_bytes), list(grad_bytes or [0.0] * n), list(activation_bytes or [0.0] * n))
    if n == 0:
        return SwapPlan((), PeakBytes("no layers", working_bytes=working_bytes), ())
    count = 1  # checkpoints counted; raised to the plan's group count until the plan fits in it
    while True:
        free_bytes = budget_bytes - working_bytes - count * checkpoint_bytes
        if free_bytes <= 0:
            raise SwapPlanError(
                f"memory budget {budget_bytes:.3g} B leaves nothing after the working set {working_bytes:.3g} B"
                f" and {count} checkpoint(s) of {checkpoint_bytes:.3g} B"
            )
        groups = _fewest_groups(costs, n, free_bytes)
        if groups is None:
            biggest = max(costs.alone((i, i + 1)) for i in range(n))
            raise SwapPlanError(
                f"cannot stream {n} layers through {budget_bytes:.3g} B: a layer's parameters, gradients and "
                f"recomputed activations (up to {biggest:.3g} B) next to its neighbouring layers' parameters, "
                f"plus {working_bytes:.3g} B working set and {count} checkpoint(s) of {checkpoint_bytes:.3g} B, "
                "must fit at once"
            )
        if len(groups) <= count:
            break
        count = len(groups)
    return _plan(tuple(groups), costs, budget_bytes, working_bytes, checkpoint_bytes)


def _fewest_groups(costs: _LayerCosts, n: int, free_bytes: float) -> list[tuple[int, int]] | None:
    if costs.alone((0, n)) <= free_bytes:
        return [(0, n)]  # everything fits: no swapping
    # best[(j, i)] = fewest groups covering layers [0, i) whose last group is [j, i), and the group before
    best: dict[tuple[int, int], tuple[int, tuple[int, int] | None]] = {}
    for i in range(1, n + 1):
        for j in range(i - 1, -1, -1):
            group = (j, i)
            if costs.alone(group) > free_bytes:
                break  # a group only grows as j decreases
            if j == 0:
                best[group] = (1, None)
                continue
            candidates = [
                (best[(k, j)][0] + 1, (k, j))
                for k in range(j)
                if (k, j) in best and costs.neighbours_fit((k, j), group, free_bytes)
            ]
            if candidates:
                best[group] = min(candidates)
    finals = [(count, j) for (j, i), (count, _) in best.items() if i == n]
    if not finals:
        return None
    _, j = min(finals)
    groups: list[tuple[int, int]] = []
    key: tuple[int, int] | None = (j, n)
    while key is not None:
        groups.append(key)
        key = best[key][1]
    groups.reverse()
    return groups


def _plan(
    groups: tuple[tuple[int, int], ...],
    costs: _LayerCosts,
    budget_bytes: float,
    working_bytes: float,
    checkpoint_bytes: float,
) -> SwapPlan:
    """The plan's moments with the exact checkpoint count of each (groups 0..g's inputs are kept at g);
    a backward is overlapped whenever that moment fits, and the program guaranteed the serial one does."""
    overlapped = tuple(
        g > 0
        and costs.backward(group) + costs.params(groups[g - 1]) + (g + 1) * checkpoint_bytes + working_bytes
        <= budget_bytes
        for g, group in enumerate(groups)
    )
    moments = []
    for g, group in enumerate(groups):
        kept = ((g + 1) * checkpoint_bytes, working_bytes)  # checkpoints and working bytes, at every moment
        params, grads, acts = costs.params(group), costs.grads(group), costs.activations(group)
        following = costs.params(groups[g + 1]) if g + 1 < len(groups) else 0.0
        preceding = costs.params(groups[g - 1]) if g > 0 else 0.0
        moments.append(
            PeakBytes(f"forward of group {g}", params, 0.0, costs.max_activation_bytes, following, *kept)
        )
        if overlapped[g]:
            moments.append(
                PeakBytes(f"backward of group {g}, overlapped", params, grads, acts, preceding, *kept)
            )
        else:
            moments.append(PeakBytes(f"backward of group {g}", params, grads, acts, 0.0, *kept))
            if g > 0:
                name = f"gradients of group {g} out, group {g - 1} in"
                moments.append(PeakBytes(name, 0.0, grads, 0.0, preceding, *kept))
    peak = max(moments, key=lambda moment: moment.total_bytes)
    return SwapPlan(groups, peak, overlapped)
