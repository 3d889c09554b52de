"""Loading the config tree: defaults < YAML file < dotted command-line overrides, each value coerced to its field's
type and checked against the range the build can hold; an unknown key or a wrongly typed value is a
:class:`ConfigError` naming the key and its section.

Values are read by YAML 1.2's core schema (:mod:`hosfl_dist.safe_yaml`) and taken as written: a str key takes a
number's text (``job.name=0x10`` is ``"0x10"``, ``007`` is ``"007"``); an int key takes integers alone (``02000`` is
2000, ``0x10`` 16; ``2000.0``, ``1e3`` and ``true`` are refused); a float key takes integers and floats (and text
Python reads as one, such as ``inf``), not booleans.

Every key of the tree is checked before one error is raised: a file (with its overrides) that holds several unknown
keys or bad values gets one :class:`ConfigError` listing each, in the order written. An unknown key names the key it
was most likely meant to be (difflib: a close name in its section, or the same name in another section)."""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

from hosfl_dist.config.preset import check_models, merge, read_preset
from hosfl_dist.config.schema import FLOAT32_MAX, INT64, TEXT_KEYS, Config, FieldError, shown
from hosfl_dist.errors import ConfigError, close_to, did_you_mean
from hosfl_dist.safe_yaml import WrittenFloat, WrittenInt, load_file, load_override


def load_config(path: str | Path | Config | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build the config tree from defaults, an optional YAML file (or a tree already built) and `key.sub=value`
    overrides.

    A named preset (:mod:`.preset`) is a file's top-level ``preset:`` key, its values under the file's sections, or an
    override ``preset=<name>``, its values over the file and under every ``key=value`` override wherever they stand
    (so a study's grid over presets keeps the study's own overrides)."""
    raw: dict[str, Any] = {}
    applied: list[str] = []
    if isinstance(path, Config):  # a tree already built (hosfl_dist.train): the overrides go on top of it
        raw = dataclasses.asdict(path)
    elif path is not None:
        loaded = load_file(path)  # bounded: size, alias expansion, nesting; unique keys (hosfl_dist.safe_yaml)
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(loaded).__name__}")
        raw = loaded or {}
        if PRESET in raw:
            name = raw.pop(PRESET)
            base: dict[str, Any] = {}
            merge(base, read_preset(name)["set"])
            merge(base, raw)
            raw = base
            applied.append(name)
    pairs = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {shown(item)} is not of the form section.key=value")
        pairs.append((key.strip(), text))
    for key, text in pairs:
        if key == PRESET:
            merge(raw, read_preset(text.strip())["set"])
            applied.append(text.strip())
    for key, text in pairs:
        if key != PRESET:
            _set_dotted(raw, key, load_override(text, f"override {_named(key)}"))
    cfg = build_config(raw)
    check_models(applied, cfg.model.name)
    return cfg


PRESET = "preset"
"""The config file's top-level key and the override that name a preset (:mod:`hosfl_dist.config.preset`)."""


def build_config(raw: dict[str, Any]) -> Config:
    """Construct a validated :class:`Config` from a nested mapping (unknown keys and bad types are errors, every one
    of them in one :class:`ConfigError`)."""
    return _all_at_once(Config, raw, "")


def build_section(cls: type, raw: Any, name: str) -> Any:
    """Construct one dataclass section (of this tree, or another tool's YAML) with the same strict checks, its keys
    named ``name.key`` in errors."""
    return _all_at_once(cls, raw, f"{name}.")


MAX_LISTED = 20
"""Most errors one message lists (the count says how many more there were)."""


class _Errors(ConfigError):
    """Every error found in a tree's keys, raised by :func:`_build` so that a caller above collects them all."""

    def __init__(self, messages: list[str]) -> None:
        super().__init__("; ".join(messages))
        self.messages = messages


def _messages(exc: ConfigError) -> list[str]:
    return exc.messages if isinstance(exc, _Errors) else [str(exc)]


def _all_at_once(cls: type, raw: Any, prefix: str) -> Any:
    """:func:`_build`, its errors raised as one ConfigError: the error itself where there is one, else ``N errors in
    the config: (1) ...; (2) ...``, on one line."""
    try:
        return _build(cls, raw, prefix, cls)
    except _Errors as exc:
        found = exc.messages
    if len(found) == 1:
        raise ConfigError(found[0]) from None
    listed = "; ".join(f"({i}) {m}" for i, m in enumerate(found[:MAX_LISTED], 1))
    more = f"; and {len(found) - MAX_LISTED} more" if len(found) > MAX_LISTED else ""
    raise ConfigError(f"{len(found)} errors in the config: {listed}{more}") from None


@functools.cache
def _fields(cls: type) -> tuple[dict[str, Any], frozenset[str]]:
    """A section's field types and names, resolved once (typing.get_type_hints is most of a tree's build time)."""
    return typing.get_type_hints(cls), frozenset(f.name for f in dataclasses.fields(cls))


@functools.cache
def _paths(cls: type) -> tuple[str, ...]:
    """Every dotted key of the tree of ``cls`` (``clients.optim.lr``), to find a key written in the wrong section."""
    found = []
    hints, _ = _fields(cls)
    for f in dataclasses.fields(cls):
        found.append(f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            found += [f"{f.name}.{sub}" for sub in _paths(hints[f.name])]
    return tuple(found)


def _unknown(key: Any, names: frozenset[str], prefix: str, section: str, root: type) -> str:
    """The line of an unknown key: the key it was most likely meant to be (the same name in other sections, else a
    close name in the section), or the section's keys when nothing is close."""
    here = f"unknown key {prefix}{_named(key)} in section {section}"
    elsewhere = [p for p in _paths(root) if p.rpartition(".")[2] == key and p != f"{prefix}{key}"]
    if elsewhere:  # zo.batch_size: clients.batch_size, not the zo key closest in spelling
        return f"{here} (did you mean {' or '.join(elsewhere[:3])}?)"
    near = close_to(key, names)
    if near is not None:
        return f"{here} (did you mean {prefix}{near}?)"
    return f"{here} (known keys: {', '.join(sorted(names))})"


def _named(key: Any) -> str:
    """A key as the user wrote it, or its repr cut short where it is long or holds what a line cannot show."""
    text = str(key)
    return text if text.isprintable() and len(text) <= 60 else shown(key, 60)


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {_named(key)}: {_named(part)} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _build(cls: type, raw: Any, prefix: str, root: type) -> Any:
    """The section ``cls`` of ``raw``; an :class:`_Errors` of every unknown key and bad value in it and below it."""
    section = prefix.rstrip(".") or "<root>"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise _Errors([f"section {section} must be a mapping, got {shown(raw)}"])
    hints, names = _fields(cls)
    errors: list[str] = []
    kwargs = {}
    for key, value in raw.items():  # in the order written, so the list reads as the file does
        if key not in names:
            errors.append(_unknown(key, names, prefix, section, root))
            continue
        try:
            kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}", root)
        except ConfigError as exc:
            errors += _messages(exc)
    if errors:  # the section cannot be built: its own checks wait for its values
        raise _Errors(errors)
    try:
        built = cls(**kwargs)
    except FieldError as exc:  # name the section of a nested check: "lr" -> "clients.optim.lr"
        raise _Errors([f"invalid value for {prefix}{exc.key}: {shown(exc.value)} ({exc.why})"]) from None
    for name in kwargs:  # what the section's own checks let through: sizes that overflow where they are used
        try:
            _check_range(getattr(built, name), f"{prefix}{name}")
        except ConfigError as exc:
            errors += _messages(exc)
    if errors:
        raise _Errors(errors)
    return built


def _check_range(value: Any, key: str) -> None:
    """Numbers the build can hold: integers of 64 bits, finite floats within float32's range (an lr of 1e300 is
    an overflow in the first float32 step, a seed of 2^64 one in the generator)."""
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_range(v, f"{key}[{i}]")
    elif isinstance(value, int) and not isinstance(value, bool) and not -INT64 <= value < INT64:
        raise ConfigError(f"invalid value for {key}: {shown(value)} (must fit in a signed 64-bit integer)")
    elif isinstance(value, float) and not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
        raise ConfigError(f"invalid value for {key}: {shown(value)} (must be a finite number within float32's "
                          f"range, |x| <= {FLOAT32_MAX:.4g})")  # fmt: skip


def _as_written(value: Any) -> str:
    """A value in a message: a number as the file or the override wrote it (``1.0e+300``, not ``1e+300``)."""
    return value.text if isinstance(value, (WrittenInt, WrittenFloat)) and len(value.text) <= 60 else shown(value)


def _coerce(tp: Any, value: Any, key: str, root: type) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".", root)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            hint = did_you_mean(value, choices, quote=True)
            raise ConfigError(f"invalid value for {key}: {shown(value)} (choose one of {list(choices)}{hint})")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key, root)
            except ConfigError as exc:
                errors.append(str(exc))
        head = f"invalid value for {key}: {shown(value)} ("
        if len(errors) > 1 and all(e.startswith(head) and e.endswith(")") for e in errors):  # every form accepted
            raise ConfigError(head + "; or ".join(e[len(head) : -1] for e in errors) + ")")
        raise ConfigError(errors[0] if errors else f"invalid value for {key}: {shown(value)}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"invalid value for {key}: {shown(value)} (expected a list)")
        return [_coerce(item_tp, v, f"{key}[{i}]", root) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"invalid value for {key}: {shown(value)} (expected a mapping)")
        k_tp, v_tp = typing.get_args(tp)
        return {_coerce(k_tp, k, key, root): _coerce(v_tp, v, f"{key}.{k}", root) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            words = isinstance(value, str) and value.lower() in ("yes", "no", "on", "off")
            hint = "; yes, no, on and off are text in YAML 1.2" if words else ""
            raise ConfigError(f"invalid value for {key}: {_as_written(value)} (expected true or false{hint})")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"invalid value for {key}: {_as_written(value)} (expected an integer)")  # 2000.0, 1e3
        return int(value)  # a WrittenInt as a plain int
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"invalid value for {key}: {_as_written(value)} (expected a number)")
        if isinstance(value, (int, float)):
            try:
                return float(value)
            except OverflowError:  # an integer beyond any float
                raise ConfigError(f"invalid value for {key}: {_as_written(value)} (expected a finite number)") from None
        if isinstance(value, str):
            try:  # text Python reads as a float: inf, nan (YAML writes .inf, .nan), a quoted "1e-3"
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"invalid value for {key}: {_as_written(value)} (expected a number)")
    if tp is str:
        if isinstance(value, (dict, list, bool)) or value is None:
            hint = "; quote text that starts with { or [, e.g. key='\"{x} ...\"'" if value is not None else ""
            if isinstance(value, bool):
                hint = "; YAML reads true and false as booleans: quote the word"
            raise ConfigError(f"invalid value for {key}: {shown(value)} (expected a string{hint})")
        text = value.text if isinstance(value, (WrittenInt, WrittenFloat)) else str(value)  # as written: 0x10, 007
        allowed = "\n\t\r" if key.split("[")[0] in TEXT_KEYS else ""
        bad = next((c for c in text if (ord(c) < 32 or ord(c) == 127) and c not in allowed), None)
        if bad is not None:
            raise ConfigError(f"invalid value for {key}: {shown(text)} (holds the control character {bad!r}; only "
                              f"{' and '.join(TEXT_KEYS)} may hold line breaks)")  # fmt: skip
        return text
    raise ConfigError(f"cannot read {key}: unsupported field type {tp!r}")
