"""How deploy/ runs relayr: time to stop warm, replicas, probes, two dispatchers, not root.

The shutdown grace of every worker deployment (Kubernetes, compose, systemd) is checked against
the time limits it runs with; workers run in replicas with resources and both probes; two
dispatchers share the work (a systemd template runs one per instance); pods run as the image's
numeric non-root user, and units as relayr. Files only: no service runs.
"""

import shlex
from collections.abc import Sequence

from relayr.cli.helpers import DEFAULT_RESERVE
from relayr.settings import Settings
from tasks.worker import CLOSE_MARGIN_S
from tests.project.deploy_files import (
    DEPLOY,
    UNIT_INSTANCE,
    UNITS,
    compose,
    containers,
    deployments,
    dockerfile_instructions,
    relayr_services,
    unit_values,
)


def required_grace_s(settings: Settings, processes: int) -> float:
    """How long a worker's warm shutdown may take: see deploy/k8s/worker.yaml."""
    soft_shutdown_s = settings.turn_grace_s
    close_s = processes * (settings.turn_grace_s + CLOSE_MARGIN_S)
    return soft_shutdown_s + settings.time_limit_s + close_s


def processes_of(argv: Sequence[str]) -> int:
    """The pool processes a ``relayr worker`` command runs: ``--concurrency`` and
    ``--reserve``."""
    reserve = int(argv[argv.index("--reserve") + 1]) if "--reserve" in argv else DEFAULT_RESERVE
    return int(argv[argv.index("--concurrency") + 1]) + reserve


def test_workers_are_given_time_to_stop_warm() -> None:
    settings = Settings()
    worker = deployments()["relayr-worker"]
    args = containers(worker)[0]["args"]
    grace = worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > required_grace_s(settings, processes_of(args))
    service = relayr_services()["worker"]
    stop = service["stop_grace_period"]
    assert stop.endswith("s")
    assert float(stop[:-1]) > required_grace_s(settings, processes_of(service["command"]))
    path = DEPLOY / "systemd" / "relayr-worker.service"
    argv = shlex.split(unit_values(path, "Service", "ExecStart")[0])
    timeout = float(unit_values(path, "Service", "TimeoutStopSec")[0])
    assert timeout > required_grace_s(settings, processes_of(argv))
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


def test_two_dispatchers_share_the_work() -> None:
    """They share the workspaces by shard leases, so any number may run at once, and a rolling
    update keeps one deciding while the other restarts."""
    dispatcher = deployments()["relayr-dispatcher"]
    assert dispatcher["spec"]["replicas"] == 2
    assert dispatcher["spec"]["strategy"]["type"] == "RollingUpdate"
    assert dispatcher["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 1
    assert compose()["services"]["dispatcher"]["deploy"]["replicas"] == 2
    [template] = [path for path in UNITS if path.name.startswith("relayr-dispatcher")]
    assert template.name == "relayr-dispatcher@.service"
    text = template.read_text()
    assert "relayr-dispatcher@9102 relayr-dispatcher@9103" in text  # how to enable two
    argv = shlex.split(unit_values(template, "Service", "ExecStart")[0])
    assert argv[argv.index("--metrics-port") + 1] == UNIT_INSTANCE
    assert unit_values(template, "Service", "WorkingDirectory")[0].endswith(UNIT_INSTANCE)


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
