"""deploy/'s environments: each variable given to relayr is a setting; together, valid settings.

Each variable given to a relayr process (the image's ENV, compose's environment, Kubernetes'
env and Secrets, systemd's environment file and Environment lines) must be a ``RELAYR_*`` name
that :class:`relayr.settings.Settings` knows, and together they must make valid settings: the
URLs come from Secrets in Kubernetes, compose mounts the allowlist's folder read-only, and
compose sends every relayr process's traces through the collector. Files only: no service runs.
"""

import re
import shlex
from collections.abc import Mapping
from pathlib import Path

import yaml

from relayr.settings import PREFIX, STANDARD_VARIABLES, Settings
from tests.project.deploy_files import (
    COMPOSE,
    DEPLOY,
    DOCKERFILE,
    ENV_EXAMPLE,
    K8S,
    REPO,
    UNITS,
    compose,
    containers,
    deployments,
    dockerfile_instructions,
    relayr_services,
    unit_values,
)

SETTINGS_VARIABLES = frozenset(
    STANDARD_VARIABLES.get(name, PREFIX + name.upper()) for name in Settings.model_fields
)
"""Every variable relayr reads: one per settings field (OpenTelemetry's standard names for
the endpoint and the service's name)."""


PYTHON_VARIABLES = frozenset({"PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE"})
"""Python's own variables, which the image may set for every process."""

SECRET_SAMPLES = {
    "RELAYR_BROKER_URL": "redis://:secret@redis:6379/0",
    "RELAYR_DATABASE_URL": "postgresql+asyncpg://relayr:secret@postgres:5432/relayr",
    "RELAYR_CONSOLE_TOKEN": "a-console-token-of-32-characters",
}
"""Values standing in for the Secret's, to check the settings a pod would start with."""

SECRETS = {
    "RELAYR_BROKER_URL": "relayr-urls",
    "RELAYR_DATABASE_URL": "relayr-urls",
    "RELAYR_CONSOLE_TOKEN": "relayr-console",
}
"""The Secret each secret variable comes from: the URLs', and the console's token (ADR-0070)."""


def dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, arguments in dockerfile_instructions():
        if keyword == "ENV":
            for pair in shlex.split(arguments):
                name, _, value = pair.partition("=")
                env[name] = value
    return env


def env_file(path: Path) -> tuple[dict[str, str], set[str]]:
    """An environment file's assignments, and the names its commented examples show."""
    assignments: dict[str, str] = {}
    examples: set[str] = set()
    for line in path.read_text().splitlines():
        if match := re.fullmatch(r"#?([A-Z][A-Z0-9_]*)=(.*)", line.strip()):
            if line.startswith("#"):
                examples.add(match[1])
            else:
                assignments[match[1]] = match[2]
    return assignments, examples


def assert_relayr_environment(where: str, environment: Mapping[str, str]) -> Settings:
    unknown = {
        name
        for name in environment
        if name not in SETTINGS_VARIABLES and name not in PYTHON_VARIABLES
    }
    assert not unknown, f"{where} sets variables relayr does not read: {sorted(unknown)}"
    return Settings.from_env({k: v for k, v in environment.items() if k in SETTINGS_VARIABLES})


def test_the_settings_know_every_variable_the_files_name() -> None:
    assert "RELAYR_BROKER_URL" in SETTINGS_VARIABLES
    text = "\n".join(path.read_text() for path in [DOCKERFILE, COMPOSE, *K8S, *UNITS, ENV_EXAMPLE])
    named = set(re.findall(r"\bRELAYR_[A-Z0-9_]+\b", text))
    assert named, "no RELAYR_* variable found"
    assert named <= SETTINGS_VARIABLES, sorted(named - SETTINGS_VARIABLES)


def test_the_image_sets_only_relayr_settings() -> None:
    environment = dockerfile_env()
    settings = assert_relayr_environment("Dockerfile", environment)
    assert settings.allowlist == Path("/etc/relayr/allowlist.toml")
    assert settings.log_format == "json"


def test_compose_services_start_with_valid_settings() -> None:
    image = dockerfile_env()
    for name, service in relayr_services().items():
        environment = {**image, **service["environment"]}
        settings = assert_relayr_environment(f"compose {name}", environment)
        assert settings.broker_url.startswith("redis://")
        assert settings.database_url.startswith("postgresql+asyncpg://")
        mounts = [volume.split(":") for volume in service["volumes"]]
        assert [str(settings.allowlist.parent)] in [m[1:2] for m in mounts], name
        for source, _, *mode in mounts:
            assert (COMPOSE.parent / source).resolve().is_dir(), f"{name} mounts {source}"
            assert mode == ["ro"], name
        assert (REPO / "rules" / settings.allowlist.name).is_file()


def test_k8s_pods_start_with_valid_settings_and_secret_urls() -> None:
    image = dockerfile_env()
    for name, deployment in deployments().items():
        for container in containers(deployment):
            environment = dict(image)
            for variable in container["env"]:
                if "valueFrom" in variable:
                    reference = variable["valueFrom"]["secretKeyRef"]
                    assert reference["name"] == SECRETS[variable["name"]], name
                    environment[variable["name"]] = SECRET_SAMPLES[variable["name"]]
                else:
                    environment[variable["name"]] = variable["value"]
            assert_relayr_environment(f"k8s {name}", environment)
            secret = {v["name"] for v in container["env"] if "valueFrom" in v}
            urls = secret - {"RELAYR_CONSOLE_TOKEN"}
            assert urls == {"RELAYR_BROKER_URL", "RELAYR_DATABASE_URL"}, name
            assert ("RELAYR_CONSOLE_TOKEN" in secret) == (name == "relayr-console"), name


def test_systemd_units_read_a_valid_environment_file() -> None:
    assignments, examples = env_file(ENV_EXAMPLE)
    assert examples <= SETTINGS_VARIABLES, sorted(examples - SETTINGS_VARIABLES)
    for path in UNITS:
        assert unit_values(path, "Service", "EnvironmentFile") == ["/etc/relayr/relayr.env"]
        environment = dict(assignments)
        for line in unit_values(path, "Service", "Environment"):
            name, _, value = line.partition("=")
            environment[name] = value
        settings = assert_relayr_environment(path.name, environment)
        assert settings.home == Path(unit_values(path, "Service", "WorkingDirectory")[0])


def test_compose_traces_every_relayr_process_through_the_collector() -> None:
    services = compose()["services"]
    for name, service in relayr_services().items():
        settings = assert_relayr_environment(f"compose {name}", service["environment"])
        assert settings.tracing, name
        assert settings.otlp_endpoint == "http://otel-collector:4318", name
    config = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    [mount] = services["otel-collector"]["volumes"]
    source, target, mode = mount.split(":")
    assert (COMPOSE.parent / source).resolve() == DEPLOY / "otel-collector.yaml"
    assert services["otel-collector"]["command"] == [f"--config={target}"]
    assert mode == "ro"
    assert config["receivers"]["otlp"]["protocols"]["http"]["endpoint"] == "0.0.0.0:4318"
    traces = config["service"]["pipelines"]["traces"]
    assert traces["receivers"] == ["otlp"]
    [exporter] = traces["exporters"]
    assert config["exporters"][exporter]["endpoint"] == "jaeger:4317"
    assert "127.0.0.1:16686:16686" in services["jaeger"]["ports"]
