"""Known-answer tests of the App. C.1 latency model (hosfl_dist.measure.latency), all worked out by hand, and of its
command line."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from hosfl_dist.config import LinkConfig, link_delay_s
from hosfl_dist.errors import ConfigError
from hosfl_dist.measure.latency.cli import TABLE_COLUMNS, load_latency_setup, main
from hosfl_dist.measure.latency.model import (
    DecoderShape,
    Hardware,
    LatencyModel,
    Workload,
    simulate,
    simulate_round_time,
)

REPO = Path(__file__).resolve().parents[1]

# Toy decoder, by hand:
#   matmul params per block: W_q 64·64 + W_k 64·32 + W_v 64·32 + W_o 64·64 + MLP 3·64·128 = 36_864
#   tokens B·T = 2·8 = 16
#   block forward = 2·36_864·16 + 4·B·T²·(heads·d_h) = 1_179_648 + 4·2·64·64 = 1_212_416 FLOP
#   LM head forward = 2·16·64·100 = 204_800 FLOP
#   server at c=1 = 3·(1_212_416 + 204_800) = 4_251_648 FLOP
#   z = λ = 16·64·2 = 2048 bytes = 16_384 bits
TOY_SHAPE = DecoderShape(hidden=64, intermediate=128, num_layers=2, num_heads=4, num_kv_heads=2, vocab=100)
TOY_WORKLOAD = Workload(batch=2, seq_len=8, bytes_per_activation=2, label_bytes=0, mask_bytes=0)
BLOCK_FLOPS = 1_212_416
SERVER_FLOPS = 4_251_648
Z_BITS = 16_384


def toy_model(rtt_ms: float = 500.0) -> LatencyModel:
    """Rates chosen so that t_fwd = 1 s, server = 1 s, uplink = 1 s, downlink = 2 s (+ RTT/2 each way)."""
    return LatencyModel(
        link=LinkConfig(uplink_mbps=Z_BITS / 1e6, downlink_mbps=Z_BITS / 2e6, rtt_ms=rtt_ms),
        hardware=Hardware(client_tflops=BLOCK_FLOPS / 1e12, server_tflops=SERVER_FLOPS / 1e12),
        shape=TOY_SHAPE,
        workload=TOY_WORKLOAD,
    )


def test_link_delay_is_serialisation_plus_half_rtt() -> None:
    assert link_delay_s(1_000_000, 8.0, 0.0) == pytest.approx(1.0)  # 8 Mbit over 8 Mbit/s
    assert link_delay_s(1_000_000, 8.0, 30.0) == pytest.approx(1.015)
    assert link_delay_s(0, 30.0, 30.0) == pytest.approx(0.015)
    with pytest.raises(ConfigError, match="bandwidth"):
        link_delay_s(1, 0.0, 0.0)


def test_toy_flops_and_parameters() -> None:
    assert TOY_SHAPE.layer_matmul_params() == 36_864
    assert TOY_SHAPE.layer_forward_flops(2, 8) == BLOCK_FLOPS
    assert TOY_SHAPE.head_forward_flops(2, 8) == 204_800
    # embeddings 6400 + 2 blocks·(36_864 + two norms 128) + final norm 64 + untied head 6400
    assert TOY_SHAPE.num_parameters() == 86_848
    assert dataclasses.replace(TOY_SHAPE, tied_embeddings=True).num_parameters() == 86_848 - 6400


def test_llama32_1b_matches_published_parameter_count() -> None:
    shape = DecoderShape.llama32_1b()
    assert shape.layer_matmul_params() == 60_817_408
    assert shape.num_parameters() == 1_235_814_400  # the released checkpoint's count
    model = LatencyModel()
    assert model.activation_bytes() == 32 * 256 * 2048 * 2
    assert model.uplink_bytes() == 32 * 256 * 2048 * 2 + 32 * 256 * 8  # + int64 labels


def test_toy_window_and_max_perturbations() -> None:
    m = toy_model()
    assert m.client_forward_time(1) == pytest.approx(1.0)
    assert m.server_compute_time(1) == pytest.approx(1.0)
    assert m.uplink_time() == pytest.approx(1.25)
    assert m.downlink_time() == pytest.approx(2.25)
    assert m.idle_window(1) == pytest.approx(4.5)
    assert m.max_perturbations(1) == 4  # floor(4.5 / 1)


def test_max_perturbations_exact_ratio_is_not_lost_to_rounding() -> None:
    assert toy_model(rtt_ms=0.0).idle_window(1) == pytest.approx(4.0)
    assert toy_model(rtt_ms=0.0).max_perturbations(1) == 4


def test_round_time_with_and_without_overlap() -> None:
    m = toy_model()  # t_fwd = 1, W = 4.5, max P = 4
    for p in range(9):
        assert m.round_time(p, 1, overlap=False, include_finish=False) == pytest.approx(1.0 + 4.5 + p)
        assert m.round_time(p, 1, overlap=True, include_finish=False) == pytest.approx(1.0 + max(4.5, p))
    assert m.round_time(0, 1, overlap=True) == m.round_time(0, 1, overlap=False)
    flat = m.round_time(0, 1, overlap=True, include_finish=False)
    for p in range(m.max_perturbations(1) + 1):
        assert m.round_time(p, 1, overlap=True, include_finish=False) == pytest.approx(flat)
    # Past max P only the unhidden part shows: 0.5 s at P = 5, then t_fwd per extra pass.
    assert m.round_time(5, 1, overlap=True, include_finish=False) == pytest.approx(flat + 0.5)
    assert m.round_time(6, 1, overlap=True, include_finish=False) == pytest.approx(flat + 1.5)


def test_finish_time_by_hand() -> None:
    m = toy_model()
    assert m.finish_time(0) == 0.0
    # 3 FLOP per element of z (16·64) per projection; 3 fp32 scalars up (1 s per 16_384 bits) and down (2 s per).
    projections = 3 * 3 * 16 * 64 / BLOCK_FLOPS
    exchange = 3 * 32 / Z_BITS + 0.25 + 3 * 32 * 2 / Z_BITS + 0.25
    assert m.finish_time(3) == pytest.approx(projections + exchange)
    assert m.round_time(3, 1, overlap=True) == pytest.approx(5.5 + projections + exchange)


def test_noise_free_simulation_has_zero_width_bands() -> None:
    m = toy_model()
    (r,) = simulate(m, [1], noise=0.0, trials=5)
    for b in (r.max_p, r.window_s, r.client_forward_s):
        assert b.low == b.high == b.min == b.max == pytest.approx(b.mean)
        assert b.mean == pytest.approx(b.nominal)
    assert r.max_p.mean == 4
    (rt,) = simulate_round_time(m, 1, [6], overlap=True, noise=0.0, trials=3)
    assert rt.low == rt.high == pytest.approx(m.round_time(6, 1, overlap=True))


def test_noisy_bands_are_ordered_bounded_and_reproducible() -> None:
    m = LatencyModel()
    results = simulate(m, [1, 4], noise=0.1, trials=200, seed=3)
    assert results == simulate(m, [1, 4], noise=0.1, trials=200, seed=3)
    for r in results:
        for b in (r.max_p, r.window_s, r.client_forward_s):
            assert b.min <= b.low <= b.mean <= b.high <= b.max
            assert b.min <= b.nominal <= b.max
        # Every speed within ±10 %: the window lies between the all-fast and all-slow cases.
        fastest, slowest = m.scaled(1.1, 1.1, 1.1, 1.1), m.scaled(0.9, 0.9, 0.9, 0.9)
        c = r.client_layers
        assert fastest.idle_window(c) <= r.window_s.min <= r.window_s.max <= slowest.idle_window(c)
    assert results[0].max_p.mean > results[1].max_p.mean  # a deeper client hides fewer passes


def test_invalid_settings_are_rejected() -> None:
    m = toy_model()
    for c in (0, 2):  # need 1 <= c < num_layers = 2
        with pytest.raises(ConfigError, match="client layers"):
            m.idle_window(c)
    with pytest.raises(ConfigError, match="noise"):
        simulate(m, [1], noise=1.0)
    with pytest.raises(ConfigError, match="num_kv_heads"):
        dataclasses.replace(TOY_SHAPE, num_kv_heads=3)
    with pytest.raises(ConfigError, match="uplink_mbps: 0.0"):
        LinkConfig(uplink_mbps=0.0)


def test_shipped_yaml_is_the_paper_default() -> None:
    model, sim = load_latency_setup(REPO / "configs" / "latency" / "llama32_1b_5g.yaml")
    assert model == LatencyModel()
    assert sim == {"noise": 0.1, "trials": 1000, "seed": 0, "max_client_layers": 8, "round_layers": 4}


def test_yaml_unknown_key_names_key_and_section(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("link:\n  uplink_mbs: 30\n")
    with pytest.raises(ConfigError, match=r"unknown key link.uplink_mbs in section link"):
        load_latency_setup(path)
    path.write_text("link:\n  rtt_ms: -1\n")
    with pytest.raises(ConfigError, match=r"invalid value for link.rtt_ms: -1.0 \(must be >= 0\)"):
        load_latency_setup(path)


def test_cli_writes_json_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--out", str(tmp_path), "--trials", "20", "--max-client-layers", "3", "--uplink-mbps", "60"])
    assert rc == 0
    report = json.loads((tmp_path / "latency.json").read_text())
    assert report["settings"]["link"]["uplink_mbps"] == 60.0
    assert [row["client_layers"] for row in report["per_client_layers"]] == [1, 2, 3]
    row = report["per_client_layers"][0]
    assert set(row["max_p"]) == {"nominal", "mean", "low", "high", "min", "max"}
    assert row["window_s"]["nominal"] > 0 and row["client_forward_s"]["nominal"] > 0
    assert report["round_time"]["P"][0] == 0
    assert (tmp_path / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "P mean" in capsys.readouterr().out


def test_cli_reports_bad_values_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", str(tmp_path), "--noise", "1.5"]) == 2
    assert capsys.readouterr().err.startswith("error: noise must be in [0, 1)")
    assert not (tmp_path / "latency.json").exists()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "latency config not found: "),
        ("link: [\n", "is not valid YAML at line 2, column 1"),
        ("link:\n  uplink_mbs: 30\n", "unknown key link.uplink_mbs in section link"),
        ("link:\n  uplink_mbps: -5\n", "invalid value for link.uplink_mbps: -5.0 (must be > 0)"),
        ("sim: 3\n", "section 'sim' must be a mapping, got int"),
    ],
)
def test_cli_reports_bad_setup_files_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str | None, message: str
) -> None:
    path = tmp_path / "setup.yaml"
    if text is not None:
        path.write_text(text)
    assert main(["--out", str(tmp_path / "out"), "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_help_shows_the_default_of_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    options = re.split(r"\n  (?=--)", text.split("options:", 1)[1])[1:]  # one block per option, after -h
    assert len(options) == 16
    for block in options:
        assert "(default" in " ".join(block.split()), block
    flat = " ".join(text.split())
    assert "bandwidth, Mbit/s (default 30)" in flat and "TFLOP/s (default 312)" in flat and "(default 1000)" in flat


def test_printed_table_explains_every_column(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", str(tmp_path), "--trials", "5", "--max-client-layers", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines[1]
    start = next(i for i, line in enumerate(lines) if line.startswith("columns ("))
    legend = lines[start + 1 : start + 1 + len(TABLE_COLUMNS)]
    for (name, _, meaning), line in zip(TABLE_COLUMNS, legend, strict=True):  # every column, in the table's order
        assert name in header and line.startswith(f"  {name} ") and line.endswith(meaning)
    for name, _, meaning in TABLE_COLUMNS[1:4]:  # the times: unit in the header and in the legend
        assert name.endswith("[s]") and meaning.endswith("seconds")
    assert len(lines[2].split()) == len(TABLE_COLUMNS)  # a row has one cell per column
