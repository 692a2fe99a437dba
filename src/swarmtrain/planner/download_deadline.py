"""How long a peer may spend downloading a stage's (or a whole-model replica's) state from its donors.

The deadline follows the state's size: a donor must deliver the whole state at no less than a minimum
rate, plus a fixed allowance for the donor to snapshot its state and open the stream:

    donor_deadline_s = base_s + state_bytes / min_rate_bytes_per_s

It is enforced on the whole download from one donor, not on the gap between its parts: a donor that
keeps sending a part every few seconds but would take hours for the state is cut at the deadline, and
the next donor (by sharing priority) is tried. At most `max_donors` donors are tried, so a download as a
whole ends within `download_deadline_s`; after that a server falls back to its stage's own checkpoint
(runtime/server/stage_sync.py) and a replica to what it holds.

A donor that goes silent is cut sooner, at the averager's chunk timeout (net/averaging.py); that is a
bound on silence, this one on the total.

The rule is each peer's own (`swarmtrain server` and `replica` take `--state-download-min-mbit` and
`--state-download-base-s`; not part of the run's config digest): the default minimum of 100 Mbit/s suits
datacenter links, but a volunteer on a 10 Mbit/s home link can never receive a state at 100 Mbit/s
(llama-8b's first stage, 11.5 GB, takes 2.6 h at 10 Mbit/s; the default gives a donor 953 s), so such
a peer sets a minimum below its own download rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FP32_BYTES = 4
ADAM_COPIES = 3  # parameters and Adam's two moments, as config/sizes.stage_state_bytes counts them
REPLICA_COPIES = 5  # a DiLoCo replica's: its anchor and outer momentum too
# how long past a download's deadline its caller waits for the averager's process to report the cut:
# the cancellation and the answer through its pipe, both local
REPORT_SLACK_S = 2.0
BYTES_PER_MBIT = 1e6 / 8
# a donor's snapshot of its state (on a busy compute thread: over 2 s at a CPU quota), the stream's
# opening and a first part, for a state of any size
DEFAULT_BASE_S = 30.0
# a donor slower than this on average is not worth waiting for when another may be faster (on
# datacenter links; a peer on a slower link sets its own, see above)
DEFAULT_MIN_MBIT = 100.0


@dataclass(frozen=True)
class DownloadRule:
    base_s: float = DEFAULT_BASE_S
    min_rate_bytes_per_s: float = DEFAULT_MIN_MBIT * BYTES_PER_MBIT
    max_donors: int = 3

    def __post_init__(self) -> None:
        finite = math.isfinite(self.base_s) and math.isfinite(self.min_rate_bytes_per_s)
        if not (finite and self.base_s >= 0 and self.min_rate_bytes_per_s > 0 and self.max_donors >= 1):
            raise ValueError(f"invalid download rule: {self}")

    @classmethod
    def of(cls, min_mbit: float | None = None, base_s: float | None = None) -> DownloadRule:
        """A peer's rule from its settings (--state-download-min-mbit, --state-download-base-s); None:
        the default."""
        return cls(
            base_s=DEFAULT_BASE_S if base_s is None else float(base_s),
            min_rate_bytes_per_s=(DEFAULT_MIN_MBIT if min_mbit is None else float(min_mbit)) * BYTES_PER_MBIT,
        )

    @property
    def min_mbit(self) -> float:
        return self.min_rate_bytes_per_s / BYTES_PER_MBIT


DEFAULT_RULE = DownloadRule()


def state_bytes(param_count: int, copies: int = ADAM_COPIES) -> float:
    """A state's size from its parameter count: `copies` fp32 tensors of that many values."""
    return float(param_count) * FP32_BYTES * copies


def donor_deadline_s(state_bytes: float, rule: DownloadRule = DEFAULT_RULE) -> float:
    """The most one donor may take to deliver the whole state."""
    if state_bytes < 0:
        raise ValueError(f"negative state size {state_bytes}")
    return rule.base_s + state_bytes / rule.min_rate_bytes_per_s


def download_deadline_s(state_bytes: float, rule: DownloadRule = DEFAULT_RULE) -> float:
    """The most a whole download may take: every donor it may try, each up to its deadline."""
    return rule.max_donors * donor_deadline_s(state_bytes, rule)


def wait_bound_s(state_bytes: float, rule: DownloadRule = DEFAULT_RULE) -> float:
    """How long the caller of a download waits for its answer: the download's deadline plus the slack
    for the averager's process to report it."""
    return download_deadline_s(state_bytes, rule) + REPORT_SLACK_S


def donors_that_fit(left_s: float, donor_s: float, rule: DownloadRule = DEFAULT_RULE) -> int:
    """How many donors a download that must end within `left_s` may try, each up to `donor_s`: as many
    as fit, at least one (a retry that no donor fits in is the caller's to skip), at most the rule's."""
    if left_s == math.inf:
        return rule.max_donors
    return max(1, min(rule.max_donors, int(left_s // donor_s)))


def describe(state_bytes: float, rule: DownloadRule = DEFAULT_RULE) -> str:
    """The rule applied to a state, in words (the line a peer logs at start)."""
    donor_s = donor_deadline_s(state_bytes, rule)
    return (
        f"each donor {donor_s:.1f} s ({rule.base_s:g} s + {state_bytes / 1e6:.1f} MB at {rule.min_mbit:g} "
        f"Mbit/s), at most {rule.max_donors} donors: {rule.max_donors * donor_s:.1f} s in all "
        "(--state-download-min-mbit, --state-download-base-s)"
    )


def replica_plan(
    param_count: int, left_s: float = math.inf, rule: DownloadRule = DEFAULT_RULE
) -> tuple[float, int]:
    """A whole-model replica's download: (one donor's deadline, how many donors to try in `left_s`)."""
    donor_s = donor_deadline_s(state_bytes(param_count, REPLICA_COPIES), rule)
    return donor_s, donors_that_fit(left_s, donor_s, rule)


def replica_deadline_s(param_count: int, rule: DownloadRule = DEFAULT_RULE) -> float:
    """A whole-model replica's resync: all its tries within one download's deadline."""
    return download_deadline_s(state_bytes(param_count, REPLICA_COPIES), rule)
