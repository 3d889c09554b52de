"""The config tree: precedence, strictness, validation messages, and every shipped YAML."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hosfl_dist.config import Config, build_config, dump_config, load_config
from hosfl_dist.errors import ConfigError
from hosfl_dist.runtime.checks import load_run_config

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_then_yaml_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("zo: {num_perturbations: 4, mu: 1.0e-4}\njob: {seed: 1}\n")
    cfg = load_config(f, ["zo.num_perturbations=8", "job.seed=3", "clients.optim.lr=1e-3"])
    assert cfg.zo.num_perturbations == 8 and cfg.job.seed == 3  # CLI beats YAML
    assert cfg.zo.mu == 1e-4  # YAML beats default
    assert cfg.clients.optim.lr == 1e-3 and isinstance(cfg.clients.optim.lr, float)  # "1e-3" read as a number
    assert cfg.clients.total == Config().clients.total  # default kept


def test_contract_keys_exist():
    cfg = load_config(
        None,
        [
            "algorithm.name=hosfl",
            "job.seed=5",
            "job.out_dir=x",
            "zo.num_perturbations=2",
            "zo.mu=0.01",
            "clients.total=10",
            "clients.per_round=3",
            "train.budget_samples=1000",
        ],
    )
    assert (cfg.clients.total, cfg.clients.per_round, cfg.train.budget_samples) == (10, 3, 1000)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["zo.num_perturbation=3"], "unknown key zo.num_perturbation in section zo"),
        (["clients.optim.lrr=1"], "unknown key clients.optim.lrr in section clients.optim"),
        (["bogus.x=1"], "unknown key bogus"),
        (["zo.num_perturbations=abc"], "zo.num_perturbations: 'abc' (expected an integer)"),
        (["zo.overlap=3"], "zo.overlap: 3 (choose one of ['auto']; or expected true or false)"),
        (["zo.mu=0"], "zo.mu: 0.0 (must be a finite perturbation scale in [1e-09, 1]"),
        (["zo.mu=inf"], "zo.mu: inf (must be a finite"),
        (["zo.mu=1e-30"], "zo.mu: 1e-30 (must be a finite perturbation scale in [1e-09, 1]; below it θ + μu rounds"),
        (["zo.num_perturbations=100000"], "zo.num_perturbations: 100000 (must be in 1..10000"),
        (["zo.rng_device=foo"], "zo.rng_device: 'foo' (use cpu or cuda)"),
        (["zo.perturb_batch=0"], "zo.perturb_batch: 0 (must be an integer >= 1: the perturbed forwards batched"),
        (["zo.perturb_batch=2.5"], "zo.perturb_batch: 2.5 (expected an integer)"),
        (["algorithm.name=zo_sfl", "zo.perturb_batch=2"],
         "zo.perturb_batch: 2 (batched perturbed forwards are implemented for hosfl, not algorithm.name=zo_sfl)"),
        (["job.seed=-1"], "job.seed: -1 (must be >= 0)"),
        (["job.out_dir=' '"], "job.out_dir: ' ' (must name a folder"),
        (["job.threads=-1"], "job.threads: -1 (must be >= 0"),
        (["job.device=gpu"], "job.device: 'gpu' (use cpu, cuda or cuda:<index>)"),
        (["server.rpc_timeout_s=inf"], "server.rpc_timeout_s: inf (must be between 1 s and a week"),
        (["server.rpc_timeout_s=1e-9"], "server.rpc_timeout_s: 1e-09 (must be between 1 s and a week"),
        (["clients.optim.lr=inf"], "clients.optim.lr: inf"),
        (["train.on_nonfinite=skip", "algorithm.name=sfl"], "train.on_nonfinite: 'skip' (algorithm.name=sfl stops"),
        (["job.resume=auto", "job.overwrite=true"], "job.overwrite: True (job.resume=auto keeps the folder's run"),
        (["zo.num_perturbations=0"], "zo.num_perturbations"),
        (["clients.total=5", "clients.per_round=6"], "clients.per_round: 6 (K must not exceed clients.total (M=5))"),
        (["split.cut=3"], "split.cut: 3"),
        (["model.name=vgg"], "model.name: 'vgg' (choose one of"),
        (["algorithm.name=nope"], "algorithm.name: 'nope'"),
        (["clients.optim.lr=-1"], "clients.optim.lr: -1.0"),
        (["clients.replicas=some"], "clients.replicas: 'some' (choose one of ['per_client', 'shared'])"),
        (["zo"], "not of the form"),
    ],
)
def test_bad_input_names_the_key(overrides, needle):
    with pytest.raises(ConfigError) as exc:
        load_run_config(None, overrides)  # the tree, then the checks across its sections
    assert needle in str(exc.value)
    assert "\n" not in str(exc.value)


def test_missing_config_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(bad)


def test_dump_round_trips():
    cfg = load_config(None, ["zo.num_perturbations=7", "data.partition=dirichlet"])
    again = build_config(yaml.safe_load(dump_config(cfg)))
    assert again == cfg


def shipped_configs() -> list[Path]:
    return sorted(p for p in (ROOT / "configs").rglob("*.yaml"))


@pytest.mark.parametrize("path", shipped_configs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_config_loads(path):
    """Every YAML under configs/ builds: training configs into Config, latency-model configs into theirs."""
    if "latency" in path.parts:
        from hosfl_dist.measure.latency.cli import load_latency_setup

        load_latency_setup(path)
        return
    load_run_config(path)
    first = path.read_text().splitlines()[0]
    assert first.startswith("#") and "hosfl_dist.run" in first, f"{path} must open with the command that runs it"


def test_help_config_lists_every_key_with_type_default_and_meaning(capsys):
    from hosfl_dist.cli.config_help import _entries, help_config
    from hosfl_dist.run import main

    undocumented = [key for key, _, _, doc, _ in _entries(Config(), "") if not doc]
    assert undocumented == []  # every field of the tree carries its docstring
    assert main(["--help-config", "zo"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("zo:  Zeroth-order estimator of the clients.\n")
    assert "  zo.num_perturbations: int = 5\n      P: perturbed client forwards" in out
    assert "  zo.perturb_mode: 'hooks' | 'copy' = 'hooks'\n" in out
    full = help_config()
    assert "  clients.optim.lr: float = 1e-05\n" in full and "  comm.uplink_mbps: float = 30.0\n" in full  # inherited
    assert main(["--help-config", "nope"]) == 2
    assert capsys.readouterr().err.startswith("error: --help-config: no section 'nope'; sections: job, algorithm")


def test_help_config_answers_without_importing_torch():
    """--help-config lists defaults: it builds them without Config's registry check, so torch is never imported
    (with it the answer took ~7 s on the 2-core machine, without it ~0.4 s)."""
    import subprocess
    import sys

    code = (
        "import sys, io, contextlib\n"
        "from hosfl_dist.run import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out: rc = main(['--help-config'])\n"
        "print(rc, 'torch' in sys.modules, 'job.threads: int = 0' in out.getvalue())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["0", "False", "True"]
