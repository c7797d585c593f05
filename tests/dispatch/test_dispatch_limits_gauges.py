"""The dispatcher reports what the operators' limits use as gauges, from the limit store every
worker counts in: ``relayr_limit_used`` and ``relayr_limit_waiting`` by limit and kind, read
again at most every LIMITS_REPORT_S (on the dispatcher's clock, which the test moves)."""

from datetime import timedelta
from pathlib import Path

from reflexr.workspace import WorkspaceRef

from relayr.dispatch.dispatcher import LIMITS_REPORT_S
from relayr.execution.limiting import checks_for
from relayr.ledger.limits import RunKey
from relayr.observe import metrics
from relayr.runtime.allowlist_file import load_allowlist
from relayr.settings import Settings
from tests.dispatch.dispatch_harness import FAIR_OFF, RULES, TENANT, WORKSPACE, Ping, opened

GATE = {"limit": "limits.gate", "kind": "runs_in_flight"}


def gauge(name: str) -> float | None:
    return metrics.registry().get_sample_value(name, GATE)


async def test_the_limits_use_and_waiting_runs_are_gauges(
    database_url: str, tmp_path: Path
) -> None:
    allowlist = tmp_path / "allowlist.toml"
    allowlist.write_text('[limits.gate]\nrules = ["dispatch:ping"]\nruns_in_flight = 1\n')
    settings = Settings(
        home=tmp_path, database_url=database_url, allowlist=allowlist, fair_messages=FAIR_OFF
    )
    async with opened(settings, RULES) as harness:
        await harness.publish(Ping(), Ping())
        _, run_ids = await harness.dispatch()
        store, now = harness.runtime.bridge.limits, harness.rules.clock()
        ref, allowlists = WorkspaceRef(TENANT, WORKSPACE), load_allowlist(allowlist)
        refused = []
        for run_id in sorted(run_ids):
            run = await harness.rules.storage.run(ref, run_id)
            assert run is not None
            key = RunKey(TENANT, WORKSPACE, run_id)
            checks = checks_for(allowlists, ref, run)
            refused.append(
                await store.admit(key, checks, now=now, lease_until=now + timedelta(hours=1))
            )
        assert [refusal is None for refusal in refused] == [True, False]

        await harness.dispatcher.report_limits()
        assert (gauge("relayr_limit_used"), gauge("relayr_limit_waiting")) == (1.0, 1.0)

        await store.release(RunKey(TENANT, WORKSPACE, sorted(run_ids)[0]))
        await harness.dispatcher.report_limits()  # too soon: not read again
        assert gauge("relayr_limit_used") == 1.0
        harness.clock.now += LIMITS_REPORT_S
        await harness.dispatcher.report_limits()
        assert gauge("relayr_limit_used") == 0.0
