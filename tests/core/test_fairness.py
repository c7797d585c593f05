"""The fair queue's hand-out, as plain tables: bounded waiting per workspace, turns between
workspaces and tenants (with weights), work-conserving, order within a workspace."""

import pytest

from relayr.core.fairness import FairQueue, Message, parse_weights

A, B, C = ("acme", "flood"), ("acme", "quiet"), ("zeta", "ops")


def queue(
    per_workspace: int = 2, *, batch: int = 1, spread: int = 1, **weights: float
) -> FairQueue[str]:
    return FairQueue(per_workspace=per_workspace, weights=weights, batch=batch, spread=spread)


def fill(fair: FairQueue[str], workspace: tuple[str, str], count: int, prefix: str) -> None:
    for index in range(count):
        name = f"{prefix}{index}"
        fair.add(workspace, name, name)


def shape(messages: list[Message[str]]) -> list[tuple[str, ...]]:
    return [message.items for message in messages]


def test_a_flooded_workspace_has_at_most_per_workspace_messages_out() -> None:
    fair = queue(per_workspace=2)
    fill(fair, A, 1000, "a")

    assert shape(fair.hand_out({})) == [("a0",), ("a1",)]
    assert shape(fair.hand_out({A: 2})) == []
    assert fair.waiting(A) == 998


def test_a_new_run_of_another_workspace_goes_next_whatever_the_flood() -> None:
    """The quiet workspace's run is handed out as soon as a slot is free anywhere: it waits
    behind at most per_workspace messages of the flood, not behind its backlog."""
    fair = queue(per_workspace=2)
    fill(fair, A, 5000, "a")
    first = fair.hand_out({})
    fair.add(B, "b0", "b0")

    handed = fair.hand_out({A: len(first)})

    assert shape(handed) == [("b0",)]


def test_a_backlogs_messages_go_behind_and_a_workspace_with_nothing_else_waiting_ahead() -> None:
    """The broker delivers a message not ``behind`` first: a workspace with nothing else
    waiting (here or in the broker) is not queued behind another's backlog."""
    fair = queue(per_workspace=2)
    fill(fair, A, 3, "a")
    fair.add(B, "b0", "b0")

    handed = fair.hand_out({})
    assert [(m.items, m.behind) for m in handed] == [
        (("a0",), True),
        (("b0",), False),
        (("a1",), True),
    ]
    fill(fair, B, 2, "c")  # B has a message in the broker: its next ones are a backlog
    assert [(m.items, m.behind) for m in fair.hand_out({A: 0, B: 1})] == [
        (("a2",), False),  # A's last, and nothing of A's waits in the broker
        (("c0",), True),
    ]


def test_workspaces_take_turns() -> None:
    fair = queue(per_workspace=3)
    fill(fair, A, 10, "a")
    fill(fair, B, 10, "b")

    assert shape(fair.hand_out({})) == [("a0",), ("b0",), ("a1",), ("b1",), ("a2",), ("b2",)]


def test_a_lone_busy_workspace_gets_a_message_each_time_one_is_taken() -> None:
    """Work-conserving: nothing else waits, so each free slot is filled at once."""
    fair = queue(per_workspace=2)
    fill(fair, A, 6, "a")
    handed = [shape(fair.hand_out({}))]
    for in_broker in (1, 0, 2):
        handed.append(shape(fair.hand_out({A: in_broker})))

    assert handed == [[("a0",), ("a1",)], [("a2",)], [("a3",), ("a4",)], []]


def test_tenants_share_before_their_workspaces_do() -> None:
    """acme's two busy workspaces get as many messages together as zeta's one."""
    fair = queue(per_workspace=4)
    fill(fair, A, 10, "a")
    fill(fair, B, 10, "b")
    fill(fair, C, 10, "c")

    handed = [message.workspace[0] for message in fair.hand_out({})]

    assert handed[:8].count("acme") == handed[:8].count("zeta") == 4
    assert handed.count("acme") == 8


def test_a_weighted_tenant_gets_its_share() -> None:
    fair = queue(per_workspace=10, zeta=3.0)
    fill(fair, A, 20, "a")
    fill(fair, C, 20, "c")

    handed = [message.workspace[0] for message in fair.hand_out({})][:8]

    assert handed.count("zeta") == 6
    assert handed.count("acme") == 2


def test_a_tenant_idle_until_now_banks_no_credit() -> None:
    """A tenant that starts late joins at the busy tenant's pace, not ahead of it by all the
    turns it did not take."""
    fair = queue(per_workspace=100)
    fill(fair, A, 50, "a")
    fair.hand_out({})
    fill(fair, A, 10, "x")
    fill(fair, C, 10, "c")

    handed = [message.workspace[0] for message in fair.hand_out({A: 0})][:6]

    assert handed.count("zeta") == 3


def test_a_lane_keeps_its_order_and_a_suspect_goes_alone() -> None:
    fair = queue(per_workspace=10, batch=20, spread=1)
    fair.add(A, "r1", "r1")
    fair.add(A, "r2", "r2")
    fair.add(A, "suspect", "suspect", alone=True)
    fair.add(A, "r3", "r3")

    assert shape(fair.hand_out({})) == [("r1", "r2"), ("suspect",), ("r3",)]


def test_messages_split_a_lane_into_spread_messages_of_at_most_batch() -> None:
    fair = queue(per_workspace=10, batch=20, spread=4)
    fill(fair, A, 10, "a")

    assert [len(items) for items in shape(fair.hand_out({}))] == [3, 3, 3, 1]


def test_an_item_added_again_keeps_its_place_and_a_removed_one_leaves() -> None:
    fair = queue(per_workspace=10, batch=20, spread=1)
    fill(fair, A, 3, "a")
    fair.add(A, "a0", "a0-new")
    fair.remove("a1")
    fair.remove("unknown")

    assert shape(fair.hand_out({})) == [("a0-new", "a2")]
    assert len(fair) == 0


@pytest.mark.parametrize(
    ("weights", "problem"),
    [
        ({"acme": 0}, "tenant 'acme': weight 0 must be above 0 and finite"),
        ({"acme": -1.5}, "tenant 'acme': weight -1.5 must be above 0 and finite"),
        ({"acme": float("inf")}, "tenant 'acme': weight inf must be above 0 and finite"),
        ({"acme": "2"}, "tenant 'acme': weight '2' is not a number"),
        ({"acme": True}, "tenant 'acme': weight True is not a number"),
    ],
)
def test_weights_that_are_not_positive_numbers_are_refused(
    weights: dict[str, object], problem: str
) -> None:
    with pytest.raises(ValueError, match=problem.replace("(", r"\(")):
        parse_weights(weights)


def test_weights_are_read_as_numbers() -> None:
    assert parse_weights({"acme": 2, "zeta": 0.5}) == {"acme": 2.0, "zeta": 0.5}
