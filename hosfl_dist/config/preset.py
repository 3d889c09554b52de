"""Named presets: a set of values a source gives for one kind of experiment, applied by name.

    preset=paper_code                        # as an override: over the config file and the overrides before it
    preset: paper_text                       # as a config file's top-level key: under the file's own sections

A preset is a YAML file of this package's ``presets/`` folder: ``about`` (one line: whose values they are), ``models``
(the ``model.name`` values it is written for; a preset applied to another model is refused) and ``set`` (sections as
in a config file). Expanding one leaves nothing of its name in the config: a run's identity is the values it ran with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hosfl_dist.errors import ConfigError, did_you_mean
from hosfl_dist.safe_yaml import load_file

PRESETS = Path(__file__).resolve().parent / "presets"
"""The folder of the preset files, ``<name>.yaml`` each."""


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def read_preset(name: Any) -> dict[str, Any]:
    """A preset's file as a mapping (``about``, ``models``, ``set``); an unknown name is a :class:`ConfigError`."""
    if not isinstance(name, str) or name not in preset_names():
        hint = did_you_mean(name, preset_names())
        raise ConfigError(f"unknown preset {name!r} (known presets: {', '.join(preset_names())}{hint})")
    data = load_file(PRESETS / f"{name}.yaml", "preset file")
    if not isinstance(data, dict) or not isinstance(data.get("set"), dict) or not isinstance(data.get("models"), list):
        raise ConfigError(f"preset file {PRESETS / name}.yaml must hold about, models and set")
    return data


def merge(into: dict[str, Any], values: dict[str, Any]) -> None:
    """Set every leaf of ``values`` in ``into``, section by section (what is not in ``values`` stays)."""
    for key, value in values.items():
        here = into.get(key)
        if isinstance(value, dict) and isinstance(here, dict):
            merge(here, value)
        else:
            into[key] = _copy(value)


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return list(value) if isinstance(value, list) else value


def check_models(applied: list[str], model_name: str) -> None:
    """Refuse a preset applied to a model it was not written for."""
    for name in applied:
        models = read_preset(name)["models"]
        if model_name not in models:
            raise ConfigError(f"preset {name} holds settings for model.name {' / '.join(map(str, models))}, "
                              f"not {model_name}")  # fmt: skip
