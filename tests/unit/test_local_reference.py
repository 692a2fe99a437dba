"""`local_reference_val_loss`: the one-process run `swarmtrain demo` compares the swarm against. It must
be `train-local` on the same samples, with the schedule's horizon at training.max_samples whatever the
sample count (the stage servers' learning rate is a function of samples over that horizon)."""

import dataclasses
import json

import pytest

from swarmtrain.cli.main import main
from swarmtrain.config import load_run_config
from swarmtrain.data import iterate_batches
from swarmtrain.model.optim import lr_at
from swarmtrain.runtime.local import LocalTrainer, local_reference_val_loss

# torch on one thread: two xdist workers with torch's default threads each oversubscribe two cores
pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

SAMPLES = 256  # 8 steps of tiny's global batch of 32


@pytest.fixture
def run_toml(tmp_path, small_text_dir):
    """tiny on a small folder; warmup shorter than SAMPLES so that the horizon shapes the schedule."""
    path = tmp_path / "run.toml"
    path.write_text(
        'preset = "tiny"\n[training]\nwarmup_samples = 64\neval_samples = 32\n'
        f'[data]\nsource = "{small_text_dir}"\nvalidation_fraction = 0.1\n'
    )
    return path


def _with_horizon(run_toml, max_samples: int):
    cfg = load_run_config(run_toml)
    return cfg.replace(training=dataclasses.replace(cfg.training, max_samples=max_samples))


def test_reference_equals_train_local_on_the_same_samples(run_toml, tmp_path):
    summary = tmp_path / "local.json"
    argv = ["train-local", "--config", str(run_toml), "--max-samples", str(SAMPLES), "--no-progress"]
    assert main([*argv, "--summary-json", str(summary)]) == 0
    expected = json.loads(summary.read_text())["final_val_loss"]

    cfg = _with_horizon(run_toml, SAMPLES)
    # a partial global batch is not a step: 31 extra samples change nothing
    assert local_reference_val_loss(cfg, SAMPLES + 31) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("horizon", [4096, 128])  # longer than the run; shorter (then min_learning_rate)
def test_reference_keeps_the_horizon_of_max_samples(run_toml, horizon):
    cfg = _with_horizon(run_toml, horizon)
    t = cfg.training
    # the same steps by hand: the learning rate is lr_at(samples seen) over `horizon`, not over SAMPLES
    trainer = LocalTrainer(cfg, progress=False)
    batches = iterate_batches(trainer.train_set, t.micro_batch_size, seed=t.seed)
    for _ in range(SAMPLES // t.global_batch_size):
        trainer.step(batches)
    expected = trainer.val_loss()

    reference = local_reference_val_loss(cfg, SAMPLES)
    assert reference == pytest.approx(expected, abs=1e-6)
    if horizon < SAMPLES:
        assert lr_at(SAMPLES - t.global_batch_size, t) == t.min_learning_rate
    # and the horizon matters: a schedule ending at SAMPLES trains differently
    assert reference != pytest.approx(
        local_reference_val_loss(_with_horizon(run_toml, SAMPLES), SAMPLES), abs=1e-4
    )
