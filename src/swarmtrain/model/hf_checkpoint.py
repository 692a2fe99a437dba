"""Hugging Face checkpoints in and out: fill a built stage from a local model directory
(`load_stage_from_hf`), and write a whole model as one that `transformers` loads (`save_hf_model`).

Reading: a directory with `config.json` and either `model.safetensors` or shards named by
`model.safetensors.index.json`. A stage opens only the files that hold its own tensors and reads only those
tensors (`safe_open(...).get_slice/get_tensor`), one at a time, so a server's memory grows with its stage,
never with the whole model. Tensors of any float dtype (bf16, fp16) are converted into the stage's fp32
parameters.

Names: the llama family's parameter names are Hugging Face's `LlamaForCausalLM` names, so they map 1:1.
GPT-2 (`GPT2LMHeadModel`) maps onto our GPT layout: `transformer.h.<i>.attn.c_attn` -> `layers.<i>.qkv`,
and so on; GPT-2's Conv1D weights are stored [in, out] and are transposed; only the first `seq_len`
position embeddings are read (positions past the run's sequence length are never used). Tied heads:
our GPT head, and a llama head of a model configured untied, is its own matrix; from a tied checkpoint
(no `lm_head.weight`, `tie_word_embeddings`) it starts as a copy of the token embedding and is trained
apart from it from then on (said in the log). An untied checkpoint that lacks `lm_head.weight` is broken
and refused.

Writing: `config.json` (config/hf_config.py), safetensors shards of at most `max_shard_bytes` (with the
index when there is more than one), and the tokenizer; all into a hidden temporary directory renamed
into place at the end, so a crash never leaves a directory that looks complete. Shared layers
(`shared_layer_repeats = k`) are unrolled: unique layer i becomes layers i*k .. i*k+k-1, which computes
the same function (each unique layer is applied k times in a row).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from swarmtrain.config.errors import ConfigError
from swarmtrain.config.hf_config import (
    gpt2_activation_note,
    hf_config_from_model,
    model_config_from_hf,
    read_hf_config,
)
from swarmtrain.config.model import ModelConfig, StageSpec
from swarmtrain.model.checkpoint import CheckpointError
from swarmtrain.model.gpt import GPTStage
from swarmtrain.model.llama import LlamaStage
from swarmtrain.model.stage import DecoderStage
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 2 << 30  # 2 GiB, as many published checkpoints are cut
EOS_TOKEN = "<|endoftext|>"  # the end-of-document token of the tokenizers swarmtrain trains
# what an export directory holds: an existing directory with nothing else in it may be replaced
_EXPORT_FILES = re.compile(
    r"^(config\.json|generation_config\.json|model(-\d{5}-of-\d{5})?\.safetensors|"
    r"model\.safetensors\.index\.json|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json)$"
)
_GPT_LAYER = re.compile(r"^layers\.(\d+)\.(\w+)\.(weight|bias)$")
_HF_LAYER = re.compile(r"^(model\.layers\.|transformer\.h\.)(\d+)\.(.+)$")
# our GPT block's modules -> GPT-2's, and whether the weight is a Conv1D ([in, out], transposed)
_GPT2_BLOCK = {
    "ln_attn": ("ln_1", False),
    "qkv": ("attn.c_attn", True),
    "proj": ("attn.c_proj", True),
    "ln_mlp": ("ln_2", False),
    "fc_in": ("mlp.c_fc", True),
    "fc_out": ("mlp.c_proj", True),
}
_GPT2_PREFIX = "transformer."


@dataclass(frozen=True)
class Source:
    """Where one of our parameters is in a Hugging Face checkpoint."""

    name: str
    transpose: bool = False  # GPT-2 Conv1D weights are stored [in, out]
    rows: int | None = None  # only the first `rows` rows (GPT-2 positions past seq_len)
    tied_fallback: str | None = None  # an untied head from a tied checkpoint: a copy of this one


@dataclass
class LoadReport:
    """What `load_stage_from_hf` read, for the log line."""

    files: list[str] = field(default_factory=list)
    files_in_checkpoint: int = 0
    tensors: int = 0
    bytes_read: int = 0
    notes: list[str] = field(default_factory=list)


@dataclass
class SaveReport:
    """What `save_hf_model` wrote."""

    directory: Path
    files: list[str]
    parameters: int
    bytes_written: int
    tokenizer: str | None


def hf_source(cfg: ModelConfig, name: str) -> Source:
    """Where our parameter `name` (of a model with unrolled layers: layer i is Hugging Face layer i) is in
    a Hugging Face checkpoint of the same architecture."""
    if cfg.arch == "llama":
        if name == "lm_head.weight":
            return Source(name, tied_fallback="model.embed_tokens.weight")
        return Source(name)
    fixed = {
        "tok_emb.weight": Source(_GPT2_PREFIX + "wte.weight"),
        "pos_emb.weight": Source(_GPT2_PREFIX + "wpe.weight", rows=cfg.seq_len),
        "ln_f.weight": Source(_GPT2_PREFIX + "ln_f.weight"),
        "ln_f.bias": Source(_GPT2_PREFIX + "ln_f.bias"),
        "lm_head.weight": Source("lm_head.weight", tied_fallback=_GPT2_PREFIX + "wte.weight"),
    }
    if name in fixed:
        return fixed[name]
    match = _GPT_LAYER.match(name)
    if match is None or match.group(2) not in _GPT2_BLOCK:
        raise CheckpointError(f"no GPT-2 name for parameter {name!r}")
    layer, module, kind = match.groups()
    hf_module, conv1d = _GPT2_BLOCK[module]
    return Source(f"{_GPT2_PREFIX}h.{layer}.{hf_module}.{kind}", transpose=conv1d and kind == "weight")


# reading ----------------------------------------------------------------------------------------------
def load_stage_from_hf(stage: DecoderStage, model_dir: str | Path) -> LoadReport:
    """Fill `stage` (already built) with its parameters from the Hugging Face model in `model_dir`.

    The stage's config must describe the checkpoint's model (`config.model_config_from_hf` derives it);
    a different shape, a missing tensor or file, or a tensor of another shape is a `CheckpointError`
    naming it. Reads only this stage's tensors, from only the files that hold them."""
    model_dir = Path(model_dir).expanduser()
    raw = read_hf_config(model_dir)
    report = LoadReport()
    _check_same_model(raw, stage.cfg, model_dir)
    tied_checkpoint = bool(raw.get("tie_word_embeddings", raw.get("model_type") == "gpt2"))
    file_of = _weight_files(model_dir)
    report.files_in_checkpoint = len(set(file_of.values()))
    plan: dict[Path, list[tuple[str, Source, str]]] = {}  # file -> (our name, source, name in the file)
    missing = []
    for name, _param in stage.named_parameters():
        source = hf_source(stage.cfg, name)
        found = _stored_name(source.name, file_of)
        if found is None and source.tied_fallback is not None and tied_checkpoint:
            found = _stored_name(source.tied_fallback, file_of)
            if found is not None:
                report.notes.append(
                    f"{name} starts as a copy of {found} (the checkpoint ties its head to the token "
                    f"embedding; here they are separate matrices and train apart)"
                )
        if found is None:
            missing.append(source.name)
            continue
        plan.setdefault(file_of[found], []).append((name, source, found))
    if missing:
        raise CheckpointError(
            f"{model_dir} lacks {len(missing)} tensor(s) stage {stage.spec.index} needs, e.g. "
            f"{', '.join(missing[:3])}"
        )
    params = dict(stage.named_parameters())
    for path, entries in plan.items():  # shapes first: a mismatch is reported before anything changes
        with _open(path) as handle:
            for name, source, stored in entries:
                _check_shape(name, source, stored, tuple(handle.get_slice(stored).get_shape()), params[name])
    _copy_planned(plan, params, report)
    note = gpt2_activation_note(raw)
    if note:
        report.notes.append(note)
    logger.info(
        "stage %d: %d tensors (%.1f MB) from %d of %d file(s) in %s",
        stage.spec.index,
        report.tensors,
        report.bytes_read / 2**20,
        len(report.files),
        report.files_in_checkpoint,
        model_dir,
    )
    for note in report.notes:
        logger.warning("%s", note)
    return report


def _copy_planned(
    plan: dict[Path, list[tuple[str, Source, str]]], params: Mapping[str, torch.Tensor], report: LoadReport
) -> None:
    """Copy every planned tensor (file -> (our name, source, name in the file)) into its parameter, rows
    cut and transposed as its source says, file by file, counting them in `report`."""
    with torch.no_grad():
        for path, entries in sorted(plan.items()):
            with _open(path) as handle:
                for name, source, stored in entries:
                    tensor = (
                        handle.get_slice(stored)[: source.rows]
                        if source.rows is not None
                        else handle.get_tensor(stored)
                    )
                    if source.transpose:
                        tensor = tensor.t()
                    params[name].copy_(tensor.to(params[name].dtype))
                    report.tensors += 1
                    report.bytes_read += tensor.numel() * tensor.element_size()
            report.files.append(path.name)


def _check_same_model(raw: dict[str, Any], cfg: ModelConfig, model_dir: Path) -> None:
    """The checkpoint's config.json must describe the model being filled: same family, layer count and
    shapes, and the same norm epsilon and rotary base (which change the function, not the shapes)."""
    expected_type = {"llama": "llama", "gpt": "gpt2"}[cfg.arch]
    if raw.get("model_type") != expected_type:
        raise CheckpointError(
            f"{model_dir}: model_type {raw.get('model_type')!r}, but the run's model.arch {cfg.arch!r} "
            f"loads {expected_type!r} checkpoints"
        )
    if cfg.shared_layer_repeats != 1:
        raise CheckpointError(
            f"{model_dir}: a Hugging Face checkpoint has no shared layers, but model.shared_layer_repeats "
            f"= {cfg.shared_layer_repeats}"
        )
    try:
        theirs = model_config_from_hf(raw, cfg, str(model_dir / "config.json"))
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    fields = ["vocab_size", "d_model", "num_layers", "num_heads", "kv_heads", "d_ff", "norm_eps"]
    fields += ["rope_theta"] if cfg.arch == "llama" else []
    differ = [
        f"{f} {getattr(theirs, f)} (model: {getattr(cfg, f)})"
        for f in fields
        if getattr(theirs, f) != getattr(cfg, f)
    ]
    if cfg.tie_embeddings and not theirs.tie_embeddings:
        differ.append("untied embeddings (model: tied, which would drop the checkpoint's lm_head)")
    if differ:
        raise CheckpointError(f"{model_dir}/config.json describes another model: {'; '.join(differ)}")


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Every tensor name of the checkpoint -> the file holding it. A single file's names come from its
    header (no tensor is read); shards' from the index, without opening any shard."""
    single, index = model_dir / SINGLE_FILE, model_dir / INDEX_FILE
    if single.is_file():  # the order transformers looks in
        with _open(single) as handle:
            return {name: single for name in handle.keys()}
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: model_dir / str(file) for name, file in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc!r})") from None
        absent = sorted({p.name for p in files.values() if not p.is_file()})
        if absent:
            raise CheckpointError(
                f"{model_dir}: the index names shard(s) that are missing: {', '.join(absent)}"
            )
        return files
    present = sorted(p.name for p in model_dir.iterdir())[:8] if model_dir.is_dir() else []
    hint = (
        " (a .bin checkpoint: convert it to safetensors first)"
        if any(n.endswith(".bin") for n in present)
        else ""
    )
    raise CheckpointError(
        f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE}{hint}; found {', '.join(present) or 'nothing'}"
    )


def _stored_name(name: str, file_of: Mapping[str, Path]) -> str | None:
    """`name` as the checkpoint spells it: GPT-2 checkpoints saved from `GPT2Model` (the original `gpt2`)
    lack the `transformer.` prefix that `GPT2LMHeadModel` writes."""
    if name in file_of:
        return name
    if name.startswith(_GPT2_PREFIX) and name[len(_GPT2_PREFIX) :] in file_of:
        return name[len(_GPT2_PREFIX) :]
    return None


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises several types for unreadable or corrupt files
        raise CheckpointError(f"cannot read {path}: {exc}") from None


def _check_shape(name: str, source: Source, stored: str, shape: tuple[int, ...], param: torch.Tensor) -> None:
    want = tuple(param.shape)
    have = tuple(reversed(shape)) if source.transpose else shape
    if source.rows is not None and len(have) == len(want) and have[0] >= want[0]:
        have = (want[0], *have[1:])  # only the first rows are read
    if have != want:
        how = " (transposed)" if source.transpose else ""
        raise CheckpointError(f"{stored}: checkpoint shape {shape}{how} does not fit {name} of shape {want}")


# writing ----------------------------------------------------------------------------------------------
def expected_shapes(cfg: ModelConfig, cuts: tuple[int, ...] = ()) -> dict[str, tuple[int, ...]]:
    """Every parameter of the whole model (with its boundary layers or subspace at `cuts`,
    `RunConfig.boundary_cuts`) and its shape, without allocating it (built on torch's meta device)."""
    stage_class = LlamaStage if cfg.arch == "llama" else GPTStage
    with torch.device("meta"):
        module = stage_class(cfg, StageSpec(0, 1, 0, cfg.num_layers), cuts)
    return {name: tuple(p.shape) for name, p in module.named_parameters()}


def check_state_dict(
    state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig, source: str, cuts: tuple[int, ...] = ()
) -> None:
    """A whole model's state dict must hold exactly the model's parameters, each of its shape."""
    want = expected_shapes(cfg, cuts)
    missing = [n for n in want if n not in state_dict]
    extra = [n for n in state_dict if n not in want]
    wrong = [
        f"{n} {tuple(state_dict[n].shape)} (model {want[n]})"
        for n in want
        if n in state_dict and tuple(state_dict[n].shape) != want[n]
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing, e.g. {', '.join(missing[:3])}")
    if extra:
        problems.append(f"{len(extra)} the model does not have, e.g. {', '.join(extra[:3])}")
    if wrong:
        problems.append(f"{len(wrong)} of another shape, e.g. {', '.join(wrong[:3])}")
    if problems:
        raise CheckpointError(
            f"{source} does not match the run's model config: tensors {'; '.join(problems)}"
        )


def hf_tensors(
    state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Our whole-model state dict as Hugging Face names and layouts, shared layers unrolled; layer by
    layer. Unrolled copies are views of one tensor (the writer clones what one file would share)."""
    repeats = cfg.shared_layer_repeats
    for name, tensor in state_dict.items():
        source = hf_source(cfg, name)
        tensor = tensor.detach().cpu()
        tensor = tensor.t() if source.transpose else tensor
        match = _HF_LAYER.match(source.name)
        if match is None or repeats == 1:
            yield source.name, tensor
            continue
        prefix, layer, rest = match.group(1), int(match.group(2)), match.group(3)
        for r in range(repeats):
            yield f"{prefix}{layer * repeats + r}.{rest}", tensor


def _shards(
    tensors: list[tuple[str, torch.Tensor]], max_shard_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of at most `max_shard_bytes` (a larger tensor gets a shard of its own)."""
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, tensor))
        size += nbytes
    return shards


def save_hf_model(
    state_dict: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    out_dir: str | Path,
    tokenizer_file: str | Path | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    byte_level_tokenizer: bool = False,
    source: str = "the state dict",
) -> SaveReport:
    """Write the whole model `state_dict` (our names, as `swarmtrain export` assembles it) as a Hugging
    Face model directory that `AutoModelForCausalLM.from_pretrained(out_dir)` loads with no missing or
    unexpected weights. `tokenizer_file`: a tokenizer.json to ship with it (with a tokenizer_config.json
    so `AutoTokenizer.from_pretrained(out_dir)` loads it); `byte_level_tokenizer`: instead, write the
    tokenizer of byte-level runs (token id = byte value). An existing `out_dir` is replaced only when
    it holds nothing but an export's files. `source` names the state dict in errors."""
    if max_shard_bytes <= 0:
        raise ConfigError(f"max shard size must be positive, got {max_shard_bytes}")
    check_state_dict(state_dict, cfg, source)
    out = Path(out_dir).expanduser()
    _check_replaceable(out)
    tokenizer = _tokenizer_files(tokenizer_file, byte_level_tokenizer, cfg)
    config = hf_config_from_model(cfg, tokenizer.config_ids)
    tensors = list(hf_tensors(state_dict, cfg))
    shards = _shards(tensors, max_shard_bytes)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        written, total = _write_weights(tmp, shards)
        for name, content in tokenizer.files.items():
            (tmp / name).write_bytes(content)
            written.append(name)
        # config.json last: with the rename below, a directory with a config.json is complete
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        written.append("config.json")
        _move_into_place(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot write {out}: {exc}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return SaveReport(
        directory=out,
        files=written,
        parameters=sum(t.numel() for _, t in tensors),
        bytes_written=total,
        tokenizer=tokenizer.description,
    )


def _write_weights(folder: Path, shards: list[list[tuple[str, torch.Tensor]]]) -> tuple[list[str], int]:
    """Write the shards into `folder` as safetensors files, with an index when there are several:
    (the files written, the tensors' bytes)."""
    written: list[str] = []
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, start=1):
        file = SINGLE_FILE if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(_unshared(shard), str(folder / file), metadata={"format": "pt"})
        weight_map.update({name: file for name, _ in shard})
        total += sum(t.numel() * t.element_size() for _, t in shard)
        written.append(file)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        written.append(INDEX_FILE)
    return written, total


def _unshared(shard: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing memory within a file: the unrolled copies of a shared layer
    (and any transposed view) are cloned, one shard at a time, so memory grows by a shard at most."""
    seen: set[int] = set()
    out = {}
    for name, tensor in shard:
        ptr = tensor.untyped_storage().data_ptr()
        out[name] = tensor.contiguous().clone() if ptr in seen or not tensor.is_contiguous() else tensor
        seen.add(ptr)
    return out


def _check_replaceable(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} exists and is not a directory")
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if not _EXPORT_FILES.match(p.name))
        if foreign:
            raise CheckpointError(
                f"not replacing {out}: it holds files an export does not write ({', '.join(foreign[:5])})"
            )


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished directory to `out`; a previous export there is renamed aside first and
    removed after, so `out` is at every moment either the old complete export or the new one."""
    if not out.exists():
        tmp.rename(out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


# tokenizer --------------------------------------------------------------------------------------------
@dataclass
class _Tokenizer:
    files: dict[str, bytes] = field(default_factory=dict)
    config_ids: dict[str, int] = field(default_factory=dict)  # eos/bos ids for config.json
    description: str | None = None


def _tokenizer_files(tokenizer_file: str | Path | None, byte_level: bool, cfg: ModelConfig) -> _Tokenizer:
    """tokenizer.json plus a tokenizer_config.json naming the fast tokenizer class, its length and its
    end-of-text token; a model directory's own tokenizer_config.json and special_tokens_map.json are
    shipped as they are (they name its special tokens, chat template and so on)."""
    if tokenizer_file is None and not byte_level:
        return _Tokenizer()
    if tokenizer_file is not None:
        path = Path(tokenizer_file).expanduser()
        try:
            content = path.read_bytes()
            spec = json.loads(content)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read tokenizer {path}: {exc}") from None
        description = str(path)
    else:
        spec = json.loads(byte_level_tokenizer_json())
        content = json.dumps(spec, ensure_ascii=False, indent=1).encode()
        description = "byte-level (token id = byte value)"
    result = _Tokenizer(files={"tokenizer.json": content}, description=description)
    size = _tokenizer_size(spec)
    if size > cfg.vocab_size:
        raise CheckpointError(
            f"tokenizer {description} produces ids up to {size - 1}, beyond the model's vocab_size "
            f"{cfg.vocab_size}"
        )
    eos = _token_id(spec, EOS_TOKEN)
    if eos is not None:
        result.config_ids = {"eos_token_id": eos, "bos_token_id": eos}
    directory = path.parent if tokenizer_file is not None else None
    if directory is not None and (directory / "tokenizer_config.json").is_file():
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            if (directory / name).is_file():
                result.files[name] = (directory / name).read_bytes()
        return result
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg.seq_len,
    }
    if eos is not None:
        tok_config.update(eos_token=EOS_TOKEN, bos_token=EOS_TOKEN)
    result.files["tokenizer_config.json"] = (json.dumps(tok_config, indent=2) + "\n").encode()
    return result


def _token_id(spec: dict[str, Any], token: str) -> int | None:
    for added in spec.get("added_tokens") or []:
        if isinstance(added, dict) and added.get("content") == token and isinstance(added.get("id"), int):
            return int(added["id"])
    vocab = (spec.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and isinstance(vocab.get(token), int):
        return int(vocab[token])
    return None


def _tokenizer_size(spec: dict[str, Any]) -> int:
    """One past the largest id the tokenizer produces (its vocabulary and added tokens)."""
    ids = [
        a["id"]
        for a in spec.get("added_tokens") or []
        if isinstance(a, dict) and isinstance(a.get("id"), int)
    ]
    vocab = (spec.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        ids += [v for v in vocab.values() if isinstance(v, int)]
    elif isinstance(vocab, list):  # unigram models: a list of [piece, score]
        ids.append(len(vocab) - 1)
    return max(ids, default=-1) + 1


def _bytes_to_unicode() -> dict[int, str]:
    """The printable stand-in of every byte in byte-level BPE (GPT-2's table, which `tokenizers`'
    ByteLevel uses): printable Latin-1 bytes stand for themselves, the others for 256, 257, ... in order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def byte_level_tokenizer_json() -> str:
    """A tokenizer.json whose ids are the bytes of the UTF-8 text (what byte-level runs train on): a
    byte-level BPE with the 256 byte stand-ins as vocabulary and no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return str(tok.to_str())
