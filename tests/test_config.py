"""The config tree: precedence, strictness, validation messages, and every shipped YAML."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hosfl_dist.config import Config, build_config, dump_config, load_config
from hosfl_dist.config.preset import preset_names, read_preset
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


# -- numbers read as written: YAML 1.2's core schema ----------------------------------------------------------------
def test_scalars_are_read_by_yaml_1_2_core_schema():
    from hosfl_dist.safe_yaml import load_text

    got = load_text("[02000, 0o17, 0x1F, -0, +12, 1:30, 1_000, 0b11, 1e3, .5, 1., 1.0e+300, -.inf, .NaN, true, True, "
                    "FALSE, yes, no, on, off, y, ~, null, NULL, 2001-02-30, '=']", "test")  # fmt: skip
    ints, text, floats, flags, nulls, date = got[:5], got[5:8], got[8:14], got[14:21], got[22:25], got[25]
    assert ints == [2000, 15, 31, 0, 12] and all(type(v) is not bool and isinstance(v, int) for v in ints)
    assert text == ["1:30", 1000, "0b11"] and text[1].text == "1_000"  # no base 60, no 0b in YAML 1.2; _ as Python
    assert floats[:5] == [1000.0, 0.5, 1.0, 1e300, float("-inf")] and floats[5] != floats[5]  # nan
    assert flags == [True, True, False, "yes", "no", "on", "off"] and got[21] == "y"
    assert nulls == [None, None, None] and date == "2001-02-30" and got[26] == "="
    assert [v.text for v in (*ints, *floats)] == ["02000", "0o17", "0x1F", "-0", "+12", "1e3", ".5", "1.", "1.0e+300",
                                                  "-.inf", ".NaN"]  # fmt: skip
    assert {type(v).__name__ for v in ints} == {"int"} and {type(v).__name__ for v in floats} == {"float"}  # messages


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.budget_samples=02000", 2000),  # decimal, not YAML 1.1's octal 1024
        ("train.budget_samples=+2000", 2000),
        ("train.budget_samples=0x7D0", 2000),  # hex and octal with their prefixes (YAML 1.2 core ints)
        ("train.budget_samples=0o3720", 2000),
        ("job.name=0x10", "0x10"),  # a str key takes the text as written, not "16"
        ("job.name=007", "007"),
        ("job.out_dir=1:30", "1:30"),  # not 90 (YAML 1.1's base 60)
        ("job.name=1e3", "1e3"),
        ("job.name=yes", "yes"),
        ("job.name=off", "off"),
        ("job.name=2001-02-03", "2001-02-03"),
        ("zo.mu=1", 1.0),  # a float key takes an integer
        ("job.overwrite=True", True),
        ("job.overwrite=FALSE", False),
    ],
)
def test_numbers_are_read_as_written(override, expected):
    key, _, _ = override.partition("=")
    section, name = key.split(".")
    value = getattr(getattr(load_config(None, [override]), section), name)
    assert value == expected and type(value) is type(expected)  # plain int/float/str, not the loader's subclasses


def test_numbers_are_read_as_written_in_a_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("job: {name: 0x10, seed: 02000}\ntrain: {budget_samples: 0x7D0}\nzo: {mu: 1}\n")
    cfg = load_config(path)
    assert (cfg.job.name, cfg.job.seed, cfg.train.budget_samples, cfg.zo.mu) == ("0x10", 2000, 2000, 1.0)
    path.write_text("job:\n  name: 007\n  seed: 1:30\n")
    with pytest.raises(ConfigError, match=r"^invalid value for job.seed: '1:30' \(expected an integer\)$"):
        load_config(path)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("job.seed=1:30", "job.seed: '1:30' (expected an integer)"),  # not 90 (base 60)
        ("train.budget_samples=1.0e+300", "train.budget_samples: 1.0e+300 (expected an integer)"),
        ("train.budget_samples=1e300", "train.budget_samples: 1e300 (expected an integer)"),
        ("train.budget_samples=2000.0", "train.budget_samples: 2000.0 (expected an integer)"),
        ("train.budget_samples=1e3", "train.budget_samples: 1e3 (expected an integer)"),
        ("job.seed=true", "job.seed: True (expected an integer)"),  # True is not 1
        ("zo.mu=true", "zo.mu: True (expected a number)"),
        ("job.overwrite=yes", "job.overwrite: 'yes' (expected true or false; yes, no, on and off are text in YAML 1"),
        ("job.overwrite=on", "job.overwrite: 'on' (expected true or false; yes, no, on and off are text in YAML 1"),
        ("job.overwrite=1", "job.overwrite: 1 (expected true or false)"),
        ("job.name=true", "job.name: True (expected a string; YAML reads true and false as booleans: quote the word)"),
    ],
)
def test_numbers_of_the_wrong_kind_are_refused_naming_the_key(override, needle):
    with pytest.raises(ConfigError) as exc:
        load_config(None, [override])
    assert str(exc.value).startswith(f"invalid value for {needle}") and "\n" not in str(exc.value)


def test_a_dumped_config_quotes_text_that_yaml_1_2_reads_as_a_number(tmp_path):
    from hosfl_dist.safe_yaml import load_text

    for name in ("1e3", "0o17", "0x10", "007", "yes", "1:30", ".5", "1_000"):
        cfg = load_config(None, [f"job.out_dir='{name}'"])
        text = dump_config(cfg)
        assert load_text(text, "dump")["job"]["out_dir"] == name and yaml.safe_load(text)["job"]["out_dir"] == name
        (tmp_path / "c.yaml").write_text(text)
        assert load_config(tmp_path / "c.yaml") == cfg


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


# -- named presets ---------------------------------------------------------------------------------------------------
REPRO_CONFIGS = sorted(
    [*(ROOT / "configs/repro").glob("*.yaml"), *(ROOT / "configs/finetune").glob("hosfl_*.yaml"),
     *(ROOT / "configs/paper/table3").glob("*.yaml")]  # fmt: skip
)


def _leaves(values, prefix=""):
    for key, value in values.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _get(cfg, dotted):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("preset", preset_names())
@pytest.mark.parametrize("path", REPRO_CONFIGS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_preset_applies_to_every_repro_config(path, preset):
    cfg = load_config(path, [f"preset={preset}"])
    for key, value in _leaves(read_preset(preset)["set"]):
        assert _get(cfg, key) == value, key


@pytest.mark.parametrize("part", ["cifar10_iid", "cifar10_dirichlet", "cifar100_iid", "cifar100_dirichlet"])
def test_table3_configs_are_the_text_and_the_code_presets(part):
    """The paper's Table 3 configs: the text's file is its own paper_text preset; the code's file is the text's
    with paper_code (the job's name aside)."""
    text = ROOT / f"configs/paper/table3/{part}.yaml"
    name = ["job.name=x"]
    assert load_config(text, name) == load_config(text, ["preset=paper_text", *name])
    code = ROOT / f"configs/paper/table3/{part}_code.yaml"
    assert load_config(code, name) == load_config(text, ["preset=paper_code", *name])


def test_a_preset_sits_over_the_file_and_under_every_override(tmp_path):
    base = ROOT / "configs/repro/cifar10_iid.yaml"
    for order in (["train.budget_samples=64", "preset=paper_code"], ["preset=paper_code", "train.budget_samples=64"]):
        cfg = load_config(base, order)
        assert (cfg.train.budget_samples, cfg.clients.optim.lr, cfg.model.freeze_bn) == (64, 1e-3, "code")
    two = load_config(base, ["preset=paper_code", "preset=paper_text"])  # the later preset wins where both set a key
    assert two.clients.optim.lr == 1e-5
    f = tmp_path / "c.yaml"  # a file's own preset sits under the file's sections
    f.write_text("preset: paper_text\nmodel: {name: resnet18}\nclients: {optim: {lr: 0.01}}\n")
    cfg = load_config(f)
    assert (cfg.clients.optim.lr, cfg.server.optim.lr, cfg.model.freeze_bn) == (0.01, 1e-5, "all")
    assert "preset" not in dump_config(cfg)  # what ran is the values


@pytest.mark.parametrize(
    "path, overrides, needle",
    [
        (ROOT / "configs/repro/cifar10_iid.yaml", ["preset=nope"], "unknown preset 'nope' (known presets: paper_"),
        (ROOT / "configs/llm/opt-125m_sst2.yaml", ["preset=paper_text"], "preset paper_text holds settings for model"),
    ],
)
def test_a_bad_preset_is_one_line(path, overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_presets_are_package_data():
    assert "hosfl_dist.config = presets/*.yaml" in (ROOT / "setup.cfg").read_text()
    assert set(preset_names()) >= {"paper_text", "paper_code"}


# -- a mistyped name: did you mean, and every error of a file at once ----------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["zo.muu=1"], "unknown key zo.muu in section zo (did you mean zo.mu?)"),
        (["clinets.total=3"], "unknown key clinets in section <root> (did you mean clients?)"),  # a section
        (["clients.optim.lrr=1"], "unknown key clients.optim.lrr in section clients.optim (did you mean clients.optim."
                                  "lr?)"),  # fmt: skip
        (["zo.batch_size=3"], "unknown key zo.batch_size in section zo (did you mean clients.batch_size?)"),
        (["clients.replicas=per-client"], "(choose one of ['per_client', 'shared']; did you mean 'per_client'?)"),
        (["algorithm.name=hosf"], "; did you mean 'hosfl'?)"),
        (["data.name=fashion_mnst"], "; did you mean 'fashion_mnist'?)"),
        (["model.name=resnet81"], "; did you mean 'resnet18'?)"),
        (["preset=paper_cod"], "; did you mean paper_code?)"),
    ],
)
def test_a_mistyped_name_says_which_it_was_most_likely_meant_to_be(overrides, needle):
    with pytest.raises(ConfigError) as exc:
        load_run_config(None, overrides)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_a_mistyped_model_source_architecture_or_text_task_says_which_it_was_meant_to_be():
    from hosfl_dist.data.text import get_task
    from hosfl_dist.models.archs import arch_fields
    from hosfl_dist.models.sources import resolve

    with pytest.raises(ConfigError, match=r"unknown tiny name 'lama'; known: .*; did you mean tiny:llama\?$"):
        resolve("tiny:lama")
    with pytest.raises(ConfigError, match=r"unknown architecture 'qwen3-8'; .*; did you mean qwen3-8b\?$"):
        arch_fields("qwen3-8")
    with pytest.raises(ConfigError, match=r"unknown text task 'sst'; .*; did you mean sst2\?$"):
        get_task("sst")
    # a name near nothing lists the choices and guesses none
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["zo.qqqqqq=1"])
    assert "(known keys: batch_clients, " in str(exc.value) and "did you mean" not in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        load_run_config(None, ["algorithm.name=qqqqqq"])
    assert "did you mean" not in str(exc.value)


def test_a_file_reports_every_error_at_once_in_one_line_in_the_order_written(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("zo:\n  muu: 1\n  num_perturbations: many\nclients:\n  total: 0\n  replicas: per-client\n"
                 "trian:\n  budget_samples: 10\n")  # fmt: skip
    with pytest.raises(ConfigError) as exc:
        load_config(f, ["job.nmae=x"])
    said = str(exc.value)
    assert "\n" not in said and said.startswith("5 errors in the config: (1) unknown key zo.muu in section zo")
    order = ["zo.muu", "zo.num_perturbations: 'many'", "clients.replicas: 'per-client'", "unknown key trian",
             "job.nmae"]  # fmt: skip
    assert [said.index(n) for n in order] == sorted(said.index(n) for n in order), said
    # a section whose values are refused is not checked further (clients.total=0 waits for clients.replicas)
    assert "clients.total" not in said
    f.write_text("clients:\n  total: 0\n")  # on its own, the section's own check speaks
    with pytest.raises(ConfigError, match=r"^invalid value for clients.total: 0 \(must be >= 1\)$"):
        load_config(f)


def test_a_file_with_many_errors_lists_the_first_twenty_and_counts_the_rest():
    with pytest.raises(ConfigError) as exc:
        load_config(None, [f"zo.bogus{i}=1" for i in range(25)])
    said = str(exc.value)
    assert said.startswith("25 errors in the config: (1) unknown key zo.bogus0")
    assert "(20) unknown key zo.bogus19" in said
    assert "(21)" not in said and said.endswith("; and 5 more")


@pytest.mark.parametrize("where", ["override", "yaml"])
def test_numbers_with_underscores_are_read_one_way_everywhere(tmp_path, where):
    """An underscore between two digits, as Python's int() and float() read it, for integers and floats alike, in an
    override and in a YAML file; anywhere else the text is no number, and a number's field refuses it."""

    def load(key: str, text: str):
        if where == "override":
            return load_config(None, [f"{key}={text}"])
        *sections, name = key.split(".")
        nested = "".join(f"{'  ' * i}{s}:\n" for i, s in enumerate(sections))
        (tmp_path / "c.yaml").write_text(f"{nested}{'  ' * len(sections)}{name}: {text}\n")
        return load_config(tmp_path / "c.yaml")

    assert load("train.budget_samples", "3_072").train.budget_samples == 3072
    assert load("server.optim.lr", "1e-3_0").server.optim.lr == 1e-30  # the exponent's digits: 30
    assert load("server.optim.lr", "2_5e-4").server.optim.lr == 25e-4
    assert load("job.name", "2026_12_02").job.name == "2026_12_02"  # text as written
    for bad in ("_3072", "3072_", "3__072", "1_.5", "1._5", "1e_3"):
        with pytest.raises(ConfigError, match="invalid value for train.budget_samples"):
            load("train.budget_samples", bad)
        with pytest.raises(ConfigError, match="invalid value for server.optim.lr"):
            load("server.optim.lr", bad)
