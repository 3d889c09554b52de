"""``python -m hosfl_dist.run --help-config [section]``: every config key with its type, default and docstring.

Generated from the dataclasses of :mod:`hosfl_dist.config.schema`: the types from their annotations, the defaults
from a default :class:`~hosfl_dist.config.Config`, the text from the string literal under each field (attribute
docstrings are not kept at run time, so they are read from the module's source with :mod:`ast`). Torch-free: the
checks that consult the algorithm registry, which imports torch (6 s on the 2-core machine), are not the tree's
(:mod:`hosfl_dist.runtime.checks`), so the help answers in a fraction of a second.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
import typing
from functools import cache
from typing import Any

from hosfl_dist.config import schema
from hosfl_dist.config import Config
from hosfl_dist.config.preset import preset_names, read_preset
from hosfl_dist.errors import ConfigError

WIDTH = 100


@cache
def field_docs() -> dict[str, dict[str, str]]:
    """class name -> field name -> the docstring under the field, for every class of hosfl_dist.config.schema."""
    tree = ast.parse(inspect.getsource(schema))
    out: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs = out.setdefault(node.name, {})
        body = node.body
        for stmt, after in zip(body, body[1:], strict=False):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return out


def _doc(cls: type, name: str) -> str:
    for klass in cls.__mro__:  # a section may inherit its fields (CommConfig from LinkConfig)
        doc = field_docs().get(klass.__name__, {}).get(name)
        if doc:
            return doc
    return ""


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(tp, "__name__", str(tp))


def _entries(obj: Any, prefix: str) -> list[tuple[str, str, Any, str, bool]]:
    """(dotted key, type, default, docstring, is a section) for ``obj`` and, depth first, its sub-sections."""
    cls = type(obj)
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        key, value = f"{prefix}{f.name}", getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.append((key, "", None, _doc(cls, f.name), True))
            out += _entries(value, f"{key}.")
        else:
            out.append((key, _type_name(hints[f.name]), value, _doc(cls, f.name), False))
    return out


def help_config(section: str = "", plugins: list[str] | tuple[str, ...] = ()) -> str:
    """The help text of every key under ``section`` (all keys when empty); with ``plugins`` (``--plugin``), the methods,
    tasks, models and zeroth-order estimators they register are listed under ``algorithm.name``, ``data.name``,
    ``model.name`` and ``zo.estimator``."""
    added: dict[str, list[str]] = {}
    if plugins:  # the registries import torch: only when plug-ins are asked for
        from hosfl_dist.algorithms import load_plugins
        from hosfl_dist.core.estimators import estimator_names
        from hosfl_dist.data.registry import task_names
        from hosfl_dist.models.registry import model_names

        names = {"data.name": task_names, "model.name": model_names, "zo.estimator": estimator_names}
        before = {key: set(listed()) for key, listed in names.items()}
        added["algorithm.name"] = load_plugins(plugins, "--plugin")
        for key, listed in names.items():
            added[key] = sorted(set(listed()) - before[key])
    entries = _entries(Config(), "")
    sections = [k for k, *_, is_section in entries if is_section]
    if section and section not in sections:
        raise ConfigError(f"--help-config: no section {section!r}; sections: {', '.join(sections)}")
    lines = [] if section else ["Config keys (defaults < YAML < dotted overrides: section.key=value)", ""]
    for key, type_name, default, doc, is_section in entries:
        if section and not (key == section or key.startswith(section + ".")):
            continue
        if is_section:
            lines += ([""] if lines and lines[-1] else []) + [f"{key}:" + (f"  {' '.join(doc.split())}" if doc else "")]
            continue
        lines.append(f"  {key}: {type_name} = {default!r}")
        for para in doc.split("\n\n"):  # the source's line breaks are layout: reflow each paragraph
            lines += textwrap.wrap(" ".join(para.split()), WIDTH, initial_indent=" " * 6, subsequent_indent=" " * 6)
        if key in added:
            lines.append(f"      From the plug-ins ({', '.join(plugins)}): {', '.join(added[key]) or 'none'}")
    if not section:
        lines += ["", "Presets (preset=<name>: over the YAML file, under every key=value override):"]
        for name, about, models, values in _presets():
            lines.append(f"  {name} (model.name {' / '.join(models)}):")
            lines += textwrap.wrap(" ".join(f"{k}={v}" for k, v in values), WIDTH, initial_indent=" " * 6,
                                   subsequent_indent=" " * 6)  # fmt: skip
            lines += textwrap.wrap(about, WIDTH, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines).rstrip() + "\n"


def _leaves(values: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for key, value in values.items():
        if isinstance(value, dict):
            out += _leaves(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _presets() -> list[tuple[str, str, list[str], list[tuple[str, Any]]]]:
    """(name, about, models, dotted values) of every preset (:mod:`hosfl_dist.config.preset`)."""
    out = []
    for name in preset_names():
        data = read_preset(name)
        out.append((name, " ".join(str(data.get("about", "")).split()), [str(m) for m in data["models"]],
                    _leaves(data["set"])))  # fmt: skip
    return out


MARKDOWN_COMMAND = "python -m hosfl_dist.config_help --markdown > docs/configuration.md"
"""The command that writes docs/configuration.md (tests/test_docs.py compares the committed file with its output)."""


def _cell(text: str) -> str:
    """``text`` as one Markdown table cell: one line, pipes escaped, and no ``<name>`` read as an HTML tag or ``*`` as
    emphasis (backslash escapes, which GitHub renders as the bare character)."""
    for char in ("\\", "|", "*", "<"):
        text = text.replace(char, "\\" + char)
    return text


def _code(text: str) -> str:
    """``text`` as a code span of a table cell (a pipe still needs its backslash inside a span)."""
    return "`" + text.replace("|", "\\|") + "`"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens dropped, spaces as hyphens."""
    return "".join(c for c in heading.lower() if c.isalnum() or c in " -_").replace(" ", "-")


def markdown_config() -> str:
    """Every config key as Markdown (docs/configuration.md): a section per config section, each a table of key,
    type, default and meaning, generated like :func:`help_config` from :mod:`hosfl_dist.config`."""
    entries = _entries(Config(), "")
    sections = [(key, doc) for key, _, _, doc, is_section in entries if is_section]
    intro = (
        "Every key of the config tree (`hosfl_dist/config/schema.py`) with its type, default and meaning, a table per"
        " section. A run's config is the defaults, then a YAML file (`--config`), then dotted overrides on the"
        " command line (`section.key=value`); an unknown key, a wrongly typed value or an invalid combination stops"
        " the run with one `error:` line naming the key ([running.md](running.md#configuration) says how files and"
        " overrides are read). `python -m hosfl_dist.run --help-config [SECTION]` prints the same in a terminal."
    )
    index = "Sections: " + ", ".join(f"[`{key}`](#{_anchor(key)})" for key, _ in sections) + "."
    lines = [
        "# Configuration",
        "",
        textwrap.fill(intro, 120, break_on_hyphens=False),
        "",
        "<!-- Generated from hosfl_dist/config/schema.py by",
        f"     `{MARKDOWN_COMMAND}`; edit the docstrings there, not this file. -->",
        "",
        textwrap.fill(index, 120, break_on_hyphens=False),
    ]
    for key, type_name, default, doc, is_section in entries:
        if is_section:
            lines += ["", f"## {key}", ""]
            if doc:
                lines += [" ".join(doc.split()), ""]
            lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
            continue
        meaning = "<br><br>".join(_cell(" ".join(para.split())) for para in doc.split("\n\n"))
        lines.append(f"| {_code(key)} | {_code(type_name)} | {_code(repr(default))} | {meaning} |")
    lines += [
        "",
        "## Presets",
        "",
        textwrap.fill(
            "A preset is a named set of values one source gives (`hosfl_dist/config/presets/<name>.yaml`): an override"
            " `preset=<name>` puts its values over the YAML file and under every `key=value` override, wherever it"
            " stands; a YAML file's top-level `preset: <name>` puts them under the file's own sections. A preset names"
            " the models it is written for and is refused for another. What ran is the values: a run's config.yaml"
            " holds them, not the preset's name.",
            120,
            break_on_hyphens=False,
        ),
        "",
        "| preset | models | values | whose |",
        "|---|---|---|---|",
    ]
    for name, about, models, values in _presets():
        shown_values = "<br>".join(_code(f"{k}={v}") for k, v in values)
        lines.append(f"| {_code(name)} | {', '.join(models)} | {shown_values} | {_cell(about)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m hosfl_dist.config_help",
        description="Every config key with its type, default and meaning (as python -m hosfl_dist.run --help-config).",
    )
    p.add_argument("section", nargs="?", default="", help="only the keys of this section (e.g. zo, clients.optim)")
    p.add_argument("--markdown", action="store_true", help=f"all keys as Markdown: {MARKDOWN_COMMAND}")
    args = p.parse_args(argv)
    if args.markdown:
        if args.section:
            p.error("--markdown writes every section; leave SECTION out")
        print(markdown_config(), end="")
        return 0
    try:
        print(help_config(args.section), end="")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
