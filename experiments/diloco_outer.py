"""In-process study of DiLoCo's outer step for `swarmtrain replica`: N replicas averaging exactly every
H local steps (`runtime/replica_inner.diloco_reference`) vs one process (`train-local`), at equal total
samples and the same schedule. Rows: H and the outer optimizer (learning rate, Nesterov momentum).

    python experiments/diloco_outer.py [--preset tiny] [--samples 8192] [--replicas 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import _common as c
import torch

from swarmtrain.config import get_preset
from swarmtrain.runtime.local import local_reference_val_loss
from swarmtrain.runtime.replica.replica_inner import diloco_reference
from swarmtrain.sim.report import format_table

# (H, outer learning rate, outer momentum): the published DiLoCo setting, plain averaging, and between
ROWS = (
    (20, 0.7, 0.9),
    (20, 0.5, 0.7),
    (20, 1.0, 0.0),
    (20, 0.9, 0.1),
    (1, 1.0, 0.0),
    (10, 0.9, 0.1),
    (32, 0.9, 0.1),
    (50, 0.9, 0.1),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--replicas", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = get_preset(args.preset)
    local = local_reference_val_loss(cfg, args.samples)
    table, rows = [], []
    for h, lr, momentum in ROWS:
        start = time.perf_counter()
        diloco = dataclasses.replace(
            cfg.diloco, inner_steps=h, outer_learning_rate=lr, outer_momentum=momentum
        )
        result = diloco_reference(cfg.replace(diloco=diloco), args.replicas, args.samples)
        gap = result.val_loss / local - 1
        table.append([h, lr, momentum, result.outer_steps, f"{result.val_loss:.4f}", f"{gap:+.2%}"])
        rows.append(
            {"h": h, "outer_lr": lr, "outer_momentum": momentum, "val_loss": result.val_loss, "gap": gap}
        )
        c.say(
            f"H={h} lr={lr} momentum={momentum}: {result.val_loss:.4f} ({gap:+.2%}, {time.perf_counter() - start:.0f} s)"
        )
    c.say(f"\n{args.replicas} replicas vs one process ({local:.4f}), {args.preset}, {args.samples} samples")
    c.say(format_table(["H", "outer lr", "momentum", "rounds", "val loss", "gap"], table))
    c.save_json("diloco_outer", {"local_val_loss": local, "rows": rows, "samples": args.samples})


if __name__ == "__main__":
    main()
