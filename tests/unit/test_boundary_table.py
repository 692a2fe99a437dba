"""A subspace run's fixed token table from the training data (data/token_table.py, `[model]
boundary_table`, `swarmtrain boundary-table`): counts, the table's rows, how the model takes the file,
what the digest holds, and the command's and flags' user errors."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch

from swarmtrain.cli.main import main
from swarmtrain.config import get_preset
from swarmtrain.config.errors import ConfigError
from swarmtrain.data import token_table
from swarmtrain.data.token_table import cooccurrence_counts
from swarmtrain.model.build import fixed_subspace
from swarmtrain.model.subspace import TABLE_SCALE, load_token_table, save_token_table

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]


def _subspace(table: str = "", preset: str = "llama-tiny"):
    cfg = get_preset(preset)
    model = dataclasses.replace(cfg.model, boundary="subspace", boundary_dim=4, boundary_table=table)
    return cfg.replace(model=model)


def _sentences(seed: int = 0, rows: int = 400) -> np.ndarray:
    """Rows of 'a X b' over 12 ids: 1 and 2 occur only between 5 and 6, 3 and 4 only between 7 and 8,
    0 and 9 are fillers, 10 occurs rarely, 11 never."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rows):
        if rng.random() < 0.5:
            out += [5, rng.choice([1, 2]), 6]
        else:
            out += [7, rng.choice([3, 4]), 8]
        out += [rng.choice([0, 9])] + ([10] if rng.random() < 0.05 else [])
    return np.asarray(out[: len(out) // 16 * 16]).reshape(-1, 16)


def test_counts_are_symmetric_weighted_by_distance_and_never_cross_rows():
    counts = cooccurrence_counts([np.array([[0, 1, 2], [3, 4, 0]])], vocab_size=5, window=2).to_dense()
    assert torch.equal(counts, counts.T)
    assert counts[0, 1] == 1.0 and counts[1, 2] == 1.0 and counts[0, 2] == 0.5  # 1 / distance
    assert counts[2, 3] == 0.0  # 2 ends one row, 3 starts the next
    assert counts[4, 0] == 1.0 and counts[3, 0] == 0.5
    # batches add up as one: the same counts from the rows one at a time
    one_by_one = cooccurrence_counts([np.array([[0, 1, 2]]), np.array([[3, 4, 0]])], 5, window=2)
    assert torch.equal(one_by_one.to_dense(), counts)


def test_tokens_used_alike_get_alike_rows_and_a_token_never_seen_a_zero_row():
    table = token_table.token_table(cooccurrence_counts([_sentences()], vocab_size=12), dim=4)
    assert table.shape == (12, 4) and table.dtype == torch.float32
    norms = table.norm(dim=1)
    assert norms[11] == 0.0  # never seen: the model draws its row from the seed
    torch.testing.assert_close(norms[:11], torch.full((11,), 2.0))  # sqrt(dim): unit-variance entries
    unit = table[:11] / norms[:11, None]
    assert unit[1] @ unit[2] > 0.95 and unit[3] @ unit[4] > 0.95  # the same contexts
    assert unit[1] @ unit[3] < 0.5  # other contexts
    # a vocabulary smaller than d_model: the columns past its rank stay zero
    wide = token_table.token_table(cooccurrence_counts([_sentences()], vocab_size=12), dim=16)
    assert torch.count_nonzero(wide[:, 12:]) == 0


def test_a_large_vocabularys_randomized_svd_gives_the_dense_table_where_it_is_exact(monkeypatch):
    counts = cooccurrence_counts([_sentences(seed=1)], vocab_size=12)
    dense = token_table.token_table(counts, dim=12)
    monkeypatch.setattr(token_table, "DENSE_MAX_VOCAB", 4)  # the sparse path; q = vocab: exact
    sparse = token_table.token_table(counts, dim=12)
    torch.testing.assert_close(sparse @ sparse.T, dense @ dense.T, rtol=1e-3, atol=1e-3)
    assert torch.equal(token_table.token_table(counts, dim=12), sparse)  # seeded: the same table again


def test_a_table_file_gives_e0_its_rows_at_e0s_scale_and_zero_rows_the_seeds_draw(tmp_path):
    model = _subspace().model
    rows = torch.randn(model.vocab_size, model.d_model, generator=torch.Generator().manual_seed(3))
    rows[5:9] = 0.0
    save_token_table(tmp_path / "t.safetensors", rows)
    cfg = _subspace(str(tmp_path / "t.safetensors"))
    basis, table = fixed_subspace(cfg.model, cfg.training.seed)
    drawn_basis, drawn = fixed_subspace(_subspace().model, cfg.training.seed)
    scale = TABLE_SCALE * model.init_std
    torch.testing.assert_close(table[:5], rows[:5] * scale)
    torch.testing.assert_close(table[9:], rows[9:] * scale)
    assert torch.equal(table[5:9], drawn[5:9]) and torch.equal(basis, drawn_basis)


def test_a_table_of_another_shape_or_not_finite_or_not_a_table_is_one_config_error(tmp_path):
    model = _subspace().model
    cases = {
        "shape": torch.zeros(model.vocab_size, model.d_model + 1),
        "nan": torch.full((model.vocab_size, model.d_model), float("nan")),
    }
    for name, rows in cases.items():
        save_token_table(tmp_path / f"{name}.safetensors", rows)
    (tmp_path / "junk.safetensors").write_bytes(b"not a table")
    for name, words in (("shape", "the model needs"), ("nan", "non-finite"), ("junk", "not a readable")):
        with pytest.raises(ConfigError, match=words):
            load_token_table(tmp_path / f"{name}.safetensors", model)
    with pytest.raises(ConfigError, match="no such file"):
        _subspace(str(tmp_path / "missing.safetensors"))
    with pytest.raises(ConfigError, match='needs model.boundary = "subspace"'):
        dataclasses.replace(
            get_preset("llama-tiny").model, boundary_table=str(tmp_path / "shape.safetensors")
        )


def test_the_digest_holds_the_tables_content_not_its_path(tmp_path):
    model = _subspace().model
    save_token_table(tmp_path / "a.safetensors", torch.ones(model.vocab_size, model.d_model))
    shutil.copy(tmp_path / "a.safetensors", tmp_path / "copy.safetensors")
    save_token_table(tmp_path / "b.safetensors", torch.full((model.vocab_size, model.d_model), 2.0))
    digests = {name: _subspace(str(tmp_path / f"{name}.safetensors")).digest() for name in ("a", "copy", "b")}
    assert digests["a"] == digests["copy"]  # each peer keeps its copy where it likes
    assert len({digests["a"], digests["b"], _subspace().digest()}) == 3
    summary = _subspace(str(tmp_path / "a.safetensors")).settings_summary()
    assert "a.safetensors" not in summary["model.boundary_table"]  # the content's hash, not the path


def test_the_command_writes_a_table_the_flags_take_and_user_mistakes_are_one_line(tmp_path, capsys):
    out = tmp_path / "table.safetensors"
    assert main(["boundary-table", "--preset", "llama-tiny", "--max-tokens", "20000", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"wrote {out}: 2,048 x 64 token table from 19,968 tokens" in said
    rows = load_token_table(out, _subspace().model)
    assert 0 < int((rows.abs().sum(dim=1) > 0).sum()) < 2048  # 20k tokens do not use every id
    run = tmp_path / "run.toml"
    run.write_text('preset = "llama-tiny"\n[training]\nmax_samples = 64\neval_samples = 32\n')
    flags = ["--boundary", "subspace", "--boundary-dim", "4", "--boundary-table", str(out)]
    assert main(["train-local", "--config", str(run), "--threads", "1", "--no-progress", *flags]) == 0
    capsys.readouterr()
    for argv, words in (
        (["--boundary-table", str(out)], "--boundary-table needs --boundary subspace"),
        (
            ["--boundary", "lowrank", "--boundary-dim", "4", "--boundary-table", str(out)],
            "needs --boundary subspace",
        ),
        ([*flags[:4], "--boundary-table", str(tmp_path / "nope")], "no such file"),
    ):
        assert main(["train-local", "--preset", "llama-tiny", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and "\n" not in err, err
