"""What a stage replica does when it falls behind its stage: the lag rule, a pure function.

A replica learns that its stage went on without it from five sources: the stage's progress records in
the DHT (refreshed every heartbeat, but they lapse while the swarm is partitioned and still list a peer
that froze), a trainer's close of a step past its close window (`SwarmAhead`, kept by
runtime/server/step_inbox.py), a close of its own step that it has not been able to act on for the lag
grace (`Stuck`: the members' gradients went to it while it was downloading or cut off), a trainer's
request that has waited the lag grace for parameters past its epoch (`held_since_s`: the closes of its
step went to its peers while it was far behind, and none will come), and its stage peers' answers to a
ping asking their epochs. From these
and its own state `decide_catch_up` chooses one action: replay the missed steps from a peer's mean
gradients, resync (download the state), adopt the other stages' step (planner/restore.py's
`behind_other_stages` then says when), or wait. It may first ask for what it needs (`ASK`: ping the
stage peers; `READ`: read the progress records), so a tick does no more I/O than its decision needs.

The catch-up part (runtime/server/stage_catch_up.py) gathers the view, asks, and acts on the decision
on the sync thread; the unit tests call these functions directly (tests/unit/test_catch_up.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# closes and gradient sums this far past a replica's epoch are kept; a peer further ahead is caught up
# with at once, without the lag grace
KEEP_STEPS_AHEAD = 4
# a replica further behind downloads the state instead of replaying (replicas keep at most this many
# steps' means, runtime/server/stage_steps.py)
MAX_REPLAY_STEPS = 64

ASK = "ask"  # ping the stage peers for their epochs, then decide again
READ = "read"  # read the stage's progress records, then decide again
REPLAY = "replay"  # apply steps epoch..end-1 from `donor`'s mean gradients; resync when that fails
RESYNC = "resync"  # stop serving and download the stage state
ADOPT = (
    "adopt"  # no replica of the stage is ahead: adopt the other stages' step once behind_other_stages says so
)
WAIT = "wait"  # nothing to do (and not behind the other stages either)


@dataclass(frozen=True)
class Heard:
    """A trainer's close of `step`, past the replica's close window when it came at `heard_s`
    (monotonic seconds)."""

    step: int
    heard_s: float


@dataclass(frozen=True)
class SwarmAhead:
    """What trainers' closes told a replica of how far its stage went."""

    newest_step: int = -1  # the highest step any close named, kept or not (`trails_stage`)
    latest: Heard | None = None  # the last close past the close window, from any sender
    # the highest step of those whose sender's closes were found true here, heard when the last of them
    # came: retried closes of many steps reach a woken replica at once, in no order, and the last of them
    # says less than the highest (netbed chaos, seed 0: the close of the replica's step was not the last)
    trusted: Heard | None = None
    vouched_step: int = -1  # the highest step a vouched sender's close named, kept or not

    def heard(self, step: int, now_s: float, far: bool, trusted: bool) -> SwarmAhead:
        """After a close of `step` came: `far` when past the close window, `trusted` when its sender
        is vouched for (planner/step_decision.py's `vouched_senders`)."""
        newest = max(self.newest_step, step)
        vouched = max(self.vouched_step, step) if trusted else self.vouched_step
        if not far:
            return SwarmAhead(newest, self.latest, self.trusted, vouched)
        kept = self.trusted
        if trusted:
            kept = Heard(step if kept is None else max(step, kept.step), now_s)
        return SwarmAhead(newest, Heard(step, now_s), kept, vouched)


@dataclass(frozen=True)
class Stuck:
    """The step a replica is at has had a close from a vouched trainer (`StepInbox.trusted`) since
    `since_s` (or since the replica reached the step, if later), the last of them at `last_s`, naming
    `members` (the other replicas that accumulated its samples), and the replica has not applied it.
    Only vouched closes count: a stranger's close of the replica's step makes it do nothing new."""

    since_s: float
    last_s: float
    members: frozenset[str]


@dataclass(frozen=True)
class LagRule:
    """The run's settings the lag rule reads."""

    lag_grace_s: float = 3.0  # a peer ahead this long is a lag, not an exchange finishing ms apart
    evidence_ttl_s: float = 120.0  # a close older than this shows nothing (`evidence_ttl_s`)
    window: int = KEEP_STEPS_AHEAD  # the close window: 1 + max_staleness, at least KEEP_STEPS_AHEAD
    keep_ahead: int = KEEP_STEPS_AHEAD
    max_replay: int = MAX_REPLAY_STEPS
    # how long the step loop waits for a trainer's close that has not come (the run's request timeout):
    # a stuck close is given up with the samples the replica holds of its step only after this long
    close_timeout_s: float = 10.0


@dataclass(frozen=True)
class LagView:
    """What a replica knows at one sync tick."""

    epoch: int  # the next step it applies
    own_samples: int  # samples accumulated and not yet applied (a replay needs none)
    now_s: float
    ahead: SwarmAhead = SwarmAhead()
    asked: Mapping[str, int | None] | None = (
        None  # stage peers' pinged epochs (None: silent); None: not asked
    )
    recorded: Mapping[str, int] | None = None  # stage peers' epochs in the progress records; None: not read
    behind_since_s: float | None = None  # since when the records have shown a peer ahead
    # the peers it follows that had other parameters at the same step (with `recorded`); empty: none
    diverged: frozenset[str] = frozenset()
    fresh_state: bool = False  # restored from a checkpoint, or initial weights, with no step since
    epoch_since_s: float = float("-inf")  # since when it has been at `epoch`
    stuck: Stuck | None = None  # its step has a close it has not applied
    held_since_s: float | None = None  # a training request has waited for a later epoch since then
    next_held: int | None = None  # the lowest step past `epoch` it holds samples or a close of
    ask_failed: bool = False  # the pings could not be sent this tick: nothing that needs them happens


@dataclass(frozen=True)
class CatchUp:
    """The lag rule's decision."""

    action: str  # ASK, READ, REPLAY, RESYNC, ADOPT or WAIT
    reason: str = ""  # RESYNC's, and REPLAY's when the replay fails
    donor: str = ""  # REPLAY: the peer whose mean gradients it applies
    end: int = 0  # REPLAY: steps epoch..end-1; ADOPT with `abandon_close`: adopt at least this step
    grace_s: float | None = None  # ADOPT: how long behind before adopting (None: a request timeout)
    behind_since_s: float | None = None  # the lag clock from now on
    # ADOPT: even while its own step has a close or samples (nobody reachable can finish the step)
    abandon_close: bool = False


def evidence_ttl_s(request_timeout_s: float, averaging_timeout_s: float) -> float:
    """How long a close past the window shows the stage ahead (`LagRule.evidence_ttl_s`). A stage that
    runs ahead closes a step here every step, and one step takes at most about a request timeout (its
    last micro-batch given up by the trainer) plus an exchange (the averaging timeout); two such steps
    with no close mean the stage stopped closing here (its records in the DHT then tell where it is) or
    the close was forged, which must not keep the replica pinging its peers for good. Far longer than
    the lag grace, so a replica left behind still adopts the other stages' step while the peers that
    ran it are frozen."""
    return 2.0 * (request_timeout_s + averaging_timeout_s)


def trails_stage(step: int, epoch: int, newest_close: int, window: int) -> bool:
    """Should a replica at `epoch` refuse a training request of `step` at once (the caller tries another
    replica) instead of holding it until its parameters reach the step? Yes when both lie more than
    `window` steps past its epoch: a trainer closed `newest_close` here, so another replica of the stage
    ran that step and this one trails it by more than an honest close can (`close_refusal`); it serves
    again once it replayed or downloaded what it missed. A replica whose whole stage is behind (restored
    from an older checkpoint) hears no such close and keeps holding requests until it adopts the other
    stages' step. A forged close alone refuses nothing: an honest request that far ahead means the
    replica does trail the swarm, which is also why this close never expires. A replica 38 steps behind
    that held its requests kept them from the stage's step while it replayed."""
    return step > epoch + window and newest_close > epoch + window


def left_behind(ahead: SwarmAhead, epoch: int, now_s: float, rule: LagRule) -> bool:
    """A close past the window came within `rule.evidence_ttl_s`: another replica ran steps this one
    has not, and it asks its stage peers how far they are. The last such close, or the highest vouched
    one: retried closes reach a woken replica in no order, and the last of them may lie within its
    window (netbed chaos, seed 0: a replica woke 41 steps behind and asked nobody for 3 s, while the
    one peer that had run the steps froze)."""
    return _shows_ahead(ahead.latest, epoch, now_s, rule) or _shows_ahead(ahead.trusted, epoch, now_s, rule)


def stuck_on_close(view: LagView, rule: LagRule) -> bool:
    """The replica's step has had a close it could not act on for the lag grace: the members' gradients
    (or the trainer's data) never reached it. A step closes within milliseconds on a LAN and within an
    exchange on a slow link, and a member that is slow but alive still answers a ping, so asking costs
    little and only a peer that already applied the step, or the silence of every replica that holds
    it, acts. Like a close past the window, the evidence expires (`evidence_ttl_s` after the last close
    of the step)."""
    stuck = view.stuck
    return (
        stuck is not None
        and view.now_s - stuck.since_s >= rule.lag_grace_s
        and view.now_s - stuck.last_s <= rule.evidence_ttl_s
    )


def held_back(view: LagView, rule: LagRule) -> bool:
    """A trainer's request has waited the lag grace for parameters this replica has not reached: the
    trainer closed the steps between, so a peer may have applied them (the closes went there while this
    replica was far behind or cut off, and nothing sends them again). A step takes milliseconds on a LAN
    and an exchange on a slow link, so a false alarm costs one ping round; only a peer that answers
    ahead acts on it: a stranger's request of a step just ahead makes the replica ask, and replay steps
    that a peer did apply (runtime/server/stage_catch_up.py counts only training requests within the
    close window)."""
    return view.held_since_s is not None and view.now_s - view.held_since_s >= rule.lag_grace_s


def _shows_ahead(close: Heard | None, epoch: int, now_s: float, rule: LagRule) -> bool:
    return (
        close is not None
        and close.step > epoch + rule.window
        and now_s - close.heard_s <= rule.evidence_ttl_s
    )


def decide_catch_up(view: LagView, rule: LagRule) -> CatchUp:
    """What a replica does at a sync tick, in order:
    1. Left behind (`left_behind`: a fresh close past the window), stuck on a vouched close of its
       own step (`stuck_on_close`), or holding a request back for the lag grace (`held_back`), and its
       peers not yet asked: `ASK` (every tick while it lasts).
    2. Asked: a peer that answers more than `keep_ahead` steps ahead is caught up with at once (replay
       from the furthest, else resync). Stuck, holding no samples of the step, with a peer that answers
       ahead: that peer applied the step, so it is replayed from its mean gradients (the members' sums
       went to this replica while it downloaded its state or was cut off, and nobody sends them again);
       the same when held back (the step's closes went to the peer alone).
       Stuck, with every replica its close names silent or gone (`_holders_silent`): nobody can finish
       the step, and it adopts the other stages' step, or if they are not that far the step after the
       highest a vouched trainer closed here (`_give_up_step`: at most a close window past its own with a
       peer that answers, `max_replay` with none, never past a later step it holds samples or a close of), although its step has a close
       (`abandon_close`), and, once `close_timeout_s` has passed since the close came, although it
       holds samples of the step (lost with it); this comes before the next rules, which keep a step
       with a close. Every peer silent (or none left), no samples and no kept close of its step, and a
       vouched close of its step or a later one heard while it was far behind (`_closed_elsewhere`):
       the same adoption. Left behind, with no peer that answers ahead and some silent, on a fresh
       close from a vouched sender (`SwarmAhead.trusted`): those that ran the steps are frozen or cut
       off, and it adopts the other stages' step after the lag grace instead of a request timeout
       (the frozen peer wins a fingerprint mismatch when it wakes, planner/restore.follows_on_mismatch).
       A stranger's close far ahead makes the replica ask,
       never by itself leave its step (every peer that answers is believed; a forger cannot silence an
       honest one); a stranger's close of its own step does nothing. Otherwise the records decide.
    3. The records not read yet: `READ`. They show no peer, and the replica has not stepped for the lag
       grace: `ASK`, and the answers stand in for the records below (netbed chaos, seed 1: a replica cut
       off until the trainers had left stayed a step behind its peer to the end, every DHT read timing
       out and nothing else telling it).
    4. A peer in the records ahead for the lag grace, or more than `keep_ahead` steps ahead at once:
       replay the missed steps from the most advanced peer when the replica holds no samples of its own
       (it was no participant of those steps) and at most `max_replay` are missing, else resync; but,
       on a tick that asked, from no peer that was silent, and when every peer ahead was, wait (step 2
       adopts when a trusted close shows the stage went on; a dead or frozen peer's record lapses).
    5. Parameters diverged from a peer it follows: ask the peers first, and resync only when one it
       diverged from answers at its step or past it (a download from peers that are cut off or frozen
       refuses the trainers for its whole deadline, and this replica may be the stage's only one they
       reach; a peer that answers with the same diverged state is no better a donor).
    6. No peer ahead, and its state fresh or no step for the lag grace: `ADOPT` (the other stages'
       step after a request timeout, planner/restore.behind_other_stages); else `WAIT`."""
    evidence = stuck_on_close(view, rule) or held_back(view, rule)
    if _may_ask(view) and (evidence or left_behind(view.ahead, view.epoch, view.now_s, rule)):
        return CatchUp(ASK, behind_since_s=view.behind_since_s)
    if view.asked is not None:
        direct = _asked(view, rule)
        if direct is not None:
            return direct
    if view.recorded is None:
        return CatchUp(READ, behind_since_s=view.behind_since_s)
    if not view.recorded and _may_ask(view) and view.now_s - view.epoch_since_s >= rule.lag_grace_s:
        return CatchUp(ASK, behind_since_s=view.behind_since_s)
    # the records show nobody (lapsed, or the DHT unreachable from here): the peers' answers stand in
    epochs = view.recorded or {peer: e for peer, e in (view.asked or {}).items() if e is not None}
    return _recorded(view, epochs, rule)


def _asked(view: LagView, rule: LagRule) -> CatchUp | None:
    """Step 2 of `decide_catch_up`; None: the records decide."""
    asked, epoch = view.asked or {}, view.epoch
    answered = {peer: e for peer, e in asked.items() if e is not None}
    ahead = max(answered.values(), default=epoch) - epoch
    if ahead > rule.keep_ahead:
        return _replay_or_resync(
            view, answered, rule, f"peers are {ahead} step(s) ahead (we are at {epoch}; asked directly)"
        )
    stuck = view.stuck if stuck_on_close(view, rule) else None
    if stuck is not None and ahead > 0 and view.own_samples == 0:
        reason = f"peers applied step {epoch}, whose close came here {view.now_s - stuck.since_s:.0f} s ago"
        return _replay_or_resync(view, answered, rule, reason)
    if held_back(view, rule) and ahead > 0 and view.own_samples == 0:
        waited_s = view.now_s - (view.held_since_s or view.now_s)
        reason = f"peers applied step {epoch}; a trainer's request has waited {waited_s:.0f} s for it here"
        return _replay_or_resync(view, answered, rule, reason)
    if ahead > 0:
        return None
    # a stuck close whose holders are silent is given up before the far-close adoption is looked at:
    # that one keeps a step with a close, so a replica with both held its step for good (netbed chaos,
    # seed 0: 25 s, until the frozen holder woke)
    if stuck is not None and _holders_silent(stuck.members, asked) and _may_drop_samples(view, stuck, rule):
        return _give_up_step(view, rule, alone=not answered)
    if not answered and _closed_elsewhere(view, rule):
        return _give_up_step(view, rule, alone=True)
    frozen = not answered or len(answered) < len(asked)
    if frozen and _shows_ahead(view.ahead.trusted, epoch, view.now_s, rule):
        return CatchUp(ADOPT, grace_s=rule.lag_grace_s, behind_since_s=view.behind_since_s)
    return None


def _give_up_step(view: LagView, rule: LagRule, alone: bool) -> CatchUp:
    """Adopt past a step nobody reachable can finish: at least the step after the highest a vouched
    trainer closed here (the trainers went on past it; netbed chaos, seed 0: the other stages' records,
    the adoption's other target, were read from a DHT whose stores timed out, and a lone replica gave
    its closes up one step at a time, 6-10 s each). Never past a later step it holds samples or a close
    of (that step can still close here). With a stage peer that answers (`alone` false), at most a close
    window past its own step: that peer may still be closing the steps between. With none, up to
    `max_replay` steps at once: a window cap made a replica woken 41 steps behind adopt three times, 17 s
    (netbed chaos, seed 0). A cap remains because one vouched sender's close sets `vouched_step` (in an
    open run any trainer whose closes were found true; a forged far close from one walks a lone replica
    `max_replay` steps per lag grace while that evidence lasts, instead of a window). The other stages'
    step, when their records are read, may take it further, as before."""
    floor = min(view.ahead.vouched_step + 1, view.epoch + (rule.max_replay if alone else rule.window))
    if view.next_held is not None:
        floor = min(floor, view.next_held)
    return CatchUp(
        ADOPT,
        grace_s=rule.lag_grace_s,
        end=max(view.epoch + 1, floor),
        behind_since_s=view.behind_since_s,
        abandon_close=True,
    )


def _closed_elsewhere(view: LagView, rule: LagRule) -> bool:
    """A vouched trainer closed this replica's step, or a later one, while the replica was further behind
    (a close past the window is heard, not kept: `Stuck` never shows it), no stage peer answers, and the
    replica holds nothing of its step and has no close of it: the replicas that ran the step are frozen or
    cut off, and none can bring this one to it. Netbed chaos, seed 0: a replica woke 50 steps behind, heard
    the close of 663 naming only its peer, which froze 2 s later; it adopted the other stages' 663 and then
    waited the stranded grace at it, the trainers' requests of 664 held, until the other stages reached
    664. The adoption goes past the highest such close (`_give_up_step`), not a step at a time; a step with
    samples or a kept close is the step loop's and the stuck rule's."""
    closed = view.ahead.trusted
    if closed is None or closed.step < view.epoch or view.now_s - closed.heard_s > rule.evidence_ttl_s:
        return False
    return view.own_samples == 0 and view.stuck is None


def _may_drop_samples(view: LagView, stuck: Stuck, rule: LagRule) -> bool:
    """Giving a stuck close up drops the samples the replica holds of its step: only once the step loop
    would have stopped waiting for a trainer's close that has not come (`close_timeout_s` since the
    stuck close came). Sooner, a slow trainer's close, naming this replica, may still bring the step
    to a close here (its requests to the silent holder failed over; netbed chaos, seed 0: a stage-0
    replica holding 8 samples held its step, and the trainers' requests of the next one, for 21 s)."""
    return view.own_samples == 0 or view.now_s - stuck.since_s >= rule.close_timeout_s


def _holders_silent(members: frozenset[str], asked: Mapping[str, int | None]) -> bool:
    """No replica a stuck close names answered: each was asked (it is in the replica's view of the
    stage) and was silent, or it is not in that view at all. A holder that was killed leaves the view
    (its records lapse, and the stage ping that checks a name a close brings fails:
    runtime/server/stage_members.py), and a close naming only peers outside the view is never acted on
    by anyone, so nobody can finish the step either way. Netbed chaos, seed 0: the stage-0 replica that
    held a step's every sample was killed, and its three peers held that step for 85 s."""
    return bool(members) and all(asked.get(member) is None for member in members)


def _recorded(view: LagView, recorded: Mapping[str, int], rule: LagRule) -> CatchUp:
    """Steps 4-6 of `decide_catch_up`."""
    epoch, now_s = view.epoch, view.now_s
    ahead = max(recorded.values(), default=epoch) - epoch
    since_s = None if ahead <= 0 else (now_s if view.behind_since_s is None else view.behind_since_s)
    # a replica that was not a member of a step can trail the members by a step or two while the
    # members' gradients reach it; it catches up from what it was sent
    lagging = since_s is not None and now_s - since_s >= rule.lag_grace_s
    if lagging or ahead > rule.keep_ahead:
        return _replay_or_resync(view, recorded, rule, f"peers are {ahead} step(s) ahead (we are at {epoch})")
    if view.diverged:
        if _may_ask(view):
            return CatchUp(ASK, behind_since_s=since_s)
        if _donor_answers(view):
            return CatchUp(RESYNC, "parameters diverged from a peer after a partial exchange")
    # the other stages are not read on every tick of a replica stepping with the swarm (several steps a
    # second on `tiny`), only once it has not stepped for a while
    if ahead <= 0 and (view.fresh_state or now_s - view.epoch_since_s >= rule.lag_grace_s):
        return CatchUp(ADOPT)
    return CatchUp(WAIT, behind_since_s=since_s)


def _may_ask(view: LagView) -> bool:
    return view.asked is None and not view.ask_failed


def _donor_answers(view: LagView) -> bool:
    """A peer this replica diverged from answered the ping at its step or past it: a download can start."""
    asked = view.asked or {}
    return any((e := asked.get(peer)) is not None and e >= view.epoch for peer in view.diverged)


def _replay_or_resync(view: LagView, epochs: Mapping[str, int], rule: LagRule, reason: str) -> CatchUp:
    """A replica holding no samples of its own (it was no participant of the missed steps) applies them
    from a peer's mean gradients: the same state as its peers, for one mean per step instead of a whole
    state download. Either way the lag clock restarts. A peer silent when asked is no donor, whatever its
    record says (a frozen peer's record lives on for its time-to-live): a replay from it ends at its
    first unanswered ping, a download from it at the download's deadline, every tick; with only such
    peers ahead the replica waits, its lag clock running."""
    silent = {peer for peer, e in (view.asked or {}).items() if e is None}
    epochs = {peer: e for peer, e in epochs.items() if peer not in silent and e > view.epoch}
    if not epochs:
        return CatchUp(
            WAIT, behind_since_s=view.behind_since_s if view.behind_since_s is not None else view.now_s
        )
    donor = max(epochs, key=lambda peer: epochs[peer])
    end = epochs[donor]
    if end - view.epoch <= rule.max_replay and view.own_samples == 0:
        return CatchUp(REPLAY, reason, donor, end)
    return CatchUp(RESYNC, reason)
