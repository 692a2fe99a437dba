"""Which trainer's `close` a stage replica acts on, and which it applies: pure decisions.

In an open run (no run key) anyone can send a replica a `close` or `grads`, so neither is trusted on its
own: every close is kept as a candidate and checked against what the replica itself knows (its epoch,
the samples it accumulated, the stage's live replicas, the gradients its peers sent). A close speaks
only for its sender's own samples: a replica records, per step, whose micro-batches it accumulated (the
authenticated trainer, or the trainer a stage server that handed one off names: `origin`), and a close
decides by this replica's own count only when each of its closes names it with exactly what that
sender's micro-batches put here (`backed_by_origin`). A stranger who reads a replica's public count
cannot make that evidence alone: it would have to be the peer whose micro-batches the replica ran. The
step coordinator (runtime/server/stage_steps.py) calls these on its event loop; the unit tests call them
directly (tests/unit/test_step_validation.py).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

MAX_COMBINATIONS = 1024  # sets of closes (at most one per shard) a decision looks at
UNKNOWN_ORIGIN = ""  # whose micro-batches these samples are is not known: any close may claim them


@dataclass(frozen=True)
class Close:
    """One trainer's close of a step, as this replica received it."""

    sender: str  # the authenticated peer id it came from ("" in tests that do not say)
    shard: int
    shards: int
    members: Mapping[str, int]  # peer -> samples the trainer saw it accumulate (> 0 only)
    participants: frozenset[str]
    arrived_s: float


@dataclass(frozen=True)
class StepDecision:
    """A candidate for a step: the closes of a set of trainers (at most one per shard) merged, whose
    members are all live replicas of the stage."""

    members: Mapping[str, int]  # peer -> samples it must contribute
    participants: frozenset[str]  # live peers to send our sums to (never this replica)
    closes: int  # how many trainers' closes it merges
    complete: bool  # every trainer closed the step (else it became due at the close timeout)
    first_s: float  # when its first close arrived
    due_s: float  # when it can be acted on: complete, or the close timeout after its first close
    lenient: bool = False  # no candidate passed the checks in time: acted on as before them
    held: bool = (
        False  # no trainer's close: the samples held, the other stages gone on (planner/held_step.py)
    )
    senders: frozenset[str] = frozenset()  # who sent the closes it merges
    naming: frozenset[str] = frozenset()  # those of them whose close names a member
    # sender -> the samples its close names this replica with (only senders that name it)
    claims: Mapping[str, int] = dataclasses.field(default_factory=dict)


def close_refusal(step: int, epoch: int, window: int) -> str | None:
    """Why a close of `step` arriving at a replica at `epoch` is not kept (None: kept). `window`: how
    many steps past its epoch a replica keeps closes of: an honest trainer closes a step at a stage once
    its micro-batches are done there, which needs the parameters of step - max_staleness on the replica
    that ran them, so at most 1 + max_staleness steps past a replica still exchanging the step before.
    A kept close is acted on only at its own step, so none makes a replica skip one. A close naming a
    peer that is not a live replica of the stage is kept but never acted on while that peer is unknown
    (`unknown_members`): the DHT view may lag a joining replica by a refresh."""
    if step < epoch:
        return f"step {step} is already applied here (at {epoch})"
    if step > epoch + window:
        return f"step {step} is more than {window} step(s) past this replica's next step {epoch}"
    return None


def unknown_members(members: Iterable[str], peer_id: str, live: AbstractSet[str] | None) -> list[str]:
    """Members that are neither this replica nor a live replica of its stage (none when `live` is unknown)."""
    if live is None:
        return []
    return sorted(p for p in members if p != peer_id and p not in live)


def step_candidates(
    closes: Iterable[Close], peer_id: str, live: AbstractSet[str] | None, close_timeout_s: float
) -> list[StepDecision]:
    """Every set of at most one close per shard (several closes of one shard: a trainer's and forged
    ones), merged, whose members are all live replicas of the stage (or this replica)."""
    out = []
    for combo in _combinations(closes):
        members: dict[str, int] = {}
        for close in combo:
            for peer, samples in close.members.items():
                members[peer] = members.get(peer, 0) + samples
        if unknown_members(members, peer_id, live):
            continue
        shards = max(c.shards for c in combo)
        complete = {c.shard for c in combo} >= set(range(shards))
        first_s = min(c.arrived_s for c in combo)
        due_s = max(c.arrived_s for c in combo) if complete else first_s + close_timeout_s
        participants = frozenset().union(*(c.participants for c in combo)) | set(members)
        if live is not None:
            participants = frozenset(p for p in participants if p in live or p in members)
        senders = frozenset(c.sender for c in combo)
        naming = frozenset(c.sender for c in combo if c.members)
        claims = {c.sender: c.members[peer_id] for c in combo if peer_id in c.members}
        candidate = StepDecision(members, participants - {peer_id}, len(combo), complete, first_s, due_s)
        out.append(dataclasses.replace(candidate, senders=senders, naming=naming, claims=claims))
    return out


def decide_step(
    candidates: Iterable[StepDecision],
    peer_id: str,
    own_samples: int,
    received: Mapping[str, int],
    now_s: float,
    close_timeout_s: float,
    confirm: bool = True,
    reached_s: float = float("-inf"),
    short_grace_s: float | None = None,
    heard_peers: bool = False,
    held_s: float | None = None,
    trusted: AbstractSet[str] | None = None,
    by_origin: Mapping[str, int] | None = None,
) -> StepDecision | None:
    """Whether this replica closes its step now (seals its sums and sends them): the candidate it starts
    with, or None (wait). `own_samples`: what it accumulated for the step, `by_origin` the same by whose
    micro-batches they were (None: not checked); `received`: the sample counts of the `grads` it holds
    for the step, by sender. A due candidate is acted on when
        - it names this replica with exactly `own_samples`, each of its closes for exactly its sender's
          samples here (`backed_by_origin`: a stranger's close of a plausible count decides nothing), or
        - another member's gradients arrived with exactly the samples it attributes to that member
          (the exchange confirms it; a replica whose own count differs then leaves its samples out, so
          only when one of its closes is from a trainer whose samples it holds), or
        - `confirm` is False (local steps: nothing is exchanged to confirm with), it names this replica
          with nothing and this replica holds nothing, or
        - it is short or empty and waited a grace (`_graced`).
    A replica the candidate does not name, or a candidate naming nobody, thus needs a confirmation: a
    forged close does not make a replica close its step before the trainer's data is there. When no
    candidate passes for `close_timeout_s` after one became due, this replica reached the step and (if it
    holds any) first held samples of it (a close sent long before starts no clock), the best one is
    returned `lenient`: a stage must not stall when a trainer died mid-step or every micro-batch of a
    step failed. For a candidate naming members, the fallback needs honest activity in the step: samples
    of its own, or gradients from a live replica (`heard_peers`); a replica holding nothing that hears
    nobody would otherwise step on members it cannot verify (forged closes to an idle open swarm would
    move one replica's epoch and leave the stage disagreeing: tests/faults/test_forged_steps.py). When a
    trainer died mid-step, the replicas that hold its samples act on the fallback and send their sums,
    which the others then hear. A candidate naming nobody keeps the fallback."""
    best: tuple[tuple, StepDecision] | None = None
    fallback: tuple[tuple, StepDecision] | None = None
    for candidate in candidates:
        if now_s < candidate.due_s:
            continue
        score, _, _ = _evidence(candidate, peer_id, own_samples, received, frozenset(), by_origin)
        consistent, backed, mine = score[0], score[1], candidate.members.get(peer_id, 0)
        confirmed = any(p != peer_id and received.get(p) == n for p, n in candidate.members.items())
        confirmed = confirmed and (own_samples == 0 or _served(candidate.senders, by_origin, any))
        since_s = now_s - max(candidate.due_s, reached_s, float("-inf") if held_s is None else held_s)
        graced = short_grace_s is not None and since_s >= short_grace_s
        own_count = consistent and (backed if mine > 0 else not confirm)
        short_or_empty = _graced(candidate, peer_id, own_samples, graced, reached_s, trusted, by_origin)
        if own_count or confirmed or short_or_empty:
            if best is None or score > best[0]:
                best = (score, candidate)
        elif since_s >= close_timeout_s and (own_samples > 0 or heard_peers or not candidate.members):
            if fallback is None or score > fallback[0]:
                fallback = (score, dataclasses.replace(candidate, lenient=True))
    if best is not None:
        return best[1]
    return None if fallback is None else fallback[1]


def _graced(
    candidate: StepDecision,
    peer_id: str,
    own_samples: int,
    graced: bool,
    reached_s: float,
    trusted: AbstractSet[str] | None,
    by_origin: Mapping[str, int] | None,
) -> bool:
    """Whether a due candidate that is short or empty decides once `graced` (`decide_step`'s
    `short_grace_s` passed). Short: it names this replica with fewer samples than it holds (a trainer
    that missed the reply of a micro-batch accumulated here); acted on when no better one came meanwhile
    (every replica then counts this one's real samples), only when all its closes come from `trusted`
    senders (None: not checked; why: `vouched_senders`) and each that names this replica is a trainer
    whose micro-batches it holds (`by_origin`). The grace counts from the first samples because a
    trainer's close comes after its micro-batches: a forger's short close kept while the swarm was idle
    would otherwise decide the step at the next trainer's first micro-batch. Empty: it names nobody,
    this replica holds nothing and the candidate came after it reached the step (all of a trainer's
    micro-batches failed at this stage; a forger's empty close for a later step comes before)."""
    if not graced:
        return False
    mine = candidate.members.get(peer_id, 0)
    if 0 < mine < own_samples:
        return (trusted is None or candidate.senders <= trusted) and _served(candidate.claims, by_origin)
    return not candidate.members and own_samples == 0 and candidate.first_s >= reached_s


def backed_by_origin(claims: Mapping[str, int], by_origin: Mapping[str, int] | None) -> bool:
    """Whether the closes of a candidate (`claims`: sender -> the samples its close names this replica
    with) speak each for its own sender's micro-batches: every sender's claim is what its micro-batches
    put here (`by_origin`: origin -> samples; None: not checked), plus at most the samples of unknown
    origin (`UNKNOWN_ORIGIN`, claimable by anyone as before this check), and the claims cover all the
    replica holds. A close counts toward this replica's own count only with evidence its sender cannot
    make without being the peer whose micro-batches the replica ran; a stranger's close, whatever its
    count, claims samples some trainer put here and is not backed."""
    if by_origin is None:
        return True
    unknown, excess = by_origin.get(UNKNOWN_ORIGIN, 0), 0
    for sender, samples in claims.items():
        served = 0 if sender == UNKNOWN_ORIGIN else by_origin.get(sender, 0)
        if samples < served:
            return False
        excess += samples - served
    return excess <= unknown and sum(claims.values()) == sum(by_origin.values())


def _served(
    senders: Iterable[str], by_origin: Mapping[str, int] | None, every: Callable[[Iterable[bool]], bool] = all
) -> bool:
    """Whether every one of `senders` (`every=any`: one) is a peer whose micro-batches this replica holds
    (or it holds samples of unknown origin, which anyone may claim). A replica holding samples acts on a
    close not naming it, confirmed by a peer's gradients, only when a trainer of its samples sent one of
    its closes: a stranger's copy of another member's count would make it leave its samples out before
    the trainer's close came, while its peers counted them."""
    if by_origin is None or by_origin.get(UNKNOWN_ORIGIN, 0) > 0:
        return True
    return every(by_origin.get(sender, 0) > 0 for sender in senders)


def vouched_senders(
    decision: StepDecision,
    peer_id: str,
    own_samples: int,
    received: Mapping[str, int],
    by_origin: Mapping[str, int] | None = None,
) -> frozenset[str]:
    """Whose closes a replica trusts after applying `decision` (`decide_step`'s `trusted`: only theirs
    may decide a step short of its samples): the senders of its closes that name a member, when data
    bore it out: it names this replica with exactly the samples it held, each close for its own
    sender's micro-batches (`backed_by_origin`), or a member's gradients came with exactly the samples
    it names. Nobody after a lenient decision or one no data confirmed (a short or empty close), and not
    the sender of an empty close merged into it (nothing to check). Time alone does not tell a forger's
    short close from a trainer's: the trainer's close can come later than any grace (a slow replica
    holding the step's last micro-batch, a loaded host), and a forged close naming only this replica
    then made it apply its own sums without the other members', which applied the trainer's."""
    if decision.lenient:
        return frozenset()
    members = decision.members
    mine = members.get(peer_id, 0)
    confirmed = any(p != peer_id and received.get(p) == n for p, n in members.items())
    backed = mine == own_samples and backed_by_origin(decision.claims, by_origin)
    return decision.naming if (mine > 0 and backed) or confirmed else frozenset()


def short_close_grace_s(usual_wait_s: float | None, floor_s: float, close_timeout_s: float) -> float:
    """How long a close naming this replica short of its samples, or naming nobody, waits for a better
    one (`decide_step`'s `short_grace_s`): twice the usual wait from reaching a step to its close (the
    trainer's close normally comes within one), at least `floor_s`. A forger's short close sent early
    thus loses to the trainer's, while a trainer's own short close costs a second or two, not the
    lenient fallback. At most half of `close_timeout_s`: one step whose close came late (a trainer that
    reached this replica only through a relay reserved seconds later) would otherwise make the grace
    longer than the fallback for good, since a lenient decision does not update the usual wait, and
    every later empty or short close would cost the whole fallback (tests/integration/test_nat.py)."""
    usual_s = 0.0 if usual_wait_s is None else 2.0 * usual_wait_s
    return max(floor_s, min(usual_s, close_timeout_s / 2))


def settle_step(
    candidates: Iterable[StepDecision],
    peer_id: str,
    own_samples: int,
    received: Mapping[str, int],
    unreachable: AbstractSet[str],
    timed_out: bool = False,
    by_origin: Mapping[str, int] | None = None,
) -> StepDecision | None:
    """The candidate a replica applies once it has closed its step (its sums sealed: `own_samples`), or
    None (wait for more gradients). The exchange decides: a candidate scores by whether it agrees with
    this replica's own count (claimed only by senders whose micro-batches it holds), then by whether each
    of its closes names exactly its sender's samples here (`by_origin`), then by how many of its members the gradients confirm (the same count),
    then by how few it names wrongly (another count, or unreachable), then complete, then the most
    closes, then the earliest. The best candidate all of whose members answered is applied once no
    candidate still waiting for gradients could beat it; at `timed_out`, the best as it stands. In an
    honest step there is one candidate, applied when its members' sums are in, as before these checks."""
    candidates = list(candidates)
    if timed_out:  # a member not heard from by now counts as gone
        unreachable = frozenset().union(*(c.members for c in candidates))
    rated = [(_evidence(c, peer_id, own_samples, received, unreachable, by_origin), c) for c in candidates]
    if not rated:
        return None
    if timed_out:
        return max(rated, key=lambda r: r[0][0])[1]
    answered = [(evidence[0], c) for evidence, c in rated if evidence[2] == 0]
    if not answered:
        return None
    best_score, best = max(answered, key=lambda r: r[0])
    if any(unanswered and potential > best_score for (_, potential, unanswered), _ in rated):
        return None
    return best


def _evidence(
    candidate: StepDecision,
    peer_id: str,
    own_samples: int,
    received: Mapping[str, int],
    unreachable: AbstractSet[str],
    by_origin: Mapping[str, int] | None,
) -> tuple[tuple, tuple, int]:
    """(score as the gradients stand, score if every member not heard from confirms, members not heard
    from) of a candidate (see `settle_step`)."""
    members = candidate.members
    consistent = members.get(peer_id, 0) == own_samples and _served(candidate.claims, by_origin)
    backed = consistent and backed_by_origin(candidate.claims, by_origin)
    confirmed = (peer_id in members and consistent) + sum(
        1 for p, n in members.items() if p != peer_id and received.get(p) == n
    )
    unanswered = sum(1 for p in members if p != peer_id and p not in received and p not in unreachable)
    wrong = len(members) - confirmed - unanswered
    rest = (candidate.complete, candidate.closes, -candidate.first_s)
    return (
        (consistent, backed, confirmed, -wrong, *rest),
        (consistent, backed, confirmed + unanswered, -wrong, *rest),
        unanswered,
    )


def _combinations(closes: Iterable[Close]) -> Iterator[list[Close]]:
    """Every non-empty set of at most one close per shard, in a fixed order, at most MAX_COMBINATIONS."""
    by_shard: dict[int, list[Close | None]] = {}
    for close in sorted(closes, key=lambda c: (c.arrived_s, c.sender)):
        by_shard.setdefault(close.shard, []).append(close)
    choices = [[*by_shard[shard], None] for shard in sorted(by_shard)]
    for picked in itertools.islice(itertools.product(*choices), MAX_COMBINATIONS):
        combo = [c for c in picked if c is not None]
        if combo:
            yield combo


@dataclass(frozen=True)
class Contributions:
    """Whose gradient sums a replica adds for the close it applies (`step_contributions`)."""

    own: bool  # this replica's own sums
    peers: tuple[str, ...]  # peers whose received sums count, sorted (every replica adds in one order)
    ignored: tuple[str, ...]  # peers that sent sums of fewer samples than the close names: left out
    missing: tuple[str, ...]  # members whose sums do not count: the exchange is partial when any


def step_contributions(
    decision: StepDecision, peer_id: str, own: int, received: Mapping[str, int]
) -> Contributions:
    """The sums a replica adds to apply `decision`, holding `own` samples and having received sums of
    `received[peer]` samples from its stage peers. A member's sums count when they hold at least the
    samples the close names for it, and this replica's own when the close names it with at most what
    it holds (a trainer that missed the reply of a micro-batch accumulated here counts fewer): then
    every replica sums the same set. A lenient decision (acted on as before the checks) counts every
    named member with whatever it sent, and our own sums whenever the close names us."""
    members = decision.members
    mine = members.get(peer_id, 0)
    own_counts = own > 0 and mine > 0 and (decision.lenient or own >= mine)
    heard = sorted((set(members) - {peer_id}) & set(received))
    peers = tuple(p for p in heard if decision.lenient or received[p] >= members[p])
    ignored = tuple(p for p in heard if p not in peers)
    counted = set(peers) | ({peer_id} if own_counts else set())
    return Contributions(own_counts, peers, ignored, tuple(sorted(set(members) - counted)))
