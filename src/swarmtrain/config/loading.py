"""TOML run files: pick a preset, override fields section by section, with errors that name the field.

preset = "tiny"
[model]
d_model = 128
[training]
max_samples = 4096
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from swarmtrain.config.errors import ConfigError
from swarmtrain.config.presets import get_preset
from swarmtrain.config.run import RunConfig

SECTIONS = ("model", "training", "data", "swarm", "diloco")


def load_run_config(path: str | Path, preset: str | None = None) -> RunConfig:
    """Read a TOML run file. `preset`, when given, wins over the file's own `preset` key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    if preset is not None:
        raw["preset"] = preset
    try:
        return run_config_from_dict(raw)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def run_config_from_dict(raw: dict[str, Any]) -> RunConfig:
    """Apply a nested dict of overrides (as read from TOML) to the named preset."""
    unknown = set(raw) - {"preset", *SECTIONS}
    if unknown:
        raise ConfigError(
            f"unknown top-level key(s) {sorted(unknown)} (valid: preset, {', '.join(SECTIONS)})"
        )
    base = get_preset(str(raw.get("preset", "tiny")))
    sections = {}
    for name in SECTIONS:
        overrides = raw.get(name, {})
        if not isinstance(overrides, dict):
            raise ConfigError(f"[{name}] must be a table")
        sections[name] = _override(getattr(base, name), overrides, name)
    return base.replace(**sections)


def _override(instance: Any, overrides: dict[str, Any], section: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(instance)}
    hints = typing.get_type_hints(type(instance))
    values = {}
    for key, value in overrides.items():
        if key not in fields:
            raise ConfigError(f"unknown field {section}.{key} (valid: {', '.join(fields)})")
        values[key] = _coerce(value, hints[key], f"{section}.{key}")
    try:
        return dataclasses.replace(instance, **values)
    except TypeError as exc:
        raise ConfigError(f"[{section}]: {exc}") from None


def _coerce(value: Any, hint: Any, name: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, options[0], name)
    if origin is tuple:
        if not isinstance(value, list):
            raise ConfigError(f"{name}: expected a list, got {type(value).__name__} {value!r}")
        (item_type, *_) = typing.get_args(hint)
        return tuple(_coerce(v, item_type, f"{name}[{i}]") for i, v in enumerate(value))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and (type(value) is not hint):
        raise ConfigError(f"{name}: expected {hint.__name__}, got {type(value).__name__} {value!r}")
    return value
