"""Read a study spec: its YAML, safely, then every rule, so that all problems are reported at once.

:func:`load_spec` reads a file and returns a :class:`~sweeps.spec.model.StudySpec`, or raises
:class:`sweeps.errors.SpecError` listing every problem: pydantic's type errors rewritten by
:mod:`sweeps.spec.messages`, and the rules spanning several fields (:mod:`sweeps.spec.checks`), which
still run on the sections that validated when others did not. Loading creates no files and touches
no storage: the CLI calls it before anything else.

The YAML is read by these rules:

- Only :class:`yaml.SafeLoader` machinery is used, never ``yaml.load`` with an unsafe
  loader: ``!!python/object...`` and every other tag that would build something other
  than a mapping, list, string, number, boolean or null is refused with a SpecError
  (nothing is constructed, nothing is called).
- Plain scalars follow YAML 1.2, not PyYAML's YAML 1.1 rules, because the 1.1 rules
  silently turn reasonable spec values into the wrong type:

  ==================  ==================  =====================================
  written             YAML 1.1 (PyYAML)   here
  ==================  ==================  =====================================
  ``1e-3``            the string "1e-3"   the float 0.001 (no dot needed)
  ``1.0e3``           the string          the float 1000.0 (exponent sign optional)
  ``no`` ``yes``      False / True        the strings "no" / "yes"
  ``on`` ``off``      True / False        the strings "on" / "off"
  ``1:30``            the int 90          the string "1:30" (a duration check rejects it)
  ``010``             the int 8 (octal)   the string "010" (a type check rejects it)
  ``2024-01-01``      a datetime.date     the string "2024-01-01"
  ==================  ==================  =====================================

  Only ``true``/``false`` (any case: True, TRUE) are booleans, so ``optimizer: no`` is
  the string "no" and fails with "'no' is not one of sgd, adam, adamw" instead of
  reaching the config as ``False``.
- A key repeated in one mapping is an error (YAML says keys are unique; PyYAML would
  keep the last one silently).
- Syntax errors name the line and column (1-based).
- Nesting deeper than :data:`MAX_DEPTH` levels is refused (PyYAML composes and Python
  compares nested values recursively: a 1 KB file of 500 nested lists would otherwise end
  in a RecursionError), also where aliases build the depth up.
"""
from __future__ import annotations

import contextlib
import re
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from sweeps.errors import SpecError
from sweeps.spec.checks import cross_problems
from sweeps.spec.messages import pydantic_problems, render
from sweeps.spec.model import StudySpec
from sweeps.spec.search_space import Problem, SearchParam

MAX_BYTES = 1 << 20  # a spec is a few hundred bytes; anything this big is a mistake
MAX_VALUES = 100_000  # after alias expansion: stops "billion laughs" documents and recursion
MAX_DEPTH = 32  # levels of nested mappings/lists; a spec needs about 5 (search.x.choices[i][j])

_DROPPED_TAGS = {
    "tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:timestamp", "tag:yaml.org,2002:value",
}
# Types a spec has no use for and that are not JSON-able; refused even when tagged explicitly.
_REFUSED_TAGS = ("binary", "set", "omap", "pairs", "timestamp", "value")

Lines = dict[tuple[str, ...], int]  # field path (keys as strings) -> 1-based line


class _TooDeep(yaml.YAMLError):
    def __init__(self, mark: yaml.Mark | None) -> None:
        super().__init__()
        self.mark = mark


def too_deep(path: str, where: str = "") -> SpecError:
    """More than MAX_DEPTH mappings and lists inside each other."""
    return SpecError(path, [f"{where}nesting deeper than {MAX_DEPTH} levels (mappings and lists inside each "
                            "other); a study spec needs only a few, so flatten it"])


class _SpecLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 scalar resolution, unique keys and no exotic types."""

    # Start from SafeLoader's resolvers minus the YAML 1.1 bool/int/float/timestamp ones.
    yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in entries if tag not in _DROPPED_TAGS]
        for first, entries in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    _depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        # Counted while composing, before PyYAML's recursion (a few frames per level) runs out.
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH + 1:  # + 1: the innermost node may be a scalar
                raise _TooDeep(self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Node, deep: bool = False) -> dict:  # noqa: D401
        if isinstance(node, MappingNode):
            seen: dict[Any, yaml.Mark] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *anchor` merges may override; that is what they are for
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:
                    continue  # unhashable key: SafeConstructor reports it below
                if first is not None:
                    raise ConstructorError(
                        None, None,
                        f"duplicate key {key!r} (first at line {first.line + 1}); "
                        "each key may appear once in a mapping",
                        key_node.start_mark,
                    )
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def _refuse(loader: _SpecLoader, node: Node) -> Any:
    raise ConstructorError(None, None, f"could not determine a constructor for the tag {node.tag!r}",
                           node.start_mark)


for _name in _REFUSED_TAGS:
    _SpecLoader.add_constructor(f"tag:yaml.org,2002:{_name}", _refuse)

_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
# Floats: a dot or an exponent (or both); `1e-3` and `1.0e3` included, unlike YAML 1.1.
_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                    |\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
                    |[0-9][0-9_]*[eE][-+]?[0-9]+
                    |\.(?:inf|Inf|INF))
                  |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))
# Ints: decimal only; a leading zero is not octal and `1:30` is not base 60.
_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^[-+]?(?:0|[1-9][0-9_]*)$"), list("-+0123456789"))


def _where(mark: yaml.Mark | None) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "unknown position"


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One readable line for a PyYAML error: position first, then what is wrong."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        return f"not valid YAML: {exc}"
    mark = exc.problem_mark or exc.context_mark
    problem = exc.problem or "invalid YAML"
    if isinstance(exc, ConstructorError) and "could not determine a constructor" in problem:
        tag = re.search(r"'([^']*)'", problem)
        shown = tag.group(1).replace("tag:yaml.org,2002:", "!!") if tag else "this tag"
        return (f"{_where(mark)}: the tag {shown!r} is refused; a study spec may hold only mappings, "
                "lists, strings, numbers, true/false and null (remove the tag)")
    if isinstance(exc, ConstructorError):
        return f"{_where(mark)}: {problem}"
    if "another document" in problem:
        return f"{_where(mark)}: a second YAML document ('---'); a spec file holds exactly one"
    context = f" ({exc.context}, {_where(exc.context_mark)})" if exc.context and exc.context_mark else ""
    return f"{_where(mark)}: YAML syntax error: {problem}{context}"


def _line_map(root: Node | None) -> Lines:
    """Field path -> line of its key (mappings) or item (lists), to point problems at the file.

    An aliased node is the same object as its anchor: it is mapped once, at the anchor, so
    repeated or recursive aliases cost nothing here (``check_size`` refuses those later).
    """
    out: Lines = {}
    seen: set[int] = set()
    stack: list[tuple[Node | None, tuple[str, ...]]] = [(root, ())]
    while stack:
        node, path = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, MappingNode):
            for key_node, value_node in node.value:
                if isinstance(key_node, ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                    sub = path + (str(key_node.value),)
                    out.setdefault(sub, key_node.start_mark.line + 1)
                    stack.append((value_node, sub))
        elif isinstance(node, SequenceNode):
            for i, item in enumerate(node.value):
                sub = path + (str(i),)
                out.setdefault(sub, item.start_mark.line + 1)
                stack.append((item, sub))
    return out


def check_size(data: Any, path: str) -> None:
    """Walk the data with a budget of values and of depth: aliases may repeat (or recurse into)
    a subtree, and each alias of a nested anchor nests it deeper. Raises SpecError."""
    budget, deep = MAX_VALUES, False
    stack = [(data, 0)]
    while stack:
        item, depth = stack.pop()
        budget -= 1
        if budget < 0:
            raise SpecError(path, [f"the document expands to more than {MAX_VALUES} values "
                                   "(YAML aliases repeating or recursing); write the spec out plainly"])
        # Reported after the walk: an alias recursing into itself is deep too, but that is its lesser fault.
        deep = deep or (isinstance(item, (dict, list)) and depth >= MAX_DEPTH)
        if isinstance(item, dict):
            stack.extend((k, depth + 1) for k in item.keys())
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    if deep:
        raise too_deep(path)


def parse_yaml_text(text: str, path: str = "<string>") -> tuple[Any, Lines]:
    """Parse one YAML document with the spec rules; returns (data, line map). Raises SpecError."""
    try:
        loader = _SpecLoader(text)  # the reader checks the characters here already
    except yaml.YAMLError as exc:
        raise SpecError(path, [_yaml_problem(exc)]) from None
    try:
        node = loader.get_single_node()
        lines = _line_map(node)  # before construction: merges (`<<`) rewrite the node tree
        data = loader.construct_document(node) if node is not None else None
    except _TooDeep as exc:
        raise too_deep(path, f"{_where(exc.mark)}: ") from None
    except yaml.YAMLError as exc:
        raise SpecError(path, [_yaml_problem(exc)]) from None
    except RecursionError:  # a guard: the depth limit should stop every document before this
        raise too_deep(path) from None
    finally:
        loader.dispose()
    check_size(data, path)
    return data, lines


def read_spec_text(path: str | Path) -> str:
    """The text of a spec file (read once: ``sweeps run`` hands this snapshot to its workers).
    Raises SpecError."""
    shown = str(path)
    p = Path(path)
    try:
        if not p.is_file():
            raise SpecError(shown, ["no such file" if not p.exists() else "not a regular file"])
        if p.stat().st_size > MAX_BYTES:
            raise SpecError(shown, [f"the file is larger than {MAX_BYTES} bytes; a study spec is a short YAML file"])
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(shown, [f"not UTF-8 text (byte {exc.start}); save the spec as UTF-8"]) from None
    except OSError as exc:
        raise SpecError(shown, [f"cannot read the file: {exc.strerror or exc}"]) from None


def mapping_from_text(text: str, shown: str) -> tuple[dict[str, Any], Lines]:
    """A spec's text -> its top-level mapping and the line of each key. Raises SpecError."""
    data, lines = parse_yaml_text(text, shown)
    if data is None:
        raise SpecError(shown, ["the file is empty; a study spec is a YAML mapping with at least 'name' and 'task'"])
    if not isinstance(data, dict):
        raise SpecError(shown, [f"the top level is a {type(data).__name__}, not a mapping; "
                                "a study spec starts with keys such as 'name:' and 'task:'"])
    return data, lines


def collect_problems(data: dict[str, Any], lines: dict[tuple[str, ...], int]) -> tuple[StudySpec | None, list[str]]:
    """Validate ``data``; returns (spec or None, every problem rendered with its line)."""
    problems: list[Problem] = []
    try:
        spec = StudySpec.model_validate(data)
        sections = {key: getattr(spec, key) for key in StudySpec.model_fields}
    except ValidationError as exc:
        spec = None
        problems += pydantic_problems(exc)
        sections = _valid_sections(data)
    problems += cross_problems(sections, set(data))
    rendered = [render(loc, text, lines) for loc, text in problems]
    return spec, list(dict.fromkeys(rendered))  # drop exact repeats, keep order


@cache
def _adapter(annotation: Any) -> TypeAdapter:
    return TypeAdapter(annotation)


def _valid_sections(data: dict[str, Any]) -> dict[str, Any]:
    """Each section validated alone (None where invalid), so cross-field rules can still run."""
    out: dict[str, Any] = {}
    for key, field in StudySpec.model_fields.items():
        if key not in data:
            out[key] = None if field.is_required() else field.get_default(call_default_factory=True)
            continue
        if key == "search" and isinstance(data[key], dict):
            params = {}
            for name, raw in data[key].items():  # one bad parameter must not hide the others
                if not isinstance(name, str):
                    continue  # already reported by pydantic
                with contextlib.suppress(ValidationError):
                    params[name] = _adapter(SearchParam).validate_python(raw)
            out[key] = params
            continue
        try:
            # A field's annotation (a type or typing form) is hashable; typeshed's lru_cache wants Hashable.
            out[key] = _adapter(field.annotation).validate_python(data[key])  # type: ignore[arg-type]
        except ValidationError:
            out[key] = None
    return out



# An empty section (`train:` with every line commented out) is YAML null: read it as "all defaults".
_SECTIONS_WITH_DEFAULTS = ("train", "search", "objective", "sampler", "pruner", "budget", "resources",
                           "lr_finder", "tracking", "constraints", "deploy")


def spec_from_dict(data: Any, path: str | Path | None = None, lines: dict | None = None) -> StudySpec:
    """Validate a parsed spec (every rule, all problems at once). Raises SpecError."""
    shown = str(path) if path is not None else "<spec>"
    if not isinstance(data, dict):
        raise SpecError(shown, [f"the spec is a {type(data).__name__}, not a mapping"])
    check_size(data, shown)  # data not read by load_spec (a dumped spec) may nest deeper than validation recurses
    data = {k: v for k, v in data.items() if not (v is None and k in _SECTIONS_WITH_DEFAULTS)}
    spec, problems = collect_problems(data, lines or {})
    if problems or spec is None:
        raise SpecError(shown, problems)
    spec._path = Path(path) if path is not None else None
    return spec


def load_spec(path: str | Path) -> StudySpec:
    """Read, parse and validate a study spec file. Raises SpecError listing every problem."""
    return spec_from_text(read_spec_text(path), path)


def spec_from_text(text: str, path: str | Path) -> StudySpec:
    """Validate a spec file's text, read earlier from ``path`` (``sweeps run``'s snapshot)."""
    data, lines = mapping_from_text(text, str(path))
    spec = spec_from_dict(data, path, lines)
    spec._text = text
    return spec
