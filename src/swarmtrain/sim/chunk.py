"""A chunk: one simulated micro-batch of `chunk_samples` samples on its way forward through stages 0..S-1
and backward S-1..0 (sim/pipeline.py moves it). A module of its own because both the pipeline and
sim/stage_steps.py (which gates and counts chunks per stage) hold chunks: kept in pipeline.py, it made
an import circle between the two.
"""

from __future__ import annotations


class Chunk:
    __slots__ = (
        "id",
        "owner",
        "samples",
        "stage",
        "backward",
        "attempt",
        "peer",
        "src",
        "path",
        "path_epoch",
        "sent_s",
        "recompute",
        "log",
        "avoid",
        "expected_s",
        "compute_factor",
        "step",
    )

    def __init__(self, chunk_id: int, owner, samples: int, num_stages: int) -> None:
        self.id = chunk_id
        self.owner = owner  # the trainer (SWARM) or pipeline (gpipe) that drives it
        self.samples = samples
        self.attempt = 0
        self.log: list[tuple[int, bool]] | None = None
        self.path = [-1] * num_stages
        self.path_epoch = [-1] * num_stages
        self.step = 0  # the global step its samples belong to (synchronous steps)
        self.reset(chunk_id)

    def reset(self, chunk_id: int) -> None:
        self.id = chunk_id
        self.stage = 0
        self.backward = False
        self.peer = -1
        self.src = -1  # peer index holding the input; -1: the trainer
        self.recompute = False
        self.sent_s = 0.0
        self.avoid = -1  # a peer that just timed out on this chunk: not chosen again right away
        self.expected_s = 0.0
        self.compute_factor = 1.0
        for s in range(len(self.path)):
            self.path[s] = -1
        if self.log is not None:
            self.log = []
