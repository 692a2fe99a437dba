"""How many micro-batches a trainer keeps in flight unless told: a pure rule of the run's stage count,
shared by `swarmtrain trainer` and `swarmtrain demo`.

A micro-batch's round trip crosses every stage twice (forward, backward). To keep the slowest stage busy,
the micro-batches in flight must cover that round trip over the stage's time per micro-batch:
S x (1 + hop latency / stage compute) for S stages of similar compute. On CPUs a stage's compute dwarfs a
hop and 4 was plenty (2-stage `tiny` and `small` served about as much at 4, 8 and 16 in flight, and
`llama-tiny` over a 2 Mbit/s link as much from 4 to 16: docs/LOG.md). On a GPU a hop (encode, copy, send,
receive, copy, decode, queue) takes several times a stage's compute: four `gpt2-small` stages sharing one
H200 served 60.8, 93.2 and 111.5 samples/s in bf16 at 4, 8 and 16 in flight (fp32: 38.3 and 38.4 at 4 and
16). Four per stage covers a hop three times a stage's compute. What more in flight costs a server is
memory for forward graphs, which it keeps within its budget (`--cache-mb`), recomputing beyond it.
"""

from __future__ import annotations

PER_STAGE = 4
MIN_IN_FLIGHT = 4


def default_in_flight(num_stages: int) -> int:
    """Micro-batches a trainer keeps in flight by default for a run of `num_stages` stages."""
    return max(MIN_IN_FLIGHT, PER_STAGE * num_stages)
