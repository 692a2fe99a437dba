"""Samples/s of local training on the `small` preset: the baseline later benchmarks divide by.

    python bench/local_baseline.py [--preset small] [--threads 1] [--steps 6]

Prints one table: threads, samples/s, ms per micro-batch (forward + backward + optimizer share).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from swarmtrain.config import get_preset
from swarmtrain.data import build_datasets, iterate_batches
from swarmtrain.runtime.local import LocalTrainer


def measure(preset: str, threads: int, steps: int) -> dict:
    torch.set_num_threads(threads)
    cfg = get_preset(preset)
    trainer = LocalTrainer(cfg, progress=False)
    batches = iterate_batches(trainer.train_set, cfg.training.micro_batch_size, seed=0)
    trainer.step(batches)  # warm-up: allocator, kernels
    start = time.perf_counter()
    for _ in range(steps):
        trainer.step(batches)
    elapsed_s = time.perf_counter() - start
    samples = steps * cfg.training.global_batch_size
    micro_batches = samples // cfg.training.micro_batch_size
    return {
        "preset": preset,
        "threads": threads,
        "samples_per_s": samples / elapsed_s,
        "ms_per_micro_batch": 1000 * elapsed_s / micro_batches,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="small")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps timed per setting")
    parser.add_argument("--summary-json", help="write the rows here")
    args = parser.parse_args()
    build_datasets(get_preset(args.preset))  # warm the file cache so the first row is not penalized
    rows = [measure(args.preset, t, args.steps) for t in args.threads]
    print(f"{'preset':<10} {'threads':>7} {'samples/s':>10} {'ms/micro-batch':>15}")
    for row in rows:
        print(
            f"{row['preset']:<10} {row['threads']:>7} {row['samples_per_s']:>10.1f} {row['ms_per_micro_batch']:>15.1f}"
        )
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
