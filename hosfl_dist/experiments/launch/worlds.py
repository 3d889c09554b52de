"""Which world each run of a study gets, and whether the run fits it. Torch-free.

A world is what a run's job is started with: its processes over all nodes (torchrun's ``--nproc-per-node`` times the
nodes), its nodes, the GPUs each node asks Slurm for, and the overrides the world brings to the run (``server.ranks=2``:
an 8B model's server sharded over two ranks). Rank 0 is the server, ranks 0..S-1 the server group, the others client
workers (:func:`hosfl_dist.runtime.process.launch.role_map`).

A study maps its rows (methods or grid points) to worlds with rules, the first that matches a row wins:

- ``--world WHEN:NPROC[,nodes=N][,gpus=G][,KEY=VALUE...]``, repeatable: WHEN is ``*`` (every row) or
  ``key=value[&key=value...]``, matched against the row's resolved config (``zo.mu=0.001`` matches ``zo.mu=1e-3``, and
  a key the YAML sets); ``KEY=VALUE`` words with a dotted key are overrides the world adds, e.g.
  ``--world=model.source=arch:qwen3-8b:6,server.ranks=2``;
- ``--worlds FILE``: a YAML list of ``{when: {key: value, ...}, nproc: N, nodes: N, gpus: G, set: [key=value, ...]}``
  (``when`` left out or ``"*"``: every row), read after the ``--world`` rules;
- a row no rule matches gets ``--nproc N`` processes, or without it ``server.ranks + 1`` (its server group and one
  client worker: the least world its roles fit).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hosfl_dist.config import Config, load_config
from hosfl_dist.errors import ConfigError

WORLD_KEYS = ("nodes", "gpus")
"""Words of a ``--world`` rule that describe the world itself; any other ``KEY=VALUE`` is an override."""
_RULE = re.compile(r"(?P<when>.*?):(?P<nproc>[0-9]+)(?:,(?P<rest>.*))?", re.DOTALL)
_ITEM = re.compile(r",(?=[A-Za-z_][A-Za-z0-9_.]*=)")  # a comma before the next key=: values may hold commas


@dataclass(frozen=True)
class World:
    """The processes, nodes and GPUs a run's job is started with, and the overrides the world adds to the run."""

    nproc: int = 1
    """Processes over all nodes (1: the in-process runtime, one process)."""
    nodes: int = 1
    gpus: int = 0
    """GPUs per node asked of Slurm (0: none)."""
    overrides: tuple[str, ...] = ()

    @property
    def per_node(self) -> int:
        return self.nproc // self.nodes

    def key(self) -> tuple[int, int, int]:
        """What one Slurm array shares: runs of one key are tasks of the same array."""
        return self.nproc, self.nodes, self.gpus

    def describe(self) -> str:
        """``3 processes``, ``8 processes on 2 nodes (4 per node), 4 GPUs per node``."""
        text = f"{self.nproc} process{'es' if self.nproc != 1 else ''}"
        if self.nodes > 1:
            text += f" on {self.nodes} nodes ({self.per_node} per node)"
        if self.gpus:
            text += f", {self.gpus} GPU{'s' if self.gpus != 1 else ''} per node"
        return text

    def as_dict(self) -> dict[str, Any]:
        return {"nproc": self.nproc, "nodes": self.nodes, "gpus": self.gpus, "overrides": list(self.overrides)}


@dataclass(frozen=True)
class Rule:
    """Rows whose config matches ``when`` (every row when empty) get this world; ``nproc`` None: the default."""

    when: tuple[str, ...]
    nproc: int | None = None
    nodes: int = 1
    gpus: int | None = None
    """None: one per process on a node where the run's job.device is cuda, none otherwise."""
    overrides: tuple[str, ...] = ()
    source: str = field(default="", compare=False)
    """How the rule was given (``--world …``, ``FILE rule 2``), for the messages."""


def _count(text: Any, what: str, source: str, least: int = 1) -> int:
    if isinstance(text, bool) or not (isinstance(text, int) or (isinstance(text, str) and text.isdigit())):
        raise ConfigError(f"{source}: {what} must be a whole number >= {least}, got {text!r}")
    if int(text) < least:
        raise ConfigError(f"{source}: {what} must be >= {least}, got {text}")
    return int(text)


def parse_world(text: str) -> Rule:
    """A ``--world WHEN:NPROC[,nodes=N][,gpus=G][,KEY=VALUE...]`` rule."""
    source = f"--world {text!r}"
    m = _RULE.fullmatch(text.strip())
    if m is None or not m.group("when"):
        raise ConfigError(f"{source} is not of the form WHEN:NPROC[,nodes=N][,gpus=G][,section.key=value...] "
                          "(WHEN: * or section.key=value[&section.key=value...])")  # fmt: skip
    when = () if m.group("when").strip() == "*" else tuple(w.strip() for w in m.group("when").split("&"))
    if any("=" not in w or not w.split("=", 1)[0].strip() for w in when):
        raise ConfigError(f"{source}: WHEN must be * or section.key=value[&section.key=value...]")
    nodes, gpus, overrides = 1, None, []
    for item in _ITEM.split(m.group("rest") or ""):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"{source}: {item!r} is not KEY=VALUE")
        if key == "nodes":
            nodes = _count(value, "nodes", source)
        elif key == "gpus":
            gpus = _count(value, "gpus", source, least=0)
        elif "." in key:
            overrides.append(item)
        else:
            raise ConfigError(f"{source}: {key!r} is neither {' nor '.join(WORLD_KEYS)} nor a section.key override")
    return Rule(when, _count(m.group("nproc"), "NPROC", source), nodes, gpus, tuple(overrides), source)


def read_worlds(path: str) -> list[Rule]:
    """The rules of a ``--worlds`` YAML file: a list of ``{when, nproc, nodes, gpus, set}``."""
    from hosfl_dist.safe_yaml import load_file

    data = load_file(path, "--worlds file")
    if not isinstance(data, list):
        raise ConfigError(f"--worlds {path}: expected a list of worlds ({{when: {{key: value}}, nproc: N, ...}}), "
                          f"got {type(data).__name__}")  # fmt: skip
    rules = []
    for i, item in enumerate(data, 1):
        source = f"--worlds {path}, world {i}"
        if not isinstance(item, dict):
            raise ConfigError(f"{source}: expected a mapping, got {type(item).__name__}")
        unknown = sorted(set(item) - {"when", "nproc", "nodes", "gpus", "set"})
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {', '.join(map(str, unknown))} (known: when, nproc, nodes, "
                              "gpus, set)")  # fmt: skip
        when = item.get("when", "*")
        if when == "*" or when is None:
            when = {}
        if not isinstance(when, dict):
            raise ConfigError(f"{source}: when must be a mapping of section.key: value, or '*'")
        sets = item.get("set") or []
        if isinstance(sets, dict):
            sets = [f"{k}={_yaml_value(v)}" for k, v in sets.items()]
        if not isinstance(sets, list) or not all(isinstance(s, str) and "=" in s for s in sets):
            raise ConfigError(f"{source}: set must be a list of section.key=value or a mapping")
        nproc = item.get("nproc")
        gpus = item.get("gpus")
        rules.append(Rule(
            tuple(f"{k}={_yaml_value(v)}" for k, v in when.items()),
            None if nproc is None else _count(nproc, "nproc", source),
            _count(item.get("nodes", 1), "nodes", source),
            None if gpus is None else _count(gpus, "gpus", source, least=0),
            tuple(sets),
            source,
        ))  # fmt: skip
    return rules


def _yaml_value(value: Any) -> str:
    """A YAML value as an override's text (``True`` -> ``true``, lists in flow style)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)):
        import json

        return json.dumps(value)
    return str(getattr(value, "text", value))  # a number as written (0x10, 02000): how the override is read back


def matches(config: str | None, overrides: Sequence[str], cfg: Config, when: Sequence[str]) -> bool:
    """Whether the row's config already has every ``key=value`` of ``when`` (setting them changes nothing)."""
    if not when:
        return True
    return load_config(config, [*overrides, *when]) == cfg


def assign(
    config: str | None, variants: dict[str, list[str]], rules: Sequence[Rule], nproc: int | None
) -> dict[str, World]:
    """Each row's world: the first rule that matches it, else ``nproc`` processes, else ``server.ranks + 1``."""
    from hosfl_dist.runtime.checks import load_run_config

    out = {}
    for name, overrides in variants.items():
        cfg = load_run_config(config, overrides)
        rule = None
        for r in rules:
            try:
                if matches(config, overrides, cfg, r.when):
                    rule = r
                    break
            except ConfigError as exc:
                raise ConfigError(f"{r.source}: {exc}") from None
        extra = rule.overrides if rule is not None else ()
        try:
            full = load_run_config(config, [*overrides, *extra]) if extra else cfg
        except ConfigError as exc:
            raise ConfigError(f"{rule.source}: {exc}") from None
        n = (rule.nproc if rule is not None else None) or nproc or full.server.ranks + 1
        nodes = rule.nodes if rule is not None else 1
        gpus = rule.gpus if rule is not None else None
        if gpus is None:
            gpus = n // nodes if full.job.device.startswith("cuda") and n % nodes == 0 else 0
        out[name] = World(n, nodes, gpus, tuple(extra))
    return out


def misfit(cfg: Config, world: World, launcher: str) -> str | None:
    """Why the run of ``cfg`` cannot start in ``world`` under ``launcher`` (None: it fits): nodes that do not divide
    the processes, several nodes without Slurm, roles that do not fit the processes (the server group and at least one
    client worker; no more workers than clients.total), a CUDA run without GPUs."""
    from hosfl_dist.runtime.process.launch import role_map

    if world.nproc % world.nodes:
        return f"{world.nproc} processes do not divide over {world.nodes} nodes"
    if world.nodes > 1 and launcher != "slurm":
        return f"{world.nodes} nodes need --launcher slurm (--launcher {launcher} runs on this machine)"
    try:
        role_map(cfg, world.nproc)
    except ConfigError as exc:
        return str(exc)
    if cfg.job.device.startswith("cuda") and launcher == "slurm" and world.gpus == 0:
        return f"job.device={cfg.job.device} but the world asks Slurm for no GPU (gpus=0)"
    return None
