"""A step nobody will close: a replica that holds samples of its step and no trainer's close of it,
while the other stages went on, applies what it holds (pure decisions).

A replica applies a step when a trainer's `close` names its members (runtime/server/stage_steps.py;
the lenient fallback, planner/step_decision.py, acts on the best close when none passes the checks in
time, but only on a close). When no close of the step ever comes, nothing else moved it: the close was
lost (its trainer died between its step's last micro-batch and its closes; a server behind a NAT whose
relay came too late, so the trainer gave the close up), the replica holds every sample of the step, and
`planner/restore.behind_other_stages` never advances a replica holding samples. It stayed at that step
for good, and every later micro-batch timed out at it (tests/integration/test_nat.py, run beside another
swarm: a stage-1 server held step 0's samples forever).

Applying the samples held is what the lost close would have said for this replica: they are the gradients
of the step's micro-batches that it computed (what the trainers' closes of the step count), and the other
stages applied the same micro-batches' gradients when they closed the step. Dropping them instead (an adoption of the other stages' step) would leave this stage without an update
the rest of the model took. The other replicas of the stage that hold samples of the step (their progress
records say so) are named members too, so a stage whose close was lost at every replica exchanges and stays
identical; a replica missing from a stale record is left out, and a fingerprint resync settles the pair.

Not too soon: the other stages must have been past the step, and the samples held unchanged, for a close
timeout (the swarm's request timeout: by then a trainer's late close has come or been given up, and no
micro-batch of the step is still on its way here). A forged "ahead" record can at worst make a replica apply,
a close timeout later, the gradients it computed for the trainers that sent it micro-batches.
"""

from __future__ import annotations

from collections.abc import Mapping

from swarmtrain.planner.step_decision import StepDecision


def applies_held_step(
    epoch: int,
    other_stage_epoch: int,
    held_samples: int,
    has_close: bool,
    finishing: bool,
    behind_for_s: float,
    held_for_s: float,
    grace_s: float,
) -> bool:
    """Whether a replica at step `epoch` applies the `held_samples` it holds of it with no close: it has
    no trainer's close of the step (`has_close`: the step loop decides on a close), is not `finishing` a
    step, and the other stages have been past the step for `behind_for_s`, its samples unchanged for
    `held_for_s`, both at least `grace_s` (the close timeout)."""
    if held_samples <= 0 or has_close or finishing or other_stage_epoch <= epoch:
        return False
    return min(behind_for_s, held_for_s) >= grace_s


def held_step_members(
    peer_id: str, held_samples: int, epoch: int, stage_records: Mapping[str, Mapping]
) -> dict[str, int]:
    """The members of a held step: this replica with its samples, and every stage peer whose progress
    record shows samples held at the same step (`samples`, `epoch`), in peer order."""
    members = {peer_id: held_samples}
    for peer, record in stage_records.items():
        samples = record.get("samples")
        if record.get("epoch") == epoch and type(samples) is int and samples > 0:
            members[peer] = samples
    return dict(sorted(members.items()))


def held_step_decision(members: Mapping[str, int], peer_id: str, now_s: float) -> StepDecision:
    """The decision the step loop acts on for a held step: lenient (every member counts with whatever
    it sends, as for a close none confirmed), merging no close, marked `held` (which tells it from the
    lenient fallback), due now, and `complete`: no trainer's close is awaited any more."""
    return StepDecision(
        members=dict(members),
        participants=frozenset(members) - {peer_id},
        closes=0,
        complete=True,
        first_s=now_s,
        due_s=now_s,
        lenient=True,
        held=True,
    )
