"""Seeded random generators derived from a root seed and a label, so streams are independent."""

from __future__ import annotations

import hashlib

import numpy as np


def derive_seed(root_seed: int, *labels: object) -> int:
    """A 63-bit seed that depends on the root seed and every label, stable across runs and hosts."""
    text = ":".join([str(root_seed), *map(str, labels)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def make_rng(root_seed: int, *labels: object) -> np.random.Generator:
    return np.random.default_rng(derive_seed(root_seed, *labels))
