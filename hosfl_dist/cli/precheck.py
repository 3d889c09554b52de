"""What ``python -m hosfl_dist.run --check`` refuses beyond the config tree: the value checks a run makes while it
builds, made without building weights or tokenising data.

The config tree already refuses what each section tells alone (:mod:`hosfl_dist.config`: types, ranges, sizes
that would overflow, thread counts), :mod:`hosfl_dist.runtime.checks` what needs two sections or the algorithm
registry (the vision models' cut, what the method implements), and ``--check`` adds the devices, the interface and
the folder.
This module adds what needs the model's architecture or the task's files:

- an LM (``model.name=hf``): the split model built as a run builds it, on the meta device with no weight read or
  allocated (:func:`hosfl_dist.models.build_split_model` with ``parts=()``, as ``--dry-run``): the cut against the
  model's decoder blocks, the model type, the LoRA targets of each part, the label words against the tokenizer.
  A hub model is not fetched: its depth is checked where it is known (``KNOWN_DEPTHS``). A package that ships its GGUF
  file in chunks is not joined (the first start joins it into ``$HOSFL_CACHE``);
- a text task read from local files: every example of both files as the data build reads it (a missing file or
  column, a label that is not one of the task's);
- one process: ``server.ranks`` > 1 needs torchrun;
- a plug-in's model or task (``job.plugins``) of the vision family: the split built as a run builds it, which puts a
  made-up batch through f_c and f_s (f_s must take f_c's output and give the task's classes) and the task's own loss
  and metrics (one value per sample): :func:`hosfl_dist.models.build_split_model`. What the plug-in's code raises
  there is one line naming it (:class:`~hosfl_dist.errors.PluginError`).

Importing the model code costs what ``import torch, transformers, peft`` costs (2-4 s on the 2-core test machine,
see docs/checkpoints.md, "Bad input"); vision configs import nothing here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

from hosfl_dist.config import Config
from hosfl_dist.errors import ConfigError


def check_build(cfg: Config, world: int) -> None:
    """Refuse, as the run would while it builds, what ``cfg`` cannot train in a world of ``world`` processes (0 or 1:
    one process)."""
    if world <= 1 and cfg.server.ranks > 1:
        raise ConfigError(f"server.ranks={cfg.server.ranks} needs a server group: start with torchrun")
    if cfg.model.name != "hf":
        _check_vision_plugins(cfg)
        return
    if cfg.data.source == "local":  # model.name=hf: a text task (hosfl_dist.runtime.checks)
        from hosfl_dist.data.text_fed import load_examples

        load_examples(cfg.data)
    from hosfl_dist.models.lm import check_without_hub, hub_requirements

    if any(need.startswith("model.source") for need in hub_requirements(cfg.model, cfg.data)):
        check_without_hub(cfg.model, cfg.split)  # no download: the depths of the paper's hub models are known
        return
    if _unjoined(cfg.model.source, cfg.model.gguf_file):
        return
    from hosfl_dist.algorithms import get_algorithm
    from hosfl_dist.data.text_fed import text_data_info
    from hosfl_dist.models import build_split_model

    info = text_data_info(cfg.data, cfg.model)
    build_split_model(cfg, info, get_algorithm(cfg.algorithm.name).zeroth_order_client, parts=())


def _check_vision_plugins(cfg: Config) -> None:
    """A plug-in's vision model or task, built as a run builds it (the package's own fit their tasks by construction
    and cost a model's build to check: left to the run)."""
    from hosfl_dist.core.plugins import plugin_of
    from hosfl_dist.data.registry import get_task
    from hosfl_dist.models.registry import get_model

    task, model = get_task(cfg.data.name), get_model(cfg.model.name)
    if plugin_of(model.build) is None and not any(plugin_of(f) for f in (task.load, task.info, task.loss,
                                                                         *task.metrics.values())):  # fmt: skip
        return
    from hosfl_dist.algorithms import get_algorithm
    from hosfl_dist.data import data_info
    from hosfl_dist.models import build_split_model
    from hosfl_dist.runtime.build import data_sections

    zeroth_order = get_algorithm(cfg.algorithm.name).zeroth_order_client
    build_split_model(cfg, data_info(data_sections(cfg)), zeroth_order, parts=())


def build_key(cfg: Config) -> str:
    """What :func:`check_build` reads of ``cfg``: two configs with the same key pass or fail it alike (the grid
    points of a sweep over P, μ or the budget are checked once)."""
    d = dataclasses.asdict(cfg)
    read = {k: d[k] for k in ("algorithm", "model", "split", "lora", "data", "server")}
    read["clients.batch_size"], read["job.device"] = cfg.clients.batch_size, cfg.job.device
    return json.dumps(read, sort_keys=True, default=str)


def _unjoined(source: str, gguf_file: str) -> bool:
    """Whether ``pkg:<name>`` ships its GGUF file in chunks not joined yet (resolving it would join and write them)."""
    from hosfl_dist.models.sources import PKG_PREFIX, chunked_gguf

    if not source.startswith(PKG_PREFIX) or gguf_file:
        return False
    name = source.removeprefix(PKG_PREFIX)
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False  # resolve says what is wrong
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders or any(f.endswith(".gguf") for f in os.listdir(folders[0])):
        return False
    chunked = chunked_gguf(name)
    return chunked is not None and not os.path.isfile(chunked[1])
