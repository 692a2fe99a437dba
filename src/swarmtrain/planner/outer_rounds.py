"""Pure decisions of an outer (DiLoCo) round between whole-model replicas (runtime/replica/replica_peer.py).

Members of one hivemind all-reduce end a round equal only up to the codec's rounding (each gets the
mean back as a compressed delta from its own tensors), and that drift adds up over rounds: measured
on `tiny`, ~5e-8 relative per round in float16 and ~7e-6 in 8-bit, while a replica that averaged a
round alone differs by a whole round of updates: 1e-2 early, ~3e-4 late in the schedule (docs/LOG.md).
A fingerprint tolerance cannot separate the two over a long run, so replicas carry a *lineage*: a
hash of which group applied which round from which state. Members of one group get the same new
lineage; a replica that averaged alone gets its own. A replica applies a round's mean only if it
started the round with the reference member's lineage; the fingerprint, with a loose tolerance,
still catches a group whose all-reduce silently kept some parts local (a reducer died).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

INITIAL_LINEAGE = "init"  # every replica starts from the seed's weights
FINGERPRINT_RTOL = 1e-3


@dataclass(frozen=True)
class RoundState:
    """What a member gathers about itself at a round's start."""

    outer_step: int
    lineage: str
    fingerprint: float
    serves_state: bool = True  # False for a client-mode replica (behind a NAT): nobody can download from it


def reference_member(states: dict[str, RoundState]) -> str:
    """The member the group converges on: the highest outer step, then one that can serve its state
    (the others download from it when they differ), then the lowest peer id."""
    top = max(s.outer_step for s in states.values())
    at_top = [p for p, s in states.items() if s.outer_step == top]
    return min([p for p in at_top if states[p].serves_state] or at_top)


def started_from_reference(states: dict[str, RoundState], me: str, rtol: float = FINGERPRINT_RTOL) -> bool:
    """Whether `me` may apply the group's mean (else it downloads a state that has applied it). Pure, so
    every member decides alike."""
    ref, mine = states[reference_member(states)], states[me]
    close = abs(mine.fingerprint - ref.fingerprint) <= rtol * max(abs(ref.fingerprint), 1e-12)
    return mine.outer_step == ref.outer_step and mine.lineage == ref.lineage and close


def next_lineage(outer_step: int, members: list[str], lineage: str) -> str:
    """The lineage after round `outer_step` applied by `members` from `lineage` (the same on each)."""
    text = f"{outer_step}|{','.join(sorted(members))}|{lineage}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def round_state(gathered: dict) -> RoundState:
    """A member's `RoundState` from the metadata it gathered into the all-reduce."""
    try:
        return RoundState(
            int(gathered["outer_step"]),
            str(gathered["lineage"]),
            float(gathered["fp"]),
            gathered.get("serves", True) is not False,
        )
    except (KeyError, TypeError, ValueError):
        return RoundState(-1, "", float("nan"))  # a malformed member never becomes the reference


def member_weight(gathered: dict, floor: float) -> float:
    """A member's weight in a round from what it gathered (its samples), as it gave it to the all-reduce;
    `floor` for a member that trained nothing in it or sent no usable count."""
    samples = gathered.get("samples")
    if isinstance(samples, int | float) and math.isfinite(samples) and samples > 0:
        return float(samples)
    return floor
