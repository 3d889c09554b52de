"""Files that whoever can write a run's folder (or an export, or a data folder) may have replaced: nothing read back
runs code, and nothing forged is trusted (the hardening issue's parts 1 and 2, attacked one by one).

The attacker here can write every file of the folder and recompute every hash and digest, but does not hold the
user's key (tests/conftest.py points HOSFL_KEY_FILE at a key of the test session)."""

from __future__ import annotations

import json
import pickle
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny import TINY_OVERRIDES, run_in_process, stop_at

from hosfl_dist.errors import ConfigError, DataError
from hosfl_dist.export.cli import main as export_main
from hosfl_dist.run import main
from hosfl_dist.runfolder.checkpoints import checkpoint_folders, list_files, manifest_digest, verify_checkpoint
from hosfl_dist.runfolder.signing import MISMATCH, SIGNED, UNSIGNED, load_key, signature_state

RUN = [*TINY_OVERRIDES, "checkpoint.interval_samples=48", "checkpoint.keep=3"]
"""Ten rounds of K=3 clients of 8 samples, a checkpoint every second round."""


def _one_line(capsys) -> list[str]:
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    return err


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A run stopped after round 6 (checkpoints of rounds 2, 4, 6)."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    with pytest.MonkeyPatch.context() as mp:
        stop_at(mp, "hosfl", 5)
        with pytest.raises(Exception, match="SIGTERM"):
            run_in_process([*RUN, f"job.out_dir={out}"])
    assert [p.name for p in checkpoint_folders(out)] == ["round-00000006", "round-00000004", "round-00000002"]
    return out


@pytest.fixture(scope="module")
def completed(tmp_path_factory):
    out = tmp_path_factory.mktemp("completed") / "run"
    _, _, summary, _ = run_in_process([*RUN, f"job.out_dir={out}"])
    assert summary["status"] == "completed"
    return out


def copy_of(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out, symlinks=True)
    return out


def forge(ckpt: Path, edit=None, signature: str = "keep") -> None:
    """What an attacker without the key can do to a checkpoint's manifest: list the files as they are now, edit
    what it records, keep the old signature or strip it, and recompute the digest."""
    path = ckpt / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["files"] = list_files(ckpt)
    if edit is not None:
        edit(manifest)
    if signature == "strip":
        manifest.pop("signature", None)
    manifest["digest"] = manifest_digest(manifest)
    path.write_text(json.dumps(manifest, indent=1, sort_keys=True))


def newest(run: Path) -> Path:
    return checkpoint_folders(run)[0]


# -- the key ---------------------------------------------------------------------------------------------------------
def test_the_key_is_made_on_first_use_private_and_kept(tmp_path, monkeypatch):
    path = tmp_path / "config" / "hosfl_dist" / "key"
    monkeypatch.setenv("HOSFL_KEY_FILE", str(path))
    key = load_key()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(key.secret) == 32
    assert load_key() == key and key.id not in path.read_text() and "secret" not in repr(key)
    monkeypatch.delenv("HOSFL_KEY_FILE")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    load_key()
    assert (tmp_path / "xdg" / "hosfl_dist" / "key").is_file()  # the default place, under the user's config


def test_a_key_open_to_others_or_not_a_key_is_refused_in_one_line(tmp_path, monkeypatch):
    path = tmp_path / "key"
    monkeypatch.setenv("HOSFL_KEY_FILE", str(path))
    load_key()
    path.chmod(0o640)
    with pytest.raises(ConfigError, match=rf"is open to others \(mode 0640\): chmod 600 {path}"):
        load_key()
    path.write_text("not a key\n")
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="is not a key: expected 64 hex digits"):
        load_key()
    monkeypatch.setenv("HOSFL_KEY_FILE", "relative/key")
    with pytest.raises(ConfigError, match="HOSFL_KEY_FILE='relative/key' is not usable: expected an absolute"):
        load_key()


def test_a_key_inside_the_run_folder_is_refused(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    monkeypatch.setenv("HOSFL_KEY_FILE", str(out / "key"))
    assert main([*RUN, f"job.out_dir={out}"]) == 2
    assert _one_line(capsys)[-1].startswith(f"error: signing key {out / 'key'} (HOSFL_KEY_FILE) lies inside {out}")


def test_the_three_states_of_a_signature(completed, tmp_path, monkeypatch):
    manifest = json.loads((newest(completed) / "manifest.json").read_text())
    key = load_key()
    assert signature_state(manifest, key)[0] == SIGNED and verify_checkpoint(newest(completed)) is None
    assert signature_state({k: v for k, v in manifest.items() if k != "signature"}, key)[0] == UNSIGNED
    assert signature_state({**manifest, "round": 99}, key)[0] == MISMATCH
    monkeypatch.setenv("HOSFL_KEY_FILE", str(tmp_path / "other-key"))
    state, detail = signature_state(manifest, load_key())
    assert state == MISMATCH and detail.startswith(f"signed by another key ({key.id}, this one is ")


# -- a consistent forgery does not verify ------------------------------------------------------------------------------
def _lr(manifest: dict) -> None:
    manifest["identity"]["config"]["clients"]["optim"]["lr"] = 0.02


@pytest.mark.parametrize("signature", ["keep", "strip"])
def test_a_resume_with_a_forged_identity_is_refused(stopped, tmp_path, capsys, signature):
    """The recorded learning rate changed in every manifest and in config.yaml, every hash recomputed: the resume
    with the other rate is refused in one line, and nothing of the run is touched."""
    out = copy_of(stopped, tmp_path)
    for ckpt in checkpoint_folders(out):
        forge(ckpt, _lr, signature)
    (out / "config.yaml").write_text((out / "config.yaml").read_text().replace("lr: 0.01", "lr: 0.02", 1))
    assert verify_checkpoint(newest(out)) is None  # every file and the digest are consistent
    summary = (out / "summary.json").read_text()
    rc = main([*RUN, f"job.out_dir={out}", "job.resume=auto", "clients.optim.lr=0.02"])
    err = _one_line(capsys)[-1]
    assert rc == 2 and err.startswith(f"error: {newest(out)}: ")
    if signature == "keep":
        assert "signature mismatch (this key's id" in err and "HOSFL_KEY_FILE" in err
        rc = main([*RUN, f"job.out_dir={out}", "job.resume=auto", "clients.optim.lr=0.02", "job.allow_unsigned=true"])
        assert rc == 2 and "signature mismatch" in _one_line(capsys)[-1]  # a mismatch is never accepted
    else:
        assert "unsigned (its manifest carries no signature" in err and "job.allow_unsigned=true accepts it" in err
    assert (out / "summary.json").read_text() == summary and len(checkpoint_folders(out)) == 3


def test_an_unsigned_checkpoint_resumes_only_when_accepted_and_the_summary_says_so(stopped, tmp_path, capsys):
    out = copy_of(stopped, tmp_path)
    forge(newest(out), signature="strip")
    assert main([*RUN, f"job.out_dir={out}", "job.resume=auto"]) == 2
    assert "job.allow_unsigned=true accepts it" in _one_line(capsys)[-1]
    _, _, got, _ = run_in_process([*RUN, f"job.out_dir={out}", "job.resume=auto", "job.allow_unsigned=true"])
    assert got["status"] == "completed" and got["resumed_unsigned"].endswith("round-00000006")


def _scaled_weights(ckpt: Path) -> None:
    """The attacker's weights: the server's θc (HO-SFL's base replica, which the export replays) zeroed in state.pt."""
    state = torch.load(ckpt / "state.pt", weights_only=True)
    state["server"]["base"]["params"] = [torch.zeros_like(p) for p in state["server"]["base"]["params"]]
    torch.save(state, ckpt / "state.pt")


@pytest.mark.parametrize("signature", ["keep", "strip"])
def test_an_export_of_forged_weights_is_refused(completed, tmp_path, capsys, signature):
    out = copy_of(completed, tmp_path)
    _scaled_weights(newest(out))
    forge(newest(out), signature=signature)
    assert verify_checkpoint(newest(out)) is None
    rc = export_main([str(out), "--out", str(tmp_path / "exported")])
    err = _one_line(capsys)[-1]
    assert rc == 2 and err.startswith(f"error: checkpoint {newest(out)}: ")
    want = "signature mismatch" if signature == "keep" else "unsigned (its manifest carries no signature"
    assert want in err and not (tmp_path / "exported").exists()
    if signature == "strip":
        assert "--allow-unsigned accepts it" in err


# -- no pickle from disk ---------------------------------------------------------------------------------------------
class _Payload:
    """What a hostile state.pt carries: unpickling it calls open(marker, "w"), which creates the file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _hostile_state(ckpt: Path, marker: Path) -> None:
    state = torch.load(ckpt / "state.pt", weights_only=True)
    state["server"]["payload"] = _Payload(marker)
    torch.save(state, ckpt / "state.pt")


def test_a_state_pt_whose_pickle_would_create_a_file_never_runs(stopped, completed, tmp_path, capsys):
    marker = tmp_path / "PWNED"
    out = copy_of(stopped, tmp_path)
    _hostile_state(newest(out), marker)
    forge(newest(out), signature="strip")  # consistent, but the attacker cannot sign it
    assert main([*RUN, f"job.out_dir={out}", "job.resume=auto"]) == 2
    assert "unsigned" in _one_line(capsys)[-1] and not marker.exists()
    # accepted deliberately: still read without running code, and refused in one line
    assert main([*RUN, f"job.out_dir={out}", "job.resume=auto", "job.allow_unsigned=true"]) == 2
    err = _one_line(capsys)[-1]
    assert err.startswith(f"error: checkpoint {newest(out)}: state.pt is not plain data this version wrote, "
                          "refused unread (") and not marker.exists()  # fmt: skip
    run = tmp_path / "done"
    shutil.copytree(completed, run, symlinks=True)
    _hostile_state(newest(run), marker)
    forge(newest(run), signature="strip")
    assert export_main([str(run), "--out", str(tmp_path / "exported"), "--allow-unsigned"]) == 2
    assert "state.pt is not plain data" in _one_line(capsys)[-1] and not marker.exists()
    # the payload is live: the unrestricted read this version no longer does would have created the file
    torch.load(newest(run) / "state.pt", weights_only=False)
    assert marker.exists()


def test_a_dcp_metadata_whose_pickle_would_create_a_file_never_runs(stopped, tmp_path, capsys):
    """torch's DCP reader unpickles model/.metadata unrestricted; the runtime reads it admitting DCP's records only."""
    from torch.distributed.checkpoint import FileSystemReader

    marker = tmp_path / "PWNED"
    out = copy_of(stopped, tmp_path)
    metadata = FileSystemReader(str(newest(out) / "model")).read_metadata()
    metadata.planner_data = _Payload(marker)
    (newest(out) / "model" / ".metadata").write_bytes(pickle.dumps(metadata))
    forge(newest(out), signature="strip")
    assert main([*RUN, f"job.out_dir={out}", "job.resume=auto", "job.allow_unsigned=true"]) == 2
    err = _one_line(capsys)[-1]
    assert err.startswith(f"error: checkpoint {newest(out)}: model/ is not plain data this version wrote, refused "
                          "unread (model/.metadata asks for ") and not marker.exists()  # fmt: skip


def test_state_pt_holds_plain_data_only():
    from hosfl_dist.runtime.plain import check_plain

    check_plain({"a": [torch.zeros(2), (1, 2.0, "x", None, True)], 3: {"b": b"bytes"}})
    with pytest.raises(TypeError, match=r"state.server.n: a numpy.int64, which state.pt does not hold"):
        check_plain({"server": {"n": np.int64(3)}})
    with pytest.raises(TypeError, match=r"state\[0\]: a .*_Payload"):
        check_plain([_Payload(Path("x"))])


def test_a_checkpoint_of_the_earlier_format_is_refused_in_one_line(stopped, completed, tmp_path, capsys):
    out = copy_of(stopped, tmp_path)
    for ckpt in checkpoint_folders(out):
        forge(ckpt, lambda m: m.update(format=1), signature="strip")  # what the earlier version wrote
    assert main([*RUN, f"job.out_dir={out}", "job.resume=auto"]) == 2
    err = _one_line(capsys)[-1]
    assert err.startswith(f"error: job.out_dir {out}: no checkpoint verifies (round 6: written by an earlier version (")
    assert "in checkpoint format 1, whose state.pt is a pickle this version does not run" in err
    run = tmp_path / "done"
    shutil.copytree(completed, run, symlinks=True)
    forge(newest(run), lambda m: m.update(format=1), signature="strip")
    assert export_main([str(run), "--out", str(tmp_path / "exported"), "--allow-unsigned"]) == 2
    assert "failed verification (written by an earlier version" in _one_line(capsys)[-1]


# -- exports verify their own files ----------------------------------------------------------------------------------
def test_an_export_is_signed_and_predict_and_load_vision_verify_it(completed, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from hosfl_dist.cli.predict import main as predict_main
    from hosfl_dist.export import ExportError, load_vision
    from hosfl_dist.runfolder.exported import EXPORT_MANIFEST

    exported = tmp_path / "exported"
    assert export_main([str(completed), "--out", str(exported)]) == 0
    load_vision(exported)
    weights = exported / "model.safetensors"
    save_file({k: torch.zeros_like(v) for k, v in load_file(str(weights)).items()}, str(weights))
    manifest = json.loads((exported / EXPORT_MANIFEST).read_text())
    manifest["files"] = list_files(exported, (EXPORT_MANIFEST,))  # recomputed, as the attacker can
    manifest["digest"] = manifest_digest(manifest)
    (exported / EXPORT_MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match="signature mismatch"):
        load_vision(exported)
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "x"}\n')
    assert predict_main(["--model", str(exported), "--data", str(data), "--out", str(tmp_path / "p.jsonl")]) == 2
    assert "signature mismatch" in _one_line(capsys)[-1]
    (exported / EXPORT_MANIFEST).unlink()
    with pytest.raises(ExportError, match=r"unsigned \(no hosfl_manifest.json.*\(allow_unsigned=True reads it"):
        load_vision(exported)
    load_vision(exported, allow_unsigned=True)  # accepted deliberately
    again = tmp_path / "again"
    assert export_main([str(completed), "--out", str(again)]) == 0
    (again / "pytorch_model.bin").write_bytes(b"anything")
    with pytest.raises(ExportError, match=r"holds files its hosfl_manifest.json does not list \(pytorch_model.bin\)"):
        load_vision(again)


# -- data files in pickle format -------------------------------------------------------------------------------------
def test_a_cifar_batch_is_read_without_running_code(tmp_path):
    from hosfl_dist.data.vision import _unpickle

    rng = np.random.default_rng(0)
    batch = {"data": rng.integers(0, 256, (4, 3072), dtype=np.uint8), "labels": [1, 2, 3, 4], "batch_label": "b"}
    for protocol in (2, 4, 5):
        (tmp_path / "b").write_bytes(pickle.dumps(batch, protocol=protocol))
        got = _unpickle(tmp_path / "b")
        assert np.array_equal(got["data"], batch["data"]) and got["labels"] == batch["labels"]
    # the published files name numpy 1's modules (numpy.core), pickled by Python 2 with protocol 2
    old = pickle.dumps(batch, protocol=2).replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    (tmp_path / "b").write_bytes(old)
    assert np.array_equal(_unpickle(tmp_path / "b")["data"], batch["data"])
    marker = tmp_path / "PWNED"
    (tmp_path / "b").write_bytes(pickle.dumps({"data": _Payload(marker), "labels": [1]}, protocol=2))
    with pytest.raises(DataError, match=r"cannot be read as a CIFAR batch \(it asks for (io|builtins).open, which a"):
        _unpickle(tmp_path / "b")
    assert not marker.exists()


# -- what a command writes or reads is a regular file of ours (issue 46) --------------------------------------------
def _within(seconds: float, call):
    """``call()``'s result, or a failure when it has not returned within ``seconds`` (an open of a FIFO that waits
    for a writer): the test never hangs."""
    import threading

    done = {}
    thread = threading.Thread(target=lambda: done.setdefault("value", _catch(call)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s (an open that blocks)"
    value = done["value"]
    if isinstance(value, BaseException):
        raise value
    return value


def _catch(call):
    try:
        return call()
    except BaseException as exc:  # noqa: BLE001 - handed back to the test's thread
        return exc


def _release(fifo: Path) -> None:
    """Open ``fifo`` at both ends and close it: a reader or a writer that blocked on it returns."""
    import contextlib
    import os

    for mode in (os.O_RDONLY, os.O_WRONLY):
        with contextlib.suppress(OSError):  # no one waits at the other end: nothing to release
            os.close(os.open(fifo, mode | os.O_NONBLOCK))


def test_predict_never_replaces_what_is_not_a_regular_file_of_ours(tmp_path, capsys):
    import os

    from hosfl_dist.cli import predict

    model, data, export = tmp_path / "model", tmp_path / "data.jsonl", tmp_path / "other_export"
    model.mkdir()
    export.mkdir()
    (export / "hosfl_export.json").write_text("{}")
    data.write_text('{"text": "a", "label": 0}\n')
    fifo, folder, outside = tmp_path / "preds.fifo", tmp_path / "a_folder", tmp_path / "elsewhere"
    os.mkfifo(fifo)
    folder.mkdir()
    (outside / "sub").mkdir(parents=True)
    link = tmp_path / "out" / "preds.jsonl"
    link.parent.mkdir()
    link.symlink_to(outside / "sub" / "preds.jsonl")
    said = {
        fifo: f"error: --out {fifo} exists and is a FIFO, not a regular file",
        folder: f"error: --out {folder} exists and is a folder, not a regular file",
        link: f"error: --out {link} is a symlink to {outside / 'sub' / 'preds.jsonl'}, outside its folder",
        export / "preds.jsonl": f"error: --out {export / 'preds.jsonl'} lies inside the model folder {export} (it "
        "holds hosfl_export.json)",
    }
    if Path("/dev/full").exists():  # the report's case (as root it was replaced by a file); the stand-in model
        said[Path("/dev/full")] = "error: --out /dev/full exists and is a device, not a regular file"  # stops any write
    for out, line in said.items():
        assert predict.main(["--model", str(model), "--data", str(data), "--out", str(out)]) == 2
        err = _one_line(capsys)
        assert len(err) == 1 and err[0].startswith(line), err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and folder.is_dir() and link.is_symlink()
    assert sorted(p.name for p in export.iterdir()) == ["hosfl_export.json"]
    assert not (outside / "sub" / "preds.jsonl").exists()

    feed = tmp_path / "data.jsonl.fifo"  # an input that is a FIFO: refused without waiting for a writer
    os.mkfifo(feed)
    argv = ["--model", str(model), "--data", str(feed), "--out", str(tmp_path / "p.jsonl")]
    try:
        assert _within(20, lambda: predict.main(argv)) == 2
    finally:
        _release(feed)
    assert _one_line(capsys) == [f"error: --data {feed} is a FIFO, not a regular file"]
    with pytest.raises(DataError, match="data file /dev/zero is a device, not a regular file"):
        from hosfl_dist.data.text import read_local_rows

        read_local_rows("/dev/zero")


def test_a_signing_key_that_is_a_fifo_is_refused_without_waiting(tmp_path, monkeypatch):
    import os

    fifo = tmp_path / "key"
    os.mkfifo(fifo, 0o600)
    monkeypatch.setenv("HOSFL_KEY_FILE", str(fifo))
    try:
        with pytest.raises(ConfigError, match=f"signing key {fifo} \\(HOSFL_KEY_FILE\\) is not a file"):
            _within(20, load_key)
    finally:
        _release(fifo)


def test_export_study_and_run_folders_refuse_what_is_not_ours(completed, tmp_path, capsys):
    import argparse
    import os

    from hosfl_dist.experiments.cli import free_out

    export = tmp_path / "export"
    export.mkdir()
    (export / "hosfl_export.json").write_text("{}")
    assert export_main([str(completed), "--out", str(export / "inner")]) == 2
    assert _one_line(capsys) == [f"error: --out {export / 'inner'} lies inside the model folder {export} (it holds "
                                 "hosfl_export.json): write it elsewhere"]  # fmt: skip
    assert sorted(p.name for p in export.iterdir()) == ["hosfl_export.json"]

    study = tmp_path / "study"
    study.mkdir()
    os.mkfifo(study / "table.md")
    with pytest.raises(ConfigError, match=r"--out .*study: its entry table.md is a FIFO, not a regular file"):
        free_out(argparse.Namespace(out=str(study)))
    (study / "table.md").unlink()
    (study / "study.json").symlink_to("/dev/null")
    with pytest.raises(ConfigError, match=r"its entry .*study.json is a symlink to /dev/null, outside its folder"):
        free_out(argparse.Namespace(out=str(study)))

    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "metrics.jsonl")
    assert main([*RUN, f"job.out_dir={run}", "--check"]) == 2
    assert _one_line(capsys)[-1] == (f"error: job.out_dir {run}: its entry metrics.jsonl is a FIFO, not a regular file "
                                     "(a file written there would replace it); remove it or choose another folder")
    assert stat.S_ISFIFO(os.lstat(run / "metrics.jsonl").st_mode)


def test_a_checkpoint_copied_in_from_a_run_ahead_is_refused_and_leaves_no_gap(stopped, completed, tmp_path, capsys):
    """The completed twin's final checkpoint (round 10) copied into the run stopped at round 6, whose metrics.jsonl
    holds the rows up to round 6: resumed, the rows of the evaluation at 240 samples would be missing. Refused in
    one line; the folder's record is as it was; without the copy, the run resumes and finishes."""
    out = copy_of(stopped, tmp_path)
    ahead = newest(completed)
    shutil.copytree(ahead, out / "checkpoints" / ahead.name)
    metrics, summary = (out / "metrics.jsonl").read_text(), (out / "summary.json").read_text()
    assert main([*RUN, f"job.out_dir={out}", "job.resume=auto"]) == 2
    err = _one_line(capsys)[-1]
    assert err.startswith(f"error: checkpoint {out / 'checkpoints' / ahead.name} cannot be resumed: metrics.jsonl "
                          "holds rows up to round 5 (120 samples) and lacks the evaluation at 240 samples"), err
    assert "remove it (job.resume=auto then takes the newest one before it)" in err
    assert (out / "metrics.jsonl").read_text() == metrics and (out / "summary.json").read_text() == summary
    shutil.rmtree(out / "checkpoints" / ahead.name)
    _, _, got, rows = run_in_process([*RUN, f"job.out_dir={out}", "job.resume=auto"])
    assert got["status"] == "completed" and got["resumed_from"].endswith("round-00000006")
    assert [r["processed_samples"] for r in rows if r["processed_samples"] in (0, 120, 240)] == [0, 120, 240]


def test_a_jsonl_is_read_line_by_line_up_to_the_examples_asked_for_and_a_huge_line_is_one_line(tmp_path):
    """--max-examples 3 reads three lines, never the 17 MiB line after them; read in full, that line is refused in one
    line naming the file and the line (a 2 GB line was a MemoryError)."""
    from hosfl_dist.cli.predict import load_examples
    from hosfl_dist.data.text import MAX_LINE_BYTES, custom_task, read_local_rows

    path = tmp_path / "big.jsonl"
    with open(path, "wb") as fh:
        for i in range(3):
            fh.write(json.dumps({"text": f"example {i}", "label": i % 2}).encode() + b"\n")
        fh.write(b'{"text": "' + b"x" * (MAX_LINE_BYTES + (1 << 20)) + b'", "label": 0}\n')
        fh.write(json.dumps({"text": "after", "label": 1}).encode() + b"\n")
    spec = custom_task("classification", "{text} It was", [" bad", " good"])
    examples, has_gold = load_examples(spec, path, {}, 3)
    assert [e["text"] for e in examples] == ["example 0", "example 1", "example 2"] and has_gold
    assert [r["label"] for r in read_local_rows(str(path), 2)] == [0, 1]
    with pytest.raises(DataError, match=rf"^cannot read {path}: line 4 is longer than 16 MiB \(one example a line\)$"):
        read_local_rows(str(path))


# -- join.json of an elastic run is input (issue 45) ----------------------------------------------------------------
GOOD_JOIN = {"host": "127.0.0.1", "port": 29400, "token": "ab" * 32, "pid": 1, "node": "elsewhere"}


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ({**GOOD_JOIN, "port": 70000}, "its port is 70000 (expected an integer in 1..65535)"),
        ({**GOOD_JOIN, "port": "29400"}, "its port is '29400' (expected an integer in 1..65535)"),
        ({**GOOD_JOIN, "port": True}, "its port is True (expected an integer in 1..65535)"),
        ({**GOOD_JOIN, "host": ["a"]}, "its host is ['a'] (expected a host name or address)"),
        ({**GOOD_JOIN, "host": "a\nb"}, "its host is 'a\\nb' (expected a host name or address)"),
        ({**GOOD_JOIN, "token": 7}, "its token is 7 (expected the run's token, text)"),
        ({**GOOD_JOIN, "pid": "1"}, "its pid is '1' (expected a process id)"),
        ([GOOD_JOIN], "is not a join file of this version"),
        ("{" * 100_000, "larger than 64 KiB"),
        ('{"host": ' + "[" * 5000 + "]" * 5000 + "}", "cannot be read"),
    ],
    ids=["port-range", "port-text", "port-bool", "host-list", "host-newline", "token-int", "pid-text", "a-list",
         "too-big", "deep"],  # fmt: skip
)
def test_a_join_file_that_is_not_one_is_refused_in_one_line(tmp_path, content, said):
    from hosfl_dist.runtime.process.join_file import read_join

    (tmp_path / "config.yaml").write_text("{}\n")
    (tmp_path / "join.json").write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ConfigError) as exc:
        read_join(tmp_path)
    assert said in str(exc.value) and "\n" not in str(exc.value) and "join.json" in str(exc.value)


def test_a_record_file_is_written_whole_and_never_through_what_was_planted_beside_it(tmp_path):
    """summary.json, workers.json, a manifest, join.json: each is written into <name>.tmp, created anew, and renamed
    over it. A link planted at the temporary name leaves the file it points to as it was; a FIFO there does not
    block; a write that fails leaves the old file and nothing beside it."""
    import os

    from hosfl_dist.safe_files import replace_file

    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own file\n")
    target = tmp_path / "summary.json"
    (tmp_path / "summary.json.tmp").symlink_to(victim)
    replace_file(target, '{"status": "running"}\n')
    assert victim.read_text() == "the user's own file\n" and target.read_text() == '{"status": "running"}\n'
    os.mkfifo(tmp_path / "summary.json.tmp")
    replace_file(target, '{"status": "completed"}\n')
    assert target.read_text() == '{"status": "completed"}\n' and not target.is_symlink()
    with pytest.raises(TypeError):
        replace_file(target, None)  # type: ignore[arg-type]  # the write fails after the file was created
    assert target.read_text() == '{"status": "completed"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json", "victim.txt"]


def test_the_join_file_replaces_what_was_planted_at_its_name_and_follows_no_link(tmp_path):
    """The server writes join.json whole and renames it into place: a link planted there to a file of the user's
    leaves that file as it was, a FIFO there does not block the server; the file is its owner's alone."""
    import os
    import threading

    from hosfl_dist.runtime.process.join_file import read_join, write_join

    (tmp_path / "config.yaml").write_text("job:\n  name: planted\n")
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own file\n")
    (tmp_path / "join.json").symlink_to(victim)
    path = write_join(tmp_path, "127.0.0.1", 29600, "t" * 64)
    assert victim.read_text() == "the user's own file\n" and not path.is_symlink()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_join(tmp_path)[0]["port"] == 29600
    path.unlink()
    os.mkfifo(tmp_path / "join.json")
    thread = threading.Thread(target=write_join, args=(tmp_path, "127.0.0.1", 29601, "u" * 64), daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and read_join(tmp_path)[0]["port"] == 29601
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "join.json", "victim.txt"]


def test_a_join_file_that_is_a_device_or_a_fifo_is_one_line_at_once(tmp_path):
    """``--join`` on a folder whose join.json links to /dev/zero, or is a FIFO no one writes: exit code 2 and one
    line, as a command, not a read that never ends."""
    import os
    import subprocess
    import sys

    (tmp_path / "config.yaml").write_text("{}\n")
    (tmp_path / "join.json").symlink_to("/dev/zero")
    fifo = tmp_path / "fifo_run"
    fifo.mkdir()
    (fifo / "config.yaml").write_text("{}\n")
    os.mkfifo(fifo / "join.json")
    for folder, kind in ((tmp_path, "a device"), (fifo, "a FIFO")):
        try:
            done = subprocess.run([sys.executable, "-m", "hosfl_dist.run", "--join", str(folder)], capture_output=True,
                                  text=True, timeout=120)  # fmt: skip
        finally:
            _release(fifo / "join.json")
        err = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(err) == 1, done.stderr[-2000:]
        assert err[0] == f"error: invalid value for --join: {folder / 'join.json'} is {kind}, not a regular file"


def test_the_curves_and_a_centralised_reference_refuse_what_is_not_ours(completed, tmp_path, capsys):
    import os

    from hosfl_dist.centralized.lora import own_result_or_none
    from hosfl_dist.errors import HosflError
    from hosfl_dist.experiments.report import main as report_main

    fifo = tmp_path / "curves.png"
    os.mkfifo(fifo)
    try:  # savefig would wait on it for a reader
        assert _within(60, lambda: report_main([str(completed), "--out", str(fifo)])) == 2
    finally:
        _release(fifo)
    assert _one_line(capsys)[-1] == f"error: --out {fifo} exists and is a FIFO, not a regular file: it would be " \
        "replaced; name a new file or a file of yours"  # fmt: skip
    reference = tmp_path / "reference"
    reference.mkdir()
    os.mkfifo(reference / "metrics.jsonl")
    with pytest.raises(HosflError, match="job.out_dir .*reference: its entry metrics.jsonl is a FIFO"):
        own_result_or_none(reference)
