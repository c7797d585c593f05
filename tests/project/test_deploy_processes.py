"""How deploy/ runs relayr: time to stop warm, replicas, probes, one dispatcher, not root.

The shutdown grace of every worker deployment (Kubernetes, compose, systemd) is checked against
the time limits it runs with; workers run in replicas with resources and both probes; one
dispatcher runs at a time; pods run as the image's numeric non-root user, and units as relayr.
Files only: no service runs.
"""

import shlex
from collections.abc import Sequence

from relayr.settings import Settings
from tasks.worker import CLOSE_MARGIN_S
from tests.deploy_files import (
    DEPLOY,
    UNITS,
    compose,
    containers,
    deployments,
    dockerfile_instructions,
    relayr_services,
    unit_values,
)


def required_grace_s(settings: Settings, concurrency: int) -> float:
    """How long a worker's warm shutdown may take: see deploy/k8s/worker.yaml."""
    soft_shutdown_s = settings.turn_grace_s
    close_s = concurrency * (settings.turn_grace_s + CLOSE_MARGIN_S)
    return soft_shutdown_s + settings.time_limit_s + close_s


def concurrency_of(argv: Sequence[str]) -> int:
    return int(argv[argv.index("--concurrency") + 1])


def test_workers_are_given_time_to_stop_warm() -> None:
    settings = Settings()
    worker = deployments()["relayr-worker"]
    args = containers(worker)[0]["args"]
    grace = worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > required_grace_s(settings, concurrency_of(args))
    service = relayr_services()["worker"]
    stop = service["stop_grace_period"]
    assert stop.endswith("s")
    assert float(stop[:-1]) > required_grace_s(settings, concurrency_of(service["command"]))
    path = DEPLOY / "systemd" / "relayr-worker.service"
    argv = shlex.split(unit_values(path, "Service", "ExecStart")[0])
    timeout = float(unit_values(path, "Service", "TimeoutStopSec")[0])
    assert timeout > required_grace_s(settings, concurrency_of(argv))
    assert unit_values(path, "Service", "KillMode") == ["mixed"]


def test_workers_have_replicas_resources_and_both_probes() -> None:
    worker = deployments()["relayr-worker"]
    assert worker["spec"]["replicas"] >= 2
    for container in containers(worker):
        assert {"requests", "limits"} <= set(container["resources"])
        assert "memory" in container["resources"]["limits"]
        for probe in ("livenessProbe", "readinessProbe"):
            assert container[probe]["exec"]["command"][:3] == ["relayr", "health", "--worker"]
            # the command itself bounds its checks within the probe's timeout
            assert container[probe]["timeoutSeconds"] >= 5
        assert container["readinessProbe"]["periodSeconds"] == 10


def test_one_dispatcher_at_a_time() -> None:
    dispatcher = deployments()["relayr-dispatcher"]
    assert dispatcher["spec"]["replicas"] == 1
    assert dispatcher["spec"]["strategy"] == {"type": "Recreate"}
    assert compose()["services"]["dispatcher"].get("deploy", {}).get("replicas", 1) == 1


def test_pods_run_as_the_images_non_root_user() -> None:
    user = dict(dockerfile_instructions())["USER"]
    uid = user.partition(":")[0]
    assert uid.isdigit(), "a numeric USER lets runAsNonRoot verify it"
    assert int(uid) > 0
    for name, deployment in deployments().items():
        context = deployment["spec"]["template"]["spec"]["securityContext"]
        assert context["runAsNonRoot"] is True, name
        assert context["runAsUser"] == int(uid), name
        for container in containers(deployment):
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
    for path in UNITS:
        assert unit_values(path, "Service", "User") == ["relayr"]
