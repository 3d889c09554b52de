"""YAML from the user, read as untrusted data: the one loader of every config file and dotted override.

:class:`SafeLoader` is PyYAML's safe loader (plain data, no Python objects) with bounds on what a small text may
make the loader do:

- a file larger than :data:`MAX_FILE_BYTES` is refused before it is parsed, without echoing it;
- aliases are expanded as copies in the count of values, which may not exceed :data:`MAX_VALUES`, so a "billion
  laughs" (nine lines, 10^9 strings once expanded) stops at its first line past the bound instead of filling memory;
  an alias inside its own anchor (a recursive structure) is refused;
- nesting deeper than :data:`MAX_DEPTH` is refused (Python's recursion limit would otherwise end in a traceback);
- a key given twice in one mapping is refused, naming the key and both lines (YAML requires unique keys; PyYAML
  keeps the last value silently), and so are two keys Python takes for one (``1`` and ``true``);
- a value the constructor cannot build (a date that does not exist, an integer of 10,000 digits) is refused at its
  line.

Plain scalars are read by YAML 1.2's core schema (:data:`CORE_SCHEMA`), not PyYAML's YAML 1.1: integers are decimal
(``02000`` is 2000) unless written ``0o17`` or ``0x1F``; there is no base 60 (``1:30`` is text); floats are
``[-+]?(.D+|D+(.D*)?)([eE][-+]?D+)?`` and ``.inf``/``.nan``; booleans are true/false alone (``yes``, ``no``, ``on``,
``off`` are text); ``null``, ``~`` and the empty value are null; dates are text. ``<<`` merge keys are kept. A number
remembers the scalar it was read from (:class:`WrittenInt`, :class:`WrittenFloat`), so a key that takes text can take
it as written (``0x10``, ``007``, ``1e3``). :class:`SafeDumper` quotes every string that YAML 1.2 or 1.1 would read as
something else, so what it writes reads back the same under either.

Every refusal is a :class:`~hosfl_dist.errors.ConfigError` of one line naming where, never the offending text beyond
a short excerpt. Torch-free.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from hosfl_dist.errors import ConfigError

MAX_FILE_BYTES = 1 << 20
"""Largest config file read (1 MiB); the shipped configs hold 0.5-2 KB."""
MAX_VALUES = 100_000
"""Most values (scalars, lists and mappings, aliases counted as copies) one document may expand to."""
MAX_DEPTH = 64
"""Deepest nesting of lists and mappings."""
EXCERPT = 80
"""Characters of the input a message may quote."""

MERGE_TAG = "tag:yaml.org,2002:merge"
NULL_TAG, BOOL_TAG, INT_TAG, FLOAT_TAG = (f"tag:yaml.org,2002:{t}" for t in ("null", "bool", "int", "float"))

DIGITS = r"[0-9](?:_?[0-9])*"
"""Decimal digits, an underscore allowed between two of them (``3_072``, ``1_000.5``, ``1e-3_0`` = 1e-30), as
Python's int() and float() read them: one rule for every number of a config, in YAML and in overrides alike; an
underscore first, last, doubled or beside a point or an e is no number (``_3``, ``3_``, ``3__0``, ``1_.5``)."""
_FLOAT = (rf"[-+]?(?:\.{DIGITS}|{DIGITS}(?:\.(?:{DIGITS})?)?)(?:[eE][-+]?{DIGITS})?|[-+]?\.(?:inf|Inf|INF)"
          r"|\.(?:nan|NaN|NAN)")  # fmt: skip
CORE_SCHEMA: list[tuple[str, re.Pattern[str], str]] = [
    (NULL_TAG, re.compile(r"(?:null|Null|NULL|~|)\Z"), "~nN"),
    (BOOL_TAG, re.compile(r"(?:true|True|TRUE|false|False|FALSE)\Z"), "tTfF"),
    (INT_TAG, re.compile(rf"(?:[-+]?{DIGITS}|0o[0-7]+|0x[0-9a-fA-F]+)\Z"), "-+0123456789"),
    (FLOAT_TAG, re.compile(f"(?:{_FLOAT})\\Z"), "-+.0123456789"),
]
"""YAML 1.2's core schema (spec 10.3.2) as (tag, regexp, first characters): how a plain scalar is resolved, the first
match in this order winning (an integer before the float that would also match); decimal numbers may hold
underscores between digits (:data:`DIGITS`)."""
_CORE = {tag: regexp for tag, regexp, _ in CORE_SCHEMA}


def _add_core_schema(cls: type[yaml.SafeLoader] | type[yaml.SafeDumper]) -> None:
    for tag, regexp, first in CORE_SCHEMA:
        cls.add_implicit_resolver(tag, regexp, [*first, ""] if tag == NULL_TAG else list(first))  # "": empty value


class WrittenInt(int):
    """An integer read from YAML, with ``text``, the scalar as written (``02000``, ``0x10``): a str key takes it."""

    text: str

    def __new__(cls, value: int, text: str) -> WrittenInt:
        self = super().__new__(cls, value)
        self.text = text
        return self

    def __getnewargs__(self) -> tuple[int, str]:
        return int(self), self.text


class WrittenFloat(float):
    """A float read from YAML, with ``text``, the scalar as written (``1e3``, ``.5``): a str key takes it."""

    text: str

    def __new__(cls, value: float, text: str) -> WrittenFloat:
        self = super().__new__(cls, value)
        self.text = text
        return self

    def __getnewargs__(self) -> tuple[float, str]:
        return float(self), self.text


# A message that names a value's type names what YAML read (an int, a float), wherever it comes from: the loaded data
# reach every reader of a config or setup file, and type(value).__name__ is how they say what they got.
WrittenInt.__name__ = "int"
WrittenFloat.__name__ = "float"


class UntrustedYAMLError(yaml.YAMLError):
    """A bound of :class:`SafeLoader` was exceeded; ``problem`` and ``problem_mark`` as PyYAML's errors have them."""

    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


class SafeLoader(yaml.SafeLoader):
    """yaml.SafeLoader with YAML 1.2's core schema, bounded alias expansion and nesting, unique keys and one-line
    construction errors."""

    yaml_implicit_resolvers: dict[str, list] = {}  # YAML 1.1's left behind: filled from CORE_SCHEMA below

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._values: dict[int, int] = {}  # id(node) -> its values once aliases are expanded
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            node = self.anchors.get(event.anchor)
            if node is not None and id(node) not in self._values:
                raise UntrustedYAMLError(f"alias *{_excerpt(event.anchor)} refers to its own anchor (a recursive "
                                         "structure)", event.start_mark)  # fmt: skip
            return super().compose_node(parent, index)
        mark = self.peek_event().start_mark
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise UntrustedYAMLError(f"nested deeper than {MAX_DEPTH} levels", mark)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if isinstance(node, SequenceNode):
            count = 1 + sum(self._values[id(child)] for child in node.value)
        elif isinstance(node, MappingNode):
            count = 1 + sum(self._values[id(k)] + self._values[id(v)] for k, v in node.value)
        else:
            count = 1
        if count > MAX_VALUES:
            raise UntrustedYAMLError(f"expands to more than {MAX_VALUES:,} values (aliases count as copies)", mark)
        self._values[id(node)] = count
        return node

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError, TypeError) as exc:  # a date that does not exist, 10,000 digits
            raise UntrustedYAMLError(f"cannot read the value ({_excerpt(str(exc))})", node.start_mark) from None

    def construct_mapping(self, node: Node, deep: bool = False) -> dict:
        if isinstance(node, MappingNode):
            seen: dict[Any, Node] = {}
            for key_node, _ in node.value:  # the keys as written: before merge keys (<<) are flattened in
                if key_node.tag == MERGE_TAG or not isinstance(key_node, ScalarNode):
                    continue  # unhashable keys are PyYAML's own error
                key = self.construct_object(key_node)
                if key in seen:
                    first = seen[key].start_mark.line + 1
                    raise UntrustedYAMLError(f"duplicate key {_excerpt(repr(key))} (also at line {first})",
                                             key_node.start_mark)  # fmt: skip
                seen[key] = key_node
        return super().construct_mapping(node, deep)

    def construct_core_int(self, node: ScalarNode) -> WrittenInt:
        text = self.construct_scalar(node)
        if not _CORE[INT_TAG].match(text):
            raise ValueError(f"{text!r} is not an integer of YAML 1.2 (digits, _ between two; 0o octal or 0x hex)")
        base = {"0o": 8, "0x": 16}.get(text[:2], 10)
        return WrittenInt(int(text if base == 10 else text[2:], base), text)

    def construct_core_float(self, node: ScalarNode) -> WrittenFloat:
        text = self.construct_scalar(node)
        if not _CORE[FLOAT_TAG].match(text):
            raise ValueError(f"{text!r} is not a float of YAML 1.2")
        return WrittenFloat(float(text.lower().replace(".inf", "inf").replace(".nan", "nan")), text)

    def construct_core_bool(self, node: ScalarNode) -> bool:
        text = self.construct_scalar(node)
        if not _CORE[BOOL_TAG].match(text):
            raise ValueError(f"{text!r} is not a boolean of YAML 1.2 (true or false)")
        return text.lower() == "true"


SafeLoader.add_implicit_resolver(MERGE_TAG, re.compile(r"<<\Z"), ["<"])  # not YAML 1.2, but configs may use it
_add_core_schema(SafeLoader)
SafeLoader.add_constructor(INT_TAG, SafeLoader.construct_core_int)
SafeLoader.add_constructor(FLOAT_TAG, SafeLoader.construct_core_float)
SafeLoader.add_constructor(BOOL_TAG, SafeLoader.construct_core_bool)


class SafeDumper(yaml.SafeDumper):
    """yaml.SafeDumper that quotes a string YAML 1.2 would read as a number, a boolean or null (``1e3``, ``0o17``), as
    it quotes those of YAML 1.1 (``yes``, ``1:30``): its output reads back the same with either loader."""

    def represent_written(self, data: WrittenInt | WrittenFloat) -> Node:
        return self.represent_int(data) if isinstance(data, int) else self.represent_float(data)


_add_core_schema(SafeDumper)  # on top of YAML 1.1's
SafeDumper.add_representer(WrittenInt, SafeDumper.represent_written)
SafeDumper.add_representer(WrittenFloat, SafeDumper.represent_written)


def dump(data: Any) -> str:
    """``data`` as YAML that :func:`load_text` reads back as ``data`` (block style, keys in their order)."""
    return yaml.dump(data, Dumper=SafeDumper, sort_keys=False)


def load_text(text: str | bytes, where: str) -> Any:
    """The data of one YAML document; ConfigError ``<where> is not valid YAML at line L, column C: <problem>``."""
    loader = None
    try:
        loader = SafeLoader(text)  # the reader checks the encoding and the characters here
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where} is not valid YAML{_where(exc)}: {_problem(exc)}") from None
    except RecursionError:  # a constructor or resolver recursing below MAX_DEPTH on a small stack
        raise ConfigError(f"{where} is not valid YAML: nested too deeply") from None
    except (ValueError, OverflowError) as exc:  # the scanner's own: an escape such as "\U0e00481B" (no such character)
        raise ConfigError(f"{where} is not valid YAML: {_excerpt(str(exc))}") from None
    finally:
        if loader is not None:
            loader.dispose()


def load_file(path: str | Path, what: str = "config file") -> Any:
    """The data of the YAML file ``path``: refused in one line when missing, not a regular file, larger than
    :data:`MAX_FILE_BYTES` (its content is not read further nor echoed), or not valid YAML (see :func:`load_text`).
    """
    path = Path(path)
    try:
        if not path.is_file():
            raise ConfigError(f"{what} not found: {path}" if not path.exists() else f"{what} {path} is not a file")
        with path.open("rb") as fh:
            data = fh.read(MAX_FILE_BYTES + 1)  # st_size can be 0 (procfs) or change while reading
    except OSError as exc:
        raise ConfigError(f"{what} {path} cannot be read: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        size = path.stat().st_size
        got = f"{size:,} bytes" if size > MAX_FILE_BYTES else f"more than {MAX_FILE_BYTES:,} bytes"
        raise ConfigError(f"{what} {path} holds {got}; a config file may hold at most {MAX_FILE_BYTES:,} (is it the "
                          "right file?)")  # fmt: skip
    return _copied(_parsed(data, f"{what} {path}"))  # a copy: the caller may change what it got


def _copied(data: Any) -> Any:
    """A copy of loaded YAML: new mappings and lists, the same (immutable) scalars."""
    if isinstance(data, dict):
        return {k: _copied(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_copied(v) for v in data]
    return data


@functools.lru_cache(maxsize=32)
def _parsed(data: bytes, where: str) -> Any:
    """:func:`load_text` of a file's bytes, parsed once per content: a study builds each of its points' configs from
    one file several times (10,000 points: 40,000 parses of the same bytes otherwise)."""
    return load_text(data, where)


def _where(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


def _problem(exc: yaml.YAMLError) -> str:
    what = getattr(exc, "problem", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
    return _excerpt(str(what))


def _excerpt(text: str) -> str:
    """``text`` on one line, at most :data:`EXCERPT` characters of it."""
    flat = text.encode("unicode_escape").decode("ascii") if not text.isprintable() else text
    return flat if len(flat) <= EXCERPT else flat[: EXCERPT - 1] + "…"


def load_override(text: str, where: str) -> Any:
    """The value of a dotted override: its YAML reading where it parses (``8``, ``[a, b]``, ``{k: v}``), the text
    itself where it does not (``{text} It was``); the loader's bounds and unique keys apply either way."""
    loader = None
    try:
        loader = SafeLoader(text)
        return loader.get_single_data()
    except UntrustedYAMLError as exc:
        raise ConfigError(f"{where} is not valid YAML{_where(exc)}: {_problem(exc)}") from None
    except (yaml.YAMLError, ValueError, OverflowError):  # not YAML: the text itself
        return text
    except RecursionError:
        raise ConfigError(f"{where} is not valid YAML: nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()
