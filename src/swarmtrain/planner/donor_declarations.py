"""When a stage replica stores its declaration as a state donor (net/averaging.py): the DHT record under
its stage's `.all_averagers` key that a joiner reads to pick whom to download the stage's state from,
highest priority first.

The priority is the replica's step (half a step lower after it skipped steps, -1 while stale:
runtime/server/stage_sync.py), so it rises with every step, and hivemind's averager re-declares on every
change of it: a DHT store (a traversal and a store on every nearest node) per step per replica. While a
`llama-tiny` swarm trained at ~7 steps a second that was a quarter of the bytes its DHT nodes served
(docs/LOG.md, 2026-11-29, twenty-ninth session). Now:
- stored at once: the first declaration, sharing switched on or off, a priority that fell (a replica gone
  stale or marked as having skipped steps must not be picked on its old standing) or rose from below zero
  (a stale replica that caught up);
- a priority that only rose (a step) is stored at most once per `MIN_REDECLARE_S`, with whatever the
  priority is then;
- an unchanged declaration is stored again once `MIN_LIFE_LEFT_SHARE` of its life is left. It was stored
  again when it expired, as hivemind does: until the new store reached the DHT's nodes the donor was not
  listed, and a joiner whose read fell in that gap (a store's latency in every period, longer on a loaded
  machine) did not try it (the state-download e2e test's failures in CI, docs/LOG.md, 2026-11-30).
A joiner may therefore see a sharing replica's step up to `MIN_REDECLARE_S` old. Replicas of a stage step
together (the exchange), so their declarations race each other at that scale already: the order among
current replicas was within a step's timing noise before and is within a second's now.
"""

from __future__ import annotations

from swarmtrain.planner.idle_pace import MIN_LIFE_LEFT_SHARE

# the most often a sharing replica re-declares a priority that only rose
MIN_REDECLARE_S = 1.0


def declaration_wait_s(
    now_s: float,
    *,
    sharing: bool,
    was_sharing: bool,
    priority: float,
    declared: tuple[float, float, float] | None,
    period_s: float,
) -> float:
    """Seconds from `now_s` (DHT time) until the declaration is to be stored (0: now), unless a change of
    state comes first. `declared`: the last declaration's (priority, stored at, expires at), None before
    the first; `was_sharing`: whether it declared sharing; `period_s`: the wait when nothing is due."""
    if declared is None:
        return 0.0 if sharing else period_s
    last_priority, stored_s, expires_s = declared
    if sharing != was_sharing:
        return 0.0
    if not sharing:  # withdrawn already: nothing to store again
        return period_s
    renew_s = expires_s - MIN_LIFE_LEFT_SHARE * (expires_s - stored_s)  # the next store lands before expiry
    if priority < last_priority or last_priority < 0 <= priority or now_s >= renew_s:
        return 0.0
    if priority != last_priority:
        return max(0.0, min(stored_s + MIN_REDECLARE_S, renew_s) - now_s)
    return renew_s - now_s
