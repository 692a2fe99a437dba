"""A stage's checkpoints on disk: periodic, written off the compute thread, atomic, the last K kept.

Layout: `DIR/stage{i}/step{k:08d}.safetensors` + `step{k:08d}.json`. The tensors file holds the
stage's parameters under their global names (`layers.<i>.<param>`, as `model/checkpoint.py` writes, so
`swarmtrain export` can assemble a whole model from stage files) and AdamW's state under
`optimizer.<key>.<name>`. The JSON manifest (run id, config digest, stage, step, samples, layer range)
is written last: a checkpoint without its manifest is incomplete and never read. Both are written to a
temporary name and renamed, so a crash mid-write leaves the previous checkpoint intact, and replicas of
a stage may share one directory (they hold identical state at a given step, so concurrent writers
rename identical files).
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from swarmtrain.config import RunConfig
from swarmtrain.config.errors import UserError
from swarmtrain.config.model import StageSpec
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

OPTIMIZER_KEYS = ("exp_avg", "exp_avg_sq", "step")
_NAME = re.compile(r"^step(\d{8})\.json$")


class StageCheckpointError(UserError):
    """A stage checkpoint cannot be written or read (permissions, disk, a foreign or corrupt file)."""


@dataclass(frozen=True)
class CheckpointSettings:
    directory: Path
    every_steps: int = 50  # 0: not by steps
    every_s: float = 0.0  # 0: not by time; otherwise at the first step boundary after every_s
    keep: int = 3


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint found on disk."""

    manifest_path: Path
    tensors_path: Path
    manifest: dict

    @property
    def step(self) -> int:
        return int(self.manifest["step"])


def stage_dir(directory: str | Path, stage: int) -> Path:
    return Path(directory) / f"stage{stage}"


def state_to_tensors(meta: dict, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """StageWorker.export_state()'s (meta, [params, exp_avg, exp_avg_sq, step]) as named tensors."""
    names, n = meta["names"], len(meta["names"])
    named = {name: tensors[i] for i, name in enumerate(names)}
    for k, key in enumerate(OPTIMIZER_KEYS, start=1):
        named.update({f"optimizer.{key}.{name}": tensors[k * n + i] for i, name in enumerate(names)})
    return {k: v.detach().cpu().contiguous() for k, v in named.items()}


def tensors_to_state(named: dict[str, torch.Tensor], names: list[str]) -> list[torch.Tensor]:
    """The inverse of state_to_tensors, in StageWorker.import_state's order."""
    keys = list(names) + [f"optimizer.{key}.{name}" for key in OPTIMIZER_KEYS for name in names]
    missing = [k for k in keys if k not in named]
    if missing:
        raise StageCheckpointError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {missing[0]}")
    return [named[k] for k in keys]


def write_checkpoint(directory: Path, manifest: dict, named: dict[str, torch.Tensor]) -> Path:
    """Tensors then manifest, each via a temporary file and an atomic rename; returns the manifest path."""
    directory.mkdir(parents=True, exist_ok=True)
    base = f"step{int(manifest['step']):08d}"
    suffix = f".tmp{threading.get_ident()}"
    tensors_tmp = directory / f"{base}.safetensors{suffix}"
    manifest_tmp = directory / f"{base}.json{suffix}"
    save_file(named, str(tensors_tmp), metadata={"step": str(manifest["step"])})
    tensors_tmp.replace(directory / f"{base}.safetensors")
    manifest_tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    manifest_tmp.replace(directory / f"{base}.json")
    return directory / f"{base}.json"


def list_checkpoints(directory: str | Path, stage: int, digest: str | None = None) -> list[Checkpoint]:
    """Complete checkpoints of `stage` (of this config digest, when given), oldest first. Unreadable
    or foreign manifests are skipped with a warning, never fatal: an older good one may exist."""
    found = []
    folder = stage_dir(directory, stage)
    if not folder.is_dir():
        return []
    for path in sorted(folder.iterdir()):
        if not _NAME.match(path.name):
            continue
        try:
            manifest = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            logger.warning("ignoring unreadable checkpoint manifest %s: %s", path, exc)
            continue
        tensors = path.with_suffix(".safetensors")
        if manifest.get("stage") != stage or not tensors.is_file():
            continue
        if digest is not None and manifest.get("digest") != digest:
            logger.warning(
                "ignoring checkpoint %s: made by another run config (digest %s, ours %s)",
                path,
                manifest.get("digest"),
                digest,
            )
            continue
        found.append(Checkpoint(path, tensors, manifest))
    return sorted(found, key=lambda c: c.step)


def read_checkpoint(checkpoint: Checkpoint, names: list[str]) -> tuple[dict, list[torch.Tensor]]:
    """(meta, tensors) for StageWorker.import_state."""
    try:
        named = load_file(str(checkpoint.tensors_path))
    except Exception as exc:  # safetensors raises several types for corrupt files
        raise StageCheckpointError(f"cannot read {checkpoint.tensors_path}: {exc}") from None
    m = checkpoint.manifest
    meta = {"epoch": m["step"], "samples_seen": m["samples_seen"], "names": names, "digest": m["digest"]}
    return meta, tensors_to_state(named, names)


class StageCheckpointer:
    """Decides when to save, snapshots on the caller's thread (a copy under the worker's state lock),
    writes on its own thread; at most one write is queued (a slow disk skips checkpoints, never
    stalls training)."""

    def __init__(self, settings: CheckpointSettings, stage: int, identity: dict, export_state) -> None:
        if settings.keep < 1:
            raise StageCheckpointError("checkpoints to keep must be >= 1")
        self.settings, self.stage = settings, stage
        self.identity = identity  # run_id, digest, layer range: written into every manifest
        self.export_state = export_state
        self.folder = stage_dir(settings.directory, stage)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._pending: Future | None = None
        self._last_step = -1
        self._last_time_s = time.monotonic()
        self.saved: list[int] = []
        self.write_s = 0.0

    def load_newest(self, names: list[str]) -> tuple[Checkpoint, dict, list[torch.Tensor]] | None:
        """The newest readable checkpoint of this stage and run config; a corrupt one is skipped with
        a warning (an older one may still be good)."""
        for checkpoint in reversed(
            list_checkpoints(self.settings.directory, self.stage, self.identity["digest"])
        ):
            try:
                return (checkpoint, *read_checkpoint(checkpoint, names))
            except StageCheckpointError as exc:
                logger.warning("skipping checkpoint: %s", exc)
        return None

    def due(self, step: int) -> bool:
        s = self.settings
        if step <= self._last_step:
            return False
        by_steps = s.every_steps > 0 and step % s.every_steps == 0
        by_time = s.every_s > 0 and time.monotonic() - self._last_time_s >= s.every_s
        return by_steps or by_time

    def after_step(self, step: int, live: bool = True) -> None:
        """Called with the new epoch after every applied step. A step replayed from a peer's means
        (`live` False) is not saved: the replicas that ran it live save it, and the checkpoint directory
        is shared, so a replayer's file of the same step would replace theirs, and a replayer is the one
        replica whose state is not yet checked against its stage's (its parameters' fingerprint is
        compared after the replay: a replica that had stepped alone before replaying differs)."""
        if live and self.due(step) and (self._pending is None or self._pending.done()):
            self.save(step)

    def save(self, step: int) -> Future:
        meta, tensors = self.export_state()
        if int(meta["epoch"]) != step:  # a resync moved the state since: save what it is now
            step = int(meta["epoch"])
        self._last_step, self._last_time_s = step, time.monotonic()
        manifest = dict(self.identity, stage=self.stage, step=step, samples_seen=int(meta["samples_seen"]))
        self._pending = self._executor.submit(self._write, manifest, state_to_tensors(meta, tensors))
        return self._pending

    def save_and_wait(self, step: int, timeout_s: float = 60.0) -> None:
        """On shutdown: the current state, written before returning."""
        if self._pending is not None:
            self._pending.result(timeout=timeout_s)
        if step != self._last_step:
            self.save(step).result(timeout=timeout_s)

    def _write(self, manifest: dict, named: dict[str, torch.Tensor]) -> None:
        start_s = time.monotonic()
        try:
            manifest["saved_at_unix_s"] = round(time.time(), 3)
            path = write_checkpoint(self.folder, manifest, named)
        except OSError as exc:
            logger.error("checkpoint of stage %d step %d failed: %s", self.stage, manifest["step"], exc)
            return
        self.write_s = time.monotonic() - start_s
        self.saved.append(int(manifest["step"]))
        logger.info("checkpoint %s written in %.2fs", path, self.write_s)
        self._prune()

    def _prune(self) -> None:
        complete = list_checkpoints(self.settings.directory, self.stage, self.identity.get("digest"))
        for old in complete[: -self.settings.keep]:
            for path in (old.manifest_path, old.tensors_path):  # manifest first: never a half pair read
                path.unlink(missing_ok=True)

    def close(self) -> None:
        self._executor.shutdown(wait=True)


# export -------------------------------------------------------------------------------------------
def export_model(directory: str | Path, step: int | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """The whole model's parameters from the stage checkpoints in `directory` (DIR/stage<i>/), at the
    newest step every stage has (or `step`), plus metadata; optimizer state is left out."""
    directory = Path(directory)
    per_stage = _checkpoints_per_stage(directory)
    common = set.intersection(*(set(found) for found in per_stage.values()))
    if step is None and not common:
        have = "; ".join(f"stage {s}: steps {sorted(found)}" for s, found in sorted(per_stage.items()))
        raise StageCheckpointError(f"no step has a checkpoint of every stage in {directory} ({have})")
    chosen = max(common) if step is None else step
    if chosen not in common:
        raise StageCheckpointError(
            f"step {chosen} is not checkpointed by every stage (common: {sorted(common)})"
        )
    named: dict[str, torch.Tensor] = {}
    for stage in sorted(per_stage):
        checkpoint = per_stage[stage][chosen]
        try:
            tensors = load_file(str(checkpoint.tensors_path))
        except Exception as exc:  # safetensors raises several types for corrupt files
            raise StageCheckpointError(f"cannot read {checkpoint.tensors_path}: {exc}") from None
        named.update({k: v for k, v in tensors.items() if not k.startswith("optimizer.")})
    first = per_stage[min(per_stage)][chosen].manifest
    meta = {
        "step": chosen,
        "digest": first["digest"],
        "run_id": first.get("run_id"),
        "stages": len(per_stage),
    }
    meta["samples_seen"] = first.get("samples_seen")
    meta["preset"] = first.get("preset")  # the run's preset name (its --config overrides are not recorded)
    return named, meta


def _checkpoints_per_stage(directory: Path) -> dict[int, dict[int, Checkpoint]]:
    if not directory.is_dir():
        raise StageCheckpointError(f"checkpoint directory not found: {directory}")
    stages = sorted(int(p.name[5:]) for p in directory.glob("stage*") if p.name[5:].isdigit())
    per_stage = {s: {c.step: c for c in list_checkpoints(directory, s)} for s in stages}
    per_stage = {s: found for s, found in per_stage.items() if found}
    if not per_stage:
        raise StageCheckpointError(
            f"no stage checkpoints in {directory} (expected {directory}/stage<N>/step*.json)"
        )
    manifests = [c.manifest for found in per_stage.values() for c in found.values()]
    digests = {m.get("digest") for m in manifests}
    if len(digests) > 1:
        raise StageCheckpointError(
            f"{directory} mixes checkpoints of several run configs: {sorted(map(str, digests))}"
        )
    expected = {int(m.get("num_stages", 0)) for m in manifests}
    missing = [s for s in range(max(expected | {len(per_stage)})) if s not in per_stage]
    if missing:
        raise StageCheckpointError(
            f"{directory} has no checkpoint of stage(s) {missing}; the model is incomplete"
        )
    return per_stage


def checkpointer_for(
    cfg: RunConfig, directory: str | None, spec: StageSpec, digest: str, export_state
) -> StageCheckpointer | None:
    """The checkpointer of one stage replica: into `directory` (default: the run's
    `swarm.checkpoint_dir`), None when neither names one."""
    directory = directory or cfg.swarm.checkpoint_dir
    if not directory:
        return None
    swarm = cfg.swarm
    settings = CheckpointSettings(
        directory=Path(directory),
        every_steps=swarm.checkpoint_every_steps,
        every_s=swarm.checkpoint_every_s,
        keep=swarm.checkpoint_keep,
    )
    identity = {
        "run_id": swarm.run_id,
        "digest": digest,
        "preset": cfg.preset,
        "layer_start": spec.layer_start,
        "layer_end": spec.layer_end,
        "num_stages": swarm.num_stages,
    }
    return StageCheckpointer(settings, spec.index, identity, export_state)
