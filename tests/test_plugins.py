"""A task and a model in the user's own module (docs/python-api.md, "A task and a model of your own"): loaded with
``--plugin`` / ``job.plugins``, they run end to end in one process and under torchrun, ``--help-config`` lists them,
an unknown name is one line listing the registered ones; and the memory profiler measures a plug-in method like the
built-in it derives from."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import hosfl_dist
from hosfl_dist.data import TaskSpec, TensorData, build_data, register_task
from hosfl_dist.errors import ConfigError, DataError
from hosfl_dist.models import ModelSpec, build_split_model, register_model
from hosfl_dist.runtime.build import data_sections
from hosfl_dist.runtime.checks import load_run_config
from tiny import (
    ROOT,
    TINY_OVERRIDES,
    lm_overrides,
    page_block,
    read_run,
    rows_of,
    torchrun,
    user_folder,
    user_module,
    write_text_files,
)

PARTS = page_block('register_task(TaskSpec("blobs"')
"""The task and the model written outside the repository, as the page shows them."""
METHOD = page_block('register(AlgorithmSpec("my_method"')
SOURCE = page_block('register_source(SourceSpec("toy"')
SCORED = page_block('register_task(TaskSpec("soft_blobs"')
"""A task of the user's with its own loss (label smoothing) and metric (top-2 accuracy), over myparts.py's blobs."""
BAD = '''
"""Plug-ins wrong in each way the package checks where it builds a run, over myparts.py's blobs."""
import torch
from torch import nn
from transformers import LlamaConfig

from hosfl_dist.data import TaskSpec, register_task
from hosfl_dist.models import ModelSpec, register_model
from hosfl_dist.models.sources import SourceSpec, register_source
from myparts import DIM, load_blobs


def wide(cfg, info, zeroth_order_client):
    """A head of num_classes + 2 (it would train: the two surplus classes are never labelled)."""
    return nn.Sequential(nn.Linear(DIM, 8), nn.ReLU()), nn.Linear(8, info["num_classes"] + 2)


def misfit(cfg, info, zeroth_order_client):
    """f_c gives 8 features, f_s takes 9."""
    return nn.Sequential(nn.Linear(DIM, 8), nn.ReLU()), nn.Linear(9, info["num_classes"])


def pairwise(outputs, labels):
    """(B, 2): two scores per sample."""
    return torch.stack([labels.float(), labels.float()], dim=1)


def broken(outputs, labels):
    raise ZeroDivisionError("no score today")


def late(outputs, labels):
    """Fine on a made-up batch of two, raises on the held-out ones."""
    if outputs.shape[0] > 2:
        raise ValueError("more than two samples")
    return torch.ones(outputs.shape[0])


def lost(data, seed):
    raise OSError("the blobs are gone")


def names():
    raise RuntimeError("the list of names is unreachable")


def toy_config(name):
    return LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=int(name),
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


register_model(ModelSpec("wide_mlp", wide, cuts=(1, 1)))
register_model(ModelSpec("misfit_mlp", misfit, cuts=(1, 1)))
register_task(TaskSpec("pair_blobs", load=load_blobs, metrics={"eval_pair": pairwise}))
register_task(TaskSpec("broken_blobs", load=load_blobs, metrics={"eval_broken": broken}))
register_task(TaskSpec("late_blobs", load=load_blobs, metrics={"eval_late": late}))
register_task(TaskSpec("lost_blobs", load=lost))
register_source(SourceSpec("badtoy", toy_config, names=names))
'''
"""What tests/test_plugins.py's checks of a plug-in's code refuse (docs/python-api.md, "What the package checks")."""
PLUGGED = [*TINY_OVERRIDES, "data.name=blobs", "model.name=mlp", "model.width=8", "split.cut=1"]
"""The tiny run on the plug-in's task and model (TINY_OVERRIDES' budget, clients and P)."""
PARTS_MOD, METHOD_MOD, SOURCE_MOD, TASK_MOD, BAD_MOD = (
    user_module(n) for n in ("myparts", "mymethod", "mysource", "mytask", "badparts")
)
"""The page's myparts.py, mymethod.py, mysource.py and mytask.py as the tests write and import them (no user's file of
the page's name in the checkout stands for them)."""


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """myparts.py and mymethod.py in a folder of the user's, importable here and by every process started from here."""
    yield user_folder(tmp_path, monkeypatch, {"myparts": PARTS, "mymethod": METHOD, "mysource": SOURCE,
                                                  "mytask": SCORED, "badparts": BAD})
    from hosfl_dist import algorithms
    from hosfl_dist.data import registry as tasks
    from hosfl_dist.models import registry as models
    from hosfl_dist.models import sources

    for name in ("blobs", "soft_blobs", "pair_blobs", "broken_blobs", "late_blobs", "lost_blobs"):
        tasks._TASKS.pop(name, None)  # the registries list the package's own to the other tests
    for name in ("mlp", "wide_mlp", "misfit_mlp"):
        models._MODELS.pop(name, None)
    algorithms._REGISTRY.pop("my_method", None)
    sources._SOURCES.pop("toy", None)
    sources._SOURCES.pop("badtoy", None)
    for name in (PARTS_MOD, METHOD_MOD, SOURCE_MOD, TASK_MOD, BAD_MOD):
        sys.modules.pop(name, None)


def run_command(*args: str, module: str = "hosfl_dist.run", timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_a_task_and_a_model_outside_the_package_train_by_plugin(tmp_path, user_modules):
    res = run_command("--plugin", PARTS_MOD, *PLUGGED, f"job.out_dir={tmp_path / 'cli'}")
    assert res.returncode == 0, res.stderr[-2000:]
    rows, summary = read_run(tmp_path / "cli")
    assert summary["status"] == "completed" and [r["round"] for r in rows] == [0, 5, 10]
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"]  # it learns the blobs
    assert rows[0]["eval_accuracy"] * 200 == round(rows[0]["eval_accuracy"] * 200)  # scored over the 200 held out
    assert set(summary["code"]["plugins"]) == {PARTS_MOD}

    api = hosfl_dist.train(None, [*PLUGGED, f"job.out_dir={tmp_path / 'api'}"], plugins=[PARTS_MOD])
    assert rows_of(api.out_dir) == rows  # job.plugins in this process: the same run


def test_help_config_lists_the_plugins_task_and_model(user_modules):
    res = run_command("--plugin", PARTS_MOD, "--help-config")  # every section
    assert res.returncode == 0, res.stderr
    listed = res.stdout.split(f"From the plug-ins ({PARTS_MOD}): ")[1:]  # algorithm/model.name, zo.estimator, data.name
    assert [line.splitlines()[0] for line in listed] == ["none", "mlp", "none", "blobs"]


def test_unknown_or_mismatched_names_are_one_line_exit_2(tmp_path, user_modules):
    out = f"job.out_dir={tmp_path / 'x'}"
    res = run_command("--plugin", PARTS_MOD, *PLUGGED, out, "data.name=blob", "--check")
    said = "error: invalid value for data.name: 'blob' (choose one of ["
    assert res.returncode == 2 and res.stderr.startswith(said) and len(res.stderr.splitlines()) == 1, res.stderr
    assert "'blobs'" in res.stderr and "'synthetic'" in res.stderr  # the plug-in's names beside the package's
    res = run_command(*PLUGGED, out, "--check")  # without the plug-in, its names are unknown
    said = "error: invalid value for model.name: 'mlp' (choose one of ['conv_mlp', 'hf', 'resnet18', 'small_cnn'])"
    assert res.returncode == 2 and res.stderr.strip() == said, res.stderr
    plugged = [*PLUGGED, f"job.plugins=[{PARTS_MOD}]"]
    for args, said in (
        (["model.name=mpl"], "invalid value for model.name: 'mpl' (choose one of ['conv_mlp', 'hf', 'mlp', 'resnet18'"),
        (["split.cut=3"], "invalid value for split.cut: 3 (mlp keeps 1..2 blocks on the client"),
        (["data.name=sst2"], "invalid value for model.name: 'mlp' (data.name=sst2 needs model.name=hf)"),
        (["model.name=hf", "model.source=tiny:llama"],
         "blobs needs model.name=conv_mlp or mlp or resnet18 or small_cnn"),
    ):
        with pytest.raises(ConfigError) as exc:
            load_run_config(None, [*plugged, *args])
        assert said in str(exc.value) and "\n" not in str(exc.value)


def test_a_name_is_registered_once_and_a_spec_says_how_it_loads(user_modules):
    myparts = importlib.import_module(PARTS_MOD)

    with pytest.raises(ValueError, match="'synthetic' is registered twice"):
        register_task(TaskSpec("synthetic", load=myparts.load_blobs))
    with pytest.raises(ValueError, match="'small_cnn' is registered twice"):
        register_model(ModelSpec("small_cnn", myparts.build_mlp, cuts=(1, 2)))
    with pytest.raises(ValueError, match="give load"):
        TaskSpec("both", load=myparts.load_blobs, build=lambda cfg, clients, evaluation: None)
    with pytest.raises(ValueError, match="family"):
        ModelSpec("cnn3", myparts.build_mlp, family="audio")
    cfg = load_run_config(None, [*PLUGGED, f"job.plugins=[{PARTS_MOD}]", "data.classes=[0, 2]"])
    from hosfl_dist.data import build_data, data_info
    from hosfl_dist.runtime.build import data_sections

    assert data_info(data_sections(cfg))["num_classes"] == 2 and data_info(data_sections(cfg))["input_shape"] == (16,)
    data = build_data(data_sections(cfg))
    assert set(data.train_labels.tolist()) == {0, 1} and data.num_clients == 6
    with pytest.raises(DataError, match="int64 class indices"):
        TensorData(data.train_inputs, data.train_labels.float(), data.eval_inputs, data.eval_labels)


def test_a_plugin_tasks_own_loss_and_metric_reach_the_rows_the_summary_and_a_study(tmp_path, user_modules):
    from hosfl_dist.experiments import compare
    from hosfl_dist.experiments.runs import resolve
    from hosfl_dist.runtime.inprocess import InProcessRunner

    config = tmp_path / "soft.yaml"
    config.write_text("job:\n  name: soft\n")
    sets = [x for o in [*PLUGGED, "data.name=soft_blobs"] for x in ("--set", o)]
    argv = ["--config", str(config), "--methods", "hosfl", "--plugin", TASK_MOD, "--out", str(tmp_path / "cmp"),
            "--metric", "eval_top2_accuracy", *sets]  # fmt: skip
    specs, _, _ = compare.build(compare.parse_args(argv))
    (spec,) = specs["hosfl"]
    InProcessRunner(resolve(str(config), spec)).setup().run()  # the run the study then reuses, in this process
    rows, summary = read_run(spec.out_dir)
    assert summary["status"] == "completed" and [r["round"] for r in rows] == [0, 5, 10]
    assert all(r["eval_accuracy"] <= r["eval_top2_accuracy"] <= 1.0 for r in rows)  # top-2 holds top-1
    assert summary["final"]["eval_top2_accuracy"] == rows[-1]["eval_top2_accuracy"]
    assert compare.main(argv) == 0
    table = json.loads((tmp_path / "cmp" / "table.json").read_text())
    assert table["rows"][0]["final"] == [rows[-1]["eval_top2_accuracy"]]

    # eval_loss is the task's loss: round 0's is the smoothed cross-entropy of the initial model over the held out
    mytask = importlib.import_module(TASK_MOD)

    cfg = load_run_config(None, [*PLUGGED, "data.name=soft_blobs", f"job.plugins=[{TASK_MOD}]"])
    data = build_data(data_sections(cfg))
    split = build_split_model(cfg, data.info, zeroth_order_client=True)
    with torch.no_grad():
        out = split.server(split.client(data.eval_inputs))
    assert rows[0]["eval_loss"] == pytest.approx(mytask.smoothed(out, data.eval_labels).mean().item(), rel=1e-5)
    assert rows[0]["eval_loss"] != pytest.approx(F.cross_entropy(out, data.eval_labels).item(), rel=1e-3)


def test_lambda_is_the_gradient_of_the_plugin_tasks_loss(user_modules):
    from hosfl_dist.algorithms.compute import Upload
    from hosfl_dist.runtime.server_compute import GroupCompute

    mytask = importlib.import_module(TASK_MOD)

    cfg = load_run_config(None, [*PLUGGED, "data.name=soft_blobs", f"job.plugins=[{TASK_MOD}]"])
    data = build_data(data_sections(cfg))
    split = build_split_model(cfg, data.info, zeroth_order_client=True)
    x, y = data.next_batch(0)
    z = split.client_forward(x)["z"].detach()  # (B, width)
    passes = GroupCompute(split.server, split.task, cfg.server).forward_backward({0: Upload({"z": z}, y)},
                                                                                {0: float(len(y))})  # fmt: skip

    def lam(loss):
        zz = z.clone().requires_grad_(True)
        value = loss(split.server(zz), y).mean()
        (grad,) = torch.autograd.grad(value, zz)
        return value.item(), grad

    smoothed, plain = lam(mytask.smoothed), lam(lambda out, y: F.cross_entropy(out, y, reduction="none"))
    assert passes.losses[0] == pytest.approx(smoothed[0], rel=1e-5)  # ℓ_m: the task's loss, not cross-entropy
    torch.testing.assert_close(passes.lams[0], smoothed[1])  # λ_m = ∂ℓ_m/∂z_m through it
    assert not torch.allclose(passes.lams[0], plain[1], rtol=1e-3, atol=1e-6)


def test_a_tasks_metric_is_named_eval_something_and_only_a_vision_task_takes_one(user_modules):
    myparts = importlib.import_module(PARTS_MOD)
    mytask = importlib.import_module(TASK_MOD)

    for name in ("top2", "eval_loss", "eval_accuracy"):
        with pytest.raises(ValueError, match=f"metric {name!r} must be named eval_<something>"):
            TaskSpec("t", load=myparts.load_blobs, metrics={name: mytask.top2})
    with pytest.raises(ValueError, match="loss and metrics are for the vision family"):
        TaskSpec("t", build=lambda cfg, clients, evaluation: None, family="hf", loss=mytask.smoothed)
    from hosfl_dist.cli.run import dry_run

    built = json.loads(json.dumps(dry_run(load_run_config(None, [*PLUGGED, "data.name=soft_blobs"]))))  # --dry-run's
    assert built["task_metrics"] == ["eval_top2_accuracy"] and built["data"]["num_classes"] == 3


def test_a_plugin_model_exports_whole_and_loads_back_by_its_plugin(tmp_path, user_modules):
    from safetensors.torch import load_file

    from hosfl_dist.export.cli import main as export_main

    run = hosfl_dist.train(None, [*PLUGGED, f"job.out_dir={tmp_path / 'run'}"], plugins=[PARTS_MOD])
    out = tmp_path / "export"
    assert export_main([str(run.out_dir), "--out", str(out)]) == 0
    described = json.loads((out / "vision.json").read_text())
    assert described["model"] == "mlp" and described["plugins"] == [PARTS_MOD]
    assert described["config"]["split"]["cut"] == 1 and described["config"]["model"]["width"] == 8
    weights = load_file(str(out / "model.safetensors"))
    assert {k.split(".")[0] for k in weights} == {"client", "server"}  # f_c and f_s, whole
    # a fresh interpreter rebuilds it from vision.json (importing myparts) and scores the run's held-out accuracy
    score = (
        "import json, sys, torch\n"
        "from hosfl_dist.export import load_vision\n"
        "from hosfl_dist.data import build_data\n"
        "from hosfl_dist.runtime.build import data_sections\n"
        "from hosfl_dist.runtime.checks import load_run_config\n"
        "model = load_vision(sys.argv[1])\n"
        "cfg = load_run_config(None, json.loads(sys.argv[2]))\n"
        "data = build_data(data_sections(cfg))\n"
        "with torch.no_grad():\n"
        "    hits = sum(int((model(x).argmax(-1) == y).sum()) for x, y in data.eval_batches(64))\n"
        "print(hits / len(data.eval_labels))\n"
    )
    res = subprocess.run([sys.executable, "-c", score, str(out), json.dumps([*PLUGGED, f"job.plugins=[{PARTS_MOD}]"])],
                         cwd=tmp_path, capture_output=True, text=True, timeout=240)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert float(res.stdout) == run.metrics[-1]["eval_accuracy"]


@pytest.mark.multiprocess
@pytest.mark.slow  # a run in one process and a torchrun job: 22 s on the 2-core machine
def test_a_plugin_task_and_model_under_torchrun_equal_the_one_process_run(tmp_path, user_modules):
    """mytask.py's task (its own loss and metric, over myparts.py's blobs) and myparts.py's model."""
    soft = [*PLUGGED, "data.name=soft_blobs"]
    one = hosfl_dist.train(None, [*soft, f"job.out_dir={tmp_path / 'one'}"], plugins=[TASK_MOD])
    rc, log, _ = torchrun(3, ["-m", "hosfl_dist.run", "--plugin", TASK_MOD, *soft, f"job.out_dir={tmp_path}/dist"])
    assert rc == 0, log[-3000:]
    rows, summary = read_run(tmp_path / "dist")
    assert summary["status"] == "completed" and summary["engine"] != one.summary["engine"]
    assert rows == rows_of(one.out_dir)  # every metrics row, and θc: each worker's digest the one process's
    assert all("eval_top2_accuracy" in r for r in rows)  # the server rank scores with the task's own metric
    assert set(summary["client_digests"].values()) == set(one.summary["client_digests"].values())


def test_the_memory_profiler_measures_a_plugin_method_as_the_method_it_reuses(tmp_path, user_modules):
    from hosfl_dist.measure.memory import _child_command, _parse_args, profile
    from hosfl_dist.measure.modes import ProfileSpec, check_modes

    with pytest.raises(ConfigError, match="unknown mode 'my_method'; choose from inference, hosfl, sfl"):
        check_modes(["my_method"])  # not imported yet
    assert _parse_args(["--plugin", METHOD_MOD, "--modes", "my_method"]).plugin == [METHOD_MOD]
    spec = ProfileSpec(model="small_cnn", cut=1, batch=4, plugins=(METHOD_MOD,))
    modes = profile(spec, ["hosfl", "my_method"], isolate=False)["modes"]
    assert modes["my_method"]["peak_bytes"] == modes["hosfl"]["peak_bytes"] > 0  # HO-SFL's worker, its own name
    command = _child_command(spec, "my_method", 1, tmp_path / "mode.json")  # a mode's own process imports it too
    assert command[command.index("--plugin") + 1] == METHOD_MOD


def test_a_model_source_outside_the_package_trains_an_lm_by_plugin(tmp_path, user_modules):
    files = write_text_files(tmp_path)
    toy = [*lm_overrides(tmp_path / "toy", files), "model.source=toy:3", f"job.plugins=[{SOURCE_MOD}]"]
    run = hosfl_dist.train(None, toy)
    assert run.summary["status"] == "completed" and len(run.metrics) == 3
    assert set(run.summary["code"]["plugins"]) == {SOURCE_MOD}
    from hosfl_dist.models.sources import model_config, resolve

    assert model_config(resolve("toy:3")).num_hidden_layers == 3
    for source, said in (
        ("toy:9", "model.source 'toy:9': unknown toy name '9'; known: 2, 3, 4"),
        ("tiny:nope", "model.source 'tiny:nope': unknown tiny name 'nope'; known: opt, gemma3"),  # the same registry
    ):
        with pytest.raises(ConfigError, match=said):
            resolve(source)
    res = run_command(*lm_overrides(tmp_path / "cli", files), "model.source=toy:9", "--plugin", SOURCE_MOD, "--check")
    assert res.returncode == 2 and len(res.stderr.splitlines()) == 1, res.stderr
    assert "unknown toy name '9'" in res.stderr


# -- a plug-in's code, checked where a run is built ----------------------------------------------------------------
CHECKED = [
    (["model.name=wide_mlp"], f"error: plug-in {BAD_MOD}: model wide_mlp: f_s gives class scores of shape (1, 5) for "
                              "one sample; the task has 3 classes (data info num_classes): its head must give (1, 3)"),
    (["model.name=misfit_mlp"], f"error: plug-in {BAD_MOD}: model misfit_mlp: f_s on f_c's output of shape (1, 8) "
                                "raised RuntimeError: mat1 and mat2 shapes cannot be multiplied"),  # torch's words
    (["data.name=pair_blobs"], f"error: plug-in {BAD_MOD}: task pair_blobs: metric eval_pair(outputs, labels) gave "
                               "(2, 2) for outputs (2, 3) and labels (2,): it must give one value per sample, a tensor "
                               "of shape (2,)"),
    (["data.name=broken_blobs"], f"error: plug-in {BAD_MOD}: task broken_blobs: metric eval_broken(outputs, labels) "
                                 "raised ZeroDivisionError: no score today"),
    (["data.name=lost_blobs"], f"error: plug-in {BAD_MOD}: task lost_blobs: load(data section, job.seed) raised "
                               "OSError: the blobs are gone"),
]


@pytest.mark.parametrize(("args", "said"), CHECKED, ids=["wide_head", "f_c_f_s_misfit", "metric_shape",
                                                          "metric_raises", "load_raises"])  # fmt: skip
def test_a_plugins_shapes_and_errors_are_one_line_where_a_run_is_built(tmp_path, user_modules, args, said):
    """The same line from the build of a run, ``--dry-run`` and (in a subprocess, slow tier) ``--check``."""
    from hosfl_dist.cli.precheck import check_build
    from hosfl_dist.cli.run import dry_run
    from hosfl_dist.errors import PluginError
    from hosfl_dist.runtime.inprocess import InProcessRunner

    cfg = load_run_config(None, [*PLUGGED, f"job.plugins=[{BAD_MOD}]", f"job.out_dir={tmp_path / 'x'}", *args])
    for build in (lambda: InProcessRunner(cfg).setup(), lambda: dry_run(cfg), lambda: check_build(cfg, 1)):
        with pytest.raises(PluginError) as exc:
            build()
        assert f"error: {exc.value}".startswith(said) and "\n" not in str(exc.value) and exc.value.exit_code == 2
    assert not (tmp_path / "x").exists()  # refused before the run's folder was made


@pytest.mark.slow  # seven commands: 60 s on the 2-core machine
def test_check_and_dry_run_say_a_plugins_fault_in_one_line_exit_2(tmp_path, user_modules):
    for i, (args, said) in enumerate(CHECKED):
        for mode in ("--check", "--dry-run")[: 2 if i < 2 else 1]:  # the models' faults passed both before
            res = run_command("--plugin", BAD_MOD, *PLUGGED, *args, f"job.out_dir={tmp_path / 'x'}", mode)
            told = res.stderr.strip()
            assert res.returncode == 2 and told.startswith(said) and "\n" not in told, (mode, res.stderr[-2000:])


def test_a_plugin_metric_that_fails_mid_run_is_one_line_and_the_run_is_recorded_failed(tmp_path, user_modules):
    from hosfl_dist.errors import PluginError

    out = tmp_path / "late"
    with pytest.raises(PluginError) as exc:
        hosfl_dist.train(None, [*PLUGGED, "data.name=late_blobs", f"job.out_dir={out}"], plugins=[BAD_MOD])
    said = (f"plug-in {BAD_MOD}: task late_blobs: metric eval_late(outputs, labels) raised ValueError: more than two "
            "samples")
    assert str(exc.value) == said
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == f"PluginError: {said}"


def test_a_model_sources_names_that_raise_are_one_line(tmp_path, user_modules):
    from hosfl_dist.errors import PluginError
    from hosfl_dist.models.sources import resolve

    importlib.import_module(BAD_MOD)  # registers badtoy

    said = rf"^plug-in {BAD_MOD}: model source badtoy: names\(\) raised RuntimeError: the list of names is unreachable$"
    with pytest.raises(PluginError, match=said):
        resolve("badtoy:3")
