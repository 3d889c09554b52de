"""Entry point: ``python -m hosfl_dist.run --config configs/X.yaml [section.key=value ...] [--dry-run | --check]``.

Started by ``torchrun --nproc_per_node=N -m hosfl_dist.run ...`` (N > 1) it runs the torchrun runtime (rank 0
server, the others client workers, see hosfl_dist/runtime/torchrun.py); started alone it runs the in-process runtime.
Parses, builds, runs and cleans up; errors in the user's input are reported in one line (exit code 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from hosfl_dist.config import Config, dump_config, load_config
from hosfl_dist.errors import ConfigError, HosflError, Interrupted, write_failure
from hosfl_dist.logs import init_logging

if TYPE_CHECKING:
    from hosfl_dist.runtime.process.launch import LaunchEnv


EXAMPLES = """\
examples:
  python -m hosfl_dist.run --config configs/quickstart.yaml                    # train in one process
  python -m hosfl_dist.run --config configs/quickstart.yaml zo.num_perturbations=8 job.seed=3 job.out_dir=runs/p8
  python -m hosfl_dist.run --config configs/quickstart.yaml --check            # is the input usable? (exit 0 or 2)
  python -m hosfl_dist.run --config configs/quickstart.yaml --dry-run --nproc 3   # the config, the build, the roles
  python -m hosfl_dist.run --help-config zo                                    # every key of a section
  python -m hosfl_dist.run --status runs/quickstart/latest                     # how a run stands
  python -m hosfl_dist.run --config configs/quickstart.yaml job.resume=auto job.out_dir=runs/p8   # go on after a stop
  python -m hosfl_dist.run --plugin mymethod --config configs/quickstart.yaml algorithm.name=my_method
  python -m hosfl_dist.run --config configs/quickstart.yaml --serve job.out_dir=runs/el   # an elastic run; then:
  python -m hosfl_dist.run --join runs/el                                      # a worker joins it
  OMP_NUM_THREADS=1 torchrun --nproc_per_node=3 -m hosfl_dist.run --config configs/quickstart.yaml

Every key: docs/configuration.md, or --help-config. Bad input is one line "error: ...", exit code 2.
"""
"""What ``--help`` ends with: one command per mode (tests/test_cli.py parses each)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hosfl_dist.run", description=__doc__, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--config", help="YAML config file (sections of hosfl_dist.config.Config)")
    p.add_argument("--dry-run", action="store_true", help="build the config (and data/model) and print it; no training")
    p.add_argument(
        "--help-config",
        nargs="?",
        const="",
        metavar="SECTION",
        help="print every config key (or those of SECTION, e.g. zo or clients.optim) with its type, default and "
        "meaning, and exit",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="only check the input that can fail fast (config, devices, job.out_dir, the role map of --nproc) and "
        "exit: 0 if it is usable, 2 with one line if not; changes nothing (the launch scripts run it before torchrun)",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=0,
        help="with --dry-run or --check: the role map of a torchrun world of NPROC processes",
    )
    p.add_argument(
        "--status",
        metavar="DIR",
        help="say in one line how the run in DIR stands (running and by which process, completed, failed, interrupted, "
        "or died: its processes ended without recording how) and exit; changes nothing",
    )
    p.add_argument(
        "--record-death",
        action="store_true",
        help="if the run died (its summary says running, no process holds it), write that into its summary.json and "
        "say how it stands: the run in --status DIR, or the one this config and overrides write (the launch scripts "
        "do this when torchrun has ended with an error)",
    )
    p.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE before anything is built (it may register a method, a task, a model or a model source of "
        "its own), like job.plugins; repeat for several (docs/python-api.md#plug-ins)",
    )
    p.add_argument(
        "--serve",
        action="store_true",
        help="serve an elastic run (HO-SFL): client workers join and leave it while it runs (--join); writes the join "
        "address into the run folder (docs/participation.md#elastic-runs)",
    )
    p.add_argument(
        "--address",
        default="127.0.0.1:0",
        metavar="HOST:PORT",
        help="with --serve: where workers reach the server (default 127.0.0.1 and a free port; 0.0.0.0:PORT for "
        "workers on other machines)",
    )
    p.add_argument(
        "--join",
        metavar="RUN_DIR",
        help="join the elastic run served in RUN_DIR as a client worker, until the run ends (its config is the run's)",
    )
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. zo.num_perturbations=8 job.seed=3")
    return p.parse_intermixed_args(argv)  # overrides before and after options, as the studies take them


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    launch = cfg = None
    try:
        if args.help_config is not None:
            return _help_config(args.help_config, args.plugin)
        if args.status is not None:
            return _status(Path(args.status), args.record_death)
        if args.join is not None:
            if args.config or args.overrides or args.serve:
                raise ConfigError("invalid value for --join: a worker takes the run's own config (give --join "
                                  "RUN_DIR alone)")  # fmt: skip
            from hosfl_dist.runtime.elastic.driver import run_join

            init_logging("worker")
            return run_join(args.join)
        from hosfl_dist.runtime.process.launch import launch_env  # torch-free: a bad config fails at once

        launch = launch_env()  # None without torchrun
        cfg = _config(args)
        world = launch.world_size if launch is not None else args.nproc
        if args.record_death:
            return _record_death(cfg)
        if args.check:
            if args.serve:
                from hosfl_dist.runtime.serve import check_elastic, parse_address

                check_elastic(cfg)
                parse_address(args.address)
            else:
                from hosfl_dist.runtime.checks import check_fixed_runtime

                check_fixed_runtime(cfg, "torchrun" if world > 1 else "in_process")
            return _check(cfg, world)
        if args.dry_run:
            return _dry_run(cfg, launch, world)
        if args.serve:
            from hosfl_dist.runtime.serve import run_serve, run_serve_group

            if launch is not None:  # the server as a group of server.ranks ranks (FSDP2 over f_s)
                init_logging("server" if launch.rank == 0 else f"server-shard {launch.rank}", launch.rank == 0)
                code, out = run_serve_group(cfg, launch, args.address)
                if out is not None:
                    say_done(*out, cfg)
                return code
            init_logging("server")
            summary, folder = run_serve(cfg, args.address)
            say_done(summary, folder, cfg)
            return 0
        if world > 1 and launch is not None:
            if not _completed_already(cfg, launch):
                return _train_torchrun(cfg, launch, world)
            return 0
        summary, folder = train_here(cfg)
        if summary is not None:
            say_done(summary, folder, cfg)
        return 0
    except KeyboardInterrupt:  # Ctrl-C before the run's stop handler was in place, or a second one (at once)
        if launch is None or launch.rank == 0:
            print(_stopped_at_once(cfg), file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - each kind is said in one line; anything else keeps its traceback
        failure = exc if isinstance(exc, HosflError) else write_failure(exc, cfg and cfg.job.out_dir, denied=True)
        if failure is None and not isinstance(exc, (OSError, MemoryError)):
            raise
        if launch is not None and launch.rank != 0 and isinstance(exc, HosflError):
            time.sleep(3)  # the same error on every rank: rank 0 says it; torchrun stops the job at the first exit
        elif isinstance(failure, Interrupted) and failure.by_ctrl_c:
            print(f"interrupted: the run stopped by {failure}", file=sys.stderr)
        elif failure is not None:  # bad input or a full disk (exit 2), a run that diverged or was stopped (exit 1)
            print(f"error: {failure}", file=sys.stderr)
        else:  # the machine, not the code: no memory, another I/O error (summary.json says so)
            print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return failure.exit_code if failure is not None else 1


def say_done(summary: dict[str, Any], folder: str | Path, cfg: Config) -> None:
    """The end of a completed run, as every runtime ends it: ``done:`` and the three lines a newcomer reads (accuracy,
    client memory against inference, uplink against SFL's: :mod:`hosfl_dist.measure.outcome`)."""
    from hosfl_dist.measure.outcome import run_lines
    from hosfl_dist.runtime.record.writer import done_line

    print(done_line(summary, folder), flush=True)
    print(run_lines(summary, cfg), flush=True)


def _stopped_at_once(cfg: Config | None) -> str:
    """The line of a run stopped by Ctrl-C at once: what it was, and how to go on."""
    if cfg is None:
        return "interrupted: hosfl_dist.run stopped by Ctrl-C before its config was read; nothing was written"
    where = f"job.out_dir={cfg.job.out_dir}" if cfg.job.out_dir else f"runs/{cfg.job.name}/latest"
    return (f"interrupted: the run {cfg.job.name} ({where}) stopped at once by KeyboardInterrupt (Ctrl-C), without a "
            "checkpoint of its own; run the same command again with job.resume=auto to "
            "continue from the newest checkpoint its folder holds (or start afresh where it holds none)")  # fmt: skip


# -- the modes, in the order main tries them -----------------------------------------------------------------------
def _help_config(section: str, plugins: list[str]) -> int:
    """``--help-config [SECTION]``: every config key (of SECTION) with its type, default and meaning (and the methods
    ``--plugin`` modules register)."""
    from hosfl_dist.cli.config_help import help_config

    print(help_config(section, plugins), end="")
    return 0


def _status(folder: Path, record: bool, given: bool = True) -> int:
    """``--status DIR [--record-death]``: how the run in DIR stands, after writing ``died`` into its summary if it
    died and ``record`` asks for it. A DIR that is no folder (``given``: the user named it) is bad input: one line,
    exit code 2 (a mistyped path must not read as "nothing to report")."""
    from hosfl_dist.runfolder.folder import describe_status, record_death

    if given and not folder.is_dir():
        why = "no such folder" if not folder.exists() else "not a folder"
        raise ConfigError(f"--status {folder}: {why} (give a run's folder: job.out_dir, or runs/<job.name>/latest)")
    if record:
        record_death(folder)
    print(describe_status(folder))
    return 0


def _config(args: argparse.Namespace) -> Config:
    """The run's config (with ``--plugin``'s modules added to ``job.plugins``), checked: :func:`run_config`."""
    return run_config(args.config, args.overrides, args.plugin)


def run_config(config: str | Path | Config | None, overrides: list[str] | tuple[str, ...] = (),
               plugins: list[str] | tuple[str, ...] = ()) -> Config:  # fmt: skip
    """A run's config as ``python -m hosfl_dist.run`` builds it, checked before torch is imported where it can be (the
    loggers), then (its plug-ins imported) against the algorithm registry."""
    cfg = load_config(config, list(overrides))
    if plugins:
        listed = [*cfg.job.plugins, *(m for m in dict.fromkeys(plugins) if m not in cfg.job.plugins)]
        cfg = dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, plugins=listed))
    from hosfl_dist.runtime.record.tracking import check_loggers

    check_loggers(cfg)  # a logger without its package: one line, before torch
    from hosfl_dist.runtime.checks import check_config  # the algorithm registry (imports torch)

    check_config(cfg)  # the sections against each other and what the method implements
    return cfg


def _record_death(cfg: Config) -> int:
    """``--record-death`` without ``--status``: the run this config writes (a new folder's: runs/<job.name>/latest)."""
    from hosfl_dist.runfolder.folder import deterministic_out_dir

    folder = deterministic_out_dir(cfg, restarted=True)
    if folder is not None:  # a run that never made its folder has nothing to record
        _status(folder, record=True, given=False)
    return 0


def _check(cfg: Config, world: int) -> int:
    """``--check``: the input that can fail fast (role map, devices, interface, job.out_dir, what the build refuses),
    without changing anything."""
    from hosfl_dist.cli.precheck import check_build
    from hosfl_dist.runfolder.folder import check_out_dir, deterministic_out_dir, with_out_dir
    from hosfl_dist.runtime.process.host import check_devices, check_interface
    from hosfl_dist.runtime.process.launch import role_map

    if world > 1:
        role_map(cfg, world)
    check_devices(cfg)
    check_interface(cfg.job.interface)
    folder = deterministic_out_dir(cfg)
    if folder is not None:  # otherwise a new folder is made at start
        check_out_dir(with_out_dir(cfg, folder))
    check_build(cfg, world)  # what the build refuses: an LM's cut and LoRA targets, a text task's files
    return 0


def _dry_run(cfg: Config, launch: LaunchEnv | None, world: int) -> int:
    """``--dry-run``: the resolved config, what it builds and (in a world of several processes) the role map, printed
    by one process."""
    from hosfl_dist.runtime.process.launch import role_map

    if launch is None or launch.rank == 0:
        print(dump_config(cfg), end="")
        print("# built:", json.dumps(dry_run(cfg)))
        if world > 1:
            roles = role_map(cfg, world).describe().splitlines()
            print("# roles:\n" + "\n".join("#  " + line for line in roles))
    return 0


def dry_run(cfg: Config) -> dict:
    """Validate what can be validated without training: config, data files, model construction and split."""
    from hosfl_dist.algorithms import get_algorithm
    from hosfl_dist.data import build_data
    from hosfl_dist.models import build_split_model
    from hosfl_dist.runtime.build import data_sections

    if cfg.model.name == "hf":  # hub models/data cannot be built offline: validate what can be, say what was not
        from hosfl_dist.models.lm import check_without_hub, hub_requirements

        needs = hub_requirements(cfg.model, cfg.data)
        if needs:
            return {"built": False, "not_built_because": needs, "checked": check_without_hub(cfg.model, cfg.split)}
    import torch

    if cfg.job.device.startswith("cuda") and not torch.cuda.is_available():  # a GPU job checked on a CPU node
        cfg = dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, device="cpu"))
    data = build_data(data_sections(cfg))
    zeroth_order = get_algorithm(cfg.algorithm.name).zeroth_order_client
    split = build_split_model(cfg, data.info, zeroth_order, parts=())  # LMs stay on the meta device: 8B costs nothing

    def count(m, trainable: bool) -> int:
        return sum(p.numel() for p in m.parameters() if p.requires_grad or not trainable)

    scorer = data.info.get("scorer")  # a plug-in task's loss and metrics: named, not printed as an object
    return {
        "data": {k: v for k, v in data.info.items() if k != "scorer"},
        **({"task_metrics": sorted(scorer.metrics)} if scorer is not None else {}),
        "client_params": count(split.client, False),
        "client_trainable_params": count(split.client, True),
        "server_params": count(split.server, False),
        "server_trainable_params": count(split.server, True),
    }


def _completed_already(cfg: Config, launch: LaunchEnv | None) -> bool:
    """Whether the folder this run writes holds it, finished (completed, or stopped by its own early stopping: a Slurm
    job again, a sweep re-run): then nothing is left to do, and rank 0 says so."""
    from hosfl_dist.runfolder.folder import completed_already, deterministic_out_dir, recorded_summary, with_out_dir

    folder = deterministic_out_dir(cfg)
    if folder is None or not completed_already(with_out_dir(cfg, folder)):
        return False
    if launch is None or launch.rank == 0:
        summary = recorded_summary(folder) or {}
        how = "completed"
        if summary.get("status") == "stopped":
            how = f"stopped early by {summary['stopped'].get('by')} after round {summary.get('rounds')}"
        print(f"done: {folder} holds this run, {how}; nothing to do (job.resume=auto)")
    return True


def _train_torchrun(cfg: Config, launch: LaunchEnv, world: int) -> int:
    """This process's part of a torchrun job: rank 0 serves (and prints the run's last line), the others work."""
    from hosfl_dist.runtime.process.launch import role_map

    roles = role_map(cfg, world)
    init_logging(roles.label(launch.rank), verbose=launch.rank in (0, roles.leader))
    from hosfl_dist.runtime.torchrun import run_torchrun

    code, done = run_torchrun(cfg, launch)
    if done is not None:  # rank 0 of a completed run
        say_done(*done, cfg)
    return code


def train_here(cfg: Config, callbacks: Iterable[Any] = ()) -> tuple[dict[str, Any] | None, str]:
    """The whole run in this one process, as ``python -m hosfl_dist.run`` trains it (and :func:`hosfl_dist.train`):
    (its summary, its folder); (None, the folder) where that folder holds it completed already (job.resume=auto). A
    run that fails raises, after recording it."""
    if _completed_already(cfg, None):
        from hosfl_dist.runfolder.folder import deterministic_out_dir

        return None, str(deterministic_out_dir(cfg))
    if cfg.server.ranks > 1:
        raise ConfigError(f"server.ranks={cfg.server.ranks} needs a server group: start with torchrun")
    init_logging()
    from hosfl_dist.runtime.inprocess import InProcessRunner

    runner = InProcessRunner(cfg, callbacks).setup()
    summary = runner.run()
    return summary, runner.cfg.job.out_dir
