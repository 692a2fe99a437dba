"""In-process study of a swarm step's semantics: which parameter version a micro-batch's gradient is
computed at, how the delay is corrected, and how gradients are clipped. No network: the stages are the
real stage modules, stepped exactly as a stage server steps them, so only the semantics differ.

Variants (each at equal samples and the same schedule as `train-local`):
- sync:       the gradient of global batch k is computed at theta_k (what `train-local` does);
- dpu:        computed at theta_{k-1}, applied to theta_k (one step of delay: SWARM's delayed update);
- dpu+predict: computed at theta_{k-1} + (theta_{k-1} - theta_{k-2}) (weight prediction: the last
              update repeated, a look-ahead in the spirit of Nesterov-corrected asynchronous pipelines);
- clipping per stage (each stage clips its own norm) or global (one norm over every stage).

    python experiments/step_semantics.py [--preset tiny] [--samples 8192] [--seeds 0 1]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from swarmtrain.config import get_preset
from swarmtrain.data import build_datasets, iterate_batches
from swarmtrain.model import build_stage
from swarmtrain.model.optim import build_optimizer, lr_at, set_lr


def run(cfg, delay: int, predict: bool, clip: str, samples: int) -> float:
    t = cfg.training
    specs = cfg.stages()
    stages = [build_stage(cfg.model, spec, seed=t.seed) for spec in specs]
    optimizers = [build_optimizer(s, t) for s in stages]
    params = [list(s.parameters()) for s in stages]
    history = [[p.detach().clone() for p in ps] for ps in params]  # theta_{k-1} per stage
    previous = [[p.detach().clone() for p in ps] for ps in params]  # theta_{k-2}
    train_set, val_set = build_datasets(cfg)
    batches = iterate_batches(train_set, t.micro_batch_size, seed=t.seed)
    steps = samples // t.global_batch_size
    accumulation = t.global_batch_size // t.micro_batch_size
    for step in range(steps):
        current = [[p.detach().clone() for p in ps] for ps in params]
        if delay:  # compute the gradient at the delayed (optionally extrapolated) version
            with torch.no_grad():
                for ps, old, older in zip(params, history, previous, strict=True):
                    for p, a, b in zip(ps, old, older, strict=True):
                        p.copy_(2 * a - b if predict else a)
        for _ in range(accumulation):
            inputs, labels = next(batches)
            x = inputs
            for stage in stages[:-1]:
                x = stage(x)
            loss = stages[-1](x, labels)
            (loss / accumulation).backward()
        with torch.no_grad():
            for ps, cur in zip(params, current, strict=True):
                for p, c in zip(ps, cur, strict=True):
                    p.copy_(c)
        _clip(params, t.grad_clip_norm, clip)
        for opt in optimizers:
            set_lr(opt, lr_at(step * t.global_batch_size, t))
            opt.step()
            opt.zero_grad(set_to_none=True)
        previous, history = history, current
    with torch.no_grad():
        total, count = 0.0, 0
        for inputs, labels in val_set.ordered_batches(t.micro_batch_size, t.eval_samples):
            x = inputs
            for stage in stages[:-1]:
                x = stage(x)
            total += float(stages[-1](x, labels)) * inputs.shape[0]
            count += inputs.shape[0]
    return total / count


def _clip(params, max_norm: float, mode: str) -> None:
    if max_norm <= 0:
        return
    if mode == "global":
        torch.nn.utils.clip_grad_norm_([p for ps in params for p in ps], max_norm)
    else:
        for ps in params:
            torch.nn.utils.clip_grad_norm_(ps, max_norm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    variants = [
        ("sync, global clip", 0, False, "global"),
        ("sync, per-stage clip", 0, False, "stage"),
        ("dpu, global clip", 1, False, "global"),
        ("dpu+predict, global clip", 1, True, "global"),
        ("dpu+predict, per-stage clip", 1, True, "stage"),
    ]
    rows = []
    print(f"{'variant':30s} {'seed':>4s} {'val loss':>9s} {'vs sync':>8s} {'wall s':>7s}")
    for seed in args.seeds:
        base = get_preset(args.preset)
        cfg = base.replace(training=_with(base.training, seed=seed, max_samples=args.samples))
        reference = None
        for name, delay, predict, clip in variants:
            start = time.time()
            loss = run(cfg, delay, predict, clip, args.samples)
            reference = reference if reference is not None else loss
            gap = loss / reference - 1
            rows.append({"variant": name, "seed": seed, "val_loss": loss, "gap_vs_sync": gap})
            print(f"{name:30s} {seed:4d} {loss:9.4f} {gap:+8.2%} {time.time() - start:7.1f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


def _with(training, **changes):
    import dataclasses

    return dataclasses.replace(training, **changes)


if __name__ == "__main__":
    main()
