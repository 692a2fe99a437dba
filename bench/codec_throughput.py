"""Throughput and error of the wire codecs on one core, side by side.

    python bench/codec_throughput.py [--mib 16] [--repeats 7] [--summary-json PATH]

One row per codec (and, below 8 bits, once more with stochastic rounding, as gradients are sent):
- encode GB/s and decode GB/s: GB of fp32 input per second, best of `repeats`, one thread;
- bytes/value on the wire (block scales included) and fp32 / that;
- relative error ||decoded - x|| / ||x|| on two inputs: standard normal values, and the same with one
  channel in 64 thirty times larger (laid out as (tokens, 256 channels): the outlier channels of
  transformer activations, which the `-rht` rotation spreads out).
The target for 8-bit is > 1 GB/s (issue 3).

Below the table, what the data plane adds to every hand-off since its frames are sealed in every run
(net/secure_link.py): AES-GCM seal and open in GB/s of 8-bit payload, next to the 8-bit codec's encode,
and the CPU time of one connection's handshake (an RSA-2048 signature and verification and an X25519
exchange per side).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from swarmtrain.net import codec

OUTLIER_SCALE = 30.0
CHANNELS = 256


def _inputs(numel: int) -> dict[str, torch.Tensor]:
    normal = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    outliers = normal.clone().view(-1, CHANNELS)
    outliers[:, ::64] *= OUTLIER_SCALE
    return {"normal": normal, "outliers": outliers.view(-1)}


def _best_s(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(name: str, numel: int, repeats: int, stochastic: bool = False) -> dict:
    inputs = _inputs(numel)
    x = inputs["normal"]
    encoded = codec.encode(x, name, stochastic)
    encode_s = _best_s(lambda: codec.encode(x, name, stochastic), repeats)
    decode_s = _best_s(lambda: codec.decode(encoded), repeats)
    errors = {}
    for label, data in inputs.items():
        decoded = codec.decode(codec.encode(data, name, stochastic))
        errors[label] = float((decoded - data).norm() / data.norm())
    bytes_per_value = len(encoded.payload) / numel
    return {
        "codec": name + (" (stochastic)" if stochastic else ""),
        "encode_gb_per_s": numel * 4 / encode_s / 1e9,
        "decode_gb_per_s": numel * 4 / decode_s / 1e9,
        "gb_per_s": numel * 4 / (encode_s + decode_s) / 1e9,
        "bytes_per_value": bytes_per_value,
        "fp32_ratio": 4 / bytes_per_value,
        "rel_error_normal": errors["normal"],
        "rel_error_outliers": errors["outliers"],
    }


def measure_seal(numel: int, repeats: int) -> dict:
    """The data plane's per-frame sealing on an 8-bit payload, and one handshake's CPU time."""
    from swarmtrain.net import secure_link
    from swarmtrain.net.identity import PeerIdentity, verify

    payload = codec.encode(torch.randn(numel), "8bit").payload
    key = bytes(32)
    sender, receiver = secure_link.Seal(key, b"c->s", b"s->c"), secure_link.Seal(key, b"s->c", b"c->s")
    sealed = sender.seal(b"head", payload)
    seal_s = _best_s(lambda: sender.seal(b"head", payload), repeats)

    def open_one() -> None:
        receiver._received = 0  # the same frame again: its nonce is the first one
        receiver.open(b"head", sealed)

    open_s = _best_s(open_one, repeats)
    me, peer = PeerIdentity.generate(), PeerIdentity.generate()
    signature = peer.sign(b"transcript")

    def handshake_side() -> None:
        ours, _ = secure_link._ephemeral()
        theirs, dh = secure_link._ephemeral()
        secure_link._shared(ours, {"dh": dh})
        me.sign(b"transcript")
        verify(peer.peer_id, peer.public_key, b"transcript", signature)

    return {
        "payload_mib": len(payload) / 2**20,
        "seal_gb_per_s": len(payload) / seal_s / 1e9,
        "open_gb_per_s": len(payload) / open_s / 1e9,
        "handshake_side_ms": _best_s(handshake_side, repeats) * 1e3,
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
    rows = [measure(name, numel, args.repeats) for name in codec.CODECS]
    rows += [measure(name, numel, args.repeats, stochastic=True) for name in codec.LOWBIT]
    print(f"({args.mib} MiB fp32, 1 thread; relative error on normal values / with outlier channels)")
    print(
        f"{'codec':<22} {'enc GB/s':>8} {'dec GB/s':>8} {'bytes/value':>11} {'x fp32':>6} "
        f"{'rel err':>8} {'outliers':>8}"
    )
    for row in rows:
        print(
            f"{row['codec']:<22} {row['encode_gb_per_s']:>8.2f} {row['decode_gb_per_s']:>8.2f} "
            f"{row['bytes_per_value']:>11.4f} {row['fp32_ratio']:>6.2f} {row['rel_error_normal']:>8.4f} "
            f"{row['rel_error_outliers']:>8.4f}"
        )
    seal = measure_seal(numel, args.repeats)
    eight_bit = next(row for row in rows if row["codec"] == "8bit")
    print(
        f"\ndata plane sealing ({seal['payload_mib']:.1f} MiB 8-bit payload, AES-GCM): seal {seal['seal_gb_per_s']:.2f} GB/s, "
        f"open {seal['open_gb_per_s']:.2f} GB/s of payload; 8-bit encode produces "
        f"{eight_bit['encode_gb_per_s'] / eight_bit['fp32_ratio']:.2f} GB/s of payload. One side of a connection's "
        f"handshake: {seal['handshake_side_ms']:.2f} ms of CPU"
    )
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump({"codecs": rows, "seal": seal}, f, indent=2)


if __name__ == "__main__":
    main()
