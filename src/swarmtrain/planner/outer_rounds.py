"""Pure decisions of an outer (DiLoCo) round between whole-model replicas (runtime/replica.py)."""

from __future__ import annotations

# replicas of one group differ by codec rounding (~1e-7 relative in the fingerprint after 13 rounds on
# `tiny`); one that averaged a round alone differs by a whole round of updates (~1e-3)
FINGERPRINT_RTOL = 1e-5


def started_from_reference(states: dict[str, tuple], me: str, rtol: float = FINGERPRINT_RTOL) -> bool:
    """Whether `me` started the round from the same anchor as the group's reference member (the highest
    outer step, then the lowest peer id), fingerprints compared within `rtol`: members of one group end
    a round equal only up to the codec's rounding of the averaged deltas (hivemind returns each member
    its average as a compressed delta from its own tensors). Pure, so every member decides alike."""
    top = max(s[0] for s in states.values())
    reference = states[min(p for p, s in states.items() if s[0] == top)]
    step, fp = states[me]
    return step == reference[0] and abs(fp - reference[1]) <= rtol * max(abs(reference[1]), 1e-12)
