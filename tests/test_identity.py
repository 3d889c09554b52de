"""A run's identity cannot be faked cheaply (the hardening issue's part 3, attacked as part 7 asks): an input rewritten
with its size and mtime kept is hashed anew, and what changes bits in the environment (threads however they were
set, library versions, CPU kernels) is identity that resume compares."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from hosfl_dist.config import load_config
from hosfl_dist.errors import ConfigError, Interrupted
from hosfl_dist.run import main
from hosfl_dist.runfolder import environment as environment_mod
from hosfl_dist.runfolder import identity as identity_mod
from hosfl_dist.runfolder.checkpoints import checkpoint_folders
from hosfl_dist.runtime import front as front_mod
from tiny import TINY_OVERRIDES, lm_overrides, run_in_process, stop_at, write_text_files

RUN = [*TINY_OVERRIDES, "train.budget_samples=240", "checkpoint.interval_samples=48"]
"""Ten rounds of K=3 clients of 8 samples, a checkpoint every second round."""


@pytest.fixture
def one_thread(monkeypatch):
    """job.threads=0 resolves to one thread (a tiny model, no OMP_NUM_THREADS), whatever the shell sets."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def interrupted(tmp_path: Path, monkeypatch, run: list[str], round_idx: int = 5) -> Path:
    out = tmp_path / "run"
    stop_at(monkeypatch, "hosfl", round_idx)
    with pytest.raises(Interrupted):
        run_in_process([*run, f"job.out_dir={out}"])
    monkeypatch.undo()
    assert checkpoint_folders(out)
    return out


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    return err[-1]


def _keep_stat(path: Path, text: str) -> None:
    """Rewrite ``path`` with ``text`` (as long as before) and set its access and modification times back."""
    st = path.stat()
    assert len(text.encode()) == st.st_size
    path.write_text(text)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)


# -- inputs -----------------------------------------------------------------------------------------------------------
def test_labels_rewritten_with_size_and_mtime_kept_are_hashed_anew_and_the_resume_names_the_input(
    tmp_path, monkeypatch, capsys
):
    (tmp_path / "text").mkdir()
    files = write_text_files(tmp_path / "text")
    monkeypatch.setenv("HOSFL_CACHE", str(tmp_path / "cache"))
    run = [*lm_overrides(tmp_path / "run", files), "train.budget_samples=32", "checkpoint.interval_samples=8"]
    stop_at(monkeypatch, "hosfl", 1)
    with pytest.raises(Interrupted):
        run_in_process(run)
    monkeypatch.undo()
    out = tmp_path / "run"
    recorded = json.loads((out / "summary.json").read_text())["inputs"]["data.train"]
    train = files / "sst2.jsonl"
    flipped = train.read_text().replace('"y": 1', '"y": 2').replace('"y": 0', '"y": 1').replace('"y": 2', '"y": 0')
    _keep_stat(train, flipped)  # every label flipped, size and mtime as they were
    assert identity_mod.file_sha256_cached(train) == identity_mod.file_sha256(train) != recorded["sha256"]
    assert main([*run, "job.resume=auto"]) == 2
    line = _one_error_line(capsys)
    assert f"error: job.out_dir {out}: round 2 was written by another run (" in line
    assert f"input data.train ({train}: its content differs)" in line


def test_a_large_input_is_hashed_once_per_version_that_a_rewrite_cannot_keep(tmp_path, monkeypatch):
    """Above FULL_HASH_BYTES the cache answers, keyed on what a rewrite changes (ctime) and checked on sampled
    blocks; a rewrite with size and mtime kept is hashed anew, and so is a cache entry whose sample is not the
    file's."""
    monkeypatch.setenv("HOSFL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(identity_mod, "FULL_HASH_BYTES", 1024)
    big = tmp_path / "model.bin"
    data = bytearray(os.urandom(3 << 20))
    big.write_bytes(bytes(data))
    first = identity_mod.file_sha256_cached(big)
    cache_file = tmp_path / "cache" / identity_mod.HASH_CACHE
    cache = json.loads(cache_file.read_text())
    entry = cache[os.path.realpath(big)]
    assert entry["sha256"] == first == identity_mod.file_sha256(big)
    assert entry["sample"] == identity_mod.sampled_sha256(big)
    # the cache answers only for this version of the file: a stand-in hash with the right version and sample is used
    cache[os.path.realpath(big)] = {**entry, "sha256": "f" * 64}
    cache_file.write_text(json.dumps(cache))
    assert identity_mod.file_sha256_cached(big) == "f" * 64
    # a byte between the sampled blocks, size and mtime kept: ctime moved, so the version is another
    data[(3 << 20) // 31] ^= 0xFF
    st = big.stat()
    big.write_bytes(bytes(data))
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert identity_mod.file_sha256_cached(big) == identity_mod.file_sha256(big) != first
    # an entry that claims this version but whose sample is not the file's (a ctime faked by a clock change)
    cache = json.loads(cache_file.read_text())
    cache[os.path.realpath(big)].update(sha256="f" * 64, sample="0" * 64)
    cache_file.write_text(json.dumps(cache))
    assert identity_mod.file_sha256_cached(big) == identity_mod.file_sha256(big)


# -- the environment --------------------------------------------------------------------------------------------------
def test_a_resume_under_other_auto_threads_is_refused_in_one_line_and_the_key_lets_it_through(
    tmp_path, monkeypatch, capsys, one_thread
):
    out = interrupted(tmp_path, monkeypatch, RUN)
    assert json.loads((out / "summary.json").read_text())["environment"]["threads"] == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # job.threads=0 (auto) now resolves to 2
    assert main([*RUN, f"job.out_dir={out}", "job.resume=auto"]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"error: job.out_dir {out}: round 6 was written in another environment (threads 1 -> 2)")
    assert line.endswith("(job.allow_environment_change=true resumes anyway)")
    _, _, got, _ = run_in_process([*RUN, f"job.out_dir={out}", "job.resume=auto", "job.allow_environment_change=true"])
    assert got["status"] == "completed" and got["environment"]["threads"] == 2
    assert got["resumed_with_other_environment"]["differs"] == ["threads 1 -> 2"]
    assert got["resumed_with_other_environment"]["checkpoint"]["threads"] == 1


def test_a_resume_with_another_torch_version_is_refused(tmp_path, monkeypatch, capsys, one_thread):
    out = interrupted(tmp_path, monkeypatch, RUN)
    real = str(torch.__version__)
    monkeypatch.setattr(torch, "__version__", "2.99.0+cpu")
    assert main([*RUN, f"job.out_dir={out}", "job.resume=auto"]) == 2
    assert f"round 6 was written in another environment (torch {real} -> 2.99.0+cpu);" in _one_error_line(capsys)


def test_a_resume_on_other_cpu_kernels_is_refused(tmp_path, monkeypatch, capsys, one_thread):
    out = interrupted(tmp_path, monkeypatch, RUN)
    real = environment_mod.cpu_kernels()
    monkeypatch.setattr(environment_mod, "cpu_kernels", lambda: {**real, "capability": "DEFAULT"})
    assert main([*RUN, f"job.out_dir={out}", "job.resume=auto"]) == 2
    assert f"(cpu.capability {real['capability']} -> DEFAULT)" in _one_error_line(capsys)


def test_a_checkpoint_recorded_before_environments_resumes_with_a_warning(tmp_path, monkeypatch, caplog, one_thread):
    _, _, reference, _ = run_in_process([*RUN, f"job.out_dir={tmp_path / 'reference'}"])
    real = identity_mod.run_identity
    stop_at(monkeypatch, "hosfl", 5)
    unrecorded = lambda cfg: {k: v for k, v in real(cfg).items() if k != "environment"}  # noqa: E731
    monkeypatch.setattr(front_mod, "run_identity", unrecorded)
    with pytest.raises(Interrupted):
        run_in_process([*RUN, f"job.out_dir={tmp_path / 'run'}"])
    monkeypatch.undo()
    caplog.set_level(logging.WARNING, logger="hosfl_dist")
    _, _, got, _ = run_in_process([*RUN, f"job.out_dir={tmp_path / 'run'}", "job.resume=auto"])
    assert "round 6 records no environment (written before threads, library versions and CPU kernels" in caplog.text
    assert got["status"] == "completed" and got["resumed_with_unrecorded_environment"] is True
    assert got["client_digests"] == reference["client_digests"] and got["server_digest"] == reference["server_digest"]


def test_a_torchrun_worker_in_another_environment_is_recorded_and_refused_on_resume(tmp_path):
    """Under torchrun each worker sends its environment as it starts: one that differs from the server rank's is
    recorded beside it, and a worker that resumes in another one than it had is refused (or let through and noted)."""

    class Record:
        base: dict = {}

    server = environment_mod.environment_identity(load_config(None, TINY_OVERRIDES))
    worker_then, worker_now = {**server, "threads": 4}, {**server, "threads": 3}
    front = front_mod.RunFront.__new__(front_mod.RunFront)
    front.cfg = load_config(None, [*TINY_OVERRIDES, f"job.out_dir={tmp_path}"])
    front.identity, front.record = {"environment": dict(server)}, Record()
    front.recorded_environment, front.resumed_from = None, None
    front._worker_environment(1, worker_then)  # a run starting: recorded, nothing compared
    front._worker_environment(2, dict(server))
    assert front.identity["environment"]["workers"] == {"1": worker_then}
    front.recorded_environment = front.identity["environment"]
    front.resumed_from = tmp_path / "checkpoints" / "round-00000004"
    front.identity = {"environment": dict(server)}
    front._worker_environment(2, dict(server))  # as it was
    with pytest.raises(ConfigError, match=r"round 4 \(worker rank 1\) was written in another environment "
                                          r"\(threads 4 -> 3\)"):  # fmt: skip
        front._worker_environment(1, worker_now)
    more = server["threads"] + 1  # rank 2 had the server rank's environment, and now has another
    with pytest.raises(ConfigError, match=rf"\(worker rank 2\) .* \(threads {server['threads']} -> {more}\)"):
        front._worker_environment(2, {**server, "threads": more})
    front.cfg = load_config(None, [*TINY_OVERRIDES, f"job.out_dir={tmp_path}", "job.allow_environment_change=true"])
    front._worker_environment(1, worker_now)
    assert front.record.base["resumed_with_other_environment"]["workers"] == {"1": ["threads 4 -> 3"]}


def test_the_environment_names_what_selects_kernels_and_libraries_only_where_a_run_uses_them():
    vision = environment_mod.environment_identity(load_config(None, TINY_OVERRIDES))
    assert vision["threads"] == torch.get_num_threads() and vision["torch"] == torch.__version__
    assert vision["cpu"]["capability"] == torch.backends.cpu.get_cpu_capability()
    assert "transformers" not in vision and "cuda" not in vision  # a vision run on CPU does not run through them
    lm = environment_mod.environment_identity(load_config(None, ["model.name=hf", "model.source=tiny:llama"]))
    assert lm["transformers"] and lm["peft"]
    assert environment_mod.environment_differences(vision, {**vision, "threads": 7}) == [
        f"threads {vision['threads']} -> 7"
    ]
    flags = {**vision, "cpu": {**vision["cpu"], "flags": ["avx2"], "ONEDNN_MAX_CPU_ISA": "AVX2"}}
    assert environment_mod.environment_differences({**flags, "cpu": {**flags["cpu"], "flags": []}}, flags) == [
        "cpu.flags none -> avx2"
    ]
    # the environment decides the last bits, not what is computed: a study reuses a run from another machine
    assert identity_mod.fingerprint({"config": {}, "environment": vision}) == identity_mod.fingerprint({"config": {}})


def test_auto_threads_of_a_large_model_resume_with_the_checkpoints_not_the_load(tmp_path, monkeypatch, one_thread):
    """The load rule would pick other threads under another load, and the resume would be refused for it: a resume
    takes the threads its newest checkpoint records (a hint read from the manifest; the resume verifies it)."""
    from hosfl_dist.runtime.process.host import resumed_threads, set_threads

    out = interrupted(tmp_path, monkeypatch, RUN)
    cfg = load_config(None, [*RUN, f"job.out_dir={out}", "job.resume=auto"])
    assert resumed_threads(cfg) == 1  # what the interrupted run recorded
    assert resumed_threads(load_config(None, [*RUN, f"job.out_dir={out}"])) is None  # not a resume
    before = torch.get_num_threads()
    try:
        big = 20_000_000
        n, why = set_threads(cfg, big, environ={}, load=0.0, recorded=3)
        assert (n, torch.get_num_threads()) == (3, 3) and "its newest checkpoint was written with" in why
        assert set_threads(cfg, 1000, environ={}, load=0.0, recorded=3)[0] == 1  # a small model: one, as ever
        assert set_threads(cfg, big, environ={"OMP_NUM_THREADS": "2"}, load=0.0, recorded=3)[0] == 2  # as set
    finally:
        torch.set_num_threads(before)
    newest = checkpoint_folders(out)[0] / "manifest.json"  # a manifest that names no usable count is no hint
    manifest = json.loads(newest.read_text())
    manifest["identity"]["environment"]["threads"] = True
    newest.write_text(json.dumps(manifest))
    assert resumed_threads(cfg) is None
