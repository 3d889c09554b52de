"""Config files, dotted overrides, custom-task files and the environment as untrusted data.

Whatever the input, ``python -m hosfl_dist.run --check …`` ends with exit code 0 and says nothing, or with exit code 2
and exactly one ``error:`` line of bounded length: no traceback, no second line, and nothing written (the run folder
does not exist yet). The explicit tests pin one case of each class (an alias bomb, a 50 MB file, a key given twice,
a name that would leave its folder, the environment, a cut that does not fit the model); the fuzz (hypothesis)
drives the same command with generated config files, overrides and task files.

The fuzz runs the command in this process (``main([...])``, its stderr through capsys) in a fresh folder per
example; its default tier takes ~15 s, ``pytest -m slow`` runs the long profile, which also builds (``--dry-run``)
what ``--check`` accepted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hosfl_dist.config import Config
from hosfl_dist.run import main

BASE: dict = {
    "job": {"name": "fuzz", "progress": False, "out_dir": "run"},
    "data": {"name": "synthetic"},
    "model": {"name": "small_cnn", "width": 4},
    "split": {"cut": 1},
    "clients": {"total": 6, "per_round": 3, "batch_size": 8},
    "zo": {"num_perturbations": 3},
    "train": {"budget_samples": 240, "eval_every_samples": 120, "eval_batch_size": 250},
}
"""The tiny synthetic run every fuzzed config starts from (README's test config)."""
BASE_OVERRIDES = [f"{s}.{k}={json.dumps(v)}" for s, keys in BASE.items() for k, v in keys.items()]
LM_OVERRIDES = [
    "job.progress=false", "job.out_dir=run", "model.name=hf", "model.source=tiny:llama", "split.cut=2", "lora.r=2",
    "clients.total=4", "clients.per_round=2", "clients.batch_size=4", "zo.num_perturbations=2",
    "train.budget_samples=16", "train.eval_every_samples=8", "data.max_length=40",
]  # fmt: skip
MAX_LINE = 4096 + 512
"""Longest error line accepted: a message names a value (a path of at most PATH_MAX), it does not echo a file."""


def dotted_keys(obj: object = None, prefix: str = "") -> list[str]:
    """Every dotted key of the config tree, e.g. ``clients.optim.lr``."""
    obj = Config() if obj is None else obj
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out += dotted_keys(value, f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


KEYS = dotted_keys()


# -- what the command must do, whatever the input ------------------------------------------------------------------
@contextmanager
def fresh_folder() -> Iterator[Path]:
    """A new empty working folder for one example (the cwd, and $HOSFL_CACHE inside it)."""
    old, cache = os.getcwd(), os.environ.get("HOSFL_CACHE")
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        os.environ["HOSFL_CACHE"] = str(Path(tmp, "cache"))
        try:
            yield Path(tmp)
        finally:
            os.chdir(old)
            if cache is None:
                os.environ.pop("HOSFL_CACHE", None)
            else:
                os.environ["HOSFL_CACHE"] = cache


def tree(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def problem(argv: list[str], capsys: pytest.CaptureFixture, folder: Path, inputs: set[str]) -> str | None:
    """What is wrong with how ``main(argv)`` ended (None: exit 0 and silent, or exit 2 and one ``error:`` line, and
    nothing written but ``inputs``)."""
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = f"SystemExit({exc.code})"
    except BaseException as exc:  # noqa: BLE001 - a traceback is what the fuzz looks for
        return f"traceback: {type(exc).__name__}: {str(exc)[:200]}"
    out, err = capsys.readouterr()
    lines = err.splitlines()
    written = tree(folder) - inputs
    if written:
        return f"wrote {sorted(written)[:3]}"
    if rc == 0:
        return None if not err.strip() else f"exit 0 with stderr {lines[:2]}"
    if rc != 2:
        return f"exit {rc}: {lines[-1:] if lines else ''}"
    if len(lines) != 1 or not lines[0].startswith("error: "):
        return f"exit 2 with {len(lines)} lines: {[x[:120] for x in lines[:3]]}"
    if len(lines[0]) > MAX_LINE:
        return f"an error line of {len(lines[0])} characters"
    return None


def assert_refused(argv: list[str], capsys: pytest.CaptureFixture, *needles: str) -> str:
    """``main(argv)`` exits 2 with one ``error:`` line holding every needle; the line."""
    capsys.readouterr()
    assert main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# -- generated input -----------------------------------------------------------------------------------------------
ODD_TEXT = [
    "", " ", ".", "..", "../x", "../../x", "/", "/tmp", "a/b", "~", "~/x", "/dev/zero",
    "/proc/self/mem", "{x}", "{0}", "{}", "{a.b}", "{a[0]}", "{", "}", "{text} It was", "%s", "cuda", "cuda:99", "lo",
    "hub", "local", "custom", "classification", "generation", "tiny:llama", "tiny:nope", "arch:qwen3-8b", "arch:../x",
    "pkg:os", "pkg:..", "pkg:", "yes", "no", "on", "1e400", "-1e400", "0x10", "0o7", ".inf", ".nan", "2001-02-30",
    "2001-01-01", "nan", "inf", "-0", "1_000", "a\nb", "a\x00b", "\t", "é", "θ+μu", "\u202e", "\ud7ff",
]  # fmt: skip
ODD_INTS = [0, -1, 1, 2, 3, 4, 2**31, 2**63 - 1, 2**63, 2**64, 10**30, -(2**63) - 1]


def scalars() -> st.SearchStrategy:
    return st.one_of(
        st.integers(-(2**70), 2**70),
        st.sampled_from(ODD_INTS),
        st.floats(allow_nan=True, allow_infinity=True),
        st.booleans(),
        st.none(),
        st.text(max_size=40),
        st.sampled_from(ODD_TEXT),
        st.integers(200, 5000).map(lambda n: "/" + "y" * n),  # past NAME_MAX, PATH_MAX
    )


def values() -> st.SearchStrategy:
    keys = st.one_of(st.sampled_from([k.rsplit(".", 1)[-1] for k in KEYS]), st.text(max_size=10))
    return st.recursive(
        scalars(),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
        max_leaves=8,
    )


def _set(raw: dict, dotted: str, value: object) -> None:
    node = raw
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = value


def alias_bomb(depth: int, width: int) -> str:
    lines = ['bomb0: &b0 ["lol", "lol"]']
    lines += [f"bomb{i}: &b{i} [" + ", ".join([f"*b{i - 1}"] * width) + "]" for i in range(1, depth + 1)]
    return "\n".join(lines) + "\n"


def inline_bomb(depth: int, width: int) -> str:
    """The same inside one value: an error message that printed the value would expand it."""
    first = ['&b0 ["lol", "lol"]']
    return ", ".join(first + [f"&b{i} [" + ", ".join([f"*b{i - 1}"] * width) + "]" for i in range(1, depth + 1)])


SNIPPETS = [
    lambda d: alias_bomb(d.draw(st.integers(1, 12)), d.draw(st.integers(2, 12))),
    lambda d: (
        "lora:\n  client_targets: [[" + inline_bomb(d.draw(st.integers(1, 12)), d.draw(st.integers(2, 12))) + "]]\n"
    ),
    lambda d: "job: &a [*a]\n",
    lambda d: "job: " + "[" * d.draw(st.integers(1, 1500)) + "]" * d.draw(st.integers(0, 1500)) + "\n",
    lambda d: "job: " + "{a: " * d.draw(st.integers(1, 1000)) + "1" + "}" * d.draw(st.integers(0, 1000)) + "\n",
    lambda d: "job:\n  seed: !!python/object/apply:os.system [echo pwned]\n",
    lambda d: "job:\n  name: !!binary aGVsbG8=\n",
    lambda d: "job:\n  name: !!set {a, b}\n",
    lambda d: "job:\n  name: !!omap [a: 1]\n",
    lambda d: "job:\n  name: !custom x\n",
    lambda d: "job:\n  name: !!timestamp 2001-13-45\n",
    lambda d: "job:\n  seed: " + "9" * d.draw(st.integers(1, 6000)) + "\n",
    lambda d: "base: &base {seed: 1}\njob:\n  <<: *base\n  seed: 2\n",
    lambda d: "---\njob: {}\n---\njob: {}\n",
    lambda d: "%YAML 1.1\n---\njob: {name: x}\n",
    lambda d: "\ufeffjob: {name: x}\n",
    lambda d: "job:\n\tname: x\n",
    lambda d: "job: {name: x, name: y}\n",
    lambda d: "job:\n  1: a\n  true: b\n",
    lambda d: "? [a, b]\n: c\n",
    lambda d: "job:\n  name: " + "x" * d.draw(st.integers(0, 200_000)) + "\n",
    lambda d: 'job:\n  name: "a\\0b"\n',
    lambda d: "data:\n  label_words: [yes, no]\n  name: custom\n",
]


@st.composite
def config_files(draw: st.DrawFn) -> bytes:
    """A YAML config: the base with some keys given generated values (or unknown keys), dumped; then maybe a piece of
    hostile YAML, a line repeated, or random bytes spliced in."""
    raw = json.loads(json.dumps(BASE))
    for _ in range(draw(st.integers(0, 4))):
        key = draw(st.one_of(st.sampled_from(KEYS), st.sampled_from(KEYS).map(lambda k: k + "x"), st.text(max_size=8)))
        _set(raw, key or "x", draw(values()))
    try:
        text = yaml.safe_dump(raw, allow_unicode=draw(st.booleans()), sort_keys=False)
    except yaml.YAMLError:
        text = yaml.safe_dump(BASE)
    data = text.encode("utf-8", "surrogatepass")
    how = draw(st.sampled_from(["as is", "snippet", "repeat a line", "splice bytes"]))
    if how == "snippet":
        snippet = SNIPPETS[draw(st.integers(0, len(SNIPPETS) - 1))]
        data += snippet(_Drawer(draw)).encode("utf-8", "surrogatepass")
    elif how == "repeat a line":
        lines = data.splitlines(keepends=True)
        i = draw(st.integers(0, len(lines) - 1))
        data = b"".join(lines[: i + 1] + [lines[i]] + lines[i + 1 :])
    elif how == "splice bytes":
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.binary(max_size=16)) + data[at:]
    return data


class _Drawer:
    """``d.draw`` for the snippets."""

    def __init__(self, draw: st.DrawFn) -> None:
        self.draw = draw


@st.composite
def overrides(draw: st.DrawFn) -> list[str]:
    """Dotted overrides: known or unknown keys, values as text, YAML of generated values, or hostile YAML."""
    out = []
    for _ in range(draw(st.integers(1, 4))):
        key = draw(st.one_of(st.sampled_from(KEYS), st.text(min_size=1, max_size=12)))
        if key.startswith("-"):  # argparse would take it for an option
            key = "x" + key
        value = draw(
            st.one_of(
                st.text(max_size=30),
                st.sampled_from(ODD_TEXT),
                values().map(lambda v: _flow(v)),
                st.sampled_from(
                    [
                        "{a: 1, a: 2}",
                        "[&x [1, 2], *x, *x]",
                        "&a [*a]",
                        "!!python/name:os.system",
                        "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]",
                        "{" * 100,
                        "2001-02-30",
                        "9" * 5000,
                        "1e999",
                        "!!float nan",
                    ]
                ),  # fmt: skip
            )
        )
        out.append(f"{key}={value}")
    return out


def _flow(value: object) -> str:
    try:
        return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()
    except (yaml.YAMLError, ValueError):
        return str(value)


@st.composite
def task_files(draw: st.DrawFn) -> tuple[str, list[str]]:
    """A custom classification or generation task: the file's text (JSONL rows with generated labels and text) and the
    overrides that name it."""
    kind = draw(st.sampled_from(["classification", "generation"]))
    label = st.one_of(st.integers(-3, 4), scalars(), values(), st.sampled_from(["yes", " no", "0", "1", "maybe"]))
    text = st.one_of(st.text(max_size=20), scalars(), values())
    rows = [{"text": draw(text), ("gold" if kind == "classification" else "answers"): draw(label)}
            for _ in range(draw(st.integers(0, 6)))]  # fmt: skip
    lines = []
    for row in rows:
        try:
            lines.append(json.dumps(row))
        except (TypeError, ValueError):
            lines.append(json.dumps({"text": "x", "gold": 0}))
    if draw(st.booleans()):
        lines.append(draw(st.sampled_from(['{"text": "a", "text": "b", "gold": 0}', "[1, 2]", "5", '"x"', "{", "\x00",
                                           "[" * 5000 + "]" * 5000, '{"text": "a", "gold": 1e999}'])))  # fmt: skip
    template = draw(st.one_of(st.sampled_from(["{text} It was", "{text}", "{0}", "{}", "{text.x}", "{text!r}", "{",
                                               "no field", "{text} {missing}"]), st.text(max_size=20)))  # fmt: skip
    words = draw(st.one_of(st.just('[" no", " yes"]'), st.just('[" a", " b", " c"]'), st.just("[yes, no]"),
                           values().map(_flow)))  # fmt: skip
    extra = [f"data.template={json.dumps(template)}", f"data.task={kind}"]
    if kind == "classification":
        extra += [f"data.label_words={words}", "data.columns={label: gold}"]
    return "\n".join(lines) + "\n", extra


FUZZ = settings(
    max_examples=int(os.environ.get("HOSFL_FUZZ_EXAMPLES", "300")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
"""The default tier's budget (~15 s for the three fuzz tests); ``HOSFL_FUZZ_EXAMPLES`` raises it."""
SLOW = settings(FUZZ, max_examples=2000)


# -- the fuzz ------------------------------------------------------------------------------------------------------
def _config_file_case(data: bytes, capsys: pytest.CaptureFixture, build: bool = False) -> None:
    with fresh_folder() as folder:
        Path(folder, "config.yaml").write_bytes(data)
        argv = ["--config", "config.yaml", "--check"]
        assert problem(argv, capsys, folder, {"config.yaml"}) is None
        if build:
            _dry_run(argv, capsys, folder, {"config.yaml"})


def _dry_run(argv: list[str], capsys: pytest.CaptureFixture, folder: Path, inputs: set[str]) -> None:
    """What --check accepted builds (data, model) without a traceback or a second line."""
    capsys.readouterr()
    if main(argv) != 0:
        return
    dry = [a for a in argv if a != "--check"] + ["--dry-run"]
    capsys.readouterr()
    rc = main(dry)
    err = capsys.readouterr().err.splitlines()
    assert rc == 0 or (rc == 2 and len(err) == 1 and err[0].startswith("error: ")), (rc, err[:3])
    assert tree(folder) - inputs == set()


@FUZZ
@given(data=config_files())
def test_fuzz_config_files(data, capsys):
    _config_file_case(data, capsys)


@FUZZ
@given(items=overrides())
def test_fuzz_dotted_overrides(items, capsys):
    with fresh_folder() as folder:
        assert problem(["--check", *BASE_OVERRIDES, *items], capsys, folder, set()) is None


@settings(FUZZ, max_examples=max(10, FUZZ.max_examples // 6))
@given(case=task_files())
def test_fuzz_custom_task_files(case, capsys):
    text, extra = case
    with fresh_folder() as folder:
        Path(folder, "task.jsonl").write_text(text, encoding="utf-8", errors="surrogatepass")
        argv = ["--check", *LM_OVERRIDES, "data.name=custom", "data.train_path=task.jsonl",
                "data.eval_path=task.jsonl", *extra]  # fmt: skip
        assert problem(argv, capsys, folder, {"task.jsonl"}) is None


@pytest.mark.slow
@SLOW
@given(data=config_files())
def test_fuzz_config_files_long_and_built(data, capsys):
    _config_file_case(data, capsys, build=True)


@pytest.mark.slow
@SLOW
@given(items=overrides())
def test_fuzz_dotted_overrides_long_and_built(items, capsys):
    with fresh_folder() as folder:
        argv = ["--check", *BASE_OVERRIDES, *items]
        assert problem(argv, capsys, folder, set()) is None
        _dry_run(argv, capsys, folder, set())


# -- one case of each class ----------------------------------------------------------------------------------------
def test_an_alias_bomb_is_refused_at_once_without_expanding(tmp_path, capsys):
    path = tmp_path / "bomb.yaml"
    path.write_text("job: {name: x}\n" + alias_bomb(9, 10))  # 10^9 strings once expanded
    start = time.perf_counter()
    line = assert_refused(["--config", str(path), "--check"], capsys, "expands to more than 100,000 values", "line 7")
    # refused at line 7, before anything was expanded; the bound only catches a hang (it takes well under a second,
    # and expanding 10^9 strings would fill memory long before it), never the machine's load
    assert time.perf_counter() - start < 60, line
    path.write_text("job: &a [*a]\n")
    assert_refused(["--config", str(path), "--check"], capsys, "alias *a refers to its own anchor")


def test_a_50_mb_config_file_is_refused_without_echoing_it(tmp_path, capsys):
    path = tmp_path / "big.yaml"
    path.write_text("job:\n  name: " + "x" * (50 << 20) + "\n")
    line = assert_refused(["--config", str(path), "--check"], capsys, "holds 52,428,814 bytes", "at most 1,048,576")
    assert "xxx" not in line and len(line) < 300


def test_a_key_given_twice_is_refused_naming_the_key_and_both_lines(tmp_path, capsys):
    path = tmp_path / "twice.yaml"
    path.write_text("job:\n  name: a\n  seed: 1\n  name: b\n")
    assert_refused(
        ["--config", str(path), "--check"], capsys, "line 4, column 3: duplicate key 'name' (also at line 2)"
    )
    assert_refused(["--check", "data.columns={a: x, a: y}"], capsys, "override data.columns", "duplicate key 'a'")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("job: " + "[" * 500 + "]" * 500, "nested deeper than 64 levels"),
        ("job:\n  name: !!timestamp 2001-02-30\n", "line 2, column 9: cannot read the value (day is out of range"),
        ("job:\n  seed: !!python/object/apply:os.system [echo]\n", "could not determine a constructor"),
        ('job:\n  name: "a\\0b"\n', "holds the control character '\\x00'"),
        ("data:\n  label_words: [true, false]\n", "YAML reads true and false as booleans: quote the word"),
        ("job:\n  1: a\n  b: c\n", "unknown key job.1 in section job"),
        (b"\xff\xfe\x00garbage", "must hold a mapping of sections"),
    ],
    ids=["deep", "no-such-date", "python-tag", "nul", "true-false", "mixed-keys", "bytes"],
)
def test_hostile_yaml_is_one_line(tmp_path, capsys, text, needle):
    path = tmp_path / "c.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert_refused(["--config", str(path), "--check"], capsys, needle)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("job.name=../../x", "invalid value for job.name: '../../x' (it names the folder runs/<job.name>/"),
        ("job.name=..", "invalid value for job.name: '..'"),
        ("job.name=a/b", "invalid value for job.name: 'a/b'"),
        ("model.gguf_file=../w.gguf", "a file name inside model.source, not a path"),
        ("data.train_path=/" + "x" * 300, "a path component is longer than 255 bytes"),
        ("job.threads=100000", "invalid value for job.threads: 100000 (must be at most 1024"),
        ("job.seed=18446744073709551616", "must fit in a signed 64-bit integer"),
        ("clients.optim.lr=1e300", "must be a finite number within float32's range"),
        ("comm.rtt_ms=inf", "invalid value for comm.rtt_ms: inf"),
        ("model.width=0", "invalid value for model.width: 0 (must be in 1..1024"),
        ("lora.r=2147483648", "invalid value for lora.r: 2147483648 (must be in 1..4096)"),
        ("train.eval_every_samples=1", None),
        ("train.budget_samples=4611686018427387904", "evaluations over train.budget_samples"),
        ('data.root="a\\nb"', "holds the control character '\\n'"),
    ],
)
def test_values_a_run_could_not_hold_are_one_line(tmp_path, capsys, override, needle):
    argv = ["--check", *BASE_OVERRIDES, f"job.out_dir={tmp_path / 'run'}", override]
    if needle is None:  # 240 evaluations of a 240-sample run: allowed
        assert main(argv) == 0
    else:
        assert_refused(argv, capsys, needle)
    assert not (tmp_path / "run").exists()


def test_variant_and_cache_names_stay_in_their_folder(tmp_path, monkeypatch):
    from hosfl_dist.errors import ConfigError
    from hosfl_dist.experiments.runs import safe_name
    from hosfl_dist.models.sources import cache_path

    for label in ("..", ".", "", "../../etc", "a/b", ".hidden", "x" * 1000, "zo.mu=1e-3,zo.num_perturbations=5"):
        name = safe_name(label)
        assert (tmp_path / name).resolve().parent == tmp_path.resolve() and len(name) <= 200 and name != ".."
    assert safe_name("zo.mu=1e-3,zo.num_perturbations=5") == "zo.mu=1e-3_zo.num_perturbations=5"  # as before
    assert safe_name("x" * 1000) != safe_name("x" * 999 + "y")
    monkeypatch.setenv("HOSFL_CACHE", str(tmp_path))
    assert cache_path("pkg", "m.gguf") == str(tmp_path / "pkg" / "m.gguf")
    for bad in ("..", "../x", "", "a/b"):
        with pytest.raises(ConfigError, match="one plain name expected"):
            cache_path("pkg", bad)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("OMP_NUM_THREADS", "100000"), ("OMP_NUM_THREADS", "abc"), ("OMP_NUM_THREADS", "-2"),
        ("MALLOC_ARENA_MAX", "-1"), ("MALLOC_ARENA_MAX", "lots"), ("MALLOC_MMAP_THRESHOLD_", "1e9"),
        ("MALLOC_MMAP_THRESHOLD_", str(1 << 40)), ("SLURM_JOB_ID", "../../etc"), ("SLURM_JOB_ID", "12/34"),
        ("HOSFL_CACHE", "relative/cache"), ("HOSFL_CACHE", "/tmp/a\nb"), ("GLOO_SOCKET_IFNAME", "eth0; rm"),
        ("TORCHELASTIC_RESTART_COUNT", "x"), ("LOCAL_RANK", "-1"), ("LOCAL_WORLD_SIZE", "0"), ("RANK", "1e3"),
        ("WORLD_SIZE", "99999999999999999999"), ("MASTER_PORT", "70000"), ("MASTER_ADDR", "a b"),
    ],
)  # fmt: skip
def test_a_bad_environment_variable_is_one_line_naming_it(capsys, monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    shown = repr(value) if len(value) <= 80 else repr(value[:79])
    assert_refused(["--check", *BASE_OVERRIDES], capsys, f"environment variable {variable}={shown} is not usable")


def test_the_launcher_environment_must_fit_together_and_a_huge_world_is_refused_at_once(capsys, monkeypatch):
    from hosfl_dist.config import load_config
    from hosfl_dist.errors import ConfigError
    from hosfl_dist.config.environment import slurm_job_id
    from hosfl_dist.runtime.process.launch import launch_env, role_map

    base = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    with pytest.raises(ConfigError, match="LOCAL_RANK=3 and LOCAL_WORLD_SIZE=2 do not fit WORLD_SIZE=2"):
        launch_env({**base, "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="SLURM_JOB_ID='..' is not usable"):
        slurm_job_id({"SLURM_JOB_ID": ".."})
    assert slurm_job_id({"SLURM_JOB_ID": "4242"}) == "4242"
    cfg = load_config(None, BASE_OVERRIDES)
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError, match="world size 1000000000 does not fit the roles"):
            role_map(cfg, 10**9)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak  # refused before any tuple of the world's ranks was built (8 GB for 10^9 of them)
    assert_refused(["--check", "--nproc", str(10**9), *BASE_OVERRIDES], capsys, "does not fit the roles")


@pytest.fixture
def lm_files(tmp_path: Path) -> Path:
    rows = [{"review": s, "y": y} for s, y in [("A fine film.", 1), ("Dull.", 0)] * 4]
    (tmp_path / "sst2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def lm_check(files: Path, *extra: str) -> list[str]:
    data = [f"data.train_path={files / 'sst2.jsonl'}", f"data.eval_path={files / 'sst2.jsonl'}"]
    return ["--check", *LM_OVERRIDES[2:], "data.name=sst2", *data, "data.columns={sentence: review, label: y}", *extra]


def test_check_refuses_what_the_build_refuses_for_an_lm(lm_files, capsys):
    """--check builds the split LM on the meta device, as a run does: the cut, the LoRA targets; and reads the
    task's files."""
    assert main(lm_check(lm_files)) == 0
    assert_refused(lm_check(lm_files, "split.cut=4"), capsys, "split.cut: 4 (tiny:llama has 4 decoder blocks")
    assert_refused(lm_check(lm_files, "model.source=arch:qwen3-8b", "split.cut=36"), capsys,
                   "split.cut: 36 (arch:qwen3-8b has 36 decoder blocks; need 1 <= cut < 36)")  # fmt: skip
    assert_refused(lm_check(lm_files, "model.source=facebook/opt-125m", "split.cut=12"), capsys,
                   "facebook/opt-125m has 12 decoder blocks")  # fmt: skip
    assert_refused(lm_check(lm_files, "lora.client_targets=[q_prj]"), capsys, "LoRA target_modules ['q_prj'] not found")
    (lm_files / "bad.jsonl").write_text(json.dumps({"review": "x", "y": [1]}) + "\n")
    assert_refused(lm_check(lm_files, f"data.eval_path={lm_files / 'bad.jsonl'}"), capsys,
                   "bad.jsonl: example 0 has label [1]; sst2 labels are 0..1")  # fmt: skip
    (lm_files / "twice.jsonl").write_text('{"review": "x", "y": 0, "y": 1}\n')
    assert_refused(lm_check(lm_files, f"data.train_path={lm_files / 'twice.jsonl'}"), capsys,
                   "line 1: the key 'y' twice in one object")  # fmt: skip


def test_dry_run_of_a_text_task_prints_what_it_built(lm_files, capsys):
    """A text task's data info names the task (a string, not a plug-in scorer): --dry-run prints it as built."""
    assert main(["--dry-run", *lm_check(lm_files)[1:]]) == 0
    built = json.loads(capsys.readouterr().out.split("# built:", 1)[1])
    assert built["data"]["task"] == "sst2" and "task_metrics" not in built
    assert built["client_trainable_params"] > 0


def test_check_refuses_a_custom_task_whose_template_or_labels_do_not_fit(lm_files, capsys):
    (lm_files / "nli.jsonl").write_text("".join(json.dumps({"p": "A.", "gold": g}) + "\n" for g in (0, 1, 2, {})))
    custom = [f"data.train_path={lm_files / 'nli.jsonl'}", f"data.eval_path={lm_files / 'nli.jsonl'}",
              "data.name=custom", "data.task=classification", "data.columns={label: gold}"]  # fmt: skip
    argv = lm_check(lm_files, *custom, 'data.label_words=[" a", " b", " c"]')
    assert_refused(
        [*argv, 'data.template="{p} is"'], capsys, "nli.jsonl: example 3 has label {}; custom labels are 0..2"
    )
    assert_refused([*argv, 'data.template="{0} is"'], capsys, "invalid value for data.template: '{0} is' (name the")
    (lm_files / "bool.jsonl").write_text(json.dumps({"p": "A.", "gold": True}) + "\n")  # not label 1
    assert_refused([*argv, 'data.template="{p} is"', f"data.train_path={lm_files / 'bool.jsonl'}"], capsys,
                   "bool.jsonl: example 0 has label true; custom labels are 0..2")  # fmt: skip
    words = lm_check(lm_files, *custom, 'data.template="{p} is"', "data.label_words=[true, false, maybe]")
    assert_refused(words, capsys, "invalid value for data.label_words[0]: True (expected a string; YAML reads true")


def test_latency_configs_go_through_the_same_loader(tmp_path):
    from hosfl_dist.errors import ConfigError
    from hosfl_dist.measure.latency.cli import load_latency_setup

    path = tmp_path / "latency.yaml"
    path.write_text("link: {}\n" + alias_bomb(9, 10))
    with pytest.raises(ConfigError, match="expands to more than 100,000 values"):
        load_latency_setup(path)
    path.write_text("sim:\n  trials: 5\n  trials: 6\n")
    with pytest.raises(ConfigError, match=r"line 3, column 3: duplicate key 'trials' \(also at line 2\)"):
        load_latency_setup(path)
    path.write_text("sim:\n  trials: 1.0e+12\n")
    with pytest.raises(ConfigError, match=r"invalid value for sim.trials"):
        load_latency_setup(path)


def test_every_reader_of_the_environment_is_checked():
    """A variable read anywhere in the package is in launch.ENVIRONMENT (or is the job token, which groups.py checks
    where it is read, torchrun's agent-store switch, compared with one word, or PATH / PYTHONPATH, which the study
    launchers extend for the processes they start and never interpret)."""
    import re

    from hosfl_dist.config.environment import ENVIRONMENT

    package = Path(__file__).resolve().parents[1] / "hosfl_dist"
    read = set()
    for path in package.rglob("*.py"):
        text = path.read_text()
        read |= set(re.findall(r"""environ(?:\.get\(|\[)\s*["']([A-Z_]+)["']""", text))
        read |= set(re.findall(r"""getenv\(\s*["']([A-Z_]+)["']""", text))
    passed_on = {"TORCHELASTIC_USE_AGENT_STORE", "HOSFL_JOB_TOKEN", "PATH", "PYTHONPATH"}
    assert read - set(ENVIRONMENT) <= passed_on, read - set(ENVIRONMENT)


def test_threads_past_what_this_machine_can_start_are_one_line_and_never_leave_a_run_running(
    tmp_path, capsys, monkeypatch
):
    """job.threads is bounded by 4 × os.cpu_count() (libgomp aborts a process it cannot start them for, leaving
    summary.json ``running``); a thread start torch refuses is one line, exit code 2, and no run left ``running``."""
    import torch

    from hosfl_dist.config.schema import thread_limit

    limit = thread_limit()
    assert limit == min(1024, 4 * (os.cpu_count() or 1))
    argv = ["--check", *BASE_OVERRIDES, f"job.out_dir={tmp_path / 'run'}"]
    assert_refused([*argv, f"job.threads={limit + 1}"], capsys, f"invalid value for job.threads: {limit + 1} (must be "
                   f"at most {limit} on this machine (4 × its {os.cpu_count()} CPUs, os.cpu_count()")  # fmt: skip
    assert main([*argv, f"job.threads={limit}"]) == 0

    real = torch.set_num_threads
    assert torch.get_num_threads() != limit  # what the run restores when it ends is started as before

    def refused(n):
        if n == limit:
            raise RuntimeError("Thread creation failed: Resource temporarily unavailable")
        real(n)

    monkeypatch.setattr(torch, "set_num_threads", refused)
    out = tmp_path / "run"
    said = f"cannot start {limit} intra-op threads (job.threads; at most"
    assert_refused([*BASE_OVERRIDES, f"job.out_dir={out}", f"job.threads={limit}"], capsys, said, "Thread creation")
    status = json.loads((out / "summary.json").read_text())["status"] if (out / "summary.json").exists() else None
    assert status in (None, "failed")
