"""The runs filter's rule: an exact name selects that rule alone, any other text every rule it
is a part of, in any case."""

from relayr.console.queries import RunQuery

KNOWN = ("ops:triage", "ops:triage-slow", "billing:invoice")


def rules_for(text: str) -> tuple[str, ...] | None:
    return RunQuery.parse({"rule": text}).rule_names(KNOWN)


def test_an_exact_name_selects_its_rule_alone() -> None:
    assert rules_for("ops:triage") == ("ops:triage",)


def test_a_part_of_a_name_selects_every_rule_it_is_in_any_case() -> None:
    assert rules_for("TRIAGE") == ("ops:triage", "ops:triage-slow")
    assert rules_for("Ops:Triage") == ("ops:triage", "ops:triage-slow")
    assert rules_for("nothing") == ()
    assert rules_for("") is None
