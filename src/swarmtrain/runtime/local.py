"""The single-process reference run that every distributed mode is compared against.

Same model code, optimizer and schedule as the stage servers; accumulation of micro-batches up to
the global batch; gradient clipping; periodic validation; checkpoint and resume.
`local_reference_val_loss` replays a swarm run's samples on one process, for `swarmtrain demo`'s
side-by-side comparison.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from swarmtrain.config import RunConfig, TrainingConfig
from swarmtrain.config.errors import UserError
from swarmtrain.data import PackedDataset, build_datasets, iterate_batches
from swarmtrain.model import build_model, load_model_checkpoint, save_model_checkpoint
from swarmtrain.model.device import CPU_FP32, ComputeDevice
from swarmtrain.model.hf_checkpoint import load_stage_from_hf
from swarmtrain.model.optim import build_optimizer, lr_at, set_lr
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass
class LocalResult:
    initial_val_loss: float
    final_val_loss: float
    samples: int
    samples_per_s: float
    val_history: list[tuple[int, float]] = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "initial_val_loss": self.initial_val_loss,
            "final_val_loss": self.final_val_loss,
            "samples": self.samples,
            "samples_per_s": self.samples_per_s,
        }


@torch.no_grad()
def validation_loss(
    model: torch.nn.Module,
    val: PackedDataset,
    batch_size: int,
    max_samples: int,
    compute: ComputeDevice = CPU_FP32,
) -> float:
    """Mean next-token loss over the first `max_samples` validation samples (weighted by batch size),
    computed as training computes (`compute`: the model's device and autocast dtype)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for inputs, labels in val.ordered_batches(batch_size, max_samples):
        with compute.autocast():
            loss = model(compute.to_device(inputs), compute.to_device(labels))
        total += loss.item() * inputs.shape[0]
        count += inputs.shape[0]
    model.train(was_training)
    return total / count


class LocalTrainer:
    def __init__(
        self,
        cfg: RunConfig,
        checkpoint_dir: str | Path | None = None,
        progress: bool = True,
        init_from: str | Path | None = None,
        init_from_hf: str | Path | None = None,
        compute: ComputeDevice = CPU_FP32,
    ) -> None:
        """`init_from`: a whole-model safetensors file (`swarmtrain export`'s output) whose weights
        replace the initial ones; `init_from_hf`: likewise from a Hugging Face model directory (whose
        config.json `cfg.model` was derived from). The optimizer and schedule start fresh. A checkpoint
        in `checkpoint_dir`, when there is one, is resumed instead. `compute`: the device the model
        lives on (fp32 parameters and optimizer state) and the dtype its compute runs in."""
        if init_from is not None and init_from_hf is not None:
            raise UserError("start from one set of weights: --init-from or --init-from-hf, not both")
        self.cfg = cfg
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.progress = progress
        self.model = build_model(cfg.model, seed=cfg.training.seed, cuts=cfg.boundary_cuts())
        if init_from is not None:
            load_model_checkpoint(self.model, init_from)
        if init_from_hf is not None:
            load_stage_from_hf(self.model, init_from_hf)
        self.compute = compute
        self.model.to(compute.device)  # before the optimizer: its state is made where the parameters are
        self.optimizer = build_optimizer(self.model, cfg.training)
        self.scaler = compute.grad_scaler()
        self.samples_seen = 0
        self.train_set, self.val_set = build_datasets(cfg)

    # checkpoints --------------------------------------------------------------------------------
    def save(self) -> None:
        if not self.checkpoint_dir:
            return
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        save_model_checkpoint(self.model, self.checkpoint_dir / "model.safetensors")
        torch.save(self.optimizer.state_dict(), self.checkpoint_dir / "optimizer.pt")
        if self.scaler is not None:  # fp16: the loss scale it has found, so a resume does not search again
            torch.save(self.scaler.state_dict(), self.checkpoint_dir / "grad_scaler.pt")
        meta = {
            "samples_seen": self.samples_seen,
            "digest": _resume_digest(self.cfg),
            "preset": self.cfg.preset,
        }
        (self.checkpoint_dir / "meta.json").write_text(json.dumps(meta))

    def try_resume(self) -> bool:
        meta_path = self.checkpoint_dir / "meta.json" if self.checkpoint_dir else None
        if not meta_path or not meta_path.is_file():
            return False
        meta = json.loads(meta_path.read_text())
        if meta.get("digest") != _resume_digest(self.cfg):
            raise UserError(
                f"checkpoint in {self.checkpoint_dir} was made with a different config (digest {meta.get('digest')}, "
                f"this run {_resume_digest(self.cfg)}); use another --checkpoint-dir"
            )
        load_model_checkpoint(self.model, self.checkpoint_dir / "model.safetensors")
        self.optimizer.load_state_dict(torch.load(self.checkpoint_dir / "optimizer.pt", weights_only=True))
        scaler_path = self.checkpoint_dir / "grad_scaler.pt"
        if self.scaler is not None and scaler_path.is_file():
            self.scaler.load_state_dict(torch.load(scaler_path, weights_only=True))
        self.samples_seen = int(meta["samples_seen"])
        logger.info("resumed from %s at %d samples", self.checkpoint_dir, self.samples_seen)
        return True

    # training -----------------------------------------------------------------------------------
    def val_loss(self) -> float:
        t = self.cfg.training
        return validation_loss(self.model, self.val_set, t.micro_batch_size, t.eval_samples, self.compute)

    def step(self, batches) -> float:
        """One optimizer step over the global batch; returns the mean training loss."""
        t = self.cfg.training
        accumulation = t.global_batch_size // t.micro_batch_size
        loss = optimizer_step(
            self.model,
            self.optimizer,
            batches,
            accumulation,
            lr_at(self.samples_seen, t),
            t,
            compute=self.compute,
            scaler=self.scaler,
        )
        self.samples_seen += t.global_batch_size
        return loss

    def train(self, stop_samples: int | None = None) -> LocalResult:
        """Train whole global batches until `stop_samples` (default: training.max_samples).

        The stop is separate from the schedule: the learning rate always decays over
        training.max_samples, so stopping early or going past it (at min_learning_rate) replays
        exactly the steps a longer or shorter run with the same config takes.
        """
        t = self.cfg.training
        stop = t.max_samples if stop_samples is None else stop_samples
        self.try_resume()
        history = [(self.samples_seen, self.val_loss())]
        batches = iterate_batches(
            self.train_set, t.micro_batch_size, seed=t.seed, skip_samples=self.samples_seen
        )
        bar = _progress_bar(stop, self.samples_seen, self.progress)
        trained_samples, train_time_s, next_eval = (
            0,
            0.0,
            self.samples_seen + (t.eval_every_samples or stop),
        )
        while self.samples_seen + t.global_batch_size <= stop:
            start = time.perf_counter()
            loss = self.step(batches)
            train_time_s += time.perf_counter() - start
            trained_samples += t.global_batch_size
            bar.update(t.global_batch_size)
            bar.set_postfix(loss=f"{loss:.3f}", samples_per_s=f"{trained_samples / train_time_s:.1f}")
            if self.samples_seen >= next_eval:
                history.append((self.samples_seen, self.val_loss()))
                bar.write(f"samples {self.samples_seen}: val_loss {history[-1][1]:.4f}")
                next_eval += t.eval_every_samples or stop
                self.save()
        bar.close()
        if history[-1][0] != self.samples_seen:
            history.append((self.samples_seen, self.val_loss()))
        self.save()
        return LocalResult(
            initial_val_loss=history[0][1],
            final_val_loss=history[-1][1],
            samples=trained_samples,
            samples_per_s=trained_samples / train_time_s if train_time_s else 0.0,
            val_history=history,
        )


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches,
    accumulation: int,
    lr: float,
    t: TrainingConfig,
    loss_and_backward=None,
    compute: ComputeDevice = CPU_FP32,
    scaler: torch.amp.GradScaler | None = None,
) -> float:
    """Accumulate `accumulation` micro-batches' mean gradient, clip it to the global norm, step at `lr`;
    returns the mean training loss. The one training step of every whole-model mode (local, replicas).
    `loss_and_backward(inputs, labels, scale) -> loss` replaces the resident forward and backward (the
    layer swapper's streamed pass). `compute`: where the model is and the autocast dtype; `scaler`:
    fp16's loss scaler (the gradients are unscaled before clipping; a step with non-finite gradients is
    skipped by the scaler and the scale lowered)."""
    set_lr(optimizer, lr)
    # summed on the device (one synchronize per step) in float64, as a sum of Python floats would be
    total = torch.zeros((), dtype=torch.float64, device=compute.device)
    for _ in range(accumulation):
        inputs, labels = next(batches)
        if loss_and_backward is None:
            with compute.autocast():
                loss = model(compute.to_device(inputs), compute.to_device(labels))
            scaled = loss / accumulation
            (scaled if scaler is None else scaler.scale(scaled)).backward()
            total += loss.detach()
        else:
            total += loss_and_backward(inputs, labels, 1.0 / accumulation)
    if scaler is not None:
        scaler.unscale_(optimizer)
    if t.grad_clip_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip_norm)
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return float(total) / accumulation


def local_reference_val_loss(
    cfg: RunConfig,
    samples: int,
    progress: bool = False,
    eval_samples: int | None = None,
    init_from_hf: str | Path | None = None,
    compute: ComputeDevice = CPU_FP32,
) -> float:
    """Validation loss of one process after the first `samples` training samples, as `train-local`
    trains them: same initial weights (seed), same data order, AdamW, accumulation to the global batch,
    clipping, and the learning-rate schedule over training.max_samples (the horizon the swarm's stage
    servers use, whatever `samples` is). `samples` is rounded down to whole global batches, since
    optimizer steps are; evaluated on the first `eval_samples` validation samples (default:
    training.eval_samples), like the swarm trainer's own evaluation. Uses torch's threads as set.
    `init_from_hf`: the swarm's servers started from that Hugging Face model directory, so does this.
    `compute`: the device and dtype to train on.
    """
    t = cfg.training
    stop = samples // t.global_batch_size * t.global_batch_size
    # Only the loss after the last step is wanted: a period past the stop skips the periodic
    # evaluations and their log lines (evaluating does not change training, so the result is the same).
    training = dataclasses.replace(
        t, eval_every_samples=stop + t.global_batch_size, eval_samples=eval_samples or t.eval_samples
    )
    cfg = cfg.replace(training=training)
    trainer = LocalTrainer(cfg, progress=progress, init_from_hf=init_from_hf, compute=compute)
    return trainer.train(stop_samples=stop).final_val_loss


def _resume_digest(cfg: RunConfig) -> str:
    """The config digest without the schedule horizon: one process may extend its own run with a
    larger --max-samples (swarm peers may not: their digest includes it, so they share one schedule)."""
    return cfg.replace(training=dataclasses.replace(cfg.training, max_samples=1)).digest()


def _progress_bar(total: int, initial: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="sample", disable=not enabled, dynamic_ncols=True)
