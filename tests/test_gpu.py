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


def test_memory_profiler_reports_the_cuda_allocator_peak():
    spec = ProfileSpec(model="tiny:llama", cut=2, batch=4, seq=16, device="cuda")
    inference, hosfl = profile_mode(spec, "inference"), profile_mode(spec, "hosfl")
    assert hosfl["cuda_peak_bytes"] >= hosfl["cuda_resident_bytes"] + hosfl["activation_bytes"]
    assert hosfl["cuda_peak_bytes"] > inference["cuda_peak_bytes"]


@pytest.mark.multiprocess
def test_torchrun_on_one_gpu_with_an_nccl_worker_group(tmp_path):
    """1 server + 1 client worker sharing the GPU (NCCL for the worker group, gloo for control): the run completes and
    matches the in-process CUDA run to float tolerance (kernels may differ between processes' streams)."""
    rc, out, _ = torchrun(2, ["-m", "hosfl_dist.run", *CUDA, f"job.out_dir={tmp_path / 'dist'}"])
    assert rc == 0, out[-4000:]
    rows, summary = read_run(tmp_path / "dist")
    _, _, ref, ref_rows = run_in_process([*CUDA, f"job.out_dir={tmp_path / 'ref'}"])
    assert summary["status"] == "completed" and summary["comm"] == ref["comm"]
    torch.testing.assert_close(
        torch.tensor([r["eval_loss"] for r in rows]),
        torch.tensor([r["eval_loss"] for r in ref_rows]),
        rtol=1e-4,
        atol=1e-5,
    )


@pytest.mark.multiprocess
def test_data_parallel_server_group_on_one_gpu_reports_cuda_memory(tmp_path):
    """A tiny bf16 Qwen3 under torchrun with 2 server ranks (FSDP2 on a CUDA mesh, NCCL) and 1 worker sharing one GPU:
    the run completes, every rank reports its peak CUDA allocation, and each server rank holds about half of f_s."""
    from tiny import lm_overrides, write_text_files

    files = write_text_files(tmp_path)
    ovr = [*lm_overrides(tmp_path / "run", files, arch="qwen3"), "model.dtype=bfloat16", "job.device=cuda"]
    rc, out, _ = torchrun(3, ["-m", "hosfl_dist.run", *ovr, "server.ranks=2"])
    assert rc == 0, out[-4000:]
    _, summary = read_run(tmp_path / "run")
    mem = {m["rank"]: m for m in summary["memory"]}
    assert all(m.get("peak_cuda_bytes", 0) > 0 for m in mem.values())
    assert abs(mem[0]["param_bytes"] - mem[1]["param_bytes"]) < 0.1 * mem[0]["param_bytes"]
