"""Analytic latency model of one HO-SFL round and the latency-hiding budget of paper App. C.1.

One round for a client (paper Sec. 3.4, Fig. "HO-SFL Timeline"):

    client forward z ─► uplink z (+labels) ─► server forward+backward ─► downlink λ ─► client projections
                      └──────────────────── idle window W(c) ──────────────────────┘

The client is idle during W(c) unless it runs its P perturbed forward passes z̃_p = f_c(x; θ_c + μu_p) there
(paper eq:perturbed_act); they need no λ, only the projections v_p = λᵀ(z̃_p − z) (eq:scalar_proj) do. The model
answers how many such passes fit in W(c) for c client layers, and what a round costs as a function of P with and
without that overlap. Equations are cited by their LaTeX labels in the paper source.

Everything is closed-form (FLOPs / throughput, bits / bandwidth + RTT/2), and the Monte Carlo (:func:`simulate`,
:func:`simulate_round_time`) draws speed multipliers around it with numpy, so the module imports only numpy, math
and the config tree; the YAML, the command line, the table and the plot are in :mod:`hosfl_dist.measure.latency.cli`.
The link is the config's :class:`~hosfl_dist.config.LinkConfig` (the ``comm`` section of a run, ``link`` in the
tool's YAML), the same that the emulated link (``comm.inject_delay``) injects.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from hosfl_dist.config import LinkConfig
from hosfl_dist.errors import ConfigError

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
