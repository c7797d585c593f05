"""deploy/ read as the tools that run it read it, for the tests of deploy/: the Dockerfile's
instructions, compose's services, Kubernetes' documents and systemd's units, each parsed here
once so the tests agree on what the files say.
"""

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"
K8S = sorted((DEPLOY / "k8s").glob("*.yaml"))
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
ENV_EXAMPLE = DEPLOY / "systemd" / "relayr.env.example"


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


UNIT_INSTANCE = "9102"
"""The instance a template unit (``name@.service``) is read as: the dispatcher's metrics port."""


def unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A systemd unit as {section: [(key, value), ...]}: keys may repeat. A template's ``%i``
    is read as :data:`UNIT_INSTANCE`."""
    sections: dict[str, list[tuple[str, str]]] = {}
    section = ""
    text = path.read_text()
    if path.name.endswith("@.service"):
        text = text.replace("%i", UNIT_INSTANCE)
    for raw in text.splitlines():
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
