"""The suite: every benchmark, the options the suite runs it with, and the figures it measures, declared once.

``python -m bench list`` prints this; ``python -m bench run`` and each module's own command write the figures named
here (``bench.common.Recorder.write``). A target is what an issue set for a figure; a floor what the figure cannot go
below (a number, or how each run measures it). Figures without either are reported as measured.
"""

from __future__ import annotations

from dataclasses import replace

from bench.common import Benchmark, Figure

X = "×"


ZO_CLIENTS = (
    ("quickstart_cnn", "quickstart CNN cut 1, B=32, P=5"),
    ("tiny_llama_lora", "tiny Llama cut 2 + LoRA, B=32 T=128, P=2"),
    ("tiny_llama_full", "tiny Llama cut 2 full fine-tuning, P=2"),
    ("resnet18_cut2", "ResNet-18 cut 2, CIFAR B=32, P=5"),
    ("smollm2_cut5", "SmolLM2-135M cut 5 + LoRA, B=16 T=64, P=2"),
)
"""bench.zo_step's clients (its --clients names) and how the batched and compiled rows label them."""


def _zo_step(name: str, options: tuple[str, ...], alloc: str) -> Benchmark:
    floor = "1 + drawing the noise (P·d_c normal draws; twice where zo.noise_cache_mb cannot keep them) / (P+1) fwds"
    what = "ZO client step / ((P+1) no-grad client forwards)"
    return Benchmark(
        name=name,
        module="bench.zo_step",
        options=options,
        measures=f"the HO-SFL client step against its floor, phase by phase, one thread, {alloc}",
        takes="~1.5 min",
        figures=(
            Figure("quickstart_cnn", X, f"{what}: quickstart CNN cut 1, B=32, P=5 (d_c = 160)", 1.10, "<=", floor),
            Figure("tiny_llama_lora", X, f"{what}: tiny Llama cut 2 + LoRA, B=32 T=128, P=2", 1.10, "<=", floor),
            Figure(
                "tiny_llama_full", X, f"{what}: tiny Llama cut 2 full fine-tuning, P=2 (d_c = 94k)", 1.10, "<=", floor
            ),
            Figure("resnet18_cut2", X, f"{what}: ResNet-18 cut 2, CIFAR B=32, P=5 (d_c = 681k)", 1.10, "<=", floor),
            Figure(
                "smollm2_cut5", X, f"{what}: SmolLM2-135M cut 5 + LoRA, B=16 T=64, P=2 (d_c = 77k)", 1.10, "<=", floor
            ),
        ),
    )


def _gpu_zo_step(name: str, options: tuple[str, ...], rng: str) -> Benchmark:
    return replace(
        _zo_step(name, ("--device", "cuda", "--reps", "20", *options), ""),
        measures=f"the HO-SFL client step against its floor on a CUDA GPU, timed to its last kernel, {rng}",
        takes="~1 min",
        gpu=True,
    )


def _batched(name: str, options: tuple[str, ...], where: str, target: float | None, gpu: bool) -> Benchmark:
    """The ZO step with all P perturbed forwards in one batched forward (zo.perturb_batch >= P), against P+1
    sequential forwards: below 1 where the device has parallelism the sequential forwards leave idle."""
    what = "ZO client step, P perturbed forwards batched (zo.perturb_batch), / ((P+1) sequential no-grad forwards)"
    return Benchmark(
        name=name,
        module="bench.zo_step",
        options=("--perturb-batch", "64", *options),
        measures=f"the HO-SFL client step with its perturbed forwards batched, {where}",
        takes="~1.5 min",
        figures=tuple(Figure(c, X, f"{what}: {label}", target, "<=") for c, label in ZO_CLIENTS),
        gpu=gpu,
    )


def _compiled(name: str, options: tuple[str, ...], where: str, gpu: bool) -> Benchmark:
    """The ZO step with its forwards compiled (zo.compile) and eager, both perturbing by copy, in one invocation,
    each against P+1 eager no-grad forwards."""
    floor = "1 + drawing the noise (P·d_c normal draws, twice) / (P+1) eager fwds"
    what = "ZO client step / ((P+1) eager no-grad client forwards), zo.perturb_mode=copy"
    figures = []
    for c, label in ZO_CLIENTS:
        figures.append(Figure(c, X, f"{what}, forwards compiled (zo.compile): {label}", 1.10, "<=", floor))
        figures.append(Figure(f"{c}_off", X, f"{what}, eager forwards (zo.compile=off): {label}", floor=floor))
    return Benchmark(
        name=name,
        module="bench.zo_step",
        options=options,
        measures=f"the HO-SFL client step with its forwards compiled against eager ones, {where}",
        takes="~3 min (the first step of each client compiles)",
        figures=tuple(figures),
        gpu=gpu,
    )


def _server_step() -> Benchmark:
    run = "bf16, cut 5, LoRA r=8 q/v, B=8 T=512, LM loss over the vocabulary"
    figures = []
    for arch, label in (
        ("qwen3_0_6b", "Qwen3-0.6B"),
        ("qwen3_1_7b", "Qwen3-1.7B"),
        ("qwen3_4b", "Qwen3-4B"),
        ("qwen3_8b", "Qwen3-8B"),
    ):
        figures += [
            Figure(f"{arch}_tokens_per_s", "tokens/s", f"server step (f_s forward, backward to λ, AdamW), {label} "
                   f"shape, {run}"),
            Figure(f"{arch}_mfu", "", f"model FLOPs utilisation of that step (dense bf16 peak), {label}"),
        ]  # fmt: skip
    return Benchmark(
        name="server_step",
        module="bench.server_step",
        measures="the server's step on a CUDA GPU at the published Qwen3 shapes: tokens/s and MFU",
        takes="~2 min",
        figures=tuple(figures),
        gpu=True,
    )


def _server_loss() -> Benchmark:
    shape = "random Qwen3, vocabulary 151,936, hidden 256, cut 2 of 4 blocks, LoRA r=8 q/v, B=4 T=256 all labels"
    return Benchmark(
        name="server_loss",
        module="bench.server_loss",
        measures="the server's forward/backward with the LM loss in one piece and in chunks (server.loss_chunk_tokens"
        "=256) on the CPU: peak bytes above the weights, CPU time",
        takes="~2 min",
        figures=(
            Figure("peak_mb_unchunked", "MiB", f"server pass peak above resident, loss_chunk_tokens=0, {shape}"),
            Figure("peak_mb_chunked", "MiB", "the same, loss_chunk_tokens=256"),
            Figure("peak_ratio", X, "chunked peak / unchunked peak"),
            Figure("step_s_unchunked", "s", "server forward/backward CPU time, loss_chunk_tokens=0, one thread"),
            Figure("step_s_chunked", "s", "the same, loss_chunk_tokens=256 (frozen head: gradients taken per chunk)"),
            Figure("time_ratio", X, "chunked time / unchunked time"),
        ),
    )


def _memory() -> Benchmark:
    inf = "client peak / inference peak"
    figures = []
    for model, label, target in (("smollm2", "SmolLM2-135M cut 5", 1.05), ("tiny_llama", "tiny Llama cut 2", None)):
        figures += [
            Figure(f"{model}_hosfl", X, f"{inf}, HO-SFL (overlap off), {label}, LoRA r=8, B=32 T=128"
                   + ("; paper 1.03" if target else ""), target, "<=", "1 + |λ|/inference (λ beside one forward)"),
            Figure(f"{model}_hosfl_overlap", X, f"{inf}, HO-SFL with zo.overlap=true, {label}",
                   floor="1 + P·|z|/inference (the P z̃ wait for λ)"),
            Figure(f"{model}_sfl", X, f"{inf}, SFL (client backprop), {label}" + ("; paper 2.19" if target else "")),
            Figure(f"{model}_zo_sfl", X, f"{inf}, ZO-SFL, {label}"),
            Figure(f"{model}_full_local", X, f"{inf}, the whole model trained on the client, {label}"
                   + ("; paper 5.19" if target else "")),
        ]  # fmt: skip
    return Benchmark(
        name="memory",
        module="bench.memory_ratio",
        measures="client peak memory of one step of each method over inference (the memory profiler's tracker)",
        takes="~4 min",
        figures=tuple(figures),
    )


def _agg_traffic() -> Benchmark:
    figures = []
    for method, per in (("hosfl", "4·P, whatever d_c"), ("sfl", "4·d_c")):
        for width in (16, 32, 64, 128):
            d_c = 10 * width
            figures.append(
                Figure(
                    f"{method}_dc{d_c}",
                    "B/client/round",
                    f"aggregation uplink bytes per client per round, {method.upper().replace('HOSFL', 'HO-SFL')}, "
                    f"small CNN width {width} (d_c = {d_c}): {per}",
                    20 if method == "hosfl" else 4 * d_c,
                    "=",
                )
            )
    return Benchmark(
        name="agg_traffic",
        module="bench.agg_traffic",
        measures="aggregation traffic per client per round of HO-SFL and SFL as d_c doubles (one in-process round)",
        takes="~5 s",
        figures=tuple(figures),
    )


def _dist() -> Benchmark:
    floor = "one loopback RPC round trip carrying a submit + one all_reduce of K×P, same layout (bench/rpc_floor.py)"
    figures = [
        Figure("in_process_samples_per_s", "samples/s", "in-process runtime, 1 thread, quickstart, 6400 samples")
    ]
    for w in (1, 2):
        layout = f"torchrun 1 server + {w} worker{'s' if w > 1 else ''}"
        figures += [
            Figure(f"torchrun_w{w}_vs_in_process", X, f"samples/s of {layout} over the 1-thread in-process run",
                   0.95 if w == 1 else None, ">="),
            Figure(f"torchrun_w{w}_transport_ms", "ms/worker-round",
                   f"{layout}: time a worker is blocked in RPC waits + all_reduce per round", floor=floor),
            Figure(f"torchrun_w{w}_blocking_waits", "waits/worker-round",
                   f"{layout}: RPC answers not there yet when asked for, per worker-round", 1.0, "<="),
            Figure(f"torchrun_w{w}_rpc_messages", "RPCs/worker-round",
                   f"{layout}: RPC messages a worker sends per round (a worker's clients' calls go together)"),
            Figure(f"torchrun_w{w}_catch_up_wait_ms", "ms/worker-round",
                   f"{layout}: blocked on sync, the catch-up of a replica that missed the last round (that "
                   "round's v̄ comes from the server, one round trip after the aggregation)"),
        ]  # fmt: skip
    figures.append(
        Figure("same_final_metrics", "bool", "torchrun's final metrics equal the 1-thread in-process run's", True, "=")
    )
    return Benchmark(
        name="dist",
        module="bench.dist_bench",
        options=("--workers", "1", "2", "--repeat", "3"),
        measures="the torchrun runtime against the in-process one, and its transport against the floor beside it",
        takes="~3 min",
        figures=tuple(figures),
    )


def _elastic() -> Benchmark:
    what = "quickstart, 6400 samples, 1 thread per process, nothing dropping, median of 3 alternating runs"
    return Benchmark(
        name="elastic",
        module="bench.elastic_bench",
        options=("--repeat", "3"),
        measures="an elastic run (--serve + 2 --join workers) against the torchrun job and the in-process runtime, "
        "one invocation",
        takes="~4 min",
        figures=(
            Figure("in_process_samples_per_s", "samples/s", f"in-process runtime, {what}"),
            Figure("torchrun_samples_per_s", "samples/s", f"torchrun 1 server + 2 workers, {what}"),
            Figure("elastic_samples_per_s", "samples/s", f"--serve + 2 --join workers, {what}"),
            Figure("elastic_vs_torchrun", X, "samples/s of the elastic run over the torchrun job's", 0.9, ">="),
            Figure("elastic_rpc_messages", "RPCs/worker-round", "messages an elastic worker sends per round (its "
                   "clients' uploads together, its round's end with the next round's catch-up in one message)", 2.0,
                   "<="),
            Figure("elastic_blocking_waits", "waits/worker-round", "calls an elastic worker waited on per round (the "
                   "critical path; a catch-up sent ahead and answered in time is not one)", 2.0, "<="),
            Figure("same_final_metrics", "bool", "the three runtimes' final metrics are equal", True, "="),
        ),
    )


def _overlap() -> Benchmark:
    figures = []
    runs = [("quickstart", "scaled", 1.10), ("quickstart", "paper", None), ("resnet18", "scaled", None)]
    model = {True: "App. C.1 model 1.003", False: "App. C.1 model 1.442"}
    for setup, link, target in runs:
        for runtime in ("in_process", "torchrun"):
            for on in (True, False):
                where = "in one process" if runtime == "in_process" else "torchrun (server in its own process)"
                figures.append(
                    Figure(
                        f"{setup}_{link}_{runtime}_{'on' if on else 'off'}",
                        X,
                        f"round(P=5) / round(P=0), overlap {'on' if on else 'off'}, {setup}, {link} link, {where}"
                        + (f"; {model[on]}" if link == "scaled" else ""),
                        target if on else None,
                    )
                )
    return Benchmark(
        name="overlap",
        module="bench.overlap",
        measures="latency hiding: HO-SFL round time against P under the emulated link, overlap on and off, both "
        "runtimes",
        takes="~15 min",
        figures=tuple(figures),
    )


def _threads() -> Benchmark:
    figures = []
    for model, label in (("small", "quickstart CNN"), ("lm135m", "SmolLM2-135M + LoRA")):
        for n in (1, 2):
            figures.append(Figure(f"{model}_{n}_thread{'s' if n > 1 else ''}", "s/round",
                                  f"{label}, one process, job.threads={n} (median of the turns)"))  # fmt: skip
    return Benchmark(
        name="threads",
        module="bench.threads",
        measures="seconds per round of one process with job.threads = 1 and 2 (the rule behind job.threads=0)",
        takes="~5 min",
        figures=tuple(figures),
    )


def _cpu_hygiene() -> Benchmark:
    run = "tiny-Qwen3 HO-SFL under torchrun, 1 server + 2 workers, 50 rounds"
    return Benchmark(
        name="cpu_hygiene",
        module="bench.cpu_hygiene",
        measures="what the torchrun processes cost beyond their work: server RSS over the rounds, idle worker CPU",
        takes="~30 s",
        figures=(
            Figure("server_rss_start_gib", "GiB", f"server RSS when training starts, {run}"),
            Figure("server_rss_peak_gib", "GiB", f"server peak RSS over the training window, {run}"),
            Figure("server_rss_end_gib", "GiB", f"server RSS at the end of the training window, {run}"),
            Figure("worker_cpu_s_per_round", "CPU s/round", f"CPU seconds per round of a client worker (mean), {run}"),
            Figure("wall_s_per_round", "s/round", f"wall time per round over the training window, {run}"),
            Figure("server_threads", "threads", f"threads that ran server code (summary.json), {run}", 1, "="),
        ),
    )


def _checkpoint_cost() -> Benchmark:
    return Benchmark(
        name="checkpoint_cost",
        module="bench.checkpoint_cost",
        measures="size and save time of a checkpoint, and a real SIGKILL during a save followed by job.resume=auto",
        takes="~4 min",
        figures=(
            Figure("quickstart_mb", "MB", "checkpoint of the quickstart (θs + AdamW, state.pt)"),
            Figure("quickstart_save_s", "s", "save time of a quickstart checkpoint (median of 4)"),
            Figure("smollm2_mb", "MB", "checkpoint of SmolLM2-135M cut 5, LoRA r=8 (frozen base weights not saved)"),
            Figure("smollm2_save_s", "s", "save time of a SmolLM2 checkpoint (median of 4)"),
            Figure(
                "kill_resume_digests_equal",
                "bool",
                "SIGKILL during the second save, then job.resume=auto: digests equal an uninterrupted run's",
                True,
                "=",
            ),
        ),  # fmt: skip
    )


def _generation() -> Benchmark:
    figures = []
    for model, label in (("tiny_qwen3", "tiny Qwen3 cut 2"), ("smollm2", "SmolLM2-135M-Instruct cut 15")):
        figures += [
            Figure(f"{model}_cache_tokens_per_s", "tokens/s", f"SQuAD greedy decoding through the split with KV "
                   f"caches on both sides, {label}, 8 examples, 1 thread"),
            Figure(f"{model}_speedup", X, f"tokens/s with KV caches over without, {label}"),
            Figure(f"{model}_same_tokens", "bool", f"the cached path generates the no-cache path's tokens, {label}",
                   True, "="),
        ]  # fmt: skip
    return Benchmark(
        name="generation",
        module="bench.generation",
        measures="evaluation speed of SQuAD greedy decoding through the split, with and without KV caches",
        takes="~3 min",
        figures=tuple(figures),
    )


def _scale() -> Benchmark:
    floor = "the analytic parameter bytes of that rank (bench/scale.py::analytic)"
    run = "Qwen3-0.6B shape, bf16, cut 5, LoRA r=8, K=2 B=1 T=16, P=2"
    figures = []
    for s in (1, 2):
        figures += [
            Figure(f"s{s}_server_peak_rss_gb", "GB", f"peak RSS of a server rank (the largest), S={s}, {run}",
                   floor=floor),
            Figure(f"s{s}_worker_peak_rss_gb", "GB", f"peak RSS of the client worker, S={s}, {run}", floor=floor),
            Figure(f"s{s}_round_s", "s", f"round time (the second round), S={s}, {run}"),
        ]  # fmt: skip
    return Benchmark(
        name="scale",
        module="bench.scale",
        options=("--arch", "qwen3-0.6b", "--ranks", "1", "2"),
        measures="HO-SFL rounds of a published architecture at its real shape under torchrun: memory per rank, "
        "round time",
        takes="~1.5 min",
        figures=tuple(figures),
    )


def _peer() -> Benchmark:
    run = "HO-SFL, ResNet-18 cut 2, M=100 K=10 B=32 P=5 μ=1e-3, AdamW, freeze_bn=code, 1 thread"
    ref = "the reference loop written in bench/peer.py (plain PyTorch, Algorithm 1-2; not the authors' code)"
    return Benchmark(
        name="peer",
        module="bench.peer",
        measures="HO-SFL at the authors' code's CIFAR-10 setting: hosfl_dist's in-process run beside a plain "
        "reference loop (and the authors' code, where --peer-command runs it), samples/s over the same span (rounds "
        "against rounds, whole process against whole process) in one invocation",
        takes="~3 min",
        figures=(
            Figure("ours_samples_per_s", "samples/s", f"hosfl_dist.train, clients.replicas=shared, {run}: rounds (the "
                   "timed rounds' samples over their wall time)"),
            Figure("reference_samples_per_s", "samples/s", f"{ref}, {run}: rounds"),
            Figure("ours_vs_reference", X, "ours / reference over the rounds, median of the per-turn ratios (turns "
                   "alternate)"),
            Figure("ours_vs_reference_cpu", X, "the same with samples per CPU second of the process (what other "
                   "processes' load moves least)"),
            Figure("ours_process_samples_per_s", "samples/s", "ours over its whole process: every round's samples "
                   "over the process's wall time, start-up, data, build and evaluations included"),
            Figure("reference_process_samples_per_s", "samples/s", "the reference over its whole process, the same "
                   "evaluations as ours"),
            Figure("ours_vs_reference_process", X, "ours / reference over the whole process, median of the per-turn "
                   "ratios"),
            Figure("ours_vs_reference_process_cpu", X, "the same with samples per CPU second of the processes"),
            Figure("authors_samples_per_s", "samples/s", f"the authors' published code, {run}: rounds, the last "
                   "samples/s its output prints (only with --peer-command: their code is not in this repository)"),
            Figure("authors_process_samples_per_s", "samples/s", "the authors' code over its whole process: "
                   "--peer-samples over its wall time (only with --peer-command and --peer-samples)"),
            Figure("ours_vs_authors", X, "ours / the authors' code over the rounds, median of the per-turn ratios "
                   "(issue 37)", 1.5, ">="),
            Figure("ours_vs_authors_process", X, "ours / the authors' code over the whole process, median of the "
                   "per-turn ratios (issue 37)", 1.5, ">="),
            Figure(
                "same_model", "bool", "the reference's f_c, f_s and z have hosfl_dist's trainable shapes", True, "="
            ),
        ),  # fmt: skip
    )


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        _zo_step("zo_step", (), "glibc's default malloc"),
        _zo_step("zo_step_tuned", ("--tune-malloc",), "glibc keeping freed memory (--tune-malloc)"),
        _zo_step(
            "zo_step_noise_cache",
            ("--tune-malloc", "--noise-cache-mb", "64"),
            "glibc keeping freed memory, the round's draws kept (zo.noise_cache_mb=64)",
        ),  # fmt: skip
        _gpu_zo_step("gpu_zo_step", (), "noise drawn on the CPU and copied (zo.rng_device=cpu, the default)"),
        _gpu_zo_step("gpu_zo_step_cuda_rng", ("--rng-device", "cuda"), "noise drawn on the GPU (zo.rng_device=cuda)"),
        _batched("zo_step_batched", (), "one thread (a 2-core CPU has no parallelism to spare: reported)", None, False),
        _batched(
            "gpu_zo_step_batched",
            ("--device", "cuda", "--reps", "20", "--rng-device", "cuda"),
            "on a CUDA GPU, noise drawn there, timed to its last kernel",
            1.0,
            True,
        ),  # fmt: skip
        _compiled("zo_step_compile", ("--compile", "default", "--tune-malloc"),
                  "one thread, glibc keeping freed memory (a CPU is not launch-bound: reported)", False),
        _compiled("gpu_zo_step_compile", ("--compile", "reduce-overhead", "--device", "cuda", "--reps", "20",
                                          "--rng-device", "cuda"),
                  "on a CUDA GPU with CUDA graphs (zo.compile=reduce-overhead), noise drawn there", True),  # fmt: skip
        _server_step(),
        _server_loss(),
        _memory(),
        _agg_traffic(),
        _dist(),
        _elastic(),
        _overlap(),
        _threads(),
        _cpu_hygiene(),
        _checkpoint_cost(),
        _generation(),
        _scale(),
        _peer(),
    )
}


def benchmark(name: str) -> Benchmark:
    return BENCHMARKS[name]
