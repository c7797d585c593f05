"""The allowlist file's text: parsed and validated whole, every problem named with its line.

Decision: an invalid file is refused whole. Parsing collects every problem (with its key path and
line) and raises :class:`~relayr.core.errors.InvalidAllowlist`; it never returns a partial or
widened allowlist. tomllib keeps no positions, so a line scan (:class:`_Layout`) finds where each
key is, for people; it never decides a permission. Pure: text in, policy out.
"""

import difflib
import json
import re
import tomllib
from collections.abc import Iterable
from types import MappingProxyType
from typing import Any

from relayr.core.allowlist import (
    FIELDS,
    RESERVED_NAMESPACE,
    Allowlists,
    Entry,
    EntryKind,
    ThreadScope,
)
from relayr.core.errors import InvalidAllowlist, Problem
from relayr.core.limits import (
    IN_FLIGHT_KINDS,
    LIMIT_KINDS,
    WINDOW_KINDS,
    Limit,
    Rate,
    parse_rate,
    pattern_problem,
)

# reflexr's own patterns (reflexr.core.rules, reflexr.core.events), matched whole with fullmatch.
_RULE_NAME = re.compile(r"[a-z][a-z0-9_]*:[a-z0-9][a-z0-9._-]*")
_NAMESPACE = re.compile(r"[a-z][a-z0-9_]*")
_ARTIFACT_KIND = re.compile(r"[a-z][a-z0-9_]*")
_NAMESPACE_WILDCARD = re.compile(r"([a-z][a-z0-9_]*):\*?")

_LIMIT_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]*")
_LIMIT_KEYS = ("rules", "workspaces", *LIMIT_KINDS)

_TABLES = ("default", "rules", "namespaces", "limits")
_SHAPE = (
    'an allowlist has [default], [rules."namespace:name"], [namespaces.namespace] '
    "and [limits.name] only"
)
FILE_KEY = "<file>"
"""The key of a problem with the file as a whole (unreadable, not UTF-8)."""
_TOO_DEEP = "invalid toml: values nested too deeply to read"
_TOML_KEY = "<toml>"


def parse_allowlist(text: str, *, source: str = "<string>") -> Allowlists:
    """Parse an allowlist file's text; raise ``InvalidAllowlist`` listing every problem."""
    layout = _Layout(text)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise InvalidAllowlist(source, layout.toml_problems(str(error))) from None
    # Values Python cannot hold as written: nesting deeper than its recursion limit, integers
    # longer than it converts to text. tomllib or the validator meets them, never a valid file.
    except RecursionError:
        raise InvalidAllowlist(source, [Problem(_TOML_KEY, _TOO_DEEP)]) from None
    except ValueError as error:
        raise InvalidAllowlist(source, [Problem(_TOML_KEY, f"invalid toml: {error}")]) from None
    try:
        return _Validator(layout, source).validate(data)
    except RecursionError:
        raise InvalidAllowlist(source, [Problem(_TOML_KEY, _TOO_DEEP)]) from None
    except ValueError as error:
        raise InvalidAllowlist(source, [Problem(_TOML_KEY, f"invalid value: {error}")]) from None


def parse_allowlist_bytes(raw: bytes, *, source: str) -> Allowlists:
    """Parse an allowlist file's bytes (UTF-8, a BOM allowed); raise ``InvalidAllowlist``."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = raw[: error.start].count(b"\n") + 1
        problem = Problem(FILE_KEY, f"not utf-8 text (byte {error.start})", line)
        raise InvalidAllowlist(source, [problem]) from None
    return parse_allowlist(text, source=source)


def key_path(*parts: str) -> str:
    """A TOML key path as written in problems: ``rules."ops:triage".turns``."""
    return ".".join(
        part if re.fullmatch(r"[A-Za-z0-9_-]+", part) else json.dumps(part, ensure_ascii=False)
        for part in parts
    )


type _Path = tuple[str, ...]


class _Layout:
    """Where keys and tables are in the text; tomllib keeps no positions, so a line scan does.

    Best effort: it reads headers, ``key = value`` lines and dotted or quoted keys, and skips
    multi-line strings; the lines it gives are for people, never for deciding permissions.
    """

    def __init__(self, text: str) -> None:
        self.lines = text.split("\n")
        self.first: dict[_Path, int] = {}
        self.definitions: dict[_Path, list[int]] = {}
        self.at_line: dict[int, _Path] = {}
        self._scan()

    def _scan(self) -> None:
        table: _Path = ()
        in_array = False
        closing: str | None = None
        for number, raw in enumerate(self.lines, start=1):
            line = raw.strip()
            if closing is not None:
                if closing in line:
                    closing = None
                continue
            if not line or line.startswith("#"):
                continue
            if line.startswith("["):
                in_array = line.startswith("[[")
                parsed = _parse_key(line, 2 if in_array else 1)
                if parsed is None:
                    self.at_line[number] = table
                    continue
                table = parsed[0]
                self._record(table, number, define=not in_array)
                continue
            parsed = _parse_key(line, 0)
            if parsed is None or not line[parsed[1] :].startswith("="):
                self.at_line[number] = table
                continue
            self._record(table + parsed[0], number, define=not in_array, since=len(table))
            value = line[parsed[1] + 1 :].strip()
            for quotes in ('"""', "'''"):
                if value.startswith(quotes) and quotes not in value[3:]:
                    closing = quotes

    def _record(self, path: _Path, number: int, *, define: bool, since: int = 0) -> None:
        for end in range(max(since, 0) + 1, len(path) + 1):
            self.first.setdefault(path[:end], number)
        self.at_line[number] = path
        if define:
            self.definitions.setdefault(path, []).append(number)

    def line(self, path: _Path) -> int | None:
        """The line that declares ``path``, or else its nearest enclosing table or key."""
        for end in range(len(path), 0, -1):
            if path[:end] in self.first:
                return self.first[path[:end]]
        return None

    def toml_problems(self, message: str) -> list[Problem]:
        """Problems for a file tomllib refused: every duplicate found, else tomllib's error."""
        problems = [
            Problem(key_path(*path), _duplicate_message(path, lines[0]), second)
            for path, lines in self.definitions.items()
            for second in lines[1:]
        ]
        duplicate = message.startswith(("Cannot declare", "Cannot overwrite"))
        if problems and duplicate:
            return sorted(problems, key=lambda problem: problem.line or 0)
        found = re.search(r"\s*\(at line (\d+), column \d+\)$", message)
        if found is not None:
            line: int | None = int(found.group(1))
            message = message[: found.start()]
        else:
            message = message.removesuffix(" (at end of document)")
            line = self._last_line()
        path = self.at_line.get(line, ()) if line is not None else ()
        text = message[:1].lower() + message[1:]
        problems.append(
            Problem(key_path(*path) if path else _TOML_KEY, f"invalid toml: {text}", line)
        )
        return sorted(problems, key=lambda problem: problem.line or 0)

    def _last_line(self) -> int | None:
        for number in range(len(self.lines), 0, -1):
            if self.lines[number - 1].strip():
                return number
        return None


def _duplicate_message(path: _Path, first: int) -> str:
    if path == ("default",) or (len(path) == 2 and path[0] in ("rules", "namespaces")):
        return f"duplicate entry, first declared at line {first}; declare each entry once"
    return f"duplicate key, first set at line {first}; set each key once"


_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
_BARE = re.compile(r"[A-Za-z0-9_-]+")


def _parse_key(line: str, position: int) -> tuple[_Path, int] | None:
    """A TOML key (bare, quoted or dotted) at ``position``: its parts and where it ends.

    For a table header the end is after its closing bracket(s); otherwise after the key.
    """
    header = position > 0
    parts: list[str] = []
    while True:
        position = _skip_spaces(line, position)
        if position >= len(line):
            return None
        if line[position] == '"':
            quoted = _QUOTED.match(line, position)
            if quoted is None:
                return None
            parts.append(_unescape(quoted.group(1)))
            position = quoted.end()
        elif line[position] == "'":
            end = line.find("'", position + 1)
            if end < 0:
                return None
            parts.append(line[position + 1 : end])
            position = end + 1
        else:
            bare = _BARE.match(line, position)
            if bare is None:
                return None
            parts.append(bare.group())
            position = bare.end()
        position = _skip_spaces(line, position)
        if position < len(line) and line[position] == ".":
            position += 1
            continue
        if header:
            if not line.startswith("]", position):
                return None
            position += 2 if line.startswith("]]", position) else 1
        return tuple(parts), position


def _skip_spaces(line: str, position: int) -> int:
    while position < len(line) and line[position] in " \t":
        position += 1
    return position


def _unescape(body: str) -> str:
    try:
        value = json.loads(f'"{body}"')
    except ValueError:
        return body
    return value if isinstance(value, str) else body


class _Validator:
    """Checks parsed TOML against the allowlist's shape, collecting every problem."""

    def __init__(self, layout: _Layout, source: str) -> None:
        self.layout = layout
        self.source = source
        self.problems: list[Problem] = []

    def problem(self, path: _Path, message: str) -> None:
        self.problems.append(Problem(key_path(*path), message, self.layout.line(path)))

    def validate(self, data: dict[str, Any]) -> Allowlists:
        rules: dict[str, Entry] = {}
        namespaces: dict[str, Entry] = {}
        default: Entry | None = None
        limits: list[Limit] = []
        for name, value in data.items():
            if name == "default":
                default = self.entry("default", ("default",), value)
            elif name == "rules":
                rules = self.rules(value)
            elif name == "namespaces":
                namespaces = self.namespaces(value)
            elif name == "limits":
                limits = self.limits(value)
            elif name in LIMIT_KINDS:
                self.problem((name,), "a limit belongs in a [limits.name] entry")
            elif name in FIELDS:
                self.problem((name,), f"a permission belongs in an entry; {_SHAPE}")
            else:
                self.problem((name,), f"unknown table{_suggest(name, _TABLES)}; {_SHAPE}")
        if self.problems:
            by_line = sorted(
                self.problems, key=lambda problem: problem.line or len(self.layout.lines) + 1
            )
            raise InvalidAllowlist(self.source, by_line)
        return Allowlists(
            rules=MappingProxyType(rules),
            namespaces=MappingProxyType(namespaces),
            default=default,
            source=self.source,
            limits=tuple(limits),
        )

    def limits(self, value: object) -> list[Limit]:
        if not isinstance(value, dict):
            self.problem(
                ("limits",),
                f"must be a table of entries such as [limits.triage], not {_describe(value)}",
            )
            return []
        found: list[Limit] = []
        for name, body in value.items():
            path = ("limits", name)
            if _LIMIT_NAME.fullmatch(name) is None:
                self.problem(
                    path,
                    "malformed limit name; a name is lower case letters, digits, _, . and -, "
                    "starting with a letter or digit",
                )
                continue
            limit = self.limit(path, name, body)
            if limit is not None:
                found.append(limit)
        return found

    def limit(self, path: _Path, name: str, body: object) -> Limit | None:
        if not isinstance(body, dict):
            self.problem(path, f"a limit must be a table, not {_describe(body)}")
            return None
        before = len(self.problems)
        rules = self.patterns((*path, "rules"), body.get("rules"), workspace=False)
        workspaces: tuple[str, ...] | None = ("*/*",)
        if "workspaces" in body:
            workspaces = self.patterns((*path, "workspaces"), body["workspaces"], workspace=True)
        if "rules" not in body:
            self.problem(path, 'a limit names the rules it binds: rules = ["ops:triage"]')
        bounds: dict[str, int | Rate] = {}
        for key, item in body.items():
            key_path_ = (*path, key)
            if key in IN_FLIGHT_KINDS:
                if isinstance(item, int) and not isinstance(item, bool) and item >= 1:
                    bounds[key] = item
                else:
                    self.problem(
                        key_path_, f"must be a whole number of at least 1, not {_describe(item)}"
                    )
            elif key in WINDOW_KINDS:
                if not isinstance(item, str):
                    self.problem(
                        key_path_, f'must be a string such as "20/1m", not {_describe(item)}'
                    )
                    continue
                try:
                    bounds[key] = parse_rate(item)
                except ValueError as error:
                    self.problem(key_path_, str(error))
            elif key not in ("rules", "workspaces"):
                expected = ", ".join(_LIMIT_KEYS)
                self.problem(
                    key_path_,
                    f"unknown key{_suggest(key, _LIMIT_KEYS)}; a limit may set {expected}",
                )
        if not bounds and len(self.problems) == before:
            self.problem(path, f"a limit sets at least one of {', '.join(LIMIT_KINDS)}")
        if len(self.problems) != before or rules is None or workspaces is None:
            return None
        return Limit(
            name=name,
            rules=rules,
            workspaces=workspaces,
            line=self.layout.line(path),
            **bounds,  # type: ignore[arg-type]  # each kind's value was checked above
        )

    def patterns(self, path: _Path, value: object, *, workspace: bool) -> tuple[str, ...] | None:
        if value is None:
            return None
        items = [value] if isinstance(value, str) else value
        example = '["acme/*"]' if workspace else '["ops:triage", "ops:*"]'
        if not isinstance(items, list) or not items:
            self.problem(path, f"must be a pattern or an array of them, such as {example}")
            return None
        fine = True
        for item in items:
            problem = (
                pattern_problem(item, workspace=workspace)
                if isinstance(item, str)
                else f"must be a string, not {_describe(item)}"
            )
            if problem is not None:
                self.problem(path, problem)
                fine = False
        return tuple(items) if fine else None

    def rules(self, value: object) -> dict[str, Entry]:
        if not isinstance(value, dict):
            self.problem(
                ("rules",),
                f'must be a table of entries such as [rules."ops:triage"], not {_describe(value)}',
            )
            return {}
        entries: dict[str, Entry] = {}
        for name, body in value.items():
            path = ("rules", name)
            named = self.rule_name(path, name)
            entry = self.entry("rule", path, body)
            if named and entry is not None:
                entries[name] = entry
        return entries

    def rule_name(self, path: _Path, name: str) -> bool:
        wildcard = _NAMESPACE_WILDCARD.fullmatch(name)
        if wildcard is not None:
            namespace = wildcard.group(1)
            self.problem(
                path,
                f"not a rule name; to grant every {namespace}:* rule use [namespaces.{namespace}]",
            )
            return False
        if _RULE_NAME.fullmatch(name) is None:
            hint = (
                "rule names contain ':' and are quoted in the file, as in [rules.\"ops:triage\"]"
                if ":" not in name
                else 'a rule name is namespace:name, as in "ops:triage"'
            )
            self.problem(path, f"malformed rule name; {hint}")
            return False
        if name.partition(":")[0] == RESERVED_NAMESPACE:
            self.problem(path, "the reflexr namespace is reserved for reflexr's own rules")
            return False
        return True

    def namespaces(self, value: object) -> dict[str, Entry]:
        if not isinstance(value, dict):
            self.problem(
                ("namespaces",),
                f"must be a table of entries such as [namespaces.ops], not {_describe(value)}",
            )
            return {}
        entries: dict[str, Entry] = {}
        for name, body in value.items():
            path = ("namespaces", name)
            named = self.namespace_name(path, name)
            entry = self.entry("namespace", path, body)
            if named and entry is not None:
                entries[name] = entry
        return entries

    def namespace_name(self, path: _Path, name: str) -> bool:
        if _NAMESPACE.fullmatch(name) is None:
            wildcard = _NAMESPACE_WILDCARD.fullmatch(name)
            hint = (
                f"write the namespace alone, as in [namespaces.{wildcard.group(1)}]"
                if wildcard is not None
                else "a namespace is lower case letters, digits and _, starting with a letter"
            )
            self.problem(path, f"malformed namespace name; {hint}")
            return False
        if name == RESERVED_NAMESPACE:
            self.problem(path, "the reflexr namespace is reserved for reflexr's own rules")
            return False
        return True

    def entry(self, kind: EntryKind, path: _Path, body: object) -> Entry | None:
        if not isinstance(body, dict):
            self.problem(path, f"an entry must be a table of permissions, not {_describe(body)}")
            return None
        turns: bool | None = None
        threads: ThreadScope | None = None
        create_threads: bool | None = None
        direct: frozenset[str] | None = None
        for name, value in body.items():
            field_path = (*path, name)
            if name == "turns":
                turns = self.boolean(field_path, value)
            elif name == "create_threads":
                create_threads = self.boolean(field_path, value)
            elif name == "threads":
                threads = self.threads(field_path, value)
            elif name == "direct":
                direct = self.direct(field_path, value)
            else:
                expected = ", ".join(sorted(FIELDS))
                self.problem(
                    field_path, f"unknown key{_suggest(name, FIELDS)}; an entry may set {expected}"
                )
        return Entry(
            kind=kind,
            key=key_path(*path),
            turns=turns,
            threads=threads,
            create_threads=create_threads,
            direct=direct,
            line=self.layout.line(path),
        )

    def boolean(self, path: _Path, value: object) -> bool | None:
        if isinstance(value, bool):
            return value
        self.problem(path, f"must be true or false, not {_describe(value)}")
        return None

    def threads(self, path: _Path, value: object) -> ThreadScope | None:
        if isinstance(value, str) and value == "chain":
            return "chain"
        if isinstance(value, str) and value == "any":
            return "any"
        self.problem(path, f'must be "chain" or "any", not {_describe(value)}')
        return None

    def direct(self, path: _Path, value: object) -> frozenset[str] | None:
        if not isinstance(value, list):
            self.problem(
                path,
                f'must be an array of artifact kinds, such as ["timeline"], not {_describe(value)}',
            )
            return None
        kinds: list[str] = []
        fine = True
        for index, kind in enumerate(value):
            if not isinstance(kind, str):
                self.problem(
                    path, f"item {index + 1} must be an artifact kind, not {_describe(kind)}"
                )
                fine = False
            elif _ARTIFACT_KIND.fullmatch(kind) is None:
                self.problem(
                    path,
                    f"malformed artifact kind {json.dumps(kind)}; a kind is lower "
                    "case letters, digits and _, starting with a letter",
                )
                fine = False
            elif kind in kinds:
                self.problem(path, f"artifact kind {json.dumps(kind)} is listed twice")
                fine = False
            else:
                kinds.append(kind)
        return frozenset(kinds) if fine else None


def _describe(value: object) -> str:
    if isinstance(value, bool):
        return f"the boolean {json.dumps(value)}"
    if isinstance(value, str):
        return f"the string {json.dumps(value, ensure_ascii=False)}"
    if isinstance(value, int):
        return f"the integer {value}"
    if isinstance(value, float):
        return f"the float {value}"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return f"a {type(value).__name__.replace('_', ' ')}"


def _suggest(name: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]}?)" if close else ""
