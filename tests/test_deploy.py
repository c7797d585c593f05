"""deploy/: every manifest and unit parses, runs real ``relayr`` commands, sets real settings.

Each command a manifest runs (the image's entry point and command, compose's commands and health
checks, Kubernetes' container args and probes, systemd's ExecStart) is parsed by the ``relayr``
click group itself, so an unknown command or option, or a bad value, fails here rather than in
a rollout. Each variable given to a relayr process must be a ``RELAYR_*`` name that
:class:`relayr.settings.Settings` knows, and together they must make valid settings. The
shutdown grace of every worker deployment is checked against the time limits it runs with.
The image's recipe is replayed in a fresh virtualenv (no container engine runs here).
"""

import ast
import re
import shlex
import shutil
import subprocess
import sys
import venv
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import click
import pytest
import yaml

from relayr.core.allowlist_toml import parse_allowlist
from relayr.settings import PREFIX, STANDARD_VARIABLES, Settings
from tasks.worker import CLOSE_MARGIN_S

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"
K8S = sorted((DEPLOY / "k8s").glob("*.yaml"))
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
ENV_EXAMPLE = DEPLOY / "systemd" / "relayr.env.example"

SETTINGS_VARIABLES = frozenset(
    STANDARD_VARIABLES.get(name, PREFIX + name.upper()) for name in Settings.model_fields
)
"""Every variable relayr reads: one per settings field (OpenTelemetry's standard names for
the endpoint and the service's name)."""

UNPROBED = {"otel-collector", "jaeger"}
"""Compose services whose images have no program to probe themselves with, and that relayr never
waits for (a span it cannot export is dropped): their health check is disabled, on purpose."""

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


# ─── reading the files ──────────────────────────────────────────────────────


@dataclass(frozen=True)
class Invocation:
    """One command line a deployment runs, and where it comes from."""

    where: str
    argv: tuple[str, ...]


def dockerfile_instructions() -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (INSTRUCTION, arguments), continuations joined."""
    instructions = []
    current = ""
    for line in DOCKERFILE.read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            keyword, _, arguments = current.strip().partition(" ")
            instructions.append((keyword.upper(), arguments.strip()))
            current = ""
    return instructions


def exec_form(arguments: str) -> list[str]:
    """An instruction's JSON exec form (``["relayr", ...]``), which a relayr image must use."""
    parsed = yaml.safe_load(arguments)
    assert isinstance(parsed, list), f"{arguments!r} is not in exec form"
    return [str(item) for item in parsed]


def dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, arguments in dockerfile_instructions():
        if keyword == "ENV":
            for pair in shlex.split(arguments):
                name, _, value = pair.partition("=")
                env[name] = value
    return env


def compose() -> dict[str, Any]:
    loaded = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(loaded, dict)
    return loaded


def relayr_services() -> dict[str, dict[str, Any]]:
    """Compose services running the relayr image (its entry point is ``relayr``)."""
    return {
        name: service
        for name, service in compose()["services"].items()
        if service.get("image", "").startswith("relayr:")
    }


def k8s_documents() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in K8S:
        for document in yaml.safe_load_all(path.read_text()):
            if document is not None:
                yield path, document


def deployments() -> dict[str, dict[str, Any]]:
    return {
        document["metadata"]["name"]: document
        for _, document in k8s_documents()
        if document["kind"] == "Deployment"
    }


def containers(deployment: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list(deployment["spec"]["template"]["spec"]["containers"])


def unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A systemd unit as {section: [(key, value), ...]}: keys may repeat."""
    sections: dict[str, list[tuple[str, str]]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            sections[section] = []
            continue
        key, equals, value = line.partition("=")
        assert equals, f"{path.name}: {raw!r} is not a key=value"
        assert section, f"{path.name}: {raw!r} is outside a section"
        sections[section].append((key.strip(), value.strip()))
    return sections


def unit_values(path: Path, section: str, key: str) -> list[str]:
    return [value for found, value in unit(path)[section] if found == key]


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


def invocations() -> list[Invocation]:
    """Every relayr command line in deploy/."""
    found: list[Invocation] = []
    instructions = dict(dockerfile_instructions())
    entrypoint = exec_form(instructions["ENTRYPOINT"])
    found.append(Invocation("Dockerfile CMD", (*entrypoint, *exec_form(instructions["CMD"]))))
    for name, service in relayr_services().items():
        found.append(Invocation(f"compose {name}", ("relayr", *service["command"])))
        test = service["healthcheck"]["test"]
        assert test[0] == "CMD", f"compose {name}: use the exec form for the health check"
        found.append(Invocation(f"compose {name} healthcheck", tuple(test[1:])))
    for name, deployment in deployments().items():
        for container in containers(deployment):
            assert "command" not in container, f"{name}: keep the image's entry point"
            found.append(Invocation(f"k8s {name}", ("relayr", *container["args"])))
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                if probe in container:
                    command = container[probe]["exec"]["command"]
                    found.append(Invocation(f"k8s {name} {probe}", tuple(command)))
    for path in UNITS:
        for line in unit_values(path, "Service", "ExecStart"):
            found.append(Invocation(f"systemd {path.name}", tuple(shlex.split(line))))
    return found


# ─── commands ───────────────────────────────────────────────────────────────


def relayr_group() -> click.Group:
    from relayr.cli import cli

    return cli


def parse_command(argv: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """Parse a relayr command line with the click group itself; return its path and params.

    Raises:
        click.UsageError: For an unknown command or option, or a bad value.
    """
    assert Path(argv[0]).name == "relayr", f"{argv} does not run relayr"
    command: click.Command = relayr_group()
    path = ["relayr"]
    rest = list(argv[1:])
    while isinstance(command, click.Group):
        assert rest, f"{argv}: no command given"
        name = rest.pop(0)
        sub = command.get_command(click.Context(command), name)
        if sub is None:
            raise click.UsageError(f"no such command {name!r} under {' '.join(path)}")
        command = sub
        path.append(name)
    context = command.make_context(" ".join(path), rest)
    return " ".join(path[1:]), dict(context.params)


ALL = invocations()


def test_deploy_runs_relayr_everywhere() -> None:
    sources = {invocation.where.split()[0] for invocation in ALL}
    assert sources == {"Dockerfile", "compose", "k8s", "systemd"}
    commands = {invocation.argv[1] for invocation in ALL}
    assert commands == {"worker", "dispatch", "health", "console"}


@pytest.mark.parametrize("invocation", ALL, ids=[invocation.where for invocation in ALL])
def test_every_command_is_a_real_relayr_command(invocation: Invocation) -> None:
    parse_command(invocation.argv)


def test_an_unknown_option_is_caught() -> None:
    with pytest.raises(click.UsageError, match="--no-such-option"):
        parse_command(("relayr", "worker", "--no-such-option"))
    with pytest.raises(click.UsageError, match="no such command 'wroker'"):
        parse_command(("relayr", "wroker"))
    with pytest.raises(click.BadParameter):
        parse_command(("relayr", "worker", "--concurrency", "0"))


def test_probes_check_the_role_they_run_in() -> None:
    for invocation in ALL:
        if "health" not in invocation.argv:
            continue
        where = invocation.where
        role = "--dispatcher" if "dispatcher" in where else "--worker"
        assert role in invocation.argv, where
        liveness = "livenessProbe" in where or "startupProbe" in where
        # a liveness probe that needed Redis would restart every worker during an outage
        assert ("--liveness" in invocation.argv) == liveness, where


# ─── settings ───────────────────────────────────────────────────────────────


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


# ─── shutdown grace, probes, one dispatcher ─────────────────────────────────


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


HANGUP: Final = re.compile(r"\b(?:SIG)?HUP\b|\bkill\s+-1\b|\bExecReload\b", re.IGNORECASE)
"""A hangup signal in any wording: its names, ``kill -1``, a systemd unit's reload command."""

RELOAD: Final = re.compile(r"reload", re.IGNORECASE)

CLAUSE_END: Final = re.compile(r"[.:;!?]\s")


def operator_texts() -> list[Path]:
    """What an operator reads: the deployment's files, the example's rules (their allowlist
    and modules), the README and the operations guides; not the ADRs, which record, among
    others, the promises that were wrong."""
    files = [*DEPLOY.rglob("*"), *(REPO / "rules").rglob("*"), REPO / "README.md"]
    files += (REPO / "docs").glob("*.md")
    return sorted(path for path in files if path.is_file() and "__pycache__" not in path.parts)


def clauses(text: str) -> Iterator[str]:
    """``text``'s clauses, across line breaks and comment markers (``#``, ``//``, ``*``)."""
    lines = (re.sub(r"^\s*(?:#+|//|\*)?\s*", "", line) for line in text.splitlines())
    yield from CLAUSE_END.split(" ".join(lines) + " ")


def test_no_shipped_file_promises_a_reload_on_a_signal() -> None:
    """Nothing reloads the allowlist on a signal (a worker watches its file), and a Celery
    worker's main process takes SIGHUP as a restart: an operator told to send it one to apply
    a change would restart every worker instead. So no clause of what an operator reads names
    a hangup signal together with a reload, in any wording; no systemd unit declares a reload
    command; the allowlist's file and its ConfigMap say to send no signal; and no module of
    relayr or tasks names SIGHUP in its code (a handler would have to)."""
    promises = [
        f"{path.relative_to(REPO)}: {clause.strip()}"
        for path in operator_texts()
        for clause in clauses(path.read_text(errors="replace"))
        if HANGUP.search(clause) and RELOAD.search(clause)
    ]
    assert promises == []
    for path in UNITS:
        assert unit_values(path, "Service", "ExecReload") == [], path
    for path in (REPO / "rules" / "allowlist.toml", DEPLOY / "k8s" / "allowlist-configmap.yaml"):
        assert "takes SIGHUP as a restart, so send it none" in " ".join(clauses(path.read_text()))
    handlers = [
        f"{path.relative_to(REPO)}:{node.lineno}"
        for path in sorted([*(REPO / "relayr").rglob("*.py"), *(REPO / "tasks").rglob("*.py")])
        for node in ast.walk(ast.parse(path.read_text()))
        if (isinstance(node, ast.Attribute) and node.attr == "SIGHUP")
        or (isinstance(node, ast.Name) and node.id == "SIGHUP")
    ]
    assert handlers == []


def test_the_allowlist_configmap_is_valid_and_reloads_live() -> None:
    (configmap,) = [document for _, document in k8s_documents() if document["kind"] == "ConfigMap"]
    name = configmap["metadata"]["name"]
    for key, text in configmap["data"].items():
        parse_allowlist(text, source=f"configmap {name} {key}")
    assert configmap["data"]["allowlist.toml"] == (REPO / "rules" / "allowlist.toml").read_text()
    for deployment_name, deployment in deployments().items():
        volumes = {
            volume["name"]: volume for volume in deployment["spec"]["template"]["spec"]["volumes"]
        }
        for container in containers(deployment):
            allowlist = next(
                v["value"] for v in container["env"] if v["name"] == "RELAYR_ALLOWLIST"
            )
            (mount,) = [
                mount
                for mount in container["volumeMounts"]
                if volumes[mount["name"]].get("configMap", {}).get("name") == name
            ]
            # a subPath mount is never updated: the folder must be mounted
            assert "subPath" not in mount, deployment_name
            assert Path(allowlist) == Path(mount["mountPath"]) / "allowlist.toml"


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


def test_systemd_accepts_the_units(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    relayr = shutil.which("relayr", path=str(Path(sys.executable).parent))
    assert relayr is not None
    for path in UNITS:
        copy = tmp_path / path.name
        copy.write_text(path.read_text().replace("/opt/relayr/bin/relayr", relayr))
        done = subprocess.run(
            [analyze, "verify", str(copy)], capture_output=True, text=True, check=False
        )
        # it warns (unknown keys, bad values) on stderr and still exits 0
        assert done.returncode == 0, done.stderr
        assert not done.stderr.strip(), done.stderr


# ─── the image's recipe, in a fresh virtualenv ──────────────────────────────


def copied_sources() -> list[str]:
    """What the Dockerfile copies from the build context (the repository's root)."""
    sources: list[str] = []
    for keyword, arguments in dockerfile_instructions():
        if keyword == "COPY":
            assert not arguments.startswith("--from"), "a single-stage recipe"
            *paths, _ = shlex.split(arguments)
            sources.extend(paths)
    return sources


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_image_recipe_installs_and_runs(tmp_path: Path) -> None:
    instructions = dockerfile_instructions()
    (base,) = [arguments for keyword, arguments in instructions if keyword == "FROM"]
    assert base == "python:3.12-slim"
    assert sys.version_info[:2] == (3, 12)
    context = tmp_path / "src"
    context.mkdir()
    for source in copied_sources():
        origin = REPO / source
        assert origin.exists(), f"the Dockerfile copies {source}, which is not in the repository"
        if origin.is_dir():
            shutil.copytree(
                origin, context / source, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )
        else:
            shutil.copy2(origin, context / source)
    (install,) = [
        arguments for keyword, arguments in instructions if keyword == "RUN" and "pip" in arguments
    ]
    pip_arguments = shlex.split(install.split("&&")[0])
    assert pip_arguments[:2] == ["pip", "install"]
    assert pip_arguments[-1] in (".", ".[otel]")
    environment = tmp_path / "venv"
    venv.create(environment, with_pip=True)
    python = environment / "bin" / "python"
    subprocess.run(
        [str(python), "-m", *pip_arguments[:-1], str(context) + pip_arguments[-1][1:]],
        check=True,
        capture_output=True,
        timeout=840,
    )
    entrypoint = exec_form(dict(instructions)["ENTRYPOINT"])
    assert entrypoint == ["relayr"]
    home = tmp_path / "home"
    home.mkdir()
    for argv in (["--help"], ["worker", "--help"], ["dispatch", "--help"]):
        done = subprocess.run(
            [str(environment / "bin" / entrypoint[0]), *argv],
            cwd=home,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert "Usage: relayr" in done.stdout


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
