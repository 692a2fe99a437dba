"""The swap plan: which consecutive layers form each group streamed through the accelerator.

Invariant (docs/DESIGN.md section 5): while group i computes, group i+1 is being prefetched, so for every i
    bytes(group i) + bytes(group i+1) + working_bytes <= budget_bytes,
and the last group stays resident from the end of the forward into the start of the backward.
Fewer groups mean fewer, larger transfers that overlap compute better, so the planner minimizes the
group count with a dynamic program over layer boundaries (exact for this pairwise constraint).
"""

from __future__ import annotations

from dataclasses import dataclass

from swarmtrain.config.errors import UserError


class SwapPlanError(UserError):
    """The model cannot be streamed through the given memory budget."""


@dataclass(frozen=True)
class SwapPlan:
    groups: tuple[tuple[int, int], ...]  # [start, end) layer ranges, in order
    peak_bytes: float

    @property
    def num_groups(self) -> int:
        return len(self.groups)


def plan_swap_groups(layer_bytes: list[float], budget_bytes: float, working_bytes: float = 0.0) -> SwapPlan:
    """Minimum number of contiguous groups such that any two neighbours plus the working set fit."""
    n = len(layer_bytes)
    if n == 0:
        return SwapPlan((), working_bytes)
    free = budget_bytes - working_bytes
    if free <= 0:
        raise SwapPlanError(
            f"memory budget {budget_bytes:.3g} B leaves nothing after the working set {working_bytes:.3g} B"
        )
    prefix = [0.0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + b)
    if prefix[-1] <= free:
        return SwapPlan(((0, n),), prefix[-1] + working_bytes)  # everything fits: no swapping
    # best[(j, i)] = fewest groups covering layers [0, i) whose last group is [j, i)
    best: dict[tuple[int, int], tuple[int, tuple[int, int] | None]] = {}
    for i in range(1, n + 1):
        for j in range(i - 1, -1, -1):
            size = prefix[i] - prefix[j]
            if size > free:
                break
            if j == 0:
                best[(j, i)] = (1, None)
                continue
            candidates = [
                (best[(k, j)][0] + 1, (k, j))
                for k in range(j)
                if (k, j) in best and (prefix[j] - prefix[k]) + size <= free
            ]
            if candidates:
                best[(j, i)] = min(candidates)
    finals = [(count, j) for (j, i), (count, _) in best.items() if i == n]
    if not finals:
        biggest = max(layer_bytes)
        raise SwapPlanError(
            f"cannot stream {n} layers through {budget_bytes:.3g} B: two neighbouring layers of up to "
            f"{biggest:.3g} B each plus {working_bytes:.3g} B working set must fit at once"
        )
    _, j = min(finals)
    groups, key = [], (j, n)
    while key is not None:
        groups.append(key)
        key = best[key][1]
    groups.reverse()
    peak = max(
        (prefix[b] - prefix[a]) + (prefix[d] - prefix[c])
        for (a, b), (c, d) in zip(groups, groups[1:], strict=False)
    )
    return SwapPlan(tuple(groups), peak + working_bytes)
