"""Where did each micro-batch's gradient go? Per-stage accounting from server and trainer ledgers.

For one stage, every micro-batch the trainer completed must be exactly one of:
- applied: in a step that a surviving replica applied (its own contribution, or a dead replica's
  contribution to a step the survivor applied with it), or in a step a dead (or stopped) replica
  applied before a survivor downloaded or restored from a checkpoint a stage state past that step
  (the state holds it);
- pending: accumulated on a survivor, waiting for its step;
- lost with a dead peer: accumulated only on a replica that was killed, before any step
  that a survivor applied with it;
- lost to a resync: dropped by a replica that had to download the stage state, and not applied or
  pending anywhere else (a retry of the same micro-batch on another replica counts there);
- not accumulated: retried with `accumulate=False` after a replica went silent (runtime/trainer/stage_calls.py),
  or arrived after its step was over (`late`), and no replica accumulated it.
A micro-batch accumulated twice on one server (at-most-once violated) or applied in two
steps is reported in `double_applied`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class StageAccount:
    stage: int
    completed: int
    applied: set[str] = field(default_factory=set)
    pending: set[str] = field(default_factory=set)
    lost_with_dead: set[str] = field(default_factory=set)
    lost_to_resync: set[str] = field(default_factory=set)
    not_accumulated: set[str] = field(default_factory=set)
    double_applied: list[str] = field(default_factory=list)
    unaccounted: set[str] = field(default_factory=set)
    samples_lost_with_dead: int = 0

    @property
    def balanced(self) -> bool:
        parts = [self.applied, self.pending, self.lost_with_dead, self.lost_to_resync, self.not_accumulated]
        disjoint = sum(map(len, parts)) == len(set().union(*parts))
        return disjoint and not self.unaccounted and not self.double_applied

    def summary(self) -> dict:
        return {
            "stage": self.stage,
            "completed": self.completed,
            "applied": len(self.applied),
            "pending": len(self.pending),
            "lost_with_dead": len(self.lost_with_dead),
            "lost_to_resync": len(self.lost_to_resync),
            "not_accumulated": len(self.not_accumulated),
            "double_applied": len(self.double_applied),
            "unaccounted": len(self.unaccounted),
            "samples_lost_with_dead": self.samples_lost_with_dead,
            "balanced": self.balanced,
        }


def account_stage(
    stage: int, ledgers: dict[str, list[dict]], dead: set[str], completed: set[str]
) -> StageAccount:
    """`ledgers`: server name -> events (all servers of this stage); `dead`: names of killed servers."""
    account = StageAccount(stage, len(completed))
    peer_of = {
        name: next((e["peer"] for e in events if e["e"] == "start"), name) for name, events in ledgers.items()
    }
    accumulated: dict[str, list[str]] = {}
    dropped: dict[str, set[str]] = {}  # what each server threw away when it resynced
    skipped: set[str] = set()  # retries answered without accumulating
    sizes: dict[str, int] = {}
    rounds: dict[str, list[dict]] = {}
    for name, events in ledgers.items():
        accumulated[name] = [e["mb"] for e in events if e["e"] == "acc"]
        sizes.update({e["mb"]: e["n"] for e in events if e["e"] == "acc"})
        rounds[name] = [e for e in events if e["e"] == "step"]
        dropped[name] = {mb for e in events if e["e"] == "lost" for mb in e["mbs"]}
        skipped |= {e["mb"] for e in events if e["e"] in ("noacc", "late")}
        account.double_applied += [mb for mb, count in Counter(accumulated[name]).items() if count > 1]
    survivors = [name for name in ledgers if name not in dead]
    survivor_steps = {(r["step"], peer) for name in survivors for r in rounds[name] for peer in r["group"]}
    # a survivor that downloaded the stage state at epoch E, or restored a checkpoint of step E,
    # holds every step before E
    downloaded = max(
        (
            e["epoch"] if e["e"] == "resync" else e.get("state_step", 0)
            for name in survivors
            for e in ledgers[name]
            if e["e"] in ("resync", "restore")
        ),
        default=0,
    )
    applied_counter: Counter = Counter()
    for name, server_rounds in rounds.items():
        for r in server_rounds:
            if name in survivors or (r["step"], peer_of[name]) in survivor_steps or r["step"] < downloaded:
                applied_counter.update(r["mbs"])
    account.double_applied += [mb for mb, count in applied_counter.items() if count > 1]
    account.applied = set(applied_counter)
    # a micro-batch one replica dropped in a resync may live on elsewhere (the trainer retried it there)
    survivor_acc = {mb for name in survivors for mb in accumulated[name] if mb not in dropped[name]}
    account.pending = survivor_acc - account.applied
    all_dropped = set().union(*dropped.values()) if dropped else set()
    account.lost_to_resync = all_dropped - account.applied - account.pending
    dead_acc = {mb for name in dead for mb in accumulated.get(name, [])}
    account.lost_with_dead = dead_acc - account.applied - survivor_acc - account.lost_to_resync
    account.samples_lost_with_dead = sum(sizes.get(mb, 0) for mb in account.lost_with_dead)
    account.not_accumulated = skipped - account.applied - account.pending - dead_acc - all_dropped
    parts = account.applied | account.pending | account.lost_with_dead | account.lost_to_resync
    parts |= account.not_accumulated
    account.unaccounted = set(completed) - parts
    return account
