"""The documentation still runs: every command line shown in README.md and docs/*.md parses, every relative link
there and in results/ resolves, docs/configuration.md is what the config tree generates; and results/ stays a report:
at most 150 files, each experiment's archive (results/<experiment>/runs.tar.xz or records.tar.xz) ignored by git once
unpacked, a packed experiment's archive holding every run its tables list, and the scripts that collect packed tables
stopping when they are not unpacked.

A command line is read from fenced ``bash`` / ``sh`` / ``shell`` / ``console`` blocks (in ``console`` blocks only the
``$ `` lines), from indented code, and from inline code that starts with ``python -m`` or ``torchrun``; backslash
continuations are joined, a leading ``$ ``, environment assignments (``OMP_NUM_THREADS=1``) and trailing comments are
dropped. Then, by what the line runs:

- ``python -m hosfl_dist.run …`` and ``torchrun … -m hosfl_dist.run …``: the run's own argument parser, and the config
  and overrides resolved with ``load_config`` (nothing is built or trained); ``--status``, ``--help-config`` and
  ``--record-death`` lines are only parsed (``--help-config SECTION`` must name a section). torchrun's own options
  must be in its ``--help``, and the line must set ``OMP_NUM_THREADS`` (torchrun warns on every launch otherwise).
- any other ``python -m MODULE [SUBCOMMAND] …``: ``python -m MODULE [SUBCOMMAND] --help`` exits 0 and names every
  ``--flag`` of the line (each help is run once, in parallel); a ``--config`` with ``key=value`` overrides is resolved
  as above. ``python -m pytest`` lines: the test paths exist and ``-m`` names declared markers.
- ``bash SCRIPT`` / ``sbatch … slurm/SCRIPT``: the script exists; the overrides of ``launch/*.sh`` and
  ``slurm/hosfl.sbatch`` are resolved against ``$CONFIG`` (default ``configs/quickstart.yaml``).

A line with a placeholder (``RUN_DIR``, ``FILE.jsonl``, ``N``, ``…``, ``<addr>``, ``[--out PNG]``) has its module and
flags checked but not its config. Other lines (``pip install``, ``. .venv/bin/activate``) are not checked.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PENDING = "export lands with issue 24"
PENDING_MODULES = {"hosfl_dist.export", "hosfl_dist.predict"}
"""Modules another change adds: their checks are expected to fail (not strictly) while the module does not exist."""
PENDING_LINKS = {"docs/export.md"}
"""Pages another change adds: a link to one is not an error while it is missing."""
SCRIPT_CONFIG = {"launch/torchrun.sh", "launch/quickstart.sh", "slurm/hosfl.sbatch"}
"""Scripts whose positional arguments are overrides of $CONFIG (default configs/quickstart.yaml)."""
SHELL_FENCES = {"bash", "sh", "shell", "console"}
COMMAND_WORDS = {"python", "python3", "torchrun", "bash", "sbatch"}
ENV_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
OVERRIDE = re.compile(r"^[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)+=")
FLAG = re.compile(r"^\[?(--[A-Za-z][\w-]*)")
PLACEHOLDER = re.compile(r"…|\.\.\.|[<>\[\]]|(^|[=,/:])[A-Z][A-Z0-9_]*(\.[a-z0-9]+)?($|[=,/:])")


@dataclass(frozen=True)
class Command:
    file: str
    """The document, relative to the repository root."""
    line: int
    text: str
    """The command as shown: continuations joined, without a leading ``$ ``."""

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


def _shell_text(line: str, console: bool) -> str | None:
    """The command on a shown line, or None for a comment, output or an empty line."""
    text = line.strip()
    if console:
        if not text.startswith("$ "):
            return None
        text = text[2:]
    elif text.startswith("$ "):
        text = text[2:]
    return text if text and not text.startswith("#") else None


def _join(lines: list[str], i: int) -> tuple[str, int]:
    """The line at ``i`` with its backslash continuations, and the index after it."""
    text = lines[i]
    while text.rstrip().endswith("\\") and i + 1 < len(lines):
        i += 1
        text = text.rstrip()[:-1].rstrip() + " " + lines[i].strip()
    return text, i + 1


def _runs_something(text: str) -> bool:
    words = text.split()
    while words and ENV_WORD.match(words[0]):
        words = words[1:]
    return bool(words) and words[0] in COMMAND_WORDS


def commands_in(path: Path) -> list[Command]:
    """Every command line shown in a Markdown file: shell fences, indented code, inline ``python -m`` / ``torchrun``."""
    name = path.relative_to(ROOT).as_posix()
    lines = path.read_text().splitlines()
    out: list[Command] = []
    prose = list(lines)  # the lines outside fences and indented code, for inline code (blanked inside them)
    fence: str | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fence = None if fence is not None else (line.strip()[3:].split() or [""])[0]
            prose[i] = ""
            i += 1
            continue
        if fence is not None or (
            line.startswith("    ") and (i == 0 or not lines[i - 1].strip() or not prose[i - 1]) and fence is None
        ):
            indented = fence is None
            if indented and not _runs_something(line.strip().removeprefix("$ ")):
                i += 1
                continue
            start = i
            text, i = _join(lines, i)
            for k in range(start, i):
                prose[k] = ""
            if fence is not None and fence not in SHELL_FENCES:
                continue
            shown = _shell_text(text, console=fence == "console")
            if shown and _runs_something(shown):
                out.append(Command(name, start + 1, shown))
            continue
        i += 1
    text = "\n".join(prose)
    for m in re.finditer(r"`([^`]+)`", text):
        span = " ".join(m.group(1).split())
        if _runs_something(span) and re.match(r"^(\S+=\S+ )*(python3? -m |torchrun )", _without_placeholders(span)):
            out.append(Command(name, text.count("\n", 0, m.start()) + 1, span))
    return sorted(out, key=lambda c: c.line)


def _without_placeholders(text: str) -> str:
    return re.sub(r"<[^<>]*>", "<PLACEHOLDER>", text)


COMMANDS = [c for path in DOC_FILES for c in commands_in(path)]


# --- what a line runs -------------------------------------------------------------------------------------------


@dataclass
class Parsed:
    env: dict[str, str]
    words: list[str]
    placeholder: bool


def parse_line(text: str) -> Parsed:
    """Environment assignments and words of a command (a trailing comment dropped); ValueError if it does not split."""
    words = shlex.split(_without_placeholders(text), comments=True)
    env = {}
    while words and ENV_WORD.match(words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return Parsed(env, words, any(PLACEHOLDER.search(w) for w in words))


def module_of(words: list[str]) -> tuple[str, list[str]] | None:
    """(module, its arguments) of ``python -m MODULE …`` or ``torchrun … -m MODULE …``."""
    if words and words[0] in ("python", "python3", "torchrun") and "-m" in words:
        i = words.index("-m")
        if i + 1 < len(words):
            return words[i + 1], words[i + 2 :]
    return None


def flags(args: list[str]) -> list[str]:
    """The long options of a command's arguments (before a bare ``--``, after which they belong to another tool)."""
    out = []
    for word in args:
        if word == "--":
            break
        m = FLAG.match(word)
        if m:
            out.append(m.group(1))
    return out


def overrides_of(args: list[str]) -> tuple[str | None, list[list[str]]]:
    """(--config, the override lists to resolve) of a study or run line: positional and --set ``key=value`` words,
    each value of a ``--grid key=v1,v2``, each method of ``--methods``."""
    config, base, variants = None, [], []
    for prev, word in zip(["", *args], args):
        if prev == "--config":
            config = word
        elif word.startswith("--config="):
            config = word.split("=", 1)[1]
        elif prev == "--grid":
            key, _, values = word.partition("=")
            variants += [[f"{key}={v}"] for v in values.split(",")]
        elif prev == "--methods":
            variants += [[f"algorithm.name={m}"] for m in word.split(",")]
        elif OVERRIDE.match(word) and prev != "--method-set":
            base.append(word)
    return config, [base + v for v in variants] or [base]


def _in_help(flag: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


@dataclass(frozen=True)
class Help:
    code: int
    text: str


HelpOf = Callable[[str, str], Help]
"""(module, subcommand or "") -> the module's --help."""


@cache
def help_of(module: str, sub: str = "") -> Help:
    argv = [sys.executable, "-m", module, *([sub] if sub else []), "--help"]
    try:
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        return Help(-1, "timed out")
    return Help(done.returncode, done.stdout + done.stderr)


def subcommands(help_text: str) -> set[str]:
    """The subcommands an argparse usage line offers (``{list,run,table}``)."""
    m = re.search(r"\{([\w,-]+)\}", help_text)
    return set(m.group(1).split(",")) if m else set()


def _resolve(config: str | None, overrides: list[str]) -> str | None:
    from hosfl_dist.config import load_config
    from hosfl_dist.errors import HosflError

    try:
        load_config(config, overrides)
    except (HosflError, OSError) as exc:
        return f"config {config} with {' '.join(overrides) or 'no overrides'}: {exc}"
    return None


def _check_run(args: list[str], placeholder: bool) -> list[str]:
    """A hosfl_dist.run command line: its parser, then its config."""
    from hosfl_dist.cli.run import parse_args

    if placeholder:  # the words cannot be parsed as given: check the flags against the parser's options
        return [f"hosfl_dist.run has no option {f}" for f in flags(args) if not _in_help(f, _run_help())]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parsed = parse_args(args)
    except SystemExit:
        return [f"hosfl_dist.run's parser refuses it: {err.getvalue().strip().splitlines()[-1]}"]
    if parsed.help_config is not None:
        from hosfl_dist.cli.config_help import help_config
        from hosfl_dist.errors import ConfigError

        try:
            help_config(parsed.help_config)
        except ConfigError as exc:
            return [str(exc)]
        return []
    if parsed.status is not None or parsed.record_death:
        return []
    problem = _resolve(parsed.config, parsed.overrides)
    return [problem] if problem else []


@cache
def _run_help() -> str:
    from hosfl_dist.cli.run import parse_args

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        parse_args(["--help"])
    return out.getvalue()


def _check_pytest(args: list[str]) -> list[str]:
    markers = re.search(r"^markers = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), flags=re.S | re.M)
    declared = set(re.findall(r'^\s*"(\w+):', markers.group(1), flags=re.M)) if markers else set()
    problems = []
    for prev, word in zip(["", *args], args):
        if prev == "-m":
            unknown = set(re.findall(r"\w+", word)) - declared - {"and", "or", "not"}
            problems += [f"pytest marker {m!r} is not declared in pyproject.toml" for m in sorted(unknown)]
        elif not word.startswith("-") and prev not in ("-k", "-m") and not (ROOT / word.split("::")[0]).exists():
            problems.append(f"pytest path {word} does not exist")
    return problems


def check_command(text: str, helps: HelpOf = help_of) -> list[str]:
    """What is wrong with one shown command line (empty when it still parses)."""
    try:
        line = parse_line(text)
    except ValueError as exc:
        return [f"cannot be split into words: {exc}"]
    words = line.words
    if not words:
        return []
    problems: list[str] = []
    if words[0] in ("bash", "sbatch"):
        scripts = [w for w in words[1:] if not w.startswith("-") and (ROOT / w).suffix in (".sh", ".sbatch", "")]
        script = next((w for w in scripts if "/" in w), None)
        if script is None:
            return [f"{words[0]}: no script named"]
        if not (ROOT / script).is_file():
            return [f"{words[0]}: {script} does not exist"]
        if script in SCRIPT_CONFIG and not line.placeholder:
            args = words[words.index(script) + 1 :]
            problem = _resolve(line.env.get("CONFIG", "configs/quickstart.yaml"), [a for a in args if "=" in a])
            problems += [problem] if problem else []
        return problems
    target = module_of(words)
    if words[0] == "torchrun":
        before = words[1 : words.index("-m")] if "-m" in words else words[1:]
        torchrun_help = helps("torch.distributed.run", "")
        problems += [f"torchrun has no option {f}" for f in flags(before) if not _in_help(f, torchrun_help.text)]
        if target is not None and "OMP_NUM_THREADS" not in line.env:
            problems.append("torchrun without OMP_NUM_THREADS=1 prints a warning on every launch: set it on the line")
    if target is None:
        return problems
    module, args = target
    if PLACEHOLDER.search(module):
        return problems
    if module == "hosfl_dist.run":
        return problems + _check_run(args, line.placeholder)
    if module == "pytest":
        return problems + _check_pytest(args)
    base = helps(module, "")
    if base.code != 0:
        return problems + [f"python -m {module} --help exits {base.code}: {base.text.strip()[-300:]}"]
    sub = args[0] if args and args[0] in subcommands(base.text) else ""
    shown = helps(module, sub) if sub else base
    if shown.code != 0:
        return problems + [f"python -m {module} {sub} --help exits {shown.code}: {shown.text.strip()[-300:]}"]
    command = f"python -m {module}{' ' + sub if sub else ''}"
    problems += [f"{command} has no option {f} (not in its --help)" for f in flags(args) if not _in_help(f, shown.text)]
    if "--config" in args and not line.placeholder:
        config, variants = overrides_of(args)
        problems += [p for overrides in variants if (p := _resolve(config, overrides))]
    return problems


def _helps_needed() -> set[tuple[str, str]]:
    needed = set()
    for command in COMMANDS:
        try:
            line = parse_line(command.text)
        except ValueError:
            continue
        target = module_of(line.words)
        if line.words and line.words[0] == "torchrun":
            needed.add(("torch.distributed.run", ""))
        if target and target[0] not in ("hosfl_dist.run", "pytest") and not PLACEHOLDER.search(target[0]):
            needed.add((target[0], target[1][0] if target[1] and not target[1][0].startswith("-") else ""))
    return needed


@pytest.fixture(scope="module")
def helps() -> HelpOf:
    """Every --help the shown lines need, run once each, four at a time (the file stays under a minute)."""
    needed = _helps_needed()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda m: help_of(m[0]), {m for m, _ in needed}))
        subs = [(m, s) for m, s in needed if s and s in subcommands(help_of(m).text)]
        list(pool.map(lambda ms: help_of(*ms), subs))
    return help_of


# --- the tests ----------------------------------------------------------------------------------------------------


def test_the_documents_show_commands():
    assert len(COMMANDS) > 30, [str(c) for c in COMMANDS]
    readme = [c.text for c in COMMANDS if c.file == "README.md"]
    assert "python -m pytest -q tests" in readme  # README's test command, in a ```bash block: CI runs it
    assert re.search(r"```bash\npython -m pytest -q tests\n```", (ROOT / "README.md").read_text())


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_shown_command_still_parses(command: Command, helps: HelpOf, request):
    target = module_of(parse_line(command.text).words)
    if target and target[0] in PENDING_MODULES and importlib.util.find_spec(target[0]) is None:
        request.applymarker(pytest.mark.xfail(strict=False, reason=PENDING))
    problems = check_command(command.text, helps)
    assert not problems, f"{command}: {command.text}\n" + "\n".join(f"  - {p}" for p in problems)


def test_the_checker_reports_a_broken_line(helps: HelpOf):
    """A mistyped key, an unknown flag, a missing script and a bare torchrun are each reported, naming what failed."""
    key = check_command("python -m hosfl_dist.run --config configs/quickstart.yaml zo.num_perturbationz=8", helps)
    assert len(key) == 1 and "zo.num_perturbationz" in key[0], key
    run_flag = check_command("python -m hosfl_dist.run --config configs/quickstart.yaml --dry-runn", helps)
    assert len(run_flag) == 1 and "--dry-runn" in run_flag[0], run_flag
    flag = check_command("python -m hosfl_dist.experiments.compare --config configs/quickstart.yaml --methodz hosfl")
    assert flag == ["python -m hosfl_dist.experiments.compare has no option --methodz (not in its --help)"]
    sub_flag = check_command("python -m bench run zo_step --outt /tmp/b", helps)
    assert sub_flag == ["python -m bench run has no option --outt (not in its --help)"]
    study = check_command(
        "python -m hosfl_dist.experiments.sweep --config configs/quickstart.yaml --grid zo.pp=1,2 --out o"
    )
    assert len(study) == 2 and all("zo.pp" in p for p in study), study
    assert check_command("bash launch/nope.sh") == ["bash: launch/nope.sh does not exist"]
    bare = check_command("torchrun --nproc_per_node=2 -m hosfl_dist.run --config configs/quickstart.yaml", helps)
    assert bare == ["torchrun without OMP_NUM_THREADS=1 prints a warning on every launch: set it on the line"]
    missing = check_command("python -m hosfl_dist.nope --out x", helps)
    assert len(missing) == 1 and "python -m hosfl_dist.nope --help exits 1" in missing[0], missing
    # a placeholder spares the config, not the flags
    assert check_command("python -m hosfl_dist.run --config X.yaml --check --nproc N …", helps) == []
    assert check_command("python -m hosfl_dist.run --config X.yaml --chek", helps) == [
        "hosfl_dist.run has no option --chek"
    ]


def test_the_extractor_reads_every_kind_of_shown_line(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Text `python -m bench list` and `pip install x`.\n\n"
        "```bash\n# a comment\nOMP_NUM_THREADS=1 torchrun --nproc_per_node=2 -m hosfl_dist.run \\\n"
        "    --config c.yaml  # trailing\n. .venv/bin/activate\n```\n\n"
        "```console\n$ bash launch/x.sh\noutput line\n```\n\n"
        "```yaml\n# python -m hosfl_dist.run --config y.yaml\n```\n\n"
        "    python -m hosfl_dist.export run --out e\n"
    )
    shown = [(c.line, c.text) for c in commands_in(doc)]
    assert shown == [
        (1, "python -m bench list"),
        (5, "OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 -m hosfl_dist.run --config c.yaml  # trailing"),
        (11, "bash launch/x.sh"),
        (19, "python -m hosfl_dist.export run --out e"),
    ]
    line = parse_line(shown[1][1])
    assert line.env == {"OMP_NUM_THREADS": "1"} and line.words[-1] == "c.yaml" and not line.placeholder


# --- results/: a report, not a store of raw files ----------------------------------------------------------------

RESULTS_MAX_FILES = 150
"""What results/ may hold: its READMEs, tables, figures, scripts and one archive per experiment (issue 43, item 6)."""
PACKED_RUNS = ["finetune", "studies"]
"""Experiments whose runs.tar.xz the experiment's summarize step reads back: every run a table lists must be in it."""


def _gitignore_rules(path: Path) -> list[tuple[re.Pattern[str], bool]]:
    """The patterns of one .gitignore as (regex over a path relative to its folder, folders only). Only what git's
    syntax offers and these files use: anchored and unanchored patterns, ``*``, ``?``, ``**``, a trailing ``/``."""
    rules = []
    for raw in path.read_text().splitlines():
        line = raw.rstrip()
        if not line or line.startswith("#"):
            continue
        assert not line.startswith("!"), f"{path}: a negated pattern ({line}) is not read by this walk"
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        anchored = "/" in line
        parts = re.split(r"(\*\*/|/\*\*$|\*\*|\*|\?)", line.lstrip("/"))
        regex = {"**/": "(?:.*/)?", "/**": "/.*", "**": ".*", "*": "[^/]*", "?": "[^/]"}
        body = "".join(regex.get(part, re.escape(part)) for part in parts)
        rules.append((re.compile(("" if anchored else "(?:.*/)?") + body), dir_only))
    return rules


@cache
def _rules_of(folder: Path) -> list[tuple[re.Pattern[str], bool]]:
    return _gitignore_rules(folder / ".gitignore") if (folder / ".gitignore").is_file() else []


def _matched(path: Path, is_dir: bool) -> bool:
    """Whether a pattern of a .gitignore in a folder above ``path`` (the repository's root included) matches it."""
    for folder in path.parents:
        rel = path.relative_to(folder).as_posix()
        if any(regex.fullmatch(rel) and (is_dir or not dir_only) for regex, dir_only in _rules_of(folder)):
            return True
        if folder == ROOT:
            return False
    raise AssertionError(f"{path} is outside {ROOT}")


def _ignored(path: Path, is_dir: bool) -> bool:
    """Whether git ignores a path under the repository: it, or a folder above it, is matched."""
    above = [folder for folder in path.parents if folder.is_relative_to(ROOT) and folder != ROOT]
    return _matched(path, is_dir) or any(_matched(folder, is_dir=True) for folder in above)


def _walk_results() -> list[str]:
    """results/'s files that git would list: the folders and files no .gitignore ignores (a checkout without git)."""
    found = []
    for folder, dirs, files in os.walk(ROOT / "results"):
        here = Path(folder)
        dirs[:] = sorted(d for d in dirs if not _ignored(here / d, is_dir=True))
        found += [(here / f).relative_to(ROOT).as_posix() for f in files if not _ignored(here / f, is_dir=False)]
    return sorted(found)


def _git_results() -> list[str] | None:
    """results/'s tracked files and its untracked ones no ignore rule covers (what a commit of everything would hold),
    or None where this is not a git checkout."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    cmd = ["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard", "-z", "--", "results"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return sorted(set(proc.stdout.split("\0")) - {""}) if proc.returncode == 0 else None


@cache
def results_files() -> tuple[str, ...]:
    listed = _git_results()
    return tuple(_walk_results() if listed is None else listed)


RESULT_PAGES = [ROOT / f for f in results_files() if f.endswith(".md") and (ROOT / f).is_file()]


def _archives() -> list[Path]:
    return [ROOT / f for f in results_files() if re.fullmatch(r"results/[^/]+/(runs|records)\.tar\.xz", f)]


def test_results_hold_at_most_150_files():
    files = results_files()
    by_folder: dict[str, int] = {}
    for f in files:
        top = f.split("/")[1] if f.count("/") > 1 else "."
        by_folder[top] = by_folder.get(top, 0) + 1
    largest = ", ".join(f"{d}/ {n}" for d, n in sorted(by_folder.items(), key=lambda kv: -kv[1])[:4])
    assert len(files) <= RESULTS_MAX_FILES, (
        f"results/ holds {len(files)} files, more than {RESULTS_MAX_FILES} (largest: {largest}): pack an experiment's "
        "per-run or per-point files (json records, logs, per-seed tables) into its runs.tar.xz or records.tar.xz (a "
        "case in results/pack_runs.sh, the files in results/.gitignore, its README saying how to unpack), merge small "
        "markdown files into its README, or drop what a committed script makes again where the README says how"
    )


def test_the_walk_without_git_lists_what_git_lists():
    """The count holds in a copy without git too: the .gitignore walk gives git's own listing of this checkout."""
    listed = _git_results()
    if listed is None:
        pytest.skip("not a git checkout")
    assert _walk_results() == [f for f in listed if (ROOT / f).is_file()]


@pytest.mark.parametrize("archive", _archives(), ids=lambda p: p.relative_to(ROOT / "results").as_posix())
def test_an_archives_files_stay_out_of_the_tree_once_unpacked(archive: Path):
    """Unpacking an archive where its files were written adds nothing git would list, and no packed file is also in
    the tree: otherwise every unpack pushes results/ past its limit, or a record is kept twice and drifts."""
    with tarfile.open(archive) as tar:
        members = [archive.parent / m.name for m in tar.getmembers() if m.isfile()]
    assert members
    tracked = set(results_files())
    name = archive.relative_to(ROOT)
    twice = [m.relative_to(ROOT).as_posix() for m in members if m.relative_to(ROOT).as_posix() in tracked]
    listed = [m.relative_to(ROOT).as_posix() for m in members if not _ignored(m, is_dir=False)]
    assert not twice, f"in {name} and in the tree (git rm one of them): {twice[:5]}"
    assert not listed, f"{name} unpacks files git would list (add them to results/.gitignore): {listed[:5]}"


@pytest.mark.parametrize("experiment", PACKED_RUNS)
def test_a_packed_experiments_tables_have_their_runs_in_its_archive(experiment: str):
    """results/<experiment>/runs.tar.xz holds every run its tables list, whether a table is kept in the tree
    (studies) or packed beside its runs (finetune): a table whose run folders were never packed stops the
    experiment's summarize.py (and run.sh, which ends with it) on a fresh checkout."""
    from hosfl_dist.experiments.runs import safe_name

    root = ROOT / "results" / experiment
    with tarfile.open(root / "runs.tar.xz") as archive:
        packed = set(archive.getnames())
        members = [m for m in archive.getmembers() if m.name.endswith("table.json")]
        tables = {m.name: json.load(archive.extractfile(m)) for m in members}
    prefix = f"results/{experiment}/"
    for f in results_files():
        if f.startswith(prefix) and f.endswith("/table.json"):
            tables.setdefault(f.removeprefix(prefix), json.loads((ROOT / f).read_text()))
    assert tables
    runs = [
        f"{Path(name).parent.as_posix()}/runs/{safe_name(row['variant'])}/seed{seed}"
        for name, table in sorted(tables.items())
        for row in table["rows"]
        for seed in row["seeds"]
    ]
    missing = [run for run in runs if f"{run}/summary.json" not in packed]
    assert not missing, f"not in results/{experiment}/runs.tar.xz (bash results/pack_runs.sh {experiment}): {missing}"


@pytest.mark.parametrize("script", ["finetune/summarize.py", "elastic/combine.py"])
def test_a_summary_script_with_its_tables_still_packed_stops_before_it_writes(script: str, tmp_path: Path):
    """Run on a fresh checkout (its tables still in the archive), the script that collects an experiment's tables
    says how to unpack them and exits 2, rather than writing the committed summary again from no table at all."""
    here = tmp_path / Path(script).parent
    here.mkdir()
    shutil.copy(ROOT / "results" / script, here)
    (here / "runs.tar.xz").touch()  # what a checkout has: the archive, not what it holds
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(here / Path(script).name)], capture_output=True, text=True, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "tar xJf results/" in proc.stderr
    assert sorted(p.name for p in here.iterdir()) == sorted([Path(script).name, "runs.tar.xz"])


# --- links and the generated page ---------------------------------------------------------------------------------


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def _links(path: Path) -> list[tuple[int, str]]:
    text = re.sub(r"```.*?```", lambda m: "\n" * m.group().count("\n"), path.read_text(), flags=re.S)
    text = re.sub(r"`[^`]*`", lambda m: "\n" * m.group().count("\n"), text)
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in re.finditer(r"\]\(([^)\s]+)\)", text)]


@pytest.mark.parametrize("path", DOC_FILES + RESULT_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path: Path):
    broken = []
    for line, target in _links(path):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        shown = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
        if not dest.exists():
            if shown not in PENDING_LINKS:
                broken.append(f"{path.name}:{line}: {target} -> {shown} does not exist")
            continue
        if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{path.name}:{line}: {target} -> no heading #{anchor} in {shown}")
    assert not broken, "\n".join(broken)


def test_every_docs_page_says_what_it_covers():
    for path in DOC_FILES[1:]:
        blocks = path.read_text().split("\n\n")
        assert blocks[0].startswith("# ") and len(blocks) > 1, path
        assert blocks[1][0].isalpha() or blocks[1][0] == "`", f"{path}: the page should open with a paragraph"


def test_configuration_page_is_generated_from_the_config_tree():
    from hosfl_dist.cli.config_help import MARKDOWN_COMMAND, markdown_config

    page = ROOT / "docs" / "configuration.md"
    assert page.read_text() == markdown_config(), f"docs/configuration.md is out of date: run `{MARKDOWN_COMMAND}`"
