"""What a run's config must satisfy beyond what each section checks of itself: how the sections fit together, and
what the chosen method implements (the capabilities its registry entry declares).

The config tree (:mod:`hosfl_dist.config`) refuses what one section tells alone and imports nothing above it; this
module is the one place for the checks that need two sections or a registry (the names of the methods, models and
tasks, a plug-in's included). They run where a run's config is built: :func:`load_run_config` (``python -m
hosfl_dist.run`` with ``--check`` and ``--dry-run``, the experiment commands, export), and each runtime checks the
config it is given (:class:`~hosfl_dist.runtime.inprocess.InProcessRunner`,
:func:`~hosfl_dist.runtime.torchrun.run_torchrun`). What needs the model's architecture or the task's files is
:mod:`hosfl_dist.cli.precheck`'s. Every refusal is one
:class:`~hosfl_dist.errors.ConfigError` line naming the key.
"""

from __future__ import annotations

from pathlib import Path

from hosfl_dist.algorithms import AlgorithmSpec, algorithm_names, get_algorithm, load_plugins
from hosfl_dist.config import Config, check, load_config
from hosfl_dist.core.estimators import get_estimator
from hosfl_dist.data.registry import get_task
from hosfl_dist.errors import ConfigError
from hosfl_dist.models.registry import get_model, model_names
from hosfl_dist.runtime.build import round_plan
from hosfl_dist.runtime.callbacks import resolve


def load_run_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The config of a run: the tree from defaults, an optional YAML file and ``key.sub=value`` overrides
    (:func:`~hosfl_dist.config.load_config`), then :func:`check_config`."""
    return check_config(load_config(path, overrides))


def check_fixed_runtime(cfg: Config, runtime: str = "in_process") -> None:
    """What a runtime of fixed workers refuses in one line. In one process there is no real time: a round timeout
    and per-client link speeds are an elastic run's or a torchrun job's (replaying one's record,
    ``clients.participation``, takes its config as it was). Under torchrun a round timeout decides rounds live, at
    the server's gate, which then takes no emulated dropout."""
    if cfg.clients.participation:
        return
    timeout, spread = cfg.server.round_timeout_s, cfg.comm.speed_spread
    if runtime == "in_process":
        for key, value in (("server.round_timeout_s", timeout), ("comm.speed_spread", spread)):
            if value:
                raise ConfigError(f"invalid value for {key}: {value:g} (one process has no real-time rounds or "
                                  "per-client links: run it under torchrun or --serve, or replay such a run with "
                                  "clients.participation: docs/participation.md#live-rounds)")  # fmt: skip
        return
    check_live(cfg, "server.round_timeout_s > 0" if timeout else "")
    if spread and not cfg.comm.inject_delay:
        raise ConfigError(f"invalid value for comm.speed_spread: {spread:g} (per-client links are emulated with "
                          "comm.inject_delay=true)")  # fmt: skip


def check_live(cfg: Config, why: str) -> None:
    """What rounds decided live (``why``: what makes them so; empty: they are not) cannot take: who takes part is who
    answers in time, not an emulation of it."""
    if not why:
        return
    if cfg.clients.dropout:
        raise ConfigError(f"invalid value for clients.dropout: {cfg.clients.dropout:g} (with {why} the workers that "
                          "answer in time decide who takes part; set it to 0)")  # fmt: skip


def check_config(cfg: Config) -> Config:
    """Refuse a config whose sections do not fit together or that asks its method for what it does not implement
    (ConfigError naming the key); returns ``cfg``. The config's plug-ins are imported first: a method they register
    is a name like the package's own; its callbacks are imported (one line if one cannot be)."""
    load_plugins(cfg.job.plugins)
    for spec in cfg.job.callbacks:
        resolve(spec)
    _check_model_and_data(cfg)
    if cfg.model.name == "resnet18" and cfg.model.freeze_bn != "all":
        _check_batch_stats_server(cfg)
    _check_algorithm(cfg, get_algorithm(cfg.algorithm.name))
    _check_participation(cfg, get_algorithm(cfg.algorithm.name))
    _check_early_stopping(cfg)
    check(
        cfg.train.budget_samples >= cfg.clients.batch_size,
        "train.budget_samples",
        cfg.train.budget_samples,
        f"is smaller than one client batch (clients.batch_size={cfg.clients.batch_size})",
    )
    return cfg


def _check_model_and_data(cfg: Config) -> None:
    """Both names registered (the package's or a plug-in's); a text task needs the decoder LM and a tensor task a
    model of the vision family; the cut leaves each side a part."""
    model, task, cut = get_model(cfg.model.name), get_task(cfg.data.name), cfg.split.cut
    fits = [n for n in model_names() if get_model(n).family == task.family]
    check(model.family == task.family, "model.name", model.name,
          f"data.name={task.name} needs model.name={' or '.join(fits)}")  # fmt: skip
    check(not cfg.data.classes or task.load is not None, "data.classes", cfg.data.classes, "applies to vision data "
          f"sets (tasks of tensors), not data.name={task.name} (its labels are the task's label words)")  # fmt: skip
    if model.family == "hf":  # its depth is the model's: checked where it is built (hosfl_dist.cli.precheck, models.lm)
        check(cut >= 1, "split.cut", cut, "the client keeps at least one decoder block")
    else:
        lo, hi = model.cuts
        check(lo <= cut <= hi, "split.cut", cut,
              f"{model.name} keeps {lo}..{hi} blocks on the client; the cut must leave the server a part")  # fmt: skip


def _check_early_stopping(cfg: Config) -> None:
    """``train.early_stopping.metric`` names a value the task's metrics rows hold."""
    metric = cfg.train.early_stopping.metric
    if not metric:
        return
    task = get_task(cfg.data.name)
    held = ["eval_accuracy", "eval_loss", "train_loss"]
    held += ["eval_f1", "eval_exact_match"] if task.family == "hf" else list(task.metrics)  # a text task's, a plug-in's
    check(metric in held, "train.early_stopping.metric", metric,
          f"the metrics rows of data.name={task.name} hold {', '.join(held)}")  # fmt: skip


def _check_batch_stats_server(cfg: Config) -> None:
    """A server normalising with batch statistics (``model.freeze_bn=code|client|none``) must see each client's batch
    whole and in one place: its outputs, λ and running statistics depend on which rows share a pass."""
    mode = f"model.freeze_bn={cfg.model.freeze_bn} (batch statistics on the server)"
    check(cfg.server.ranks == 1, "server.ranks", cfg.server.ranks, f"{mode} needs one server rank: each rank "
          "would normalise and update its own statistics")  # fmt: skip
    micro, batch = cfg.server.micro_batch_tokens, cfg.clients.batch_size
    check(not 0 < micro < batch, "server.micro_batch_tokens", micro, f"{mode} needs 0 or at least "
          f"clients.batch_size={batch}: a client's batch must not be cut into pieces")  # fmt: skip


def _check_algorithm(cfg: Config, spec: AlgorithmSpec) -> None:
    """What the method implements: its model families, LoRA, schedules, batched perturbations, skipping."""
    family = get_model(cfg.model.name).family
    lora = cfg.lora
    check(
        not spec.needs_lora or (family == "hf" and bool(lora.client_targets) and bool(lora.server_targets)),
        "algorithm.name",
        spec.name,
        "needs LoRA adapters on both sides (model.name=hf with lora.client_targets and lora.server_targets); "
        "use algorithm.name=sfl otherwise",
    )
    check(
        family in spec.families,
        "algorithm.name",
        spec.name,
        f"implemented for {'/'.join(spec.families)} models, not model.name={cfg.model.name}",
    )
    check(spec.name != "fsl_sage" or cfg.model.name != "conv_mlp", "algorithm.name", spec.name,
          "builds its auxiliary model from a convolutional activation, which model.name=conv_mlp's server part "
          "does not begin with (a fully connected layer): use small_cnn or resnet18")  # fmt: skip
    if family == "hf":  # half-precision rounding against μ (refused before anything is built)
        problem = cfg.zo.precision_problem(cfg.model.dtype, spec.uploads_perturbed_pair)
        if problem is not None and spec.zeroth_order_client:
            raise ConfigError(problem)
    for side in ("clients", "server"):
        scheduling = "/".join(n for n in algorithm_names() if get_algorithm(n).lr_schedules)
        check(not getattr(cfg, side).optim.scheduled or spec.lr_schedules, f"{side}.optim.schedule",
              getattr(cfg, side).optim.schedule, f"learning-rate schedules are implemented for {scheduling}, "
              f"not algorithm.name={spec.name}")  # fmt: skip
    check(cfg.zo.perturb_batch == 1 or spec.batches_perturbations, "zo.perturb_batch", cfg.zo.perturb_batch,
          f"batched perturbed forwards are implemented for hosfl, not algorithm.name={spec.name}")  # fmt: skip
    check(not cfg.zo.batch_clients or spec.batches_clients, "zo.batch_clients", cfg.zo.batch_clients,
          f"clients batched in one pass are implemented for hosfl, not algorithm.name={spec.name}")  # fmt: skip
    check(cfg.zo.compile == "off" or spec.compiles_client, "zo.compile", cfg.zo.compile,
          f"compiled client forwards are implemented for hosfl, not algorithm.name={spec.name}")  # fmt: skip
    get_estimator(cfg.zo.estimator)  # registered (the package's or a plug-in's): else one line with the names
    estimating = "/".join(n for n in algorithm_names() if get_algorithm(n).zo_estimator)
    check(cfg.zo.estimator == "gaussian" or spec.zo_estimator, "zo.estimator", cfg.zo.estimator,
          f"zeroth-order estimators are used by {estimating}, not algorithm.name={spec.name} (it draws no "
          "perturbation)")  # fmt: skip
    check(cfg.zo.compile != "reduce-overhead" or cfg.job.device.startswith("cuda"), "zo.compile", cfg.zo.compile,
          f"captures CUDA graphs, which job.device={cfg.job.device} has none of; use zo.compile=default")  # fmt: skip
    check(
        cfg.train.on_nonfinite == "stop" or spec.skips_nonfinite,
        "train.on_nonfinite",
        cfg.train.on_nonfinite,
        f"algorithm.name={spec.name} stops on a non-finite value; skip is implemented for hosfl",
    )


def _check_participation(cfg: Config, spec: AlgorithmSpec) -> None:
    """Rounds that not every sampled client finishes: a method that implements them, a floor it can reach."""
    c = cfg.clients
    check(cfg.server.min_clients <= c.per_round, "server.min_clients", cfg.server.min_clients,
          f"a round counts at most clients.per_round={c.per_round} uploads, so it would never step")  # fmt: skip
    dropping = "/".join(n for n in algorithm_names() if get_algorithm(n).drops_clients)
    for key, value, default in (("dropout", c.dropout, 0), ("over_select", c.over_select, 0),
                                ("participation", c.participation, "")):  # fmt: skip
        check(value == default or spec.drops_clients, f"clients.{key}", value, f"algorithm.name={spec.name} cannot "
              f"run a round without all its sampled clients; implemented for {dropping}")  # fmt: skip
    if c.participation:  # a replayed record is read and checked line by line before anything is built
        round_plan(cfg)
