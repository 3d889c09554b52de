"""Command line of the App. C.1 latency model: the YAML setup, flags over it, the Monte Carlo, a printed table,
latency.json and latency.png.

The model and the Monte Carlo are in :mod:`hosfl_dist.measure.latency.model`; this module only reads settings
(defaults < ``--config`` YAML < flags), runs them and writes what they give. A bad setting is one line
``error: …`` on stderr and exit code 2, before anything is written.

    python -m hosfl_dist.measure.latency --out /tmp/latency_out
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hosfl_dist.config import LinkConfig, build_section
from hosfl_dist.errors import ConfigError, HosflError
from hosfl_dist.measure.latency.model import (
    Band,
    DecoderShape,
    Hardware,
    LatencyModel,
    LayerResult,
    Workload,
    simulate,
    simulate_round_time,
)
from hosfl_dist.safe_yaml import load_file

_SECTIONS: dict[str, type] = {"link": LinkConfig, "hardware": Hardware, "model": DecoderShape, "workload": Workload}
_SIM_DEFAULTS: dict[str, Any] = {"noise": 0.10, "trials": 1000, "seed": 0, "max_client_layers": 8, "round_layers": 4}
_SIM_RANGES: dict[str, tuple[float, float]] = {
    "noise": (0.0, 0.99), "trials": (1, 1_000_000), "seed": (0, 2**63 - 1), "max_client_layers": (1, 10_000),
    "round_layers": (1, 10_000),
}  # fmt: skip


def load_latency_setup(path: str | Path) -> tuple[LatencyModel, dict[str, Any]]:
    """Build a LatencyModel and the simulation settings from a YAML with sections link/hardware/model/workload/sim.

    A missing section keeps its defaults (``model`` defaults to Llama-3.2-1B); an unknown section or key is an
    error that names it, and so are a missing file and text that is not YAML.
    """
    path = Path(path)
    raw = load_file(path, "latency config") or {}  # bounded: size, aliases, nesting; unique keys
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    unknown = set(raw) - set(_SECTIONS) - {"sim"}
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {sorted(unknown)}; known: {sorted(_SECTIONS) + ['sim']}")
    parts: dict[str, Any] = {}
    for section, cls in _SECTIONS.items():
        values = raw.get(section) or {}
        if cls is DecoderShape and isinstance(values, dict):
            values = {**dataclasses.asdict(DecoderShape.llama32_1b()), **values}
        try:
            parts[section] = build_section(cls, values, section)  # the config tree's strict loader
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    sim = raw.get("sim") or {}
    if not isinstance(sim, dict):
        raise ConfigError(f"{path}: section 'sim' must be a mapping, got {type(sim).__name__}")
    bad = set(sim) - set(_SIM_DEFAULTS)
    if bad:
        raise ConfigError(f"{path}: unknown key(s) {sorted(bad)} in section 'sim'; known: {sorted(_SIM_DEFAULTS)}")
    for key, value in sim.items():
        lo, hi = _SIM_RANGES[key]
        kind = float if isinstance(_SIM_DEFAULTS[key], float) else int
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not lo <= value <= hi or (kind is int and value != int(value)):
            raise ConfigError(f"{path}: invalid value for sim.{key}: {str(value)[:80]!r} (expected "
                              f"{'a number' if kind is float else 'an integer'} in {lo:g}..{hi:g})")  # fmt: skip
        sim[key] = kind(value)
    model = LatencyModel(
        link=parts["link"], hardware=parts["hardware"], shape=parts["model"], workload=parts["workload"]
    )
    return model, {**_SIM_DEFAULTS, **sim}


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse the CLI; flags default to None so that only those given override the YAML/default values (the help
    shows the built-in defaults, which a --config YAML replaces)."""
    link, hw, wl, sim = LinkConfig(), Hardware(), Workload(), _SIM_DEFAULTS
    p = argparse.ArgumentParser(
        prog="python -m hosfl_dist.measure.latency",
        description="HO-SFL latency-hiding simulator (paper App. C.1). Defaults: the paper's 5G link, a "
        "Jetson-class client and an A100 server, Llama-3.2-1B; a --config YAML replaces them, flags override both.",
    )
    p.add_argument(
        "--out", default="out/latency", help="directory for latency.json and latency.png (default %(default)s)"
    )
    p.add_argument("--config", help="YAML with link/hardware/model/workload/sim sections (default: none)")
    p.add_argument("--uplink-mbps", type=float, help=f"client->server bandwidth, Mbit/s (default {link.uplink_mbps:g})")
    p.add_argument(
        "--downlink-mbps", type=float, help=f"server->client bandwidth, Mbit/s (default {link.downlink_mbps:g})"
    )
    p.add_argument("--rtt-ms", type=float, help=f"round-trip time, ms; a message pays half (default {link.rtt_ms:g})")
    p.add_argument(
        "--client-tflops", type=float, help=f"client peak throughput, TFLOP/s (default {hw.client_tflops:g})"
    )
    p.add_argument(
        "--server-tflops", type=float, help=f"server peak throughput, TFLOP/s (default {hw.server_tflops:g})"
    )
    p.add_argument(
        "--client-efficiency", type=float, help=f"achieved / peak on the client (default {hw.client_efficiency:g})"
    )
    p.add_argument(
        "--server-efficiency", type=float, help=f"achieved / peak on the server (default {hw.server_efficiency:g})"
    )
    p.add_argument("--batch", type=int, help=f"sequences per client step B (default {wl.batch})")
    p.add_argument("--seq", type=int, dest="seq_len", help=f"tokens per sequence T (default {wl.seq_len})")
    p.add_argument(
        "--max-client-layers",
        type=int,
        help=f"client depths c = 1..this are tabulated (default {sim['max_client_layers']}, at most L-1)",
    )
    p.add_argument(
        "--round-layers", type=int, help=f"client layers c of the round-time panel (default {sim['round_layers']})"
    )
    p.add_argument(
        "--noise", type=float, help=f"half-width of the uniform speed multipliers (default {sim['noise']:.2f})"
    )
    p.add_argument("--trials", type=int, help=f"noise draws (default {sim['trials']})")
    p.add_argument("--seed", type=int, help=f"seed of the noise draws (default {sim['seed']})")
    return p.parse_args(argv)


def _build(args: argparse.Namespace) -> tuple[LatencyModel, dict[str, Any]]:
    """Defaults < YAML < flags."""
    model, sim = load_latency_setup(args.config) if args.config else (LatencyModel(), dict(_SIM_DEFAULTS))

    def override(obj: Any, names: Sequence[str]) -> Any:
        given = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
        return dataclasses.replace(obj, **given) if given else obj

    model = dataclasses.replace(
        model,
        link=override(model.link, ["uplink_mbps", "downlink_mbps", "rtt_ms"]),
        hardware=override(model.hardware, ["client_tflops", "server_tflops", "client_efficiency", "server_efficiency"]),
        workload=override(model.workload, ["batch", "seq_len"]),
    )
    for key in _SIM_DEFAULTS:
        if getattr(args, key) is not None:
            sim[key] = getattr(args, key)
    # Cap the depth below L: c = L would leave the server nothing but the head.
    sim["max_client_layers"] = min(sim["max_client_layers"], model.shape.num_layers - 1)
    return model, sim


def _plot(
    path: Path,
    layers: list[LayerResult],
    c_round: int,
    ps: list[int],
    on: list[Band],
    off: list[Band],
    noise: float,
    nominal_p: int,
) -> None:
    """Two panels: max P vs client depth (mean with percentile band), and round time vs P at c_round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    cs = [r.client_layers for r in layers]
    ax1.fill_between(
        cs,
        [r.max_p.low for r in layers],
        [r.max_p.high for r in layers],
        alpha=0.25,
        label=f"5–95 % over ±{noise:.0%} noise",
    )
    ax1.plot(cs, [r.max_p.mean for r in layers], "o-", label="mean")
    ax1.set(xlabel="client layers c", ylabel="max perturbations P hidden", title="Latency-hiding budget")
    ax1.set_xticks(cs)
    ax1.set_ylim(bottom=0)
    ax1.grid(alpha=0.3)
    ax1.legend()

    for bands, label, style in ((off, "no overlap", "s-"), (on, "overlap (HO-SFL)", "o-")):
        (line,) = ax2.plot(ps, [b.mean for b in bands], style, label=label, markersize=4)
        ax2.fill_between(ps, [b.low for b in bands], [b.high for b in bands], alpha=0.2, color=line.get_color())
    ax2.axvline(nominal_p, color="grey", ls=":", label=f"max P (no noise) = {nominal_p}")
    ax2.set(xlabel="perturbations P", ylabel="round time (s)", title=f"Round time, c = {c_round}")
    ax2.set_ylim(bottom=0)
    ax2.grid(alpha=0.3)
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


TABLE_COLUMNS: tuple[tuple[str, int, str], ...] = (
    ("c", 2, "client layers: decoder blocks the client runs"),
    ("t_fwd [s]", 9, "one client forward of its c blocks (a perturbed pass costs the same), seconds"),
    ("server [s]", 10, "server forward + backward of the other blocks and the LM head, seconds"),
    ("window W [s]", 12, "idle window W(c): uplink of z + server + downlink of λ, RTT included, seconds"),
    ("max P", 5, "perturbed forwards that fit in W without noise: floor(W / t_fwd)"),
    ("P mean", 6, "max P over the noise trials: mean"),
    ("P 5-95%", 7, "max P over the noise trials: 5th-95th percentile"),
    ("P min-max", 9, "max P over the noise trials: smallest-largest"),
)
"""The printed table's columns: header, width, and what the legend under the table says of it."""


def table_legend(noise: float, trials: int) -> list[str]:
    """One line per column of the printed table (times are without noise; P columns say where noise enters)."""
    lines = [f"columns (noise: speeds × U[1-{noise:.2f}, 1+{noise:.2f}], {trials} trials):"]
    pad = max(len(name) for name, _, _ in TABLE_COLUMNS) + 2
    return lines + [f"  {name:<{pad}}{meaning}" for name, _, meaning in TABLE_COLUMNS]


def main(argv: Sequence[str] | None = None) -> int:
    """Simulate at the given settings, write latency.json and latency.png under --out, print a table."""
    try:
        args = _parse_args(argv)
        from hosfl_dist.cli.guard import check_destination

        check_destination(Path(args.out), below=False)  # latency.json and latency.png never go into a run's folder
        model, sim = _build(args)
        noise, trials, seed = float(sim["noise"]), int(sim["trials"]), int(sim["seed"])
        layers = simulate(model, range(1, sim["max_client_layers"] + 1), noise, trials, seed)
        c_round = min(int(sim["round_layers"]), model.shape.num_layers - 1)
        nominal_p = model.max_perturbations(c_round)
        ps = list(range(2 * max(nominal_p, 2) + 1))
        on = simulate_round_time(model, c_round, ps, True, noise, trials, seed)
        off = simulate_round_time(model, c_round, ps, False, noise, trials, seed)
    except HosflError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "settings": {
            "link": dataclasses.asdict(model.link),
            "hardware": dataclasses.asdict(model.hardware),
            "model": dataclasses.asdict(model.shape),
            "workload": dataclasses.asdict(model.workload),
            "noise": noise,
            "noise_distribution": "uniform multipliers in [1-noise, 1+noise] on uplink, downlink, client, server",
            "trials": trials,
            "seed": seed,
            "band_percentiles": [5.0, 95.0],
            "uplink_bytes": model.uplink_bytes(),
            "downlink_bytes": model.activation_bytes(),
        },
        "per_client_layers": [
            {
                **dataclasses.asdict(r),
                "server_compute_s": model.server_compute_time(r.client_layers),
                "uplink_s": model.uplink_time(),
                "downlink_s": model.downlink_time(),
            }
            for r in layers
        ],
        "round_time": {
            "client_layers": c_round,
            "P": ps,
            "overlap": [dataclasses.asdict(b) for b in on],
            "no_overlap": [dataclasses.asdict(b) for b in off],
        },
    }
    (out / "latency.json").write_text(json.dumps(report, indent=2))
    _plot(out / "latency.png", layers, c_round, ps, on, off, noise, nominal_p)

    up, down = model.uplink_time(), model.downlink_time()
    print(f"uplink {up:.3f} s, downlink {down:.3f} s (incl. RTT/2 each), ±{noise:.0%} speed noise, {trials} trials")
    print(" ".join(f"{name:>{width}}" for name, width, _ in TABLE_COLUMNS))
    for r in layers:
        server = model.server_compute_time(r.client_layers)
        cells = [
            f"{r.client_layers}",
            f"{r.client_forward_s.nominal:.3f}",
            f"{server:.3f}",
            f"{r.window_s.nominal:.3f}",
            f"{r.max_p.nominal:.0f}",
            f"{r.max_p.mean:.2f}",
            f"{r.max_p.low:.0f}-{r.max_p.high:.0f}",
            f"{r.max_p.min:.0f}-{r.max_p.max:.0f}",
        ]
        print(" ".join(f"{cell:>{width}}" for cell, (_, width, _) in zip(cells, TABLE_COLUMNS)))
    print("\n".join(table_legend(noise, trials)))
    print(f"wrote {out / 'latency.json'} and {out / 'latency.png'}")
    return 0
