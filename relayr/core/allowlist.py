"""The operators' allowlist as a policy: what each rule may do beyond posting notices in its own
threads, and why (pure: no file, no clock).

A rule holds a permission only when the one entry chosen for it states it: the rule's own
(``[rules."ops:triage"]``), else its namespace's (``[namespaces.ops]``), else ``[default]``. A
field the entry leaves out takes the most restrictive value, never a wider entry's, so adding an
entry never widens a field it does not mention. Parsing is :mod:`relayr.core.allowlist_toml`'s;
reading the file is :mod:`relayr.runtime.allowlist_file`'s.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool

from relayr.core.errors import Problem
from relayr.core.limits import Limit, limits_for

type ThreadScope = Literal["chain", "any"]
type EntryKind = Literal["rule", "namespace", "default"]
type SourceKind = Literal["rule", "namespace", "default", "builtin"]

FIELDS: tuple[str, ...] = ("turns", "threads", "create_threads", "direct")
RESERVED_NAMESPACE = "reflexr"


class Allowlist(BaseModel):
    """What one rule may do. ``Allowlist()`` is the most restrictive: notices in its own threads.

    ``turns``: its messages may start agent turns. ``threads``: ``"chain"`` acts only in the
    threads of the events that made it fire (and threads it created), ``"any"`` anywhere in the
    run's workspace. ``create_threads``: it may create threads. ``direct``: artifact kinds it may
    write directly instead of as proposals.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    turns: StrictBool = False
    threads: ThreadScope = "chain"
    create_threads: StrictBool = False
    direct: frozenset[str] = frozenset()

    def to_json(self) -> dict[str, Any]:
        """The permissions as JSON-ready data, ``direct`` sorted."""
        return {
            "turns": self.turns,
            "threads": self.threads,
            "create_threads": self.create_threads,
            "direct": sorted(self.direct),
        }


MOST_RESTRICTIVE = Allowlist()


@dataclass(frozen=True)
class Entry:
    """One entry of the file, as written: a field it does not set is ``None``.

    ``key`` is its path in the file (``rules."ops:triage"``, ``namespaces.ops``, ``default``) and
    ``line`` the line that declares it, when found.
    """

    kind: EntryKind
    key: str
    turns: bool | None = None
    threads: ThreadScope | None = None
    create_threads: bool | None = None
    direct: frozenset[str] | None = None
    line: int | None = None

    def sets(self, field: str) -> bool:
        """Whether the entry states ``field`` itself."""
        return getattr(self, field) is not None

    def allowlist(self) -> Allowlist:
        """The entry's permissions, each field it does not set at its most restrictive."""
        return Allowlist(
            turns=self.turns if self.turns is not None else MOST_RESTRICTIVE.turns,
            threads=self.threads if self.threads is not None else MOST_RESTRICTIVE.threads,
            create_threads=(
                self.create_threads
                if self.create_threads is not None
                else MOST_RESTRICTIVE.create_threads
            ),
            direct=self.direct if self.direct is not None else MOST_RESTRICTIVE.direct,
        )


@dataclass(frozen=True)
class GrantSource:
    """Where a permission came from: an entry of the file (kind and key) or the built-in value."""

    kind: SourceKind
    key: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "key": self.key}


BUILTIN = GrantSource("builtin")


@dataclass(frozen=True)
class Grant:
    """A rule's effective permissions, the entry chosen for it and the source of each field."""

    rule: str
    allowlist: Allowlist
    entry: GrantSource
    fields: Mapping[str, GrantSource]
    source: str
    limits: tuple[Limit, ...] = ()
    """The limits whose rule patterns match the rule, whatever their workspaces."""

    def to_json(self) -> dict[str, Any]:
        """What ``relayr allowlist explain --json`` prints."""
        values = self.allowlist.to_json()
        return {
            "rule": self.rule,
            "source": self.source,
            "entry": self.entry.to_json(),
            "allowlist": values,
            "fields": {
                field: {"value": values[field], **self.fields[field].to_json()} for field in FIELDS
            },
            "limits": [limit.to_json() for limit in self.limits],
        }


@dataclass(frozen=True)
class Allowlists:
    """A parsed allowlist file: its entries by rule name and by namespace, and its default."""

    rules: Mapping[str, Entry]
    namespaces: Mapping[str, Entry]
    default: Entry | None
    source: str
    limits: tuple[Limit, ...] = ()
    """The ``[limits.NAME]`` entries, in file order (:mod:`relayr.core.limits`)."""

    @classmethod
    def empty(cls, source: str = "<empty>") -> "Allowlists":
        """No entries: every rule gets the most restrictive allowlist."""
        return cls(
            rules=MappingProxyType({}), namespaces=MappingProxyType({}), default=None, source=source
        )

    def entry_for(self, rule: str) -> Entry | None:
        """The whole entry that decides ``rule``: its own, its namespace's, the default, or none.

        reflexr's own namespace is reserved: its rules get no entry, so nothing is granted to them.
        """
        if rule in self.rules:
            return self.rules[rule]
        namespace, colon, _ = rule.partition(":")
        if colon and namespace == RESERVED_NAMESPACE:
            return None
        if colon and namespace in self.namespaces:
            return self.namespaces[namespace]
        return self.default

    def for_rule(self, rule: str) -> Allowlist:
        """The effective permissions of ``rule``."""
        entry = self.entry_for(rule)
        return entry.allowlist() if entry is not None else MOST_RESTRICTIVE

    def limits_for(self, rule: str, tenant_id: str, workspace_id: str) -> list[Limit]:
        """The limits that bind a run of ``rule`` in the workspace, in file order."""
        return limits_for(self.limits, rule, tenant_id, workspace_id)

    def explain(self, rule: str) -> Grant:
        """The effective permissions of ``rule``, which entry gave each field, and the limits
        that may bind its runs (those whose rule patterns match it)."""
        entry = self.entry_for(rule)
        bound = tuple(limit for limit in self.limits if limit.matches_rule(rule))
        if entry is None:
            return Grant(
                rule, MOST_RESTRICTIVE, BUILTIN, dict.fromkeys(FIELDS, BUILTIN), self.source, bound
            )
        chosen = GrantSource(entry.kind, entry.key)
        fields = {field: chosen if entry.sets(field) else BUILTIN for field in FIELDS}
        return Grant(rule, entry.allowlist(), chosen, MappingProxyType(fields), self.source, bound)


def warnings(allowlists: Allowlists, rule_names: Iterable[str]) -> list[Problem]:
    """What ``relayr allowlist check`` warns about in a valid file, in file order.

    Entries that name no rule the application has, and rules that get ``turns`` through their
    namespace's entry or the default rather than an entry of their own.
    """
    names = set(rule_names)
    namespaces = {name.partition(":")[0] for name in names if ":" in name}
    found: list[Problem] = []
    for name, entry in allowlists.rules.items():
        if name not in names:
            found.append(
                Problem(entry.key, f"names no rule the application has: {name}", entry.line)
            )
    for namespace, entry in allowlists.namespaces.items():
        if namespace not in namespaces:
            message = f"no rule the application has is in the namespace {namespace}"
            found.append(Problem(entry.key, message, entry.line))
    for name in sorted(names):
        chosen = allowlists.entry_for(name)
        if chosen is not None and chosen.kind != "rule" and chosen.turns is True:
            message = (
                f"gives turns to {name}, which has no entry of its own; "
                f'grant turns rule by rule with [rules."{name}"]'
            )
            found.append(Problem(chosen.key, message, chosen.line))
    return sorted(found, key=lambda problem: (problem.line or 0, problem.key))
