"""``bench.fair_queue`` at a tiny size, in this process: a JSON line per size, every run handed
out in messages of five."""

import json

import pytest

from bench import fair_queue


def test_it_prints_the_hand_out_of_each_backlog(capsys: pytest.CaptureFixture[str]) -> None:
    fair_queue.main(["--sizes", "10", "23", "--rounds", "2"])
    machine, *lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert machine["bench"] == "machine"
    assert [(line["runs"], line["messages"]) for line in lines] == [(10, 2), (23, 5)]
    for line in lines:
        assert line["bench"] == "fair_queue"
        assert line["drain_ms"] > 0
        assert line["per_message_us"] > 0


def test_it_refuses_a_size_below_one(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        fair_queue.main(["--sizes", "0"])
    assert refused.value.code == 2
    assert "--sizes and --rounds must be at least 1" in capsys.readouterr().err
