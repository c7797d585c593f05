"""deploy/'s allowlist: valid, reloaded live from its folder, never promised a reload on a signal.

Nothing reloads the allowlist on a signal (a worker watches its file), so no file an operator
reads promises one, and no module of relayr or tasks handles SIGHUP. Kubernetes' ConfigMap holds
the example's allowlist, parses, and is mounted as a folder (a subPath mount is never updated).
Files only: no service runs.
"""

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from relayr.core.allowlist_toml import parse_allowlist
from tests.project.deploy_files import (
    DEPLOY,
    REPO,
    UNITS,
    containers,
    deployments,
    k8s_documents,
    unit_values,
)

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
