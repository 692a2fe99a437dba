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
  younger than the slack and the record still has at least half its life ahead;
- a store lives `IDLE_TTL_PER_SLACK` x the slack longer than its time-to-live, so an unchanged record is
  re-stored about once per slack instead of once per half its time-to-live (every 2 s for the progress
  heartbeat's 4 s).
Any activity (a micro-batch, a step, a change of serving state) ends the slack at once: every read
and store goes to the DHT again, as before. Periods and the readers' lapse grace are untouched, so a
new peer is seen as fast as before whenever the swarm trains; while it idles, up to `MAX_SLACK_S`
later, and a replica that missed its stage's step and gets no request learns of it up to that late. A
peer that dies idle stays listed up to its time-to-live plus 1.5 x the slack (36 s for an announcement):
within the lapse grace of 45 s of the readers that keep a `StageView` (trainers), which list a lapsed
peer that long anyway; readers of the records themselves (the balancer, a replica's reads of its stage's
progress, joiners choosing a donor) see it up to 30 s longer than before. A server that leaves says so at
once (an "offline" announcement, its state declaration withdrawn).

The DHT refuses a subkey's value that expires before the one it holds, so a store after an idle one
(a step's progress, an "offline" announcement) never expires earlier than the last store of its
subkey (`store_expiration`): otherwise the new value would be refused until the idle one lapsed. A
restarted peer (the same identity) does not know its previous life's stores: its first store of a
subkey, if the DHT answers False (refused, or no node answered), goes once more with
`outlasting_expiration`.

Pure functions of numbers: `runtime/server/activity_clock.py` measures the idleness and
`net/dht_records.RunRecords` applies the slack.
"""

from __future__ import annotations

# idle this long before any read is reused or store skipped: start-up, joins, a restore's adoption of
# the other stages' step (after `lag_grace_s`) and a move's arrival run at the usual pace
IDLE_GRACE_S = 30.0
# the most a reused read may lag the DHT: an idle server sees a record change up to this late. 20 s: the
# reads fall from ~6 a second to ~one per key per 20 s, while a new peer of a swarm that does not train
# is still seen well within the readers' lapse grace (net/dht_records.LAPSE_GRACE_S, 45 s). With 10 s an
# idle server of a stage with two replicas sent 10.1 kB/s (docs/LOG.md, 2026-11-28)
MAX_SLACK_S = 20.0
# while idle a stored record lives this many seconds longer per second of slack: with `may_skip_store`'s
# half-life rule, an unchanged record is re-stored every ~0.75 slack plus half its own time-to-live
# (every 17 s for the progress heartbeat at the cap), and a peer that dies idle is listed 30 s longer
IDLE_TTL_PER_SLACK = 1.5
# how much later than the last store of a subkey a new one expires at the least: the DHT keeps the value
# that expires last, and a tie keeps the old one
EXPIRATION_STEP_S = 1e-3
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


def stored_ttl_s(ttl_s: float, slack_s: float) -> float:
    """The time-to-live a record is stored with under `slack_s`: its own while active, longer while idle."""
    return ttl_s + IDLE_TTL_PER_SLACK * max(0.0, slack_s)


def store_expiration(now_s: float, ttl_s: float, last_expiration_s: float | None) -> float:
    """When a store made at `now_s` (DHT time) with `ttl_s` to live expires: never before, nor at, the
    last store of the same subkey (`last_expiration_s`; None: none), which the DHT would keep instead."""
    expiration_s = now_s + ttl_s
    if last_expiration_s is None:
        return expiration_s
    return max(expiration_s, last_expiration_s + EXPIRATION_STEP_S)


def outlasting_expiration(now_s: float, ttl_s: float) -> float:
    """An expiration later than any a store of the same record made up to `now_s` can have: the longest
    idle time-to-live ahead of now."""
    return now_s + stored_ttl_s(ttl_s, MAX_SLACK_S) + EXPIRATION_STEP_S
