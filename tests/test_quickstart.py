"""The quickstart shows the point: a client part big enough that aggregating P scalars instead of θc and a client that
never back-propagates matter, the three lines every run ends with (accuracy, client memory against inference,
uplink against SFL's), and the script that puts HO-SFL, SFL and frozen_client side by side."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from hosfl_dist.algorithms import algorithm_names, get_algorithm
from hosfl_dist.cli.run import main
from hosfl_dist.data import data_info
from hosfl_dist.measure.outcome import UPLINK, client_sizes, sfl_uplink, table
from hosfl_dist.models import build_split_model
from hosfl_dist.runtime.build import data_sections
from hosfl_dist.runtime.checks import load_run_config
from tiny import TINY_OVERRIDES, run_in_process

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "launch" / "compare_quick.sh"


def test_the_quickstarts_client_part_has_between_1e5_and_1e6_parameters():
    cfg = load_run_config(str(ROOT / "configs" / "quickstart.yaml"), [])
    zo = get_algorithm(cfg.algorithm.name).zeroth_order_client
    info = data_info(data_sections(cfg))
    split = build_split_model(cfg, info, zo, parts=())  # on the meta device: nothing trained or loaded
    d_c = sum(p.numel() for p in split.client.parameters() if p.requires_grad)
    assert 1e5 <= d_c <= 1e6, d_c


def _run_lines(capsys, tmp_path: Path, *overrides: str) -> tuple[list[str], dict]:
    out = tmp_path / "run"
    assert main([*TINY_OVERRIDES, f"job.out_dir={out}", *overrides]) == 0
    printed = capsys.readouterr().out.splitlines()
    from hosfl_dist.runfolder.folder import recorded_summary

    return printed, recorded_summary(out)


def _bytes(text: str) -> float:
    value, unit = text.replace(",", "").split()
    return float(value) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


def test_a_run_ends_with_its_accuracy_client_memory_and_uplink_against_sfl(capsys, tmp_path):
    printed, summary = _run_lines(capsys, tmp_path)
    done = [i for i, line in enumerate(printed) if line.startswith("done: ")]
    assert len(done) == 1
    accuracy, memory, uplink = printed[-3:]
    final = summary["final"]
    assert accuracy.startswith(f"accuracy: {100 * final['eval_accuracy']:.2f} % on the ")
    assert f"after {summary['processed_samples']:,} training samples" in accuracy

    m = re.match(r"client memory: ([\d.,]+ \w+) at the peak of one hosfl client step, against ([\d.,]+ \w+) for an "
                 r"inference-only forward of f_c \(([\d.]+)x; memory profiler", memory)  # fmt: skip
    assert m, memory
    peak, inference = _bytes(m[1]), _bytes(m[2])
    assert peak >= inference > 0

    sent = sum(summary["comm"]["bytes"][c] for c in UPLINK)
    m = re.match(r"uplink: ([\d.,]+ \w+) counted \(activations .*\); SFL, estimated for the same samples: "
                 r"([\d.,]+ \w+) \(.*\) = ([\d.]+)x$", uplink)  # fmt: skip
    assert m, uplink
    assert _bytes(m[1]) == pytest.approx(sent, rel=0.01)
    assert _bytes(m[2]) > sent  # SFL sends the same activations, and θc besides the scalars HO-SFL sends


def test_the_sfl_estimate_is_what_an_sfl_run_of_the_same_samples_counts(tmp_path):
    """The estimate for an HO-SFL run equals the uplink an SFL run of the same config and budget counted (IID shards
    of equal size: the estimate's mean shard is every shard)."""
    cfg, _, hosfl, _ = run_in_process([*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'h'}"])
    _, _, sfl, _ = run_in_process([*TINY_OVERRIDES, "algorithm.name=sfl", f"job.out_dir={tmp_path / 's'}"])
    assert sfl["processed_samples"] == hosfl["processed_samples"]
    estimate = sfl_uplink(hosfl, cfg, client_sizes(cfg))
    counted = {c: sfl["comm"]["bytes"][c] for c in UPLINK}
    assert estimate["model_bytes"] == counted["uplink_model"] > 0
    assert estimate["bytes"] == sum(counted.values())


def test_an_sfl_run_is_not_compared_with_itself_and_a_language_model_says_how_to_measure(capsys, tmp_path):
    printed, summary = _run_lines(capsys, tmp_path, "algorithm.name=sfl")
    memory, uplink = printed[-2:]
    assert "client step, against" in memory and "SFL, estimated" not in uplink and "θc " in uplink

    from hosfl_dist.measure.outcome import lines

    cfg = load_run_config(None, ["model.name=hf", "model.source=tiny:llama", "data.name=sst2"])
    said = lines({"algorithm": "hosfl", "final": {"eval_accuracy": 0.5}, "processed_samples": 8, "rounds": 1,
                  "uplink": dict.fromkeys(UPLINK, 0), "sizes": {"eval_size": 0, "client_params": 1}, "sfl": None,
                  "memory": {"skipped": "model.name=hf is not rebuilt at the end of a run"}}, cfg)  # fmt: skip
    assert said[1].startswith(
        "client memory: not measured (model.name=hf is not rebuilt at the end of a run): "
        "python -m hosfl_dist.measure.memory --model tiny:llama --cut 1 --modes hosfl,inference"
    )


def test_the_table_has_a_row_per_run_with_memory_uplink_and_wall_time(tmp_path):
    for method in ("hosfl", "frozen_client"):
        run_in_process([*TINY_OVERRIDES, f"algorithm.name={method}", f"job.out_dir={tmp_path / method}"])
    rows = table([tmp_path / "hosfl", tmp_path / "frozen_client"])
    assert rows[0].startswith("| method | final accuracy | client peak memory")
    assert [r.split("|")[1].strip() for r in rows[2:]] == ["hosfl", "frozen_client"]
    for row in rows[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2].endswith("×)") and "(" in cells[3] and cells[4].endswith(" s"), row
    assert "(1.00×)" in rows[3]  # frozen_client's client is an inference-only forward


def test_compare_quick_is_valid_bash_and_runs_existing_configs_and_methods():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    config = re.search(r"CONFIG=\$\{CONFIG:-([^}]+)\}", text)[1]
    assert (ROOT / config).is_file()
    load_run_config(str(ROOT / config), [])
    methods = shlex.split(re.search(r"METHODS=\(([^)]*)\)", text)[1])
    assert methods == ["hosfl", "sfl", "frozen_client"] and set(methods) <= set(algorithm_names())
    assert "python -m hosfl_dist.experiments.compare" in text.replace('"$PYTHON"', "python")
    assert "python -m hosfl_dist.measure.outcome" in text.replace('"$PYTHON"', "python")


@pytest.mark.parametrize("check", [False, True], ids=["run", "check"])
def test_fsl_sage_on_conv_mlp_is_refused_in_one_line(capsys, tmp_path, check):
    """FSL-SAGE's auxiliary model pools a convolutional activation; conv_mlp's z is a vector: refused where the
    config is checked (``--check`` too), before a run folder exists."""
    out = tmp_path / "r"
    flags = ["--check"] if check else []
    code = main([*flags, *TINY_OVERRIDES, "model.name=conv_mlp", "algorithm.name=fsl_sage", f"job.out_dir={out}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "builds its auxiliary model from a convolutional activation" in err[-1], err
    assert not out.exists()


def test_ctrl_c_while_the_lines_are_made_leaves_the_completed_run_as_it_is(monkeypatch):
    """The lines come after the record: a KeyboardInterrupt while the client's memory is measured is one line."""
    from hosfl_dist.measure import outcome

    def interrupted(summary, cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(outcome, "outcome", interrupted)
    said = outcome.run_lines({}, None)
    assert said == "(the summary lines were not made: Ctrl-C; the run is complete and recorded)"
