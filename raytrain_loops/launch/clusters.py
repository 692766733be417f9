"""Checks for the cluster definitions in ``clusters/``: Ray's own schema and a security lint.

``problems(path)`` returns what is wrong with a Ray cluster-launcher YAML or a KubeRay manifest,
one sentence per problem naming the place; an empty list means the file passed.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import yaml

SECRET_PATTERNS = {
    "an AWS access key id": re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),
    "an AWS secret access key": re.compile(r"aws_secret_access_key\s*[:=]\s*\S+", re.I),
    "a private key": re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    "a service-account key": re.compile(r'"private_key"\s*:'),
    "a literal Ray token": re.compile(r"RAY_AUTH_TOKEN\s*[=:]\s*['\"]?[0-9a-f]{16,}", re.I),
}
PUBLIC = ("0.0.0.0/0", "::/0")


def ray_schema() -> dict[str, Any]:
    """Ray's cluster-config JSON schema, as shipped in the installed ray package."""
    import ray.autoscaler

    with open(os.path.join(os.path.dirname(ray.autoscaler.__file__), "ray-schema.json")) as f:
        return json.load(f)


def _secrets(text: str, where: str) -> list[str]:
    return [
        f"{where}: holds {what}; mount it or use a secret store"
        for what, rx in SECRET_PATTERNS.items()
        if rx.search(text)
    ]


def _public_ranges(text: str, where: str) -> list[str]:
    return [f"{where}: opens a port to {cidr}" for cidr in PUBLIC if cidr in text]


def launcher_problems(cfg: dict[str, Any], where: str) -> list[str]:
    """Schema errors and security problems of a Ray cluster-launcher config."""
    import jsonschema

    out = []
    try:
        jsonschema.validate(cfg, ray_schema())
    except jsonschema.ValidationError as err:
        path = ".".join(str(p) for p in err.absolute_path) or "(top level)"
        out.append(f"{where}: {path}: {err.message} (Ray's cluster-config schema)")
    starts = [("head_start_ray_commands", c) for c in cfg.get("head_start_ray_commands", [])]
    starts += [("worker_start_ray_commands", c) for c in cfg.get("worker_start_ray_commands", [])]
    for key, cmd in starts:
        if "ray start" in cmd and "RAY_AUTH_MODE=token" not in cmd:
            out.append(f"{where}: {key}: `{cmd}` starts Ray without RAY_AUTH_MODE=token")
        if re.search(r"--dashboard-host[= ](0\.0\.0\.0|::)", cmd):
            out.append(f"{where}: {key}: the dashboard listens on every interface; use --dashboard-host=127.0.0.1")
    if not any("ray start" in c for _, c in starts):
        out.append(f"{where}: no ray start commands, so token authentication cannot be checked")
    head = cfg.get("available_node_types", {}).get(cfg.get("head_node_type", ""), {})
    if head.get("resources", {}).get("CPU", None) != 0 or head.get("resources", {}).get("GPU", 0) != 0:
        out.append(f"{where}: the head node type must declare resources CPU: 0 and GPU: 0 (no training worker on it)")
    if not any(str(k).endswith(".ray/auth_token") for k in cfg.get("file_mounts", {})):
        out.append(f"{where}: file_mounts does not mount ~/.ray/auth_token onto the nodes")
    return out


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return spec.get("template", {}).get("spec", {}).get("containers", [])


def _token_env_problems(container: dict[str, Any], where: str) -> list[str]:
    env = {e.get("name"): e for e in container.get("env", [])}
    out = []
    if env.get("RAY_AUTH_MODE", {}).get("value") != "token":
        out.append(f"{where}: container {container.get('name')} lacks RAY_AUTH_MODE=token")
    token = env.get("RAY_AUTH_TOKEN", {})
    if "secretKeyRef" not in token.get("valueFrom", {}):
        out.append(f"{where}: container {container.get('name')} must take RAY_AUTH_TOKEN from a Secret")
    return out


def kuberay_problems(doc: dict[str, Any], where: str) -> list[str]:
    """Security problems of a KubeRay RayCluster or RayJob manifest."""
    out = []
    kind = doc.get("kind")
    spec = doc.get("spec", {})
    if kind == "RayCluster":
        head = spec.get("headGroupSpec", {})
        if head.get("serviceType", "ClusterIP") != "ClusterIP":
            out.append(
                f"{where}: head serviceType {head.get('serviceType')} exposes Ray's ports; use ClusterIP and port-forward"
            )
        if str(head.get("rayStartParams", {}).get("num-cpus")) != "0":
            out.append(f"{where}: the head must start with num-cpus '0' (no training worker on it)")
        groups = [("head", head)] + [(g.get("groupName"), g) for g in spec.get("workerGroupSpecs", [])]
        for name, group in groups:
            if group.get("rayStartParams", {}).get("dashboard-host") in ("0.0.0.0", "::"):
                out.append(f"{where}: group {name}: dashboard-host opens the dashboard on every interface")
            for c in _containers(group):
                out += _token_env_problems(c, f"{where}: group {name}")
            for c in _containers(group) if name != "head" else []:
                gpus = str(group.get("rayStartParams", {}).get("num-gpus", "0"))
                limit = str(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", "0"))
                if gpus != limit:
                    out.append(f"{where}: group {name}: num-gpus {gpus} but the container's GPU limit is {limit}")
    elif kind == "RayJob":
        for c in spec.get("submitterPodTemplate", {}).get("spec", {}).get("containers", []):
            out += _token_env_problems(c, f"{where}: submitter")
    else:
        out.append(f"{where}: unexpected kind {kind!r}")
    return out


def problems(path: str | Path) -> list[str]:
    """Everything wrong with one file of ``clusters/`` (an empty list: it passed)."""
    p = Path(path)
    text = p.read_text()
    out = _secrets(text, p.name) + _public_ranges(text, p.name)
    docs = [d for d in yaml.safe_load_all(text) if d]
    for i, doc in enumerate(docs):
        where = p.name if len(docs) == 1 else f"{p.name}[{i}]"
        if "apiVersion" in doc:
            out += kuberay_problems(doc, where)
        else:
            out += launcher_problems(doc, where)
    return out
