"""The GPU tier: the CUDA and NCCL paths. Skipped, with the reason, where there is no CUDA device (conftest)."""

from __future__ import annotations

import pytest
import torch

from hosfl_dist.measure.memory import profile_mode
from hosfl_dist.measure.modes import ProfileSpec
from tiny import TINY_OVERRIDES, read_run, run_in_process, torchrun

pytestmark = pytest.mark.gpu
CUDA = [*TINY_OVERRIDES, "job.device=cuda"]


def test_hosfl_on_cuda_catches_up_bit_identically(tmp_path):
    """Models on the GPU, noise on the CPU stream (zo.rng_device=cpu, the default): per-client replicas that catch up
    through Algorithm 3 equal the always-current shared replica bit for bit, as on the CPU."""
    _, _, a, rows_a = run_in_process([*CUDA, f"job.out_dir={tmp_path / 'a'}"])
    _, _, b, rows_b = run_in_process([*CUDA, "clients.replicas=shared", f"job.out_dir={tmp_path / 'b'}"])
    for r in rows_a + rows_b:
        r.pop("wall_time_s")
    assert rows_a == rows_b and a["client_digests"] == b["client_digests"] and a["server_digest"] == b["server_digest"]
    assert rows_a[-1]["eval_accuracy"] > 0.5


def test_cuda_noise_stream_is_reproducible(tmp_path):
    """zo.rng_device=cuda: every replica draws u from the CUDA generator; two runs are bit-identical."""
    runs = [run_in_process([*CUDA, "zo.rng_device=cuda", f"job.out_dir={tmp_path / str(i)}"])[2] for i in range(2)]
    assert (
        runs[0]["client_digests"] == runs[1]["client_digests"] and runs[0]["server_digest"] == runs[1]["server_digest"]
    )


def test_batched_perturbed_forwards_on_cuda_take_the_steps_of_one_at_a_time(tmp_path):
    """zo.perturb_batch=3 (all P perturbed forwards in one vmap, CUDA noise stream): the losses of one forward at a
    time to float tolerance (batched kernels round otherwise), and two batched runs bit-identical."""
    base = [*CUDA, "zo.rng_device=cuda"]
    _, _, _, one = run_in_process([*base, f"job.out_dir={tmp_path / 'one'}"])
    runs = [run_in_process([*base, "zo.perturb_batch=3", f"job.out_dir={tmp_path / str(i)}"]) for i in range(2)]
    assert runs[0][2]["client_digests"] == runs[1][2]["client_digests"]
    torch.testing.assert_close(
        torch.tensor([r["eval_loss"] for r in runs[0][3]]), torch.tensor([r["eval_loss"] for r in one]),
        rtol=1e-4, atol=1e-5,
    )  # fmt: skip


def test_batched_lora_client_on_cuda_uses_the_attention_batch_rule():
    """A tiny Llama LoRA client on CUDA: its P=4 perturbed activations from one batched forward equal those of one
    forward at a time to float tolerance (SDPA has a vmap batch rule on CUDA, none on the CPU)."""
    from hosfl_dist.measure.modes import build_setup, profiled_worker

    spec = ProfileSpec(model="tiny:llama", cut=2, batch=4, seq=16, device="cuda", rng_device="cuda",
                       num_perturbations=4, perturb_batch=4)  # fmt: skip
    setup = build_setup(spec)
    worker = profiled_worker(spec, setup, "hosfl")
    worker.bind(worker.replicas[0].params)
    batched = worker.zo_activations(setup.inputs, [1, 2, 3, 4])
    worker.perturb_batch = 1
    for a, b in zip(batched, worker.zo_activations(setup.inputs, [1, 2, 3, 4]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_memory_profiler_reports_the_cuda_allocator_peak():
    spec = ProfileSpec(model="tiny:llama", cut=2, batch=4, seq=16, device="cuda")
    inference, hosfl = profile_mode(spec, "inference"), profile_mode(spec, "hosfl")
    assert hosfl["cuda_peak_bytes"] >= hosfl["cuda_resident_bytes"] + hosfl["activation_bytes"]
    assert hosfl["cuda_peak_bytes"] > inference["cuda_peak_bytes"]


def failure(out: str) -> str:
    """What a failed torchrun printed: its ranks' error lines first (the tail alone is torchrun's own report)."""
    errors = [line for line in out.splitlines() if "Error" in line or "error:" in line]
    return "\n".join(errors[:30]) + "\n...\n" + out[-3000:]


def assert_matches_in_process(tmp_path, dist_dir) -> None:
    """The torchrun run in ``dist_dir`` completed with the in-process CUDA run's traffic and, to float tolerance
    (kernels may differ between processes' streams), its losses."""
    rows, summary = read_run(dist_dir)
    _, _, ref, ref_rows = run_in_process([*CUDA, f"job.out_dir={tmp_path / 'ref'}"])
    assert summary["status"] == "completed" and summary["comm"] == ref["comm"]
    torch.testing.assert_close(
        torch.tensor([r["eval_loss"] for r in rows]),
        torch.tensor([r["eval_loss"] for r in ref_rows]),
        rtol=1e-4,
        atol=1e-5,
    )


@pytest.mark.multiprocess
def test_torchrun_on_one_gpu_with_an_nccl_worker_group(tmp_path):
    """1 server + 1 client worker sharing the GPU (NCCL for the worker group, gloo for control): the run completes and
    matches the in-process CUDA run to float tolerance (kernels may differ between processes' streams)."""
    rc, out, _ = torchrun(2, ["-m", "hosfl_dist.run", *CUDA, f"job.out_dir={tmp_path / 'dist'}"])
    assert rc == 0, failure(out)
    assert_matches_in_process(tmp_path, tmp_path / "dist")


@pytest.mark.multiprocess
def test_client_workers_sharing_one_gpu_reduce_through_gloo(tmp_path):
    """2 client workers and the server on one GPU: NCCL refuses a group whose ranks share a device, so the workers'
    P-scalar all_reduce runs on gloo over the CPU; the run completes with the in-process run's traffic and losses."""
    rc, out, _ = torchrun(3, ["-m", "hosfl_dist.run", *CUDA, "job.device=cuda:0", f"job.out_dir={tmp_path / 'dist'}"])
    assert rc == 0, failure(out)
    assert "client workers ranks 1 and 2 share cuda:0 on" in out and "runs on gloo over the CPU" in out
    assert_matches_in_process(tmp_path, tmp_path / "dist")


@pytest.mark.multiprocess
def test_server_ranks_sharing_one_gpu_are_refused_in_one_line(tmp_path):
    """FSDP2 over NCCL needs a GPU per server rank: two server ranks on one GPU stop before any group starts, with the
    reason in one line (one rank reports it), and no run is written."""
    from tiny import lm_overrides, write_text_files

    files = write_text_files(tmp_path)
    ovr = [*lm_overrides(tmp_path / "run", files, arch="qwen3"), "model.dtype=bfloat16", "job.device=cuda:0"]
    rc, out, _ = torchrun(3, ["-m", "hosfl_dist.run", *ovr, "server.ranks=2"])
    assert rc != 0
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, failure(out)
    assert errors[0].startswith("error: invalid value for server.ranks: 2 server ranks on CUDA need a GPU each (FSDP2 "
                                "over NCCL), but ranks 0 and 1 share cuda:0 on ")  # fmt: skip
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: one per server rank (NCCL)")
def test_data_parallel_server_group_reports_cuda_memory(tmp_path):
    """A tiny bf16 Qwen3 under torchrun with 2 server ranks (FSDP2 on a CUDA mesh, NCCL), one GPU each, and 1 worker:
    the run completes, every rank reports its peak CUDA allocation, and each server rank holds about half of f_s."""
    from tiny import lm_overrides, write_text_files

    files = write_text_files(tmp_path)
    ovr = [*lm_overrides(tmp_path / "run", files, arch="qwen3"), "model.dtype=bfloat16", "job.device=cuda"]
    rc, out, _ = torchrun(3, ["-m", "hosfl_dist.run", *ovr, "server.ranks=2"])
    assert rc == 0, failure(out)
    _, summary = read_run(tmp_path / "run")
    mem = {m["rank"]: m for m in summary["memory"]}
    assert all(m.get("peak_cuda_bytes", 0) > 0 for m in mem.values())
    assert abs(mem[0]["param_bytes"] - mem[1]["param_bytes"]) < 0.1 * mem[0]["param_bytes"]
