"""How much DHT traffic an idle stage server may save: the slack it allows its record reads and stores.

A server reads and writes the run's DHT records on fixed periods (announcements every announce period,
progress every heartbeat, its sync thread's reads of its own and the other stages' progress twice a
second, the balancer's lease poll every second). On a slow link that costs 22-26 kB/s each way per
server with no training at all (bench/idle_traffic.py, docs/LOG.md), six DHT reads and two stores a
second. While a server is idle nothing it would read has changed (its stage peers step only with it,
through the exchange that reaches it; the other stages step only when micro-batches pass through it
too), so once it has been idle for `IDLE_GRACE_S` it allows a slack, growing to `MAX_SLACK_S`:
- a read of a record key reuses the last read of the same key when that is younger than the slack;
- a store of a value equal to the last one stored (time stamps aside) is skipped while that store is
  younger than the slack and the record still has at least half its life ahead.
Any activity (a micro-batch, a step, a change of serving state) ends the slack at once: every read
and store goes to the DHT again, as before. Periods, time-to-live and the readers' lapse grace are
untouched, so a new or dead peer is seen as fast as before whenever the swarm trains; while it idles,
up to `MAX_SLACK_S` later.

Pure functions of numbers: `runtime/server/activity_clock.py` measures the idleness and
`net/dht_records.RunRecords` applies the slack.
"""

from __future__ import annotations

# idle this long before any read is reused or store skipped: start-up, joins, a restore's adoption of
# the other stages' step (after `lag_grace_s`) and a move's arrival run at the usual pace
IDLE_GRACE_S = 30.0
# the most a reused read may lag the DHT: an idle server sees a record change up to this late. 10 s: the
# reads fall from ~6 a second to ~one per key per 10 s, while a new peer of a swarm that does not train
# is still seen well within the readers' lapse grace (net/dht_records.LAPSE_GRACE_S, 45 s)
MAX_SLACK_S = 10.0
# a skipped store keeps at least this share of its record's time-to-live ahead of it, so one failed
# store later still leaves the record alive until the next attempt
MIN_LIFE_LEFT_SHARE = 0.5


def idle_slack_s(idle_s: float, grace_s: float = IDLE_GRACE_S, max_slack_s: float = MAX_SLACK_S) -> float:
    """The slack after `idle_s` without activity: none within `grace_s`, then growing a second per
    second up to `max_slack_s` (a server back from a short pause is not handed a large one at once)."""
    return min(max_slack_s, max(0.0, idle_s - grace_s))


def may_reuse_read(age_s: float, slack_s: float) -> bool:
    """Whether a read of a key may return the last read of it, made `age_s` ago."""
    return 0.0 <= age_s < slack_s


def may_skip_store(unchanged: bool, age_s: float, ttl_s: float, slack_s: float) -> bool:
    """Whether a store may be skipped: its value equals the last one stored, `age_s` ago with `ttl_s`
    to live, which therefore still has at least `MIN_LIFE_LEFT_SHARE` of its life ahead."""
    return unchanged and 0.0 <= age_s < min(slack_s, (1.0 - MIN_LIFE_LEFT_SHARE) * ttl_s)
