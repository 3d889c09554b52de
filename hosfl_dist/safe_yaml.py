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

Every refusal is a :class:`~hosfl_dist.errors.ConfigError` of one line naming where, never the offending text beyond
a short excerpt. Torch-free.
"""

from __future__ import annotations

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


class UntrustedYAMLError(yaml.YAMLError):
    """A bound of :class:`SafeLoader` was exceeded; ``problem`` and ``problem_mark`` as PyYAML's errors have them."""

    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


class SafeLoader(yaml.SafeLoader):
    """yaml.SafeLoader with bounded alias expansion and nesting, unique keys and one-line construction errors."""

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
    return load_text(data, f"{what} {path}")


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
