"""Surviving faults in one process: run records, exact resume after a stop, atomic checkpoints, the guarded server,
and bad input turned into one line (the torchrun side is in test_distributed.py)."""

from __future__ import annotations

import gzip
import json
import logging
import warnings
from pathlib import Path

import pytest
import torch

from hosfl_dist.algorithms import get_algorithm
from hosfl_dist.algorithms.hosfl import HOSFLServer
from hosfl_dist.config import load_config
from hosfl_dist.errors import ConfigError, DataError, Interrupted, NonFiniteError, ProtocolError
from hosfl_dist.models import build_split_model
from hosfl_dist.run import main
from hosfl_dist.runtime import checkpoint as ckpt_mod
from hosfl_dist.runfolder.checkpoints import latest_checkpoint
from hosfl_dist.runtime.record.writer import finite_json, strict_dumps
from hosfl_dist.runtime.server_group import local_endpoint
from tiny import TINY_OVERRIDES, rows_of, run_in_process, server_of, stop_at

SMALL = [*TINY_OVERRIDES, "data.train_max_samples=240", "train.budget_samples=360", "checkpoint.interval_samples=120"]
"""Three rounds of every method (40 samples per client, one local epoch of 5 steps for the baselines)."""


# -- run records -----------------------------------------------------------------------------------------------------
def test_summary_is_running_from_the_start_and_completed_at_the_end(tmp_path, monkeypatch):
    seen = []
    real = get_algorithm("hosfl").worker.run_round

    def run_round(self, t):
        seen.append(json.loads((tmp_path / "run" / "summary.json").read_text())["status"])
        return real(self, t)

    monkeypatch.setattr(get_algorithm("hosfl").worker, "run_round", run_round)
    _, _, summary, _ = run_in_process([*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'run'}"])
    assert set(seen) == {"running"} and summary["status"] == "completed"


def test_records_are_strict_json():
    clean, bad = finite_json({"a": float("nan"), "b": [1.0, float("inf")], "c": {"d": -float("inf")}, "e": 2})
    assert clean == {"a": None, "b": [1.0, None], "c": {"d": None}, "e": 2} and bad == ["a", "b[1]", "c.d"]
    text = strict_dumps({"eval_loss": float("nan"), "round": 3})
    assert json.loads(text) == {"eval_loss": None, "round": 3, "nonfinite": ["eval_loss"]} and "NaN" not in text


def test_a_folder_holding_a_run_is_refused_unless_resumed_or_overwritten(tmp_path):
    out = f"job.out_dir={tmp_path / 'run'}"
    run_in_process([*TINY_OVERRIDES, out])
    with pytest.raises(ConfigError, match=r"holds a run \(status: completed\); set job.resume=auto .* job.overwrite"):
        run_in_process([*TINY_OVERRIDES, out])
    with pytest.raises(ConfigError, match=r"holds a different run \(its config differs in zo.num_perturbations\)"):
        run_in_process([*TINY_OVERRIDES, out, "zo.num_perturbations=4", "job.resume=auto"])
    _, _, summary, _ = run_in_process([*TINY_OVERRIDES, out, "zo.num_perturbations=4", "job.overwrite=true"])
    # the replaced run's files and checkpoints are gone; what is left is the new run's final checkpoint
    assert summary["status"] == "completed" and summary["rounds"] == 10
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["round-00000010"]


@pytest.mark.parametrize(
    ("out_dir", "needle"),
    [("{file}", "is a file, not a folder"), ("{file}/sub", "lies under a file"), ("/proc/hosfl", "cannot be created")],
)
def test_an_unusable_out_dir_is_one_line(tmp_path, capsys, out_dir, needle):
    (tmp_path / "f").write_text("")
    rc = main([*TINY_OVERRIDES, f"job.out_dir={out_dir.format(file=tmp_path / 'f')}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and needle in err[0]


# -- exact resume --------------------------------------------------------------------------------------------------
def test_a_stop_signal_in_the_last_round_lets_the_run_complete(tmp_path, monkeypatch):
    """The budget is reached in the round the signal came in: the run ends as it would have (completed, the same
    results), not as an interruption that a requeue would have to finish."""
    _, _, ref, _ = run_in_process([*SMALL, f"job.out_dir={tmp_path / 'ref'}"])
    stop_at(monkeypatch, "hosfl", ref["rounds"] - 1)
    _, _, got, _ = run_in_process([*SMALL, f"job.out_dir={tmp_path / 'run'}"])
    assert got["status"] == "completed" and got["client_digests"] == ref["client_digests"]
    assert rows_of(tmp_path / "run") == rows_of(tmp_path / "ref")


@pytest.mark.parametrize(
    ("alg", "extra"),
    [
        ("hosfl", []),
        ("hosfl", ["clients.replicas=shared", "zo.overlap=true"]),
        ("hosfl", ["clients.optim.schedule=cosine", "clients.optim.warmup_rounds=2", "server.optim.schedule=linear"]),
        ("sfl", []),
        ("fsl_sage", ["algorithm.server_update_interval=2"]),
        ("zo_sfl", []),
        ("mu_splitfed", []),
        # clients dropping at both stages, late ones, skipped rounds (docs/participation.md)
        (
            "hosfl",
            ["clients.dropout=0.3", "clients.dropout_stage=mixed", "clients.over_select=0.5", "server.min_clients=2"],
        ),
        (
            "fsl_sage",
            ["clients.dropout=0.3", "clients.dropout_stage=mixed", "clients.over_select=0.5", "server.min_clients=2"],
        ),
        # frozen parameters (BatchNorm's affine ones), which checkpoints leave out, and running statistics that
        # training updates (freeze_bn=client): five rounds, evaluated every second
        *[
            pytest.param(
                "hosfl",
                [
                    "model.name=resnet18",
                    f"model.freeze_bn={bn}",
                    "train.budget_samples=120",
                    "train.eval_every_samples=48",
                ],
                marks=pytest.mark.slow,
            )  # ~30 s each
            for bn in ("all", "client")
        ],  # fmt: skip
        # a first-order client's running statistics, which travel and are averaged with θc (freeze_bn=code)
        pytest.param("sfl", ["model.name=resnet18", "model.freeze_bn=code"], marks=pytest.mark.slow),
    ],
)
def test_resume_after_a_stop_is_bit_identical(tmp_path, monkeypatch, alg, extra):
    """SIGTERM mid-run: the runtime checkpoints at the next round boundary and records the run as interrupted; the
    same command with job.resume=auto finishes it with the uninterrupted run's rows, digests and traffic."""
    cfg = [*SMALL, f"algorithm.name={alg}", *extra]
    _, _, ref, _ = run_in_process([*cfg, f"job.out_dir={tmp_path / 'ref'}"])
    out = tmp_path / "run"
    stop_at(monkeypatch, alg, 1)
    with pytest.raises(Interrupted, match=r"SIGTERM after round 2; checkpoint .*round-00000002"):
        run_in_process([*cfg, f"job.out_dir={out}"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["checkpoint"].endswith("round-00000002")
    monkeypatch.undo()
    _, _, got, _ = run_in_process([*cfg, f"job.out_dir={out}", "job.resume=auto"])
    assert rows_of(out) == rows_of(tmp_path / "ref")
    assert got["client_digests"] == ref["client_digests"] and got["server_digest"] == ref["server_digest"]
    assert got["comm"] == ref["comm"] and got["resumed_from"].endswith("round-00000002")
    log = "participation.jsonl"  # the rounds before the checkpoint written again, the later ones once
    assert (out / log).read_text() == (tmp_path / "ref" / log).read_text()
    assert got["participation"] == ref["participation"]


def test_a_checkpoint_without_frozen_parameters_restores_the_server(tmp_path):
    """Checkpoints leave frozen parameters out (they come from the model's source): loading one fills every other
    tensor — trainable ones, running statistics, optimizer state — and leaves the frozen ones as built."""
    cfg = load_config(None, [*SMALL, "model.name=resnet18", "model.freeze_bn=client"])
    spec = get_algorithm("hosfl")
    info = {"num_classes": 4, "input_shape": (1, 8, 8)}
    build = lambda: server_of(cfg, build_split_model(cfg, info, True), spec.server)  # noqa: E731
    saved = build()
    for p in saved.model.parameters():
        p.grad = torch.randn_like(p) if p.requires_grad else None
    saved.opt.step()
    for m in saved.model.modules():  # statistics a training round would have moved
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.add_(1.0)
    path = ckpt_mod.CheckpointStore(tmp_path, 2).save(saved, ckpt_mod.LoopState(3, 72), {}, {})
    from torch.distributed.checkpoint import FileSystemReader

    stored = set(FileSystemReader(str(path / "model")).read_metadata().state_dict_metadata)
    frozen = [n for n, p in saved.model.named_parameters() if not p.requires_grad]
    assert frozen and not {f"model.{n}" for n in frozen} & stored  # BatchNorm's γ, β are not in the checkpoint
    loaded = build()
    ckpt_mod.CheckpointStore(tmp_path, 2).load(loaded, path)
    want, got = saved.model.state_dict(), loaded.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    a, b = saved.opt.state_dict()["state"], loaded.opt.state_dict()["state"]
    assert a.keys() == b.keys() and all(torch.equal(a[i][k], b[i][k]) for i in a for k in a[i])


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_usable(tmp_path, monkeypatch):
    cfg = [*SMALL, "checkpoint.interval_samples=24"]
    _, _, ref, _ = run_in_process([*cfg, f"job.out_dir={tmp_path / 'ref'}"])
    real, saves = ckpt_mod.commit, []

    def die_before_the_rename(partial, final):  # the process dies while saving the second checkpoint
        saves.append(final)
        if len(saves) == 2:
            raise KeyboardInterrupt("killed during the save")
        return real(partial, final)

    monkeypatch.setattr(ckpt_mod, "commit", die_before_the_rename)
    with pytest.raises(KeyboardInterrupt):
        run_in_process([*cfg, f"job.out_dir={tmp_path / 'run'}"])
    monkeypatch.undo()
    folder = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["round-00000001", "round-00000002.partial"]
    assert latest_checkpoint(tmp_path / "run").name == "round-00000001"
    _, _, got, _ = run_in_process([*cfg, f"job.out_dir={tmp_path / 'run'}", "job.resume=auto"])
    assert got["client_digests"] == ref["client_digests"] and rows_of(tmp_path / "run") == rows_of(tmp_path / "ref")
    assert not any(p.name.endswith(".partial") for p in folder.iterdir()) and len(list(folder.iterdir())) == 2


# -- the guarded server --------------------------------------------------------------------------------------------
def poison(monkeypatch, client: int, round_idx: int) -> None:
    """Client ``client`` uploads a NaN activation in round ``round_idx``."""
    worker_cls = get_algorithm("hosfl").worker
    real_forward, real_round, now = worker_cls.client_forward, worker_cls.run_round, {}

    def run_round(self, t):
        now["t"] = t
        return real_round(self, t)

    def client_forward(self, x, forward=None):
        act = real_forward(self, x, forward)
        if now.get("t") == round_idx and now.get("x") is x:  # the batch the client drew, whenever it goes forward
            act["z"] = act["z"].clone().fill_(float("nan"))
        return act

    monkeypatch.setattr(worker_cls, "run_round", run_round)
    monkeypatch.setattr(worker_cls, "client_forward", client_forward)
    from hosfl_dist.data import FederatedData

    real_batch = FederatedData.next_batch

    def next_batch(self, m):
        x, y = real_batch(self, m)
        if m == client:
            now["x"] = x
        return x, y

    monkeypatch.setattr(FederatedData, "next_batch", next_batch)


def test_a_nonfinite_activation_stops_the_run_naming_round_client_and_quantity(tmp_path, monkeypatch):
    poison(monkeypatch, client=3, round_idx=0)  # S_0 = [1, 3, 4]
    with pytest.raises(NonFiniteError, match=r"round 0: non-finite activation z of client 3"):
        run_in_process([*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'run'}"])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "non-finite activation z of client 3" in summary["error"]


def test_a_skipped_client_is_left_out_of_the_round_and_counted(tmp_path, monkeypatch):
    poison(monkeypatch, client=3, round_idx=0)
    _, _, summary, rows = run_in_process([*TINY_OVERRIDES, "train.on_nonfinite=skip", f"job.out_dir={tmp_path / 'r'}"])
    assert summary["status"] == "completed" and [r["nonfinite_skipped"] for r in rows] == [0, 1, 0]
    assert rows[-1]["eval_accuracy"] > 0.5 and "nonfinite" not in rows[-1]  # the NaN never reached θs or θc


def test_divergence_stops_the_run_instead_of_completing(tmp_path):
    rc = main([*TINY_OVERRIDES, "server.optim.lr=1e6", "server.optim.name=sgd", f"job.out_dir={tmp_path / 'run'}"])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert rc == 1 and summary["status"] == "failed" and "non-finite" in summary["error"]
    json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])  # strict JSON, no NaN


@pytest.fixture
def endpoint():
    cfg = load_config(None, TINY_OVERRIDES)
    server = server_of(cfg, build_split_model(cfg, {"num_classes": 4, "input_shape": (1, 8, 8)}, True), HOSFLServer)
    return server, local_endpoint(server)


def call(endpoint, method, **kwargs):
    return endpoint[1].serve(method, kwargs).wait()


def test_the_server_refuses_rogue_calls(endpoint):
    server, _ = endpoint
    z = torch.zeros(8, 4, 4, 4)
    y = torch.zeros(8, dtype=torch.long)
    with pytest.raises(ProtocolError, match=r"round 0: sync from client 0, which is not sampled \(S_t = \[1, 3, 4\]\)"):
        call(endpoint, "sync", t=0, client=0, since=0)
    with pytest.raises(ProtocolError, match="unknown client 77"):
        call(endpoint, "eval_sync", t=0, since=0, client=77)
    futs = [endpoint[1].serve("submit", {"t": 0, "client": m, "act": {"z": z}, "labels": y}) for m in (1, 3)]
    bad = endpoint[1].serve("submit", {"t": 0, "client": 4, "act": {"z": z[:, :2]}, "labels": y})
    for f in [*futs, bad]:
        with pytest.raises(ProtocolError, match=r"client 4 sent z of shape \(8, 2, 4, 4\), expected \(B, 4, 4, 4\)"):
            f.wait()
    with pytest.raises(ProtocolError, match="labels outside 0..3"):
        server.admit(0, 1, {"z": z}, torch.full((8,), 9))
    server.rounds_done = 1
    with pytest.raises(NonFiniteError, match="round 0: the aggregated scalars v̄ are not finite"):
        call(endpoint, "finish_round", t=0, scalars=torch.full((3,), float("nan")))
    with pytest.raises(ProtocolError, match=r"v̄ of shape \(5,\), expected \(3,\)"):
        call(endpoint, "finish_round", t=0, scalars=torch.zeros(5))
    with pytest.raises(ProtocolError, match="finish_round for round 7"):
        call(endpoint, "finish_round", t=7, scalars=torch.zeros(3))


def test_a_forged_final_report_does_not_pass_the_audit(tmp_path):
    from tiny import runner

    r = runner([*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'run'}"])
    r.run()
    digest, rounds = r.worker.client_digest(), r.trainer.round
    assert r.server.audit(rounds, {"worker_0": digest}) is None
    assert "client digests {'worker_1': 'forged'} differ" in r.server.audit(rounds, {"worker_1": "forged"})
    assert "the report says 999999 rounds, the server ran 10" in r.server.audit(999_999, {"worker_0": digest})


# -- bad input -----------------------------------------------------------------------------------------------------
def fashion(tmp_path: Path, mutate) -> str:
    src = Path("/usr/share/datasets/fashion-mnist")
    if not src.is_dir():
        pytest.skip("dataset-fashion-mnist is not installed")
    root = tmp_path / "fm"
    root.mkdir()
    for f in src.iterdir():
        (root / f.name).write_bytes(f.read_bytes())
    mutate(root)
    return str(root)


def _truncate_gz(root: Path) -> None:
    p = root / "t10k-images-idx3-ubyte.gz"
    p.write_bytes(p.read_bytes()[:5000])


def _truncate_raw(root: Path) -> None:
    raw = gzip.decompress((root / "t10k-images-idx3-ubyte.gz").read_bytes())
    (root / "t10k-images-idx3-ubyte.gz").unlink()
    (root / "t10k-images-idx3-ubyte").write_bytes(raw[: len(raw) // 2])


def _two_byte_labels(root: Path) -> None:
    (root / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(b"\x00\x00"))


def _label_out_of_range(root: Path) -> None:
    raw = bytearray(gzip.decompress((root / "t10k-labels-idx1-ubyte.gz").read_bytes()))
    raw[8 + 17] = 12
    (root / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(bytes(raw)))


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (_truncate_gz, "t10k-images-idx3-ubyte.gz: cannot be read"),
        (_truncate_raw, "t10k-images-idx3-ubyte: 3920008 bytes where its header (10000, 28, 28) needs 7840016"),
        (_two_byte_labels, "t10k-labels-idx1-ubyte.gz: 2 bytes, not an IDX file"),
        (_label_out_of_range, "label 12 of example 17 is outside 0..9"),
    ],
)
def test_broken_data_files_are_one_line(tmp_path, capsys, mutate, needle):
    root = fashion(tmp_path, mutate)
    overrides = ["data.name=fashion_mnist", f"data.root={root}", f"job.out_dir={tmp_path / 'run'}"]
    rc = main(overrides)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and needle in err[0], err
    with pytest.raises(DataError):
        from hosfl_dist.data import build_data
        from hosfl_dist.runtime.build import data_sections

        build_data(data_sections(load_config(None, overrides)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the refusal cannot happen")
def test_a_cuda_device_without_one_is_one_line(tmp_path, capsys):
    rc = main([*TINY_OVERRIDES, "job.device=cuda", f"job.out_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [
        "error: job.device=cuda but this machine has no CUDA device (torch.cuda.is_available() is False)"
    ]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ([], None),
        (["--nproc", "9"], "world size 9 does not fit the roles: 8 client workers for clients.total=6"),
        (["server.rpc_timeout_s=inf"], "invalid value for server.rpc_timeout_s: inf"),
        (["job.interface=bad/name"], "invalid value for job.interface: 'bad/name'"),
        (["job.out_dir={held}"], "holds a run (status: completed); set job.resume=auto"),
    ],
)
def test_check_refuses_bad_input_in_one_line_and_changes_nothing(tmp_path, capsys, extra, needle):
    held = tmp_path / "held"
    held.mkdir()
    (held / "summary.json").write_text('{"status": "completed"}')
    out = tmp_path / "new"
    extra = [x.format(held=held) for x in extra]
    rc = main(["--check", "--nproc", "3", *TINY_OVERRIDES, f"job.out_dir={out}", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    if needle is None:
        assert rc == 0 and err == []
    else:
        assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert not out.exists() and sorted(p.name for p in held.iterdir()) == ["summary.json"]


def test_a_batch_larger_than_a_shard_is_said_and_an_empty_shard_is_refused(caplog):
    from hosfl_dist.data import FederatedData, build_data
    from hosfl_dist.runtime.build import data_sections

    cfg = load_config(None, [*TINY_OVERRIDES, "data.train_max_samples=30", "clients.batch_size=8"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a line in the run's log, not a Python warning with its source line
        with caplog.at_level(logging.WARNING, logger="hosfl_dist"):
            build_data(data_sections(cfg))
    (said,) = [r.getMessage() for r in caplog.records if "is larger than" in r.getMessage()]
    assert said.startswith("clients.batch_size=8 is larger than the training samples of 6 of the 6 clients")
    assert "\n" not in said
    x, y = torch.zeros(4, 1), torch.zeros(4, dtype=torch.long)
    with pytest.raises(DataError, match="client 1 has no training samples"):
        FederatedData(x, y, x, y, [torch.arange(4).numpy(), torch.arange(0).numpy()], 2, 0, {})


def test_resuming_a_completed_run_leaves_it_alone(tmp_path, capsys):
    out = tmp_path / "run"
    run_in_process([*TINY_OVERRIDES, f"job.out_dir={out}"])  # its final checkpoint is the last round's
    before = {f: f.read_bytes() for f in out.rglob("*") if f.is_file()}
    capsys.readouterr()
    assert main([*TINY_OVERRIDES, f"job.out_dir={out}", "job.resume=auto"]) == 0
    assert capsys.readouterr().out.strip() == f"done: {out} holds this run, completed; nothing to do (job.resume=auto)"
    assert {f: f.read_bytes() for f in out.rglob("*") if f.is_file()} == before
