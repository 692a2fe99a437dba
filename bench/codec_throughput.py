"""Throughput of the wire codecs on one core: GB/s of fp32 input, encode + decode.

    python bench/codec_throughput.py [--mib 16] [--repeats 7] [--summary-json PATH]

Prints one row per codec: GB/s (best of `repeats`), bytes per value on the wire, max abs error on
standard normal data. The target for 8-bit is > 1 GB/s (issue 3).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from swarmtrain.net import codec


def measure(name: str, numel: int, repeats: int) -> dict:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    best_s = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        encoded = codec.encode(x, name)
        decoded = codec.decode(encoded)
        best_s = min(best_s, time.perf_counter() - start)
    return {
        "codec": name,
        "gb_per_s": numel * 4 / best_s / 1e9,
        "bytes_per_value": len(encoded.payload) / numel,
        "max_abs_error": float((decoded - x).abs().max()),
    }


def codec_gb_per_s(mib: int = 16, repeats: int = 7) -> float:
    """Encode+decode GB/s of the 8-bit codec on one thread (used by bench/swarm_vs_local.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measure("8bit", mib * 2**20 // 4, repeats)["gb_per_s"]
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=16, help="fp32 input size in MiB")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--summary-json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    numel = args.mib * 2**20 // 4
    rows = [measure(name, numel, args.repeats) for name in ("8bit", "float16", "none")]
    print(
        f"{'codec':<8} {'GB/s':>7} {'bytes/value':>12} {'max abs err':>12}   ({args.mib} MiB fp32, 1 thread)"
    )
    for row in rows:
        print(
            f"{row['codec']:<8} {row['gb_per_s']:>7.2f} {row['bytes_per_value']:>12.4f} {row['max_abs_error']:>12.5f}"
        )
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
