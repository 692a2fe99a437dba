"""Helpers shared by the experiment scripts: fleets of identical devices, a custom model, output paths."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from swarmtrain.config import ModelConfig, RunConfig, SwarmConfig, TrainingConfig
from swarmtrain.sim.entities import DEVICE_TYPES, Fleet, PeerSpec, single_location

OUT_DIR = Path(__file__).resolve().parent / "out"


def device_fleet(
    counts: dict[str, int], latency_s: float = 0.0, bandwidth_bytes_per_s: float | None = None
) -> Fleet:
    """Identical-location peers; `bandwidth_bytes_per_s` (if given) replaces every access link."""
    peers = []
    for device, count in counts.items():
        for i in range(count):
            spec = PeerSpec.from_device(f"{device}{i}", DEVICE_TYPES[device], 0)
            if bandwidth_bytes_per_s is not None:
                spec = PeerSpec(
                    **{
                        **spec.__dict__,
                        "uplink_bytes_per_s": bandwidth_bytes_per_s,
                        "downlink_bytes_per_s": bandwidth_bytes_per_s,
                    }
                )
            peers.append(spec)
    return Fleet(
        tuple(peers), single_location(latency_s=latency_s), ", ".join(f"{n} x {d}" for d, n in counts.items())
    )


def layer_model(d_model: int, num_layers: int, seq_len: int, vocab_size: int = 256) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size,
        d_model=d_model,
        num_layers=num_layers,
        num_heads=d_model // 64,
        d_ff=4 * d_model,
        seq_len=seq_len,
    )


def run_config(
    model: ModelConfig, num_stages: int, micro_batch_size: int = 1, global_batch_size: int = 1 << 30
) -> RunConfig:
    training = TrainingConfig(micro_batch_size=micro_batch_size, global_batch_size=global_batch_size)
    return RunConfig(
        preset="experiment", model=model, training=training, swarm=SwarmConfig(num_stages=num_stages)
    )


def save_json(name: str, payload: dict) -> Path:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return path


def figure_path(name: str) -> Path:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    return OUT_DIR / f"{name}.png"


def save_outputs(name: str, fig, payload: dict) -> Path:
    """The figure (PNG) and the numbers (JSON) of one experiment in OUT_DIR; says where."""
    from swarmtrain.sim.plotting import save_figure

    path = figure_path(name)
    save_figure(fig, path)
    save_json(name, payload)
    say(f"figure: {path}")
    return path


def say(text: str = "") -> None:
    print(text)
    sys.stdout.flush()
