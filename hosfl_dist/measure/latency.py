"""Analytic latency model of one HO-SFL round and the latency-hiding budget of paper App. C.1.

One round for a client (paper Sec. 3.4, Fig. "HO-SFL Timeline"):

    client forward z ─► uplink z (+labels) ─► server forward+backward ─► downlink λ ─► client projections
                      └──────────────────── idle window W(c) ──────────────────────┘

The client is idle during W(c) unless it runs its P perturbed forward passes z̃_p = f_c(x; θ_c + μu_p) there
(paper eq:perturbed_act); they need no λ, only the projections v_p = λᵀ(z̃_p − z) (eq:scalar_proj) do. The model
answers how many such passes fit in W(c) for c client layers, and what a round costs as a function of P with and
without that overlap. Equations are cited by their LaTeX labels in the paper source.

Everything is closed-form (FLOPs / throughput, bits / bandwidth + RTT/2), so the module imports only numpy and the
config tree; yaml and matplotlib are imported where the CLI needs them. The link is the config's
:class:`~hosfl_dist.config.LinkConfig` (the ``comm`` section of a run, ``link`` in this tool's YAML), the same that
the emulated link (``comm.inject_delay``) injects.

    python -m hosfl_dist.measure.latency --out /tmp/latency_out
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hosfl_dist.config import LinkConfig, build_section
from hosfl_dist.errors import ConfigError, HosflError

# Backward = 2x forward: one matmul for the input gradient, one for the weight gradient. This is the full
# fine-tuning count; with LoRA on frozen weights the server only needs input gradients (≈1x). The server term is
# ~1-2 % of the window at the paper's settings, so the conservative choice does not move the answer.
BACKWARD_FLOPS_FACTOR = 2.0
# A projection v_p = λᵀ(z̃_p − z) is one subtraction and one multiply-add per activation element.
PROJECTION_FLOPS_PER_ELEMENT = 3.0
# The P scalars v_p travel as fp32 (eq:scalar_agg upload and the aggregated v̄_p broadcast).
SCALAR_BYTES = 4
# Relative slack for floor(W / t_fwd): exact ratios such as 3.0 must not become 2 through rounding error.
_FLOOR_RTOL = 1e-9


def _require_positive(section: str, **values: float) -> None:
    """Raise a ConfigError naming the first non-positive field of ``section``."""
    for name, value in values.items():
        if not value > 0:
            raise ConfigError(f"{section}.{name} must be > 0, got {value}")


@dataclass(frozen=True)
class Hardware:
    """Peak throughputs and the fraction of peak reached (App. C.1: Jetson-class client, A100 server)."""

    client_tflops: float = 2.0
    """Client peak FP16 throughput, TFLOP/s."""
    server_tflops: float = 312.0
    """Server peak FP16 throughput, TFLOP/s (A100 dense tensor cores)."""
    client_efficiency: float = 1.0
    """Achieved / peak on the client; 1.0 is the paper's idealised setting, real kernels reach ~0.3-0.6."""
    server_efficiency: float = 1.0
    """Achieved / peak on the server."""

    def __post_init__(self) -> None:
        _require_positive(
            "hardware",
            client_tflops=self.client_tflops,
            server_tflops=self.server_tflops,
            client_efficiency=self.client_efficiency,
            server_efficiency=self.server_efficiency,
        )

    @property
    def client_flops_per_s(self) -> float:
        """Sustained client throughput in FLOP/s."""
        return self.client_tflops * 1e12 * self.client_efficiency

    @property
    def server_flops_per_s(self) -> float:
        """Sustained server throughput in FLOP/s."""
        return self.server_tflops * 1e12 * self.server_efficiency


@dataclass(frozen=True)
class DecoderShape:
    """Shape of a Llama-style decoder: GQA attention, SwiGLU MLP, RMSNorm, optional tied LM head."""

    hidden: int
    """Model width d."""
    intermediate: int
    """SwiGLU inner width."""
    num_layers: int
    """Number of transformer blocks L; "layer" in the paper means one block (App. B.2)."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA groups)."""
    vocab: int
    """Vocabulary size."""
    head_dim: int | None = None
    """Per-head width; None means hidden // num_heads."""
    tied_embeddings: bool = False
    """LM head shares the embedding matrix; changes the parameter count only, not the FLOPs."""

    def __post_init__(self) -> None:
        _require_positive(
            "model",
            hidden=self.hidden,
            intermediate=self.intermediate,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            vocab=self.vocab,
        )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_heads={self.num_heads} must be a multiple of model.num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim is None and self.hidden % self.num_heads:
            raise ConfigError(
                f"model.hidden={self.hidden} is not divisible by model.num_heads={self.num_heads}; set model.head_dim"
            )

    @classmethod
    def llama32_1b(cls) -> DecoderShape:
        """Return the published meta-llama/Llama-3.2-1B config.json shape.

        App. B.2 of the paper says 18 layers; the released config has 16 (num_hidden_layers=16), which we use.
        Only the server share of the window depends on L, and it is ~1-2 % of it, so the choice barely matters.
        """
        return cls(
            hidden=2048,
            intermediate=8192,
            num_layers=16,
            num_heads=32,
            num_kv_heads=8,
            vocab=128256,
            head_dim=64,
            tied_embeddings=True,
        )

    @property
    def resolved_head_dim(self) -> int:
        """Per-head width actually used."""
        return self.head_dim if self.head_dim is not None else self.hidden // self.num_heads

    def layer_matmul_params(self) -> int:
        """Weights of one block that enter a matmul (norm gains excluded)."""
        q_width = self.num_heads * self.resolved_head_dim
        kv_width = self.num_kv_heads * self.resolved_head_dim
        attention = self.hidden * q_width + 2 * self.hidden * kv_width + q_width * self.hidden  # W_q, W_k, W_v, W_o
        mlp = 3 * self.hidden * self.intermediate  # SwiGLU: gate, up, down
        return attention + mlp

    def num_parameters(self) -> int:
        """All parameters: embeddings, blocks (matmuls + two RMSNorm gains), final norm, LM head unless tied."""
        block = self.layer_matmul_params() + 2 * self.hidden
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return self.vocab * self.hidden + self.num_layers * block + self.hidden + head

    def layer_forward_flops(self, batch: int, seq_len: int) -> float:
        """Forward FLOPs of one block for a (batch, seq_len) input.

        Linear layers: 2 FLOPs (multiply + add) per weight per token. Attention core: for each of the num_heads
        query heads, scores QKᵀ and the weighted sum AV are each a (T × d_h)·(d_h × T)-sized product, i.e.
        2·T²·d_h FLOPs per head per sequence; GQA shares K/V between heads but does not shrink these products.
        So the core costs 2 · 2·B·T²·(num_heads·d_h). We count the full T×T square although the mask is causal:
        dense kernels compute it, and it keeps the client estimate conservative. Softmax, RoPE, norms and the
        SwiGLU elementwise product are O(B·T·d) and left out.
        """
        tokens = batch * seq_len
        linear = 2.0 * self.layer_matmul_params() * tokens
        attention_core = 2.0 * 2.0 * batch * seq_len**2 * self.num_heads * self.resolved_head_dim
        return linear + attention_core

    def head_forward_flops(self, batch: int, seq_len: int) -> float:
        """Forward FLOPs of the LM head (hidden → vocab for every token); the final norm and the loss are O(B·T·V)."""
        return 2.0 * batch * seq_len * self.hidden * self.vocab


@dataclass(frozen=True)
class Workload:
    """One client's batch and what the link carries for it."""

    batch: int = 32
    """Sequences per client step (App. B.3)."""
    seq_len: int = 256
    """Tokens per sequence (App. C.1)."""
    bytes_per_activation: int = 2
    """Element size of z and λ: fp16."""
    label_bytes: int = 8
    """Bytes per label token sent with z: int64 token ids, as PyTorch's cross-entropy takes them."""
    mask_bytes: int = 0
    """Bytes per token of an attention/padding mask sent with z; 0 for fixed-length packed sequences, where the
    causal mask is implied by the positions (set 1 for a bool padding mask)."""

    def __post_init__(self) -> None:
        _require_positive(
            "workload", batch=self.batch, seq_len=self.seq_len, bytes_per_activation=self.bytes_per_activation
        )
        if self.label_bytes < 0 or self.mask_bytes < 0:
            raise ConfigError(
                f"workload.label_bytes and workload.mask_bytes must be >= 0, got {self.label_bytes}, {self.mask_bytes}"
            )

    @property
    def tokens(self) -> int:
        """B·T."""
        return self.batch * self.seq_len


@dataclass(frozen=True)
class LatencyModel:
    """Round timing of one HO-SFL client; every time is in seconds, every ``c`` counts client blocks."""

    link: LinkConfig = field(default_factory=LinkConfig)
    hardware: Hardware = field(default_factory=Hardware)
    shape: DecoderShape = field(default_factory=DecoderShape.llama32_1b)
    workload: Workload = field(default_factory=Workload)

    def _check_layers(self, c: int) -> None:
        # c = 0 would leave the client only the embedding lookup (~0 FLOPs), i.e. an unbounded P.
        if not 1 <= c < self.shape.num_layers:
            raise ConfigError(f"client layers c={c} must satisfy 1 <= c < model.num_layers={self.shape.num_layers}")

    def activation_bytes(self) -> int:
        """Size of z_m (= size of λ_m): B·T·d elements."""
        return self.workload.tokens * self.shape.hidden * self.workload.bytes_per_activation

    def uplink_bytes(self) -> int:
        """Uplink message: z, the labels y and, if configured, the mask."""
        per_token = self.workload.label_bytes + self.workload.mask_bytes
        return self.activation_bytes() + self.workload.tokens * per_token

    def uplink_time(self) -> float:
        """Time to send z (+labels) client → server, including RTT/2."""
        return self.link.uplink_s(self.uplink_bytes())

    def downlink_time(self) -> float:
        """λ server → client (same shape and dtype as z), including RTT/2."""
        return self.link.downlink_s(self.activation_bytes())

    def client_forward_time(self, c: int) -> float:
        """One forward of the first c blocks (the embedding lookup is a gather, ~0 FLOPs).

        A perturbed pass costs the same: the perturbation θ_c + μu_p is regenerated from a seed in place and is
        O(d_c) elementwise work, negligible next to the matmuls (and tiny under LoRA).
        """
        self._check_layers(c)
        flops = c * self.shape.layer_forward_flops(self.workload.batch, self.workload.seq_len)
        return flops / self.hardware.client_flops_per_s

    def server_compute_time(self, c: int) -> float:
        """Forward + backward of blocks c+1..L and the LM head on the server (yields g_s and λ in one BP)."""
        self._check_layers(c)
        w = self.workload
        forward = (self.shape.num_layers - c) * self.shape.layer_forward_flops(w.batch, w.seq_len)
        forward += self.shape.head_forward_flops(w.batch, w.seq_len)
        return (1.0 + BACKWARD_FLOPS_FACTOR) * forward / self.hardware.server_flops_per_s

    def idle_window(self, c: int) -> float:
        """W(c): from the end of the client forward to the arrival of λ (uplink + server BP + downlink, incl. RTT)."""
        return self.uplink_time() + self.server_compute_time(c) + self.downlink_time()

    def max_perturbations(self, c: int) -> int:
        """Largest P whose P perturbed forwards fit entirely in W(c): floor(W(c) / t_fwd(c))."""
        return math.floor(self.idle_window(c) / self.client_forward_time(c) * (1.0 + _FLOOR_RTOL))

    def finish_time(self, num_perturbations: int) -> float:
        """Work after λ arrives that needs λ and so cannot be hidden, for P perturbations.

        The P projections v_p = λᵀ(z̃_p − z) (eq:scalar_proj) on the client, then the scalar exchange: P fp32 v_p
        up (eq:scalar_agg) and P aggregated v̄_p down, each paying RTT/2. Waiting for the other K−1 clients and
        the seed-replay update of θ_c (eq:grad_recon, eq:client_update; O(P·d_c), small under LoRA) are not
        modelled. Zero when P = 0.
        """
        if num_perturbations < 0:
            raise ConfigError(f"number of perturbations P must be >= 0, got {num_perturbations}")
        if num_perturbations == 0:
            return 0.0
        elements = self.workload.tokens * self.shape.hidden
        projections = num_perturbations * PROJECTION_FLOPS_PER_ELEMENT * elements / self.hardware.client_flops_per_s
        scalars = num_perturbations * SCALAR_BYTES
        exchange = self.link.uplink_s(scalars) + self.link.downlink_s(scalars)
        return projections + exchange

    def round_time(self, num_perturbations: int, c: int, overlap: bool, include_finish: bool = True) -> float:
        """Wall time of one round with P perturbed passes.

        overlap=True (HO-SFL latency hiding): t_fwd + max(W, P·t_fwd) + finish, since the client's compute runs
        while its NIC sends z and the server works. overlap=False (passes started only once λ is back):
        t_fwd + W + P·t_fwd + finish. Both equal t_fwd + W at P = 0.
        """
        t_fwd = self.client_forward_time(c)
        window = self.idle_window(c)
        perturbed = num_perturbations * t_fwd
        middle = max(window, perturbed) if overlap else window + perturbed
        finish = self.finish_time(num_perturbations) if include_finish else 0.0
        return t_fwd + middle + finish

    def scaled(self, uplink: float, downlink: float, client: float, server: float) -> LatencyModel:
        """Return this model with bandwidths and throughputs multiplied by the given factors (RTT unchanged)."""
        link = dataclasses.replace(
            self.link, uplink_mbps=self.link.uplink_mbps * uplink, downlink_mbps=self.link.downlink_mbps * downlink
        )
        hardware = dataclasses.replace(
            self.hardware,
            client_tflops=self.hardware.client_tflops * client,
            server_tflops=self.hardware.server_tflops * server,
        )
        return dataclasses.replace(self, link=link, hardware=hardware)


@dataclass(frozen=True)
class Band:
    """Summary of a quantity over noise trials."""

    nominal: float
    """Value without noise."""
    mean: float
    low: float
    """Lower percentile (see ``simulate``'s band argument)."""
    high: float
    """Upper percentile."""
    min: float
    max: float

    @classmethod
    def of(cls, nominal: float, samples: np.ndarray, band: tuple[float, float]) -> Band:
        """Summarise ``samples`` with the percentiles ``band``."""
        low, high = np.percentile(samples, band)
        return cls(
            nominal=float(nominal),
            mean=float(samples.mean()),
            low=float(low),
            high=float(high),
            min=float(samples.min()),
            max=float(samples.max()),
        )


@dataclass(frozen=True)
class LayerResult:
    """Latency-hiding budget for one client depth c."""

    client_layers: int
    max_p: Band
    window_s: Band
    client_forward_s: Band


def _noise_models(model: LatencyModel, noise: float, trials: int, seed: int) -> list[LatencyModel]:
    """``trials`` perturbed copies of ``model``.

    Per trial, four independent multipliers ~ Uniform[1 − noise, 1 + noise] scale uplink and downlink bandwidth
    and client and server throughput (the paper's "10 % random noise in network and computing speed"); one draw
    holds for the whole round, i.e. the client forward and all P passes share the client factor. RTT is fixed.
    """
    if not 0.0 <= noise < 1.0:
        raise ConfigError(f"noise must be in [0, 1), got {noise}")
    if trials < 1:
        raise ConfigError(f"trials must be >= 1, got {trials}")
    rng = np.random.default_rng(seed)
    factors = rng.uniform(1.0 - noise, 1.0 + noise, size=(trials, 4))  # (trials, [up, down, client, server])
    return [model.scaled(*map(float, row)) for row in factors]


def simulate(
    model: LatencyModel,
    client_layers: Iterable[int],
    noise: float = 0.10,
    trials: int = 1000,
    seed: int = 0,
    band: tuple[float, float] = (5.0, 95.0),
) -> list[LayerResult]:
    """Max P, W(c) and t_fwd(c) for each c, over ``trials`` noise draws (see ``_noise_models``).

    The same draws are used for every c, so the curves are comparable across depths. ``band`` are the
    percentiles reported as low/high; min/max are kept too.
    """
    draws = _noise_models(model, noise, trials, seed)
    results = []
    for c in client_layers:
        max_p = np.array([m.max_perturbations(c) for m in draws], dtype=float)
        window = np.array([m.idle_window(c) for m in draws])
        forward = np.array([m.client_forward_time(c) for m in draws])
        results.append(
            LayerResult(
                client_layers=c,
                max_p=Band.of(model.max_perturbations(c), max_p, band),
                window_s=Band.of(model.idle_window(c), window, band),
                client_forward_s=Band.of(model.client_forward_time(c), forward, band),
            )
        )
    return results


def simulate_round_time(
    model: LatencyModel,
    c: int,
    perturbations: Sequence[int],
    overlap: bool,
    noise: float = 0.10,
    trials: int = 1000,
    seed: int = 0,
    band: tuple[float, float] = (5.0, 95.0),
) -> list[Band]:
    """Round time for each P in ``perturbations`` (one Band per P) under the same noise draws as ``simulate``."""
    draws = _noise_models(model, noise, trials, seed)
    return [
        Band.of(
            model.round_time(p, c, overlap),
            np.array([m.round_time(p, c, overlap) for m in draws]),
            band,
        )
        for p in perturbations
    ]


# ---------------------------------------------------------------------------------------------------------- CLI

_SECTIONS: dict[str, type] = {"link": LinkConfig, "hardware": Hardware, "model": DecoderShape, "workload": Workload}
_SIM_DEFAULTS: dict[str, Any] = {"noise": 0.10, "trials": 1000, "seed": 0, "max_client_layers": 8, "round_layers": 4}


def load_config(path: str | Path) -> tuple[LatencyModel, dict[str, Any]]:
    """Build a LatencyModel and the simulation settings from a YAML with sections link/hardware/model/workload/sim.

    A missing section keeps its defaults (``model`` defaults to Llama-3.2-1B); an unknown section or key is an
    error that names it.
    """
    import yaml

    raw = yaml.safe_load(Path(path).read_text()) or {}
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
    bad = set(sim) - set(_SIM_DEFAULTS)
    if bad:
        raise ConfigError(f"{path}: unknown key(s) {sorted(bad)} in section 'sim'; known: {sorted(_SIM_DEFAULTS)}")
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
    model, sim = load_config(args.config) if args.config else (LatencyModel(), dict(_SIM_DEFAULTS))

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


if __name__ == "__main__":
    sys.exit(main())
