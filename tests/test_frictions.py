"""A newcomer's frictions (issue 24, item 4), each pinned where no other test file owns it."""

from __future__ import annotations

import io
import json
import logging

import pytest
from tiny import run_in_process


def test_transformerstransformers_bars_are_silent_unless_asked(monkeypatch):
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from hosfl_dist.models.hf_load import transformers_bars

    before = gguf_utils.tqdm
    for shown in (False, True):
        err = io.StringIO()
        with transformers_bars(shown):
            for _ in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors...", file=err):
                pass
            for _ in hf_logging.tqdm(range(3), desc="Loading weights", file=err):
                pass
        assert ("de-quantizing" in err.getvalue() and "Loading weights" in err.getvalue()) is shown
    assert gguf_utils.tqdm is before and hf_logging._tqdm_hook is None  # put back as found


@pytest.mark.parametrize(
    ("method", "said", "unsaid"),
    [
        ("sfl", "fetching the global client model θc of round 1 (no replicas to bring up to date)", "Algorithm"),
        ("hosfl", "bringing the 6 client replicas to round 2 by replaying the history (Algorithm 3)", "θc"),
    ],
)
def test_the_end_of_run_line_says_what_the_method_does(tiny_overrides, caplog, method, said, unsaid):
    """An SFL run said it brought its client replicas up to date (Algorithm 3): the catch-up replay is HO-SFL's."""
    with caplog.at_level(logging.INFO, logger="hosfl_dist"):
        run_in_process([*tiny_overrides, f"algorithm.name={method}", "train.budget_samples=48"])
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("budget reached")]
    assert said in line and unsaid not in line and "checking the client digests against the server's" in line


def scaling_record() -> dict:
    return {"launched": [{"run": "r1", "wall_time_s": 1.5}], "reused": ["r0"], "failed": [], "wall_time_s": 1.5}


def test_scaling_says_its_wall_time_once_at_the_end(tmp_path, monkeypatch, capsys):
    """'wall time of this invocation: 39.9 s' came half-way through a 78 s job (after the runs, before the profiles
    and the report)."""
    from test_scaling import point

    from hosfl_dist.experiments import runs, scaling
    from hosfl_dist.experiments.runs import RunData, RunSpec

    def run_rows(*args):
        print("the runs' report")
        return scaling_record()

    spec = RunSpec("split.cut=1", 0, ["split.cut=1"], tmp_path / "r")
    monkeypatch.setattr(scaling, "run_rows", run_rows)
    monkeypatch.setattr(scaling, "build", lambda args: ({"split.cut=1": [spec], "split.cut=2": [spec]}, "t", {}))
    monkeypatch.setattr(runs, "load", lambda s: RunData(s))
    monkeypatch.setattr(scaling, "point", lambda config, name, *rest: point(1e6, int(name[-1]), 2))
    argv = ["--config", "c.yaml", "--grid", "split.cut=1,2", "--out", str(tmp_path), "--no-client-profile"]
    assert scaling.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [i for i, line in enumerate(lines) if "of this invocation" in line] == [len(lines) - 1]
    assert lines[-1].startswith("wall time of this invocation: ")
    assert lines[-1].endswith(f"s; 1 run(s) launched (1.5 s), 1 reused -> {tmp_path}")


def test_a_client_profile_names_its_grid_point(tmp_path, monkeypatch, capsys):
    import hosfl_dist.measure.memory as memory
    from hosfl_dist.config import load_config
    from hosfl_dist.experiments.scaling import client_profile

    labels = []

    def profile(spec, modes, threads, label):
        labels.append(label)
        return {"modes": {modes[0]: {"peak_bytes": 3 * 2**20, "step_s": 0.5}}}

    monkeypatch.setattr(memory, "profile", profile)
    cfg = load_config(None, ["model.width=16", "zo.num_perturbations=3"])
    assert client_profile(cfg, tmp_path, "zo.num_perturbations=3", 1)["peak_bytes"] == 3 * 2**20
    assert client_profile(cfg, tmp_path, "zo.num_perturbations=3", 1)["step_s"] == 0.5  # the file, not a new process
    first, second = capsys.readouterr().out.splitlines()
    assert labels == ["zo.num_perturbations=3"]
    assert first.startswith("client profile of zo.num_perturbations=3: hosfl client measured in ")
    assert first.endswith(" s, peak 3.0 MiB of live tensors")
    assert second.startswith("client profile of zo.num_perturbations=3: reusing ")


def test_a_two_evaluation_curve_shows_its_two_measurements_and_the_command_says_so(tmp_path, capsys):
    """A 3072-sample SFL run evaluated at its start and end drew a straight line that read as a measured one."""
    from test_experiments import fake_run

    from hosfl_dist.experiments.report import few_evaluations, main, metric_figure

    fig = metric_figure({"sfl": [fake_run(0, [0.3, 0.6])]}, "eval_accuracy", "t")
    (line,) = fig.axes[0].lines
    assert line.get_marker() == "o" and len(line.get_xdata()) == 2
    note = few_evaluations("sfl", [[{"eval_accuracy": 0.3}, {"eval_accuracy": 0.6}]], "eval_accuracy", 3072)
    assert note == ("note: SFL: 2 evaluation(s) of eval_accuracy; its curve joins 2 measurement(s) with a straight "
                    "line: train.eval_every_samples=768 gives about five")  # fmt: skip
    assert few_evaluations("sfl", [[{"eval_accuracy": 0.3}] * 3], "eval_accuracy", 3072) is None

    rows = [{"round": r, "processed_samples": 384 * r, "eval_accuracy": 0.5, "comm": {}} for r in (0, 8)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([str(tmp_path), "--out", str(tmp_path / "c.png")]) == 0
    assert "train.eval_every_samples=768 gives about five" in capsys.readouterr().out
    # one SFL round of the whole budget: evaluations come at round ends, no interval adds a point
    rows = [{"round": r, "processed_samples": 3072 * r, "eval_accuracy": 0.5, "comm": {}} for r in (0, 1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([str(tmp_path), "--out", str(tmp_path / "c.png")]) == 0
    assert "evaluations come at the end of a round and it ran 1 round(s)" in capsys.readouterr().out
