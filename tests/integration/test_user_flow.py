"""The README's path from a folder of text to a model `transformers` loads, command by command, as a
user runs it: train a tokenizer, tokenize the folder into shards, train a Llama swarm on them with the
demo (stage checkpoints on), export a Hugging Face directory, load it with transformers."""

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(420)]
transformers = pytest.importorskip("transformers")

VOCAB = 1024
RUN_TOML = f"""preset = "llama-tiny"
[model]
vocab_size = {VOCAB}
[data]
source = "shards"
tokenizer = "tok.json"
[training]
max_samples = 2048
"""


def _swarmtrain(cwd: Path, *args: str, timeout_s: float = 240) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "swarmtrain.cli.main", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, f"swarmtrain {args[0]} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stdout


def _texts(folder: Path) -> None:
    """Real text a user might have: ~3 MB of this Python's standard library documentation strings and code."""
    folder.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for i, path in enumerate(sorted(stdlib.glob("*.py"))):
        shutil.copy(path, folder / f"doc{i:04d}.txt")
        total += path.stat().st_size
        if total > 3_000_000:
            break


def test_from_a_text_folder_to_a_model_transformers_loads(tmp_path):
    _texts(tmp_path / "texts")
    (tmp_path / "run.toml").write_text(RUN_TOML)
    _swarmtrain(
        tmp_path,
        "tokenizer",
        "train",
        "--vocab-size",
        str(VOCAB),
        "--out",
        "tok.json",
        "--no-progress",
        "texts",
    )
    _swarmtrain(
        tmp_path,
        "tokenize",
        "--tokenizer",
        "tok.json",
        "--val-fraction",
        "0.05",
        "--out",
        "shards",
        "--no-progress",
        "texts",
    )
    assert sorted(p.name for p in (tmp_path / "shards").glob("*.tok"))[:1] == ["train-00000.tok"]
    # 15 s of training (was 25): the exported model's loss is then ~0.9 below uniform where the check
    # needs 0.5 (two runs at 15 s: 5.94 and 6.01; one at 25 s: 5.69; uniform 6.93)
    out = _swarmtrain(
        tmp_path,
        "demo",
        "--config",
        "run.toml",
        "--checkpoint-dir",
        "ckpt",
        "--no-kill",
        "--duration-s",
        "15",
        "--no-monitor",
        "--no-reference",
        "--workdir",
        "demo",
        timeout_s=300,
    )
    assert "microbatches_failed            0" in out, out[-2000:]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["stage0", "stage1"]
    _swarmtrain(
        tmp_path, "export", "--checkpoint-dir", "ckpt", "--config", "run.toml", "--hf-out", "my-model"
    )

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "my-model", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "my-model")
    text = (tmp_path / "texts" / "doc0003.txt").read_text()[:2000]
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :64]
    assert tokenizer.decode(ids[0]) == text[: len(tokenizer.decode(ids[0]))]  # same text back
    import math

    loss = float(model(input_ids=ids, labels=ids).loss.detach())
    print(
        f"exported model: loss {loss:.3f} on a training document (uniform over {VOCAB} ids: {math.log(VOCAB):.3f})"
    )
    assert loss < math.log(VOCAB) - 0.5  # it trained: below guessing uniformly (~1 after 20 s here)
