"""One rank of PyTorch's own pipelining (`torch.distributed.pipelining`, GPipe over gloo): the
baseline `bench/wan.py` runs against the swarm. Start one process per stage:

    python bench/gpipe_rank.py --rank 0 --world-size 2 --master-addr 127.0.0.1 --master-port 29511 \
        --ifname lo [--preset small | --config RUN.toml] [--steps 10] [--warmup-steps 1] \
        [--duration-s S] [--threads 1] [--summary-json PATH]
    python bench/gpipe_rank.py --rank 1 --world-size 2 --master-addr 127.0.0.1 --master-port 29511 --ifname lo

Rank r holds stage r of the run config's cut (`cfg.stages()`, `build_stage(..., seed=training.seed)`), so
world size = swarm.num_stages. Each optimizer step is one global batch (training.global_batch_size) of
global / micro_batch_size micro-batches through `ScheduleGPipe` (all forwards, then all backwards), fp32;
rank 0 feeds the token ids, the last rank's loss function gets the labels. The math is train-local's
(`runtime/local.py`): same weights, data order (`iterate_batches`), mean of the micro-batches' gradients,
gradient clipping to the *global* norm over all stages (one all-reduce of the squared norms per step),
AdamW with the learning-rate schedule in samples. That all-reduce also carries the step's loss to rank 0
and rank 0's stop flag (`--duration-s`), so every rank stops after the same step: a few dozen bytes per
step on top of GPipe's activations and gradients.

`--ifname` sets GLOO_SOCKET_IFNAME: inside a network namespace of the WAN test bed gloo must use the
namespace's veth, not loopback. `--warmup-steps` train but are not timed (the first one also exchanges
the stages' tensor shapes). Rank 0 prints a line per step and writes `--summary-json`: samples/s over
the timed steps, their mean training loss, and every step's loss.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

EXIT_INTERRUPTED = 130


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, default=2, help="ranks = the config's stages (default 2)")
    parser.add_argument("--master-addr", default="127.0.0.1", help="rank 0's address (rendezvous)")
    parser.add_argument("--master-port", type=int, default=29511)
    parser.add_argument("--ifname", help="network interface gloo uses (sets GLOO_SOCKET_IFNAME)")
    parser.add_argument("--preset", help="named preset (default small)")
    parser.add_argument("--config", metavar="FILE", help="TOML run file (`preset = ...` plus overrides)")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps, at most (default 10)")
    parser.add_argument("--warmup-steps", type=int, default=1, help="untimed steps first (default 1)")
    parser.add_argument(
        "--duration-s", type=float, help="stop after the timed step that reaches this many seconds"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as the servers)")
    parser.add_argument(
        "--timeout-s", type=float, default=300.0, help="rendezvous and per-operation timeout (default 300)"
    )
    parser.add_argument("--summary-json", metavar="PATH", help="rank 0 writes its summary here")
    args = parser.parse_args(argv)
    if args.world_size < 2:
        parser.error("--world-size must be >= 2 (a pipeline of stages)")
    if not 0 <= args.rank < args.world_size:
        parser.error(f"--rank must be in 0..{args.world_size - 1}")
    if args.steps < 1 or args.warmup_steps < 0:
        parser.error("--steps must be >= 1 and --warmup-steps >= 0")
    return args


def load_config(args: argparse.Namespace):
    from swarmtrain.config import get_preset, load_run_config

    if args.config:
        return load_run_config(args.config, preset=args.preset)
    return get_preset(args.preset or "small")


def init_group(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    if args.ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = args.ifname
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master_addr}:{args.master_port}",
        rank=args.rank,
        world_size=args.world_size,
        timeout=datetime.timedelta(seconds=args.timeout_s),
    )


def global_batches(cfg):
    """(token ids, labels) of each global batch: train-local's micro-batches, concatenated in order
    (ScheduleGPipe splits a batch into equal chunks along dim 0, giving those micro-batches back)."""
    import torch

    from swarmtrain.data import build_datasets, iterate_batches

    t = cfg.training
    train_set, _ = build_datasets(cfg)
    micro = iterate_batches(train_set, t.micro_batch_size, seed=t.seed)
    per_step = t.global_batch_size // t.micro_batch_size
    while True:
        pairs = [next(micro) for _ in range(per_step)]
        yield torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])


def make_loss_fn(pad_token_id: int):
    """The last stage's loss on its logits, as DecoderStage computes it with labels."""
    import torch.nn.functional as F

    def loss_fn(logits, labels):
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=pad_token_id
        )

    return loss_fn


class Rank:
    """This rank's stage, schedule and optimizer."""

    def __init__(self, cfg, rank: int, world_size: int) -> None:
        import torch
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        from swarmtrain.model.build import build_stage
        from swarmtrain.model.optim import build_optimizer

        specs = cfg.stages()
        if len(specs) != world_size:
            raise SystemExit(f"the config has {len(specs)} stages; run that many ranks, not {world_size}")
        t = cfg.training
        self.cfg = cfg
        self.spec = specs[rank]
        self.micro_batches = t.global_batch_size // t.micro_batch_size
        self.module = build_stage(cfg.model, self.spec, seed=t.seed)
        self.optimizer = build_optimizer(self.module, t)
        stage = PipelineStage(self.module, rank, world_size, torch.device("cpu"))
        self.schedule = ScheduleGPipe(stage, self.micro_batches, loss_fn=make_loss_fn(cfg.model.pad_token_id))

    def step(self, index: int, inputs, labels, stop_vote) -> tuple[float, bool]:
        """Optimizer step `index` on one global batch; returns (the mean loss over its micro-batches,
        whether any rank asked to stop after it: `stop_vote()`, asked after the backward passes).
        Collective: every rank calls it."""
        import torch
        import torch.distributed as dist

        from swarmtrain.model.optim import lr_at, set_lr

        t = self.cfg.training
        losses: list = []
        if self.spec.is_first:
            self.schedule.step(inputs, return_outputs=False)
        elif self.spec.is_last:
            self.schedule.step(target=labels, losses=losses, return_outputs=False)
        else:
            self.schedule.step(return_outputs=False)
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        squared_norm = sum(float(torch.linalg.vector_norm(g).item()) ** 2 for g in grads)
        loss_sum = sum(float(loss.item()) for loss in losses)
        # [squared grad norm of this stage, sum of micro-batch losses (last rank), stop votes]
        totals = torch.tensor([squared_norm, loss_sum, float(stop_vote())], dtype=torch.float64)
        dist.all_reduce(totals)
        if t.grad_clip_norm > 0:  # as clip_grad_norm_ over the whole model
            coef = min(1.0, t.grad_clip_norm / (math.sqrt(totals[0].item()) + 1e-6))
            for g in grads:
                g.mul_(coef)
        set_lr(self.optimizer, lr_at(index * t.global_batch_size, t))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return totals[1].item() / self.micro_batches, totals[2].item() > 0


class Clock:
    """The timed steps' clock; on rank 0 it also casts the --duration-s stop vote."""

    def __init__(self, duration_s: float | None, votes: bool) -> None:
        self.duration_s, self.votes = duration_s, votes
        self.start_s: float | None = None  # None during the warm-up steps

    def start(self) -> None:
        self.start_s = time.perf_counter()

    def elapsed_s(self) -> float:
        return 0.0 if self.start_s is None else time.perf_counter() - self.start_s

    def stop_vote(self) -> bool:
        return bool(self.votes and self.duration_s and self.start_s is not None) and (
            self.elapsed_s() >= self.duration_s
        )


def train(args: argparse.Namespace, cfg) -> dict:
    """Warm-up steps, then timed steps until --steps or --duration-s; the summary (every rank gets the
    last rank's losses through the step's all-reduce)."""
    t = cfg.training
    rank = Rank(cfg, args.rank, args.world_size)
    batches = global_batches(cfg)
    clock = Clock(args.duration_s, votes=args.rank == 0)
    losses: list[float] = []
    for index in range(args.warmup_steps + args.steps):
        if index == args.warmup_steps:
            clock.start()
        step_start_s = time.perf_counter()
        inputs, labels = next(batches)
        loss, stop = rank.step(index, inputs, labels, clock.stop_vote)
        losses.append(loss)
        if args.rank == 0:
            kind = "warm-up" if index < args.warmup_steps else "timed"
            print(
                f"step {index} {kind} loss {loss:.4f} {time.perf_counter() - step_start_s:.2f} s", flush=True
            )
        if stop:
            break
    timed_s, timed_losses = clock.elapsed_s(), losses[args.warmup_steps :]
    return {
        "samples_per_s": len(timed_losses) * t.global_batch_size / timed_s if timed_s else 0.0,
        "mean_loss": sum(timed_losses) / len(timed_losses) if timed_losses else None,
        "timed_steps": len(timed_losses),
        "timed_s": timed_s,
        "warmup_steps": args.warmup_steps,
        "steps": len(losses),
        "samples": len(losses) * t.global_batch_size,
        "global_batch_size": t.global_batch_size,
        "micro_batches": rank.micro_batches,
        "losses": losses,
        "world_size": args.world_size,
        "threads": args.threads,
        "preset": cfg.preset,
    }


def run(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    cfg = load_config(args)
    init_group(args)
    try:
        summary = train(args, cfg)
        # both ranks past their last transfer before either tears the group down: a rank that destroys
        # its group while the other still sends aborts in gloo's C++ threads (SIGABRT, "terminate called")
        dist.barrier()
        return summary
    finally:
        dist.destroy_process_group()


def run_in_thread(args: argparse.Namespace) -> dict:
    """`run` in a worker thread: the rendezvous and gloo's transfers wait in C++, where a signal handler
    never runs, so the main thread only waits and takes Ctrl-C / SIGTERM (KeyboardInterrupt)."""
    outcome: dict = {}

    def work() -> None:
        try:
            outcome["summary"] = run(args)
        except BaseException as exc:  # handed to the main thread
            outcome["error"] = exc

    worker = threading.Thread(target=work, name="gpipe", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(timeout=0.2)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["summary"]


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # a launcher's stop: as Ctrl-C
    try:
        summary = run_in_thread(args)
    except KeyboardInterrupt:
        print(f"gpipe rank {args.rank}: interrupted", file=sys.stderr, flush=True)
        os._exit(EXIT_INTERRUPTED)  # the worker may be blocked in gloo: do not wait for it
    except (RuntimeError, OSError, ValueError) as exc:  # a peer gone, a timeout, an unreachable master
        print(f"gpipe rank {args.rank}: failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    if args.rank == 0:
        print(
            f"gpipe: {summary['timed_steps']} timed steps, {summary['samples_per_s']:.1f} samples/s, "
            f"mean loss {summary['mean_loss']:.4f}",
            flush=True,
        )
        if args.summary_json:
            Path(args.summary_json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.summary_json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    code = main()
    # skip the interpreter's teardown: gloo's C++ threads outlive the group in some torch releases and
    # abort the process while static objects are destroyed, after all the work and output are done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
