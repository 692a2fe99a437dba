"""How many resyncs of a DiLoCo replica skip their download after a donor's state was refused.

hivemind serves the state of the donor with the highest sharing priority, so asking again after a refusal
(implausible weights: a byzantine or broken replica) downloads the same state: 144 times a minute within
one resync, then once more every round (57 times in one run of the byzantine DiLoCo test). A refusal sets
the next resyncs' downloads aside, twice as many after each refusal (2, 4, ... 32); a state loaded resets
it (tests/unit/test_replica_resync.py)."""

from __future__ import annotations

from dataclasses import dataclass

SET_ASIDE_FIRST, SET_ASIDE_MAX = 2, 32


@dataclass
class DownloadSetAside:
    left: int = 0  # resyncs still to go on without a download
    next_skip: int = SET_ASIDE_FIRST  # how many the next refusal sets aside

    def take(self) -> bool:
        """Whether this resync goes on without a download (counted off)."""
        if not self.left:
            return False
        self.left -= 1
        return True

    def refused(self) -> int:
        """A donor's state was refused: the next `next_skip` resyncs skip their download (returned)."""
        skip = self.next_skip
        self.left, self.next_skip = skip, min(2 * skip, SET_ASIDE_MAX)
        return skip

    def loaded(self) -> None:
        """A state was loaded: the next refusal starts from the first set-aside again."""
        self.left, self.next_skip = 0, SET_ASIDE_FIRST
