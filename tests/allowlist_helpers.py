"""What the allowlist tests share: a sample file with an entry of every kind, and a clock the
test moves by hand.

The fuzz tests of ``tests/allowlist_mutations.py`` start from the example application's file
instead; this one is small enough to read beside each expected grant.
"""

FILE = """\
[default]
threads = "any"

[namespaces.ops]
turns = true
direct = ["timeline"]

[rules."ops:incident-triage"]
create_threads = true

[rules."ops:quiet"]

[rules."billing:refunds"]
turns = true
threads = "chain"
"""


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now
