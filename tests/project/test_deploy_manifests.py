"""deploy/'s manifests parse, and their tools accept them: compose, Kubernetes, systemd.

Every Kubernetes document is of a known kind and version, every unit has its sections (and
``systemd-analyze verify`` accepts it where it is installed), and compose's Redis keeps its
messages while every service has a health check, disabled only where nothing can probe.
Files only: no service runs.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.project.deploy_files import (
    COMPOSE,
    DOCKERFILE,
    K8S,
    UNIT_INSTANCE,
    UNITS,
    compose,
    k8s_documents,
    unit,
)

UNPROBED = {"otel-collector", "jaeger"}
"""Compose services whose images have no program to probe themselves with, and that relayr never
waits for (a span it cannot export is dropped): their health check is disabled, on purpose."""


def test_compose_redis_keeps_messages_and_every_service_is_checked() -> None:
    services = compose()["services"]
    redis = " ".join(services["redis"]["command"])
    assert "--appendonly yes" in redis
    assert "--maxmemory-policy noeviction" in redis
    assert {"redis", "postgres", "dispatcher", "worker", "flower"} <= set(services)
    assert services["worker"]["deploy"]["replicas"] == 2
    for name, service in services.items():
        assert "healthcheck" in service, f"compose {name} has no health check"
        assert service["healthcheck"].get("disable", False) == (name in UNPROBED), name
    assert "--broker=redis://redis:6379/0" in services["flower"]["command"]


def test_every_manifest_parses() -> None:
    assert DOCKERFILE.is_file()
    assert COMPOSE.is_file()
    assert K8S
    assert UNITS
    kinds = sorted(document["kind"] for _, document in k8s_documents())
    assert kinds == ["ConfigMap", "Deployment", "Deployment", "Deployment", "Service"]
    for path, document in k8s_documents():
        assert document["apiVersion"] in {"v1", "apps/v1"}, path.name
        assert document["metadata"]["labels"]["app.kubernetes.io/name"] == "relayr"
    for path in UNITS:
        sections = unit(path)
        assert set(sections) == {"Unit", "Service", "Install"}, path.name


@pytest.mark.process
def test_systemd_accepts_the_units(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    relayr = shutil.which("relayr", path=str(Path(sys.executable).parent))
    assert relayr is not None
    for path in UNITS:
        copy = tmp_path / path.name.replace("@.", f"@{UNIT_INSTANCE}.")
        copy.write_text(path.read_text().replace("/opt/relayr/bin/relayr", relayr))
        done = subprocess.run(
            [analyze, "verify", str(copy)], capture_output=True, text=True, check=False
        )
        # it warns (unknown keys, bad values) on stderr and still exits 0
        assert done.returncode == 0, done.stderr
        assert not done.stderr.strip(), done.stderr
