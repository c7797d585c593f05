"""The console's deploy entries: reachable only where the ADR says, probed where it listens.

``tests/project/test_deploy_commands.py`` parses every command (``relayr console ...`` included)
with the click group, ``tests/project/test_deploy_settings.py`` every variable with the settings;
this adds what is the console's own (ADR-0070): compose publishes it on the host's loopback only,
Kubernetes behind a ClusterIP Service, both keep its check of host names (no ``--allowed-host '*'``:
bound to every address of a container it still answers no other site's name), both probe the port it
listens on, and its token comes from outside the files (an optional Secret, the operator's
environment), so a deployment without it is read-only.
"""

from itertools import pairwise
from typing import Any

from tests.project.deploy_files import compose, containers, deployments, k8s_documents


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def answers_every_name(argv: list[str]) -> bool:
    """Whether ``--allowed-host '*'`` turns off the console's check of host names."""
    return any(a == "--allowed-host" and b.strip() == "*" for a, b in pairwise(argv))


def test_compose_publishes_the_console_on_loopback_and_probes_its_port() -> None:
    console = compose()["services"]["console"]
    port = option(console["command"], "--port")
    assert option(console["command"], "--host") == "0.0.0.0"  # inside its container
    assert not answers_every_name(console["command"])  # no DNS rebinding through the host
    assert console["ports"] == [f"127.0.0.1:{port}:{port}"]
    assert console["healthcheck"]["test"] == ["CMD", "relayr", "console", "--probe", "--port", port]
    assert console["environment"]["RELAYR_CONSOLE_TOKEN"] == "${RELAYR_CONSOLE_TOKEN:-}"


def test_kubernetes_serves_the_console_in_the_cluster_only() -> None:
    deployment = deployments()["relayr-console"]
    [container] = containers(deployment)
    port = option(container["args"], "--port")
    assert not answers_every_name(container["args"])
    [named] = [p for p in container["ports"] if p["name"] == "http"]
    assert str(named["containerPort"]) == port
    for probe in ("startupProbe", "livenessProbe"):
        assert container[probe]["exec"]["command"] == [
            "relayr",
            "console",
            "--probe",
            "--port",
            port,
        ]
    [token] = [v for v in container["env"] if v["name"] == "RELAYR_CONSOLE_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"]["optional"] is True  # without it: read-only
    services: list[dict[str, Any]] = [d for _, d in k8s_documents() if d["kind"] == "Service"]
    [service] = services
    assert service["metadata"]["name"] == "relayr-console"
    assert service["spec"]["type"] == "ClusterIP"
    pods = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pods.items()
    [exposed] = service["spec"]["ports"]
    assert exposed["targetPort"] == "http"
