"""Where a starting stage replica's state comes from, and what a replica behind the other stages does.

Pure decisions (no I/O), used by the server's synchronizer and unit-tested on their own:
- `choose_start`: live replicas of the stage > its newest checkpoint > initial weights, and never
  initial weights silently once the swarm has stepped (a stage whose replicas all died would
  otherwise restart from scratch while the other stages go on: the loss jumps back to the start);
- `behind_other_stages`: stages apply a step milliseconds apart; a replica left steps behind the
  others adopts the swarm's step number, keeping its parameters (the skipped steps' updates of this
  stage are lost), unless its parameters are the untrained initial ones. One restored from a checkpoint
  (an older checkpoint, or stages restarted from checkpoints of different steps) does so after a short
  grace period; one that has stepped with the swarm only once nothing of its step can still come (the
  step was applied by a replica of this stage that died, or by none), which is what a checkpoint
  period and the loss of a dead peer's unsaved work bound;
- `follows_on_mismatch`: of two replicas whose parameters differ at the same step, which one resyncs
  from the other (the one that skipped steps, else the one that trained fewer samples of its own lately).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StartState:
    source: str  # "fresh" | "peers" | "checkpoint" | "refuse"
    epoch: int  # the step this replica serves from
    lost_steps: int  # of this stage's updates, when it resumes behind the swarm
    reason: str


def choose_start(
    stage_peer_epochs: list[int], checkpoint_step: int | None, swarm_step: int, allow_fresh: bool
) -> StartState:
    """`stage_peer_epochs`: live replicas of this stage; `checkpoint_step`: the newest usable checkpoint
    of this stage (None: none); `swarm_step`: the highest step live replicas of the other stages are at."""
    peers_epoch = max(stage_peer_epochs, default=None)
    if checkpoint_step == 0:
        checkpoint_step = None  # the initial weights: restoring them once the swarm has stepped is a reset
    if peers_epoch is not None and peers_epoch >= (checkpoint_step or 0) and peers_epoch > 0:
        return StartState(
            "peers", peers_epoch, 0, f"{len(stage_peer_epochs)} live replica(s) at step {peers_epoch}"
        )
    if checkpoint_step is not None:
        epoch = max(checkpoint_step, swarm_step)
        lost = epoch - checkpoint_step
        why = f"checkpoint of step {checkpoint_step}"
        if lost:
            why += f"; the other stages are at step {swarm_step}: this stage's last {lost} update(s) are lost"
        return StartState("checkpoint", epoch, lost, why)
    if peers_epoch is not None or swarm_step == 0:
        return StartState("fresh", 0, 0, "a new run: initial weights")
    if allow_fresh:
        return StartState(
            "fresh",
            swarm_step,
            swarm_step,
            f"--fresh-start: initial weights at step {swarm_step}; every update of this stage so far is lost",
        )
    return StartState(
        "refuse",
        swarm_step,
        swarm_step,
        f"the swarm is at step {swarm_step}, this stage has no live replica and no checkpoint: serving "
        "initial weights would silently reset it. Start this server with --checkpoint-dir pointing at "
        "the stage's checkpoints, or with --fresh-start to restart this stage from scratch on purpose",
    )


def behind_other_stages(
    epoch: int,
    other_stage_epoch: int,
    pending_samples: int,
    behind_for_s: float,
    grace_s: float,
    untrained: bool,
    allow_fresh: bool,
    closing: bool = False,
    restored: bool = True,
    stranded_grace_s: float = math.inf,
    abandon_close: bool = False,
    finishing: bool = False,
) -> str:
    """ "wait", "advance" (adopt `other_stage_epoch`) or "refuse" for a replica whose own stage has no
    replica ahead of it. A replica still holding a step's gradients, or whose current step is being
    closed (`closing`: it may wait a close timeout for a slow trainer, with or without samples of its
    own), is never advanced; nor one behind by less than `grace_s` (stages step a few ms apart).
    Unless it gives its step's close up (`abandon_close`: a vouched close of its step whose every holder
    has been silent for the lag grace, planner/catch_up.py): nobody can finish that step, and the
    samples it holds of it are lost with the step (the caller writes them to the ledger). Netbed chaos,
    seed 0: a stage-0 replica holding 8 samples of such a step kept it, and the trainers' requests of
    the next step, for 21 s, until the cut-off holder came back. Never while the step loop is `finishing`
    the step (an exchange or apply under way: it decides the step, and an adoption under it would log its
    samples lost twice).

    A replica that was not `restored` from a checkpoint (or started fresh) without stepping since, but
    has stepped with the swarm or downloaded its state from peers, waits `stranded_grace_s` (a request
    timeout: by then every micro-batch of its step still on its way has arrived or been given up by its
    trainer). Sooner, it could skip a step its peers are still closing; never, and a stage whose only
    replica that applied a step died stays a step behind the other stages for good, every micro-batch
    timing out at it (both shown by bench/chaos.py)."""
    held = finishing or (not abandon_close and (pending_samples > 0 or closing))
    if other_stage_epoch <= epoch or held or behind_for_s < grace_s:
        return "wait"
    if not (restored or untrained) and behind_for_s < stranded_grace_s:
        return "wait"
    if untrained and not allow_fresh:
        return "refuse"
    return "advance"


@dataclass(frozen=True)
class Line:
    """What a replica's progress record says of the line its parameters are on, at its fingerprint's step."""

    peer_id: str
    # this stage's updates its state lacks among the last RECENT_STEPS steps (`recent_skipped`): it
    # adopted the other stages' step without them, or was restored from a checkpoint older than that step
    skipped: int
    # samples of its own in the steps it applied among the last RECENT_STEPS, as of the fingerprint's step
    # (None: not published, a peer of an earlier version)
    own_samples: int | None = 0


# how far back a replica's own samples and skipped updates count for which line a diverged pair keeps
# (`follows_on_mismatch`): a divergence is found within a few heartbeats, far less than this many steps
RECENT_STEPS = 32


def with_skip(skips: Sequence[tuple[int, int]], at: int, count: int) -> list[tuple[int, int]]:
    """`skips` (as `recent_skipped` takes them) with a skip of `count` steps to step `at`, less the ones
    too far back to count from there: the list stays RECENT_STEPS long at most."""
    return [(step, n) for step, n in skips if at - step < RECENT_STEPS] + [(at, count)]


def recent_skipped(skips: Sequence[tuple[int, int]], epoch: int) -> int:
    """How many of this stage's updates a state at `epoch` lacks among the last RECENT_STEPS steps;
    `skips`: (the step it moved to, how many steps it moved over without their updates), one per skip.
    A skip further back no longer counts: the replica has applied the steps since, as its peers did."""
    return sum(count for at, count in skips if epoch - at < RECENT_STEPS)


def follows_on_mismatch(ours: Line, theirs: Line) -> bool:
    """Whether the replica on line `ours` resyncs from the one on `theirs`, their parameters differing at
    the same step. One whose state skipped more of the recent steps (it adopted the other stages' step
    without this stage's updates: its stage peers were frozen or cut off, `behind_other_stages`; or it
    was restored from an older checkpoint) follows. Netbed chaos, seed 0, when this was a flag that
    stayed set: a replica that had skipped 1 step 33 steps before, and applied every step since, threw
    its state away for that of a replica restored from the checkpoint 14 steps older, which carried no
    flag; the stage lost those 14 updates and the final loss rose from 2.21 (step 400) to 2.39 (420).
    Then the one that trained fewer samples of its own in the recent steps follows: it was the follower
    of the stage's exchanges (a replica that receives the members' means but served no micro-batch), the
    other the one that computed the gradients; netbed chaos, seed 2: settled by id, the replica that had
    computed every gradient of 50 steps threw its state away for a follower's, and the loss after the
    whole-swarm restart was 5% worse. Last, the larger id follows. Both replicas read the same numbers
    (each pinned to the fingerprint's step), so exactly one of them follows; with a peer that does not
    publish its own samples (an earlier version) both go by id, as before. By id alone, a replica that
    wakes from a freeze, adopts the swarm's step and has the smaller id would make its peer, which applied
    the steps it missed, throw them away (bench/chaos.py --netbed, docs/LOG.md)."""
    if ours.skipped != theirs.skipped:
        return ours.skipped > theirs.skipped
    if (
        ours.own_samples is not None
        and theirs.own_samples is not None
        and ours.own_samples != theirs.own_samples
    ):
        return ours.own_samples < theirs.own_samples
    return ours.peer_id > theirs.peer_id


def swarm_restarting(other_stage_records: Iterable[dict], swarm_step: int, checkpoint_step: int) -> bool:
    """The swarm restarts from its checkpoints: a replica of another stage at the swarm's step was
    restored there and has not stepped since (its progress record among `other_stage_records`), and this
    replica's checkpoint is at that step (or past it). No step has been trained since, so a replica of
    this stage that the records miss would hold that step's state, the checkpoint's: waiting for it could
    change no start's step (one past the other stages is caught up to as any replica behind its stage
    is). A swarm that trains on (the other stages stepped since their start) gets the wait as before,
    checkpoint or not."""
    if checkpoint_step < swarm_step or swarm_step <= 0:
        return False
    return any(
        value.get("epoch") == swarm_step and value.get("restored") is True for value in other_stage_records
    )
